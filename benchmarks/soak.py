"""Soak: thousands of training steps of a small model on 4 ranks, watching each rank's memory.

Runs a small BERT (4 layers, hidden 64) as 2 stages x 2 replicas under 1F1B with dropout for
--steps steps under mpiexec, and reports each rank's resident memory (RSS) after --warmup steps
and at the end, its peak, the step time and any error. Target (issue 9): flat within 5%.

    PYTHONPATH=. .venv/bin/python benchmarks/soak.py [--steps 2000] [--np 4]
    PYTHONPATH=. .venv/bin/python benchmarks/soak.py --smoke     # 2 ranks, 40 steps
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(a: argparse.Namespace) -> None:
    import torch
    from transformers import BertConfig, BertForPreTraining

    import rannc
    from rannc import dist as rdist

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=64)
    model = BertForPreTraining(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    world = rdist.get_world_size()
    layout = {"partition_num": 2, "replicas": [world // 2, world // 2]} if world >= 2 else {}
    m = rannc.RaNNCModule(model, opt, microbatches=4, schedule="1f1b", profiler="estimate",
                          timeout_s=120, **layout)
    rank = rdist.get_rank()
    g = torch.Generator().manual_seed(rank)
    record: dict[str, object] = {"rank": rank, "error": None}
    t_warm = time.perf_counter()
    try:
        for step in range(1, a.steps + 1):
            b, s = 8, 32
            kw = dict(input_ids=torch.randint(0, 512, (b, s), generator=g),
                      attention_mask=torch.ones(b, s, dtype=torch.long),
                      token_type_ids=torch.zeros(b, s, dtype=torch.long),
                      labels=torch.randint(0, 512, (b, s), generator=g),
                      next_sentence_label=torch.randint(0, 2, (b,), generator=g))
            loss = m(**kw).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step == a.warmup:
                record["rss_warm_mb"] = rss_mb()
                t_warm = time.perf_counter()
            if step % max(1, a.steps // 10) == 0:
                record.setdefault("trace", []).append((step, round(rss_mb(), 1)))  # type: ignore[union-attr]
        record["rss_end_mb"] = rss_mb()
        record["step_ms"] = (time.perf_counter() - t_warm) / max(1, a.steps - a.warmup) * 1e3
        record["loss"] = float(loss.item())
    except Exception as e:  # reported, and the rank still fails
        record["error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        record["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        with open(f"{a.out}.{rank}.json", "w") as f:
            json.dump(record, f)
    rdist.shutdown()


def driver(a: argparse.Namespace) -> None:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    out = tempfile.mkdtemp(prefix="rannc-soak-") + "/rank"
    env = dict(os.environ, PYTHONPATH=str(ROOT), RANNC_BACKEND="gloo", OMP_NUM_THREADS="1")
    cmd = [str(mpiexec), "-n", str(a.np), sys.executable, __file__, "--worker", "--out", out,
           "--steps", str(a.steps), "--warmup", str(a.warmup)]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=a.timeout)
    wall = time.perf_counter() - t0
    recs = []
    for r in range(a.np):
        try:
            with open(f"{out}.{r}.json") as f:
                recs.append(json.load(f))
        except OSError:
            recs.append({"rank": r, "error": "no report (the rank died)"})
    print(f"soak: {a.steps} steps on {a.np} ranks, exit status {res.returncode}, {wall:.0f} s; "
          f"{platform.node()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}")
    print("| rank | RSS after warm-up (MB) | RSS at the end (MB) | change | peak RSS (MB) | "
          "step (ms) | error |")
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    for rec in recs:
        warm, end = rec.get("rss_warm_mb"), rec.get("rss_end_mb")
        change = (end - warm) / warm if warm and end else float("nan")
        worst = max(worst, abs(change)) if change == change else worst
        print(f"| {rec['rank']} | {warm or float('nan'):.1f} | {end or float('nan'):.1f} | "
              f"{change * 100:+.2f}% | {rec.get('peak_mb', float('nan')):.1f} | "
              f"{rec.get('step_ms', float('nan')):.1f} | {rec.get('error') or '-'} |")
    for rec in recs:
        print(f"rank {rec['rank']} RSS by step: {rec.get('trace')}")
    ok = res.returncode == 0 and all(not r.get("error") for r in recs)
    print(f"largest change {worst * 100:.2f}% (target: within 5%); "
          f"{'no errors' if ok else 'ERRORS: ' + res.stderr[-2000:]}")
    if not ok:
        sys.exit(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--smoke", action="store_true", help="2 ranks, 40 steps")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.smoke:
        a.steps, a.warmup, a.np = 40, 10, 2
    if a.worker:
        worker(a)
    else:
        driver(a)


if __name__ == "__main__":
    main()
