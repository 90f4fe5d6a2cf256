"""Process groups stay few however many input signatures a model is called with.

Every new input signature (here: each sequence length, in training and in eval) is captured
again and gets a runtime of its own; torch never frees a process group, so groups made per
runtime grew by a few with every capture, without bound (with NCCL, a communicator and its
buffers each). Two models, called with sequence lengths 4, 6, 8, 10 and 6 again, a training
step and an eval call each: one stage on both ranks (one group for its gradients beside the
default group, made once) and two stages sharing a tied weight (one group over both ranks for
it, made once), and the runtimes' gradient reducers share one kept bucket buffer. Then two
sequence lengths' calls before one backward through both, under 1F1B (whose forward() starts
the gradient buckets) with small buckets: the second call's reducer finishes the first's
buckets before it begins, in the shared group. Losses and gradients equal the unwrapped
model's on the global batch.
Prints "PASS groups rank R one-stage G1 two-stage G2" with the most process groups seen."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed import distributed_c10d as c10d  # noqa: E402

import rannc  # noqa: E402
from rannc import dist as rdist  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6


class Tied(nn.Module):
    """Token ids -> the mean over the sequence of logits from a tied embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 8))

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.body(self.emb(ids))
        logits = h @ self.emb.weight.t()
        return nn.functional.cross_entropy(logits.mean(1), y)


def groups() -> int:
    return len(c10d._world.pg_map)


def run(partition_num: int, rank: int, world: int) -> int:
    torch.manual_seed(0)
    model = Tied()
    ref = copy.deepcopy(model)
    opt_w = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    wrapped = rannc.RaNNCModule(model, opt_w, partition_num=partition_num, microbatches=1)
    seen = []
    for step, seq in enumerate([4, 6, 8, 10, 6]):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 16, (2 * world, seq), generator=g)
        y = torch.randint(0, 16, (2 * world,), generator=g)
        mine = slice(2 * rank, 2 * rank + 2)
        loss, want = wrapped(ids[mine], y[mine]), ref(ids, y)
        torch.testing.assert_close(loss.detach(), want.detach(), rtol=RTOL, atol=ATOL)
        loss.backward()
        want.backward()
        opt_w.step()
        opt_r.step()
        opt_w.zero_grad()
        opt_r.zero_grad()
        wrapped.eval()
        ref.eval()
        with torch.no_grad():
            torch.testing.assert_close(wrapped(ids[mine], y[mine]), ref(ids, y), rtol=RTOL,
                                       atol=ATOL)
        wrapped.train()
        ref.train()
        seen.append(groups())
    # the first signature made what the model needs; the other nine captures made nothing
    assert len(set(seen)) == 1, f"process groups after each step: {seen}"
    # and their reducers fill one kept bucket buffer (a buffer each: up to max_captures)
    reducers = [rt.grads for rt in wrapped._runtimes.values()]
    assert len(reducers) > 2 and len({id(r.buffers) for r in reducers}) == 1, reducers
    return seen[-1]


def two_calls_one_backward(rank: int, world: int) -> None:
    torch.manual_seed(1)
    model = Tied()
    ref = copy.deepcopy(model)
    wrapped = rannc.RaNNCModule(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                partition_num=1, microbatches=2, schedule="1f1b", bucket_mb=1e-4)
    losses, wants = [], []
    for step, seq in enumerate([4, 7]):
        g = torch.Generator().manual_seed(10 + step)
        ids = torch.randint(0, 16, (4 * world, seq), generator=g)
        y = torch.randint(0, 16, (4 * world,), generator=g)
        mine = slice(4 * rank, 4 * rank + 4)
        losses.append(wrapped(ids[mine], y[mine]))
        wants.append(ref(ids, y))
    (losses[0] + 2 * losses[1]).backward()
    (wants[0] + 2 * wants[1]).backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=n)


def main() -> None:
    rdist.init_process_group(timeout_s=300)
    rank, world = rdist.get_rank(), rdist.get_world_size()
    two_calls_one_backward(rank, world)
    one = run(1, rank, world)
    assert one == 2, f"one stage on every rank: {one} process groups, the default and one more expected"
    two = run(2, rank, world)
    print(f"PASS groups rank {rank} one-stage {one} two-stage {two}", flush=True)
    rdist.shutdown()


if __name__ == "__main__":
    main()
