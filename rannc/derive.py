"""A deployed plan carried over to a newly captured graph of the same model.

When the model is called in another mode (`model.eval()`) or with another input shape (a new
sequence length), torch.export gives a different graph, but the ranks already hold their
stages' parameters and the optimizer steps only those. So rather than planning from scratch,
the new graph's atomic components are placed on the deployed stages: each component goes to
the first stage that holds every parameter it reads and is not before any stage that feeds it,
nor before the stage the plan ran the same work on (the same op of the same module, counted in
order: without that, work without parameters followed its inputs to the earliest stage, and a
new sequence length left BERT's last stage 16 of its 23 components). Every data dependency
then goes forward, and no rank needs a parameter it released. A value that may not cross a stage
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
    cannot = unsplittable(graph)
    tied = _tied_edges(graph, atomic, cannot)
    hints = _planned_stages(graph, atomic, base)
    try:
        stage_of = _placed(graph, atomic, allowed, preds, tied, cannot, hints)
    except RaNNCError:  # the plan's stages cannot be followed: the earliest placement
        stage_of = _placed(graph, atomic, allowed, preds, tied, cannot, [0] * len(hints))
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


def _placed(graph: TaskGraph, atomic: AtomicPartition, allowed: list[set[int]],
            preds: list[set[int]], tied: list[tuple[int, int, str]], cannot: dict[str, str],
            start: list[int]) -> list[int]:
    """Each component on the first stage from `start` on that holds its parameters and is not
    before its inputs; then each unsplittable value's producer on its consumer's stage, and
    again what follows it. Stages only move later (but a start outside a component's holders,
    once), so this ends."""
    stage_of = list(start)
    moved = True
    while moved:
        moved = False
        for comp in atomic.components:  # topological order
            c = comp.index
            lo = max((stage_of[p] for p in preds[c]), default=0)
            if stage_of[c] < lo or stage_of[c] not in allowed[c]:
                want = max(lo, stage_of[c])
                if not any(s >= want for s in allowed[c]):
                    want = lo  # a start no holder of its parameters is at: (once) from lo
                stage_of[c] = _earliest(graph, atomic, c, allowed[c], want,
                                        f"its inputs come from stage {lo}")
                moved = True
        for a, b, v in tied:
            if stage_of[a] < stage_of[b]:
                stage_of[a] = _earliest(graph, atomic, a, allowed[a], stage_of[b],
                                        f"it computes {v} for stage {stage_of[b]}, and {cannot[v]} "
                                        "so it may not cross a stage boundary")
                moved = True
    return stage_of


def _planned_stages(graph: TaskGraph, atomic: AtomicPartition, base: Plan) -> list[int]:
    """Per component of `graph`: the latest stage on which `base` ran the same work as its
    tasks (each task matched to the base graph's task of the same module and op by order of
    occurrence), 0 where nothing matches or the plan has no graph (loaded from a file)."""
    out = [0] * len(atomic.components)
    if base.source is None:
        return out
    b_graph, b_atomic = base.source
    b_stage = {c: st.index for st in base.stages for c in st.components}
    where = {key: b_stage[c] for t, key in _occurrences(b_graph)
             if (c := b_atomic.component_of[t]) >= 0 and c in b_stage}
    for t, key in _occurrences(graph):
        c = atomic.component_of[t]
        if c >= 0:
            out[c] = max(out[c], where.get(key, 0))
    return out


def _occurrences(graph: TaskGraph) -> list[tuple[int, tuple[str, str, int]]]:
    """(task index, (module, op, k)) per task: its k-th occurrence of that op in that module."""
    seen: dict[tuple[str, str], int] = {}
    out = []
    for t, task in enumerate(graph.tasks):
        k = seen[task.module_path, task.op] = seen.get((task.module_path, task.op), -1) + 1
        out.append((t, (task.module_path, task.op, k)))
    return out


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
