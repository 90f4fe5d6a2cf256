"""The synchronous pipeline runtime (fill-drain / GPipe), with a replica count per stage.

Every rank runs one replica of one stage. A call's global batch is the
concatenation of the ranks' local batches; it is cut into microbatches, and
each microbatch's rows are cut among each stage's replicas by their shares
(`rows.RowLayout`, computed identically on every rank, so a sender and a
receiver always agree on a transfer without asking each other). Every value
moves as rows: model inputs from the ranks that own them straight to the
stages that read them; stage outputs from the producing replicas to the
consuming replicas; batch outputs back to the ranks that own those rows.
Gradients travel the same routes backwards.

The user sees ordinary tensors: the outputs come out of an autograd Function
whose backward runs this rank's part of the pipeline backward, so
`loss.backward()` on every rank drives the whole thing.

Gradient semantics (DDP): rank r's `backward()` of L_r sends d L_r / d(out) / W
for its rows (W = world size) and the average of the scalar outputs'
gradients; each (microbatch, replica) piece of a scalar output carries the
weight rows/N of the global row-weighted mean; parameter gradients are then
summed over every rank holding the parameter (stage replicas, tied copies), in
buckets started during the last backward (`rannc.pipeline.grads`).

Index conventions: s, t stages; m microbatches; j replicas; r ranks.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from rannc import health
from rannc.atomic.components import AtomicPartition
from rannc.errors import ConfigError, InputMismatchError, RaNNCError
from rannc.graph.capture import CapturedModel
from rannc.graph.extract import (
    StageGraph,
    build_stage_module,
    check_buffer_writes_stay_in_one_stage,
    split_graph,
)
from rannc.graph.task_graph import Value, ValueKind, eval_dim
from rannc.pipeline import batchnorm as bnorm
from rannc.pipeline.grads import GradReducer, ParamGroup, share_overflow
from rannc.pipeline.rows import Range, RowLayout, intersect
from rannc.plans import Plan
from rannc.schedule import (
    FILL_DRAIN,
    Action,
    Event,
    Op,
    Schedule,
    ScheduleError,
    get_spec,
    make_schedule,
    validate,
)

if TYPE_CHECKING:
    from rannc.validate import CallAgreement

log = logging.getLogger(__name__)

_BN_WARNED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models warned about BatchNorm

# Hugging Face's keyword for the global number of loss items (tokens not labelled -100): a loss
# given it is sum / count, so its (microbatch, replica) pieces add up to the global loss.
COUNT_KWARG = "num_items_in_batch"

# Message kinds, part of every tag so two transfers between the same ranks never mix.
_FWD, _OUT, _GRAD, _OUT_GRAD = range(4)


@dataclass
class _Micro:
    """One microbatch on this replica: what its actions pass to each other."""

    rows: Range
    ins: list[Any] | None = None  # stage inputs (float activations as leaves when training)
    rng: torch.Tensor | None = None  # RNG state before the forward ran
    saved: list[Any] | None = None  # eager schedules: the stage inputs, for a late pass
    outs: list[Any] | None = None  # stage outputs, to send (SF)
    kept: list[Any] | None = None  # outputs of the kept part, with their autograd graph
    links: dict[str, torch.Tensor] = field(default_factory=dict)  # recomputed part -> kept part
    rec: list[Any] | None = None  # outputs of the recomputed part, rebuilt with a graph (R)
    out_grads: list[torch.Tensor | None] | None = None  # per stage output (RB)
    in_grads: list[Any] | None = None  # per stage input (B), to send (SB)

    @property
    def empty(self) -> bool:
        return self.rows[0] == self.rows[1]


@dataclass
class _Call:
    layout: RowLayout
    env: dict[str, Any]
    micro: list[_Micro]
    mode: str  # "forward" (no grad), "split" (fill-drain: backward() runs the rest), "eager"
    sends: list[Any] = field(default_factory=list)
    local: dict[Any, Any] = field(default_factory=dict)  # transfers to this rank itself
    stash: dict[str, torch.Tensor] | None = None  # eager: gradients for a unit loss gradient
    used: set[str] = field(default_factory=set)  # batch outputs some rank back-propagates from
    grad_inputs: frozenset[str] = frozenset()  # model inputs whose rows get gradients back
    input_stash: dict[str, torch.Tensor] = field(default_factory=dict)  # eager: for a unit loss gradient
    t0: float = 0.0
    # A call run on the last call's row layout before the ranks agreed on this one's: its
    # agreement and checks, and its transfers to other ranks, held back until they pass.
    agreement: CallAgreement | None = None
    checks: list[Callable[[], None]] = field(default_factory=list)
    held_back: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)


class _LayoutChanged(Exception):
    """A call run on the last call's layout found that some rank's batch size changed: it runs
    again on `sizes` (nothing of it has left this rank)."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__(sizes)
        self.sizes = sizes


@dataclass(frozen=True, slots=True)
class _Part:
    """The recomputed prefix or the kept suffix of this rank's stage."""

    graph: StageGraph
    module: Any


class PipelineRuntime:
    def __init__(self, model: nn.Module, captured: CapturedModel, atomic: AtomicPartition,
                 plan: Plan, rank: int, world_size: int, device: torch.device,
                 trace: bool = False,
                 wrap_stage: Callable[[fx.GraphModule], Any] | None = None,
                 batchnorm: str = "local", bucket_mb: float = 25.0) -> None:
        self.model, self.cap, self.plan = model, captured, plan
        self._wrap_stage = wrap_stage  # e.g. torch.compile (Config.compile), applied to each part
        self.rank, self.world_size, self.device = rank, world_size, device
        self.graph = captured.graph
        groups = [list(s.components) for s in plan.stages]
        self.stages: list[StageGraph] = split_graph(self.graph, atomic, groups)
        check_buffer_writes_stay_in_one_stage(self.graph, self.stages)
        self.s = plan.stage_of_rank(rank).index
        self.j = plan.stages[self.s].ranks.index(rank)
        self.me = self.stages[self.s]
        self.vid = {v: i for i, v in enumerate(sorted(self.graph.values))}
        self.out_stage = self._output_stages()
        self._suppliers, self._consumers = self._routes()
        self._grad_edges, self._input_edges = self._gradient_edges()
        self._summed = self._summed_outputs()
        self._check_boundaries()
        self.held = self._held_params()
        param_groups = self.param_groups = self._param_groups()
        self._bucket_bytes = int(bucket_mb * 2**20)
        # rannc.ownership.parameter_owners of the deployment (set by the module): first
        # parameter name -> the holder that saves it, counts it in norms and, under ZeRO-1,
        # steps it.
        self.owners: dict[str, int] = {}
        self.sync = True
        self._call: _Call | None = None
        planned = get_spec(plan.schedule)
        # the schedule run: an eager one falls back to fill-drain without one scalar loss
        self.spec = planned if not planned.eager or self._one_scalar_loss() else get_spec(FILL_DRAIN)
        self.schedule = self._schedule(self.spec.name)
        self._has_consumers = bool(self.schedule.consumers(self.s))
        self.rec_part, self.keep_part = self._parts(captured, atomic, groups)
        self.grads = GradReducer(self.held, param_groups, self._first_use(),
                                 int(bucket_mb * 2**20), self._accumulations())
        self._bn = self._batch_norm(batchnorm)
        bn_tasks = set(bnorm.training_batch_norms(self.cap.gm, self.graph))
        self._bn_stages = [t for t, st in enumerate(self.stages)
                           if len(self.plan.stages[t].ranks) > 1 and set(st.tasks) & bn_tasks]
        if self.spec is not planned and rank == 0:
            log.info("rannc: schedule %s needs the model to return one floating-point scalar "
                     "(the loss) to run its backward inside forward(); this model returns %s, so "
                     "it runs fill-drain (%s) instead", plan.schedule, self._outputs_text(),
                     FILL_DRAIN)
        if self._count_input() is not None and not self._summed and rank == 0:
            log.warning("rannc: the call passed %s, but no scalar output of the model is computed "
                        "from it (its loss ignores it), so scalar outputs are combined as a "
                        "row-weighted mean over microbatches and replicas, not a sum; compute "
                        "the loss as sum / %s inside the model for the exact global value",
                        COUNT_KWARG, COUNT_KWARG)
        self._has_batch_grad_outputs = any(
            _is_float(self.graph.values[v]) and self.graph.values[v].batch_dim is not None
            for v in self.out_stage)
        self._late_logged = False
        self.trace = trace
        # a stand-in parameter in the optimizer of a rank that holds none (see _share_overflow)
        self.placeholder: nn.Parameter | None = None
        self.events: list[Event] = []  # the last iteration's actions, when tracing
        # (digest, every rank's local batch size) of the last call: the guess for the next one.
        self._agreed: tuple[int, list[int]] | None = None
        # A call on a guessed layout is run again when the guess was wrong; that is exact only
        # where its first run changed nothing but the RNG: no BatchNorm statistics, no buffer
        # written in forward.
        self._can_guess = (world_size > 1 and not self._bn.sites
                           and not any(t.mutates for t in self.graph.tasks))
        self.guessed_calls = 0  # calls run on a guessed layout (their agreement not waited for)
        self.rerun_calls = 0  # of those, run again because a batch size changed
        self.iteration_s = 0.0  # the last iteration's seconds from forward() to the gradients

    def _parts(self, captured: CapturedModel, atomic: AtomicPartition,
               groups: list[list[int]]) -> tuple[_Part | None, _Part | None]:
        """Split this stage into the prefix whose activations are dropped in forward and rebuilt
        before backward (`recompute` of its components) and the suffix that keeps them."""
        comps = groups[self.s]
        n_rec = self.plan.stages[self.s].recomputed_components
        if not self.spec.recomputes(self.s, len(self.stages), True):
            n_rec = 0  # e.g. scp's last stage holds one microbatch at a time: nothing to save

        def part(st: StageGraph) -> _Part:
            gm = build_stage_module(captured.gm, self.graph, st)
            return _Part(st, gm if self._wrap_stage is None else self._wrap_stage(gm))

        if n_rec in (0, len(comps)):
            whole = part(self.me)
            return (whole, None) if n_rec else (None, whole)
        cut = [*groups[:self.s], comps[:n_rec], comps[n_rec:], *groups[self.s + 1:]]
        sub = split_graph(self.graph, atomic, cut)
        return part(sub[self.s]), part(sub[self.s + 1])

    def _batch_norm(self, mode: str) -> bnorm.BatchNormState:
        """Training-mode BatchNorm: deferred running statistics, the stage replicas' process
        group, and `batchnorm="sync"`'s synchronised statistics (see `rannc.pipeline.batchnorm`)."""
        state = bnorm.BatchNormState(bnorm.check_mode(mode), None)
        tasks = bnorm.training_batch_norms(self.cap.gm, self.graph)
        if not tasks:
            return state
        where = {t for t, st in enumerate(self.stages) if set(st.tasks) & set(tasks)}
        for t in sorted(where):  # every rank creates every group, in the same order
            ranks = list(self.plan.stages[t].ranks)
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if t == self.s:
                state.group = group
        for part in (self.rec_part, self.keep_part):
            if part is not None:
                bnorm.install(part.module, self.graph, state)
        paths = sorted({self.graph.tasks[i].module_path or self.graph.tasks[i].name for i in tasks})
        reps = {t: len(self.plan.stages[t].ranks) for t in sorted(where)}
        if state.mode == "sync" and self.plan.microbatches > 1:
            raise ConfigError(
                f"batchnorm='sync' needs one microbatch where BatchNorm runs in training "
                f"({', '.join(paths)}), but the plan has {self.plan.microbatches}: plan again "
                "(with batchnorm='sync' the planner keeps one), or set microbatches=1")
        differs = self.plan.microbatches > 1 or max(reps.values()) > 1
        if state.mode == "local" and differs and self.rank == 0 and self.model not in _BN_WARNED:
            _BN_WARNED.add(self.model)
            log.warning(
                "rannc: BatchNorm in training (%s) normalises each microbatch on each stage "
                "replica over its own rows (plan: %d microbatches; replicas of the stages "
                "holding it: %s), so outputs and gradients differ from the model on the global "
                "batch, as under DDP without SyncBatchNorm; running statistics are still "
                "updated once per call from the global batch. Config batchnorm='sync' makes "
                "it exact (one microbatch, statistics synchronised over the replicas)",
                ", ".join(paths), self.plan.microbatches,
                ", ".join(f"stage {t}: {r}" for t, r in reps.items()))
        return state

    def _check_sync_rows(self, layout: RowLayout) -> None:
        """Synchronised BatchNorm is a collective of the stage's replicas in every
        microbatch: each replica needs rows (the same check on every rank)."""
        if self._bn.mode != "sync" or not self._bn_stages:
            return
        for t in self._bn_stages:
            for m, per in enumerate(layout.rows[t]):
                if any(a == b for a, b in per):
                    raise RaNNCError(
                        f"batchnorm='sync': microbatch {m} of the global batch "
                        f"({layout.n_rows} rows) leaves a replica of stage {t} "
                        f"({len(per)} replicas, rows {per}) without rows; pass at least "
                        "one row per replica")

    def _schedule(self, name: str) -> Schedule:
        sup = [sorted({self.supplier(v, t) for v in st.inputs if self._moves(v)} - {-1})
               for t, st in enumerate(self.stages)]
        rc = [st.recomputed_components > 0 for st in self.plan.stages]
        try:
            sched = make_schedule(name, self.plan.microbatches, sup, rc)
        except ScheduleError as e:
            raise RaNNCError(f"plan schedule {name!r}: {e}") from e
        validate(sched)
        return sched

    def _one_scalar_loss(self) -> bool:
        floats = [v for v in self.out_stage if _is_float(self.graph.values[v])]
        scalars = [v for v in floats if self.graph.values[v].batch_dim is None]
        return len(scalars) == 1

    def _outputs_text(self) -> str:
        vals = [self.graph.values[v] for v in self.out_stage]
        return ", ".join(f"{v.name} {list(v.shape)} {v.dtype}" for v in vals) or "no tensors"

    # -- static routing ----------------------------------------------------
    def _routes(self) -> tuple[dict[tuple[str, int], int], dict[tuple[str, int], list[int]]]:
        """Fixed at deployment: the stage sending each moved input of stage t (-1: a model
        input, from its owners), and the stages reading each value from a given sender."""
        suppliers: dict[tuple[str, int], int] = {}
        consumers: dict[tuple[str, int], list[int]] = {}
        for t, st in enumerate(self.stages):
            for v in st.inputs:
                if not self._moves(v):
                    continue
                g = self._find_supplier(v, t)
                suppliers[(v, t)] = g
                consumers.setdefault((v, g), []).append(t)
        return suppliers, consumers

    def _find_supplier(self, v: str, t: int) -> int:
        if self.graph.values[v].kind is ValueKind.INPUT:
            return -1
        for g in range(t - 1, -1, -1):
            if v in self.stages[g].outputs:
                return g
        raise RaNNCError(f"no stage before {t} supplies value {v}")

    def _gradient_edges(self) -> tuple[set[tuple[str, int]], set[tuple[str, int]]]:
        """The moved values (v, t) whose gradient stage t can send back: stage t has a task
        reading v with an output some float model output depends on. Both ends read this
        fixed set, so a value only a dead branch reads (a BatchNorm that no output uses, kept
        for its statistics) sends nothing back, and its producer's parameters keep `.grad`
        None as in the original model, where zeros would let weight decay move them.
        Returned apart: the activations', always sent, and the float model inputs', sent to
        the ranks owning the rows only in calls where those inputs require grad."""
        g = self.graph
        live = {v for v in self.out_stage if _is_float(g.values[v])}
        for task in reversed(g.tasks):
            if any(o in live for o in task.outputs):
                live.update(v for v in task.inputs if _is_float(g.values[v]))
        edges = {(v, t) for t, st in enumerate(self.stages) for i in st.tasks
                 for v in g.tasks[i].inputs
                 if self._moves(v) and _is_float(g.values[v])
                 and any(o in live for o in g.tasks[i].outputs)}
        acts = {(v, t) for v, t in edges if self._is_activation(v)}
        return acts, edges - acts

    def grad_inputs(self, leaves: Sequence[Any]) -> list[tuple[str, torch.Tensor]]:
        """(value name, tensor) of the call's input leaves that require grad and reach a float
        output: each gets the gradient of this rank's rows back (`backward` returns them)."""
        wanted = {v for v, _t in self._input_edges}
        return [(v, x) for v, x in zip(self.cap.leaf_values, leaves, strict=True)
                if v in wanted and isinstance(x, torch.Tensor) and x.requires_grad]

    def supplier(self, v: str, t: int) -> int:
        """The stage that sends moved value v to stage t (-1: a model input, from its owners)."""
        return self._suppliers[(v, t)]

    def consumers(self, v: str, s: int) -> list[int]:
        """Stages that read moved value v from stage s (or from the input owners when s == -1)."""
        return self._consumers.get((v, s), [])

    def _moves(self, v: str) -> bool:
        val = self.graph.values[v]
        return val.is_tensor and val.batch_dim is not None and val.kind in (
            ValueKind.INPUT, ValueKind.ACTIVATION)

    def _output_stages(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for v in self.graph.outputs:
            if v is None:
                continue
            prods = [s for s, st in enumerate(self.stages) if v in st.outputs]
            if not prods:
                raise RaNNCError(f"model output {v} is not computed by any stage (it is a "
                                 f"{self.graph.values[v].kind.value}); return a computed tensor")
            out[v] = prods[-1]
        return out

    def _check_boundaries(self) -> None:
        for t, st in enumerate(self.stages):
            for v in st.inputs:
                val = self.graph.values[v]
                if val.kind is ValueKind.ACTIVATION and val.is_tensor and val.batch_dim is None:
                    raise RaNNCError(
                        f"value {v} ({val.shape}) has no batch dimension but crosses into stage "
                        f"{t}; it cannot be split by rows. Choose another partition_num or cut")

    def _held_params(self) -> dict[str, nn.Parameter]:
        params = dict(self.model.named_parameters(remove_duplicate=False))
        return {n: params[n] for n in self.plan.stages[self.s].param_names}

    def _first_use(self) -> dict[str, int]:
        """Per parameter name: the index of the first task reading it in the whole graph (the
        same on every rank: the reducer's bucket order)."""
        out: dict[str, int] = {}
        for i, task in enumerate(self.graph.tasks):
            for v in task.inputs:
                val = self.graph.values[v]
                if val.kind is ValueKind.PARAM and val.target is not None:
                    out.setdefault(val.target, i)
        return out

    def _accumulations(self) -> dict[int, int]:
        """Per held parameter (by id): how many backward passes of one microbatch accumulate
        into it here, one per part (recomputed, kept) reading it."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        out: dict[int, int] = {}
        for part in (self.rec_part, self.keep_part):
            if part is None:
                continue
            ids = {id(params[val.target]) for v in part.graph.inputs
                   for val in [self.graph.values[v]]
                   if val.kind is ValueKind.PARAM and val.target in params}
            for i in ids:
                out[i] = out.get(i, 0) + 1
        return out

    def _param_groups(self) -> list[ParamGroup]:
        """(ranks, parameter names, process group) per distinct set of holding ranks.

        Every rank creates every group in the same order, as torch.distributed requires.
        """
        holders = self.plan.holders()
        by_set: dict[tuple[int, ...], list[str]] = {}
        for n in sorted(holders):
            by_set.setdefault(tuple(sorted(holders[n])), []).append(n)
        out = []
        for ranks in sorted(by_set):
            group = dist.new_group(list(ranks)) if len(ranks) > 1 else None
            if self.rank in ranks:
                out.append((ranks, by_set[ranks], group))
        return out

    # -- transfers ---------------------------------------------------------
    def _tag(self, v: str, m: int, kind: int) -> int:
        return ((self.vid[v] * max(self.plan.microbatches, 1) + m) * 4 + kind) % (2**31 - 1)

    def _row_slice(self, x: torch.Tensor, v: str, base: Range, rows: Range) -> torch.Tensor:
        val = self.graph.values[v]
        k, d = val.batch_scale, val.batch_dim or 0
        return x.narrow(d, (rows[0] - base[0]) * k, (rows[1] - rows[0]) * k)

    def _empty(self, v: str, n_rows: int) -> torch.Tensor:
        val = self.graph.values[v]
        shape = [eval_dim(dim, n_rows) for dim in val.shape]
        return torch.empty(shape, dtype=getattr(torch, val.dtype), device=self.device)

    def _send(self, x: torch.Tensor, dst: int, tag: int, call: _Call) -> None:
        if dst == self.rank:
            call.local[tag] = x.detach()
        elif call.agreement is not None:
            call.held_back.append((x.detach().contiguous(), dst, tag))
        else:
            call.sends.append(dist.isend(x.detach().contiguous(), dst, tag=tag))

    def _settle(self, call: _Call) -> None:
        """A call run on a guessed layout: wait for the ranks' agreement (raising what it raises,
        on every rank alike), then either send what was held back or, if some rank's batch size
        changed, start the call again on the agreed layout."""
        if call.agreement is None:
            return
        sizes = call.agreement.resolve()
        for check in call.checks:
            check()
        if sizes != call.layout.local_sizes:
            raise _LayoutChanged(sizes)
        call.agreement = None
        for x, dst, tag in call.held_back:
            call.sends.append(dist.isend(x, dst, tag=tag))
        call.held_back.clear()

    def _recv_rows(self, v: str, rows: Range, sources: Sequence[tuple[int, Range]], kind: int,
                   m: int, call: _Call) -> torch.Tensor:
        """Assemble value v's rows `rows` from pieces held by (rank, range) sources."""
        pieces = []
        for r, have in sources:
            part = intersect(rows, have)
            if part is None:
                continue
            tag = self._tag(v, m, kind)
            if r == self.rank:
                pieces.append(call.local.pop(tag))  # sliced to `part` by the sender (this rank)
            else:
                self._settle(call)
                buf = self._empty(v, part[1] - part[0])
                dist.recv(buf, r, tag=tag)
                pieces.append(buf)
        d = self.graph.values[v].batch_dim or 0
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, d)

    def _replicas(self, t: int, m: int, layout: RowLayout) -> list[tuple[int, Range]]:
        return list(zip(self.plan.stages[t].ranks, layout.rows[t][m], strict=True))

    # -- forward -----------------------------------------------------------
    def guess_sizes(self, agreement: CallAgreement) -> list[int] | None:
        """The ranks' local batch sizes, guessed before they agree on them: those of this
        runtime's last call when this rank's call is the same kind with as many rows as then.
        None where a guess cannot be taken back if wrong (BatchNorm statistics or buffers
        updated in forward: see `forward`)."""
        if self._agreed is None or not self._can_guess:
            return None
        digest, sizes = self._agreed
        if digest != agreement.digest or sizes[self.rank] != agreement.rows:
            return None
        return list(sizes)

    def forward(self, leaves: Sequence[Any], sizes: Sequence[int],
                agreement: CallAgreement | None = None) -> list[Any]:
        """Run this rank's part of the call, every rank's local batch sizes given (from
        `validate.agree_on_call`); returns the flat outputs for this rank.

        With `agreement` not yet resolved, `sizes` is a guess (`guess_sizes`): the call computes
        on it and holds back every transfer to another rank until the agreement arrives, before
        its first receive from another rank at the latest, so no collective stands between one
        step and the next (stage 0 runs its first forwards while later stages still step their
        optimizers). If some rank's batch size changed, nothing has left this rank: the RNG goes
        back to where it was and the call runs again on the agreed sizes.

        Without grad mode only forwards run. Under fill-drain, the forwards run here and the
        rest of the line when `backward()` comes. Under 1F1B and the shifted critical path the
        whole line runs here, seeded with a unit gradient of the loss, and `backward()` commits
        the gradients scaled by the real one (gradients are linear in it)."""
        guessed = agreement is not None and not agreement.resolved
        if guessed:
            assert agreement is not None
            self.guessed_calls += 1
            rng = _rng_state(self.device)
            try:
                out = self._forward(leaves, sizes, agreement, lambda: self._check_count(leaves))
            except _LayoutChanged as changed:
                _set_rng_state(rng, self.device)
                self.rerun_calls += 1
                sizes = changed.sizes
                if self.rank == 0:
                    log.debug("rannc: a rank's batch size changed: the call runs on %s", sizes)
                out = self._forward(leaves, sizes, None, None)
        else:
            self._check_count(leaves)
            out = self._forward(leaves, sizes, None, None)
        if agreement is not None:
            self._agreed = (agreement.digest, list(sizes))
        return out

    def _forward(self, leaves: Sequence[Any], sizes: Sequence[int],
                 agreement: CallAgreement | None, count_check: Callable[[], None] | None,
                 ) -> list[Any]:
        layout = RowLayout(sizes, self.plan.microbatches, [s.shares for s in self.plan.stages])
        self._check_sync_rows(layout)
        buffers: dict[str, torch.Tensor] = {}
        if self._bn.sites:
            buffers = dict(self.model.named_buffers(remove_duplicate=False))
            self._bn.begin_call(buffers)
        grad = torch.is_grad_enabled()
        mode = "forward" if not grad else "eager" if self.spec.eager else "split"
        call = _Call(layout, self.cap.bind(self.model, leaves),
                     [_Micro(layout.rows[self.s][m][self.j]) for m in range(self.plan.microbatches)],
                     mode, t0=time.perf_counter(), agreement=agreement,
                     checks=[count_check] if count_check is not None else [])
        if grad:
            call.grad_inputs = frozenset(v for v, _x in self.grad_inputs(leaves))
        self._call = None
        self.events = []
        self.iteration_s = 0.0
        self._send_inputs(call)
        scalars = {v: torch.zeros((), dtype=torch.float64, device=self.device)
                   for v in self._scalar_outputs()}
        acts = self.schedule.actions[self.s]
        if mode == "forward":
            acts = tuple(a for a in acts if a.op in (Op.RF, Op.F, Op.SF))
        elif mode == "split":
            acts = self.schedule.forward_part(self.s)
        if mode == "eager":
            before = {n: p.grad for n, p in self.held.items()}
            for p in self.held.values():
                p.grad = None
            try:
                self._run(call, acts, scalars)
                call.stash = {n: p.grad for n, p in self.held.items() if p.grad is not None}
                call.input_stash = self._receive_input_grads(call)
            finally:
                for n, p in self.held.items():
                    p.grad = before[n]
        else:
            self._run(call, acts, scalars)
        if self._bn.sites:  # the running statistics, once per call (every replica)
            self._bn.finish_call(buffers, self.device)
        return self._collect_outputs(call, layout, scalars)

    def _send_inputs(self, call: _Call) -> None:
        """My input rows, every microbatch, straight to the stages that read them."""
        mine = call.layout.owned[self.rank]
        for v in self.graph.inputs:
            if not self._moves(v):
                continue
            for t in self.consumers(v, -1):
                for m in range(self.plan.microbatches):
                    for r, rows in self._replicas(t, m, call.layout):
                        part = intersect(mine, rows)
                        if part is not None:
                            self._send(self._row_slice(call.env[v], v, mine, part), r,
                                       self._tag(v, m, _FWD), call)

    def _run(self, call: _Call, acts: Sequence[Action], scalars: dict[str, torch.Tensor],
             scalar_g: dict[str, torch.Tensor] | None = None, arm: Action | None = None) -> None:
        """Run `acts`; `arm`: the action before which the gradient reducer is armed."""
        for a in acts:
            mic = call.micro[a.micro]
            if mic.empty:
                continue
            if a == arm:
                self.grads.arm()
            t0 = time.perf_counter() if self.trace else 0.0
            # A named range per action (F0.3: forward of stage 0, microbatch 3) in torch.profiler traces.
            with torch.profiler.record_function(f"rannc {a}"):
                self._run_action(call, a, mic, scalars, scalar_g)
            if self.trace:
                self.events.append(Event(a, t0 - call.t0, time.perf_counter() - call.t0))
            if call.agreement is not None and call.agreement.ready():
                self._settle(call)  # the held-back transfers go as soon as they can

    def _run_action(self, call: _Call, a: Action, mic: _Micro, scalars: dict[str, torch.Tensor],
                    scalar_g: dict[str, torch.Tensor] | None) -> None:
        if a.op is Op.RF:
            self._receive_inputs(call, a.micro)
        elif a.op is Op.F:
            self._forward_micro(call, a.micro)
            if not self._has_consumers:  # no SF action: model outputs leave right away
                self._send_outputs(call, a.micro, scalars)
        elif a.op is Op.SF:
            self._send_outputs(call, a.micro, scalars)
        elif a.op is Op.RB:
            mic.out_grads = [self._output_grad(v, a.micro, mic.rows, call, scalar_g)
                             for v in self.me.outputs]
        elif a.op is Op.R:
            self._recompute_micro(mic)
        elif a.op is Op.B:
            if mic.out_grads is None:  # a stage without consumers: only model-output grads
                mic.out_grads = [self._output_grad(v, a.micro, mic.rows, call, scalar_g)
                                 for v in self.me.outputs]
            self._backward_micro(call, mic)
            # model inputs' gradients go back to their owners now: a stage reading only
            # model inputs has no SB action
            self._send_input_grads(call, a.micro, model_inputs=True)
        elif a.op is Op.SB:
            self._send_input_grads(call, a.micro)

    def _send_outputs(self, call: _Call, m: int, scalars: dict[str, torch.Tensor]) -> None:
        mic = call.micro[m]
        assert mic.outs is not None
        for v, o in zip(self.me.outputs, mic.outs, strict=True):
            self._send_output(v, o, m, mic.rows, call, scalars)
        mic.outs = None

    def _receive_inputs(self, call: _Call, m: int) -> None:
        mic = call.micro[m]
        ins = [self._stage_input(v, m, mic.rows, call) for v in self.me.inputs]
        if call.mode != "forward":
            ins = [_leaf(x) if self._wants_grad(v, call) else x
                   for v, x in zip(self.me.inputs, ins, strict=True)]
        mic.ins = ins

    def _forward_micro(self, call: _Call, m: int) -> None:
        mic = call.micro[m]
        if mic.ins is None:  # the first stage: only model inputs, received here
            self._receive_inputs(call, m)
        assert mic.ins is not None
        env = dict(zip(self.me.inputs, mic.ins, strict=True))
        grad = call.mode != "forward"
        mic.rng = torch.get_rng_state()
        if call.mode == "eager" and self._has_batch_grad_outputs:
            mic.saved = list(mic.ins)
        self._bn.accumulate = True  # BatchNorm statistics count in this first forward only
        try:
            self._forward_parts(mic, env, grad)
        finally:
            self._bn.accumulate = False
        mic.outs = [env[v] for v in self.me.outputs]
        if not grad:
            mic.ins = None

    def _forward_parts(self, mic: _Micro, env: dict[str, Any], grad: bool) -> None:
        if self.rec_part is not None:
            with torch.no_grad():
                outs = self.rec_part.module(*[env[v] for v in self.rec_part.graph.inputs])
            for v, o in zip(self.rec_part.graph.outputs, outs, strict=True):
                if grad and isinstance(o, torch.Tensor) and o.is_floating_point():
                    o = o.detach().requires_grad_(True)
                    mic.links[v] = o
                env[v] = o
        if self.keep_part is not None:
            with torch.set_grad_enabled(grad):
                outs = self.keep_part.module(*[env[v] for v in self.keep_part.graph.inputs])
            env.update(zip(self.keep_part.graph.outputs, outs, strict=True))
            mic.kept = list(outs) if grad else None

    def _recompute_micro(self, mic: _Micro) -> None:
        """Rebuild the recomputed part's activations, replaying its dropout; buffers get
        copies so BatchNorm statistics update once per microbatch, as without recomputation."""
        part = self.rec_part
        assert part is not None and mic.ins is not None and mic.rng is not None
        env = dict(zip(self.me.inputs, mic.ins, strict=True))
        ins = [env[v].clone() if self._is_buffer(v) else env[v] for v in part.graph.inputs]
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            torch.set_rng_state(mic.rng)
            mic.rec = list(part.module(*ins))

    def _backward_micro(self, call: _Call, mic: _Micro) -> None:
        """Backward through the kept part, then the recomputed part, into the stage inputs."""
        assert mic.out_grads is not None and mic.ins is not None
        grad_of = dict(zip(self.me.outputs, mic.out_grads, strict=True))
        if self.keep_part is not None and mic.kept is not None:
            _backward(mic.kept, [grad_of.get(v) for v in self.keep_part.graph.outputs])
        if self.rec_part is not None:
            if mic.rec is None:
                self._recompute_micro(mic)
            assert mic.rec is not None
            gs = []
            for v in self.rec_part.graph.outputs:
                g, link = grad_of.get(v), mic.links.get(v)
                if link is not None and link.grad is not None:
                    g = link.grad if g is None else g + link.grad
                gs.append(g)
            _backward(mic.rec, gs)
        mic.in_grads = self._input_grads(call, mic.ins)
        mic.ins = mic.kept = mic.rec = mic.out_grads = None
        mic.links = {}

    def _wants_grad(self, v: str, call: _Call) -> bool:
        """Whether this stage computes stage input v's gradient in this call."""
        return self._is_activation(v) or (v in call.grad_inputs and (v, self.s) in self._input_edges)

    def _input_grads(self, call: _Call, ins: Sequence[Any]) -> list[Any]:
        """Per stage input: its gradient (zeros if none reached it) where the sender waits for
        one (`_gradient_edges`, and the model inputs requiring grad), else None."""
        return [(x.grad if x.grad is not None else torch.zeros_like(x))
                if ((v, self.s) in self._grad_edges
                    or (v in call.grad_inputs and (v, self.s) in self._input_edges))
                and isinstance(x, torch.Tensor) else None
                for v, x in zip(self.me.inputs, ins, strict=True)]

    def _send_input_grads(self, call: _Call, m: int, model_inputs: bool = False) -> None:
        """Stage input gradients back to their senders: a model input's to the ranks owning
        those rows. With `model_inputs`, only those (the rest wait for the SB action)."""
        mic = call.micro[m]
        if mic.in_grads is None:
            return
        for i, (v, g) in enumerate(zip(self.me.inputs, mic.in_grads, strict=True)):
            if g is None:
                continue
            src = self.supplier(v, self.s)
            if model_inputs and src != -1:
                continue
            dests = list(enumerate(call.layout.owned)) if src == -1 else \
                self._replicas(src, m, call.layout)
            for r, theirs in dests:
                part = intersect(mic.rows, theirs)
                if part is not None:
                    self._send(self._row_slice(g, v, mic.rows, part), r, self._tag(v, m, _GRAD), call)
            mic.in_grads[i] = None
        if not model_inputs:
            mic.in_grads = None

    def _receive_input_grads(self, call: _Call) -> dict[str, torch.Tensor]:
        """The gradients of this rank's rows of the model inputs that require grad: the pieces
        every (microbatch, replica) of every stage reading them sent back, in row order, summed
        over the stages."""
        layout = call.layout
        mine = layout.owned[self.rank]
        out: dict[str, torch.Tensor] = {}
        for v in sorted(call.grad_inputs):
            d = self.graph.values[v].batch_dim or 0
            for t in self.consumers(v, -1):
                if (v, t) not in self._input_edges:
                    continue
                pieces = []
                for m in range(self.plan.microbatches):
                    part = intersect(mine, layout.micro[m])
                    if part is not None:
                        pieces.append(self._recv_rows(v, part, self._replicas(t, m, layout),
                                                      _GRAD, m, call))
                g = torch.cat(pieces, d) if pieces else self._empty(v, 0)
                out[v] = g if v not in out else out[v] + g
        return out

    def _stage_input(self, v: str, m: int, rows: Range, call: _Call) -> Any:
        val = self.graph.values[v]
        if val.dtype == "sym_int":
            return eval_dim(val.sym_expr or "batch", rows[1] - rows[0])
        if not self._moves(v):
            return call.env[v]
        g = self.supplier(v, self.s)
        src = list(enumerate(call.layout.owned)) if g == -1 else self._replicas(g, m, call.layout)
        return self._recv_rows(v, rows, src, _FWD, m, call)

    def _send_output(self, v: str, o: Any, m: int, rows: Range, call: _Call,
                     scalars: dict[str, torch.Tensor]) -> None:
        layout = call.layout
        if self._moves(v):
            for t in self.consumers(v, self.s):
                for r, theirs in self._replicas(t, m, layout):
                    part = intersect(rows, theirs)
                    if part is not None:
                        self._send(self._row_slice(o, v, rows, part), r, self._tag(v, m, _FWD), call)
        if self.out_stage.get(v) != self.s:
            return
        if v in scalars:
            w = self._piece_weight(v, rows, layout)
            scalars[v] += o.detach().to(torch.float64) * w
        else:
            for r, owned in enumerate(layout.owned):
                part = intersect(rows, owned)
                if part is not None:
                    self._send(self._row_slice(o, v, rows, part), r, self._tag(v, m, _OUT), call)

    def _piece_weight(self, v: str, rows: Range, layout: RowLayout) -> float:
        """The weight of one (microbatch, replica) piece of scalar output v in its global value:
        1 (a sum) where v is divided by the global `num_items_in_batch`, each piece being
        sum / global count; else the piece's share of the rows (a row-weighted mean)."""
        return 1.0 if v in self._summed else (rows[1] - rows[0]) / layout.n_rows

    def _count_input(self) -> str | None:
        """The value of the `num_items_in_batch` keyword input (Hugging Face's global count of
        loss items), if the call passed it as a tensor."""
        tree = pytree.tree_unflatten(list(range(len(self.cap.leaf_values))), self.cap.layout.spec)
        kwargs = tree[1] if isinstance(tree, tuple) and len(tree) == 2 else {}
        i = kwargs.get(COUNT_KWARG) if isinstance(kwargs, dict) else None
        return self.cap.leaf_values[i] if isinstance(i, int) else None

    def _summed_outputs(self) -> set[str]:
        """The scalar outputs computed from the `num_items_in_batch` input: their pieces sum."""
        count = self._count_input()
        if count is None:
            return set()
        reached = {count}
        for task in self.graph.tasks:
            if any(v in reached for v in task.inputs):
                reached.update(task.outputs)
        return {v for v in self._scalar_outputs() if v in reached}

    def _check_count(self, leaves: Sequence[Any]) -> None:
        """`num_items_in_batch` is the global count: the same on every rank (a rank passing its
        own count would silently scale its pieces wrongly). Collective when the call passed it;
        after the call's agreement, so that every rank runs the same collectives in the same
        order even when the agreement raises."""
        count = self._count_input()
        if count is None:
            return
        x = next(leaf for v, leaf in zip(self.cap.leaf_values, leaves, strict=True) if v == count)
        c = float(x.detach().reshape(-1)[0]) if x.numel() == 1 else math.nan
        both = torch.tensor([c, -c], dtype=torch.float64, device=self.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        hi, lo = float(both[0]), -float(both[1])
        if not hi == lo == c or x.numel() != 1:
            raise InputMismatchError(
                f"{COUNT_KWARG} differs across ranks (from {lo:g} to {hi:g}; or is not one "
                "number): it must be the count of loss items in the GLOBAL batch, the same on "
                "every rank. Fix: sum the local counts over the ranks (e.g. "
                "torch.distributed.all_reduce of (labels != -100).sum()) and pass that on every rank")

    def _scalar_outputs(self) -> list[str]:
        return [v for v in self.out_stage if self.graph.values[v].batch_dim is None]

    def _collect_outputs(self, call: _Call, layout: RowLayout,
                         scalars: dict[str, torch.Tensor]) -> list[Any]:
        self._settle(call)
        if scalars:
            names = sorted(scalars)
            flat = torch.stack([scalars[v] for v in names])
            dist.all_reduce(flat)
            for v, x in zip(names, flat, strict=True):
                scalars[v] = x.to(getattr(torch, self.graph.values[v].dtype))
        mine = layout.owned[self.rank]
        batch_out: dict[str, torch.Tensor] = {}
        for v, s in self.out_stage.items():
            if v in scalars:
                continue
            pieces = []
            for m in range(self.plan.microbatches):
                src = self._replicas(s, m, layout)
                part = intersect(mine, layout.micro[m])
                if part is not None:
                    pieces.append(self._recv_rows(v, part, src, _OUT, m, call))
            d = self.graph.values[v].batch_dim or 0
            batch_out[v] = torch.cat(pieces, d) if pieces else self._empty(v, 0)
        self._wait_sends(call)
        self._call = call if call.mode != "forward" else None
        out = []
        for name, c in zip(self.graph.outputs, self.cap.output_constants, strict=True):
            out.append(c if name is None else scalars[name] if name in scalars else batch_out[name])
        return out

    def _wait_sends(self, call: _Call) -> None:
        for w in call.sends:
            w.wait()
        call.sends.clear()

    # -- backward ----------------------------------------------------------
    def backward(self, grad_of: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """This rank's part of the pipeline backward, for the gradients of its outputs; returns
        the gradients of this rank's rows of the model inputs that required grad, by value."""
        call = self._call
        if call is None:
            raise RaNNCError("backward() without a forward() whose outputs need gradients")
        self._call = None
        w = float(self.world_size)
        scalar_names = sorted(self._scalar_outputs())
        batch_names = sorted(v for v in self.out_stage
                             if v not in scalar_names and _is_float(self.graph.values[v]))
        # One all-reduce: the scalar outputs' gradients (averaged, as DDP) and, per batch output,
        # whether any rank back-propagates through it (unused ones send no zeros around).
        vec = [_grad_or_zero(grad_of.get(v)) for v in scalar_names]
        vec += [torch.tensor(float(_nonzero(grad_of.get(v))), dtype=torch.float64)
                for v in batch_names]
        flat = torch.stack(vec) if vec else torch.zeros(0, dtype=torch.float64)
        dist.all_reduce(flat)
        scalar_g = {v: x / w for v, x in zip(scalar_names, flat, strict=False)}
        call.used = {v for v, x in zip(batch_names, flat[len(scalar_names):], strict=True) if x > 0}
        batch_used = bool(call.used)
        self.grads.begin()
        if call.mode == "split":
            self._send_output_grads(call, grad_of)
            rest = self.schedule.actions[self.s][len(self.schedule.forward_part(self.s)):]
            # the last microbatch's backward makes gradients final: buckets start from there
            last = [a for a in rest if a.op is Op.B and not call.micro[a.micro].empty]
            self._run(call, rest, {}, scalar_g, arm=last[-1] if last and self.sync else None)
            in_grads = self._receive_input_grads(call)
        else:
            g = scalar_g[self._loss]
            assert call.stash is not None
            # The usual loss.backward() brings a gradient of exactly 1: the stashed gradients
            # are then the gradients (x * 1.0 is x, bit for bit), without a multiply and a new
            # tensor per parameter and step.
            unit = bool(g == 1)
            for n, p in self.held.items():
                st = call.stash.get(n)
                if st is not None:
                    p.grad = st if unit else st * g.to(st.dtype)
            in_grads = {v: x if unit else x * g.to(x.dtype) for v, x in call.input_stash.items()}
            if batch_used:
                self._late_pass(call, grad_of)
                for v, x in self._receive_input_grads(call).items():
                    in_grads[v] = in_grads[v] + x if v in in_grads else x
        with torch.profiler.record_function("rannc reduce gradients"):
            self.grads.finish(self.sync)
            if self.sync:
                self._share_overflow()
        self._wait_sends(call)
        self.iteration_s = time.perf_counter() - call.t0
        return in_grads

    @property
    def _loss(self) -> str:
        return next(v for v in self._scalar_outputs() if _is_float(self.graph.values[v]))

    def _send_output_grads(self, call: _Call, grad_of: dict[str, torch.Tensor | None]) -> None:
        """My rows of each batch output's gradient (scaled 1/W, as DDP) to their producers."""
        layout = call.layout
        mine = layout.owned[self.rank]
        w = float(self.world_size)
        for v, s in self.out_stage.items():
            if v not in call.used:
                continue
            gv = grad_of.get(v)
            if gv is None:
                gv = self._empty(v, mine[1] - mine[0]).zero_()
            for m in range(self.plan.microbatches):
                for r, rows in self._replicas(s, m, layout):
                    part = intersect(mine, rows)
                    if part is not None:
                        self._send(self._row_slice(gv / w, v, mine, part), r,
                                   self._tag(v, m, _OUT_GRAD), call)

    def _late_pass(self, call: _Call, grad_of: dict[str, torch.Tensor | None]) -> None:
        """Eager schedules ran backward from the loss alone; when a batch output (logits, say)
        also got a gradient, its contribution goes through a fill-drain backward that
        recomputes each microbatch from its saved stage inputs (gradients add)."""
        if self.rank == 0 and not self._late_logged:
            log.info("rannc: a batch output of the model received a gradient, so each %s "
                     "iteration adds a recomputing backward pass for it; compute the loss inside "
                     "the model, or detach other outputs, to avoid it", self.plan.schedule)
            self._late_logged = True
        self._send_output_grads(call, grad_of)
        zero = {v: torch.zeros((), dtype=torch.float64) for v in self._scalar_outputs()}
        for m in reversed(range(self.plan.microbatches)):
            mic = call.micro[m]
            if mic.empty:
                continue
            mic.out_grads = [self._output_grad(v, m, mic.rows, call, zero) for v in self.me.outputs]
            assert mic.saved is not None and mic.rng is not None
            ins = [x.detach().clone() if self._is_buffer(v) else
                   x.detach().requires_grad_(True) if self._wants_grad(v, call) else x
                   for v, x in zip(self.me.inputs, mic.saved, strict=True)]
            env = dict(zip(self.me.inputs, ins, strict=True))
            with torch.random.fork_rng(devices=[]), torch.enable_grad():
                torch.set_rng_state(mic.rng)
                for part in (self.rec_part, self.keep_part):
                    if part is not None:
                        outs = part.module(*[env[v] for v in part.graph.inputs])
                        env.update(zip(part.graph.outputs, outs, strict=True))
            _backward([env[v] for v in self.me.outputs], mic.out_grads)
            mic.in_grads = self._input_grads(call, ins)
            mic.saved = mic.out_grads = None
            self._send_input_grads(call, m)

    def _is_activation(self, v: str) -> bool:
        """A float value received from an earlier stage: gradients flow back along it."""
        val = self.graph.values[v]
        return self._moves(v) and val.kind is ValueKind.ACTIVATION and _is_float(val)

    def _is_buffer(self, v: str) -> bool:
        return self.graph.values[v].kind is ValueKind.BUFFER

    def _output_grad(self, v: str, m: int, rows: Range, call: _Call,
                     scalar_g: dict[str, torch.Tensor] | None) -> torch.Tensor | None:
        """The gradient of stage output v for microbatch m: the sum over the stages reading it,
        plus, for a model output, the seed (scalar_g None: an eager pass, seeded with a unit
        loss gradient and nothing from batch outputs)."""
        val = self.graph.values[v]
        if not _is_float(val):
            return None
        total: torch.Tensor | None = None
        if self._moves(v):
            for t in self.consumers(v, self.s):
                if (v, t) not in self._grad_edges:
                    continue
                g = self._recv_rows(v, rows, self._replicas(t, m, call.layout), _GRAD, m, call)
                total = g if total is None else total + g
        if self.out_stage.get(v) == self.s:
            if val.batch_dim is None:
                seed = torch.ones((), dtype=torch.float64) if scalar_g is None else scalar_g[v]
                w = self._piece_weight(v, rows, call.layout)
                g = (seed * w).to(getattr(torch, val.dtype)).reshape(())
            elif scalar_g is None or v not in call.used:
                return total
            else:
                g = self._recv_rows(v, rows, list(enumerate(call.layout.owned)), _OUT_GRAD, m, call)
            total = g if total is None else total + g
        return total

    def _share_overflow(self) -> None:
        """A non-finite gradient on any rank shows on every rank (`grads.share_overflow`); a
        rank holding no parameter answers with its optimizer's stand-in."""
        grads = [p.grad for p in self.grads.held.values() if p.grad is not None]
        if self.placeholder is not None:
            self.placeholder.grad = torch.zeros_like(self.placeholder)
            grads.append(self.placeholder.grad)
        share_overflow(grads, self.device)

    def first_names(self) -> dict[int, str]:
        """id of each parameter tensor -> its first name (the key of `owners`)."""
        out: dict[int, str] = {}
        for n, p in self.model.named_parameters(remove_duplicate=False):
            out.setdefault(id(p), n)
        return out

    def not_stepped(self) -> list[nn.Parameter]:
        """ZeRO-1: the held parameters another holder's optimizer steps (each tensor once)."""
        if self.plan.zero_stage == 0:
            return []
        first = self.first_names()
        out = {id(p): p for p in self.held.values() if self.owners[first[id(p)]] != self.rank}
        return list(out.values())

    def share_stepped_params(self) -> None:
        """ZeRO-1, after the optimizer step: each parameter's owner sends its new values to the
        parameter's other holders; one broadcast per (holders, owner, dtype) and bucket_mb."""
        if self.plan.zero_stage == 0:
            return
        first = self.first_names()
        for _ranks, names, group in self.param_groups:
            if group is None:
                continue
            by: dict[tuple[int, str], dict[int, nn.Parameter]] = {}
            for n in names:
                p = self.held[n]
                by.setdefault((self.owners[first[id(p)]], str(p.dtype)), {})[id(p)] = p
            for (owner, _dtype), ps in sorted(by.items()):
                for chunk in _chunks(list(ps.values()), self._bucket_bytes):
                    self._broadcast(chunk, owner, group)

    def _broadcast(self, ps: list[nn.Parameter], owner: int, group: Any) -> None:
        with torch.no_grad():
            if len(ps) == 1 and ps[0].is_contiguous():
                dist.broadcast(ps[0].data, owner, group=group)
                return
            if self.rank == owner:
                flat = torch.cat([p.detach().reshape(-1) for p in ps])
            else:
                flat = torch.empty(sum(p.numel() for p in ps), dtype=ps[0].dtype, device=self.device)
            dist.broadcast(flat, owner, group=group)
            if self.rank != owner:
                at = 0
                for p in ps:
                    p.copy_(flat[at:at + p.numel()].view_as(p))
                    at += p.numel()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        prev, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = prev


class PipelineFunction(torch.autograd.Function):
    """Connects the pipeline to the user's autograd graph: its outputs are this rank's
    outputs, and its backward runs this rank's part of the pipeline backward."""

    @staticmethod
    def forward(ctx: Any, runtime: PipelineRuntime, names: list[str],  # type: ignore[override]
                in_names: list[str], anchor: torch.Tensor,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`tensors`: the outputs (one per name in `names`), then the model inputs requiring
        grad (one per name in `in_names`), which backward gives their rows' gradients."""
        ctx.runtime, ctx.names, ctx.in_names = runtime, names, in_names
        outs = tensors[:len(names)]
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        grad_of: dict[str, torch.Tensor | None] = {}
        for v, g in zip(ctx.names, grads, strict=True):
            prev = grad_of.get(v)
            grad_of[v] = g if prev is None else prev if g is None else prev + g
        with health.phase("backward"):
            in_grads = ctx.runtime.backward(grad_of)
        return (None, None, None, None, *([None] * len(grads)),
                *[in_grads.get(v) for v in ctx.in_names])


def _chunks(ps: list[nn.Parameter], nbytes: int) -> Iterator[list[nn.Parameter]]:
    """Consecutive runs of `ps` of at most `nbytes` each (one larger parameter alone)."""
    run: list[nn.Parameter] = []
    size = 0
    for p in ps:
        b = p.numel() * p.element_size()
        if run and size + b > nbytes:
            yield run
            run, size = [], 0
        run.append(p)
        size += b
    if run:
        yield run


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _is_float(val: Value) -> bool:
    return val.is_tensor and getattr(torch, val.dtype).is_floating_point


def _leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and not isinstance(x, nn.Parameter):
        if x.grad_fn is None and not x.requires_grad:
            return x.detach().requires_grad_(True)
    return x


def _backward(outs: Sequence[Any], grads: Sequence[torch.Tensor | None]) -> None:
    """Backward from the outputs that have both a graph and a gradient."""
    ts, gs = [], []
    for o, g in zip(outs, grads, strict=True):
        if g is not None and isinstance(o, torch.Tensor) and o.requires_grad:
            ts.append(o)
            gs.append(g)
    if ts:
        torch.autograd.backward(ts, gs)


def _nonzero(g: torch.Tensor | None) -> bool:
    return g is not None and bool(g.detach().ne(0).any())


def _grad_or_zero(g: torch.Tensor | None) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float64) if g is None else g.detach().reshape(()).to(torch.float64)


__all__ = ["PipelineFunction", "PipelineRuntime"]
