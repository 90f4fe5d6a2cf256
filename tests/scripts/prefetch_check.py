"""Receives posted ahead (`Transport.expect`) and sends dropped once proven arrived
(`arrivals.Arrivals`): 2 stages on 2 ranks, 8 microbatches, under fill-drain, 1F1B and
zero-bubble. Every receive from the other rank is an irecv posted ahead: while the action
before it runs, or, for the first one of a call on a guessed row layout (nothing is posted on a
guess), with the other pieces of its action once the layout is agreed. None is a blocking recv.
The most isends of activations and gradients a rank holds at once (their tensors alive) is what
its schedule keeps in flight, not every microbatch's. Losses and gradients equal the unwrapped
model's on the global batch (fp32, rtol 1e-5) and no posted receive is left at the end of a
call (`Transport.check_drained` raises). Prints "PASS <schedule> rank R calls C blocking B
posted P held H"."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]

import torch  # noqa: E402
from torch import nn  # noqa: E402

import rannc  # noqa: E402
from rannc import dist as rdist  # noqa: E402
from rannc.graph.task_graph import ValueKind  # noqa: E402
from rannc.pipeline import transport as tp  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
CALLS = 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(self.body(x)), y)


def main() -> None:
    rdist.init_process_group(timeout_s=300)
    rank, world = rdist.get_rank(), rdist.get_world_size()
    counts = {"recv": 0, "irecv": 0}

    def counting(name: str) -> Any:
        f = getattr(tp.dist, name)

        def g(*args: Any, **kw: Any) -> Any:
            counts[name] += 1
            return f(*args, **kw)
        return g

    tp.dist.recv, tp.dist.irecv = counting("recv"), counting("irecv")  # type: ignore[assignment]
    held = [0]
    isend = tp.Transport._isend

    def holding(self: tp.Transport, *args: Any) -> None:
        isend(self, *args)  # (model inputs' rows sent at the start are views of the batch)
        held[0] = max(held[0], sum(self.values[k.value].kind is not ValueKind.INPUT
                                   for _, k in self.pending_sends()))
    tp.Transport._isend = holding  # type: ignore[method-assign]
    for schedule in ("gpipe", "1f1b", "zero_bubble"):
        torch.manual_seed(0)
        net = Net()
        ref = copy.deepcopy(net)
        model = rannc.RaNNCModule(net, None, partition_num=2, microbatches=8, schedule=schedule,
                                  checkpointing="off")
        counts.update(recv=0, irecv=0)
        held[0] = 0
        for step in range(CALLS):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(16, 16, generator=g), torch.randint(0, 4, (16,), generator=g)
            lo, hi = rank * 16 // world, (rank + 1) * 16 // world
            loss = model(x[lo:hi], y[lo:hi])
            loss.backward()
            ref_loss = ref(x, y)
            ref_loss.backward()
            torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
            mine = dict(net.named_parameters())
            for k, q in ref.named_parameters():
                if mine[k].grad is not None:
                    where = f"{schedule} step {step} {k}"
                    torch.testing.assert_close(mine[k].grad, q.grad, rtol=RTOL, atol=ATOL,
                                               msg=lambda m, w=where: f"{w}: {m}")
                    mine[k].grad = None
            ref.zero_grad()
        blocking, posted = counts["recv"], counts["irecv"]
        assert posted > 0 and blocking == 0, (schedule, rank, counts)
        print(f"PASS {schedule} rank {rank} calls {CALLS} blocking {blocking} posted {posted} "
              f"held {held[0]}", flush=True)
    rdist.shutdown()


if __name__ == "__main__":
    main()
