"""Gradient reduction across a stage's replicas: one flat copy reduced after the backward (the
runtime before rannc.pipeline.grads) against buckets started during the last backward.

    PYTHONPATH=. .venv/bin/python benchmarks/grad_reduce.py --old-root /tmp/rannc_old
    PYTHONPATH=. .venv/bin/python benchmarks/grad_reduce.py --smoke

`--old-root`: a checkout of rannc before the bucketed reducer (e.g. `git archive <commit> rannc
| tar -x -C /tmp/rannc_old`, plus the built `rannc/_C*.so`); without it only the new runtime's
bucket sizes are compared. Each variant runs in fresh `mpiexec -n 2` ranks (gloo, one OpenMP
thread per rank): runtime_peers.py's small BERT as ONE stage with 2 replicas (so every gradient
is all-reduced), AdamW, `--microbatches`, the schedule forced. Reported per variant: the median
step time over `--steps` steps after `--warmup` (rank 0's clock, a barrier before each step),
the median time from backward() entry to its return, and the bytes the reduction held beyond
the gradients: the new runtime's own count (`GradReducer.peak_extra_bytes`); the old one
concatenated every gradient (`torch.cat`), so its figure is their total size. Variants run
round-robin over `--repeats`; the table holds medians over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipeline_memory as pm  # noqa: E402  (mpiexec)

ROOT = Path(__file__).resolve().parents[1]


def worker(a: argparse.Namespace) -> None:
    import runtime_peers as peers
    import torch
    import torch.distributed as dist

    import rannc
    from rannc import dist as rdist

    rdist.init_process_group(timeout_s=600)
    rank, world = rdist.get_rank(), rdist.get_world_size()
    ns = argparse.Namespace(vocab=a.vocab, hidden=a.hidden, layers=a.layers, heads=a.heads,
                            seq=a.seq)
    data = peers.batches("bert", argparse.Namespace(**vars(ns), batch=a.batch), a.warmup + a.steps)
    lo, hi = rank * a.batch // world, (rank + 1) * a.batch // world
    wrapper, _, _ = peers.build("bert", ns)
    opt = torch.optim.AdamW(wrapper.parameters(), lr=1e-3)
    opts: dict[str, Any] = dict(partition_num=1, replicas=[world], microbatches=a.microbatches,
                                checkpointing="off", schedule=a.schedule)
    if a.bucket_mb > 0:
        opts["bucket_mb"] = a.bucket_mb
    model = rannc.RaNNCModule(wrapper, opt, **opts)
    steps, backs = [], []
    for i, (x, y) in enumerate(data):
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(x[lo:hi], y[lo:hi])
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        if i >= a.warmup:
            steps.append(t3 - t0)
            backs.append(t2 - t1)
    rt = model._last_rt
    grads = rt.grads if hasattr(rt, "grads") else None
    held = {id(p): p for p in rt.held.values()}.values()
    total = sum(p.numel() * p.element_size() for p in held)
    extra = grads.peak_extra_bytes if grads is not None else total
    if rank == 0:
        print("@@" + json.dumps(dict(step_s=statistics.median(steps),
                                     backward_s=statistics.median(backs), extra_mb=extra / 2**20,
                                     grads_mb=total / 2**20, schedule=model.plan.schedule,
                                     rannc=rannc.__file__)))
    rdist.shutdown()


def driver(a: argparse.Namespace) -> None:
    mpiexec = pm.mpiexec()
    variants: list[tuple[str, str, float]] = []  # (label, root, bucket_mb; 0: the default)
    if a.old_root:
        variants.append(("flat copy (before)", a.old_root, 0.0))
    variants += [(f"buckets {mb:g} MB", str(ROOT), mb) for mb in a.bucket_mb]
    common = [f"--{k}={getattr(a, k)}" for k in ("vocab", "hidden", "layers", "heads", "seq",
                                                  "batch", "microbatches", "steps", "warmup")]
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for _ in range(a.repeats):
        for sched in a.schedules:
            for label, root, mb in variants:
                env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root,
                       "RANNC_PROFILER": "estimate"}
                cmd = [mpiexec, "-n", "2", sys.executable, str(Path(__file__).resolve()),
                       "--worker", f"--schedule={sched}", f"--worker-bucket={mb}", *common]
                with tempfile.TemporaryDirectory() as tmp:
                    out = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True,
                                         timeout=a.timeout)
                line = next((ln for ln in out.stdout.splitlines() if ln.startswith("@@")), None)
                if line is None:
                    sys.exit(f"{label} {sched} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
                r = json.loads(line[2:])
                if not r["rannc"].startswith(str(Path(root).resolve())):
                    sys.exit(f"{label}: the ranks imported rannc from {r['rannc']}, not {root}")
                results.setdefault((sched, label), []).append(r)
    print(f"BERT vocab {a.vocab}, hidden {a.hidden}, {a.layers} layers, seq {a.seq}, global batch "
          f"{a.batch}, {a.microbatches} microbatches; 1 stage x 2 replicas (gloo, CPU); medians "
          f"of {a.steps} steps, {a.repeats} repeat(s)")
    print("| schedule | reduction | step (ms) | backward() (ms) | held beyond grads (MB) | grads (MB) |")
    print("|---|---|---|---|---|---|")
    for (sched, label), rs in results.items():
        def med(k: str, rs: list[dict[str, Any]] = rs) -> float:
            return statistics.median(r[k] for r in rs)
        print(f"| {sched} | {label} | {med('step_s') * 1e3:.1f} | {med('backward_s') * 1e3:.1f} | "
              f"{med('extra_mb'):.1f} | {med('grads_mb'):.1f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old-root", default="", help="a rannc checkout with the flat-copy reducer")
    p.add_argument("--bucket-mb", nargs="+", type=float, default=[25.0, 4.0])
    p.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--smoke", action="store_true", help="tiny BERT, 1 repeat, 2 steps")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--schedule", default="gpipe", help=argparse.SUPPRESS)
    p.add_argument("--worker-bucket", type=float, default=0.0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        a.bucket_mb = a.worker_bucket
        worker(a)
        return
    if a.smoke:
        a.vocab, a.hidden, a.layers, a.seq, a.batch = 64, 32, 2, 8, 4
        a.repeats, a.steps, a.warmup, a.schedules, a.bucket_mb = 1, 2, 1, ["gpipe"], [0.01]
    driver(a)


if __name__ == "__main__":
    main()
