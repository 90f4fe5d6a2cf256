"""What the estimate oracle predicts for BERT's stages on a GPU spec, device time alone and
with the host floor (`DeviceSpec.host_per_op`), on the 1-, 2- and 4-stage splits that
`gpu_study.py` measures on a GPU: the numbers to set beside that study's measured column.

    PYTHONPATH=. .venv/bin/python benchmarks/estimate_host.py                  # BERT-Large, bf16, H200
    PYTHONPATH=. .venv/bin/python benchmarks/estimate_host.py --smoke

Runs on a CPU: the model is captured under CPU autocast (the captured ops are those a CUDA
capture gives; autocast's casts are not ops of the graph on either) and priced on the named
table spec with the GPU's fused attention kernels.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_study import SMOKE_BERT, bert_args, bert_model, stage_of_components  # noqa: E402

from rannc.atomic.components import atomic_components  # noqa: E402
from rannc.config import Config  # noqa: E402
from rannc.graph.capture import capture  # noqa: E402
from rannc.planner import plan_graph  # noqa: E402
from rannc.profile.device import KNOWN_DEVICES, Cluster  # noqa: E402
from rannc.profile.estimate import GraphCosts  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bert_args(p)
    p.add_argument("--device", default="H200", choices=sorted(KNOWN_DEVICES))
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--smoke", action="store_true", help="gpu_study's smoke BERT (2 x 64)")
    a = p.parse_args(argv)
    if a.smoke:
        vars(a).update(SMOKE_BERT)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    _cfg, model, batch = bert_model(a.layers, a.hidden, a.seq, a.batch, torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16) if a.dtype == "bf16" else nullcontext():
        cap = capture(model, (), batch)
    atomic = atomic_components(cap.graph)
    costs = GraphCosts.of(cap.graph, atomic, fused=True)
    spec = KNOWN_DEVICES[a.device]
    device_only = dataclasses.replace(spec, host_per_op=0.0)
    ops = int(costs.is_kernel.sum())
    grad_ops = int((costs.is_kernel & costs.has_grad).sum())
    print(f"BERT L{a.layers} H{a.hidden}, batch {a.batch} x {a.seq}, {a.dtype}; {a.device} spec, "
          f"host {spec.host_per_op * 1e6:.0f} us an op; {ops} forward ops, {grad_ops} "
          "differentiable (one microbatch's forward and backward: "
          f"{(ops + 2 * grad_ops) * spec.host_per_op * 1e3:.2f} ms of host time)")
    print("| stages | stage | device ms | with the host floor ms |")
    print("|---|---|---|---|")
    for n in a.stages:
        c = Config(partition_num=n, replicas=[1] * n, microbatches=1, checkpointing="off",
                   schedule="gpipe", opt_param_factor=2.0)
        plan = plan_graph(cap.graph, atomic, Cluster.homogeneous(spec, n=n, per_node=n), c,
                          batch_size=a.batch, costs=costs)
        stage_of = stage_of_components(plan, len(atomic.components))
        dev = costs.block_profile(device_only, stage_of, [a.batch])
        host = costs.block_profile(spec, stage_of, [a.batch])
        for s in range(n):
            print(f"| {n} | {s} | {1e3 * (dev.fwd[s, 0] + dev.bwd[s, 0]):.2f} | "
                  f"{1e3 * (host.fwd[s, 0] + host.bwd[s, 0]):.2f} |")


if __name__ == "__main__":
    main()
