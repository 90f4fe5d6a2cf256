"""A deployed plan carried over to a newly captured graph of the same model.

When the model is called in another mode (`model.eval()`) or with another input shape (a new
sequence length), torch.export gives a different graph, but the ranks already hold their
stages' parameters and the optimizer steps only those. So rather than planning from scratch,
the new graph's atomic components are placed on the deployed stages: each component goes to
the first stage that holds every parameter it reads and is not before any stage that feeds it
(a component without parameters simply follows its inputs). Every data dependency then goes
forward, and no rank needs a parameter it released. Replicas, shares, microbatches and the
schedule stay the plan's.
"""

from __future__ import annotations

import dataclasses

from rannc.atomic.components import AtomicPartition
from rannc.errors import RaNNCError
from rannc.graph.task_graph import TaskGraph
from rannc.plans import Plan, param_names_of


def derive_plan(graph: TaskGraph, atomic: AtomicPartition, base: Plan, *,
                recompute: bool = True) -> Plan:
    """`base`'s stages, ranks and parameter placement for `graph` (same model, another
    capture). `recompute=False` drops recomputation (forward-only use)."""
    holders = base.holder_stages()
    n_stages = len(base.stages)
    stage_of = [0] * len(atomic.components)
    preds: list[set[int]] = [set() for _ in atomic.components]
    for a, b in atomic.component_edges(graph):
        preds[b].add(a)
    for comp in atomic.components:  # topological order
        c = comp.index
        lo = max((stage_of[p] for p in preds[c]), default=0)
        allowed = set(range(n_stages))
        names = param_names_of(graph, atomic, [c])
        for n in names:
            if n not in holders:
                raise RaNNCError(f"parameter {n} is read by the new capture but no stage of the "
                                 "deployed plan holds it; construct a new RaNNCModule")
            allowed &= set(holders[n])
        fit = sorted(s for s in allowed if s >= lo)
        if not fit:
            task = graph.tasks[comp.task]
            raise RaNNCError(
                f"cannot place {task.op} in '{task.module_path}' of the new capture on the deployed "
                f"stages: it reads {sorted(names)} held by stages {sorted(allowed)}, but its inputs "
                f"come from stage {lo}; construct a new RaNNCModule for this mode or shape")
        stage_of[c] = fit[0]
    stages = []
    for st in base.stages:
        comps = tuple(c for c in range(len(stage_of)) if stage_of[c] == st.index)
        stages.append(dataclasses.replace(
            st, components=comps, param_names=param_names_of(graph, atomic, comps),
            recompute=st.recompute if recompute else 0.0,
            selective=st.selective and recompute, predicted=None))
    return dataclasses.replace(base, stages=tuple(stages), fingerprint=graph.fingerprint(),
                               predicted_iteration_time=None, source=(graph, atomic))


__all__ = ["derive_plan"]
