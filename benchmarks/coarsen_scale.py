"""Wall time of block formation (paper III-B) at the scale of a 256-layer BERT.

Builds the synthetic BERT-like component graph of tests/coarsen_graphs.py (58
atomic components per layer: ~15,000 for 256 layers, the paper's example) and
times the native `form_blocks` for several k, then the Python reference on a
~1,500-component graph (25 layers) and checks that both agree there. Prints, per
run, the blocks formed, their balance (largest block time / mean) and the bytes
sent between blocks.

    PYTHONPATH=. .venv/bin/python benchmarks/coarsen_scale.py
    PYTHONPATH=. .venv/bin/python benchmarks/coarsen_scale.py --layers 512 --ks 16 64
    PYTHONPATH=. .venv/bin/python benchmarks/coarsen_scale.py --smoke   # tiny graphs, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the graph generator

from coarsen_graphs import bert_like  # noqa: E402

from rannc.coarsen.blocks import (  # noqa: E402
    CoarsenProblem,
    block_comm_bytes,
    form_blocks,
    form_blocks_reference,
)


def timed(
    f: Callable[[CoarsenProblem], list[int]], p: CoarsenProblem, repeat: int
) -> tuple[float, list[int]]:
    """Median wall seconds over `repeat` runs, and the result."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = f(p)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def describe(p: CoarsenProblem, block_of: list[int]) -> str:
    m = max(block_of) + 1
    per_block = [0.0] * m
    for c, b in enumerate(block_of):
        per_block[b] += p.time[c]
    balance = max(per_block) / (sum(per_block) / m)
    return f"m={m:<5} max/mean time {balance:.2f}  comm {block_comm_bytes(p, block_of):.3g} B"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=256, help="layers of the large graph (default 256)")
    ap.add_argument("--ks", type=int, nargs="+", default=[8, 32, 128, 1024], help="block counts")
    ap.add_argument("--ref-layers", type=int, default=25, help="layers of the reference's graph")
    ap.add_argument("--repeat", type=int, default=3, help="native runs per k (median)")
    ap.add_argument("--smoke", action="store_true", help="8 and 3 layers, k 8 and 32, one run")
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.ks, args.ref_layers, args.repeat = 8, [8, 32], 3, 1

    big = bert_like(args.layers)
    print(f"native form_blocks: {big.n} components, {len(big.values)} values")
    for k in args.ks:
        p = dataclasses.replace(big, k=k)
        secs, out = timed(form_blocks, p, args.repeat)
        print(f"  k={k:<5} {secs:7.3f} s   {describe(p, out)}")
    tight = dataclasses.replace(big, k=32, mem_limit=sum(big.memory) / 200)
    secs, out = timed(form_blocks, tight, args.repeat)
    print(f"  k=32, mem_limit total/200: {secs:.3f} s   {describe(tight, out)}")

    small = bert_like(args.ref_layers, k=16)
    print(f"reference form_blocks_reference: {small.n} components")
    ref_secs, ref_out = timed(form_blocks_reference, small, 1)
    nat_secs, nat_out = timed(form_blocks, small, args.repeat)
    print(f"  k=16  reference {ref_secs:.2f} s, native {nat_secs:.4f} s, identical: {ref_out == nat_out}")


if __name__ == "__main__":
    main()
