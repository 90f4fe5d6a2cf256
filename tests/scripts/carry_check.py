"""One stage on every rank (data parallelism), a model returning two scalars: a call like the
last one posts its agreement once its scalars are computed, carrying their sums, so the ranks
meet once in forward (`PipelineRuntime.carries_scalars`). When the last rank's batch shrinks,
it does not guess and posts its agreement at once, carrying nothing; the others, which did,
see the new layout in the same all-gather and run the call again, and every rank then sums the
scalars in an all-reduce of their own. Every call's outputs, the gradients and the parameters
after SGD steps equal the unwrapped model's on the global batch (fp32, rtol 1e-5), in training
and under torch.no_grad(). Then rank 0 makes such a call while the others call state_dict():
every rank raises CallOrderError ("ORDER rank R <error>"). Prints "PASS carry rank R carried C
guessed G rerun X"."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]

import torch  # noqa: E402
from torch import nn  # noqa: E402

import rannc  # noqa: E402
from rannc import dist as rdist  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6


class TwoScalars(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.net(x)
        return ((out - y) ** 2).mean(), out.abs().mean()


def main() -> None:
    rdist.init_process_group(timeout_s=300)
    rank, world = rdist.get_rank(), rdist.get_world_size()
    torch.manual_seed(0)
    model = TwoScalars()
    ref = copy.deepcopy(model)
    opt_w = torch.optim.SGD(model.parameters(), lr=0.05)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.05)
    wrapped = rannc.RaNNCModule(model, opt_w, partition_num=1, microbatches=1, schedule="gpipe")
    # rows per rank per call: the last rank's batch shrinks at call 3, then stays
    calls = [[3] * world] * 3 + [[3] * (world - 1) + [2]] * 2
    for step, sizes in enumerate(calls + [calls[-1]]):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(sum(sizes), 8, generator=g), torch.randn(sum(sizes), 8, generator=g)
        lo, hi = sum(sizes[:rank]), sum(sizes[:rank + 1])
        if step == len(calls):  # the last call: under no_grad
            with torch.no_grad():
                got, want = wrapped(x[lo:hi], y[lo:hi]), ref(x, y)
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
            break
        loss, aux = wrapped(x[lo:hi], y[lo:hi])
        ref_loss, ref_aux = ref(x, y)
        torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL, msg=f"call {step} loss")
        torch.testing.assert_close(aux, ref_aux, rtol=RTOL, atol=ATOL, msg=f"call {step} aux")
        loss.backward()
        ref_loss.backward()
        for (k, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, k=k, s=step: f"call {s} grad {k}: {m}")
        for opt in (opt_w, opt_r):
            opt.step()
            opt.zero_grad()
    rts = list(wrapped._runtimes.values())
    carried = sum(r.carried_calls for r in rts)
    # A rank in another rannc call meets a call that posts its agreement late, carrying its
    # sums, in the same shape: every rank raises CallOrderError, none waits.
    sizes = calls[-1]
    lo, hi = sum(sizes[:rank]), sum(sizes[:rank + 1])
    x, y = torch.randn(sum(sizes), 8), torch.randn(sum(sizes), 8)
    wrapped(x[lo:hi], y[lo:hi])[0].backward()  # (a training call again: the next one guesses)
    guessed = sum(r.guessed_calls for r in rts)
    try:
        if rank == 0:
            wrapped(x[lo:hi], y[lo:hi])
        else:
            wrapped.state_dict()
        print(f"ORDER rank {rank} no error", flush=True)
    except rannc.RaNNCError as e:
        print(f"ORDER rank {rank} {type(e).__name__}: {' '.join(str(e).split())}", flush=True)
    # rank 0's call ran on the guessed layout, its agreement posted only at its end
    assert sum(r.guessed_calls for r in rts) == guessed + (rank == 0)
    assert sum(r.carried_calls for r in rts) == carried
    print(f"PASS carry rank {rank} carried {sum(r.carried_calls for r in rts)} "
          f"guessed {sum(r.guessed_calls for r in rts)} rerun {sum(r.rerun_calls for r in rts)}",
          flush=True)
    rdist.shutdown()


if __name__ == "__main__":
    main()
