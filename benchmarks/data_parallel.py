"""rannc with one stage on every rank (pure data parallelism) against DistributedDataParallel,
side by side in the same processes.

    python benchmarks/data_parallel.py --launch 2 4 --model bert resnet --iters 20
    python benchmarks/data_parallel.py --smoke   # a tiny BERT on 2 ranks, seconds

Every rank builds two copies of the same model (runtime_peers.py's BERT-like or pre-activation
ResNet) from the same seed: one wrapped in `rannc.RaNNCModule` (one stage replicated on every
rank: `partition_num=1`, one microbatch, as the planner picks for these sizes), one in DDP, each
with its own AdamW. Steps alternate between the two in ABBA order after a warm-up, every step
starting from a barrier, so the machine's load and the cost of running first in a pair hit both
alike (runs in separate launches minutes apart differ by up to 1.5x on a shared machine). Each
rank feeds its own rows of the same global batches, and both return the global loss on every
rank (DDP's loop all-reduces it, as rannc does inside the call). Prints, from rank 0, the median seconds per
step of each, the ratio DDP / rannc of the medians and the median of the per-pair ratios, and
each rank's process CPU milliseconds per step (its work, not its waits). The losses of the two
must agree (same model, same rows): a check, not a figure.

`--profile DIR` writes torch.profiler's operator table of a few extra steps of each, per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def worker(a: argparse.Namespace) -> None:
    import pipeline_memory as pm
    import torch
    import torch.distributed as dist
    from runtime_peers import batches, build
    from torch.nn.parallel import DistributedDataParallel

    import rannc
    from rannc import dist as rdist

    rdist.init_process_group(timeout_s=600)
    rank, world = rdist.get_rank(), rdist.get_world_size()
    data = batches(a.model, a, a.warmup + a.iters)
    lo, hi = rank * a.batch // world, (rank + 1) * a.batch // world

    wrapped, _, _ = build(a.model, a)
    opt_r = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    rmodel = rannc.RaNNCModule(wrapped, opt_r, partition_num=1, microbatches=1,
                               checkpointing="off", bucket_mb=a.bucket_mb,
                               **({"schedule": a.schedule} if a.schedule else {}))
    plain, _, _ = build(a.model, a)  # the same seed: the same weights
    ddp = DistributedDataParallel(plain, bucket_cap_mb=a.bucket_mb)
    opt_d = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    losses: dict[str, list[float]] = {"rannc": [], "ddp": []}

    def step_rannc(x: Any, y: Any) -> None:
        loss = rmodel(x[lo:hi], y[lo:hi])
        loss.backward()
        opt_r.step()
        opt_r.zero_grad()
        losses["rannc"].append(float(loss.detach()))

    def step_ddp(x: Any, y: Any) -> None:
        loss = ddp(x[lo:hi], y[lo:hi])
        loss.backward()
        opt_d.step()
        opt_d.zero_grad()
        # rannc returns the global loss on every rank; with DDP the loop averages it (as
        # runtime_peers.py's DDP does: the same work for the same result)
        mean = loss.detach() / world
        dist.all_reduce(mean)
        losses["ddp"].append(float(mean))

    runs = {"rannc": step_rannc, "ddp": step_ddp}
    for x, y in data[:a.warmup]:
        for f in runs.values():
            f(x, y)
    wall: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    order = list(runs)
    for i, (x, y) in enumerate(data[a.warmup:]):
        for k in order if i % 2 == 0 else reversed(order):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            runs[k](x, y)
            dist.barrier()  # the step ends when the slowest rank's ends
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    d = torch.tensor(losses["ddp"], dtype=torch.float64)
    gap = max(abs(r - float(q)) / max(abs(float(q)), 1e-12) for r, q in zip(losses["rannc"], d, strict=True))
    if gap > a.max_loss_gap:
        raise SystemExit(f"rank {rank}: rannc's and DDP's losses differ by {gap:.2e} relative "
                         f"(more than --max-loss-gap {a.max_loss_gap:g}): rannc {losses['rannc']}, "
                         f"DDP {d.tolist()}")
    if a.profile:
        for k, f in runs.items():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for x, y in data[a.warmup:a.warmup + 4]:
                    dist.barrier()
                    f(x, y)
            Path(a.profile).mkdir(parents=True, exist_ok=True)
            Path(a.profile, f"{a.model}.{world}.{k}.rank{rank}.txt").write_text(
                prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    cpu_ms = {k: 1e3 * statistics.median(v) for k, v in cpu.items()}
    every = [None] * world
    dist.all_gather_object(every, cpu_ms)
    if rank == 0:
        pairs = [dd / r for r, dd in zip(wall["rannc"], wall["ddp"], strict=True)]
        out = dict(model=a.model, ranks=world, iters=a.iters,
                   rannc_s=statistics.median(wall["rannc"]), ddp_s=statistics.median(wall["ddp"]),
                   pair_median=statistics.median(pairs), pair_lo=min(pairs), pair_hi=max(pairs),
                   cpu_ms={k: [e[k] for e in every] for k in runs}, loss_gap=gap,
                   stages=len(rmodel.plan.stages), microbatches=rmodel.plan.microbatches,
                   schedule=rmodel.plan.schedule)
        out["ratio"] = out["ddp_s"] / out["rannc_s"]
        print("RESULT " + json.dumps(out), flush=True)
    ddp = None  # before the process group goes: a DDP wrapper outliving it can deadlock (`pm.shutdown`)
    pm.shutdown()


def launch(a: argparse.Namespace) -> None:
    import pipeline_memory as pm

    mpiexec = pm.mpiexec()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                         env.get("PYTHONPATH", "")])
    rows = []
    for model in a.model_list:
        for n in a.launch:
            args = [a for a in sys.argv[1:]]
            cmd = [mpiexec, "-n", str(n), sys.executable, __file__, "--worker", "--model", model,
                   *_passthrough(args)]
            print("$ " + " ".join(cmd), flush=True)
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
            line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if res.returncode or line is None:
                sys.exit(f"{model} on {n} ranks failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
            rows.append(json.loads(line[len("RESULT "):]))
    print("\n| model | ranks | rannc schedule | rannc ms/step | DDP ms/step | DDP / rannc (medians) | paired "
          "(median, range) | CPU ms/step rannc | CPU ms/step DDP | loss gap |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['ranks']} | {r['schedule']} | {1e3 * r['rannc_s']:.1f} "
              f"| {1e3 * r['ddp_s']:.1f} "
              f"| {r['ratio']:.3f} | {r['pair_median']:.3f} ({r['pair_lo']:.2f} to {r['pair_hi']:.2f}) "
              f"| {' / '.join(f'{c:.0f}' for c in r['cpu_ms']['rannc'])} "
              f"| {' / '.join(f'{c:.0f}' for c in r['cpu_ms']['ddp'])} | {r['loss_gap']:.1e} |")


def _passthrough(args: list[str]) -> list[str]:
    """The command line less --launch and --model (the launcher's own)."""
    out, skip = [], False
    for x in args:
        if x in ("--launch", "--model"):
            skip = True
            continue
        if skip and not x.startswith("--"):
            continue
        skip = False
        out.append(x)
    return out


def main() -> None:
    from runtime_peers import add_model_args

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launch", nargs="+", type=int, default=[2, 4], help="rank counts to launch")
    p.add_argument("--model", nargs="+", default=["bert"], choices=["bert", "resnet"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--schedule", default="", help="force rannc's schedule (default: its plan's)")
    p.add_argument("--max-loss-gap", type=float, default=1e-2,
                   help="the largest relative difference of the two losses at any step (AdamW "
                        "magnifies rounding differences in BatchNorm models over many steps)")
    p.add_argument("--profile", default="", help="folder for torch.profiler tables per rank")
    p.add_argument("--timeout", type=float, default=1200)
    add_model_args(p)  # the models' sizes, runtime_peers.py's
    p.add_argument("--batch", type=int, default=0, help="global batch (0: 16 for BERT, 32 for ResNet)")
    p.add_argument("--smoke", action="store_true", help="a tiny BERT on 2 ranks, 2 steps of each")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.smoke:
        a.launch, a.model, a.iters, a.warmup = [2], ["bert"], 2, 1
        a.vocab, a.hidden, a.layers, a.heads, a.seq, a.batch = 128, 32, 2, 2, 16, 8
    a.model_list = a.model
    if not a.worker:
        launch(a)
        return
    a.model = a.model[0]
    a.batch = a.batch or (16 if a.model == "bert" else 32)
    a.t_f = a.t_b = a.t_w = 0.0
    worker(a)


if __name__ == "__main__":
    main()
