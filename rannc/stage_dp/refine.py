"""Stage boundaries below block level, after phase 3 has chosen a plan.

Why: phase 2 groups the atomic components into k blocks so that the stage DP stays fast, and the
DP can only cut between blocks. With k = 32 blocks a block holds 3 BERT layers at 96 layers and
8 at 256, so a stage boundary cannot fall where the stages would balance best; the plan-quality
study (BENCHMARKS.md, issue 8) found simple partitioners' splits by layer up to 6% faster under
the planner's own cost model. A larger k everywhere costs the DP O(k^2 devices^2) per layout.

How: the plan's S - 1 boundaries are refined in levels, as phase 2's uncoarsening refines a
coarse partition. At each level the components on either side of each boundary (first the two
blocks it separates, then the pieces next to it) are cut into a few runs of about equal time;
everything else in a stage stays one segment, so a level has about S (1 + 2 pieces) segments.
The planner then splits the segments again with the plan's own replica counts, microbatches and
schedule, and keeps the split when the simulator predicts a faster iteration
(`rannc.planner._refine_boundaries`). The next level cuts finer around the boundaries it kept,
until the pieces are single components.

Why any run of segments is a valid stage: list the components block by block, blocks in their
topological order (phase 2 numbers them so) and each block's components in index order (itself
topological). An edge never goes backwards in that list: between blocks the block order is
topological, within a block the index order is. So the graph between the runs of any split of
the list is acyclic: every run is convex and the runs can execute one after another.

Positions: p in 0..n is the boundary before the p-th component of that list (n: the end).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def plan_order(block_of: Sequence[int]) -> list[int]:
    """The components block by block, each block's in index order."""
    return sorted(range(len(block_of)), key=lambda c: (block_of[c], c))


def block_starts(block_of: Sequence[int]) -> list[int]:
    """The position where each block begins in `plan_order`, then n (k + 1 entries)."""
    counts = np.bincount(np.asarray(block_of, dtype=np.int64))
    return [0, *(int(x) for x in np.cumsum(counts))]


def pieces(weight: np.ndarray, lo: int, hi: int, n: int) -> set[int]:
    """Positions strictly inside (lo, hi) cutting weight[lo:hi] (per position, in plan order)
    into at most n runs of about equal weight; every position when the run has <= n components."""
    if hi - lo <= n:
        return set(range(lo + 1, hi))
    w = weight[lo:hi]
    total = float(w.sum())
    if total <= 0:  # nothing to balance: equal counts
        return {lo + (hi - lo) * j // n for j in range(1, n)}
    at = np.searchsorted(np.cumsum(w), total * np.arange(1, n) / n)
    return {lo + int(i) + 1 for i in at} - {hi}


def level_points(weight: np.ndarray, cuts: Sequence[int], windows: Sequence[tuple[int, int]],
                 n: int) -> list[int]:
    """One level's segment boundaries: the stage boundaries `cuts` (0 and the end included),
    each inner boundary's window (lo, hi), and n pieces on either side of the boundary."""
    points = set(cuts)
    for x, (lo, hi) in zip(cuts[1:-1], windows, strict=True):
        points |= {lo, hi} | pieces(weight, lo, x, n) | pieces(weight, x, hi, n)
    return sorted(points)


def segment_of(order: Sequence[int], points: Sequence[int]) -> list[int]:
    """block_of for the segments order[points[j]:points[j + 1]] (points rise from 0 to n)."""
    out = [0] * len(order)
    for j in range(len(points) - 1):
        for pos in range(points[j], points[j + 1]):
            out[order[pos]] = j
    return out
