"""Splits chosen elsewhere (a peer partitioner's, a layer-equal one), costed exactly as the
planner costs its own: the same oracle, memory model, recomputation and simulator, and the same
search over microbatch counts and schedules, so two partitioners' splits differ only in the
split (`benchmarks/plan_quality.py`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from rannc.atomic.components import AtomicPartition
from rannc.config import Config
from rannc.errors import ConfigError, PlanInfeasibleError
from rannc.graph.task_graph import TaskGraph
from rannc.plans import Plan
from rannc.profile.device import Cluster
from rannc.profile.estimate import GraphCosts, runs_fused_kernels
from rannc.profile.oracle import BlockOracle, EstimateOracle
from rannc.schedule import get_spec
from rannc.stage_dp.assemble import to_plan
from rannc.stage_dp.search import (
    Simulated,
    TableCache,
    candidate,
    fmt_bytes,
    late_pass,
    memory_model,
    microbatch_counts,
    searched_schedules,
    simulate_candidate,
)
from rannc.stage_dp.tables import BlockIO, batch_per_replica


def plan_splits(graph: TaskGraph, atomic: AtomicPartition, cluster: Cluster, config: Config, *,
                batch_size: int, block_of: Sequence[int],
                splits: Sequence[tuple[Sequence[int], Sequence[int]]],
                oracle: BlockOracle | None = None, costs: GraphCosts | None = None) -> list[Plan | None]:
    """Plans that run splits chosen elsewhere, costed as `plan_graph` costs its own.

    `block_of` groups the atomic components into blocks in topological order (e.g. one block per
    model layer); a split (bounds, replicas) puts blocks bounds[s] .. bounds[s+1]-1 on stage s with
    replicas[s] devices, one pipeline over the whole (homogeneous) cluster. The oracle, memory
    model, recomputation and simulator are the planner's, and so is the search over microbatch
    counts and schedules: each split gets the fastest that fits (None: none fits), so two
    partitioners' splits differ only in the split. The stage tables are shared by the splits.
    """
    if not splits:
        return []
    k = max(block_of) + 1
    for bounds, replicas in splits:
        S = len(replicas)
        if (len(bounds) != S + 1 or bounds[0] != 0 or bounds[-1] != k
                or any(b >= c for b, c in zip(bounds, bounds[1:], strict=False))):
            raise ConfigError(f"split bounds {list(bounds)} must rise strictly from 0 to the {k} "
                              f"blocks, one more entry than the {S} stages of replicas {list(replicas)}")
        if sum(replicas) != cluster.size or min(replicas) < 1 or not cluster.is_homogeneous:
            raise ConfigError(f"replicas {list(replicas)} must be positive and use the {cluster.size} "
                              "devices of a homogeneous cluster")
    spec, mem = memory_model(cluster, config, len(graph.tasks))
    costs = costs if costs is not None else \
        GraphCosts.of(graph, atomic, fused=runs_fused_kernels(cluster))
    oracle = oracle or EstimateOracle(costs, cluster)
    D, R = cluster.size, 1
    width = max(max(r) for _, r in splits)  # tables only up to the replica counts asked for
    mbs = [m for m in microbatch_counts(config, batch_size) if m <= batch_size]
    prof = oracle.block_profile(block_of, sorted({batch_per_replica(batch_size, R, m, d)
                                                  for m in mbs for d in range(1, width + 1)}))
    io = BlockIO.of(graph, atomic, block_of)
    late = late_pass(graph)
    best: list[Simulated | None] = [None] * len(splits)
    for m in mbs:  # one microbatch count's tables at a time: they are (blocks^2 x width) each
        table = TableCache(prof, io, mem, cluster, batch_size, spec.link_bandwidth, width=width)
        for sched in searched_schedules(config, one_stage_per_rank=True):
            for i, (bounds, replicas) in enumerate(splits):
                held = get_spec(sched).held(len(replicas), m, late)
                tab = table(D, R, m, held.in_flight, held.saved_inputs, sched, pending=held.pending)
                ref = simulate_candidate(candidate([tab] * len(replicas), D, R, m, bounds, replicas,
                                                   sched), table, late)
                old = best[i]
                if ref is not None and (old is None or ref.time < old.time * (1 - 1e-9)):
                    best[i] = ref
    # costed with ZeRO-1 (memory_model reads config.zero_stage): the plan says so, as plan_graph's
    zero = 1 if config.zero_stage == 1 else 0
    return [None if b is None else dataclasses.replace(
        to_plan(graph, atomic, costs, b, block_of, cluster.size, batch_size), zero_stage=zero)
            for b in best]


def plan_split(graph: TaskGraph, atomic: AtomicPartition, cluster: Cluster, config: Config, *,
               batch_size: int, block_of: Sequence[int], bounds: Sequence[int],
               replicas: Sequence[int], oracle: BlockOracle | None = None,
               costs: GraphCosts | None = None) -> Plan:
    """`plan_splits` for one split; raises PlanInfeasibleError when it fits no microbatch count."""
    (out,) = plan_splits(graph, atomic, cluster, config, batch_size=batch_size, block_of=block_of,
                         splits=[(bounds, replicas)], oracle=oracle, costs=costs)
    if out is None:
        _, mem = memory_model(cluster, config, len(graph.tasks))
        raise PlanInfeasibleError(
            f"the split {list(bounds)} with replicas {list(replicas)} fits no microbatch count "
            f"within {fmt_bytes(mem.limit)} per device ({cluster.slowest.name}); use more "
            "replicas or stages, or larger devices", needed_bytes=math.inf)
    return out


__all__ = ["plan_split", "plan_splits"]
