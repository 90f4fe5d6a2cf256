"""The synchronous pipeline runtime, with a replica count per stage: the facade
`rannc.module` calls (`forward`, `backward`, ZeRO-1's parameter sharing, `no_sync`).

Every rank runs one replica of one stage (of several under interleaved 1F1B or ZB-V: stages
s, s + P, ... or s, 2P - 1 - s on the same ranks, one `Stage` each, their actions in one
line). A call's global batch is the concatenation of the ranks' local batches; it is cut
into microbatches, and each microbatch's rows are cut among each stage's replicas by their shares
(`rows.RowLayout`, computed identically on every rank, so a sender and a
receiver always agree on a transfer without asking each other). Every value
moves as rows: model inputs from the ranks that own them straight to the
stages that read them; stage outputs from the producing replicas to the
consuming replicas; batch outputs back to the ranks that own those rows.
Gradients travel the same routes backwards.

The parts, each in its module: `routes` (where each value goes, fixed at deployment),
`transport` (typed message keys, tags, isend/recv, held-back sends), `stage` (forward,
recomputation and backward of one microbatch), `executor` (walks the schedule's line of actions
for a call), `grads` (bucketed gradient reduction). This module builds them from the plan and
runs a call: the row layout (guessed from the last call, or agreed), the line for the call's
mode, the outputs, and in `backward` the loss gradient and the gradient reduction.

The user sees ordinary tensors: the outputs come out of an autograd Function
whose backward runs this rank's part of the pipeline backward, so
`loss.backward()` on every rank drives the whole thing.

Gradient semantics (DDP): rank r's `backward()` of L_r sends d L_r / d(out) / W
for its rows (W = world size) and the average of the scalar outputs'
gradients; each (microbatch, replica) piece of a scalar output carries the
weight rows/N of the global row-weighted mean; parameter gradients are then
summed over every rank holding the parameter (stage replicas, tied copies), in
buckets started during the last microbatch's backward (`rannc.pipeline.grads`),
inside forward() under the eager schedules, whose backward runs for a unit loss
gradient: backward() scales the sums by the real one (gradients are linear in it).

The ranks meet three times a step at most: for the scalar outputs (an all-reduce each rank
starts once its own pieces are in, mid-line, and waits for at the end of the call; with one
stage on every rank it carries BatchNorm's statistics too), at the start of backward() (the
loss gradients; under an eager schedule whose buckets are already in flight, waited for only
after them; under fill-drain with one stage, read only as the first gradient joins a bucket,
the backward having started from the rank's own loss gradient) and after the gradient buckets
(the overflow and got-a-gradient flags, one all-reduce; under an eager schedule without shared
parameters it travels with the loss gradients instead, and under data parallelism alone, where
every replica computed rows, it is not needed). The row layout's all-gather is not waited for
at the start of a call that can guess it (`guess_sizes`).

Index conventions: s, t stages; m microbatches; j replicas; r ranks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import warnings
import weakref
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from rannc import dist as rdist
from rannc import health
from rannc.atomic.components import AtomicPartition
from rannc.errors import ConfigError, InputMismatchError, RaNNCError
from rannc.graph import reductions
from rannc.graph.capture import CapturedModel
from rannc.graph.extract import StageGraph, check_buffer_writes_stay_in_one_stage, split_graph
from rannc.graph.model_state import model_state
from rannc.graph.task_graph import ValueKind
from rannc.pipeline import batchnorm as bnorm
from rannc.pipeline.executor import Call, Executor
from rannc.pipeline.grads import Accumulation, BucketBuffers, GradReducer, LossSeed, ParamGroup, not_finite
from rannc.pipeline.routes import Routes
from rannc.pipeline.rows import RowLayout
from rannc.pipeline.stage import Part, Stage, build_parts
from rannc.pipeline.transport import Guess, LayoutChanged, Tags, Transport
from rannc.plans import Plan
from rannc.profile.saved import fused_kernels
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
from rannc.validate import CARRIED, COUNT_KWARG

if TYPE_CHECKING:
    from rannc.validate import CallAgreement

log = logging.getLogger(__name__)

_BN_WARNED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models warned about BatchNorm
_MIXING_WARNED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # ... about rows mixed (`_warn_mixing`)
_FREQ_WARNED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # ... scale_grad_by_freq
_IGNORED_WARNED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # ... uneven ignored targets
# calls whose targets rank 0 looks at for rows with uneven numbers of ignored ones (a host sync
# each, so not every call: a padded batch shows it at once)
_IGNORED_CALLS_CHECKED = 10
# ops whose gradient of the weight divides by each index's count in the batch when the flag at
# this argument index is True (nn.Embedding / nn.EmbeddingBag(scale_grad_by_freq=True))
_FREQ_SCALED = {"aten.embedding.default": 3, "aten._embedding_bag.default": 3,
                "aten.embedding_bag.default": 3, "aten.embedding_bag.padding_idx": 3}
_WRITES_WARNED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # ... about buffers forward writes


# the lines branching on the batch size whose pieces' branch `_check_batch_rows` warned about
_WARNED_ROWS: set[str] = set()


class PipelineRuntime:
    def __init__(self, model: nn.Module, captured: CapturedModel, atomic: AtomicPartition,
                 plan: Plan, rank: int, world_size: int, device: torch.device,
                 trace: bool = False,
                 wrap_stage: Callable[[fx.GraphModule], Any] | None = None,
                 batchnorm: str = "local", bucket_mb: float = 25.0,
                 accumulation: Accumulation | None = None,
                 planned_accumulation: bool = False,
                 buffers: BucketBuffers | None = None) -> None:
        self.model, self.cap, self.plan = model, captured, plan
        self.rank, self.world_size, self.device = rank, world_size, device
        self.graph = captured.graph
        groups = [list(s.components) for s in plan.stages]
        self.stages: list[StageGraph] = split_graph(self.graph, atomic, groups)
        check_buffer_writes_stay_in_one_stage(self.graph, self.stages)
        # the stages this rank holds a replica of: one, or under an interleaved schedule
        # several (s, s + P, ...: the same ranks, so the same replica index j in each)
        self.mine = [st.index for st in plan.stages_of_rank(rank)]
        self.s = self.mine[0]
        self.j = plan.stages[self.s].ranks.index(rank)
        self.routes = Routes(self.graph, self.stages)
        # scalar outputs whose pieces add up: divided by the global num_items_in_batch, or sums
        # over the rows (`graph/reductions.py`; a mean's pieces are weighted by their rows)
        by_count = self._summed_outputs()
        self.reductions = reductions.analyse(captured.gm, self.graph)
        self._summed = by_count | self.reductions.summed
        self.held = self._held_params()
        param_groups = self.param_groups = self._param_groups()
        self._bucket_bytes = int(bucket_mb * 2**20)
        # rannc.ownership.parameter_owners of the deployment (set by the module): first
        # parameter name -> the holder that saves it, counts it in norms and, under ZeRO-1,
        # steps it.
        self.owners: dict[str, int] = {}
        self.sync = True
        self._call: Call | None = None
        planned = get_spec(plan.schedule)
        # the schedule run: an eager one falls back to fill-drain without one scalar loss
        self.spec = planned if not planned.eager or self.routes.one_scalar_loss() else get_spec(FILL_DRAIN)
        self.schedule = self._schedule(self.spec.name)
        self.parts: dict[int, tuple[Part | None, Part | None]] = {}
        for s in self.mine:
            n_rec = plan.stages[s].recomputed_components
            if not self.spec.recomputes(s, len(self.stages), True):
                n_rec = 0  # e.g. scp's last stage holds one microbatch at a time: nothing to save
            self.parts[s] = build_parts(captured, atomic, self.stages, groups, s, n_rec, wrap_stage,
                                        selective=plan.stages[s].selective,
                                        fused=fused_kernels(torch.device(device).type))
        self.rec_part, self.keep_part = self.parts[self.s]  # the first stage's
        self.grads = GradReducer(self.held, param_groups, self.routes.first_use(),
                                 int(bucket_mb * 2**20), self._accumulations(),
                                 shared=self._shared_names(), device=device,
                                 everywhere=self._everyone_holds_everything(),
                                 accumulation=accumulation, buffers=buffers)
        # no_sync()'s state, shared with the model's other input signatures' runtimes
        self.acc = self.grads.accumulation
        self.param_hooks = self.acc.param_hooks
        self._bn = self._batch_norm(batchnorm)
        bn_tasks = set(bnorm.training_batch_norms(self.cap.gm, self.graph))
        self._bn_stages = [t for t, st in enumerate(self.stages)
                           if len(self.plan.stages[t].ranks) > 1 and set(st.tasks) & bn_tasks]
        params = dict(self.model.named_parameters(remove_duplicate=False))
        self.stage_runs = [Stage(s, self.j, self.stages[s], *self.parts[s], self.routes, self._bn,
                                 [params[n] for n in plan.stages[s].param_names],
                                 captured.autocast) for s in self.mine]
        self.stage = self.stage_runs[0]
        self.executor = Executor(self.stage_runs, self.routes, plan, self.schedule, self.grads,
                                 self._summed, rank, world_size, trace)
        # (BatchNorm's statistics over the world ride in the scalar outputs' all-reduce)
        self.executor.scalars_at_end = self._bn.world and bool(self._bn.sites)
        # This rank's line of actions (one stage's today; several under interleaved schedules).
        self.line = self.schedule.actions[self.schedule.lane_of(self.s)]
        self._forward_line = self.schedule.forward_part(self.schedule.lane_of(self.s))
        self._tags = Tags(self.routes.channels(), plan.microbatches)
        if self.spec is not planned and rank == 0:
            log.info("rannc: schedule %s needs the model to return one floating-point scalar "
                     "(the loss) to run its backward inside forward(); this model returns %s, so "
                     "it runs fill-drain (%s) instead", plan.schedule, self._outputs_text(),
                     FILL_DRAIN)
        if rank == 0:
            self._warn_mixing()
            self._warn_buffer_writes()
            self._warn_frequency_scaled_grads()
        count = self._count_input()
        # (the mean losses over targets whose rows may hold uneven numbers of ignored ones, on
        # stages the plan runs on pieces: rank 0 looks at its rows, `_warn_uneven_ignored`; a
        # call that passed num_items_in_batch to a loss ignoring it is told so below instead)
        self._ignored = [(site, s, reps) for site in reductions.ignored_target_means(captured.gm, self.graph)
                         for s, reps in [self._pieces_of(site.task)] if s is not None
                         and self.plan.microbatches * reps > 1] \
            if rank == 0 and count is None else []
        self._ignored_calls = 0
        if count is not None and not by_count and rank == 0:
            log.warning("rannc: the call passed %s, but no scalar output of the model is computed "
                        "from it (its loss ignores it), so scalar outputs are combined as a "
                        "row-weighted mean over microbatches and replicas, not a sum; compute "
                        "the loss as sum / %s inside the model for the exact global value",
                        COUNT_KWARG, COUNT_KWARG)
        self._late_logged = False
        # the plan counted an eager line's gradients beside `.grad` (Config.grad_accumulation)
        self.planned_accumulation = planned_accumulation
        # a stand-in parameter in the optimizer of a rank that holds none (see _stand_in)
        self.placeholder: nn.Parameter | None = None
        self.sparse_placeholder: nn.Parameter | None = None  # (SparseAdam's: a sparse gradient)
        # (digest, every rank's local batch size) of the last call: the guess for the next one.
        self._agreed: tuple[int, list[int]] | None = None
        # A call on a guessed layout is run again when the guess was wrong; that is exact only
        # where its first run changes nothing that the second cannot take back: the RNG and
        # the buffers the graph writes (BatchNorm's num_batches_tracked, say) are put back
        # (`_written`), BatchNorm's running statistics are written only once the guess is
        # confirmed, and synchronised BatchNorm (a collective per microbatch) and writes into
        # the inputs or parameters are not guessed at all.
        kinds = {self.graph.values[v].kind for t in self.graph.tasks for v in t.mutates}
        # (The running statistics of a BatchNorm site the stage replaced are not among them:
        # the replacement leaves them as they were, and `finish_call` writes them once agreed.)
        deferred = {n for site in self._bn.sites.values()
                    for n in (site.running_mean, site.running_var) if n is not None}
        self._written = sorted({str(self.graph.values[v].target) for s in self.mine
                                for t in self.stages[s].tasks for v in self.graph.tasks[t].mutates
                                if self.graph.values[v].kind is ValueKind.BUFFER}
                               - deferred)
        self._can_guess = (world_size > 1 and not (self._bn.sites and self._bn.mode == "sync")
                           and kinds <= {ValueKind.BUFFER, ValueKind.ACTIVATION})
        self.guessed_calls = 0  # calls run on a guessed layout (their agreement not waited for)
        self.rerun_calls = 0  # of those, run again because a batch size changed
        self.carried_seeds = 0  # backwards whose loss gradient travelled in the gradients' bucket
        self.carried_calls = 0  # calls whose scalar sums travelled in their agreement
        self.iteration_s = 0.0  # the last iteration's seconds from forward() to the gradients

    @property
    def trace(self) -> bool:
        return self.executor.trace

    @property
    def events(self) -> list[Event]:
        """The last iteration's actions, when tracing."""
        return self.executor.events

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
            group = self._group(ranks, "batchnorm")
            if t in self.mine and state.group is None:  # (stages sharing ranks: the same ranks)
                state.group = group
                state.world = group is not None and len(ranks) == self.world_size
        for part in self._all_parts():
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

    def _check_batch_rows(self, layout: RowLayout) -> None:
        """Where the model's code branches on the batch size, the graph holds one branch, for
        the rows `cap.batch_rows`: every piece (a microbatch's rows on a replica) must take it
        (the same check on every rank). The planner takes enough microbatches for the global
        batch it planned for; a later, larger batch may not fit. Where the global batch itself
        takes the other branch, the unwrapped model would run that one: said once, on rank 0."""
        cap = self.cap
        if cap.batch_rows == (1, None):
            return
        pieces = sorted({b - a for stage in layout.rows for per in stage for a, b in per if b > a})
        wrong = [n for n in pieces if not cap.fits(n)]
        span = cap.rows_text()
        if wrong:
            fix = (f"microbatches={cap.microbatches_for(layout.n_rows)} or more "
                   "(Config.microbatches, or a plan made for this batch size), or smaller batches"
                   if cap.batch_rows[1] is not None else "larger batches")
            raise RaNNCError(
                f"the model's code branches on the batch size ({cap.rows_site}), and rannc's graph "
                f"holds the branch for {span} rows, but this call runs pieces of {wrong} rows (a "
                f"global batch of {layout.n_rows} rows in {self.plan.microbatches} microbatches, "
                f"replicas {[len(st.ranks) for st in self.plan.stages]}), which would take the "
                f"other branch. Fix: {fix}")
        if not cap.fits(layout.n_rows) and cap.rows_site not in _WARNED_ROWS and self.rank == 0:
            _WARNED_ROWS.add(cap.rows_site)  # (once per line: a train and an eval capture)
            warnings.warn(
                f"rannc: the model's code branches on the batch size ({cap.rows_site}). The "
                f"pipeline runs the global batch of {layout.n_rows} rows in pieces of up to "
                f"{pieces[-1]} rows, which take the branch for {span} rows, where the unwrapped "
                "model on the whole batch takes the other. Where the two branches compute the "
                "same values (a workaround for speed or memory, as diffusers' upsampling's "
                "`contiguous()` for 64 rows or more) nothing differs; otherwise the results "
                "are those of the model run on batches of the pieces' size", UserWarning,
                stacklevel=2)

    def _schedule(self, name: str) -> Schedule:
        rc = [st.recomputed_components > 0 for st in self.plan.stages]
        try:
            sched = make_schedule(name, self.plan.microbatches, self.routes.stage_suppliers(), rc,
                                  self.plan.placement())
        except ScheduleError as e:
            raise RaNNCError(f"plan schedule {name!r}: {e}") from e
        validate(sched)
        return sched

    def _outputs_text(self) -> str:
        vals = [self.graph.values[v] for v in self.routes.out_stage]
        return ", ".join(f"{v.name} {list(v.shape)} {v.dtype}" for v in vals) or "no tensors"

    def grad_inputs(self, leaves: Sequence[Any]) -> list[tuple[str, torch.Tensor]]:
        """(value name, tensor) of the call's input leaves that require grad and reach a float
        output: each gets the gradient of this rank's rows back (`backward` returns them)."""
        wanted = {v for v, _t in self.routes.input_edges}
        return [(v, x) for v, x in zip(self.cap.leaf_values, leaves, strict=True)
                if v in wanted and isinstance(x, torch.Tensor) and x.requires_grad]

    # -- parameters ------------------------------------------------------------------------------
    def _held_params(self) -> dict[str, nn.Parameter]:
        params = dict(self.model.named_parameters(remove_duplicate=False))
        return {n: params[n] for s in self.mine for n in self.plan.stages[s].param_names}

    def _all_parts(self) -> list[Part]:
        """The recomputed and kept parts of every stage this rank holds."""
        return [p for s in self.mine for p in self.parts[s] if p is not None]

    def _accumulations(self) -> dict[int, int]:
        """Per held parameter (by id): how many backward passes of one microbatch accumulate
        into it here, one per part (recomputed, kept) of each stage held reading it."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        out: dict[int, int] = {}
        for part in self._all_parts():
            ids = {id(params[val.target]) for v in part.graph.inputs
                   for val in [self.graph.values[v]]
                   if val.kind is ValueKind.PARAM and val.target in params}
            for i in ids:
                out[i] = out.get(i, 0) + 1
        return out

    def _everyone_holds_everything(self) -> bool:
        """Every rank holds every parameter (one stage, replicated on every rank)."""
        holders = self.plan.holders()
        return bool(holders) and all(len(set(r)) == self.world_size for r in holders.values())

    def _shared_names(self) -> list[str]:
        """Every parameter name more than one rank holds, in the same order on every rank."""
        holders = self.plan.holders()
        return sorted(n for n in holders if len(set(holders[n])) > 1)

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
            group = self._group(ranks, "gradients")
            if self.rank in ranks:
                out.append((ranks, by_set[ranks], group))
        return out

    @staticmethod
    def _group(ranks: Sequence[int], purpose: str) -> Any:
        """The process group of `purpose`'s collectives over `ranks` (None for one rank); every
        rank asks for every group, in the same order. One per purpose and set of ranks, shared
        by every runtime (`rannc.dist.new_group`: made per runtime, they grew with every new
        input signature). Not the default group even where `ranks` are the world: an eager
        schedule's buckets and its scalar sums are not posted in the same order on every rank,
        and in one group they met the wrong peers (gloo aborted: "Received data size doesn't
        match", a random-model case of tests/test_random_models_mpi.py)."""
        return rdist.new_group(ranks, purpose) if len(ranks) > 1 else None

    # -- forward ---------------------------------------------------------------------------------
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
        with model_state(self.model).unchanged():  # (one check of the model's tensors a call)
            out = self._forward_guessed(leaves, sizes, agreement)
        return out

    def _forward_guessed(self, leaves: Sequence[Any], sizes: Sequence[int],
                         agreement: CallAgreement | None) -> list[Any]:
        if self._ignored:
            self._warn_uneven_ignored(leaves)
        guessed = agreement is not None and not agreement.resolved
        if guessed:
            assert agreement is not None
            self.guessed_calls += 1
            rng = _rng_state(self.device)
            kept = self._keep_written()
            guess = Guess(agreement, list(sizes), [lambda: self._check_count(leaves)])
            try:
                out = self._forward(leaves, sizes, guess)
            except LayoutChanged as changed:
                _set_rng_state(rng, self.device)
                self._put_back(kept)
                self.rerun_calls += 1
                sizes = changed.sizes
                if self.rank == 0:
                    log.debug("rannc: a rank's batch size changed: the call runs on %s", sizes)
                out = self._forward(leaves, sizes, None)
        else:
            self._check_count(leaves)
            out = self._forward(leaves, sizes, None)
        if agreement is not None:
            self._agreed = (agreement.digest, list(sizes))
        return out

    def _keep_written(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(buffer, copy) of each buffer the graph writes in place on this rank's stages, to
        put back when a call on a guessed layout runs again."""
        if not self._written:
            return []
        buffers = model_state(self.model).buffers()
        return [(buffers[n], buffers[n].detach().clone()) for n in self._written if n in buffers]

    @staticmethod
    def _put_back(kept: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        with torch.no_grad():
            for buf, copy in kept:
                buf.copy_(copy)

    def _forward(self, leaves: Sequence[Any], sizes: Sequence[int], guess: Guess | None) -> list[Any]:
        layout = RowLayout(sizes, self.plan.microbatches, [s.shares for s in self.plan.stages])
        self._check_sync_rows(layout)
        self._check_batch_rows(layout)
        buffers: dict[str, torch.Tensor] = {}
        if self._bn.sites:
            buffers = model_state(self.model).buffers()
            self._bn.begin_call(buffers)
        grad = torch.is_grad_enabled()
        mode = "forward" if not grad else "eager" if self.spec.eager else "split"
        call = Call(layout, self.cap.bind(self.model, leaves), mode,
                    Transport(self.rank, self._tags, self.graph.values, self.device, guess),
                    self.executor.new_micro(layout), t0=time.perf_counter())
        if grad:
            self.grads._drop_hooks()  # (rannc's own, left by a backward that raised)
            # (`grads.ParamHooks`: run once, in `finish`; every parameter, held here or not, so
            # that every rank knows alike whether there are any)
            self.param_hooks.suspend(model_state(self.model).params())
            call.grad_inputs = frozenset(v for v, _x in self.grad_inputs(leaves))
            # (a call without gradients in between, e.g. a metric under torch.no_grad(), leaves
            # the last call's backward to come)
            self._call = None
        self.executor.events = []
        self.iteration_s = 0.0
        self.executor.send_inputs(call)
        scalars = {v: torch.zeros((), dtype=torch.float64, device=self.device)
                   for v in self.routes.scalar_outputs()}
        acts = self.line
        if mode == "forward":
            acts = tuple(a for a in acts if a.op in (Op.RF, Op.F, Op.SF))
        elif mode == "split":
            acts = self._forward_line
        if mode == "eager":
            self._run_eager(call, acts, scalars)
        else:
            self.executor.run(call, acts, scalars)
        if self._bn.sites:  # the running statistics, once per call (every replica)
            call.transport.settle()  # (a collective, and a write not to make on a wrong guess)
            if scalars and self._bn.world:  # one all-reduce over the world carries both
                assert call.scalar_share is None
                shared = self.executor.share_scalars(call, scalars, self._bn.call_sums(self.device))
                assert shared is not None
                self._bn.adopt(*shared)
            else:  # both all-reduces in flight before waiting for either: the ranks meet once
                if scalars and call.scalar_share is None:
                    self.executor.share_scalars(call, scalars)
                self._bn.post_call(self.device)
            self._bn.finish_call(buffers, self.device)
        return self._collect_outputs(call, scalars)

    def _run_eager(self, call: Call, acts: Sequence[Action],
                   scalars: dict[str, torch.Tensor]) -> None:
        """An eager schedule's whole line, seeded with a unit loss gradient; the gradients go
        aside (`Call.stash`) and `.grad` shows what it held before until backward() commits.

        Where parameters have several holders, their buckets start during this line's last
        backward, as under fill-drain (gradients are linear in the loss gradient: backward()
        scales the sums). Not after a no_sync() backward (its pending local sums must not be
        scaled), and only when the next backward is synchronised too (`backward` checks)."""
        call.reducing = self.sync and self.acc.last_sync and bool(self.grads.shared)
        before = {n: p.grad for n, p in self.held.items()}
        if not self.planned_accumulation and not self.acc.warned_twice and self.rank == 0:
            self.acc.warned_twice = _warn_grads_twice(self.spec.name, before.values())
        if call.reducing:
            self.grads.begin()  # (sets .grad aside as below, and remembers it)
        for p in self.held.values():
            p.grad = None
        last = self._last_final(call, acts)
        call.grad_from = frozenset({self._loss})  # (the line's one seed)
        try:
            self.executor.run(call, acts, scalars,
                              arm=last if last is not None and call.reducing else None)
            call.stash = {n: p.grad for n, p in self.held.items() if p.grad is not None}
            if call.reducing:
                call.transport.settle()  # (collectives start only on an agreed layout)
                self.grads.prepare_rest()
            call.input_stash = self.executor.receive_input_grads(call)
        finally:
            for n, p in self.held.items():
                p.grad = before[n]

    def _last_final(self, call: Call, acts: Sequence[Action]) -> Action | None:
        """The action of `acts` after which this rank's gradients are final: the last
        microbatch's backward, or its W where the schedule splits it off."""
        final = Op.W if any(self.schedule.splits_backward(s) for s in self.mine) else Op.B
        last = [a for a in acts if a.op is final and not call.micro[(a.stage, a.micro)].empty]
        return last[-1] if last else None

    @functools.cached_property
    def carries_scalars(self) -> bool:
        """Whether a call on a guessed layout posts its agreement once its scalar outputs
        are computed, carrying their sums (`validate.CallAgreement.start`): one all-gather where
        the ranks would meet twice. Where nothing leaves a rank before those sums: one stage
        on every rank, no BatchNorm statistics to sum (they ride in the scalars' all-reduce),
        a schedule whose forward() runs no backward (an eager line's buckets settle the layout
        first: the gather would be posted late and waited for at once); and on the CPU (on a
        GPU the scalars would have to come to the host first)."""
        n = len(self.routes.scalar_outputs())
        return (len(self.plan.stages) == 1 and self.world_size > 1 and not self._bn.sites
                and not self.spec.eager and 0 < n <= CARRIED and self.device.type == "cpu")

    def _collect_outputs(self, call: Call, scalars: dict[str, torch.Tensor]) -> list[Any]:
        guess = call.transport.guess
        names = sorted(scalars)
        if guess is not None and not guess.agreement.started and scalars:
            guess.agreement.start([scalars[v] for v in names])
        call.transport.settle()
        if scalars:
            carried = guess.agreement.carried if guess is not None else None
            self.carried_calls += carried is not None
            sums = (dict(zip(names, carried, strict=False)) if carried is not None
                    else self.executor.shared_scalars(call, scalars))
            for v, x in sums.items():
                scalars[v] = x.to(getattr(torch, self.graph.values[v].dtype))
        batch_out = self.executor.receive_outputs(call, scalars)
        call.transport.wait_sends()
        if call.mode != "forward":
            self._call = call
        out = []
        for name, c in zip(self.graph.outputs, self.cap.output_constants, strict=True):
            out.append(c if name is None else scalars[name] if name in scalars
                       else batch_out[name] if name in batch_out
                       else self._global_size(name, call.layout.n_rows))
        return out

    def _global_size(self, v: str, rows: int) -> int:
        """A size the model returns (`x.size(0)`, `x.shape`'s entries): its value on the global
        batch of `rows` rows, as the unwrapped model returns it (before, the first call failed
        with "'int' object has no attribute 'detach'"). A size computed from tensor values is
        refused before planning (`validate.check_outputs_combine`)."""
        import sympy

        expr = sympy.sympify(self.graph.values[v].sym_expr or "0")
        return int(expr.subs({s: rows for s in expr.free_symbols}))

    def _warn_mixing(self) -> None:
        """Say once per model where an output depends on several rows together and the plan
        computes it on pieces of the batch (`graph/reductions.py`): it is not the model's
        value on the global batch."""
        if not self.reductions.inexact or self.model in _MIXING_WARNED:
            return
        split = []
        for out, (task, path, op) in self.reductions.inexact.items():
            s, reps = self._pieces_of(task) if task else (None, 1)
            if self.plan.microbatches * reps > 1:
                split.append((out, path, op, s, reps))
        if not split:
            return
        _MIXING_WARNED.add(self.model)
        out, path, op, s, reps = split[0]
        names = ", ".join(self.cap.output_label(o) for o, *_ in split[:3]) + (
            f" and {len(split) - 3} more" if len(split) > 3 else "")
        log.warning(
            "rannc: the model's output %s depends on several rows of the batch together (from "
            "%s in module '%s': e.g. a loss over pairs of samples, statistics over the batch "
            "dimension, a softmax along it, a mean over the elements a mask selects). The "
            "pipeline computes it on each piece of the batch (plan: %d microbatches; stage %s "
            "has %d replicas), so it differs from the model's value on the global batch, as "
            "under DDP, where each rank computes it on its own rows. For the model's value, "
            "plan that stage with one replica and one microbatch (replicas=[..., 1], "
            "microbatches=1), or compute it outside the model from the rows every rank gets "
            "back; a mean over masked elements (`h[labels != -100]`) is exact as a sum divided "
            "by the global batch's count, passed in as num_items_in_batch. (rannc takes dim 0 "
            "of every input as the batch: a model taking its batch in another dimension, sequence-first as "
            "nn.TransformerEncoderLayer(batch_first=False), mixes its 'rows' in attention; give "
            "it batch-first inputs)", names, op, path or "(the model itself)",
            self.plan.microbatches, s, reps)

    def _pieces_of(self, task: str) -> tuple[int | None, int]:
        """The stage computing `task` and its replicas (None, 1: no stage does)."""
        t = self.graph.task_index(task)
        s = next((s for s, st in enumerate(self.stages) if t in st.tasks), None)
        return s, len(self.plan.stages[s].ranks) if s is not None else 1

    def _warn_uneven_ignored(self, leaves: Sequence[Any]) -> None:
        """Say once per model (rank 0, from its own rows) where a loss is the mean over the
        targets it keeps (labels of -100 skipped: padding, a masked LM's unmasked tokens), the
        rows hold different numbers of them, and the plan computes that loss on pieces of the
        batch: the row-weighted mean of the pieces' means is not the global mean over kept
        targets, so the loss and gradients differ slightly from the model's on the global batch
        (measured: a padded Llama on 2 ranks, loss 4.168766 against 4.168351), silently before."""
        self._ignored_calls += 1
        if self.model in _IGNORED_WARNED or self._ignored_calls > _IGNORED_CALLS_CHECKED:
            return
        for site, s, reps in self._ignored:
            leaf = leaves[self.cap.leaf_values.index(site.input)]
            if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0 or leaf.shape[0] < 2:
                continue
            kept = (leaf != site.ignore_index).reshape(leaf.shape[0], -1).sum(1)
            least, most = (int(x) for x in kept.aminmax())
            if least == most:
                continue
            _IGNORED_WARNED.add(self.model)
            task = self.graph.tasks[self.graph.task_index(site.task)]
            log.warning(
                "rannc: the loss in module '%s' is the mean over the targets of input '%s' that "
                "are not %d, and its rows keep different numbers of them (%d to %d here). The "
                "pipeline computes it on each piece of the batch (plan: %d microbatches; stage %d "
                "has %d replicas) and combines the pieces as a row-weighted mean, which is not "
                "the mean over the global batch's kept targets (as under DDP, where each rank "
                "averages its own): loss and gradients differ slightly from the model's on the "
                "global batch. For the exact value pass num_items_in_batch, the global batch's "
                "count of kept targets, the same on every rank, to a model whose loss divides "
                "its sum by it (transformers' causal- and masked-LM losses do; "
                "rannc.hf.RaNNCTrainer passes it), or compute the loss outside the model from "
                "the rows of logits every rank gets back (README: 'Losses averaged over a "
                "data-dependent count')", task.module_path or "(the model itself)",
                site.input, site.ignore_index, least, most, self.plan.microbatches, s, reps)
            return

    def _warn_frequency_scaled_grads(self) -> None:
        """Say once per model where an embedding scales its weight's gradient by each index's
        count in the batch (`scale_grad_by_freq=True`) and the plan runs its stage on several
        pieces of the batch: each piece counts its own rows, so the gradient differs from the
        model's on the global batch (measured: up to 45x on a row, silently, before this)."""
        if self.model in _FREQ_WARNED:
            return
        nodes = {n.name: n for n in self.cap.gm.graph.nodes}
        for s, st in enumerate(self.stages):
            reps = len(self.plan.stages[s].ranks)
            if self.plan.microbatches * reps == 1:
                continue
            for t in st.tasks:
                task = self.graph.tasks[t]
                at = _FREQ_SCALED.get(task.op)
                node = nodes.get(task.name)
                if at is None or node is None or len(node.args) <= at or node.args[at] is not True:
                    continue
                _FREQ_WARNED.add(self.model)
                log.warning(
                    "rannc: the embedding in module '%s' scales its weight's gradient by each "
                    "index's count in the batch (scale_grad_by_freq=True). The pipeline computes "
                    "that gradient on each piece of the batch (plan: %d microbatches; stage %d has "
                    "%d replicas), each piece counting its own rows, so it differs from the model's "
                    "gradient on the global batch. For the model's gradient, plan that stage with "
                    "one replica and one microbatch (microbatches=1, replicas with 1 for stage %d), "
                    "or build the embedding with scale_grad_by_freq=False",
                    task.module_path or "(the model itself)", self.plan.microbatches, s, reps, s)
                return

    def _warn_buffer_writes(self) -> None:
        """Say once per model which buffers forward updates from the batch (a running mean:
        not BatchNorm's, which rannc defers itself; not those updated from the weights alone,
        which run once per call: `Stage.forward`) where the plan runs their stage on several
        pieces of the batch: each piece's forward updates its replica's copy from its own
        rows, so a call updates them once per microbatch and the replicas' copies drift apart,
        where the unwrapped model updates them once per call from the global batch."""
        if self.model in _WRITES_WARNED:
            return
        norms = {self.graph.tasks[i].module_path
                 for i in bnorm.training_batch_norms(self.cap.gm, self.graph)}
        kinds = self.reductions.kinds
        # (updates that do not read the batch run once per call: `Stage.forward`)
        per_call = reductions.per_call_writes(self.graph, range(len(self.graph.tasks)))
        split: dict[str, tuple[str, int]] = {}
        for s, st in enumerate(self.stages):
            replicas = len(self.plan.stages[s].ranks)
            for t in st.tasks:
                task = self.graph.tasks[t]
                # (from the batch: the replicas' copies differ; a counter: only per microbatch)
                rows = any(kinds.get(i) not in (None, reductions.Kind.CONST) for i in task.inputs
                           if i not in task.mutates)
                if self.plan.microbatches == 1 and not (rows and replicas > 1):
                    continue
                for v in task.mutates:
                    val = self.graph.values[v]
                    name = str(val.target)
                    if val.kind is ValueKind.BUFFER and name.rpartition(".")[0] not in norms \
                            and v not in per_call:
                        split.setdefault(name, (task.module_path, s))
        if not split:
            return
        _WRITES_WARNED.add(self.model)
        name, (path, s) = next(iter(split.items()))
        more = f" and {len(split) - 1} more are" if len(split) > 1 else " is"
        log.warning(
            "rannc: buffer '%s'%s updated in forward from the batch (module '%s', a running "
            "statistic). The pipeline runs forward once per microbatch on each replica of a "
            "stage (plan: %d microbatches; stage %d has %d replicas), so a call updates it once "
            "per microbatch, and each replica from its own rows (the replicas' copies drift "
            "apart), where the model updates it once per call from the global batch. It stays "
            "the model's with one microbatch and one replica for that stage (replicas=[..., 1], "
            "microbatches=1); BatchNorm's statistics rannc keeps exact itself", name, more,
            path or "(the model itself)", self.plan.microbatches, s,
            len(self.plan.stages[s].ranks))

    # -- the global count of loss items ------------------------------------------------------------
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
        reached = self.routes.reached_from(count)
        return {v for v in self.routes.scalar_outputs() if v in reached}

    def _check_count(self, leaves: Sequence[Any]) -> None:
        """`num_items_in_batch` is the global count of loss items: one number. That it is the
        same on every rank (a rank passing its own count would silently scale its pieces
        wrongly) the call's agreement checks with every whole input's values
        (`validate.whole_values_hash`); its shape is in the agreement's digest, so this check
        raises on every rank alike."""
        count = self._count_input()
        if count is None:
            return
        x = next(leaf for v, leaf in zip(self.cap.leaf_values, leaves, strict=True) if v == count)
        if x.numel() != 1:
            raise InputMismatchError(
                f"{COUNT_KWARG} is a tensor of shape {tuple(x.shape)}: it must be one number, the "
                "count of loss items in the GLOBAL batch, the same on every rank. Fix: sum the "
                "local counts over the ranks (e.g. torch.distributed.all_reduce of "
                "(labels != -100).sum()) and pass that on every rank")

    # -- backward --------------------------------------------------------------------------------
    @property
    def awaiting_backward(self) -> Call | None:
        """The latest call with gradients, until its backward runs."""
        return self._call

    def backward(self, grad_of: dict[str, torch.Tensor | None],
                 of: Call | None = None) -> dict[str, torch.Tensor]:
        """This rank's part of the pipeline backward of call `of` (default: the latest), for
        the gradients of its outputs; returns the gradients of this rank's rows of the model
        inputs that required grad, by value."""
        call = self._call
        # (checked first: where one loss holds two calls' outputs, the later call's backward
        # has run when the earlier one's comes, and the pipeline holds no call then)
        if of is not None and of is not call:
            # Every rank makes the same calls, so every rank raises here alike, before sending.
            raise RaNNCError(
                "backward() through the outputs of an earlier call of the model: another "
                "forward() with gradients ran since (e.g. one loss over two calls' outputs, "
                "D(real) and D(fake), or two views of a batch), and rannc keeps the pipeline "
                "state of the latest call with gradients only (its schedules may run that "
                "call's backward inside forward()). Fix: call backward() before the next "
                "forward(), or run the other forward() under torch.no_grad() (e.g. a metric or "
                "a teacher's outputs); to back-propagate through two batches at once, pass them "
                "in one call (out = D(torch.cat([real, fake])); out[:n], out[n:])")
        if call is None:
            raise RaNNCError("backward() without a forward() whose outputs need gradients")
        self._call = None
        if call.reducing and not self.sync:
            raise RaNNCError(
                f"backward() under no_sync() after a forward() outside it: under schedule "
                f"{self.spec.name!r} the gradients' all-reduce starts inside forward(), so "
                "no_sync() must hold the forward call too (as DistributedDataParallel.no_sync "
                "requires): with model.no_sync(): loss = model(...); loss.backward()")
        if call.reducing:  # its buckets are in flight: the agreement is waited for after them
            return self._finish_eager(call, grad_of, self._post_loss_gradients(call, grad_of))
        seed = self._speculative_seed(call, grad_of)
        carried = self._carried_seed(seed, grad_of)
        posted = None if carried is not None else self._post_loss_gradients(call, grad_of)
        self.carried_seeds += carried is not None
        agreed = posted.resolve() if seed is None and posted is not None else None
        # (from a speculative seed, each gradient is corrected on this rank as it becomes final,
        # or once the bucket carrying the ranks' seeds is summed; else fill-drain's backward,
        # run here for the real loss gradient, adds into a pending no_sync() sum in place)
        self.grads.begin(None if seed is None or posted is None
                         else _Correction(posted, self._loss, seed),
                         in_place=call.mode == "split", seed=carried)
        if call.mode == "split":
            rest = self.line[len(self._forward_line):]
            # the last microbatch's backward (its W where split off) makes gradients final:
            # buckets start from there
            last = self._last_final(call, rest)
            arm = last if last is not None and self.sync else None
            if agreed is not None:
                self.executor.send_output_grads(call, grad_of)
                call.grad_from = frozenset(agreed.seeds) | frozenset(call.used)
                self.executor.run(call, rest, {}, agreed.seeds, arm=arm)
            else:
                assert seed is not None
                call.grad_from = frozenset({self._loss})
                self.executor.run(call, rest, {}, {self._loss: seed}, arm=arm)
            in_grads = self.executor.receive_input_grads(call)
        else:
            assert agreed is not None
            in_grads = self._commit_eager(call, grad_of, agreed.seeds.get(self._loss))
        same = self.acc.same_got = self.acc.same_got and call.layout.every_replica_computes()
        self.grads.user_hooks = self.param_hooks.resume() and self.sync
        with torch.profiler.record_function("rannc reduce gradients"):
            self.grads.finish(self.sync, self._stand_in(),
                              agreed.overflow if agreed is not None else None, same_got=same)
        self.acc.last_sync = self.sync
        self.acc.same_got = self.acc.same_got or self.sync
        call.transport.wait_sends()
        call.release()
        self.iteration_s = time.perf_counter() - call.t0
        return in_grads

    def _speculative_seed(self, call: Call,
                          grad_of: dict[str, torch.Tensor | None]) -> torch.Tensor | None:
        """The loss gradient a fill-drain backward may start from before the ranks agree on it
        (None: it waits for the agreement): this rank's own, where every gradient this rank
        computes comes from its own seed alone -- one stage (no gradient arrives from another
        rank's stage), no input requiring a gradient (whose rows another replica may compute),
        the loss the one output that can carry a gradient -- and the value is a usable factor.
        Every rank usually passes the same one (loss.backward(), or the same loss scaler's
        factor), which is then the agreed average exactly and nothing changes; else each
        gradient is scaled by agreed / own on this rank before it joins a bucket
        (`_Correction`, `GradReducer.begin`). Starting from the own value rather than 1
        keeps a loss scaler's factor inside the backward, where half precision needs it. The
        agreement, posted before the backward, has long arrived when the first bucket needs
        it: the ranks meet once, after the backward, instead of also before it (each blocking
        wait costs a wake-up: up to milliseconds on the CPU ranks here)."""
        scalar_names, batch_names = self._loss_outputs
        if (call.mode != "split" or len(self.plan.stages) != 1 or call.grad_inputs
                or len(scalar_names) != 1 or batch_names):
            return None
        g = grad_of.get(scalar_names[0])
        if g is None:
            return torch.ones((), dtype=torch.float64)
        g = g.detach().to(torch.float64).reshape(())
        return g if bool(torch.isfinite(g)) and bool(g != 0) else torch.ones((), dtype=torch.float64)

    def _carried_seed(self, seed: torch.Tensor | None,
                      grad_of: dict[str, torch.Tensor | None]) -> LossSeed | None:
        """A speculative seed whose agreement can travel in the gradients' own all-reduce
        (`LossSeed`; `GradReducer.carries_seed`: one bucket, every rank holding every
        parameter) instead of an all-reduce of its own: then the ranks meet once a
        synchronised backward, as under DDP. Not under no_sync() (no bucket is summed) nor
        right after it (the pending sums are in `.grad`'s tensors). The same choice on every
        rank: the plan's, the graph's and the sync state's."""
        if seed is None or not self.sync or not self.acc.last_sync or not self.grads.carries_seed:
            return None
        return LossSeed(_grad_or_zero(grad_of.get(self._loss)), seed)

    @functools.cached_property
    def _loss_outputs(self) -> tuple[list[str], list[str]]:
        """(the scalar outputs, the floating-point batch outputs), sorted: the entries of the
        loss gradients' all-reduce (the graph's, so fixed for the runtime)."""
        scalar_names = sorted(self.routes.scalar_outputs())
        batch_names = sorted(v for v in self.routes.out_stage
                             if v not in scalar_names and self.routes.is_float(v))
        return scalar_names, batch_names

    def _post_loss_gradients(self, call: Call,
                             grad_of: dict[str, torch.Tensor | None]) -> _PostedLossGradients:
        """One all-reduce, started without waiting: the scalar outputs' gradients (averaged, as
        DDP), per scalar output whether any rank back-propagates through it at all, and, per
        batch output, whether any rank back-propagates through it (unused ones send no zeros
        around; a gradient of zeros counts: PyTorch then gives the parameters behind it zero
        gradients, not None, which weight decay and momentum see); see `_early_overflow` for
        what else it may carry."""
        scalar_names, batch_names = self._loss_outputs
        vec = [_grad_or_zero(grad_of.get(v)) for v in scalar_names]
        vec += [torch.tensor(float(grad_of.get(v) is not None), dtype=torch.float64)
                for v in scalar_names]
        vec += [torch.tensor(float(grad_of.get(v) is not None), dtype=torch.float64)
                for v in batch_names]
        early = self._early_overflow(call)
        vec += [torch.tensor(float(x), dtype=torch.float64) for x in early or ()]
        flat = torch.stack(vec) if vec else torch.zeros(0, dtype=torch.float64)
        work = dist.all_reduce(flat, async_op=True)

        def resolve() -> _LossGradients:
            work.wait()
            return self._loss_gradients(call, flat, scalar_names, batch_names, early)
        return _PostedLossGradients(resolve)

    def _loss_gradients(self, call: Call, flat: torch.Tensor, scalar_names: list[str],
                        batch_names: list[str], early: tuple[bool, bool] | None) -> _LossGradients:
        """What the loss gradients' all-reduce (`flat`, summed) agreed on; sets `call.used`."""
        w = float(self.world_size)
        n_s, n_b = len(scalar_names), len(batch_names)
        # A scalar output no rank back-propagated through (a second loss the step leaves out,
        # GPT2DoubleHeadsModel's mc_loss beside its loss) seeds nothing: seeded with 0, the
        # parameters only it reaches got zeros where PyTorch leaves .grad None, and AdamW
        # then decayed them and moved them by their momentum.
        seeds = {v: x / w for v, x, reached in zip(scalar_names, flat[:n_s], flat[n_s:2 * n_s],
                                                   strict=True) if reached > 0}
        call.used = {v for v, x in zip(batch_names, flat[2 * n_s:2 * n_s + n_b], strict=True)
                     if x > 0}
        # Under an eager schedule without gradients to reduce across ranks, the gradients are
        # the stash itself when the loss gradient is 1, nothing was accumulated before and no
        # late pass runs: then every rank knows from this all-reduce whether some rank's are not
        # finite, and the gradient reducer need not meet the others again.
        overflow: tuple[bool, bool] | None = None
        if early is not None and not call.used and self._loss in seeds \
                and bool(seeds[self._loss] == 1) and float(flat[-1]) == 0:
            overflow = (float(flat[-2]) > 0, early[0])
        return _LossGradients(seeds, overflow)

    def _finish_eager(self, call: Call, grad_of: dict[str, torch.Tensor | None],
                      posted: _PostedLossGradients) -> dict[str, torch.Tensor]:
        """backward() of an eager call whose gradients are being summed since forward(): the
        sums scaled by the loss gradient, whose agreement is waited for once the buckets are
        (the ranks meet once at the end of backward, as under DDP); a late pass's gradients
        summed in a second round."""
        # the line ran for a unit loss gradient: the sums need the agreed one (None: it is 1)
        scale = _Correction(posted, self._loss, torch.ones((), dtype=torch.float64))
        # (reducing in forward() needs the backward before synchronised: nothing pending)
        same = call.layout.every_replica_computes()
        self.grads.user_hooks = self.param_hooks.resume()
        before = {n: p.grad for n, p in self.held.items()}
        with torch.profiler.record_function("rannc reduce gradients"):
            self.grads.rebase()  # (.grad may have been zeroed or replaced since forward())
            self.grads.finish(True, self._stand_in(), None, scale, same_got=same)
        g = scale()
        in_grads = {v: x if g is None else x * g.to(x.dtype) for v, x in call.input_stash.items()}
        if self._loss not in posted.resolve().seeds:
            # No rank back-propagated through the loss (a loss computed from a batch output
            # instead): the line's sums, scaled by 0, are not the step's; .grad keeps what it
            # held, as PyTorch leaves a parameter no backward reaches (`_commit_eager`).
            for n, p in self.held.items():
                p.grad = before[n]
            in_grads = {}
        if call.used:
            self._log_late_pass()
            self.grads.begin()
            self.executor.late_pass(call, grad_of)
            for v, x in self.executor.receive_input_grads(call).items():
                in_grads[v] = in_grads[v] + x if v in in_grads else x
            with torch.profiler.record_function("rannc reduce gradients"):
                self.grads.finish(True, self._stand_in(), same_got=same)
        self.acc.last_sync = True
        self.acc.same_got = True
        call.transport.wait_sends()
        call.release()
        self.iteration_s = time.perf_counter() - call.t0
        return in_grads

    def _log_late_pass(self) -> None:
        if self.rank == 0 and not self._late_logged:
            log.info("rannc: a batch output of the model received a gradient, so each %s "
                     "iteration adds a recomputing backward pass for it; compute the loss "
                     "inside the model, or detach other outputs, to avoid it", self.plan.schedule)
            self._late_logged = True

    def _commit_eager(self, call: Call, grad_of: dict[str, torch.Tensor | None],
                      g: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """An eager schedule's backward(): the gradients stashed in forward() for a unit loss
        gradient, scaled by the real one, and the late pass for batch outputs' gradients."""
        assert call.stash is not None
        # The usual loss.backward() brings a gradient of exactly 1: the stashed gradients
        # are then the gradients (x * 1.0 is x, bit for bit), without a multiply and a new
        # tensor per parameter and step.
        # No rank back-propagated through the loss (g None: a loss computed from the outputs
        # instead): its line's gradients are not the step's; .grad keeps what it held, as
        # PyTorch leaves a parameter no backward reached.
        in_grads: dict[str, torch.Tensor] = {}
        if g is not None:
            unit = bool(g == 1)
            for n, p in self.held.items():
                st = call.stash.get(n)
                if st is not None:
                    p.grad = st if unit else st * g.to(st.dtype)
            in_grads = {v: x if unit else x * g.to(x.dtype) for v, x in call.input_stash.items()}
        if call.used:
            self._log_late_pass()
            self.executor.late_pass(call, grad_of)
            for v, x in self.executor.receive_input_grads(call).items():
                in_grads[v] = in_grads[v] + x if v in in_grads else x
        return in_grads

    @property
    def _loss(self) -> str:
        return next(v for v in self.routes.scalar_outputs() if self.routes.is_float(v))

    def _early_overflow(self, call: Call) -> tuple[bool, bool] | None:
        """Eager, synchronised and no parameter held by several ranks: (this rank's stashed
        gradients are not all finite, their check is not final because `.grad` held gradients
        before); else None. The same on every rank (the loss gradient's all-reduce carries it)."""
        if call.mode != "eager" or not self.sync or self.grads.shared or self.param_hooks.active:
            return None  # (a parameter's own hooks run on the final gradients, after this)
        assert call.stash is not None
        if any(p.grad is not None for p in self.held.values()):
            return False, True
        return not_finite(list(call.stash.values())), False

    def _stand_in(self) -> list[torch.Tensor]:
        """A rank holding no parameter answers the overflow check with its optimizer's stand-in
        (zero gradient, marked when another rank overflowed, so its GradScaler skips too)."""
        if not self.sync:
            return []
        out = []
        if self.placeholder is not None:
            self.placeholder.grad = torch.zeros_like(self.placeholder)
            out.append(self.placeholder.grad)
        if self.sparse_placeholder is not None:  # (one explicit zero: a value to mark)
            self.sparse_placeholder.grad = torch.sparse_coo_tensor(
                torch.zeros((1, 1), dtype=torch.long, device=self.device),
                torch.zeros(1, device=self.device), (1,), check_invariants=False)
            out.append(self.sparse_placeholder.grad)
        return out

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

    def share_stepped_params(self, only: Container[int] | None = None) -> None:
        """ZeRO-1, after the optimizer step: each parameter's owner sends its new values to the
        parameter's other holders; one broadcast per (holders, owner, dtype) and bucket_mb.
        `only`: the ids of the parameters the step could change (the optimizer's, the same on
        every holder; one of several optimizers changes its own alone)."""
        if self.plan.zero_stage == 0:
            return
        first = self.first_names()
        for _ranks, names, group in self.param_groups:
            if group is None:
                continue
            by: dict[tuple[int, str], dict[int, nn.Parameter]] = {}
            for n in names:
                p = self.held[n]
                if only is not None and id(p) not in only:
                    continue
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



def _warn_grads_twice(schedule: str, grads: Iterable[torch.Tensor | None]) -> bool:
    """Warn (and return True) where an eager line starts while `.grad` holds gradients, which a
    plan not made for an accumulation did not count beside the line's own (an accumulation it
    was not planned for, or a loop zeroing gradients in place). Once per wrapped model, on
    rank 0 (`Accumulation.warned_twice`)."""
    held = sum(g.numel() * g.element_size() for g in grads if g is not None)
    if not held:
        return False
    log.warning(
        "rannc: forward() started while .grad held gradients (%.1f MiB on rank 0): under "
        "schedule %r backward runs inside forward() and its gradients wait beside them until "
        "backward(), a second copy of each stage's gradients that this plan's memory forecast "
        "does not count. For a gradient accumulation, make the first call under no_sync() or "
        "pass grad_accumulation='on' so the plan counts it; otherwise zero_grad() with "
        "set_to_none=True (the default) frees them", held / 2**20, schedule)
    return True


class PipelineFunction(torch.autograd.Function):
    """Connects the pipeline to the user's autograd graph: its outputs are this rank's
    outputs, and its backward runs this rank's part of the pipeline backward."""

    @staticmethod
    def forward(ctx: Any, runtime: PipelineRuntime, names: list[str],  # type: ignore[override]
                in_names: list[str], in_scales: list[float], anchor: torch.Tensor,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`tensors`: the outputs (one per name in `names`), then the model inputs requiring
        grad (one per name in `in_names`), which backward gives their rows' gradients, times
        `in_scales` (`input_gradient_scales`)."""
        ctx.runtime, ctx.names, ctx.in_names, ctx.in_scales = runtime, names, in_names, in_scales
        ctx.call = runtime.awaiting_backward  # (the call these outputs came from)
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
            in_grads = ctx.runtime.backward(grad_of, ctx.call)
        return (None, None, None, None, None, *([None] * len(grads)),
                *[_scaled(in_grads.get(v), s) for v, s in zip(ctx.in_names, ctx.in_scales,
                                                               strict=True)])


def check_whole_backward(anchor: Any) -> None:
    """Refuse a backward the pipeline cannot give as the unwrapped model would, before anything
    is sent (every rank makes the same call, so every rank raises here alike; called from a
    pre-hook on `PipelineFunction`'s node, `anchor` the gradient node of its first tensor
    input):

    * `create_graph=True` (a gradient penalty, `torch.autograd.grad(out, x, create_graph=True)`
      as WGAN-GP and R1 compute it; grad mode is on in backward only then): the pipeline's
      backward runs once across the ranks and is not itself differentiable. Before, the penalty
      went on to fail with "backward() ... a second time".
    * a backward restricted to some tensors (`torch.autograd.grad(loss, x)`, `backward(inputs=
      [x])`, as input saliency and adversarial attacks compute it): the unwrapped model leaves
      the parameters' `.grad` alone there, while the pipeline computes and sums every held
      parameter's gradient with the inputs' (its schedules may run that inside forward()).
      Before, each such call added a gradient into `.grad` silently. Seen on the anchor: its
      gradient node runs in every unrestricted backward.
    """
    if torch.is_grad_enabled():
        raise RaNNCError(
            "backward with create_graph=True through the outputs of a model on several ranks "
            "(a gradient penalty: torch.autograd.grad(out, x, create_graph=True)): rannc's "
            "pipelined backward runs once across the ranks and cannot be differentiated again. "
            "Fix: keep the penalised model in one process (exact there), or drop the penalty")
    if anchor is not None and not torch._C._will_engine_execute_node(anchor):
        raise RaNNCError(
            "torch.autograd.grad(...) or backward(inputs=...) through the outputs of a model on "
            "several ranks: rannc's pipelined backward computes every parameter's gradient and "
            "sums it over the ranks together with the inputs' gradients, so the parameters' "
            ".grad would change where the unwrapped model leaves it alone. Fix: give the input "
            "requires_grad, call loss.backward() and read x.grad (then model.zero_grad() before "
            "the training step's backward), or compute these gradients in one process")


def _scaled(g: torch.Tensor | None, s: float) -> torch.Tensor | None:
    return g if g is None or s == 1 else g * s


# How far back `input_gradient_scales` looks for another pipeline's outputs (autograd nodes).
_COMPOSED_SEARCH = 10_000


def input_gradient_scales(inputs: Sequence[torch.Tensor], world_size: int) -> list[float]:
    """Per model input requiring grad: what its gradient is multiplied by.

    Why: a rank's input gradient is the gradient of the average over the ranks of what each
    back-propagated (README, "Inputs with requires_grad"), 1/world_size of each rank's own
    share, so that back-propagating the model's global loss gives the unwrapped model's
    `x.grad`. An input computed from another wrapped model's outputs (a GAN's `D(G(z))`) passes
    that gradient on to the other model's backward, which averages over the ranks again: its
    gradients came out 1/world_size of the composed model's. For such an input, the gradient is
    each rank's own share (as DDP gives input gradients), and the other model's average makes
    it exact. Found by a search of the input's autograd graph for a `PipelineFunction` node."""
    scales = []
    for x in inputs:
        found = _from_a_pipeline(x)
        if found is None:
            warnings.warn(
                f"rannc: could not tell whether a model input comes from another RaNNCModule's "
                f"outputs (its autograd graph has over {_COMPOSED_SEARCH} nodes); taken as not. "
                "If it does, that model's gradients are 1/world_size of the composed model's",
                UserWarning, stacklevel=3)
        scales.append(float(world_size) if found else 1.0)
    return scales


def _from_a_pipeline(x: torch.Tensor) -> bool | None:
    """Whether `x`'s autograd graph holds a `PipelineFunction` (None: too large to search)."""
    stack = [x.grad_fn]
    seen: set[Any] = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        if getattr(node, "_forward_cls", None) is PipelineFunction:
            return True
        seen.add(node)
        if len(seen) > _COMPOSED_SEARCH:
            return None
        stack.extend(f for f, _i in node.next_functions)
    return False


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


class _PostedLossGradients:
    """The loss gradients' all-reduce once started: `resolve` waits for it (once) and returns
    what the ranks agreed on."""

    def __init__(self, resolve: Callable[[], _LossGradients]) -> None:
        self._resolve: Callable[[], _LossGradients] | None = resolve
        self._agreed: _LossGradients | None = None

    def resolve(self) -> _LossGradients:
        if self._agreed is None:
            assert self._resolve is not None
            self._agreed, self._resolve = self._resolve(), None
        return self._agreed


class _Correction:
    """What the gradients of a backward run from a loss gradient the ranks had not agreed on
    yet still need: the agreed seed over the one used, or None where they are equal. Used
    for a fill-drain backward from the rank's own loss gradient (`_speculative_seed`: asked
    as the first gradient becomes final, applied on this rank before the sum) and for an
    eager line run for a unit one (`_finish_eager`: applied after the sum). Waits for the
    agreement when first called; the same value every later call."""

    def __init__(self, posted: _PostedLossGradients, loss: str, used: torch.Tensor) -> None:
        self.posted, self.loss, self.used = posted, loss, used
        self._known = False
        self._factor: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor | None:
        if not self._known:
            agreed = self.posted.resolve().seed(self.loss)
            self._factor = None if bool(agreed == self.used) else agreed / self.used
            self._known = True
        return self._factor


@dataclass(frozen=True, slots=True)
class _LossGradients:
    """What the ranks agreed on at the start of backward(): the seeds of the scalar outputs'
    backward (none for one no rank back-propagated through), and the overflow where already
    known (`_early_overflow`)."""

    seeds: dict[str, torch.Tensor]
    overflow: tuple[bool, bool] | None

    def seed(self, v: str) -> torch.Tensor:
        """v's seed, 0 where no rank back-propagated through it (a line already run for the
        loss, an eager one's, is scaled by it)."""
        return self.seeds.get(v, torch.zeros((), dtype=torch.float64))


def _grad_or_zero(g: torch.Tensor | None) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float64) if g is None else g.detach().reshape(()).to(torch.float64)


__all__ = ["PipelineFunction", "PipelineRuntime", "input_gradient_scales"]
