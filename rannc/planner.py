"""The automatic planner: model -> graph -> blocks -> stages, replicas and microbatches -> Plan.

Pure: it reads a TaskGraph, a cost oracle and a Cluster and returns a Plan; no process group,
no device side effects. The steps are the paper's (section III), each in its phase's folder:

1. capture (`rannc.graph.capture`) and atomic components, phase 1 (`rannc.atomic`);
2. the cost oracle, estimated or measured (`rannc.profile.oracle`);
3. phase 2, blocks: k-way multilevel coarsening (`rannc.coarsen`);
4. phase 3, the stage DP search (`rannc.stage_dp.search`): for pipelines of n whole nodes and
   microbatch counts doubling from min_pipeline, the DP's best split for every stage count,
   each stage within THE memory model (`rannc.stage_dp.memory`), and for an interleaved
   schedule splits whose devices each run several stages; the simulator ranks the best few,
   bubbles and the gradient all-reduce included;
5. refine: the fastest few move their stage boundaries below block level
   (`rannc.stage_dp.refine`), and are split at the model's layer boundaries
   (`rannc.stage_dp.layers`), kept only where the simulator predicts a faster iteration;
6. the Plan (`rannc.stage_dp.assemble`), placed on a mixed cluster's real devices
   (`rannc.stage_dp.placement`).

Forced `partition_num`, `replicas` and `microbatches` narrow the search to them. When nothing
fits, `plan_graph` plans again with ZeRO-1 (zero_stage "auto") and on finer blocks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from rannc.atomic.components import AtomicPartition
from rannc.coarsen.graph import form_blocks_for
from rannc.config import Config
from rannc.errors import ConfigError, PlanInfeasibleError, RaNNCError
from rannc.graph.task_graph import TaskGraph
from rannc.plans import Plan, StagePlan, param_names_of
from rannc.profile.choice import make_oracle
from rannc.profile.device import Cluster
from rannc.profile.estimate import BlockProfile, GraphCosts, runs_fused_kernels
from rannc.profile.oracle import BlockOracle, EstimateOracle
from rannc.progress import NO_PROGRESS, Progress
from rannc.schedule import FILL_DRAIN
from rannc.stage_dp.assemble import module_range, to_plan
from rannc.stage_dp.layers import aligned_best, layer_of
from rannc.stage_dp.memory import MemoryModel
from rannc.stage_dp.placement import (
    MIXED_DP_MAX,
    hetero_devices,
    mixed_dp_enabled,
    mixed_plans,
    place,
)
from rannc.stage_dp.refine import (
    REFINED,
    Tabler,
    refine_best,
    refine_boundaries,
    with_each_schedule,
)
from rannc.stage_dp.search import (
    Simulated,
    TableCache,
    infeasible_error,
    late_pass,
    memory_model,
    microbatch_counts,
    pipeline_layouts,
    ranked,
    search,
    searched_schedules,
    simulate_best,
)
from rannc.stage_dp.splits import plan_split, plan_splits
from rannc.stage_dp.tables import BlockIO, ValueUses, batch_per_replica

log = logging.getLogger(__name__)


@dataclass
class PlanStats:
    """What planning did, for logs and benchmarks."""

    components: int = 0
    blocks: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    candidates: int = 0


_FINER_BLOCKS = 2  # times the planner doubles k when nothing fits at the configured k


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
    from rannc.calls import without_cache
    from rannc.dist import get_rank
    from rannc.graph.capture import capture, flatten_inputs
    from rannc.profile.device import measure_local_device
    from rannc.progress import progress_for

    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"rannc.plan needs a torch.nn.Module, got {type(model).__name__}")
    kwargs = without_cache(model, dict(kwargs or {}))  # (as RaNNCModule calls it)
    cfg = config if config is not None else Config()
    if cluster is None:
        n = cfg.dry_run_np or 1
        cluster = Cluster.homogeneous(measure_local_device(), n=n, per_node=n)
    stats = stats if stats is not None else PlanStats()
    progress = progress_for(cfg.progress, get_rank())
    with _timed(stats, "capture"):
        with progress.phase("capture"):
            cap = capture(model, args, kwargs or {})
        with progress.phase("atomic components"):
            atomic = atomic_components(cap.graph)
    leaves, layout = flatten_inputs(args, kwargs or {})
    costs = GraphCosts.of(cap.graph, atomic, fused=runs_fused_kernels(cluster))
    oracle = make_oracle(cfg, cap, atomic, model, leaves, costs, cluster, progress=progress)
    # capture() has refused inputs without a batched tensor, so layout.batch is set
    return plan_graph(cap.graph, atomic, cluster, cfg, batch_size=layout.batch or 0,
                      oracle=oracle, costs=costs, stats=stats, progress=progress)


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
    # zero_stage "auto": without ZeRO-1 first, then with it, which frees the replicas' copies of
    # the optimizer state but all-gathers the parameters after each step. A plan with replicas
    # or recomputation is planned both ways and the faster prediction kept: the memory freed
    # may spare recomputation or allow fewer stages.
    auto = config.zero_stage == "auto" and cluster.size > 1
    zeros = [0, 1] if auto else [int(config.zero_stage) if config.zero_stage != "auto" else 0]
    for attempt in range(_FINER_BLOCKS + 1):
        for z in zeros:
            finer = min(2 * k, len(atomic.components))
            last = z == zeros[-1] and (attempt == _FINER_BLOCKS or finer <= k)
            try:
                plan = _plan_graph(graph, atomic, cluster, dataclasses.replace(config, zero_stage=z),
                                   batch_size=batch_size, oracle=oracle, costs=costs, stats=stats,
                                   progress=progress, explain=last)
                plan = dataclasses.replace(plan, zero_stage=z)
                # (ZeRO-1 only frees memory: it can help where the plan has replicas, whose
                # copies of the state it shares out, or where memory bound it, a stage
                # recomputing; with ZeRO-1 a plan may then take replicas this one did not)
                if auto and z == 0 and any(st.replicas > 1 or st.recompute > 0 or st.selective
                                           for st in plan.stages):
                    plan = _faster(plan, _zero_1_plan(graph, atomic, cluster, config,
                                                      batch_size=batch_size, oracle=oracle,
                                                      costs=costs, stats=stats, progress=progress),
                                   "ZeRO-1")
                if any(st.selective for st in plan.stages) and config.checkpointing != "selective":
                    # Selective recomputation is chosen per stage where it costs fewer seconds than
                    # recomputing a prefix; the search that follows can then find a slower whole
                    # (another schedule fits the prefix's memory): where a stage took it, the
                    # search without it runs too, at each ZeRO stage "auto" weighs (the memory
                    # ZeRO-1 frees may replace what the recipes saved), and the faster
                    # prediction is kept
                    for z_off in (zeros if auto else [plan.zero_stage]):
                        plan = _faster(plan, _plan_or_none(
                            graph, atomic, cluster,
                            dataclasses.replace(config, zero_stage=z_off, selective_recompute=False),
                            batch_size=batch_size, oracle=oracle, costs=costs, stats=stats,
                            progress=progress), "without selective recomputation"
                            + (" with ZeRO-1" if z_off else ""))
                return plan
            except PlanInfeasibleError:
                if last:
                    raise
                if z != zeros[-1]:
                    log.info("rannc: no plan fits without ZeRO-1 in %d blocks; planning with the "
                             "optimizer state spread over each stage's replicas", k)
        log.info("rannc: no plan fits in %d blocks; planning again with %d", k, finer)
        k = finer
        config = dataclasses.replace(config, blocks=k)
    raise AssertionError("unreachable")  # the loop returns or raises


def _zero_1_plan(graph: TaskGraph, atomic: AtomicPartition, cluster: Cluster, config: Config, *,
                 batch_size: int, oracle: BlockOracle | None, costs: GraphCosts | None,
                 stats: PlanStats | None, progress: Progress) -> Plan | None:
    """The plan with ZeRO-1 at `config.blocks`, or None when none fits."""
    return _plan_or_none(graph, atomic, cluster, dataclasses.replace(config, zero_stage=1),
                         batch_size=batch_size, oracle=oracle, costs=costs, stats=stats,
                         progress=progress)


def _plan_or_none(graph: TaskGraph, atomic: AtomicPartition, cluster: Cluster, config: Config, *,
                  batch_size: int, oracle: BlockOracle | None, costs: GraphCosts | None,
                  stats: PlanStats | None, progress: Progress) -> Plan | None:
    """The plan under `config` (its zero_stage recorded), or None when none fits."""
    try:
        plan = _plan_graph(graph, atomic, cluster, config, batch_size=batch_size, oracle=oracle,
                           costs=costs, stats=stats, progress=progress, explain=False)
    except PlanInfeasibleError:
        return None
    return dataclasses.replace(plan, zero_stage=int(config.zero_stage))


def _faster(plan: Plan, other: Plan | None, what: str) -> Plan:
    """`other` when it is predicted faster (ties to `plan`); `what` names it in the log."""
    if other is None or _time(other) >= _time(plan) * (1 - 1e-9):
        return plan
    log.info("rannc: %s predicted faster (%.4g s against %.4g s per iteration)", what,
             _time(other), _time(plan))
    return other


def _plan_graph(graph: TaskGraph, atomic: AtomicPartition, cluster: Cluster, config: Config, *,
                batch_size: int, oracle: BlockOracle | None = None, costs: GraphCosts | None = None,
                stats: PlanStats | None = None, progress: Progress = NO_PROGRESS,
                explain: bool = True) -> Plan:
    """One attempt: phase 2, phase 3's search, refinement and the Plan, at `config.blocks`;
    `explain=False`: where none fits, the error without the memory it would need (the caller
    tries again and reads none of it: `infeasible_error`)."""
    config = _batchnorm_config(graph, config)
    stats = stats if stats is not None else PlanStats()
    with _timed(stats, "costs"):
        spec, mem = memory_model(cluster, config, len(graph.tasks))
        costs = costs if costs is not None else \
            GraphCosts.of(graph, atomic, fused=runs_fused_kernels(cluster))
        oracle = oracle or EstimateOracle(costs, cluster)
        stats.components = len(atomic.components)

    with _timed(stats, "blocks"):  # phase 2
        b_ref = max(1, math.ceil(batch_size / cluster.size))  # rows per device, all replicas
        comp_time = oracle.component_time(b_ref)
        with progress.phase("coarsening into blocks"):
            block_of = form_blocks_for(graph, atomic, costs, spec_time=comp_time, limit=mem.limit,
                                       opt=mem.opt_param_factor, k=config.blocks,
                                       bandwidth=spec.link_bandwidth, batch=b_ref)
        k = stats.blocks = max(block_of) + 1
        uses = ValueUses.of(graph, atomic)
        io = BlockIO.of(graph, atomic, block_of, uses)

    with _timed(stats, "profile"):  # every per-replica batch size the search will read
        layouts = pipeline_layouts(cluster, config)
        mbs = microbatch_counts(config, batch_size)
        prof = oracle.block_profile(block_of, _profiled_batches(cluster, layouts, mbs, batch_size))

    with _timed(stats, "stage_dp"):  # phase 3: the search, and the simulator's verdict
        schedules = searched_schedules(config)
        late = late_pass(graph)
        table = TableCache(prof, io, mem, cluster, batch_size, spec.link_bandwidth)
        found, infeasible = search(table, layouts, mbs, schedules, config, batch_size, late,
                                   steps=lambda s: progress.iterate("stage DP search", s))
        stats.candidates += len(found)
        # (mixed devices: all state; under an accumulation the gradients twice, whichever of the
        # schedules a mixed plan takes, as an eager one would hold them)
        static = mem.scheduled(eager=True).static(io.params, io.grad_params, 1, 0)
        if not found:
            # The search plans every stage within the smallest device's memory; on a mixed
            # cluster the mixed-cluster DP may still fit, with each stage on its own devices.
            alts = mixed_plans(graph, atomic, prof, io, static, cluster, config, block_of,
                               batch_size, mbs, schedules, late, spec.link_bandwidth) \
                if mixed_dp_enabled(cluster, config) else []
            if alts:
                return min(alts, key=lambda p: p.predicted_iteration_time or math.inf)
            raise infeasible_error(infeasible, layouts, mbs, config, mem, spec, cluster.size,
                                   batch_size, explain=explain)
        sims = simulate_best(found, schedules, table, late)
        if not sims:  # a candidate's stages hold no more than the bound it was split under
            raise RaNNCError("planner: no candidate survived simulation; please report this")
        # Nothing reads the search's tables from here on (the refinement and the alignment
        # table other groupings): 1,059 tables, 2.0 GB, for the 12.96 B BERT, which the
        # refinement's own would otherwise join. Dropped once, not step by step: freeing them
        # as the search goes made glibc hand the heap back and fault it in again, 5 to 12 %
        # of planning time on the Llama shapes of plan_snapshot.
        table.forget()

    refine = bool(config.extra.get("boundary_refinement", True))
    with _timed(stats, "refine"):  # stage boundaries below block level
        tabler = Tabler(graph, atomic, oracle, mem, cluster, batch_size, spec.link_bandwidth, uses)
        best, plan_of, plan_io, own = refine_best(
            ranked(sims), block_of, io, comp_time, tabler, late, enabled=refine,
            steps=lambda s: progress.iterate("refining stage boundaries", s))
    with _timed(stats, "layers"):  # the best layouts split at the model's layer boundaries
        layers = layer_of(graph, atomic) if refine and config.extra.get("layer_splits", True) \
            else None
        if layers is not None:
            best, plan_of, plan_io = _layer_aligned(best, plan_of, plan_io, ranked(sims), layers,
                                                    graph, atomic, uses, comp_time, tabler, late,
                                                    config, own)
    out = to_plan(graph, atomic, costs, best, plan_of, cluster.size, batch_size, blocks=k)
    if not cluster.is_homogeneous:
        # (the best plan of each other stage count too, at block level: the fastest on the
        # weakest device need not place best on the real ones)
        others = [to_plan(graph, atomic, costs, s, block_of, cluster.size, batch_size, blocks=k)
                  for s in _best_per_stage_count(ranked(sims), len(best.cand.replicas))]
        out = _on_mixed_devices(out, graph, atomic, prof, io, static, plan_io, mem, cluster, config,
                                block_of, batch_size, schedules, late, spec.link_bandwidth, stats,
                                others)
    return _experimental(out, config)


# How much slower than the plan so far a schedule's best layer-aligned plan may be and still
# have its boundaries refined (the refinement can only make it faster).
ALIGNED_SLACK = 0.05


def _layer_aligned(best: Simulated, plan_of: list[int], plan_io: BlockIO,
                   sims: Sequence[Simulated], layers: list[int], graph: TaskGraph,
                   atomic: AtomicPartition, uses: ValueUses, comp_time: np.ndarray,
                   tabler: Tabler, late: bool, config: Config, own: Mapping[str, float]
                   ) -> tuple[Simulated, list[int], BlockIO]:
    """The plan so far, or a layer-aligned one (`aligned_best`) with its boundaries then moved
    inside the layers (`refine_boundaries`) where that is predicted faster. Per schedule, from
    its own first `REFINED` distinct plans, and refined when it starts within `ALIGNED_SLACK`
    of that schedule's own fastest refined plan (`own`): a schedule whose plans rank behind at
    block level can win once aligned and refined (Llama-3-8B on 8 H100: ZB-V's best aligned
    plan, 1.0x the scp plan so far, refines to 48.55 s against 49.14 s), and nothing a schedule
    gets depends on the other schedules searched, so searching one more never gives a slower
    plan (Mixtral-8x7B on 64 H100: held against the fastest plan of all, scp's aligned plan
    was left unrefined once two more zero-bubble schedules lowered that, 6.118 s against
    5.906 s)."""
    first = with_each_schedule(sims, REFINED)
    layer_io = BlockIO.of(graph, atomic, layers, uses)
    out = (best, plan_of, plan_io)
    for sched in dict.fromkeys(r.cand.schedule for r in first):
        aligned = aligned_best([r for r in first if r.cand.schedule == sched], layers, comp_time,
                               tabler, late, replicas_forced=config.replicas is not None,
                               stages=config.partition_num)
        if aligned is None or aligned.time >= own[sched] * (1 + ALIGNED_SLACK):
            continue
        got = refine_boundaries(aligned, layers, layer_io, comp_time, tabler, late)
        if got[0].time < out[0].time * (1 - 1e-9):
            out = got
    return out


def _profiled_batches(cluster: Cluster, layouts: Sequence[tuple[int, int]], mbs: Sequence[int],
                      batch_size: int) -> list[int]:
    """Rows per replica of every (layout, microbatch count, replica count) the search tables
    (and, on a small mixed cluster, every replica count of one pipeline over all devices)."""
    needed = {batch_per_replica(batch_size, R, m, d) for D, R in layouts for m in mbs
              for d in range(1, D + 1)} - {0}
    if not cluster.is_homogeneous and cluster.size <= MIXED_DP_MAX:
        needed |= {batch_per_replica(batch_size, 1, m, d) for m in mbs
                   for d in range(1, cluster.size + 1)} - {0}
    return sorted(needed)


# Stage counts besides the best plan's whose best block-level plan is also placed on a mixed
# cluster's devices.
PLACED_STAGE_COUNTS = 3


def _best_per_stage_count(sims: Sequence[Simulated], but: int) -> list[Simulated]:
    """The fastest of `sims` (ranked) for each stage count other than `but`, the first
    `PLACED_STAGE_COUNTS` of those counts by time."""
    out: dict[int, Simulated] = {}
    for s in sims:
        n = len(s.cand.replicas)
        if n != but and n not in out and len(out) < PLACED_STAGE_COUNTS:
            out[n] = s
    return list(out.values())


def _on_mixed_devices(out: Plan, graph: TaskGraph, atomic: AtomicPartition, prof: BlockProfile,
                      io: BlockIO, static: np.ndarray, plan_io: BlockIO, mem: MemoryModel,
                      cluster: Cluster,
                      config: Config, block_of: Sequence[int], batch_size: int,
                      schedules: Sequence[str], late: bool, link_bw: float,
                      stats: PlanStats, others: Sequence[Plan] = ()) -> Plan:
    """The plan made on the weakest device placed on the mixed cluster's devices (extra
    balance=False: equal shares in rank order, for benchmarks), or one of `others` (plans of
    other stage counts, whose block indices are `io`'s) placed so, or the mixed-cluster DP's
    plan at about its microbatch count (half to four times it: a plan made on the weakest
    device may take few microbatches where its memory allows, as selective recomputation
    does, which the mixed DP, planning every device within its own memory, may not),
    whichever is predicted fastest. The fastest plan on the weakest device need not place
    best: GPT-2 on four mixed devices under a tight memory (plan_snapshot's "gpt2 mixed4
    tight") got 27.29 ms from the others, and its best 1-stage plan placed gives 24.46 ms."""
    dev = hetero_devices(cluster, config)
    balance = bool(config.extra.get("balance", True))
    out = place(out, cluster, dev, plan_io, mem, balance=balance)
    for other in others:
        alt = place(other, cluster, dev, io, mem, balance=balance)
        if _time(alt) < _time(out) * (1 - 1e-9):
            out = alt
    if not mixed_dp_enabled(cluster, config):
        return out
    with _timed(stats, "hetero_dp"):
        m0 = out.microbatches
        for alt in mixed_plans(graph, atomic, prof, io, static, cluster, config,
                               block_of, batch_size, sorted({max(1, m0 // 2), m0, 2 * m0, 4 * m0}),
                               schedules, late, link_bw):
            if _time(alt) < _time(out) * (1 - 1e-9):
                out = alt
    return out


def _time(p: Plan) -> float:
    return p.predicted_iteration_time if p.predicted_iteration_time is not None else math.inf


def _experimental(out: Plan, config: Config) -> Plan:
    """Overrides for experiments (Config.extra): `recompute_fraction`, the same recomputed
    fraction on every stage; `selective`, selective recomputation on (True) or off (False) on
    every stage; `shares`, each stage's replicas' row shares, e.g. [[3, 1], [1]]."""
    frac = config.extra.get("recompute_fraction")
    if frac is not None:
        out = dataclasses.replace(out, stages=tuple(dataclasses.replace(st, recompute=float(frac))
                                                    for st in out.stages))
    sel = config.extra.get("selective")
    if sel is not None:
        out = dataclasses.replace(out, stages=tuple(dataclasses.replace(st, selective=bool(sel))
                                                    for st in out.stages))
    shares = config.extra.get("shares")
    if shares is not None:
        if len(shares) != len(out.stages) or any(
                len(sh) != st.replicas or min(sh) <= 0 for sh, st in zip(shares, out.stages, strict=False)):
            raise ConfigError(f"extra shares {shares} must give each of the {len(out.stages)} stages "
                              f"one positive share per replica ({[st.replicas for st in out.stages]})")
        out = dataclasses.replace(out, stages=tuple(
            dataclasses.replace(st, shares=tuple(float(x) / sum(sh) for x in sh))
            for sh, st in zip(shares, out.stages, strict=True)))
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


def single_process_plan(graph: TaskGraph, atomic: AtomicPartition, batch_size: int) -> Plan:
    """What one process runs: the whole graph as one stage on rank 0, one microbatch, nothing
    recomputed. Nothing is searched and no costs are predicted (one process has no choice to
    make); `model.plan` shows it, so a script reads the same attribute on one rank or many."""
    comps = tuple(range(len(atomic.components)))
    stage = StagePlan(index=0, components=comps, ranks=(0,), shares=(1.0,), recompute=0.0,
                      param_names=param_names_of(graph, atomic, comps),
                      modules=module_range(graph, atomic, comps))
    return Plan(stages=(stage,), microbatches=1, world_size=1, fingerprint=graph.fingerprint(),
                schedule=FILL_DRAIN, batch_size=batch_size, source=(graph, atomic))


@contextlib.contextmanager
def _timed(stats: PlanStats, step: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:  # summed over the attempts (finer blocks, ZeRO-1 weighed)
        stats.seconds[step] = stats.seconds.get(step, 0.0) + time.perf_counter() - t0


__all__ = ["BlockOracle", "EstimateOracle", "PlanInfeasibleError", "PlanStats", "form_blocks_for",
           "make_oracle", "param_names_of", "plan", "plan_graph", "plan_split", "plan_splits",
           "single_process_plan"]
