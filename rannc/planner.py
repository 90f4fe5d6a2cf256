"""The automatic planner: graph -> blocks -> stages, replicas and microbatches -> Plan.

Pure: it reads a TaskGraph, a cost oracle and a Cluster and returns a Plan; no process group,
no device side effects. Steps (paper section III):
1. costs of every atomic component from the oracle (`rannc.profile`);
2. phase 2, blocks: k-way multilevel coarsening (`rannc.coarsen`);
3. phase 3, Algorithm 2 around Algorithm 1: for pipelines of n whole nodes (n = 1, 2, 4, ...;
   the rest of the cluster replicates the pipeline R times) and microbatch counts doubling
   from min_pipeline, the stage DP (`rannc.stage_dp`) gives the best split for every stage
   count; among all of them we keep the one with the smallest predicted iteration time
   (bubbles and the gradient all-reduce included), not the first one that fits as the paper
   does, since a pipeline over more nodes can be faster than replicating a smaller one.
Forced `partition_num`, `replicas` and `microbatches` narrow the search to them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rannc.atomic.components import AtomicPartition
from rannc.coarsen.blocks import CoarsenProblem, form_blocks
from rannc.config import Config
from rannc.errors import ConfigError, RaNNCError
from rannc.graph.task_graph import TaskGraph, ValueKind
from rannc.plans import Plan, StagePlan, stage_ranks
from rannc.profile.device import Cluster
from rannc.profile.estimate import BlockProfile, GraphCosts, _bytes
from rannc.stage_dp.dp import stage_dp
from rannc.stage_dp.tables import (
    BlockIO,
    MemoryModel,
    StageTables,
    batch_per_replica,
    gpipe_iteration_time,
    stage_tables,
)

log = logging.getLogger(__name__)


class PlanInfeasibleError(RaNNCError):
    """No plan fits device memory; `needed_bytes` is the smallest per-device memory that would."""

    def __init__(self, message: str, needed_bytes: float) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes


@dataclass
class PlanStats:
    """What planning did, for logs and benchmarks."""

    components: int = 0
    blocks: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    candidates: int = 0


@dataclass(frozen=True, slots=True)
class _Candidate:
    time: float
    devices: int
    copies: int
    microbatches: int
    bounds: tuple[int, ...]
    replicas: tuple[int, ...]
    tables: StageTables


def plan_graph(graph: TaskGraph, atomic: AtomicPartition, cluster: Cluster, config: Config, *,
               batch_size: int, oracle: BlockOracle | None = None, costs: GraphCosts | None = None,
               stats: PlanStats | None = None) -> Plan:
    """Plan `graph` (captured at global batch `batch_size`) for `cluster`."""
    stats = stats if stats is not None else PlanStats()
    t0 = time.perf_counter()
    spec = min(cluster.devices, key=lambda d: (d.memory_bytes, d.flops))  # conservative
    limit = spec.memory_bytes if config.mem_limit_gb is None else config.mem_limit_gb * 1e9
    limit *= 1.0 - config.mem_margin
    opt = 2.0 if config.opt_param_factor is None else config.opt_param_factor
    mem = MemoryModel(opt_param_factor=opt, limit=limit, checkpointing=config.checkpointing)
    costs = costs if costs is not None else GraphCosts.of(graph, atomic)
    oracle = oracle or EstimateOracle(costs, cluster)
    world = cluster.size
    stats.components = len(atomic.components)
    stats.seconds["costs"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    b_ref = max(1, math.ceil(batch_size / world))
    block_of = form_blocks_for(graph, atomic, costs, spec_time=oracle.component_time(b_ref),
                               limit=limit, opt=opt, k=config.blocks, bandwidth=spec.link_bandwidth,
                               batch=b_ref)
    k = max(block_of) + 1
    stats.blocks = k
    io = BlockIO.of(graph, atomic, block_of)
    stats.seconds["blocks"] = time.perf_counter() - t1

    t2 = time.perf_counter()
    layouts = _pipeline_layouts(cluster, config)
    mbs = _microbatch_counts(config, batch_size)
    needed = {batch_per_replica(batch_size, R, m, d) for D, R in layouts for m in mbs
              for d in range(1, D + 1)} - {0}
    prof = oracle.block_profile(block_of, sorted(needed))
    stats.seconds["profile"] = time.perf_counter() - t2

    t3 = time.perf_counter()
    best: _Candidate | None = None
    infeasible: list[tuple[StageTables, int]] = []  # kept only while nothing fits, for the error
    for D, R in layouts:
        cross_node = R > 1 or D > cluster.per_node
        ar_bw = cluster.inter_node_bandwidth if cross_node else spec.link_bandwidth
        for m in mbs:
            if batch_per_replica(batch_size, R, m, 1) < 1 or m * R > batch_size:
                continue
            tab = stage_tables(prof, io, mem, batch_size=batch_size, devices=D, copies=R,
                               microbatches=m, link_bw=spec.link_bandwidth, allreduce_bw=ar_bw)
            for cand in _solutions(tab, D, R, m, config):
                stats.candidates += 1
                if best is None or cand.time < best.time * (1 - 1e-9):
                    best = cand
            infeasible = [] if best is not None else [*infeasible, (tab, D)]
    stats.seconds["stage_dp"] = time.perf_counter() - t3
    if best is None:
        smallest = min((_memory_needed(tab, D, config) for tab, D in infeasible), default=math.inf)
        need = smallest / (1.0 - config.mem_margin)
        have = limit / (1.0 - config.mem_margin)
        raise PlanInfeasibleError(
            f"no plan fits: the model needs at least {fmt_bytes(need)} per device (with "
            f"mem_margin {config.mem_margin}) but the devices have {fmt_bytes(have)} "
            f"({spec.name}, {world} devices); use more or larger devices, raise mem_limit_gb, or "
            "relax forced partition_num/replicas/microbatches", needed_bytes=need)
    sched = "gpipe" if config.schedule == "auto" else config.schedule
    out = dataclasses.replace(_to_plan(graph, atomic, best, block_of, world, batch_size),
                              schedule=sched)
    frac = config.extra.get("recompute_fraction")
    if frac is not None:
        out = dataclasses.replace(out, stages=tuple(dataclasses.replace(st, recompute=float(frac))
                                                    for st in out.stages))
    return out


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _pipeline_layouts(cluster: Cluster, config: Config) -> list[tuple[int, int]]:
    """(devices per pipeline, pipeline copies R): pipelines over 1, 2, 4, ... whole nodes
    (Algorithm 2), or what forced replicas imply."""
    world = cluster.size
    if config.replicas is not None:
        per = sum(config.replicas)
        if world % per:
            raise ConfigError(f"replicas {config.replicas} use {per} ranks per pipeline, which does "
                              f"not divide the {world} devices; make sum(replicas) divide {world}")
        return [(per, world // per)]
    out = []
    n = 1
    while n <= cluster.nodes:
        if cluster.nodes % n == 0:
            out.append((cluster.per_node * n, cluster.nodes // n))
        n *= 2
    if config.partition_num is not None:
        out = [(D, R) for D, R in out if D >= config.partition_num]
        if not out:
            raise ConfigError(f"partition_num {config.partition_num} exceeds the {world} devices")
    return out


def _microbatch_counts(config: Config, batch_size: int) -> list[int]:
    if config.microbatches is not None:
        return [config.microbatches]
    out, m = [], max(1, config.min_pipeline)
    while m <= min(config.max_pipeline, batch_size):
        out.append(m)
        m *= 2
    return out or [1]


def _solutions(tab: StageTables, D: int, R: int, m: int, config: Config) -> list[_Candidate]:
    h = tab.h
    if config.replicas is not None:
        return _forced_replicas(tab, D, R, m, tuple(config.replicas))
    s_max = min(h.shape[0], D) if config.partition_num is None else config.partition_num
    sols = stage_dp(h, D, s_max)
    wanted = range(len(sols)) if config.partition_num is None else [config.partition_num - 1]
    out = []
    for s in wanted:
        if s < len(sols) and sols[s].feasible:
            out.append(_candidate(tab, D, R, m, sols[s].bounds, sols[s].replicas))
    return out


def _forced_replicas(tab: StageTables, D: int, R: int, m: int,
                     reps: tuple[int, ...]) -> list[_Candidate]:
    """The best bounds for fixed per-stage replica counts: a 1-D min-max DP over blocks."""
    k = tab.h.shape[0]
    S = len(reps)
    best = np.full((S + 1, k + 1), math.inf)
    arg = np.zeros((S + 1, k + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for s in range(1, S + 1):
        for b in range(s, k + 1):
            vals = [max(best[s - 1, bp], tab.h[bp, b - 1, reps[s - 1]]) for bp in range(s - 1, b)]
            j = int(np.argmin(vals))
            best[s, b], arg[s, b] = vals[j], j + s - 1
    if not math.isfinite(best[S, k]):
        return []
    bounds = [k]
    for s in range(S, 0, -1):
        bounds.append(int(arg[s, bounds[-1]]))
    return [_candidate(tab, D, R, m, tuple(reversed(bounds)), reps)]


def _candidate(tab: StageTables, D: int, R: int, m: int, bounds: Sequence[int],
               reps: Sequence[int]) -> _Candidate:
    idx = [(bounds[i], bounds[i + 1] - 1, reps[i]) for i in range(len(reps))]
    t = gpipe_iteration_time([float(tab.fwd[x]) for x in idx], [float(tab.bwd[x]) for x in idx],
                             [float(tab.allreduce[x]) for x in idx], m)
    return _Candidate(t, D, R, m, tuple(bounds), tuple(reps), tab)


def _memory_needed(tab: StageTables, D: int, config: Config) -> float:
    """The smallest per-device memory any split of this layout needs: min-max over memory."""
    mm = tab.memory_min
    if config.replicas is not None:
        return math.inf
    sols = stage_dp(np.where(np.isfinite(mm), mm, math.inf), D, min(mm.shape[0], D))
    if config.partition_num is not None:
        sols = sols[config.partition_num - 1:config.partition_num]
    return min((s.value for s in sols), default=math.inf)


def _to_plan(graph: TaskGraph, atomic: AtomicPartition, c: _Candidate, block_of: Sequence[int],
             world: int, batch_size: int) -> Plan:
    ranks = stage_ranks(c.replicas, world)
    stages = []
    for s in range(len(c.replicas)):
        lo, hi, d = c.bounds[s], c.bounds[s + 1] - 1, c.replicas[s]
        comps = tuple(i for i, b in enumerate(block_of) if lo <= b <= hi)
        x = (lo, hi, d)
        stages.append(StagePlan(
            index=s, components=comps, ranks=ranks[s], shares=tuple(1.0 / len(ranks[s]) for _ in ranks[s]),
            recompute=bool(c.tables.recompute[x]), param_names=_param_names(graph, atomic, comps),
            predicted={"forward_s": float(c.tables.fwd[x]), "backward_s": float(c.tables.bwd[x]),
                       "allreduce_s": float(c.tables.allreduce[x]),
                       "memory_bytes": float(c.tables.memory[x]),
                       "microbatch_rows": float(c.tables.batch[d]),
                       "first_block": float(lo), "last_block": float(hi)},
            modules=_module_range(graph, atomic, comps)))
    return Plan(stages=tuple(stages), microbatches=c.microbatches, world_size=world,
                fingerprint=graph.fingerprint(), predicted_iteration_time=c.time,
                batch_size=batch_size, blocks=max(block_of) + 1, source=(graph, atomic))


def _param_names(graph: TaskGraph, atomic: AtomicPartition, comps: Sequence[int]) -> tuple[str, ...]:
    names: dict[str, None] = {}
    for c in comps:
        for t in atomic.components[c].tasks:
            for v in graph.tasks[t].inputs:
                val = graph.values[v]
                if val.kind is ValueKind.PARAM and val.target is not None:
                    names[val.target] = None
    return tuple(names)


def _module_range(graph: TaskGraph, atomic: AtomicPartition, comps: Sequence[int]) -> str:
    paths = [graph.tasks[atomic.components[c].task].module_path for c in comps]
    paths = [p for p in paths if p] or ["<top>"]
    return paths[0] if paths[0] == paths[-1] else f"{paths[0]} .. {paths[-1]}"


# -- blocks ------------------------------------------------------------------------------------

def form_blocks_for(graph: TaskGraph, atomic: AtomicPartition, costs: GraphCosts, *,
                    spec_time: np.ndarray, limit: float, opt: float, k: int, bandwidth: float,
                    batch: int) -> list[int]:
    """Phase 2 on this graph: the CoarsenProblem from component costs, then the native algorithm."""
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


# -- oracles -----------------------------------------------------------------------------------

class BlockOracle:
    """What the planner asks a cost oracle (estimate or measure)."""

    def component_time(self, batch: int) -> np.ndarray:
        raise NotImplementedError

    def block_profile(self, block_of: Sequence[int], batch_sizes: Sequence[int]) -> BlockProfile:
        raise NotImplementedError


class EstimateOracle(BlockOracle):
    """Roofline estimates on the cluster's slowest device."""

    def __init__(self, costs: GraphCosts, cluster: Cluster) -> None:
        self.costs = costs
        self.spec = cluster.slowest

    def component_time(self, batch: int) -> np.ndarray:
        return self.costs.component_time(self.spec, batch)

    def block_profile(self, block_of: Sequence[int], batch_sizes: Sequence[int]) -> BlockProfile:
        return self.costs.block_profile(self.spec, block_of, batch_sizes)


# -- the public entry point ---------------------------------------------------------------------

def plan(model: object, args: tuple[object, ...] = (), kwargs: dict[str, object] | None = None, *,
         cluster: Cluster | None = None, config: Config | None = None,
         stats: PlanStats | None = None) -> Plan:
    """Plan `model` called as `model(*args, **kwargs)` with the GLOBAL batch, for `cluster`.

    Pure: captures the model (a `meta`-device model works and allocates nothing), estimates
    costs and searches; no process group, no device side effects. `cluster` defaults to this
    machine's measured device times `dry_run_np` (or 1) devices on one node.
    """
    import torch

    from rannc.atomic.components import atomic_components
    from rannc.graph.capture import capture, flatten_inputs
    from rannc.profile.device import measure_local_device

    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"rannc.plan needs a torch.nn.Module, got {type(model).__name__}")
    cfg = config if config is not None else Config()
    if cluster is None:
        n = cfg.dry_run_np or 1
        cluster = Cluster.homogeneous(measure_local_device(), n=n, per_node=n)
    stats = stats if stats is not None else PlanStats()
    t0 = time.perf_counter()
    cap = capture(model, args, kwargs or {})
    atomic = atomic_components(cap.graph)
    stats.seconds["capture"] = time.perf_counter() - t0
    leaves, layout = flatten_inputs(args, kwargs or {})
    costs = GraphCosts.of(cap.graph, atomic)
    oracle = make_oracle(cfg, cap, atomic, model, leaves, costs, cluster)
    # capture() has refused inputs without a batched tensor, so layout.batch is set
    return plan_graph(cap.graph, atomic, cluster, cfg, batch_size=layout.batch or 0,
                      oracle=oracle, costs=costs, stats=stats)


def make_oracle(cfg: Config, cap: Any, atomic: AtomicPartition, model: Any, leaves: Sequence[Any],
                costs: GraphCosts, cluster: Cluster) -> BlockOracle:
    """`profiler`: `estimate` always; `measure` runs blocks on this process's device (the model
    must be materialised there); `auto` measures when the model's parameters live on a CUDA
    device and estimates otherwise (CPU timings of a busy host mislead more than they help, and
    a meta model cannot run)."""
    import torch

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    use = cfg.profiler
    if use == "auto":
        use = "measure" if device.type == "cuda" else "estimate"
    if use == "estimate":
        return EstimateOracle(costs, cluster)
    from rannc.profile.measure import MeasureOracle

    return MeasureOracle(cap, atomic, model, leaves, device, costs, cluster.slowest,
                         cache_dir=cfg.profile_cache_dir)
