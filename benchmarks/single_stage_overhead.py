"""rannc with one stage vs plain PyTorch on the same model, measured side by side in one run.

    python benchmarks/single_stage_overhead.py --layers 4 --hidden 256 --batch 16 --seq 128
    python benchmarks/single_stage_overhead.py --smoke   # a tiny BERT, seconds

Both train a copy of the same BERT with AdamW on the same batch; iterations
alternate between the two in ABBA order (after a warm-up), so machine noise and
the cost of running first in a pair (fresh pages for large tensors) hit both alike.
Prints samples per second of each and their ratio (rannc / plain).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import statistics
import time
from collections.abc import Callable

import torch
from transformers import BertConfig, BertForPreTraining

import rannc


def step_fn(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor],
            autocast: torch.dtype | None = None) -> Callable[[], None]:
    """One training iteration; forward under `torch.autocast(<batch device>, autocast)` if given."""
    device_type = next(iter(batch.values())).device.type

    def step() -> None:
        with torch.autocast(device_type, dtype=autocast) if autocast else contextlib.nullcontext():
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return step


def alternate(runs: dict[str, Callable[[], None]], iters: int, warmup: int = 2,
              sync: Callable[[], None] = lambda: None) -> dict[str, list[float]]:
    """Seconds of each of `iters` calls of every run, in ABBA order after `warmup` calls each.
    `sync` is called before and after every timed call (torch.cuda.synchronize on a GPU)."""
    for f in runs.values():  # warm-up; rannc captures here
        for _ in range(warmup):
            f()
    times: dict[str, list[float]] = {k: [] for k in runs}
    order = list(runs)
    for i in range(iters):
        for k in order if i % 2 == 0 else reversed(order):
            sync()
            t0 = time.perf_counter()
            runs[k]()
            sync()
            times[k].append(time.perf_counter() - t0)
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--smoke", action="store_true", help="1 x 64 BERT, 2 iterations: seconds")
    a = p.parse_args()
    if a.smoke:
        a.layers, a.hidden, a.batch, a.seq, a.iters, a.threads = 1, 64, 2, 16, 2, a.threads or 1
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=a.hidden, num_hidden_layers=a.layers,
                     num_attention_heads=max(1, a.hidden // 64), intermediate_size=4 * a.hidden,
                     max_position_embeddings=max(512, a.seq))
    plain = BertForPreTraining(cfg)
    wrapped_inner = copy.deepcopy(plain)
    opt_p = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    opt_w = torch.optim.AdamW(wrapped_inner.parameters(), lr=1e-4)
    wrapped = rannc.RaNNCModule(wrapped_inner, opt_w)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq))
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids,
                 next_sentence_label=torch.zeros(a.batch, dtype=torch.long))
    runs = {"plain": step_fn(plain, opt_p, batch), "rannc": step_fn(wrapped, opt_w, batch)}
    times = alternate(runs, a.iters)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"BERT L{a.layers} H{a.hidden}, batch {a.batch} x seq {a.seq}, {a.iters} alternating "
          f"iterations, torch threads {torch.get_num_threads()}")
    for k in runs:
        print(f"{k:6s} median {med[k] * 1e3:8.1f} ms/iter  {a.batch / med[k]:8.2f} samples/s")
    print(f"throughput ratio rannc/plain: {med['plain'] / med['rannc']:.3f}")


if __name__ == "__main__":
    main()
