"""Two ranks, one of them really slowed down (the harness pins it to a core shared with a busy
process; nothing in the library knows): data parallel with the row shares of a cluster file that
declares it 2x slower, against equal shares. Prints the median step time of each.

    mpiexec -n 2 python tests/scripts/throttle_check.py CLUSTER.json
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]
import rannc  # noqa: E402
from rannc import dist as rdist  # noqa: E402


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))
                                    for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).pow(2).mean()


def main() -> None:
    torch.set_num_threads(1)
    ctx = rdist.init_process_group(timeout_s=120)
    rank = ctx.rank
    hog = None
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {rank})
        if rank == 1:  # the throttle: a busy process on this rank's core
            hog = subprocess.Popen([sys.executable, "-c", "import os; os.sched_setaffinity(0, {1})\n"
                                    "while True: pass"])
    try:
        times = {}
        for balance in (True, False):
            torch.manual_seed(0)
            model = MLP()
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            wrapped = rannc.RaNNCModule(model, opt, replicas=[2], microbatches=1,
                                        cluster_file=sys.argv[1], extra={"balance": balance})
            x = torch.randn(768, 512)
            steps = []
            for step in range(9):
                t0 = time.perf_counter()
                wrapped(x).backward()
                opt.step()
                opt.zero_grad()
                t = torch.tensor([time.perf_counter() - t0])
                torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
                if step >= 2:
                    steps.append(float(t))
            times[balance] = statistics.median(steps)
            if rank == 0:
                print(f"SHARES {'balanced' if balance else 'equal'} {wrapped.plan.stages[0].shares}",
                      flush=True)
        if rank == 0:
            print(f"TIME balanced {times[True]:.4f} equal {times[False]:.4f}", flush=True)
    finally:
        if hog is not None:
            hog.kill()
    rdist.shutdown()


if __name__ == "__main__":
    main()
