"""Layer-aligned candidates: splits at the model's own layer boundaries, for the simulator.

Why: phase 2's blocks balance time, not structure, and the stage DP minimises the slowest stage
while the iteration time the simulator predicts also depends on the bubbles, on which stage's
gradient reduction the drain hides, and on where recomputation is needed. The boundary
refinement (`refine.py`) moves boundaries locally; it can stop short of a split along the
model's layers that the simulator prefers (Llama-3-8B at 64 H100: 0.2 % slower than the
FLOPs-balanced layer split). So the planner also costs, with its own tables and simulator,
the splits a layer-wise partitioner would make: the min-max split over layers (its own cost
table), the compute-balanced one (torchtitan's auto-partition, torchgpipe's balance_by_time) and
the equal one (torchtitan's default), each with the candidate's replicas and with uniform
replicas for nearby stage counts dividing the pipeline (under an interleaved schedule: lane
counts, each lane running its v stages). The fastest wins, so a plan is never
predicted slower than those splits of the same layout.

Layers: the repeated modules of the model, found from the components' module paths: the
`prefix.<i>` with the most distinct indices i (`model.layers.3`, `bert.encoder.layer.3`); what runs
before the first is one layer (embeddings), what runs after the last another (norm, head);
components without a module (the model's own glue) join the layer before them.

Index conventions: L layers; S stages; bounds over layers.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from collections.abc import Sequence

import numpy as np

from rannc.atomic.components import AtomicPartition
from rannc.graph.task_graph import TaskGraph
from rannc.schedule import get_spec
from rannc.schedule.spec import past_b_counts, pending_counts
from rannc.stage_dp.refine import Tabler
from rannc.stage_dp.search import (
    Simulated,
    candidate,
    in_flight_counts,
    min_max_bounds,
    runnable_lanes,
    simulate_candidate,
)

_INDEXED = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")
VARIANT_STAGES = 2  # uniform layouts with S / 2 .. 2 S stages, S the candidate's


def layer_of(graph: TaskGraph, atomic: AtomicPartition) -> list[int] | None:
    """Each atomic component's layer (see the module docstring), or None when the model has no
    repeated modules or they do not run one after another in component order."""
    paths = [graph.tasks[c.task].module_path or "" for c in atomic.components]
    found = [_INDEXED.match(p) for p in paths]
    counts = Counter(m.group(1) for m in found if m)
    if not counts:
        return None
    prefix = max(counts, key=lambda p: (len({m.group(2) for m in found if m and m.group(1) == p}),
                                        counts[p]))
    out: list[int] = []
    cur, seen_layer, last_idx = 0, False, -1
    for path, m in zip(paths, found, strict=True):
        if m and m.group(1) == prefix:
            i = int(m.group(2))
            if i < last_idx:
                return None
            if i != last_idx:
                cur = (cur + 1) if out else 0
                last_idx, seen_layer = i, True
        elif path and seen_layer and not path.startswith(prefix + "."):
            cur += 1  # the first component after the last layer's: the head
            seen_layer = False
        out.append(cur)
    n = max(out) + 1
    return out if n >= 3 else None


def min_max_parts(weights: Sequence[float] | np.ndarray, S: int) -> tuple[int, ...] | None:
    """Bounds of the contiguous split of `weights` into S parts whose largest sum is smallest
    (None when there are fewer weights than parts)."""
    L = len(weights)
    if S > L:
        return None
    pre = np.concatenate([[0.0], np.cumsum(np.asarray(weights, dtype=np.float64))])
    h = np.triu(pre[None, 1:] - pre[:L, None])
    h[np.tril_indices(L, -1)] = math.inf
    return min_max_bounds([h] * S)


def equal_parts(L: int, S: int) -> tuple[int, ...] | None:
    """L layers spread evenly over S stages, the first taking one more when S does not divide."""
    if S > L:
        return None
    q, r = divmod(L, S)
    return tuple(i * q + min(i, r) for i in range(S + 1))


def aligned_best(sims: Sequence[Simulated], layers: Sequence[int], comp_time: np.ndarray,
                 tabler: Tabler, late: bool, replicas_forced: bool = False,
                 stages: int | None = None) -> Simulated | None:
    """The fastest layer-aligned variant of `sims` (see the module docstring), costed on the
    layer grouping `layers`; None when none fits. `replicas_forced`: keep each candidate's
    replicas (Config.replicas); `stages`: only that many stages (Config.partition_num)."""
    L = max(layers) + 1
    weight = np.bincount(np.asarray(layers), weights=np.asarray(comp_time, dtype=np.float64),
                         minlength=L)
    best: Simulated | None = None
    # what one layout costs depends on nothing else of its candidate: the candidates of one
    # layout and microbatch count share their uniform variants, costed once (BERT 8 x 256 on
    # 8 V100: 78 distinct of 326)
    seen: set[tuple[str, int, int, int, tuple[int, ...]]] = set()
    for sim in sims:
        c = sim.cand
        # lanes: the device groups (under an interleaved schedule of v chunks each runs v
        # stages, s, s + lanes, ..., with its replicas)
        v = get_spec(c.schedule).chunks
        P, D = len(c.replicas) // v, sum(c.replicas) // v
        layouts = {c.replicas} | (set() if replicas_forced else {
            (D // p,) * (v * p)
            for p in range(max(1 if v == 1 else 2, P // VARIANT_STAGES), VARIANT_STAGES * P + 1)
            if D % p == 0 and v * p <= L and (stages is None or v * p == stages)
            and runnable_lanes(c.schedule, p, c.microbatches)})
        for reps in sorted(layouts):
            if (c.schedule, c.devices, c.copies, c.microbatches, reps) in seen:
                continue
            seen.add((c.schedule, c.devices, c.copies, c.microbatches, reps))
            _io, table = tabler(layers, dataclasses.replace(c, replicas=reps))
            saved = get_spec(c.schedule).held(len(reps), c.microbatches, late).saved_inputs
            # each stage's table for the microbatches it holds, first to last
            counts = reversed(in_flight_counts(c.schedule, len(reps), c.microbatches))
            pend = pending_counts(c.schedule, len(reps), c.microbatches)
            past = past_b_counts(c.schedule, len(reps), c.microbatches)
            tabs = [table(c.devices, c.copies, c.microbatches, n, saved, c.schedule, pending=p,
                          past_b=q) for n, p, q in zip(counts, pend, past, strict=True)]
            splits = {min_max_bounds([t.h[:, :, d] for t, d in zip(tabs, reps, strict=True)]),
                      min_max_parts(weight, len(reps)), equal_parts(L, len(reps))}
            for bounds in sorted(b for b in splits if b is not None):
                got = simulate_candidate(candidate(tabs, c.devices, c.copies, c.microbatches,
                                                   bounds, reps, c.schedule), table, late)
                if got is not None and (best is None or got.time < best.time * (1 - 1e-9)):
                    best = got
    return best


__all__ = ["aligned_best", "equal_parts", "layer_of", "min_max_parts"]
