"""Dropout on: a pipeline that recomputes each stage in backward gives exactly the results of
one that keeps its activations (same dropout masks, BatchNorm statistics updated once); with
`--autocast`, under bf16 autocast too (the recomputation, in backward(), casts as forward did).

    mpiexec -n 2 python tests/scripts/recompute_check.py [--autocast --schedule gpipe]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]
import case_batch  # noqa: E402
from model_zoo import make_case  # noqa: E402

import rannc  # noqa: E402
from rannc import dist as rdist  # noqa: E402


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--autocast", action="store_true", help="forward under bf16 autocast")
    p.add_argument("--schedule", default="auto")
    return p.parse_args(argv)


def run(a: argparse.Namespace, ctx: rdist.DistContext) -> None:
    case = make_case("bert", batch=6, seed=0)
    for m in case.model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.3
    case.model.bert.config.attention_probs_dropout_prob = 0.0  # sdpa's own dropout is not replayed
    lo = 3 * ctx.rank
    kw = {k: v[lo:lo + 3] for k, v in case.kwargs.items()}
    runs = {}
    # Both runs must use the same stages (a different cut draws dropout masks differently): the
    # "off" run saves its plan, and the "on" run loads it with every stage set to recompute.
    box = [tempfile.mktemp(suffix=".json", prefix="rannc_recompute_")]
    torch.distributed.broadcast_object_list(box, src=0)
    plan_file = Path(box[0])
    for mode in ("off", "on"):
        model = copy.deepcopy(case.model)
        if mode == "off":
            opts = dict(partition_num=2, microbatches=2, checkpointing="off", save_deployment=True,
                        schedule=a.schedule)
        else:
            if ctx.rank == 0:
                d = json.loads(plan_file.read_text())
                for st in d["stages"]:
                    st["recompute"] = True
                plan_file.write_text(json.dumps(d))
            rannc.barrier()
            opts = dict(load_deployment=True)
        wrapped = rannc.RaNNCModule(model, deployment_file=str(plan_file), **opts)
        torch.manual_seed(123)
        with torch.autocast("cpu", torch.bfloat16, enabled=a.autocast):
            out = wrapped(**kw)
        out.loss.backward()  # (outside autocast, as PyTorch's recipe has it)
        runs[mode] = (out.loss.detach(), {n: p.grad.clone() for n, p in wrapped.named_parameters()})
        assert wrapped.plan is not None and wrapped.plan.stages[0].recompute == (mode == "on")
    (l_on, g_on), (l_off, g_off) = runs["on"], runs["off"]
    torch.testing.assert_close(l_on, l_off, rtol=0, atol=0)
    for n in g_on:
        torch.testing.assert_close(g_on[n], g_off[n], rtol=1e-6, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")
    rannc.barrier()
    if ctx.rank == 0:
        plan_file.unlink()
    ref = copy.deepcopy(case.model)
    torch.manual_seed(123)
    assert ref(**case.kwargs).loss.item() != 0.0
    print(f"PASS rank {ctx.rank} loss {l_on.item():.6f} ({len(g_on)} gradients equal)", flush=True)


def main() -> None:
    case_batch.main(parse, run)


if __name__ == "__main__":
    main()
