"""Phase 2 on a captured graph: the coarsening problem (`CoarsenProblem`) built from a
TaskGraph's atomic components and their costs, solved by the native algorithm
(`rannc.coarsen.blocks.form_blocks`)."""

from __future__ import annotations

import numpy as np

from rannc.atomic.components import AtomicPartition
from rannc.coarsen.blocks import CoarsenProblem, form_blocks
from rannc.graph.task_graph import TaskGraph, ValueKind
from rannc.profile.estimate import GraphCosts, _bytes


def form_blocks_for(graph: TaskGraph, atomic: AtomicPartition, costs: GraphCosts, *,
                    spec_time: np.ndarray, limit: float, opt: float, k: int, bandwidth: float,
                    batch: int) -> list[int]:
    """Each atomic component's block: at most `k` convex blocks in topological order, each
    within `limit` bytes (memory at `batch` rows plus `opt` optimizer state per parameter
    element), balancing `spec_time` (seconds per component) against the bytes cut between
    blocks at `bandwidth`."""
    n = len(atomic.components)
    memory = costs.component_memory(batch) + costs.comp_params * opt
    values = []
    for name, val in graph.values.items():
        if val.kind is not ValueKind.ACTIVATION or not val.is_tensor:
            continue
        pt = graph.producer(name)
        if pt is None or atomic.component_of[pt] < 0:
            continue
        p = atomic.component_of[pt]
        cons = sorted({c for t in graph.consumers(name) for c in atomic.holders[t]} - {p})
        if cons:
            b0, b1 = _bytes(val)
            values.append((p, cons, b0 + b1 * batch))
    prob = CoarsenProblem(n=n, values=values, time=[float(x) for x in spec_time],
                          memory=[float(x) for x in memory], mem_limit=limit, k=min(k, n),
                          bandwidth=bandwidth)
    return list(form_blocks(prob))


__all__ = ["form_blocks_for"]
