"""Config.compile (torch.compile of each stage's graph) against rannc's eager stages, on CPU.

    python benchmarks/compile_stages.py --layers 2 --hidden 128 --batch 8 --seq 64 --iters 10
    python benchmarks/compile_stages.py --smoke   # a tiny BERT, 2 iterations

One process (one stage): two copies of the same BERT, wrapped with compile=False and
compile=True, train with AdamW on the same batch; iterations alternate in ABBA order after a
warm-up (which holds capture and compilation: torch.compile's first calls are not timed), as in
single_stage_overhead.py. Prints ms/iteration of each and the speed-up (eager / compiled).
Inductor on CPU needs a C++ compiler (g++ here).
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import BertConfig, BertForPreTraining

sys.path.insert(0, str(Path(__file__).resolve().parent))
from single_stage_overhead import alternate, step_fn  # noqa: E402

import rannc  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: leave as is)")
    p.add_argument("--smoke", action="store_true", help="1 x 32 BERT, 2 iterations")
    a = p.parse_args()
    if a.smoke:
        a.layers, a.hidden, a.batch, a.seq, a.iters = 1, 32, 2, 8, 2
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=1024, hidden_size=a.hidden, num_hidden_layers=a.layers,
                     num_attention_heads=max(1, a.hidden // 64), intermediate_size=4 * a.hidden,
                     max_position_embeddings=max(128, a.seq), hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    eager = BertForPreTraining(cfg)
    compiled = copy.deepcopy(eager)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-4)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=1e-4)
    wrapped_e = rannc.RaNNCModule(eager, opt_e)
    wrapped_c = rannc.RaNNCModule(compiled, opt_c, compile=True)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq))
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids,
                 next_sentence_label=torch.zeros(a.batch, dtype=torch.long))
    runs = {"eager": step_fn(wrapped_e, opt_e, batch), "compile": step_fn(wrapped_c, opt_c, batch)}
    t0 = time.perf_counter()
    times = alternate(runs, a.iters, warmup=3)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"BERT L{a.layers} H{a.hidden}, batch {a.batch} x seq {a.seq}, {a.iters} alternating "
          f"iterations, torch threads {torch.get_num_threads()} ({time.perf_counter() - t0:.0f} s "
          "in all, warm-up and compilation included)")
    for k in runs:
        print(f"{k:8s} median {med[k] * 1e3:8.1f} ms/iter")
    print(f"speed-up compile=True / eager stages: {med['eager'] / med['compile']:.2f}x")


if __name__ == "__main__":
    main()
