"""rannc.Plan: what every rank runs, as plain data (JSON, never pickle).

A plan lists the stages in pipeline order; each stage is a convex set (a run of blocks) of
atomic components placed on the ranks of its replicas, each replica computing
a share of every microbatch's rows. A plan is checked against the model's
graph fingerprint when loaded.

Plans come from the planner (`rannc.planner`). The whole pipeline may itself
be replicated R times (RaNNC's factor R): the world is R copies of
sum(replicas) ranks, and each stage's replicas are the union over the copies
(`stage_ranks`).

Index conventions: s indexes stages, m microbatches, j a stage's replicas.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, ClassVar

from rannc.atomic.components import AtomicPartition
from rannc.errors import ConfigError, PlanMismatchError, RaNNCError
from rannc.graph.task_graph import TaskGraph, ValueKind

PLAN_FORMAT = 1


@dataclass(frozen=True, slots=True)
class StagePrediction:
    """The planner's cost predictions for one stage, on the device of its fullest replica."""

    forward_s: float  # one microbatch's forward, receiving its inputs included
    backward_s: float  # one microbatch's backward, recomputation and sending gradients included
    # the gradient reduction over its holders that the iteration waits for after the stage's
    # last backward (per iteration; what overlapping it with that backward leaves)
    allreduce_s: float = 0.0
    memory_bytes: float = 0.0  # the fullest replica's peak (rannc.stage_dp.memory)
    microbatch_rows: float = 0.0  # rows of each microbatch per replica (the fullest)
    recompute_s: float = 0.0  # the seconds recomputation adds inside backward_s
    # of backward_s besides, the seconds selective recomputation's rebuilds add (not part of
    # recompute_s, which a schedule runs before the backward as its own pass; None: unknown,
    # as in plans made before it, taken as 0)
    selective_s: float | None = None
    # the weight-gradient seconds inside backward_s (what a zero-bubble schedule runs as W;
    # None: not predicted, as in plans made before zero-bubble schedules, taken as 0)
    backward_weight_s: float | None = None
    first_block: int = 0  # the blocks it was planned as (phase 2's, or finer after refinement)
    last_block: int = 0
    in_flight: int | None = None  # microbatches whose activations it holds at once
    recompute_memory_fraction: float | None = None  # of its kept activations, recomputed

    _INTS: ClassVar[frozenset[str]] = frozenset({"first_block", "last_block", "in_flight"})

    def to_dict(self) -> dict[str, float]:
        """As a plan file stores it: the known fields (block indices as integers)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "a stage") -> StagePrediction:
        """From a plan file, including one written when this was a dict of floats (block
        indices as 3.0); a key or value it does not know is a PlanMismatchError."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise PlanMismatchError(
                f"{where}'s predictions hold {unknown}, which this version of rannc does not "
                f"know (it knows {sorted(names)}); plan again, or delete the plan file")
        missing = sorted({"forward_s", "backward_s"} - set(d))
        if missing:
            raise PlanMismatchError(f"{where}'s predictions lack {missing}; plan again, or "
                                    "delete the plan file")
        out: dict[str, Any] = {}
        for k, v in d.items():
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int | float) or \
                    (k in cls._INTS and float(v) != int(v)):
                raise PlanMismatchError(f"{where}'s prediction {k}={v!r} is not a number of the "
                                        "right kind; plan again, or delete the plan file")
            out[k] = int(v) if k in cls._INTS else float(v)
        return cls(**out)

    # The spelling of plans made when predictions were a dict (`st.predicted["memory_bytes"]`).
    def __getitem__(self, key: str) -> float:
        v = getattr(self, key, None) if key in self._names() else None
        if v is None:
            raise KeyError(key)
        return float(v)

    def get(self, key: str, default: float | None = None) -> float | None:
        v = getattr(self, key) if key in self._names() else None
        return default if v is None else float(v)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self._names() and getattr(self, key) is not None

    @classmethod
    def _names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


@dataclass(frozen=True, slots=True)
class StagePlan:
    """One pipeline stage of a Plan: the atomic components it runs (a contiguous, convex run
    of the model), the ranks holding its replicas (one each) with each replica's share of a
    microbatch's rows, the fraction recomputed in backward, the parameters it holds (original
    names), the user's modules it covers and the planner's cost predictions."""

    index: int
    components: tuple[int, ...]  # atomic components, in order
    ranks: tuple[int, ...]  # one per replica
    shares: tuple[float, ...]  # per replica: its share of each microbatch's rows (sum 1)
    recompute: float  # fraction of its components (a prefix) recomputed in backward: 0 none, 1 all
    param_names: tuple[str, ...] = ()  # parameters this stage holds (original names)
    predicted: StagePrediction | None = None  # the planner's cost estimates, when known
    modules: str = ""  # the user's modules it covers, "first .. last"
    devices: tuple[str, ...] = ()  # per replica, its device's name (when the cluster is mixed)
    # selective recomputation: its cheap elementwise activations kept as recipes and rebuilt
    # in backward (`rannc.profile.saved.recomputable`), besides the recomputed prefix
    selective: bool = False

    @property
    def replicas(self) -> int:
        return len(self.ranks)

    @property
    def recomputed_components(self) -> int:
        """How many of its first components drop their activations in forward."""
        n = len(self.components)
        return min(n, max(0, round(float(self.recompute) * n)))


@dataclass(frozen=True, slots=True)
class Plan:
    """A deployment: what every rank runs. Its stages in pipeline order, the microbatch count,
    the schedule, the number of ranks and the fingerprint of the graph it was made for (a
    loaded plan is checked against it), with the predicted iteration time. `summary()` prints
    it as a table; `save()`/`Plan.load()` keep it as JSON; `to_onnx()` writes the partitioned
    graph. Made by `rannc.plan()` and by a RaNNCModule's first call (`model.plan`)."""

    stages: tuple[StagePlan, ...]
    microbatches: int
    world_size: int
    fingerprint: str  # of the TaskGraph the plan was made for
    schedule: str = "gpipe"
    predicted_iteration_time: float | None = None
    batch_size: int | None = None  # the global batch it was planned for
    blocks: int | None = None  # phase 2's block count
    # ZeRO stage: 1 = each parameter's optimizer state lives on one of its holders only
    # (rannc.ownership); 0 = on every holder.
    zero_stage: int = 0
    # The graph it was made from, for to_onnx; not saved (a loaded plan has none).
    source: tuple[TaskGraph, AtomicPartition] | None = field(default=None, compare=False, repr=False)

    def holder_stages(self) -> dict[str, tuple[int, ...]]:
        """Parameter name -> the stages that hold it, in stage order. THE answer to who holds a
        parameter (a tied one lists every stage reading it); every module asks here."""
        out: dict[str, list[int]] = {}
        for st in self.stages:
            for n in st.param_names:
                out.setdefault(n, []).append(st.index)
        return {n: tuple(s) for n, s in out.items()}

    def holders(self) -> dict[str, tuple[int, ...]]:
        """Parameter name -> the ranks that hold a copy of it (every replica of every holding
        stage), ascending. Their copies are equal after every step."""
        return {n: tuple(sorted({r for s in stages for r in self.stages[s].ranks}))
                for n, stages in self.holder_stages().items()}

    def owner(self, name: str) -> int:
        """The lowest holder of parameter `name`. Which holder's copy counts once (saves it,
        adds its gradient to a global norm, steps it under ZeRO-1) is `rannc.ownership`'s
        answer, which is this one when `zero_stage` is 0."""
        ranks = self.holders().get(name)
        if not ranks:
            raise RaNNCError(f"no stage of this plan holds parameter {name!r}")
        return ranks[0]

    def placement(self) -> tuple[int, ...]:
        """Per stage: its lane, the position of its ranks among the stages' distinct sets of
        ranks in stage order. Stage s's own (s) but under a schedule of several stages per rank,
        whose stages s, s + P, ... (interleaved) or s, 2P - 1 - s (ZB-V) run on the same ranks."""
        seen: dict[tuple[int, ...], int] = {}
        return tuple(seen.setdefault(st.ranks, len(seen)) for st in self.stages)

    def stages_of_rank(self, rank: int) -> list[StagePlan]:
        """The stages `rank` holds a replica of: one, or under a schedule of several stages per
        rank (interleaved 1F1B, ZB-V) several, first to last."""
        out = [st for st in self.stages if rank in st.ranks]
        if not out:
            raise RaNNCError(f"rank {rank} has no stage in this plan (world size {self.world_size})")
        return out

    def stage_of_rank(self, rank: int) -> StagePlan:
        for st in self.stages:
            if rank in st.ranks:
                return st
        raise RaNNCError(f"rank {rank} has no stage in this plan (world size {self.world_size})")

    def summary(self) -> str:
        """A table a user can check by eye."""
        head = (f"rannc plan: {len(self.stages)} stage(s), {self.microbatches} microbatch(es), "
                f"schedule {self.schedule}, {self.world_size} rank(s)")
        if self.batch_size is not None:
            head += f", global batch {self.batch_size}"
        if self.blocks is not None:
            head += f", {self.blocks} blocks"
        if self.zero_stage:
            head += f", ZeRO-{self.zero_stage}"
        if self.predicted_iteration_time is not None:
            head += f", predicted {_fmt_s(self.predicted_iteration_time)}/iteration"
        header = ("stage", "components", "params", "rows/mb", "fwd", "bwd", "memory", "recomp",
                  "ranks", "modules")
        rows = []
        for st in self.stages:
            p = st.predicted
            rows.append((
                str(st.index),
                f"{st.components[0]}-{st.components[-1]}" if st.components else "-",
                str(len(st.param_names)),
                f"{int(p.microbatch_rows)}" if p is not None else "-",
                _fmt_s(p.forward_s) if p is not None else "-",
                _fmt_s(p.backward_s) if p is not None else "-",
                f"{p.memory_bytes / 1e9:.2f} GB" if p is not None else "-",
                _fmt_recompute(st.recompute, st.selective),
                _fmt_stage_ranks(st),
                st.modules or "-"))
        return "\n".join([head, *_table(header, rows, left={"ranks", "modules"})])

    def to_dict(self) -> dict[str, Any]:
        d = asdict(replace(self, source=None))
        del d["source"]
        for st, sd in zip(self.stages, d["stages"], strict=True):
            sd["predicted"] = {} if st.predicted is None else st.predicted.to_dict()
        d["format"] = PLAN_FORMAT
        return d

    def to_onnx(self, path: str | os.PathLike[str]) -> None:
        """The captured graph as ONNX for Netron: one function per stage (a node that opens
        into the stage's graph), each task node with its `stage` and `atomic_component`
        attributes (`rannc.graph.onnx_export`). Needs the graph: a plan from rannc.plan() or
        RaNNCModule.plan."""
        if self.source is None:
            raise RaNNCError("this plan has no graph attached (it was loaded from a file); get it "
                             "from rannc.plan(...) or RaNNCModule.plan to export it")
        from rannc.atomic.components import task_attributes
        from rannc.graph.onnx_export import export_onnx

        graph, atomic = self.source
        attrs = task_attributes(graph, atomic)
        stage_of = {c: st.index for st in self.stages for c in st.components}
        for t, task in enumerate(graph.tasks):
            attrs[task.name]["stage"] = stage_of[atomic.holders[t][0]]
        export_onnx(graph, os.fspath(path), task_attrs=attrs, group_by="stage")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        if d.get("format") != PLAN_FORMAT:
            raise RaNNCError(f"plan format {d.get('format')!r} is not {PLAN_FORMAT}; plan again")
        stages = tuple(
            StagePlan(index=s["index"], components=tuple(s["components"]), ranks=tuple(s["ranks"]),
                      shares=tuple(s["shares"]), recompute=float(s["recompute"]),
                      param_names=tuple(s["param_names"]),
                      predicted=StagePrediction.from_dict(s["predicted"], f"stage {i}")
                      if s.get("predicted") else None,
                      modules=s.get("modules", ""), devices=tuple(s.get("devices", ())),
                      selective=bool(s.get("selective", False)))
            for i, s in enumerate(d["stages"])
        )
        return cls(stages=stages, microbatches=d["microbatches"], world_size=d["world_size"],
                   fingerprint=d["fingerprint"], schedule=d["schedule"],
                   predicted_iteration_time=d["predicted_iteration_time"],
                   batch_size=d.get("batch_size"), blocks=d.get("blocks"),
                   zero_stage=int(d.get("zero_stage", 0)))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON, atomically (a crash mid-write leaves the old file)."""
        tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """A plan written by `save()`."""
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def check(self, graph: TaskGraph, world_size: int, source: str = "the plan",
              atomic: AtomicPartition | None = None, batch_rows: int | None = None) -> None:
        """Raise if this plan was made for another model or another number of ranks; `source`
        names where it came from (a file) in the message. With `atomic` (and `batch_rows`, the
        global batch of the call deploying it) the whole plan is checked against the model and
        the world before anything runs: a plan file edited by hand, or written for another
        version of the model, is one clear PlanMismatchError on every rank (every rank checks
        the same broadcast plan against the same graph), not a KeyError or a shape error inside
        the pipeline."""
        again = ("plan again (load_deployment=False; save_deployment=True writes a new plan "
                 "file), or delete the plan file")
        if self.fingerprint != graph.fingerprint():
            raise PlanMismatchError(
                f"{source} was made for another model or input shapes (graph fingerprint "
                f"{self.fingerprint}, this model's is {graph.fingerprint()}). Fix: {again}."
            )
        if self.world_size != world_size:
            raise PlanMismatchError(
                f"{source} is for {self.world_size} ranks but {world_size} are running. Launch "
                f"{self.world_size} ranks, or {again}."
            )
        if atomic is not None:
            problem = plan_problem(self, graph, atomic, batch_rows)
            if problem is not None:
                raise PlanMismatchError(f"{source} is not a valid plan for this model and "
                                        f"{world_size} ranks: {problem}. Fix: {again}.")


def param_names_of(graph: TaskGraph, atomic: AtomicPartition, comps: Sequence[int]) -> tuple[str, ...]:
    """The original names of the parameters the components read, each once."""
    names: dict[str, None] = {}
    for c in comps:
        for t in atomic.components[c].tasks:
            for v in graph.tasks[t].inputs:
                val = graph.values[v]
                if val.kind is ValueKind.PARAM and val.target is not None:
                    names[val.target] = None
    return tuple(names)


def plan_problem(plan: Plan, graph: TaskGraph, atomic: AtomicPartition,
                 batch_rows: int | None = None) -> str | None:
    """The first thing wrong with `plan` for this graph and its world, said with the values,
    or None. Pure; the checks the runtime relies on and would otherwise fail on obscurely."""
    from rannc.schedule.spec import SCHEDULES

    if plan.schedule not in SCHEDULES:
        return f"schedule {plan.schedule!r} is not one of {', '.join(SCHEDULES)}"
    m = plan.microbatches
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        return f"microbatches={m!r} is not a positive integer"
    if batch_rows is not None and m > batch_rows:
        return (f"microbatches={m} exceeds the {batch_rows} rows of the global batch (each "
                "microbatch needs at least one row)")
    if not plan.stages:
        return "it has no stages"
    n_comp = len(atomic.components)
    shared = SCHEDULES[plan.schedule].chunks > 1  # several stages on the same ranks
    seen_rank: dict[int, int] = {}
    stage_of: dict[int, int] = {}
    for s, st in enumerate(plan.stages):
        if st.index != s:
            return f"stage {s} has index {st.index}"
        if not st.ranks:
            return f"stage {s} has no ranks"
        if len(st.shares) != len(st.ranks):
            return (f"stage {s} has {len(st.ranks)} replicas (ranks {list(st.ranks)}) but "
                    f"{len(st.shares)} row shares {list(st.shares)}; give one share per replica")
        if any(not isinstance(x, int | float) or not 0 < x <= 1 for x in st.shares) \
                or abs(sum(st.shares) - 1) > 1e-6:
            return (f"stage {s}'s row shares {list(st.shares)} must each be in (0, 1] and sum "
                    "to 1")
        if not 0 <= st.recompute <= 1:
            return f"stage {s}'s recompute={st.recompute} is not a fraction in [0, 1]"
        for r in st.ranks:
            if not isinstance(r, int) or not 0 <= r < plan.world_size:
                return f"stage {s} names rank {r!r}, not one of 0..{plan.world_size - 1}"
            if r in seen_rank and not (shared and plan.stages[seen_rank[r]].ranks == st.ranks):
                return f"rank {r} is in two stages ({seen_rank[r]} and {s})" + (
                    " whose ranks differ (stages sharing ranks must share all of them)"
                    if shared else "")
            seen_rank.setdefault(r, s)
        for c in st.components:
            if not isinstance(c, int) or not 0 <= c < n_comp:
                return (f"stage {s} lists atomic component {c!r}, but this model has {n_comp} "
                        f"(0..{n_comp - 1})")
            if c in stage_of:
                return f"atomic component {c} is in two stages ({stage_of[c]} and {s})"
            stage_of[c] = s
    idle = sorted(set(range(plan.world_size)) - set(seen_rank))
    if idle:
        return f"ranks {idle} are in no stage"
    lost = sorted(set(range(n_comp)) - set(stage_of))
    if lost:
        return f"atomic components {lost[:10]} are in no stage"
    for a, b in atomic.component_edges(graph):
        if stage_of[a] > stage_of[b]:
            return (f"atomic component {b} in stage {stage_of[b]} reads a value computed in a "
                    f"later stage ({stage_of[a]}): data must flow forward")
    for s, st in enumerate(plan.stages):
        need = set(param_names_of(graph, atomic, st.components))
        listed = set(st.param_names)
        if need != listed:
            missing, extra = sorted(need - listed), sorted(listed - need)
            what = []
            if missing:
                what.append(f"its components read {missing[:5]}, which it does not list")
            if extra:
                what.append(f"it lists {extra[:5]}, which its components do not read")
            return f"stage {s}'s parameters do not match its components: {'; '.join(what)}"
    return None


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], left: set[str]) -> list[str]:
    """Lines of a table whose columns are as wide as their widest cell (numbers right-aligned,
    the `left` columns left-aligned), two spaces apart, with no trailing blanks: every row
    puts each column at the same position whatever the rank lists or module names hold."""
    widths = [max(len(cells[i]) for cells in (header, *rows)) for i in range(len(header))]
    out = []
    for cells in (header, *rows):
        out.append("  ".join(c.ljust(w) if h in left else c.rjust(w)
                             for h, c, w in zip(header, cells, widths, strict=True)).rstrip())
    return out


def _fmt_stage_ranks(st: StagePlan) -> str:
    """`0-3,6` when the replicas share rows evenly on one kind of device; otherwise each rank
    with its share (and device), which the ranges would hide."""
    if len(set(st.shares)) > 1 or st.devices:
        return ",".join(f"{r}:{st.devices[j]}:{st.shares[j]:.2f}" if st.devices
                        else f"{r}:{st.shares[j]:.2f}" for j, r in enumerate(st.ranks))
    return fmt_ranks(st.ranks)


def fmt_ranks(ranks: Sequence[int]) -> str:
    """Ranks as sorted runs: (0, 1, 2, 3, 6) -> "0-3,6"; a pair of neighbours stays "4,5"."""
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ",".join(map(str, run))
                    for run in runs) or "-"


def _fmt_recompute(frac: float, selective: bool = False) -> str:
    prefix = "all" if frac >= 1 else "no" if frac <= 0 else f"{frac:.0%}"
    if not selective:
        return prefix
    return "sel" if frac <= 0 else f"sel+{prefix}"


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def check_replicas_divide(replicas: Sequence[int], world_size: int) -> None:
    """Replica counts (one per stage) must run whole copies of the pipeline on `world_size`
    ranks: sum(replicas) divides it. The one check and message, for forced and planned counts."""
    per = sum(replicas)
    if per < 1 or world_size % per:
        raise ConfigError(
            f"replicas={list(replicas)} sum to {per} ranks per pipeline, which does not "
            f"divide the {world_size} ranks running. Fix: give counts that sum to "
            f"{world_size} (or a divisor of it, to run {world_size} // sum copies of the "
            "pipeline), or leave replicas unset for the planner to choose.")


def stage_ranks(replicas: Sequence[int], world_size: int) -> list[tuple[int, ...]]:
    """Ranks of each stage's replicas: R copies of the pipeline, each over sum(replicas) ranks."""
    check_replicas_divide(replicas, world_size)
    per_copy = sum(replicas)
    copies = world_size // per_copy
    out: list[tuple[int, ...]] = []
    start = 0
    for r in replicas:
        out.append(tuple(c * per_copy + start + j for c in range(copies) for j in range(r)))
        start += r
    return out
