"""A deployed plan carried over to a newly captured graph of the same model.

When the model is called in another mode (`model.eval()`) or with another input shape (a new
sequence length), torch.export gives a different graph, but the ranks already hold their
stages' parameters and the optimizer steps only those. So rather than planning from scratch,
the new graph's atomic components are placed on the deployed stages: each component goes to
the first stage that holds every parameter it reads and is not before any stage that feeds it
(a component without parameters simply follows its inputs). Every data dependency then goes
forward, and no rank needs a parameter it released. A value that may not cross a stage
boundary (`rannc.graph.row_mixing.unsplittable`: a mixture-of-experts layer's sorted tokens)
keeps its producer on its consumers' stage: the producer moves later, and what follows it with
it. Replicas, shares, microbatches and the schedule stay the plan's.
"""

from __future__ import annotations

import dataclasses

from rannc.atomic.components import AtomicPartition
from rannc.errors import RaNNCError
from rannc.graph.row_mixing import unsplittable
from rannc.graph.task_graph import TaskGraph
from rannc.plans import Plan, param_names_of


def derive_plan(graph: TaskGraph, atomic: AtomicPartition, base: Plan, *,
                recompute: bool = True) -> Plan:
    """`base`'s stages, ranks and parameter placement for `graph` (same model, another
    capture). `recompute=False` drops recomputation (forward-only use)."""
    holders = base.holder_stages()
    n_stages = len(base.stages)
    allowed: list[set[int]] = []
    preds: list[set[int]] = [set() for _ in atomic.components]
    for a, b in atomic.component_edges(graph):
        preds[b].add(a)
    for comp in atomic.components:
        ok = set(range(n_stages))
        for n in param_names_of(graph, atomic, [comp.index]):
            if n not in holders:
                raise RaNNCError(f"parameter {n} is read by the new capture but no stage of the "
                                 "deployed plan holds it; construct a new RaNNCModule")
            ok &= set(holders[n])
        allowed.append(ok)
    # Each component on the first stage that holds its parameters and is not before its
    # inputs; then each unsplittable value's producer on its consumer's stage, and again what
    # follows it. Stages only move later, so this ends.
    cannot = unsplittable(graph)
    tied = _tied_edges(graph, atomic, cannot)
    stage_of = [0] * len(atomic.components)
    moved = True
    while moved:
        moved = False
        for comp in atomic.components:  # topological order
            c = comp.index
            lo = max((stage_of[p] for p in preds[c]), default=0)
            if stage_of[c] < lo or stage_of[c] not in allowed[c]:
                stage_of[c] = _earliest(graph, atomic, c, allowed[c], lo,
                                        f"its inputs come from stage {lo}")
                moved = True
        for a, b, v in tied:
            if stage_of[a] < stage_of[b]:
                stage_of[a] = _earliest(graph, atomic, a, allowed[a], stage_of[b],
                                        f"it computes {v} for stage {stage_of[b]}, and {cannot[v]} "
                                        "so it may not cross a stage boundary")
                moved = True
    stages = []
    for st in base.stages:
        comps = tuple(c for c in range(len(stage_of)) if stage_of[c] == st.index)
        # The stage keeps every parameter it holds, read by the new graph here or not: the
        # holders of a parameter are the ranks that sum its gradient and step their copies.
        # (With only the ones read here, a tied weight the new graph reads on fewer stages -
        # BART's shared embedding, ALBERT's shared layer - was reduced over fewer ranks, and
        # the others stepped their copies without its gradient: wrong and diverging.)
        assert set(param_names_of(graph, atomic, comps)) <= set(st.param_names)
        stages.append(dataclasses.replace(
            st, components=comps,
            recompute=st.recompute if recompute else 0.0,
            selective=st.selective and recompute, predicted=None))
    return dataclasses.replace(base, stages=tuple(stages), fingerprint=graph.fingerprint(),
                               predicted_iteration_time=None, source=(graph, atomic))


def _earliest(graph: TaskGraph, atomic: AtomicPartition, c: int, allowed: set[int], lo: int,
              why: str) -> int:
    """The first stage from `lo` on that holds every parameter component `c` reads."""
    fit = sorted(s for s in allowed if s >= lo)
    if not fit:
        task = graph.tasks[atomic.components[c].task]
        raise RaNNCError(
            f"cannot place {task.op} in '{task.module_path}' of the new capture on the deployed "
            f"stages: it reads {sorted(param_names_of(graph, atomic, [c]))} held by stages "
            f"{sorted(allowed)}, but {why}; construct a new RaNNCModule for this mode or shape")
    return fit[0]


def _tied_edges(graph: TaskGraph, atomic: AtomicPartition,
                cannot: dict[str, str]) -> list[tuple[int, int, str]]:
    """(producer, consumer, value) for each value in `cannot` read by another component than
    its producer's (constant tasks are cloned where read: never tied)."""
    out: set[tuple[int, int, str]] = set()
    for comp in atomic.components:
        for u in comp.tasks:
            for v in graph.tasks[u].inputs:
                p = graph.producer(v) if v in cannot else None
                if p is None or atomic.component_of[p] < 0:
                    continue
                if atomic.component_of[p] != comp.index:
                    out.add((atomic.component_of[p], comp.index, v))
    return sorted(out)


__all__ = ["derive_plan"]
