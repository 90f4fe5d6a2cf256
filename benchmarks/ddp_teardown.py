"""Why the benchmarks free a DistributedDataParallel wrapper before the process group goes.

    python benchmarks/ddp_teardown.py --launches 60     # each order 60 times, 2 ranks
    python benchmarks/ddp_teardown.py --smoke           # 1 launch of each order

Every launch (mpiexec, 2 gloo ranks) trains a small DDP model for three steps, meets at a
barrier, and ends in one of two orders: "group first" destroys the process group
(`rdist.shutdown()`) and then frees the DDP wrapper, as a function returning after its
shutdown call does; "wrapper first" frees the wrapper, then destroys the group
(`pipeline_memory.shutdown`, which says why). A launch that has not exited within
`--timeout` seconds prints its ranks' stacks, is killed (`pipeline_memory.launch`) and is
counted as hung. Prints the count of each order.

(A DDP wrapper's C++ Reducer holds the group; freed last, under the interpreter lock, it
destroys the gloo group, whose destructor joins worker threads that may need that lock.)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipeline_memory as pm  # noqa: E402  (mpiexec, launch, shutdown)

ORDERS = ("group first", "wrapper first")


def worker(order: str) -> None:
    import torch
    import torch.distributed as dist

    from rannc import dist as rdist

    rdist.init_process_group(timeout_s=60)
    ddp = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)))
    for _ in range(3):
        ddp(torch.randn(8, 64)).sum().backward()
        dist.all_reduce(torch.ones(1))
    dist.barrier()
    if order == "wrapper first":
        del ddp
        pm.shutdown()
    else:
        rdist.shutdown()
        del ddp  # (the last reference to the gloo group goes with the Reducer)


def driver(a: argparse.Namespace) -> None:
    mpiexec = pm.mpiexec()
    hung = dict.fromkeys(ORDERS, 0)
    for _ in range(a.launches):
        for order in ORDERS:  # alternating: the machine's load meets both alike
            try:  # (a launch that runs out of time prints its ranks' stacks, then is killed)
                pm.launch([mpiexec, "-n", "2", sys.executable, __file__, "--worker", order], a.timeout)
            except subprocess.TimeoutExpired:
                hung[order] += 1
    print("| teardown order | launches | did not exit |")
    print("|---|---|---|")
    for order in ORDERS:
        print(f"| {order} | {a.launches} | {hung[order]} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launches", type=int, default=60, help="launches of each order")
    p.add_argument("--timeout", type=float, default=20, help="seconds before a launch counts as hung")
    p.add_argument("--smoke", action="store_true", help="1 launch of each order")
    p.add_argument("--worker", choices=ORDERS, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.worker)
        return
    if a.smoke:
        a.launches = 1
    driver(a)


if __name__ == "__main__":
    main()
