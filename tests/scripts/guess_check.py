"""A call run on the last call's row layout before the ranks agree on it, when the guess is
wrong, of models that write buffers in forward (the `writes` model's running mean and counter,
ResNet's BatchNorm statistics and counters): 2 stages on 2 ranks, one microbatch, so the
pipeline equals the unwrapped model on the global batch. Rank 0's rows stay the same from call
to call while rank 1 passes 0 rows and then 1: rank 0 then runs its stage on the old layout
without receiving anything, writing its buffers, before the agreement says the layout changed;
the call then runs again. After every call, every buffer rank 0's stage writes, the outputs,
the gradients and the parameters after SGD steps must equal the unwrapped model's (fp32,
rtol 1e-5). Prints "PASS <model> rank R guessed G rerun X"."""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]

import torch  # noqa: E402
from model_zoo import make_case  # noqa: E402

import rannc  # noqa: E402
from rannc import dist as rdist  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="writes,resnet")
    a = p.parse_args()
    rdist.init_process_group(timeout_s=300)
    rank = rdist.get_rank()
    # (global rows, rank 0's rows): the same 6 rows on rank 0 from the second call on
    calls = [(6, 3), (6, 6), (6, 6), (7, 6), (7, 6), (6, 6)]
    for name in a.model.split(","):
        case = make_case(name, batch=7, seed=0)
        ref = copy.deepcopy(case.model)
        model = rannc.RaNNCModule(case.model, None, partition_num=2, microbatches=1,
                                  schedule="gpipe", batchnorm="local")
        opt_w = torch.optim.SGD(case.model.parameters(), lr=0.01)
        opt_r = torch.optim.SGD(ref.parameters(), lr=0.01)
        for step, (n, first) in enumerate(calls):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(n, *case.args[0].shape[1:], generator=g)
            lo, hi = (0, first) if rank == 0 else (first, n)
            out, ref_out = model(x[lo:hi]), ref(x)
            torch.testing.assert_close(out, ref_out[lo:hi], rtol=RTOL, atol=ATOL)
            # each rank's share of the global mean, times the world size: the gradients are the
            # average over the ranks (DDP's), so they are the global mean's
            loss = out.pow(2).sum() * rdist.get_world_size() / ref_out.numel()
            loss.backward()
            ref_out.pow(2).mean().backward()
            held = {k for k, q in case.model.named_parameters() if q.grad is not None}
            for k, q in ref.named_parameters():
                if k in held:
                    mine = dict(case.model.named_parameters())[k]
                    torch.testing.assert_close(mine.grad, q.grad, rtol=RTOL, atol=ATOL,
                                               msg=lambda m, k=k, s=step: f"step {s} grad {k}: {m}")
            opt_w.step()
            opt_r.step()
            opt_w.zero_grad()
            opt_r.zero_grad()
            rt = next(iter(model._runtimes.values()))
            mine_b = dict(case.model.named_buffers())
            if name == "writes_no_grad" and rank == 0:  # (its buffers: rank 0's stage)
                assert sorted(rt._written) == ["calls", "ema"], rt._written
            for k in rt._written:
                torch.testing.assert_close(mine_b[k], dict(ref.named_buffers())[k], rtol=RTOL,
                                           atol=ATOL, msg=lambda m, k=k, s=step: f"step {s} buffer {k}: {m}")
        # BatchNorm's running statistics (written once per call, after the agreement): those
        # of the modules whose counters this rank's stage writes
        mods = {k.rsplit(".", 1)[0] for k in rt._written}
        mine_b = dict(case.model.named_buffers())
        for k, b in ref.named_buffers():
            if k.rsplit(".", 1)[0] in mods:
                torch.testing.assert_close(mine_b[k], b, rtol=RTOL, atol=ATOL, msg=k)
        rts = list(model._runtimes.values())
        print(f"PASS {name} rank {rank} guessed {sum(r.guessed_calls for r in rts)} "
              f"rerun {sum(r.rerun_calls for r in rts)} written {len(rt._written)}", flush=True)
    rdist.shutdown()


if __name__ == "__main__":
    main()
