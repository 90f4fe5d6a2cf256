"""Train a small model on every rank and make one rank fail on purpose (tests/test_faults.py).

--where: none (no fault), forward | backward (this rank's pipeline work), allreduce (the gradient all-reduce),
checkpoint (writing its shard of a checkpoint), between (user code after backward),
skip-backward (this rank does not call backward() at that step), or state-dict (this rank
leaves the loop after that step and calls state_dict() while the others train on).  --how:
raise (an exception), die (SIGKILL, no chance to report), sleep (--sleep-s seconds of user
code) or sigterm (the rank sends itself SIGTERM, as `kill` would).  Before the fault the rank prints
"FAULT rank R step S at <unix time>"; every completed step prints "STEP".
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import rannc
from rannc import dist as rdist
from rannc.pipeline.stage import Stage


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--where", required=True)
    p.add_argument("--how", default="raise", choices=("raise", "die", "sleep", "sigterm"))
    p.add_argument("--sleep-s", type=float, default=12.0, help="--how sleep: for how long")
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--step", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--timeout-s", type=float, default=5.0)
    p.add_argument("--partition-num", type=int, default=None)
    p.add_argument("--linger", type=float, default=0.0,
                   help="rank --rank works this long after the last step, the others exit")
    a = p.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m = rannc.RaNNCModule(model, opt, timeout_s=a.timeout_s, profiler="estimate",
                          partition_num=a.partition_num)
    rank = rdist.get_rank()
    step = 0

    def fault(where: str) -> None:
        if rank != a.rank or step != a.step or where != a.where:
            return
        print(f"FAULT rank {rank} step {step} at {time.time():.3f}", flush=True)
        if a.how == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if a.how == "sigterm":  # as a user's `kill PID` would
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        if a.how == "sleep":  # slow user code (data loading), longer than timeout_s
            time.sleep(a.sleep_s)
            return
        raise ValueError(f"injected fault in {where} on rank {rank}")

    # Faults go where rannc does the work: the stage modules run from the captured graph, so
    # hooks on the user's modules would never fire.
    fwd, bwd = Stage.forward, Stage.backward

    def forward_micro(self: Stage, *args: object, **kwargs: object) -> None:
        fault("forward")
        fwd(self, *args, **kwargs)  # type: ignore[arg-type]

    def backward_micro(self: Stage, *args: object) -> None:
        fault("backward")
        bwd(self, *args)  # type: ignore[arg-type]

    all_reduce = dist.all_reduce

    def grad_all_reduce(t: torch.Tensor, *args: object, **kwargs: object) -> object:
        if kwargs.get("group") is not None:  # the gradient reduce names its replica group
            fault("allreduce")
        return all_reduce(t, *args, **kwargs)  # type: ignore[arg-type]

    write_data = dcp.FileSystemWriter.write_data

    def write_shard(self: dcp.FileSystemWriter, *args: object) -> object:
        fault("checkpoint")
        return write_data(self, *args)  # type: ignore[arg-type]

    Stage.forward = forward_micro  # type: ignore[method-assign]
    Stage.backward = backward_micro  # type: ignore[method-assign]
    dist.all_reduce = grad_all_reduce  # type: ignore[assignment]
    dcp.FileSystemWriter.write_data = write_shard  # type: ignore[method-assign]

    g = torch.Generator().manual_seed(1)
    ckpt_dir = tempfile.mkdtemp(prefix="rannc-fault-") if rank == 0 else ""
    box = [ckpt_dir]
    dist_ok = dist.is_initialized()
    for step in range(1, a.steps + 1):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
        loss = ((m(x) - y) ** 2).mean()
        if not dist_ok:
            dist.broadcast_object_list(box, src=0)
            dist_ok = True
        if a.where == "skip-backward" and rank == a.rank and step == a.step:
            print(f"FAULT rank {rank} step {step} at {time.time():.3f}", flush=True)
        else:
            loss.backward()
        fault("between")
        opt.step()
        opt.zero_grad()
        if a.where == "checkpoint" and step == a.step:
            m.save_checkpoint(os.path.join(box[0], "ckpt"))
        if a.where == "state-dict" and rank == a.rank and step == a.step:
            # This rank leaves the loop early and saves while the others go on training.
            print(f"FAULT rank {rank} step {step} at {time.time():.3f}", flush=True)
            m.state_dict()
            break
        print(f"STEP rank {rank} step {step} loss {loss.item():.5f}", flush=True)
    if rank == a.rank:
        time.sleep(a.linger)
    print(f"DONE rank {rank}", flush=True)


if __name__ == "__main__":
    main()
