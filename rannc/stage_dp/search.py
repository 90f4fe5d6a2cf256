"""Phase 3's search (paper III-C, Algorithm 2 around Algorithm 1): over pipeline layouts,
microbatch counts and schedules, the stage DP's best split for every stage count, then the
simulator's verdict on the best few.

- Layouts: pipelines of n whole nodes (n = 1, 2, 4, ...), the rest of the cluster replicating
  the pipeline R times (`pipeline_layouts`); microbatch counts doubling from min_pipeline
  (`microbatch_counts`); every registered schedule (`rannc.schedule.spec`) or the forced one.
- For each, the stage tables (`tables.py`, THE memory model in `memory.py`) and the DP
  (`dp.py`) give one candidate per stage count (`solutions`), ranked by a closed form of the
  simulated time (`iteration_estimate`).
- Schedules of several stages per device (`ScheduleSpec.chunks`: interleaved 1F1B, ZB-V) get
  their own candidates (`interleaved`): P lanes of devices, each running v stages (s, s + P,
  ... or, in ZB-V's V, s and 2P - 1 - s: `ScheduleSpec.lane_of`), the memory of each device
  split between its stages where that recomputes less (`lane_share_options`).
- The best `SIMULATED` candidates of each schedule are costed stage by stage with the
  microbatches each really holds and simulated (`simulate_candidate`): that is the predicted
  iteration time, bubbles and the gradient all-reduce included. Unlike the paper, which keeps the
  first plan that fits, the fastest wins, since a pipeline over more nodes can beat replicating
  a smaller one.

Index conventions: D devices per pipeline, R pipeline copies, m microbatches, S stages, k
blocks, d a stage's replicas; bounds[s] .. bounds[s+1]-1 are stage s's blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from rannc.config import Config
from rannc.errors import ConfigError, PlanInfeasibleError
from rannc.graph.task_graph import TaskGraph
from rannc.plans import check_replicas_divide
from rannc.profile.device import Cluster, DeviceSpec
from rannc.profile.estimate import BlockProfile
from rannc.schedule import (
    SCHEDULES,
    StageCosts,
    chain,
    default_placement,
    get_spec,
    in_flight,
    make_schedule,
    simulate,
    splits_backward,
)
from rannc.schedule.spec import past_b_counts, pending_counts
from rannc.stage_dp.dp import stage_dp, stage_dp_by_position
from rannc.stage_dp.memory import MB, MemoryModel, rank_overhead
from rannc.stage_dp.tables import (
    BlockIO,
    BlockSums,
    StageTables,
    batch_per_replica,
    iteration_estimate,
    reduction_overlaps_backward,
    stage_tables,
)

SIMULATED = 6  # candidates per schedule the simulator judges


@dataclass(frozen=True, slots=True)
class Candidate:
    """One split found by the DP for a layout, microbatch count and schedule, with its
    closed-form time (the ranking before simulation)."""

    time: float
    devices: int  # per pipeline (D)
    copies: int  # pipeline copies (R)
    microbatches: int
    bounds: tuple[int, ...]
    replicas: tuple[int, ...]
    batch: np.ndarray  # rows per replica per microbatch, by replica count (`StageTables.batch`)
    schedule: str


@dataclass(frozen=True, slots=True)
class StageCost:
    """One stage of a candidate, read from its stage tables."""

    recompute: float  # fraction of its kept activation memory recomputed
    fwd: float
    bwd: float  # recomputation included
    allreduce: float
    memory: float
    recompute_s: float
    wgrad: float  # the weight-gradient seconds within bwd (a zero-bubble schedule's W)
    selective: bool = False  # selective recomputation
    selective_s: float = 0.0  # its seconds (in bwd)


@dataclass(frozen=True, slots=True)
class Simulated:
    """A candidate with each stage's exact memory, recomputation and the simulated time."""

    cand: Candidate
    time: float
    recompute: tuple[float, ...]  # per stage, fraction of kept activation memory
    fwd: tuple[float, ...]
    bwd: tuple[float, ...]  # recomputation included
    allreduce: tuple[float, ...]
    memory: tuple[float, ...]
    in_flight: tuple[int, ...]
    recompute_s: tuple[float, ...]
    wgrad: tuple[float, ...]  # the weight-gradient seconds within bwd
    selective: tuple[bool, ...]  # per stage, selective recomputation
    selective_s: tuple[float, ...]  # its seconds, in bwd
    # per stage where the backward is split: the most microbatches between B and W at once
    # (`pending_w`), and of its live peak those past B (`past_b`)
    pending: tuple[int, ...] = ()
    past_b: tuple[int, ...] = ()


# (devices, replicas, microbatches, in flight, saved inputs, reduction overlaps backward, chunks,
# memory share, pending W, past B, gradients held twice): what a `TableCache` table depends on
TableKey = tuple[int, int, int, int, int, bool, int, float | None, int, int, bool]


class TableCache:
    """Stage tables per (devices per pipeline D, copies R, microbatches m, in-flight bound,
    saved inputs, whether the schedule overlaps the gradient reduction, the stages sharing each
    device, the share of the device's memory), built on first use. A schedule of v chunks
    (interleaved, ZB-V) plans each stage within 1/v of the memory (`MemoryModel.sharing`), so a
    device's stages fit together; `simulate_candidate` then lets the stages of one device share
    it unevenly (`lane_shares`), where the cluster's devices are alike."""

    def __init__(self, prof: BlockProfile, io: BlockIO, mem: MemoryModel, cluster: Cluster,
                 batch_size: int, link_bw: float, width: int | None = None,
                 only: frozenset[int] | None = None) -> None:
        self.prof, self.io, self.mem, self.batch_size = prof, io, mem, batch_size
        self.sums = BlockSums(prof)  # (what all its tables read of the profile, once)
        self.cluster, self.link_bw = cluster, link_bw
        self.width = width  # replica counts beyond it are not tabled
        self.only = only  # the replica counts tabled (None: all up to the width)
        self.tables: dict[TableKey, StageTables] = {}
        self._cells: dict[tuple[object, ...], StageCost | None] = {}  # (`stage_cost`)
        # a device's stages may split its memory unevenly only where every device is alike: a
        # mixed cluster's placement (`placement.place`) gives each stage 1/chunks of a device
        self.lane_shares = cluster.is_homogeneous

    def __call__(self, D: int, R: int, m: int, n_in: int, saved: int, sched: str,
                 share: float | None = None, *, pending: int, past_b: int = 0) -> StageTables:
        """The tables; `share`: of the device's memory for each stage where several share a
        device (default 1/chunks); `pending`, `past_b`: where the schedule splits the backward,
        the most microbatches between B and W (`spec.pending_counts`; else 0) and those past B
        at the live peak (`actions.past_b`; 0, the bound, where not known per stage)."""
        key = self._key(D, R, m, n_in, saved, sched, share, pending, past_b)
        if key not in self.tables:
            self.tables[key] = self._build(key)
        return self.tables[key]

    def forget(self) -> None:
        """Drop the whole tables built so far (what `stage_cost` computed stays)."""
        self.tables.clear()

    def stage_cost(self, D: int, R: int, m: int, n_in: int, saved: int, sched: str,
                   share: float | None, *, pending: int, past_b: int, first: int, last: int,
                   replicas: int) -> StageCost | None:
        """Blocks first..last as one stage on `replicas` replicas, under the key of `__call__`
        (None: it does not fit). Read from that key's tables where they are built; else that
        one stage is computed alone (and kept), the same values: a memory share tried for one
        plan's device (`lane_share_options`) is a key of its own, and whole tables built to
        read one stage of each were a quarter of planning the 12.96 B BERT (k = 349 segments
        in the boundary refinement: 121,801 runs of segments per replica count, for one)."""
        key = self._key(D, R, m, n_in, saved, sched, share, pending, past_b)
        x = (first, last, replicas)
        if key in self.tables:
            return _stage_cost(self.tables[key], x)
        at = (key, x)
        if at not in self._cells:
            one = self._build(key, cells=([first], [last]), only=frozenset([replicas]))
            self._cells[at] = _stage_cost(one, (0, replicas))
        return self._cells[at]

    def _key(self, D: int, R: int, m: int, n_in: int, saved: int, sched: str,
             share: float | None, pending: int, past_b: int
             ) -> TableKey:
        spec = get_spec(sched)
        chunks = spec.chunks
        # (share None is 1/chunks: one key for both, so the search's tables serve the costing)
        part = None if chunks == 1 else 1.0 / chunks if share is None else share
        # (whether the gradients are held twice: the only way eager and fill-drain tables differ,
        # and only under an accumulation, so they share their tables otherwise)
        return (D, R, m, n_in, saved, reduction_overlaps_backward(sched), chunks, part, pending,
                past_b, self.mem.second_copy(spec.eager))

    def _build(self, key: TableKey,
               cells: tuple[list[int], list[int]] | None = None,
               only: frozenset[int] | None = None) -> StageTables:
        D, R, m, n_in, saved, overlap, chunks, part, pending, past_b, second = key
        c = self.cluster
        link = self.link_bw
        cross_node = R > 1 or D > c.per_node
        ar_bw = c.inter_node_bandwidth if cross_node else link
        width = D if self.width is None else min(D, self.width)
        if only is not None and self.only is not None:
            only = only & self.only
        # (`second` holds only where the schedule is eager: `second_copy`)
        return stage_tables(self.prof, self.io, self.mem.sharing(chunks, part).scheduled(second),
                            batch_size=self.batch_size, devices=width, copies=R,
                            microbatches=m, link_bw=link, allreduce_bw=ar_bw,
                            inflight=n_in, saved_inputs=saved,
                            only=self.only if only is None else only, overlap=overlap,
                            world=D * R, pending=pending, past_b=past_b, sums=self.sums,
                            cells=cells)


def _stage_cost(tab: StageTables, x: tuple[int, ...]) -> StageCost | None:
    """The stage at index `x` of `tab` ([l, r, d], or [cell, d]); None where it does not fit."""
    if not math.isfinite(float(tab.h[x])):
        return None
    return StageCost(recompute=float(tab.recompute[x]), fwd=float(tab.fwd[x]),
                     bwd=float(tab.bwd[x]), allreduce=float(tab.allreduce[x]),
                     memory=float(tab.memory[x]), recompute_s=float(tab.recompute_s[x]),
                     wgrad=float(tab.wgrad[x]), selective=bool(tab.selective[x]),
                     selective_s=float(tab.selective_s[x]))


def selective_allowed(config: Config) -> bool:
    """Whether plans may recompute selectively (`rannc.profile.saved.recomputable`): forced by
    checkpointing "selective", else under "auto" / "stage_aware" unless turned off or
    compiled (the compiler chooses what it saves)."""
    return config.checkpointing == "selective" or (
        config.selective_recompute and not config.compile
        and config.checkpointing not in ("off", "on"))


def memory_model(cluster: Cluster, config: Config, tasks: int) -> tuple[DeviceSpec, MemoryModel]:
    """The device every stage is planned on (the smallest memory, then the slowest) and the
    memory model on it, for a graph of `tasks` tasks (a CPU rank holds it in the memory it
    trains in: `memory.rank_overhead`)."""
    spec = min(cluster.devices, key=lambda d: (d.memory_bytes, d.flops))  # conservative
    limit = spec.memory_bytes if config.mem_limit_gb is None else config.mem_limit_gb * 1e9
    limit *= 1.0 - config.mem_margin
    opt = 2.0 if config.opt_param_factor is None else config.opt_param_factor
    return spec, MemoryModel(opt_param_factor=opt, limit=limit, checkpointing=config.checkpointing,
                             zero_stage=1 if config.zero_stage == 1 else 0,
                             bucket_bytes=config.bucket_mb * MB,
                             selective=selective_allowed(config),
                             accumulating=config.grad_accumulation == "on",
                             overhead=rank_overhead([d.name for d in cluster.devices], tasks))


def late_pass(graph: TaskGraph) -> bool:
    """Eager schedules keep every microbatch's stage inputs when a batch output (logits) might
    also get a gradient (the runtime's late pass)."""
    return any(v is not None and graph.values[v].batch_dim is not None
               and graph.values[v].dtype.startswith(("float", "bfloat"))
               for v in graph.outputs)


def pipeline_layouts(cluster: Cluster, config: Config) -> list[tuple[int, int]]:
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


def searched_schedules(config: Config, one_stage_per_rank: bool = False) -> list[str]:
    """The schedules searched: the forced one, or under "auto" every registered one the
    runtime runs (`ScheduleSpec.runs`); `one_stage_per_rank` leaves out interleaved ones, and
    so does "auto" with a forced partition_num or replicas (which count one stage per rank
    unless an interleaved schedule is forced with them)."""
    if config.schedule != "auto":
        return [config.schedule]
    forced = config.partition_num is not None or config.replicas is not None
    return [n for n in SCHEDULES if get_spec(n).runs
            and not ((one_stage_per_rank or forced) and get_spec(n).chunks > 1)]


def placement(c: Candidate) -> tuple[int, ...]:
    """Each stage's lane (the ranks running it): its own, or under a schedule of v chunks
    (several stages per device), the schedule's `lane_of(s, stages / v)`."""
    return default_placement(c.schedule, len(c.replicas))


def runnable_lanes(sched: str, lanes: int, m: int) -> bool:
    """Whether a schedule of several stages per lane runs m microbatches on `lanes` lanes
    (interleaved 1F1B: a short last round deadlocks, so m must be at most the lanes or a
    multiple; `ScheduleSpec.runnable`)."""
    spec = get_spec(sched)
    return spec.chunks == 1 or spec.runnable(lanes, m)


def microbatch_counts(config: Config, batch_size: int) -> list[int]:
    """The forced count, or min_pipeline doubling up to max_pipeline (and the batch)."""
    if config.microbatches is not None:
        return [config.microbatches]
    out, m = [], max(1, config.min_pipeline)
    while m <= min(config.max_pipeline, batch_size):
        out.append(m)
        m *= 2
    return out or [1]


def in_flight_by_position(sched: str, D: int, m: int) -> tuple[int, ...] | None:
    """Microbatches in flight on the stage j-th from the end (index j - 1, j = 1..D), when that
    depends on j alone and not on the number of stages (1F1B: min(j, m)); None otherwise. Read
    off the schedule's own lines (`in_flight`), for D and D - 1 stages, which must agree."""
    got = in_flight_counts(sched, D, m)
    if D > 1 and in_flight_counts(sched, D - 1, m) != got[:D - 1]:
        return None
    return got


@functools.lru_cache(maxsize=256)
def in_flight_counts(sched: str, S: int, m: int) -> tuple[int, ...]:
    """Microbatches in flight per stage of an S-stage chain, the last stage first."""
    return tuple(n for n, _ in reversed(in_flight(make_schedule(sched, m, chain(S), [False] * S))))


@dataclass
class Infeasible:
    """What the search tried while nothing fitted: (tables, the table of each position from the
    end, devices, the stage counts they hold for), for the "needs N GB" error; and under a
    schedule of several stages per device, (its table, devices, lanes, stages per device)."""

    tried: list[tuple[list[StageTables], list[int], int, set[int]]] = dataclasses.field(
        default_factory=list)
    lanes: list[tuple[StageTables, int, int, int]] = dataclasses.field(default_factory=list)


def search(table: TableCache, layouts: Sequence[tuple[int, int]], mbs: Sequence[int],
           schedules: Sequence[str], config: Config, batch_size: int, late: bool,
           steps: Callable[[list[tuple[int, int, int]]], Iterable[tuple[int, int, int]]] = iter,
           ) -> tuple[list[Candidate], Infeasible]:
    """Algorithm 2: the DP's candidates for every (layout, microbatch count, schedule), and,
    while none fits, what was tried. `steps` wraps the (D, R, m) steps (a progress bar)."""
    found: list[Candidate] = []
    infeasible = Infeasible()
    for D, R, m in steps([(D, R, m) for D, R in layouts for m in mbs]):
        if batch_per_replica(batch_size, R, m, 1) < 1 or m * R > batch_size:
            continue
        for sched in schedules:
            saved = get_spec(sched).held(D, m, late).saved_inputs
            if get_spec(sched).chunks > 1:  # several stages per device: its own search
                virtual = interleaved(table, D, R, m, config, sched, saved)
                found += virtual
                if not virtual:
                    v = get_spec(sched).chunks
                    for P in lane_counts(table, D, m, config, sched):
                        tab = table(D, R, m, get_spec(sched).in_flight(v * P, m), saved, sched,
                                    pending=get_spec(sched).pending(v * P, m))
                        infeasible.lanes.append((tab, D, P, v))
                continue
            # (a split backward's pending counts depend on the number of stages: bounded below)
            by_pos = None if splits_backward(sched) else in_flight_by_position(sched, D, m)
            if by_pos is not None:
                # Each stage is costed with the microbatches it holds, known from its position
                # counted from the end (1F1B: the j-th from the end holds min(j, m)); the DP
                # runs over the blocks reversed to know that position.
                counts = sorted(set(by_pos))
                tabs = [table(D, R, m, n, saved, sched, pending=0) for n in counts]
                table_of = [counts.index(n) for n in by_pos]
                found += solutions(tabs, table_of, D, R, m, config, sched)
                if not found:
                    infeasible.tried.append((tabs, table_of, D, set(range(1, D + 1))))
                continue
            # A schedule whose in-flight counts do not depend on the position alone: every
            # stage of an S-stage split is budgeted for the most any stage holds,
            # in_flight(S, m), and costed per stage by `simulate_candidate`.
            held = {S: get_spec(sched).held(S, m, late) for S in range(1, D + 1)}
            for n_in, pend in sorted({(h.in_flight, h.pending) for h in held.values()}):
                tab = table(D, R, m, n_in, saved, sched, pending=pend)
                found += [c for c in solutions([tab], [0] * D, D, R, m, config, sched)
                          if (held[len(c.replicas)].in_flight, held[len(c.replicas)].pending)
                          == (n_in, pend)]
                if not found:
                    counts_s = {S for S in range(1, D + 1)
                                if (held[S].in_flight, held[S].pending) == (n_in, pend)}
                    infeasible.tried.append(([tab], [0] * D, D, counts_s))
    return found, infeasible


def interleaved(table: TableCache, D: int, R: int, m: int, config: Config, sched: str,
                saved: int) -> list[Candidate]:
    """Candidates of a schedule of v chunks (interleaved, ZB-V): P lanes of devices, each
    running v stages (s, s + P, ... looped, or d and 2P - 1 - d in a V: the schedule's
    `lane_of`), the stages' replica counts those of their lane. Per lane count P
    (or the forced partition_num / v), the lanes' replicas are the forced ones, one replica
    count for every lane, or the stage DP's best P-stage split's; the v * P stage bounds then
    minimise the slowest stage (each stage planned within 1/v of the device memory, so a
    device's stages fit together). The simulator ranks them as it ranks the others."""
    v = get_spec(sched).chunks
    out: list[Candidate] = []
    for P in lane_counts(table, D, m, config, sched):
        S = v * P
        tab = table(D, R, m, get_spec(sched).in_flight(S, m), saved, sched,
                    pending=get_spec(sched).pending(S, m))
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
            reps = tuple(lane_reps[d] for d in default_placement(sched, S))
            for bounds in split_options([tab.h[:, :, d] for d in reps], sched):
                out.append(candidate([tab] * S, D, R, m, bounds, reps, sched))
    return out


def lane_counts(table: TableCache, D: int, m: int, config: Config, sched: str) -> list[int]:
    """The lane counts P an interleaved schedule of v chunks is planned for on D devices: the
    forced partition_num / v, or 2 .. D; each with v * P stages of at least one block, and
    runnable with m microbatches."""
    v = get_spec(sched).chunks
    k = table.io.params.shape[0]
    if config.partition_num is not None:
        if config.partition_num % v:
            return []
        lanes = [config.partition_num // v]
    else:
        lanes = list(range(2, min(D, k // v) + 1))
    return [P for P in lanes if v * P <= k and P <= D and runnable_lanes(sched, P, m)]


def infeasible_error(infeasible: Infeasible, layouts: Sequence[tuple[int, int]],
                     mbs: Sequence[int], config: Config, mem: MemoryModel, spec: DeviceSpec,
                     world: int, batch_size: int, explain: bool = True) -> Exception:
    """The error when nothing fits: the batch is too small for every layout (ConfigError), or
    the smallest per-device memory any split needs (PlanInfeasibleError). `explain=False`: a
    PlanInfeasibleError without that figure (needed_bytes nan), where the planner tries again
    (finer blocks, ZeRO-1) and nobody reads it: the figure is a stage DP per layout tried,
    which was a quarter of planning a model that fits only on finer blocks."""
    if not infeasible.tried and not infeasible.lanes:  # no layout was even tried: the batch
        # has too few rows for them all
        rows = min((m * R for _D, R in layouts for m in mbs), default=0)
        return ConfigError(
            f"the global batch of {batch_size} rows cannot be split: every layout considered "
            f"(microbatches {sorted(mbs)}, pipeline copies {sorted({R for _D, R in layouts})}) "
            f"needs at least one row per microbatch of each copy, so at least {rows} rows; "
            "use a larger global batch, or force fewer microbatches or replicas")
    if not explain:
        return PlanInfeasibleError("no plan fits (planning tries again)", needed_bytes=math.nan)
    smallest = min([memory_needed(tabs, table_of, D, config, ok)
                    for tabs, table_of, D, ok in infeasible.tried]
                   + [lanes_memory_needed(*x) for x in infeasible.lanes], default=math.inf)
    need = smallest / (1.0 - config.mem_margin)
    have = mem.limit / (1.0 - config.mem_margin)
    if math.isinf(need):  # (no split at all: one stage always exists unless a setting is forced)
        forced = ", ".join(f"{name}={value}" for name, value in (
            ("partition_num", config.partition_num), ("replicas", config.replicas),
            ("microbatches", config.microbatches)) if value is not None)
        return PlanInfeasibleError(
            f"no plan exists for the forced settings ({forced or 'none'}): the model cannot be "
            "split into that many stages. rannc cuts the model only where every value crossing "
            "the cut can be sent row by row; values that mix the batch's rows, or that lost the "
            "batch dimension (a reduction over rows, nn.EmbeddingBag with offsets), stay inside "
            "one stage with everything between them. Fix: force fewer stages, or leave "
            "partition_num and replicas to the planner", needed_bytes=need)
    return PlanInfeasibleError(
        f"no plan fits: the model needs at least {fmt_bytes(need)} per device (with "
        f"mem_margin {config.mem_margin}) but the devices have {fmt_bytes(have)} "
        f"({spec.name}, {world} devices); use more or larger devices, raise mem_limit_gb, or "
        "relax forced partition_num/replicas/microbatches", needed_bytes=need)


def memory_needed(tabs: Sequence[StageTables], table_of: Sequence[int], D: int, config: Config,
                  stage_counts: set[int]) -> float:
    """The smallest per-device memory any split of this layout into one of `stage_counts`
    stages needs: min-max over the tables' memory, each position with its own table."""
    if config.replicas is not None:
        return math.inf
    mms = [np.where(np.isfinite(t.memory_min), t.memory_min, math.inf) for t in tabs]
    k = mms[0].shape[0]
    sols = stage_dp(mms[0], D, min(k, D)) if len(mms) == 1 else \
        stage_dp_by_position(mms, table_of, D, min(k, D))
    wanted = stage_counts if config.partition_num is None else stage_counts & {config.partition_num}
    return min((sol.value for S, sol in enumerate(sols, 1) if S in wanted), default=math.inf)


def lanes_memory_needed(tab: StageTables, D: int, P: int, v: int) -> float:
    """The per-device memory P lanes of v stages each need, as the search plans them (each
    stage within 1/v of the device: `TableCache`, whose memory `tab` is): v times the smallest
    largest stage of a split into v * P stages of D // P replicas; where P does not divide D,
    at least what the lanes' replica counts come from needs too (`interleaved`: the stage DP's
    best P-run split, each run within 1/v)."""
    mm_all = np.where(np.isfinite(tab.memory_min), tab.memory_min, math.inf)
    r = D // P
    bounds = min_max_bounds([mm_all[:, :, r]] * (v * P))
    if bounds is None:
        return math.inf
    need = max(float(mm_all[bounds[i], bounds[i + 1] - 1, r]) for i in range(v * P))
    if D % P:
        sols = stage_dp(mm_all, D, P)
        need = max(need, sols[P - 1].value if len(sols) >= P else math.inf)
    return v * need


def simulate_best(found: Sequence[Candidate], schedules: Sequence[str], table: TableCache,
                  late: bool) -> list[Simulated]:
    """The best `SIMULATED` candidates of each schedule by the closed form, simulated, in that
    order (schedule by schedule)."""
    out: list[Simulated] = []
    for sched in schedules:
        mine = sorted((c for c in found if c.schedule == sched), key=lambda c: c.time)
        for cand in mine[:SIMULATED]:
            sim = simulate_candidate(cand, table, late)
            if sim is not None:
                out.append(sim)
    return out


def ranked(sims: Sequence[Simulated]) -> list[Simulated]:
    """The fastest first (ties to the earliest within 1e-9), then the others by time."""
    winner = sims[0]
    for sim in sims[1:]:
        if sim.time < winner.time * (1 - 1e-9):
            winner = sim
    return [winner, *sorted((s for s in sims if s is not winner), key=lambda s: s.time)]


def stage_tables_of(tabs: Sequence[StageTables], table_of: Sequence[int], S: int) -> list[StageTables]:
    """The table of each of S stages, first to last (`table_of`: by position from the end)."""
    return [tabs[table_of[S - s - 1]] for s in range(S)]


def solutions(tabs: Sequence[StageTables], table_of: Sequence[int], D: int, R: int, m: int,
              config: Config, sched: str) -> list[Candidate]:
    """The DP's best split for each stage count (or the forced one), the j-th stage from the end
    costed with `tabs[table_of[j - 1]]`."""
    if config.replicas is not None:
        return forced_replicas(tabs, table_of, D, R, m, tuple(config.replicas), sched)
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
            out.append(candidate(stage_tables_of(tabs, table_of, s + 1), D, R, m, sols[s].bounds,
                                 sols[s].replicas, sched))
    return out


def forced_replicas(tabs: Sequence[StageTables], table_of: Sequence[int], D: int, R: int, m: int,
                    reps: tuple[int, ...], sched: str) -> list[Candidate]:
    """The best bounds for fixed per-stage replica counts: a 1-D min-max DP over blocks."""
    per_stage = stage_tables_of(tabs, table_of, len(reps))
    bounds = min_max_bounds([t.h[:, :, d] for t, d in zip(per_stage, reps, strict=True)])
    return [] if bounds is None else [candidate(per_stage, D, R, m, bounds, reps, sched)]


def min_max_bounds(hs: Sequence[np.ndarray]) -> tuple[int, ...] | None:
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


def balance_lanes(hs: Sequence[np.ndarray], lanes: Sequence[int],
                  bounds: Sequence[int]) -> tuple[int, ...]:
    """`bounds` moved a block at a time while the lanes' loads, largest first, fall, where a
    lane's load is the sum of its stages' costs (run s over blocks l..r costs hs[s][l, r]).

    Why: `min_max_bounds` minimises the slowest *stage*, but under a schedule of several
    stages per lane (ZB-V pairs stage d with 2P - 1 - d, interleaving s with s + P) a device
    works through all of its stages every microbatch, so its load is their sum: ZB-V puts the
    embedding (light) and the vocabulary head (heavy) of an LLM on one device, and stage
    min-max left Gemma's 16-device plan 5 % of the bound in imbalance. Each move is kept only
    when the sorted loads fall lexicographically, so the walk ends."""
    S = len(hs)
    n_lanes = max(lanes) + 1

    def loads(b: Sequence[int]) -> tuple[float, ...]:
        per = [0.0] * n_lanes
        for st in range(S):
            per[lanes[st]] += float(hs[st][b[st], b[st + 1] - 1])
        return tuple(sorted(per, reverse=True))

    best = list(bounds)
    cur = loads(best)
    moved = True
    while moved:
        moved = False
        for i in range(1, S):
            for step in (-1, 1):
                x = best[i] + step
                if not best[i - 1] < x < best[i + 1]:
                    continue
                trial = [*best[:i], x, *best[i + 1:]]
                new = loads(trial)
                if new < cur:
                    best, cur, moved = trial, new, True
    return tuple(best)


def split_options(hs: Sequence[np.ndarray], sched: str) -> list[tuple[int, ...]]:
    """The stage bounds worth simulating for per-stage costs `hs`: the slowest-stage
    minimum, and under a schedule of several stages per lane the split that balances the
    lanes from there (`balance_lanes`); empty when no split is finite."""
    bounds = min_max_bounds(hs)
    if bounds is None:
        return []
    if get_spec(sched).chunks == 1:
        return [bounds]
    balanced = balance_lanes(hs, default_placement(sched, len(hs)), bounds)
    return [bounds] if balanced == bounds else [bounds, balanced]


def candidate(tabs: Sequence[StageTables], D: int, R: int, m: int, bounds: Sequence[int],
              reps: Sequence[int], sched: str) -> Candidate:
    """`tabs`: each stage's table (first to last)."""
    idx = [(bounds[i], bounds[i + 1] - 1, reps[i]) for i in range(len(reps))]
    t = iteration_estimate([float(tb.fwd[x]) for tb, x in zip(tabs, idx, strict=True)],
                           [float(tb.bwd[x]) for tb, x in zip(tabs, idx, strict=True)],
                           [float(tb.allreduce[x]) for tb, x in zip(tabs, idx, strict=True)], m,
                           get_spec(sched).eager, get_spec(sched).chunks,
                           default_placement(sched, len(reps)))
    return Candidate(t, D, R, m, tuple(bounds), tuple(reps), tabs[0].batch, sched)


def simulate_candidate(c: Candidate, table: TableCache,
                       late: bool) -> Simulated | None:
    """`c` with each stage costed for the microbatches its schedule really holds in flight
    there (the DP may have budgeted a common bound), and its iteration simulated; None when a
    stage does not fit at its own count. Where two stages share each device, their split of
    its memory is chosen too (`lane_share_options`)."""
    S = len(c.replicas)
    sched = c.schedule
    saved = get_spec(sched).held(S, c.microbatches, late).saved_inputs
    place = placement(c)
    # the schedule's own counts per stage, first to last (recomputation does not change them;
    # each read off its lines once per shape: the lines of `default_placement`, as `place`)
    counts = in_flight_counts(sched, S, c.microbatches)[::-1]
    pend = tuple(zip(pending_counts(sched, S, c.microbatches),
                     past_b_counts(sched, S, c.microbatches), strict=True))
    shares: list[float | None] = [None] * S  # (None: 1/chunks, the even split)
    best = _costed(c, table, counts, pend, saved, place, shares)
    # Greedily, device by device, the split of its memory the simulator finds fastest (the
    # even split first: a plan never gets slower than with it), where a stage of the device
    # recomputes or does not fit (else more memory cannot make either faster).
    wanted = [s for s in range(S) if best is None or best.recompute[s] > 0
              or (best.selective and best.selective[s])]
    for a, b, tries in lane_share_options(c, table, counts, pend, saved, place, wanted):
        for share in tries:
            trial = list(shares)
            trial[a], trial[b] = share, 1 - share
            got = _costed(c, table, counts, pend, saved, place, trial)
            if got is not None and (best is None or got.time < best.time * (1 - 1e-9)):
                best, shares = got, trial
    return best


def _costed(c: Candidate, table: TableCache, counts: Sequence[int],
            pend: Sequence[tuple[int, int]], saved: int, place: Sequence[int],
            shares: Sequence[float | None]) -> Simulated | None:
    """`simulate_candidate` for one split of the devices' memory among their stages; `pend`:
    per stage (`pending_w`, `past_b`)."""
    S, sched = len(c.replicas), c.schedule
    rows: list[StageCost] = []
    for s in range(S):
        # (from the key's whole table where one is built, else this stage alone: a share
        # tried for this plan's device, or the stage's own in-flight count where the search
        # budgeted every stage for a common bound)
        row = table.stage_cost(c.devices, c.copies, c.microbatches, counts[s], saved, sched,
                               shares[s], pending=pend[s][0], past_b=pend[s][1],
                               first=c.bounds[s], last=c.bounds[s + 1] - 1,
                               replicas=c.replicas[s])
        if row is None:
            return None
        rows.append(row)
    if not get_spec(sched).recompute_last:  # e.g. scp: its last stage holds one microbatch
        last = rows[-1]
        rows[-1] = dataclasses.replace(last, recompute=0.0, bwd=last.bwd - last.recompute_s,
                                       recompute_s=0.0)
    rc = [r.recompute for r in rows]
    timeline = simulate(make_schedule(sched, c.microbatches, chain(S), [f > 0 for f in rc], place),
                        StageCosts(fwd=[r.fwd for r in rows], bwd=[r.bwd - r.recompute_s for r in rows],
                                   recompute=[r.recompute_s for r in rows], comm_fwd=[0.0] * S,
                                   comm_bwd=[0.0] * S, allreduce=[r.allreduce for r in rows],
                                   wgrad=[r.wgrad for r in rows]), record=False)
    return Simulated(c, timeline.iteration_time, tuple(rc), tuple(r.fwd for r in rows),
                     tuple(r.bwd for r in rows), tuple(r.allreduce for r in rows),
                     tuple(r.memory for r in rows), tuple(counts), tuple(r.recompute_s for r in rows),
                     tuple(r.wgrad for r in rows), tuple(r.selective for r in rows),
                     tuple(r.selective_s for r in rows), tuple(p for p, _ in pend),
                     tuple(b for _, b in pend))


# The grain of the shares of a device's memory that `lane_share_options` gives its stages
# (tables are cached per share: a coarse grain keeps their count small).
SHARE_GRAIN = 32


def lane_share_options(c: Candidate, table: TableCache, counts: Sequence[int],
                       pend: Sequence[tuple[int, int]], saved: int, place: Sequence[int],
                       stages: Sequence[int]
                       ) -> list[tuple[int, int, list[float]]]:
    """Where two stages share each device (ZB-V, interleaved 1F1B over two chunks) and the
    cluster's devices are alike: per device running one of `stages`, its stages a and b and
    the shares of its memory for a to try besides the even split (b takes the rest): a given
    all it needs to keep everything, or b given all it needs (in steps of 1/SHARE_GRAIN).
    Else none: each stage is planned within 1/chunks (`TableCache`). The stages of a device
    hold different counts of microbatches (ZB-V pairs its first stage, which holds 2P, with
    its last, which holds one), so an even split can leave one stage recomputing under half
    the device while part of the other half stands unused: Llama-3-8B on 8 H100 under ZB-V
    recomputed 4.5 s of a 49.7 s iteration with even halves and 3.8 s of 48.6 s with its
    devices split this way."""
    S = len(c.replicas)
    if get_spec(c.schedule).chunks != 2 or not table.lane_shares:
        return []

    def keeps_all(s: int) -> float | None:  # the share stage s needs to recompute nothing
        x = (c.bounds[s], c.bounds[s + 1] - 1, c.replicas[s])
        t = table(c.devices, c.copies, c.microbatches, counts[s], saved, c.schedule,
                  pending=pend[s][0], past_b=pend[s][1])
        need = float(t.memory_keep[x]) / table.mem.limit
        return math.ceil(need * SHARE_GRAIN) / SHARE_GRAIN if math.isfinite(need) else None

    out = []
    for d in sorted({place[s] for s in stages}):
        a, b = (s for s in range(S) if place[s] == d)
        tries = []
        for first, need in ((True, keeps_all(a)), (False, keeps_all(b))):
            if need is not None and 0 < need < 1 and need != 0.5:
                tries.append(need if first else 1 - need)
        if tries:
            out.append((a, b, tries))
    return out


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


__all__ = ["SIMULATED", "Candidate", "Infeasible", "Simulated", "TableCache", "balance_lanes",
           "candidate", "fmt_bytes", "in_flight_by_position", "infeasible_error", "interleaved",
           "lane_counts", "lane_share_options", "lanes_memory_needed", "late_pass", "memory_model",
           "microbatch_counts", "min_max_bounds",
           "pipeline_layouts", "placement", "ranked", "runnable_lanes", "search",
           "searched_schedules", "selective_allowed", "simulate_best", "simulate_candidate",
           "solutions", "split_options"]
