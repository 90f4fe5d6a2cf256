"""The captured graph against the eager layers, in one process, at a pipeline microbatch's size.

    PYTHONPATH=. python benchmarks/graph_vs_eager.py --model resnet --batch 8

Why: under torch.distributed.pipelining the same stages' operators ran 10 to 25 % faster than
under rannc on a 2-rank ResNet (BENCHMARKS.md, "Runtime against torch.distributed.pipelining
with a core per rank"). This asks whether rannc's graph itself is slower: the model of
`runtime_peers.py` (same sizes) trained as plain PyTorch and through `rannc.RaNNCModule` in one
process (its whole captured graph as one stage, one microbatch) on the same batch, one thread,
forward and backward alternating ABBA after a warm-up. Prints the median ms of each, and the
median and quartiles of the per-pair ratios rannc / plain.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

import rannc

sys.path.insert(0, str(Path(__file__).parent))
from runtime_peers import add_model_args, batches, build  # noqa: E402
from single_stage_overhead import alternate  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--model", default="resnet", choices=["resnet", "bert"])
    p.add_argument("--batch", type=int, default=8, help="rows (a microbatch of the 2-rank runs)")
    p.add_argument("--iters", type=int, default=30)
    a = p.parse_args()
    torch.set_num_threads(1)
    wrapper, _layers, _loss = build(a.model, a)
    x, y = batches(a.model, a, 1)[0]
    plain = copy.deepcopy(wrapper)
    wrapped = rannc.RaNNCModule(copy.deepcopy(wrapper))

    def step(m: torch.nn.Module) -> Callable[[], None]:
        def f() -> None:
            m(x, y).backward()
            for q in m.parameters():
                q.grad = None
        return f

    times = alternate({"plain": step(plain), "rannc": step(wrapped)}, a.iters, warmup=3)
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    pairs = sorted(r / q for r, q in zip(times["rannc"], times["plain"], strict=True))
    q1, q3 = pairs[len(pairs) // 4], pairs[3 * len(pairs) // 4]
    print(f"{a.model} batch {a.batch}: plain {med['plain']:.2f} ms, rannc {med['rannc']:.2f} ms "
          f"(medians); rannc / plain per pair: median {statistics.median(pairs):.3f} "
          f"(quartiles {q1:.3f} to {q3:.3f})")


if __name__ == "__main__":
    main()
