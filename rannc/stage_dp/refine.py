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
(`refine_boundaries`). The next level cuts finer around the boundaries it kept,
until the pieces are single components.

Why any run of segments is a valid stage: list the components block by block, blocks in their
topological order (phase 2 numbers them so) and each block's components in index order (itself
topological). An edge never goes backwards in that list: between blocks the block order is
topological, within a block the index order is. So the graph between the runs of any split of
the list is acyclic: every run is convex and the runs can execute one after another.

Positions: p in 0..n is the boundary before the p-th component of that list (n: the end).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from rannc.atomic.components import AtomicPartition
from rannc.graph.task_graph import TaskGraph
from rannc.profile.device import Cluster
from rannc.profile.oracle import BlockOracle
from rannc.schedule import get_spec
from rannc.stage_dp.memory import MemoryModel
from rannc.stage_dp.search import (
    Candidate,
    Simulated,
    TableCache,
    candidate,
    simulate_candidate,
    split_options,
)
from rannc.stage_dp.tables import BlockIO, ValueUses, batch_per_replica

REFINED = 4  # plans, the fastest at block level, whose boundaries are refined
PIECES = 8  # runs each side of a stage boundary is cut into per refinement level
LEVELS = 16  # refinement levels at most (each narrows the windows about PIECES-fold)


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


@dataclass(frozen=True, slots=True)
class Tabler:
    """Stage tables for any grouping of the components: what the boundary refinement needs."""

    graph: TaskGraph
    atomic: AtomicPartition
    oracle: BlockOracle
    mem: MemoryModel
    cluster: Cluster
    batch_size: int
    link_bw: float
    uses: ValueUses

    def __call__(self, block_of: Sequence[int], c: Candidate) -> tuple[BlockIO, TableCache]:
        """Tables over `block_of`'s groups for candidate `c`'s layout, only for its replica
        counts (and only their batch sizes profiled)."""
        reps = frozenset(c.replicas)
        sizes = sorted({batch_per_replica(self.batch_size, c.copies, c.microbatches, d) for d in reps})
        io = BlockIO.of(self.graph, self.atomic, block_of, self.uses)
        return io, TableCache(self.oracle.block_profile(block_of, sizes), io, self.mem,
                              self.cluster, self.batch_size, self.link_bw, width=max(reps),
                              only=reps)


def distinct(sims: Sequence[Simulated]) -> list[Simulated]:
    """The first of each (block bounds, devices per stage over all copies, microbatches,
    schedule): layouts that differ only in how many pipeline copies share those devices cost
    nearly the same, so the few refinements are spent on different splits instead."""
    seen: set[tuple[object, ...]] = set()
    out = []
    for r in sims:
        c = r.cand
        key = (c.bounds, tuple(d * c.copies for d in c.replicas), c.microbatches, c.schedule)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def with_each_schedule(sims: Sequence[Simulated], n: int = REFINED,
                       each: int | None = None) -> list[Simulated]:
    """The first `n` of `distinct(sims)`, then the first `each` (default `n`) of each
    schedule's not among them: the plans `refine_best` refines (and, one each, the planner
    aligns to the layers). The block-level time can rank a schedule's plans far
    behind the others where whole blocks suit it worst (zero_bubble, whose every stage holds S
    microbatches, fills the memory and recomputes on coarse blocks), while its refined plan
    wins: Llama-3-8B on 8 H100 with max_pipeline 64, whose 8 stages x 1 under zero_bubble are
    56.41 s at block level, third of that schedule's and not among the first 4 distinct plans,
    and 48.35 s refined, against 50.02 s for the best of the first 4 refined (scp, 4 stages x 2,
    without ZeRO-1). The price: up to n refinements per schedule searched."""
    first = distinct(sims)
    out = first[:n]
    for sched in dict.fromkeys(r.cand.schedule for r in first):
        out += [r for r in first if r.cand.schedule == sched][:n if each is None else each]
    return list({id(r): r for r in out}.values())


def refine_boundaries(best: Simulated, block_of: Sequence[int], io: BlockIO,
                      comp_time: np.ndarray, tabler: Tabler,
                      late: bool) -> tuple[Simulated, list[int], BlockIO]:
    """Move the stage boundaries of `best` below block level: same replicas, microbatches and
    schedule; a finer split is kept only when the simulator predicts a faster iteration, so
    the plan never gets slower. Returns the plan, the grouping its bounds index, and that
    grouping's BlockIO."""
    c = best.cand
    S = len(c.replicas)
    out = (best, list(block_of), io)
    if S == 1:
        return out
    order = plan_order(block_of)
    weight = np.asarray(comp_time, dtype=np.float64)[order]
    starts = block_starts(block_of)
    cuts = [starts[b] for b in c.bounds]
    windows = [(starts[b - 1], starts[b + 1]) for b in c.bounds[1:-1]]
    saved = get_spec(c.schedule).held(S, c.microbatches, late).saved_inputs
    for _ in range(LEVELS):
        points = level_points(weight, cuts, windows, PIECES)
        seg_of = segment_of(order, points)
        seg_io, table = tabler(seg_of, c)
        # each stage costed with the microbatches it really holds in flight (as
        # `simulate_candidate` does), not the search's common bound: a later 1F1B stage holds
        # fewer and recomputes less
        pend = best.pending or (0,) * len(best.in_flight)
        past = best.past_b or (0,) * len(best.in_flight)
        tabs = [table(c.devices, c.copies, c.microbatches, n, saved, c.schedule, pending=p,
                      past_b=q) for n, p, q in zip(best.in_flight, pend, past, strict=True)]
        mine = tuple(points.index(x) for x in cuts)
        hs = [t.h[:, :, d] for t, d in zip(tabs, c.replicas, strict=True)]
        refs = [(r, b) for b in split_options(hs, c.schedule) if b != mine
                and (r := simulate_candidate(candidate(tabs, c.devices, c.copies, c.microbatches,
                                                       b, c.replicas, c.schedule), table, late))]
        if refs:
            ref, bounds = min(refs, key=lambda rb: rb[0].time)
            # the plan so far, costed on these same groups unless that cannot change its cost
            now = out[0] if tabler.oracle.additive else simulate_candidate(candidate(
                tabs, c.devices, c.copies, c.microbatches, mine, c.replicas, c.schedule),
                table, late)
            if now is None or ref.time < now.time * (1 - 1e-9):
                out = (ref, seg_of, seg_io)
                cuts = [points[b] for b in bounds]
        # the next level looks between the segments on either side of each boundary
        where = {p: j for j, p in enumerate(points)}
        windows = [(points[where[x] - 1], points[where[x] + 1]) for x in cuts[1:-1]]
        if all(x - lo <= 1 and hi - x <= 1 for x, (lo, hi) in zip(cuts[1:-1], windows, strict=True)):
            break  # single components either side of every boundary: nothing finer to try
    return out


def refine_best(sims: Sequence[Simulated], block_of: Sequence[int], io: BlockIO,
                comp_time: np.ndarray, tabler: Tabler, late: bool, enabled: bool = True,
                steps: Callable[[list[Simulated]], Iterable[Simulated]] = iter,
                ) -> tuple[Simulated, list[int], BlockIO, dict[str, float]]:
    """The fastest after refining the boundaries of the first `REFINED` distinct plans of
    `sims` (the winner first) and each schedule's best (`with_each_schedule`), ties to the
    earlier. Refining only the winner can miss a plan whose block-level split was further from
    its own best split (BERT 256x2048 at 32 devices: 13.68 s refined from the winner, 13.34 s
    from the fourth). `enabled=False`: the winner as it is, stages as runs of whole blocks as
    the paper plans them (benchmarks compare). Also returns each schedule's fastest refined
    time (what its layer-aligned plan is held against: `planner._layer_aligned`)."""
    best: tuple[Simulated, list[int], BlockIO] | None = None
    own: dict[str, float] = {}
    for sim in steps(with_each_schedule(sims) if enabled else distinct(sims)[:1]):
        got = refine_boundaries(sim, block_of, io, comp_time, tabler, late) if enabled else \
            (sim, list(block_of), io)
        s = sim.cand.schedule
        own[s] = min(own.get(s, math.inf), got[0].time)
        if best is None or got[0].time < best[0].time * (1 - 1e-9):
            best = got
    if best is None:
        raise ValueError("refine_best needs at least one plan")
    return (*best, own)
