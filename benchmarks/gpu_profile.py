"""Where a GPU iteration's time goes: plain PyTorch and rannc (one stage) under torch.profiler.

    PYTHONPATH=. python3 benchmarks/gpu_profile.py                 # BERT-Large, bf16, one CUDA GPU
    PYTHONPATH=. .venv/bin/python benchmarks/gpu_profile.py --smoke   # tiny BERT on CPU: seconds

The question it answers (BENCHMARKS.md, "BERT-Large on one GPU"): rannc's bf16 stages took 1.5
to 2x the estimate oracle's time. For each variant, after a warm-up, `--iters` training
iterations (forward under autocast, backward, AdamW) run under torch.profiler with the CPU and
CUDA activities, and it prints per iteration:

- wall ms (the profiled window over the iterations, the device synchronised at both ends);
- device busy ms: the sum of the kernels' own device time (kernels of one stream do not
  overlap, so wall minus busy is the time the GPU waited for the host: an iteration that
  issues its kernels slower than they run is host-bound). The profiler's own cost per
  operator makes the profiled wall longer than an unprofiled iteration (gpu_study.py times
  those): compare the busy time with that;
- the kernels launched and the operators the host dispatched (the host's issue work);
- the autocast casts (`aten::_to_copy` / `aten::copy_`): calls and their device ms;
- the top operators by their own device time.

The same batch and model for both variants, as `gpu_study.py` builds them.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import single_stage_overhead as sso  # noqa: E402  (step_fn: one training iteration)
from gpu_study import SMOKE_BERT, bert_args, bert_pair  # noqa: E402  (the model pair it compares)

CASTS = ("aten::_to_copy", "aten::copy_")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bert_args(p)
    p.add_argument("--iters", type=int, default=4, help="profiled iterations per variant")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtypes", nargs="+", default=["bf16"], choices=["fp32", "bf16"])
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--smoke", action="store_true", help="2 x 64 BERT on whatever device")
    a = p.parse_args(argv)
    if a.smoke:
        vars(a).update(SMOKE_BERT, iters=2, warmup=1)
    return a


def _self_device_us(e: object) -> float:
    """An event's own device time in microseconds, under either name torch has used."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        v = getattr(e, name, None)
        if v is not None:
            return float(v)
    return 0.0


def profile_variant(name: str, step: Callable[[], None], iters: int, warmup: int,
                    dev: torch.device, top: int) -> dict[str, float]:
    cuda = dev.type == "cuda"
    sync: Callable[[], None] = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    for _ in range(warmup):
        step()
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        sync()
        wall = (time.perf_counter() - t0) / iters
    # Kernel rows: device events that are not user annotations (an `Optimizer.step` range on
    # the GPU timeline is one, as long as the optimizer's kernels together: counting it would
    # count them twice).
    avgs = prof.key_averages()
    kernels = [e for e in avgs if e.device_type == DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)]
    busy_us = sum(_self_device_us(e) for e in kernels)
    ops = [e for e in avgs if e.device_type == DeviceType.CPU and e.key.startswith("aten::")]
    casts = [e for e in avgs if e.key in CASTS]
    row = {"wall_ms": wall * 1e3, "busy_ms": busy_us / 1e3 / iters,
           "kernels": sum(e.count for e in kernels) / iters,
           "aten_ops": sum(e.count for e in ops) / iters,
           "cast_calls": sum(e.count for e in casts) / iters,
           "cast_ms": sum(_self_device_us(e) for e in casts) / 1e3 / iters}
    print(f"\n### {name}: wall {row['wall_ms']:.1f} ms/iter, device busy {row['busy_ms']:.1f} "
          f"ms ({row['busy_ms'] / row['wall_ms']:.0%}), {row['kernels']:.0f} kernels, "
          f"{row['aten_ops']:.0f} aten ops dispatched, casts {row['cast_calls']:.0f} calls "
          f"{row['cast_ms']:.1f} device ms (per iteration)")
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(avgs.table(sort_by=key, row_limit=top, max_name_column_width=48))
    return row


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _cfg, plain, opt_p, wrapped, opt_w, batch = bert_pair(a.layers, a.hidden, a.seq, a.batch, dev)
    what = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"BERT L{a.layers} H{a.hidden}, batch {a.batch} x seq {a.seq}, AdamW; {what}; torch "
          f"{torch.__version__}; {a.iters} profiled iterations after {a.warmup}")
    rows = {}
    for dtype in a.dtypes:
        ac = torch.bfloat16 if dtype == "bf16" else None
        for name, model, opt in (("plain", plain, opt_p), ("rannc", wrapped, opt_w)):
            rows[(dtype, name)] = profile_variant(f"{dtype} {name}", sso.step_fn(model, opt, batch, ac),
                                                  a.iters, a.warmup, dev, a.top)
    print("\n| dtype | variant | wall ms/iter | device busy ms | busy / wall | kernels | aten ops | "
          "cast calls | cast device ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (dtype, name), r in rows.items():
        print(f"| {dtype} | {name} | {r['wall_ms']:.1f} | {r['busy_ms']:.1f} | "
              f"{r['busy_ms'] / r['wall_ms']:.2f} | {r['kernels']:.0f} | {r['aten_ops']:.0f} | "
              f"{r['cast_calls']:.0f} | {r['cast_ms']:.2f} |")


if __name__ == "__main__":
    main()
