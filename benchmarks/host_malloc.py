"""Config.host_malloc on CPU ranks: step time and resident peak, "reuse" and "release" against "keep".

    PYTHONPATH=. .venv/bin/python benchmarks/host_malloc.py                # the table in BENCHMARKS.md
    PYTHONPATH=. .venv/bin/python benchmarks/host_malloc.py --smoke        # seconds

"release" fixes glibc's mmap and trim thresholds at 128 KiB ("auto", the default, does so only
on a CPU rank whose forecast is near its memory), so every tensor from that size up is its own
mapping, returned when freed: the resident peak follows the live tensors, at the price of fresh
zero-filled pages for those allocations. "reuse" ("auto" elsewhere on a CPU) raises both to
1 GiB: freed blocks stay in the heap for the next tensors, without page faults. "keep" leaves
glibc's defaults. Each repeat trains the model of `benchmarks/memory_forecast.py`
(`BertForMaskedLM` or `GPT2LMHeadModel` from a small config, random weights) under
`rannc.RaNNCModule` on S ranks (`partition_num=S`, 4 microbatches, AdamW) for `--steps` steps,
in fresh processes; the settings alternate (reuse, release, keep, reuse, ...), and each round
gives one ratio per setting against "keep". Per run:
the median step time over steps 2 to the last (rank 0's wall clock around model(), backward()
and step(); the pipeline is synchronous, so every rank's is alike) and rank 0's CPU time per
step (user and system, all its threads: what the page faults cost, whatever else the host
runs), and each rank's resident
peak over those steps (`VmHWM` reset after step 1, minus `VmRSS` before the model was built).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memory_forecast as mf  # noqa: E402  (the models and the batch)
import pipeline_memory as pm  # noqa: E402  (its launcher and VmHWM helpers)

MB = 2**20


def worker(a: argparse.Namespace) -> None:
    import gc
    import logging

    import torch

    import rannc
    from rannc import dist as rdist

    logging.getLogger("transformers").setLevel(logging.ERROR)
    rank, world = rdist.get_rank(), rdist.get_world_size()
    if world > 1:
        rdist.init_process_group(timeout_s=600)
    batch = mf.local_batch(a)
    with torch.device("meta"):  # imports what capture and planning import, before the baseline
        meta = mf.build(a.model, a)
    rannc.plan(meta, kwargs=batch, config=rannc.Config(partition_num=1, microbatches=1, progress=False))
    del meta
    gc.collect()
    mf.trim()
    base_kb = pm.status_kb("VmRSS")
    net = mf.build(a.model, a)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    model = rannc.RaNNCModule(net, opt, partition_num=world, microbatches=a.microbatches,
                              host_malloc=a.host_malloc)
    times, cpu = [], []
    for step in range(a.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        if step == 0:
            gc.collect()
            pm.reset_peak()
    out = dict(rank=rank, step_s=statistics.median(times[1:]), cpu_s=statistics.median(cpu[1:]),
               peak_kb=pm.status_kb("VmHWM") - base_kb)
    Path(a.out, f"{a.host_malloc}.{a.repeat}.{rank}.json").write_text(json.dumps(out))
    if world > 1:
        rdist.shutdown()


def driver(a: argparse.Namespace) -> None:
    mpiexec = pm.mpiexec() if a.stages > 1 else ""
    out = Path(tempfile.mkdtemp(prefix="rannc_host_malloc_"))
    me = [sys.executable, str(Path(__file__).resolve())]
    common = [f"--{k}={v}" for k, v in (("layers", a.layers), ("hidden", a.hidden), ("heads", a.heads),
                                        ("vocab", a.vocab), ("batch", a.batch), ("seq", a.seq),
                                        ("steps", a.steps), ("microbatches", a.microbatches),
                                        ("model", a.model), ("out", out))]
    modes = ("reuse", "release", "keep")
    try:
        for i in range(a.repeats):
            for mode in modes:
                cmd = [*me, "--worker", f"--host-malloc={mode}", f"--repeat={i}", *common]
                pm.launch([mpiexec, "-n", str(a.stages), *cmd] if a.stages > 1 else cmd, a.timeout)
        runs = {(m, i): [json.loads(p.read_text()) for p in sorted(out.glob(f"{m}.{i}.*.json"))]
                for m in modes for i in range(a.repeats)}
    finally:
        shutil.rmtree(out, ignore_errors=True)

    def step(m: str, i: int, key: str = "step_s") -> float:
        return next(r[key] for r in runs[(m, i)] if r["rank"] == 0)

    print(f"\n{a.model} L{a.layers} H{a.hidden} vocab {a.vocab}, global batch {a.batch} x {a.seq}, "
          f"{a.stages} stage(s), {a.microbatches} microbatches, {a.steps} steps, {a.repeats} pairs\n")
    print("| host_malloc | step s (median of runs) | rank 0's CPU s per step (user + system) | "
          "resident peak per rank MiB (median of runs) |")
    print("|---|---|---|---|")
    for m in modes:
        peaks = [statistics.median(next(r["peak_kb"] for r in runs[(m, i)] if r["rank"] == k)
                                   for i in range(a.repeats)) / 1024 for k in range(a.stages)]
        print(f"| {m} | {statistics.median(step(m, i) for i in range(a.repeats)):.3f} | "
              f"{statistics.median(step(m, i, 'cpu_s') for i in range(a.repeats)):.3f} | "
              + ", ".join(f"{p:.0f}" for p in peaks) + " |")
    for key, what in (("step_s", "step time"), ("cpu_s", "CPU time")):
        for m in modes[:-1]:
            ratios = [step(m, i, key) / step("keep", i, key) for i in range(a.repeats)]
            print(f"\n{what} {m} / keep, round by round: {', '.join(f'{x:.3f}' for x in ratios)}; "
                  f"median {statistics.median(ratios):.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=mf.MODELS, default="bert")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3, help="rounds (reuse, release, keep)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--smoke", action="store_true", help="2 layers H64, one process, 1 round, 3 steps")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--host-malloc", help=argparse.SUPPRESS)
    p.add_argument("--repeat", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.smoke and not a.worker:
        a.layers, a.hidden, a.heads, a.vocab, a.batch, a.seq, a.steps = 2, 64, 2, 256, 8, 16, 3
        a.stages, a.repeats = 1, 1
    if a.worker:
        worker(a)
    else:
        driver(a)


if __name__ == "__main__":
    main()
