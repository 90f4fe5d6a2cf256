"""The Plan of a searched (and refined) split: stages as the atomic components of their blocks,
ranks from the replica counts, the recomputed prefix, the user's module names, the predictions.

Index conventions: s stages; bounds[s] .. bounds[s+1]-1 are stage s's blocks (groups of
`block_of`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rannc.atomic.components import AtomicPartition
from rannc.graph.task_graph import TaskGraph
from rannc.plans import Plan, StagePlan, StagePrediction, param_names_of, stage_ranks
from rannc.profile.estimate import GraphCosts
from rannc.stage_dp.search import Simulated, placement


def to_plan(graph: TaskGraph, atomic: AtomicPartition, costs: GraphCosts, best: Simulated,
            block_of: Sequence[int], world: int, batch_size: int, blocks: int | None = None) -> Plan:
    """The plan of `best`, whose bounds index the groups of `block_of`; `blocks`: phase 2's
    block count to report (default: those groups')."""
    c = best.cand
    lane = placement(c)  # stages sharing a lane (interleaved) share its ranks
    lane_ranks = stage_ranks(c.replicas[:max(lane) + 1], world)
    ranks = [lane_ranks[lane[s]] for s in range(len(c.replicas))]
    stages = []
    for s in range(len(c.replicas)):
        lo, hi, d = c.bounds[s], c.bounds[s + 1] - 1, c.replicas[s]
        comps = tuple(i for i, b in enumerate(block_of) if lo <= b <= hi)
        rows = float(c.batch[d])
        stages.append(StagePlan(
            index=s, components=comps, ranks=ranks[s], shares=tuple(1.0 / len(ranks[s]) for _ in ranks[s]),
            recompute=component_fraction(costs, comps, best.recompute[s], rows),
            param_names=param_names_of(graph, atomic, comps),
            predicted=StagePrediction(
                forward_s=best.fwd[s], backward_s=best.bwd[s], allreduce_s=best.allreduce[s],
                memory_bytes=best.memory[s], microbatch_rows=rows, in_flight=best.in_flight[s],
                recompute_memory_fraction=best.recompute[s], recompute_s=best.recompute_s[s],
                backward_weight_s=best.wgrad[s], first_block=lo, last_block=hi,
                selective_s=best.selective_s[s]),
            modules=module_range(graph, atomic, comps), selective=best.selective[s]))
    return Plan(stages=tuple(stages), microbatches=c.microbatches, world_size=world,
                fingerprint=graph.fingerprint(), schedule=c.schedule,
                predicted_iteration_time=best.time, batch_size=batch_size,
                blocks=max(block_of) + 1 if blocks is None else blocks, source=(graph, atomic))


def component_fraction(costs: GraphCosts, comps: Sequence[int], f: float, rows: float) -> float:
    """The runtime recomputes a prefix of a stage's components: the shortest prefix holding at
    least fraction f of the stage's kept activation memory, as a fraction of its components."""
    if f <= 0 or not comps:
        return 0.0
    if f >= 1:
        return 1.0
    kept = (costs.component_memory(rows) - 2 * costs.comp_params)[list(comps)]
    total = float(kept.sum())
    if total <= 0:
        return 1.0
    c = int(np.searchsorted(np.cumsum(kept) / total, f - 1e-12)) + 1
    return min(c, len(comps)) / len(comps)


def module_range(graph: TaskGraph, atomic: AtomicPartition, comps: Sequence[int]) -> str:
    """The user's modules a run of components covers, "first .. last"."""
    paths = [graph.tasks[atomic.components[c].task].module_path for c in comps]
    paths = [p for p in paths if p] or ["<top>"]
    return paths[0] if paths[0] == paths[-1] else f"{paths[0]} .. {paths[-1]}"


__all__ = ["component_fraction", "module_range", "to_plan"]
