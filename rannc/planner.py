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
   does, since a pipeline over more nodes can be faster than replicating a smaller one;
4. the fastest few plans move their stage boundaries below block level, down to single atomic
   components, keeping their replicas, microbatches and schedule (`rannc.stage_dp.refine`): k
   blocks keep the stage DP fast but are coarser than a large model's layers. The simulator
   decides, so a refined plan is never predicted slower than the plan it came from.
Forced `partition_num`, `replicas` and `microbatches` narrow the search to them.
"""

from __future__ import annotations

import dataclasses
import functools
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
from rannc.errors import ConfigError, PlanInfeasibleError, RaNNCError
from rannc.graph.task_graph import TaskGraph, ValueKind
from rannc.hostmem import rank_overhead
from rannc.plans import Plan, StagePlan, check_replicas_divide, param_names_of, stage_ranks
from rannc.profile.device import Cluster, DeviceSpec
from rannc.profile.estimate import BlockProfile, GraphCosts, _bytes, runs_fused_kernels
from rannc.profile.oracle import BlockOracle, EstimateOracle
from rannc.progress import NO_PROGRESS, Progress
from rannc.schedule import (
    FILL_DRAIN,
    SCHEDULES,
    StageCosts,
    chain,
    get_spec,
    in_flight,
    make_schedule,
    simulate,
)
from rannc.stage_dp.dp import stage_dp, stage_dp_by_position
from rannc.stage_dp.hetero import HeteroDevices
from rannc.stage_dp.refine import block_starts, level_points, plan_order, segment_of
from rannc.stage_dp.shares import finish_time, whale_shares
from rannc.stage_dp.tables import (
    BlockIO,
    MemoryModel,
    StageTables,
    ValueUses,
    batch_per_replica,
    gpipe_iteration_time,
    stage_tables,
    static_memory,
)

log = logging.getLogger(__name__)


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
    schedule: str


_FINER_BLOCKS = 2  # times the planner doubles k when nothing fits at the configured k


def plan_graph(graph: TaskGraph, atomic: AtomicPartition, cluster: Cluster, config: Config, *,
               batch_size: int, oracle: BlockOracle | None = None, costs: GraphCosts | None = None,
               stats: PlanStats | None = None, progress: Progress = NO_PROGRESS) -> Plan:
    """Plan `graph` (captured at global batch `batch_size`) for `cluster`; `progress` shows
    the phases (a measuring oracle shows its own profiling).

    When no plan fits at `config.blocks` blocks, the search runs again on twice as many (up to
    `_FINER_BLOCKS` times, never more blocks than atomic components): a stage is a run of whole
    blocks, so k blocks allow at most k stages and none smaller than a block, and a model that
    fits only in more, smaller stages (Llama-3-70B on 64 H100: 33 stages of 2 to 3 layers)
    would otherwise be refused although a plan exists."""
    k = config.blocks
    # zero_stage "auto": ZeRO-1 only when nothing fits without it (its broadcast after each
    # step costs time; the memory it frees is the replicas' copies of the optimizer state).
    zeros = [int(config.zero_stage)] if config.zero_stage != "auto" else [0, 1] if cluster.size > 1 \
        else [0]
    for attempt in range(_FINER_BLOCKS + 1):
        for z in zeros:
            try:
                plan = _plan_graph(graph, atomic, cluster, dataclasses.replace(config, zero_stage=z),
                                   batch_size=batch_size, oracle=oracle, costs=costs, stats=stats,
                                   progress=progress)
                return dataclasses.replace(plan, zero_stage=z)
            except PlanInfeasibleError:
                finer = min(2 * k, len(atomic.components))
                if z == zeros[-1] and (attempt == _FINER_BLOCKS or finer <= k):
                    raise
                if z != zeros[-1]:
                    log.info("rannc: no plan fits without ZeRO-1 in %d blocks; planning with the "
                             "optimizer state spread over each stage's replicas", k)
        log.info("rannc: no plan fits in %d blocks; planning again with %d", k, finer)
        k = finer
        config = dataclasses.replace(config, blocks=k)
    raise AssertionError("unreachable")  # the loop returns or raises


def _plan_graph(graph: TaskGraph, atomic: AtomicPartition, cluster: Cluster, config: Config, *,
                batch_size: int, oracle: BlockOracle | None = None, costs: GraphCosts | None = None,
                stats: PlanStats | None = None, progress: Progress = NO_PROGRESS) -> Plan:
    config = _batchnorm_config(graph, config)
    stats = stats if stats is not None else PlanStats()
    t0 = time.perf_counter()
    spec, mem = _memory_model(cluster, config, len(graph.tasks))
    limit, opt = mem.limit, mem.opt_param_factor
    costs = costs if costs is not None else \
        GraphCosts.of(graph, atomic, fused=runs_fused_kernels(cluster))
    oracle = oracle or EstimateOracle(costs, cluster)
    world = cluster.size
    stats.components = len(atomic.components)
    stats.seconds["costs"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    b_ref = max(1, math.ceil(batch_size / world))
    comp_time = oracle.component_time(b_ref)
    with progress.phase("coarsening into blocks"):
        block_of = form_blocks_for(graph, atomic, costs, spec_time=comp_time, limit=limit, opt=opt,
                                   k=config.blocks, bandwidth=spec.link_bandwidth, batch=b_ref)
    k = max(block_of) + 1
    stats.blocks = k
    uses = ValueUses.of(graph, atomic)
    io = BlockIO.of(graph, atomic, block_of, uses)
    stats.seconds["blocks"] = time.perf_counter() - t1

    t2 = time.perf_counter()
    layouts = _pipeline_layouts(cluster, config)
    mbs = _microbatch_counts(config, batch_size)
    needed = {batch_per_replica(batch_size, R, m, d) for D, R in layouts for m in mbs
              for d in range(1, D + 1)} - {0}
    if not cluster.is_homogeneous and cluster.size <= _HETERO_DP_MAX:  # one pipeline, any d
        needed |= {batch_per_replica(batch_size, 1, m, d) for m in mbs
                   for d in range(1, world + 1)} - {0}
    prof = oracle.block_profile(block_of, sorted(needed))
    stats.seconds["profile"] = time.perf_counter() - t2

    t3 = time.perf_counter()
    schedules = _schedules(config)
    late = _late_pass(graph)
    table = _TableCache(prof, io, mem, cluster, batch_size, spec.link_bandwidth)

    found: list[_Candidate] = []
    # (tables, the table of each position from the end, devices, the stage counts they hold
    # for), kept only while nothing fits, for the error
    infeasible: list[tuple[list[StageTables], list[int], int, set[int]]] = []
    # one step per pipeline layout and microbatch count
    for D, R, m in progress.iterate("stage DP search", [(D, R, m) for D, R in layouts for m in mbs]):
        if batch_per_replica(batch_size, R, m, 1) < 1 or m * R > batch_size:
            continue
        for sched in schedules:
            saved = get_spec(sched).held(D, m, late).saved_inputs
            if get_spec(sched).chunks > 1:  # several stages per rank: its own search
                virtual = _interleaved(table, D, R, m, config, sched, saved)
                stats.candidates += len(virtual)
                found += virtual
                if not virtual:
                    tab = table(D, R, m, get_spec(sched).in_flight(D, m), saved,
                                get_spec(sched).chunks)
                    infeasible.append(([tab], [0] * D, D, set(range(1, D + 1))))
                continue
            by_pos = _in_flight_by_position(sched, D, m)
            if by_pos is not None:
                # Each stage is costed with the microbatches it holds, known from its position
                # counted from the end (1F1B: the j-th from the end holds min(j, m)); the DP
                # runs over the blocks reversed to know that position.
                counts = sorted(set(by_pos))
                tabs = [table(D, R, m, n, saved) for n in counts]
                table_of = [counts.index(n) for n in by_pos]
                for cand in _solutions(tabs, table_of, D, R, m, config, sched):
                    stats.candidates += 1
                    found.append(cand)
                if not found:
                    infeasible.append((tabs, table_of, D, set(range(1, D + 1))))
                continue
            # A schedule whose in-flight counts do not depend on the position alone: every
            # stage of an S-stage split is budgeted for the most any stage holds,
            # in_flight(S, m), and refined per stage below.
            held = {S: get_spec(sched).held(S, m, late) for S in range(1, D + 1)}
            for n_in in sorted({h.in_flight for h in held.values()}):
                tab = table(D, R, m, n_in, saved)
                for cand in _solutions([tab], [0] * D, D, R, m, config, sched):
                    if held[len(cand.replicas)].in_flight != n_in:
                        continue
                    stats.candidates += 1
                    found.append(cand)
                if not found:
                    counts_s = {S for S in range(1, D + 1) if held[S].in_flight == n_in}
                    infeasible.append(([tab], [0] * D, D, counts_s))
    mixed_dp = (not cluster.is_homogeneous and cluster.size <= _HETERO_DP_MAX
                and bool(config.extra.get("hetero_dp", True))
                and bool(config.extra.get("balance", True)))
    # (mixed devices: all state)
    static = static_memory(io.params, io.grad_params, opt, 1, 0) + mem.overhead
    if not found and mixed_dp:
        # The DP above plans every stage within the smallest device's memory; on a mixed
        # cluster the mixed-cluster DP may still fit, with each stage on its own devices.
        alts = _hetero_search(graph, atomic, costs, prof, io, static, cluster, config, block_of,
                              batch_size, mbs, schedules, late, spec.link_bandwidth)
        if alts:
            stats.seconds["stage_dp"] = time.perf_counter() - t3
            return min(alts, key=lambda p: p.predicted_iteration_time or math.inf)
    if not found:
        stats.seconds["stage_dp"] = time.perf_counter() - t3
        if not infeasible:  # no layout was even tried: the batch has too few rows for them all
            rows = min((m * R for _D, R in layouts for m in mbs), default=0)
            raise ConfigError(
                f"the global batch of {batch_size} rows cannot be split: every layout considered "
                f"(microbatches {sorted(mbs)}, pipeline copies {sorted({R for _D, R in layouts})}) "
                f"needs at least one row per microbatch of each copy, so at least {rows} rows; "
                "use a larger global batch, or force fewer microbatches or replicas")
        smallest = min((_memory_needed(tabs, table_of, D, config, ok)
                        for tabs, table_of, D, ok in infeasible), default=math.inf)
        need = smallest / (1.0 - config.mem_margin)
        have = limit / (1.0 - config.mem_margin)
        raise PlanInfeasibleError(
            f"no plan fits: the model needs at least {fmt_bytes(need)} per device (with "
            f"mem_margin {config.mem_margin}) but the devices have {fmt_bytes(have)} "
            f"({spec.name}, {world} devices); use more or larger devices, raise mem_limit_gb, or "
            "relax forced partition_num/replicas/microbatches", needed_bytes=need)
    # The closed form ranks candidates; the simulator, with each stage's exact in-flight count
    # and recomputation, decides among the best few of each schedule.
    refs: list[_Refined] = []
    for sched in schedules:
        mine = sorted((c for c in found if c.schedule == sched), key=lambda c: c.time)
        for cand in mine[:_SIMULATED]:
            ref = _refine(cand, table, late)
            if ref is not None:
                refs.append(ref)
    stats.seconds["stage_dp"] = time.perf_counter() - t3
    if not refs:  # a candidate's stages hold no more than the bound it was split under
        raise RaNNCError("planner: no candidate survived refinement; please report this")
    # The fastest few move their stage boundaries below block level; the fastest result wins,
    # ties to the block-level winner (chosen as before: the earliest within 1e-9), then to the
    # faster before refinement. Refining only the winner can miss a plan whose block-level split
    # was further from its own best split (BERT 256x2048 at 32 devices: 13.68 s refined from the
    # winner, 13.34 s from the fourth).
    winner = refs[0]
    for ref in refs[1:]:
        if ref.time < winner.time * (1 - 1e-9):
            winner = ref
    ranked = [winner, *sorted((r for r in refs if r is not winner), key=lambda r: r.time)]
    t5 = time.perf_counter()
    tabler = _Tabler(graph, atomic, oracle, mem, cluster, batch_size, spec.link_bandwidth, uses)
    best: tuple[_Refined, list[int], BlockIO] | None = None
    # extra boundary_refinement=False: stages as runs of whole blocks, as the paper plans them
    # (benchmarks and tests compare against it)
    refine = bool(config.extra.get("boundary_refinement", True))
    for ref in progress.iterate("refining stage boundaries",
                                _distinct(ranked)[:_BOUNDARY_REFINED if refine else 1]):
        got = _refine_boundaries(ref, block_of, io, comp_time, tabler, late) if refine else \
            (ref, list(block_of), io)
        if best is None or got[0].time < best[0].time * (1 - 1e-9):
            best = got
    assert best is not None
    best_ref, plan_of, plan_io = best
    stats.seconds["refine"] = time.perf_counter() - t5
    out = _to_plan(graph, atomic, costs, best_ref, plan_of, world, batch_size, blocks=k)
    if not cluster.is_homogeneous:
        # extra balance=False: equal shares in rank order, what a planner that assumes identical
        # devices would run (benchmarks compare against it)
        balance = bool(config.extra.get("balance", True))
        plan_static = static_memory(plan_io.params, plan_io.grad_params, opt, 1, 0) + mem.overhead
        out = _heterogeneous(out, cluster, _hetero_devices(cluster, config), plan_static,
                             balance=balance)
        if mixed_dp:
            t4 = time.perf_counter()
            m0 = out.microbatches
            for alt in _hetero_search(graph, atomic, costs, prof, io, static, cluster, config,
                                      block_of, batch_size, sorted({max(1, m0 // 2), m0, 2 * m0}),
                                      schedules, late, spec.link_bandwidth):
                assert alt.predicted_iteration_time is not None
                assert out.predicted_iteration_time is not None
                if alt.predicted_iteration_time < out.predicted_iteration_time * (1 - 1e-9):
                    out = alt
            stats.seconds["hetero_dp"] = time.perf_counter() - t4
    frac = config.extra.get("recompute_fraction")
    if frac is not None:  # experimental: the same recomputed fraction on every stage
        out = dataclasses.replace(out, stages=tuple(dataclasses.replace(st, recompute=float(frac))
                                                    for st in out.stages))
    shares = config.extra.get("shares")
    if shares is not None:  # experimental: each stage's replicas' row shares, e.g. [[3, 1], [1]]
        if len(shares) != len(out.stages) or any(
                len(sh) != st.replicas or min(sh) <= 0 for sh, st in zip(shares, out.stages, strict=False)):
            raise ConfigError(f"extra shares {shares} must give each of the {len(out.stages)} stages "
                              f"one positive share per replica ({[st.replicas for st in out.stages]})")
        out = dataclasses.replace(out, stages=tuple(
            dataclasses.replace(st, shares=tuple(float(x) / sum(sh) for x in sh))
            for sh, st in zip(shares, out.stages, strict=True)))
    return out


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
    spec, mem = _memory_model(cluster, config, len(graph.tasks))
    costs = costs if costs is not None else \
        GraphCosts.of(graph, atomic, fused=runs_fused_kernels(cluster))
    oracle = oracle or EstimateOracle(costs, cluster)
    D, R = cluster.size, 1
    width = max(max(r) for _, r in splits)  # tables only up to the replica counts asked for
    mbs = [m for m in _microbatch_counts(config, batch_size) if m <= batch_size]
    prof = oracle.block_profile(block_of, sorted({batch_per_replica(batch_size, R, m, d)
                                                  for m in mbs for d in range(1, width + 1)}))
    io = BlockIO.of(graph, atomic, block_of)
    late = _late_pass(graph)
    best: list[_Refined | None] = [None] * len(splits)
    for m in mbs:  # one microbatch count's tables at a time: they are (blocks^2 x width) each
        table = _TableCache(prof, io, mem, cluster, batch_size, spec.link_bandwidth, width=width)
        for sched in _schedules(config, one_stage_per_rank=True):
            for i, (bounds, replicas) in enumerate(splits):
                held = get_spec(sched).held(len(replicas), m, late)
                tab = table(D, R, m, held.in_flight, held.saved_inputs)
                ref = _refine(_candidate([tab] * len(replicas), D, R, m, bounds, replicas, sched),
                              table, late)
                old = best[i]
                if ref is not None and (old is None or ref.time < old.time * (1 - 1e-9)):
                    best[i] = ref
    return [None if b is None else _to_plan(graph, atomic, costs, b, block_of, cluster.size, batch_size)
            for b in best]


def plan_split(graph: TaskGraph, atomic: AtomicPartition, cluster: Cluster, config: Config, *,
               batch_size: int, block_of: Sequence[int], bounds: Sequence[int],
               replicas: Sequence[int], oracle: BlockOracle | None = None,
               costs: GraphCosts | None = None) -> Plan:
    """`plan_splits` for one split; raises PlanInfeasibleError when it fits no microbatch count."""
    (out,) = plan_splits(graph, atomic, cluster, config, batch_size=batch_size, block_of=block_of,
                         splits=[(bounds, replicas)], oracle=oracle, costs=costs)
    if out is None:
        _, mem = _memory_model(cluster, config, len(graph.tasks))
        raise PlanInfeasibleError(
            f"the split {list(bounds)} with replicas {list(replicas)} fits no microbatch count "
            f"within {fmt_bytes(mem.limit)} per device ({cluster.slowest.name}); use more "
            "replicas or stages, or larger devices", needed_bytes=math.inf)
    return out


_SIMULATED = 6  # candidates per schedule the simulator judges


@dataclass(frozen=True, slots=True)
class _Refined:
    """A candidate with each stage's exact memory, recomputation and the simulated time."""

    cand: _Candidate
    time: float
    recompute: tuple[float, ...]  # per stage, fraction of kept activation memory
    fwd: tuple[float, ...]
    bwd: tuple[float, ...]  # recomputation included
    allreduce: tuple[float, ...]
    memory: tuple[float, ...]
    in_flight: tuple[int, ...]
    recompute_s: tuple[float, ...]
    wgrad: tuple[float, ...] = ()  # the weight-gradient seconds within bwd (zero-bubble's W)


@dataclass(frozen=True, slots=True)
class _StageCost:
    """One stage of a candidate, read from its stage tables."""

    recompute: float  # fraction of its kept activation memory recomputed
    fwd: float
    bwd: float  # recomputation included
    allreduce: float
    memory: float
    recompute_s: float
    wgrad: float


class _TableCache:
    """Stage tables per (devices per pipeline D, copies R, microbatches m, in-flight bound,
    saved inputs), built on first use."""

    def __init__(self, prof: BlockProfile, io: BlockIO, mem: MemoryModel, cluster: Cluster,
                 batch_size: int, link_bw: float, width: int | None = None,
                 only: frozenset[int] | None = None) -> None:
        self.prof, self.io, self.mem, self.batch_size = prof, io, mem, batch_size
        self.cluster, self.link_bw = cluster, link_bw
        self.width = width  # replica counts beyond it are not tabled
        self.only = only  # the replica counts tabled (None: all up to the width)
        self.tables: dict[tuple[int, int, int, int, int, int], StageTables] = {}

    def __call__(self, D: int, R: int, m: int, n_in: int, saved: int, share: int = 1) -> StageTables:
        """`share`: stages sharing each device (an interleaved schedule's chunks), each planned
        within 1/share of its memory, so the device's stages fit together."""
        key = (D, R, m, n_in, saved, share)
        if key not in self.tables:
            mem = self.mem if share == 1 else dataclasses.replace(self.mem, limit=self.mem.limit / share)
            c = self.cluster
            link = self.link_bw
            cross_node = R > 1 or D > c.per_node
            ar_bw = c.inter_node_bandwidth if cross_node else link
            width = D if self.width is None else min(D, self.width)
            self.tables[key] = stage_tables(self.prof, self.io, mem, batch_size=self.batch_size,
                                            devices=width, copies=R, microbatches=m, link_bw=link,
                                            allreduce_bw=ar_bw, inflight=n_in, saved_inputs=saved,
                                            only=self.only, world=D * R)
        return self.tables[key]


def _memory_model(cluster: Cluster, config: Config, tasks: int = 0) -> tuple[DeviceSpec, MemoryModel]:
    """The device every stage is planned on (the smallest memory, then the slowest) and the
    memory model on it, for a graph of `tasks` tasks (a CPU rank holds it in the memory it
    trains in: `rannc.hostmem.rank_overhead`)."""
    spec = min(cluster.devices, key=lambda d: (d.memory_bytes, d.flops))  # conservative
    limit = spec.memory_bytes if config.mem_limit_gb is None else config.mem_limit_gb * 1e9
    limit *= 1.0 - config.mem_margin
    opt = 2.0 if config.opt_param_factor is None else config.opt_param_factor
    return spec, MemoryModel(opt_param_factor=opt, limit=limit, checkpointing=config.checkpointing,
                             zero_stage=1 if config.zero_stage == 1 else 0,
                             overhead=rank_overhead([d.name for d in cluster.devices], tasks))


def _late_pass(graph: TaskGraph) -> bool:
    """Eager schedules keep every microbatch's stage inputs when a batch output (logits) might
    also get a gradient (the runtime's late pass)."""
    return any(v is not None and graph.values[v].batch_dim is not None
               and graph.values[v].dtype.startswith(("float", "bfloat"))
               for v in graph.outputs)


def _refine(c: _Candidate, table: Any, late: bool) -> _Refined | None:
    S = len(c.replicas)
    sched = c.schedule
    saved = get_spec(sched).held(S, c.microbatches, late).saved_inputs
    idx = [(c.bounds[s], c.bounds[s + 1] - 1, c.replicas[s]) for s in range(S)]
    place = _placement(c)
    # the schedule's own in-flight counts (recomputation does not change them)
    counts = [n for n, _ in in_flight(make_schedule(sched, c.microbatches, chain(S), [False] * S,
                                                    place))]
    share = get_spec(sched).chunks
    rows: list[_StageCost] = []
    for s, x in enumerate(idx):
        tab = table(c.devices, c.copies, c.microbatches, counts[s], saved, share)
        if not math.isfinite(float(tab.h[x])):
            return None
        rows.append(_StageCost(recompute=float(tab.recompute[x]), fwd=float(tab.fwd[x]),
                               bwd=float(tab.bwd[x]), allreduce=float(tab.allreduce[x]),
                               memory=float(tab.memory[x]), recompute_s=float(tab.recompute_s[x]),
                               wgrad=float(tab.wgrad[x])))
    if not get_spec(sched).recompute_last:  # e.g. scp: its last stage holds one microbatch
        last = rows[-1]
        rows[-1] = dataclasses.replace(last, recompute=0.0, bwd=last.bwd - last.recompute_s,
                                       recompute_s=0.0)
    rc = [r.recompute for r in rows]
    timeline = simulate(make_schedule(sched, c.microbatches, chain(S), [f > 0 for f in rc], place),
                        StageCosts(fwd=[r.fwd for r in rows], bwd=[r.bwd - r.recompute_s for r in rows],
                                   recompute=[r.recompute_s for r in rows], comm_fwd=[0.0] * S,
                                   comm_bwd=[0.0] * S, allreduce=[r.allreduce for r in rows],
                                   wgrad=[r.wgrad for r in rows]))
    return _Refined(c, timeline.iteration_time, tuple(rc), tuple(r.fwd for r in rows),
                    tuple(r.bwd for r in rows), tuple(r.allreduce for r in rows),
                    tuple(r.memory for r in rows), tuple(counts), tuple(r.recompute_s for r in rows),
                    tuple(r.wgrad for r in rows))


_BOUNDARY_REFINED = 4  # plans, the fastest at block level, whose boundaries are refined
_PIECES = 8  # runs each side of a stage boundary is cut into per refinement level
_LEVELS = 16  # refinement levels at most (each narrows the windows about _PIECES-fold)


@dataclass(frozen=True, slots=True)
class _Tabler:
    """Stage tables for any grouping of the components: what the boundary refinement needs."""

    graph: TaskGraph
    atomic: AtomicPartition
    oracle: BlockOracle
    mem: MemoryModel
    cluster: Cluster
    batch_size: int
    link_bw: float
    uses: ValueUses

    def __call__(self, block_of: Sequence[int], c: _Candidate) -> tuple[BlockIO, _TableCache]:
        """Tables over `block_of`'s groups for candidate `c`'s layout, only for its replica
        counts (and only their batch sizes profiled)."""
        reps = frozenset(c.replicas)
        sizes = sorted({batch_per_replica(self.batch_size, c.copies, c.microbatches, d) for d in reps})
        io = BlockIO.of(self.graph, self.atomic, block_of, self.uses)
        return io, _TableCache(self.oracle.block_profile(block_of, sizes), io, self.mem,
                               self.cluster, self.batch_size, self.link_bw, width=max(reps),
                               only=reps)


def _distinct(refs: Sequence[_Refined]) -> list[_Refined]:
    """The first of each (block bounds, devices per stage over all copies, microbatches,
    schedule): layouts that differ only in how many pipeline copies share those devices cost
    nearly the same, so the few refinements are spent on different splits instead."""
    seen: set[tuple[object, ...]] = set()
    out = []
    for r in refs:
        c = r.cand
        key = (c.bounds, tuple(d * c.copies for d in c.replicas), c.microbatches, c.schedule)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def _refine_boundaries(best: _Refined, block_of: Sequence[int], io: BlockIO, comp_time: np.ndarray,
                       tabler: _Tabler, late: bool) -> tuple[_Refined, list[int], BlockIO]:
    """Move the stage boundaries of `best` below block level (`rannc.stage_dp.refine`): same
    replicas, microbatches and schedule; a finer split is kept only when the simulator predicts
    a faster iteration, so the plan never gets slower. Returns the plan, the grouping its bounds
    index, and that grouping's BlockIO."""
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
    for _ in range(_LEVELS):
        points = level_points(weight, cuts, windows, _PIECES)
        seg_of = segment_of(order, points)
        seg_io, table = tabler(seg_of, c)
        # each stage costed with the microbatches it really holds in flight (as `_refine` does),
        # not the search's common bound: a later 1F1B stage holds fewer and recomputes less
        tabs = [table(c.devices, c.copies, c.microbatches, n, saved, get_spec(c.schedule).chunks)
                for n in best.in_flight]
        bounds = _min_max_bounds([t.h[:, :, d] for t, d in zip(tabs, c.replicas, strict=True)])
        mine = tuple(points.index(x) for x in cuts)
        if bounds is not None and bounds != mine:
            ref = _refine(_candidate(tabs, c.devices, c.copies, c.microbatches, bounds,
                                     c.replicas, c.schedule), table, late)
            # the plan so far, costed on these same groups unless that cannot change its cost
            now = out[0] if tabler.oracle.additive else _refine(_candidate(
                tabs, c.devices, c.copies, c.microbatches, mine, c.replicas, c.schedule),
                table, late)
            if ref is not None and (now is None or ref.time < now.time * (1 - 1e-9)):
                out = (ref, seg_of, seg_io)
                cuts = [points[b] for b in bounds]
        # the next level looks between the segments on either side of each boundary
        where = {p: j for j, p in enumerate(points)}
        windows = [(points[where[x] - 1], points[where[x] + 1]) for x in cuts[1:-1]]
        if all(x - lo <= 1 and hi - x <= 1 for x, (lo, hi) in zip(cuts[1:-1], windows, strict=True)):
            break  # single components either side of every boundary: nothing finer to try
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
        check_replicas_divide(config.replicas, world)
        per = sum(config.replicas)
        return [(per, world // per)]
    out = []
    n = 1
    while n <= cluster.nodes:
        if cluster.nodes % n == 0:
            out.append((cluster.per_node * n, cluster.nodes // n))
        n *= 2
    if config.partition_num is not None:
        # an interleaved schedule forced puts several stages on each device
        per = get_spec(config.schedule).chunks if config.schedule != "auto" else 1
        out = [(D, R) for D, R in out if D * per >= config.partition_num]
        if not out:
            raise ConfigError(f"partition_num {config.partition_num} exceeds the {world} devices"
                              + (f" ({per} stages each under {config.schedule})" if per > 1 else ""))
    return out


def _batchnorm_config(graph: TaskGraph, config: Config) -> Config:
    """batchnorm="sync" is exact only where each replica of a stage holding BatchNorm runs
    the whole mini-batch's rows in one microbatch; the runtime has one microbatch count for
    the whole pipeline, so the plan keeps one microbatch (forcing more is an error)."""
    from rannc.pipeline.batchnorm import batch_norm_tasks, check_mode

    if check_mode(config.batchnorm) != "sync" or not batch_norm_tasks(graph):
        return config
    if config.microbatches not in (None, 1):
        paths = sorted({graph.tasks[i].module_path for i in batch_norm_tasks(graph)})
        raise ConfigError(f"batchnorm='sync' keeps one microbatch (BatchNorm in {', '.join(paths)}), "
                          f"but microbatches={config.microbatches} is forced; drop one of them")
    return dataclasses.replace(config, microbatches=1)


def _microbatch_counts(config: Config, batch_size: int) -> list[int]:
    if config.microbatches is not None:
        return [config.microbatches]
    out, m = [], max(1, config.min_pipeline)
    while m <= min(config.max_pipeline, batch_size):
        out.append(m)
        m *= 2
    return out or [1]


def _schedules(config: Config, one_stage_per_rank: bool = False) -> list[str]:
    """The schedules searched: the forced one, or under "auto" every registered one the
    runtime runs (`ScheduleSpec.runs`); `one_stage_per_rank` leaves out interleaved ones, and
    so does "auto" with a forced partition_num or replicas (which count one stage per rank
    unless an interleaved schedule is forced with them)."""
    if config.schedule != "auto":
        return [config.schedule]
    forced = config.partition_num is not None or config.replicas is not None
    return [n for n in SCHEDULES if get_spec(n).runs
            and not ((one_stage_per_rank or forced) and get_spec(n).chunks > 1)]


def _placement(c: _Candidate) -> tuple[int, ...]:
    """Each stage's lane (the ranks running it): its own, or under an interleaved schedule
    of v chunks, s % (stages / v)."""
    S, v = len(c.replicas), get_spec(c.schedule).chunks
    return tuple(s % (S // v) for s in range(S)) if v > 1 else tuple(range(S))


def _interleaved(table: _TableCache, D: int, R: int, m: int, config: Config, sched: str,
                 saved: int) -> list[_Candidate]:
    """Candidates of an interleaved schedule of v chunks: P lanes of devices, each running v
    stages (s, s + P, ...), the stages' replica counts those of their lane. Per lane count P
    (or the forced partition_num / v), the lanes' replicas are the forced ones, one replica
    count for every lane, or the stage DP's best P-stage split's; the v * P stage bounds then
    minimise the slowest stage (each stage planned within 1/v of the device memory, so a
    device's stages fit together). The simulator ranks them as it ranks the others."""
    v = get_spec(sched).chunks
    k = table.io.params.shape[0]
    if config.partition_num is not None:
        if config.partition_num % v:
            return []
        lanes = [config.partition_num // v]
    else:
        lanes = list(range(2, min(D, k // v) + 1))
    out: list[_Candidate] = []
    for P in lanes:
        S = v * P
        if S > k or P > D or (m > P and m % P):
            continue  # a short last round deadlocks (rannc.schedule.spec)
        tab = table(D, R, m, get_spec(sched).in_flight(S, m), saved, v)
        options: set[tuple[int, ...]] = set()
        if config.replicas is not None:
            options.add(tuple(config.replicas))
        else:
            if D % P == 0:
                options.add((D // P,) * P)
            sols = stage_dp(tab.h, D, P)
            if len(sols) >= P and sols[P - 1].feasible:
                options.add(tuple(sols[P - 1].replicas))
        for lane_reps in sorted(options):
            if len(lane_reps) != P or sum(lane_reps) != D:
                continue
            reps = tuple(lane_reps[s % P] for s in range(S))
            bounds = _min_max_bounds([tab.h[:, :, d] for d in reps])
            if bounds is not None:
                out.append(_candidate([tab] * S, D, R, m, bounds, reps, sched))
    return out


def _in_flight_by_position(sched: str, D: int, m: int) -> tuple[int, ...] | None:
    """Microbatches in flight on the stage j-th from the end (index j - 1, j = 1..D), when that
    depends on j alone and not on the number of stages (1F1B: min(j, m)); None otherwise. Read
    off the schedule's own lines (`in_flight`), for D and D - 1 stages, which must agree."""
    got = _in_flight_counts(sched, D, m)
    if D > 1 and _in_flight_counts(sched, D - 1, m) != got[:D - 1]:
        return None
    return got


@functools.lru_cache(maxsize=256)
def _in_flight_counts(sched: str, S: int, m: int) -> tuple[int, ...]:
    """Microbatches in flight per stage of an S-stage chain, the last stage first."""
    return tuple(n for n, _ in reversed(in_flight(make_schedule(sched, m, chain(S), [False] * S))))


def _stage_tables(tabs: Sequence[StageTables], table_of: Sequence[int], S: int) -> list[StageTables]:
    """The table of each of S stages, first to last (`table_of`: by position from the end)."""
    return [tabs[table_of[S - s - 1]] for s in range(S)]


def _solutions(tabs: Sequence[StageTables], table_of: Sequence[int], D: int, R: int, m: int,
               config: Config, sched: str) -> list[_Candidate]:
    """The DP's best split for each stage count (or the forced one), the j-th stage from the end
    costed with `tabs[table_of[j - 1]]`."""
    if config.replicas is not None:
        return _forced_replicas(tabs, table_of, D, R, m, tuple(config.replicas), sched)
    k = tabs[0].h.shape[0]
    s_max = min(k, D) if config.partition_num is None else config.partition_num
    if len(tabs) == 1:
        sols = stage_dp(tabs[0].h, D, s_max)
    else:
        sols = stage_dp_by_position([t.h for t in tabs], table_of, D, s_max)
    wanted = range(len(sols)) if config.partition_num is None else [config.partition_num - 1]
    out = []
    for s in wanted:
        if s < len(sols) and sols[s].feasible:
            out.append(_candidate(_stage_tables(tabs, table_of, s + 1), D, R, m, sols[s].bounds,
                                  sols[s].replicas, sched))
    return out


def _forced_replicas(tabs: Sequence[StageTables], table_of: Sequence[int], D: int, R: int, m: int,
                     reps: tuple[int, ...], sched: str) -> list[_Candidate]:
    """The best bounds for fixed per-stage replica counts: a 1-D min-max DP over blocks."""
    per_stage = _stage_tables(tabs, table_of, len(reps))
    bounds = _min_max_bounds([t.h[:, :, d] for t, d in zip(per_stage, reps, strict=True)])
    return [] if bounds is None else [_candidate(per_stage, D, R, m, bounds, reps, sched)]


def _min_max_bounds(hs: Sequence[np.ndarray]) -> tuple[int, ...] | None:
    """Bounds of the split of k blocks into len(hs) runs minimising the slowest run, where run s
    over blocks l..r costs hs[s][l, r] (inf: infeasible); None when no split is finite."""
    S, k = len(hs), hs[0].shape[0]
    best = np.full((S + 1, k + 1), math.inf)
    arg = np.zeros((S + 1, k + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for s in range(1, S + 1):
        h = hs[s - 1]
        for b in range(s, k + 1):
            vals = np.maximum(best[s - 1, s - 1:b], h[s - 1:b, b - 1])  # over bp = s-1 .. b-1
            j = int(np.argmin(vals))
            best[s, b], arg[s, b] = vals[j], j + s - 1
    if not math.isfinite(best[S, k]):
        return None
    bounds = [k]
    for s in range(S, 0, -1):
        bounds.append(int(arg[s, bounds[-1]]))
    return tuple(reversed(bounds))


def _candidate(tabs: Sequence[StageTables], D: int, R: int, m: int, bounds: Sequence[int],
               reps: Sequence[int], sched: str) -> _Candidate:
    """`tabs`: each stage's table (first to last)."""
    idx = [(bounds[i], bounds[i + 1] - 1, reps[i]) for i in range(len(reps))]
    t = gpipe_iteration_time([float(tb.fwd[x]) for tb, x in zip(tabs, idx, strict=True)],
                             [float(tb.bwd[x]) for tb, x in zip(tabs, idx, strict=True)],
                             [float(tb.allreduce[x]) for tb, x in zip(tabs, idx, strict=True)], m)
    return _Candidate(t, D, R, m, tuple(bounds), tuple(reps), tabs[0], sched)


def _memory_needed(tabs: Sequence[StageTables], table_of: Sequence[int], D: int, config: Config,
                   stage_counts: set[int]) -> float:
    """The smallest per-device memory any split of this layout into one of `stage_counts`
    stages needs: min-max over memory, each position with its own table."""
    if config.replicas is not None:
        return math.inf
    mms = [np.where(np.isfinite(t.memory_min), t.memory_min, math.inf) for t in tabs]
    k = mms[0].shape[0]
    sols = stage_dp(mms[0], D, min(k, D)) if len(mms) == 1 else \
        stage_dp_by_position(mms, table_of, D, min(k, D))
    wanted = stage_counts if config.partition_num is None else stage_counts & {config.partition_num}
    return min((sol.value for S, sol in enumerate(sols, 1) if S in wanted), default=math.inf)


def _to_plan(graph: TaskGraph, atomic: AtomicPartition, costs: GraphCosts, best: _Refined,
             block_of: Sequence[int], world: int, batch_size: int, blocks: int | None = None) -> Plan:
    """The plan of `best`, whose bounds index the groups of `block_of`; `blocks`: phase 2's
    block count to report (default: those groups')."""
    c = best.cand
    place = _placement(c)
    lane_ranks = stage_ranks(c.replicas[:max(place) + 1], world)
    ranks = [lane_ranks[place[s]] for s in range(len(c.replicas))]  # stages sharing a lane
    stages = []
    for s in range(len(c.replicas)):
        lo, hi, d = c.bounds[s], c.bounds[s + 1] - 1, c.replicas[s]
        comps = tuple(i for i, b in enumerate(block_of) if lo <= b <= hi)
        rows = float(c.tables.batch[d])
        stages.append(StagePlan(
            index=s, components=comps, ranks=ranks[s], shares=tuple(1.0 / len(ranks[s]) for _ in ranks[s]),
            recompute=_component_fraction(costs, comps, best.recompute[s], rows),
            param_names=param_names_of(graph, atomic, comps),
            predicted={"forward_s": best.fwd[s], "backward_s": best.bwd[s],
                       "allreduce_s": best.allreduce[s], "memory_bytes": best.memory[s],
                       "microbatch_rows": rows, "in_flight": float(best.in_flight[s]),
                       "recompute_memory_fraction": best.recompute[s],
                       "recompute_s": best.recompute_s[s], "backward_weight_s": best.wgrad[s],
                       "first_block": float(lo), "last_block": float(hi)},
            modules=_module_range(graph, atomic, comps)))
    return Plan(stages=tuple(stages), microbatches=c.microbatches, world_size=world,
                fingerprint=graph.fingerprint(), schedule=c.schedule,
                predicted_iteration_time=best.time, batch_size=batch_size,
                blocks=max(block_of) + 1 if blocks is None else blocks, source=(graph, atomic))


_HETERO_DP_MAX = 16  # devices; the mixed-cluster DP is O(blocks^2 devices^2) in Python


def _hetero_search(graph: TaskGraph, atomic: AtomicPartition, costs: GraphCosts,
                   prof: BlockProfile, io: BlockIO, static: np.ndarray, cluster: Cluster,
                   config: Config, block_of: Sequence[int], batch_size: int,
                   microbatches: Sequence[int], schedules: Sequence[str], late: bool,
                   link_bw: float) -> list[Plan]:
    """Plans from the mixed-cluster DP (`stage_dp.hetero`), one pipeline over all devices,
    for each of `microbatches` and each schedule (forced replicas honoured)."""
    from rannc.schedule.predict import predict
    from rannc.stage_dp.hetero import hetero_stages

    world = cluster.size
    dev = _hetero_devices(cluster, config)
    ar_bw = cluster.inter_node_bandwidth if cluster.nodes > 1 else link_bw
    out = []
    if config.replicas is not None and sum(config.replicas) != world:
        return []  # pipeline copies: not in the mixed-cluster DP yet
    for m in microbatches:
        if m > batch_size or m > config.max_pipeline and config.microbatches is None:
            continue
        if config.microbatches is not None and m != config.microbatches:
            continue
        batch_of = [0] + [batch_per_replica(batch_size, 1, m, d) for d in range(1, world + 1)]
        for sched in schedules:
            if get_spec(sched).chunks > 1:
                continue  # the mixed-cluster DP places one stage per device group
            held = get_spec(sched).held(world, m, late)
            hs = hetero_stages(prof, io, static, dev, rows=batch_size / m, batch_of=batch_of,
                               in_flight=held.in_flight,
                               saved=held.saved_inputs, link_bw=link_bw,
                               allreduce_bw=ar_bw, microbatches=m,
                               checkpointing=config.checkpointing, stages=config.partition_num,
                               replicas=config.replicas)
            if hs is None:
                continue
            stages = []
            for s, h in enumerate(hs):
                comps = tuple(c for c, b in enumerate(block_of) if h.first_block <= b <= h.last_block)
                total = sum(h.rows)
                stages.append(StagePlan(
                    index=s, components=comps, ranks=h.devices,
                    shares=tuple(x / total for x in h.rows), recompute=1.0 if h.recompute else 0.0,
                    param_names=param_names_of(graph, atomic, comps),
                    predicted={"forward_s": h.forward_s, "backward_s": h.backward_s,
                               "recompute_s": h.recompute_s, "allreduce_s": h.allreduce_s,
                               "memory_bytes": h.memory_bytes, "microbatch_rows": max(h.rows),
                               "first_block": float(h.first_block),
                               "last_block": float(h.last_block)},
                    modules=_module_range(graph, atomic, comps),
                    devices=tuple(cluster.devices[r].name for r in h.devices)))
            plan = Plan(stages=tuple(stages), microbatches=m, world_size=world,
                        fingerprint=graph.fingerprint(), schedule=sched, batch_size=batch_size,
                        blocks=max(block_of) + 1, source=(graph, atomic))
            out.append(dataclasses.replace(plan, predicted_iteration_time=predict(plan).iteration_time))
    return out


def _hetero_devices(cluster: Cluster, config: Config) -> HeteroDevices:
    """Each rank's effective speed and the memory a stage may use on it."""
    cap = config.mem_limit_gb * 1e9 if config.mem_limit_gb is not None else None
    return HeteroDevices(speed=[d.flops * d.efficiency for d in cluster.devices],
                         memory=[(cap if cap is not None else d.memory_bytes) * (1 - config.mem_margin)
                                 for d in cluster.devices])


def _heterogeneous(plan: Plan, cluster: Cluster, dev: HeteroDevices, static: np.ndarray,
                   balance: bool = True) -> Plan:
    """Place a plan made for the cluster's weakest device on its real devices: earlier
    stages (which hold more microbatches' activations) on the devices with more memory, and
    each stage's rows split among its replicas by speed within memory (`whale_shares`); the
    predicted stage times and iteration time follow."""
    from rannc.schedule.predict import predict

    speed, mem = dev.speed, dev.memory
    order = dev.order() if balance else list(range(cluster.size))
    slow = min(speed)
    stages = []
    for st in plan.stages:
        ranks = tuple(order[r] for r in st.ranks)
        p = dict(st.predicted)
        rows = p["microbatch_rows"]  # what the plan gave each replica on the weakest device
        total = rows * st.replicas
        fixed = float(static[int(p["first_block"]), int(p["last_block"])])
        per_row = max(p["memory_bytes"] - fixed, 0.0) / rows
        caps = [(mem[r] - fixed) / per_row if per_row > 0 else math.inf for r in ranks]
        x = whale_shares(total, [speed[r] for r in ranks], caps) if balance else [rows] * len(ranks)
        factor = finish_time(x, [speed[r] for r in ranks]) / (rows / slow)
        for k in ("forward_s", "backward_s", "recompute_s"):
            if k in p:
                p[k] *= factor
        j = max(range(len(ranks)), key=lambda i: fixed + per_row * x[i] - mem[ranks[i]])
        p["memory_bytes"] = fixed + per_row * x[j]
        stages.append(dataclasses.replace(st, ranks=ranks, shares=tuple(v / total for v in x),
                                          predicted=p,
                                          devices=tuple(cluster.devices[r].name for r in ranks)))
    out = dataclasses.replace(plan, stages=tuple(stages))
    return dataclasses.replace(out, predicted_iteration_time=predict(out).iteration_time)


def _component_fraction(costs: GraphCosts, comps: Sequence[int], f: float, rows: float) -> float:
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


def single_process_plan(graph: TaskGraph, atomic: AtomicPartition, batch_size: int) -> Plan:
    """What one process runs: the whole graph as one stage on rank 0, one microbatch, nothing
    recomputed. Nothing is searched and no costs are predicted (one process has no choice to
    make); `model.plan` shows it, so a script reads the same attribute on one rank or many."""
    comps = tuple(range(len(atomic.components)))
    stage = StagePlan(index=0, components=comps, ranks=(0,), shares=(1.0,), recompute=0.0,
                      param_names=param_names_of(graph, atomic, comps),
                      modules=_module_range(graph, atomic, comps))
    return Plan(stages=(stage,), microbatches=1, world_size=1, fingerprint=graph.fingerprint(),
                schedule=FILL_DRAIN, batch_size=batch_size, source=(graph, atomic))


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


# -- the public entry point ---------------------------------------------------------------------

def plan(model: object, args: tuple[object, ...] = (), kwargs: dict[str, object] | None = None, *,
         cluster: Cluster | None = None, config: Config | None = None,
         stats: PlanStats | None = None) -> Plan:
    """Plan `model` called as `model(*args, **kwargs)` with the GLOBAL batch, for `cluster`.

    Pure: captures the model (a `meta`-device model works and allocates nothing), estimates
    costs and searches; no process group, no device side effects. `cluster` defaults to this
    machine's measured device times `dry_run_np` (or 1) devices on one node. Its phases show
    as progress bars on stderr when it is a terminal (`config.progress`).
    """
    import torch

    from rannc.atomic.components import atomic_components
    from rannc.dist import get_rank
    from rannc.graph.capture import capture, flatten_inputs
    from rannc.profile.device import measure_local_device
    from rannc.progress import progress_for

    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"rannc.plan needs a torch.nn.Module, got {type(model).__name__}")
    cfg = config if config is not None else Config()
    if cluster is None:
        n = cfg.dry_run_np or 1
        cluster = Cluster.homogeneous(measure_local_device(), n=n, per_node=n)
    stats = stats if stats is not None else PlanStats()
    progress = progress_for(cfg.progress, get_rank())
    t0 = time.perf_counter()
    with progress.phase("capture"):
        cap = capture(model, args, kwargs or {})
    with progress.phase("atomic components"):
        atomic = atomic_components(cap.graph)
    stats.seconds["capture"] = time.perf_counter() - t0
    leaves, layout = flatten_inputs(args, kwargs or {})
    costs = GraphCosts.of(cap.graph, atomic, fused=runs_fused_kernels(cluster))
    oracle = make_oracle(cfg, cap, atomic, model, leaves, costs, cluster, progress=progress)
    # capture() has refused inputs without a batched tensor, so layout.batch is set
    return plan_graph(cap.graph, atomic, cluster, cfg, batch_size=layout.batch or 0,
                      oracle=oracle, costs=costs, stats=stats, progress=progress)


def make_oracle(cfg: Config, cap: Any, atomic: AtomicPartition, model: Any, leaves: Sequence[Any],
                costs: GraphCosts, cluster: Cluster, progress: Progress = NO_PROGRESS) -> BlockOracle:
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
        return EstimateOracle(costs, cluster)  # array arithmetic: nothing to show
    from rannc.profile.measure import MeasureOracle

    return MeasureOracle(cap, atomic, model, leaves, device, costs, cluster.slowest,
                         cache_dir=cfg.profile_cache_dir, progress=progress)
