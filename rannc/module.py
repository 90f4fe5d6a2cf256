"""RaNNCModule: the one-line facade around an unmodified nn.Module.

Construction is cheap: nothing is captured until the first call, because only
then are example inputs (shapes, dtypes, keyword names) known. The first call
captures the model (torch.export), forms its atomic components and deploys it;
later calls with the same input signature reuse that deployment, and a call
with a new signature (another sequence length, other keyword names, another
mode) captures once more and caches the result.

The wrapper owns no parameters of its own: it runs the captured graph on the
user's parameter and buffer tensors, so the user's optimizer, `state_dict()`
names and BatchNorm statistics keep their meaning.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
import logging
import os
import sys
import warnings
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from rannc import amp, callers, health, validate
from rannc import checkpoint as ckpt
from rannc import clip as rclip
from rannc import dist as rdist
from rannc.calls import without_cache
from rannc.config import Config
from rannc.deploy import Holdings, OneProcess, capture_signature, deployment_plan, host_malloc
from rannc.deploy import optimizer_state_factor as optimizer_state_factor  # (its old home)
from rannc.derive import derive_plan
from rannc.errors import CaptureError, ConfigError, RaNNCError
from rannc.gathered import check_modifier, gathered
from rannc.graph import attributes, leftovers
from rannc.graph.capture import CapturedModel, autocast_state, flatten_inputs
from rannc.graph.extract import run_chain
from rannc.graph.model_state import model_state, replaced
from rannc.optimizers import as_one, members
from rannc.pipeline.grads import Accumulation, BucketBuffers
from rannc.pipeline.runtime import (
    COUNT_KWARG,
    PipelineFunction,
    PipelineRuntime,
    check_whole_backward,
    input_gradient_scales,
)
from rannc.plans import Plan
from rannc.progress import NO_PROGRESS, progress_for

log = logging.getLogger(__name__)

# Captures one attribute's changes may cause before that is warned about (`_changed_reads`).
RECAPTURES_WARNED = 3


class RaNNCModule(nn.Module):
    """Wrap `model` (and optionally its optimizer) for automatic hybrid parallelism.

    Construction is cheap (it starts the process group under mpiexec/torchrun); the first call
    captures the model, plans (or loads a plan) and deploys it: each rank then holds only its
    stage's parameters, and the optimizer steps only those (a list of optimizers, e.g. Muon
    over the matrices and AdamW over the rest, is `model.optimizer`, a
    `rannc.optimizers.OptimizerSet` over them; step them as before). Every rank calls the wrapper with
    its own local batch; the model behaves as the original on the concatenation of the ranks'
    batches. Settings are `rannc.Config` fields, as `config=` or keywords (`partition_num=2`),
    or `RANNC_*` environment variables; they are readable as `model.rannc_config`. Attributes
    of the wrapped model (a Hugging Face `config`) are reachable through the wrapper, and the
    wrapped model is `model.module`."""

    # Already distributed: Accelerate's prepare() (and so Hugging Face's Trainer) returns a module
    # with this flag as it is instead of wrapping it in DistributedDataParallel, which would
    # all-reduce gradients rannc already reduced, over parameters each rank does not all hold.
    # Accelerate reading or setting it also says it prepared this module: its mixed precision
    # then applies to the calls (`rannc.amp`), as it would have wrapped a prepared forward.
    @property
    def _is_accelerate_prepared(self) -> bool:
        if callers.called_from_accelerate():
            self.__dict__["_accelerate_prepared"] = True
        return True

    @_is_accelerate_prepared.setter
    def _is_accelerate_prepared(self, value: bool) -> None:
        if callers.called_from_accelerate():
            self.__dict__["_accelerate_prepared"] = True
    # Hugging Face Trainer reads this (through the wrapper it would find the wrapped model's, or
    # forward's **kwargs): True makes it pass num_items_in_batch, the global label count, and
    # multiply the loss by the number of processes, right under DDP where each rank's loss is its
    # rows' share. A RaNNCModule returns the global loss itself on every rank, so that factor
    # would scale loss and gradients by the world size. The plain Trainer's loss is then the
    # row-weighted mean over the ranks' rows (exact unless labels are masked with -100);
    # rannc.hf.RaNNCTrainer passes the count without the factor and is exact.
    accepts_loss_kwargs = False

    def __init__(self, model: nn.Module,
                 optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None, *,
                 config: Config | None = None, **options: Any) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"RaNNCModule wraps an nn.Module, got {type(model).__name__}")
        if isinstance(model, RaNNCModule):
            raise RaNNCError(
                f"the model is already a RaNNCModule (around {type(model.module).__name__}); "
                "wrapping it again would pipeline a pipeline. Fix: wrap the original model once, "
                "RaNNCModule(model.module, optimizer, ...), or use the existing wrapper as is")
        _refuse_lazy(model)
        # Registered as the child `module` (as DDP and FSDP do), so a parent (HF Trainer,
        # Accelerate, Lightning) sees its parameters; named_parameters() and state_dict() below
        # keep the original names, without a "module." prefix.
        self.module = model
        # (several optimizers, e.g. Muon and AdamW: one `rannc.optimizers.OptimizerSet`)
        self.optimizer = as_one(optimizer)
        # Not `config`: that name is the wrapped model's (a Hugging Face model's `config`).
        self.rannc_config = _sync_for_sync_batch_norm(model, Config.resolve(config, **options))
        # The process group starts here, not at the first call: a DistributedSampler (or any
        # torch.distributed call) made right after wrapping needs it.
        if rdist.get_world_size() > 1:
            rdist.init_process_group(self.rannc_config.timeout_s)
        self.training = model.training
        # Captures by input signature, least recently used first; at most config.max_captures.
        self._deployments: OrderedDict[tuple[Any, ...], OneProcess] = OrderedDict()
        self._sync = True
        # no_sync()'s local sums and flags, one record for every input signature's runtime: the
        # micro-steps of an accumulation may run different graphs (dynamic padding)
        self._accumulation = Accumulation()
        self._bucket_buffers = BucketBuffers()  # (likewise shared by every input signature's)
        self._plan: Plan | None = None
        self._planned_accumulation = False  # the plan counts an accumulation's gradients
        self._runtimes: OrderedDict[tuple[Any, ...], PipelineRuntime] = OrderedDict()
        self._warned_recapture = False
        self._recaptured_for: dict[str, int] = {}  # attribute -> captures its changes caused
        self._warned_attributes = False
        # what torch keeps of each capture (cached sources, its ShapeEnv), given back when it is
        # dropped or the wrapper is gone (`rannc.graph.leftovers`)
        self._leftovers: dict[tuple[Any, ...], leftovers.Leftovers] = {}
        weakref.finalize(self, _forget_leftovers, self._leftovers)
        self._calls = 0  # forward() calls: the "step" a failure report names
        self._last_rt: PipelineRuntime | None = None
        self._owned: list[nn.Parameter] | None = None  # the parameters this rank counts in norms
        # the model's parameters by name when it was deployed (several ranks), which the stages,
        # the gradient reduction and the optimizer hold from then on (`_check_kept`)
        self._deployed: dict[str, torch.Tensor] | None = None
        rclip.register(self)  # torch.nn.utils.clip_grad_norm_ recognises model.parameters()
        _watch_late_optimizers(self)  # (an optimizer built after wrapping: `_adopt`)
        me = weakref.ref(self)
        # What this rank holds once deployed (released parameters, pruned optimizer groups,
        # ZeRO-1's step hooks) and the planned deployment's runtime (`rannc.deploy`).
        self._held = Holdings(step=lambda: m._calls if (m := me()) is not None else 0)
        self._gathering = 0  # gathered_parameters() blocks open: parameters() lists them all
        self._loading_as: str | None = None  # the key prefix a parent's load_state_dict gives
        self.register_load_state_dict_post_hook(_loaded_through_a_parent)

    module: nn.Module  # the wrapped model (as `DistributedDataParallel.module`)

    def __getattr__(self, name: str) -> Any:
        """The wrapped model's attributes (a Hugging Face model's `config`, `generation_config`,
        `can_generate`, any user attribute) through the wrapper, as DDP and FSDP do."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules")
            if modules is None or "module" not in modules or name.startswith("__"):
                raise
            found = getattr(modules["module"], name)
            if name == "save_pretrained" and callable(found):
                return functools.partial(self._save_pretrained, found)
            if name == "generate" and callable(found) and self.__dict__["_held"].released:
                return functools.partial(_generate_refused, type(modules["module"]).__name__)
            return found

    def _save_pretrained(self, save: Callable[..., Any], save_directory: Any, *args: Any,
                         **kwargs: Any) -> Any:
        """`model.save_pretrained(path)` of a Hugging Face or PEFT model: after deployment on
        several ranks a collective, as `state_dict()` (every rank calls it; the whole model is
        gathered onto rank 0, which writes it when its `is_main_process` is true). Before, the
        wrapped model's own save wrote each rank's released parameters as empty tensors. Given
        `state_dict=`, the module's own save writes that, on the rank that calls it."""
        rt = self._last_rt
        if rt is None or rt.world_size == 1 or "state_dict" in kwargs:
            with ckpt.own_state_dict_reads():
                return save(save_directory, *args, **kwargs)
        sd = self.state_dict()
        if rt.rank != 0 or not kwargs.pop("is_main_process", True):
            return None
        with ckpt.own_state_dict_reads():
            return save(save_directory, *args, state_dict=sd, is_main_process=True, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> RaNNCModule:
        """`copy.deepcopy(model)`: in one process a second wrapped model of its own, with its own
        copy of the model and the optimizer (as deepcopy of any module); on several ranks refused
        (before: torch's "cannot pickle 'ProcessGroup' object" on some ranks, a copy of a rank's
        stages that no other rank's copy runs with on others)."""
        if rdist.get_world_size() > 1:
            raise RaNNCError(
                f"copy.deepcopy of a RaNNCModule on rank {rdist.get_rank()} of "
                f"{rdist.get_world_size()}: each rank holds only its stages and the process "
                "groups that join them, which cannot be copied. Fix: copy the model before "
                "wrapping it (`ema = copy.deepcopy(model)`, then `rannc.RaNNCModule(model, "
                "optimizer)`), or load a fresh copy from model.state_dict() called on every rank "
                "(it gathers the whole model onto rank 0)")
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickling (`torch.save(model, path)`) is refused with the fix, as it failed anyway
        (a weakref in one process, a process group on several) with torch's unclear error."""
        raise RaNNCError(
            "pickling a RaNNCModule (`torch.save(model, path)`): it holds its captured graphs, "
            "runtime and process groups, which cannot be saved. Fix: save its state instead, "
            "`sd = model.state_dict()` on every rank (it gathers the whole model onto rank 0), "
            "then `torch.save(sd, path)` on rank 0, or model.save_pretrained(path) or "
            "model.save_checkpoint(dir) on every rank; to resume, build the model, load the state "
            "and wrap it again")

    @property
    def plan(self) -> Plan | None:
        """The deployment plan after the first call (None before). In one process it is the whole
        model as one stage, one microbatch, with no predictions: nothing is planned there."""
        return self._plan

    # -- running -----------------------------------------------------------
    # Dynamo must not trace rannc's capture, planning and collectives (it crashed inside them):
    # the outer torch.compile runs this eagerly, and _NO_OUTER_COMPILE says what to do instead.
    @torch.compiler.disable
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        mixed = amp.prepared_autocast() if self.__dict__.get("_accelerate_prepared") else None
        if mixed is None:
            return self._forward(*args, **kwargs)
        with torch.autocast(mixed[0], dtype=mixed[1]):
            out = self._forward(*args, **kwargs)
        return amp.outputs_to_fp32(out)

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if callers.called_through_compile(self):
            raise RaNNCError(_NO_OUTER_COMPILE)
        kwargs = _count_as_tensor(args, kwargs)
        kwargs = without_cache(self.module, kwargs)
        if rdist.get_world_size() > 1:
            ctx = rdist.init_process_group(self.rannc_config.timeout_s)  # and the phase's watchdog
            self._calls += 1
            with health.phase("forward", self._calls):
                return self._forward_distributed(ctx, args, kwargs)
        leaves, layout = flatten_inputs(args, kwargs)
        base = self._capture_base(layout)
        rows = layout.batch or 1
        key = _cached(self._deployments, base, lambda d: d.captured.reads,
                      fits=lambda d: d.captured.fits(rows))
        if key is None:
            changes = self._changed_reads(self._deployments, base, lambda d: d.captured.reads)
            other = _other_rows(self._deployments, base, lambda d: d.captured, rows)
            first = not self._deployments
            mark = leftovers.Mark()
            validate.check_capturable(self.module, leaves, [layout.batch or 0], first)
            cap, atomic = capture_signature(self.module, args, kwargs,
                                            progress_for(self.rannc_config.progress, 0))
            if not first:
                log.info("rannc: %s; captured again (%s)",
                         other or _why_again(changes, self._deployments, base),
                         cap.graph.summary())
            log.info("rannc: captured %s, %d atomic components, in %.2f s", cap.graph.summary(),
                     len(atomic.components), cap.seconds)
            dep = OneProcess.of(cap, atomic, _compile_stage if self.rannc_config.compile else None)
            if first:
                self._plan = deployment_plan(self.rannc_config, self.module, self.optimizer, cap,
                                             atomic, None, leaves, [layout.batch or 0],
                                             NO_PROGRESS)
            # (the tree as the capture left it: a model may register its hooks in its first
            # forward, as transformers' output recorders do)
            key = (*self._capture_base(layout), (cap.reads.values(), cap.batch_rows))
            self._deployments[key] = dep
            self._leftovers[key] = mark.new(cap.gm)
            self._bound_cache(self._deployments, pinned=None)
            if first:
                _seed_at_deployment(self.rannc_config)
                host_malloc(self.rannc_config,
                            next((p.device for p in self.module.parameters()), torch.device("cpu")),
                            [])
        else:
            self._deployments.move_to_end(key)
            dep = self._deployments[key]
        values = run_chain(dep.modules, dep.stages, dep.captured.bind(self.module, leaves))
        cap = dep.captured
        if cap.stored:  # (tensors forward stores on its modules: assigned as forward does)
            cap.store(self.module, [values[v] if v is not None else None
                                    for v in cap.graph.outputs[cap.n_user_outputs:]])
        return cap.unflatten_outputs(values)

    def _planning_config(self) -> Config:
        """The configuration the first call plans with: grad_accumulation "auto" is "on" when
        that call is made under no_sync() (an accumulation's first micro-step), else "off"."""
        cfg = self.rannc_config
        coupled = _coupling_optimizers(self.optimizer)
        if coupled:
            forced = _forced_split(cfg)
            if forced:
                raise ConfigError(_coupled_text(coupled, forced))
            # (every rank holds every parameter: one stage, its replicas as DDP's)
            cfg = dataclasses.replace(cfg, partition_num=1, zero_stage=0)
        if cfg.grad_accumulation != "auto":
            return cfg
        return dataclasses.replace(cfg, grad_accumulation="off" if self._sync else "on")

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Not supported: rannc plans and communicates in Python around the graphs it runs; use
        `RaNNCModule(model, opt, compile=True)` to torch.compile each stage's graph."""
        raise RaNNCError(_NO_OUTER_COMPILE)

    def _check_kept(self) -> None:
        """Raise (on every rank that replaced one, before the call's first collective) where a
        parameter of the deployed model is no longer the tensor deployed: the stages, the
        gradient reduction and the optimizer hold the deployed ones, so a new one would be
        neither trained nor summed over the replicas (DDP would not notice either). In one
        process nothing holds them, and a replaced parameter is simply used."""
        if self._deployed is None:
            return
        now = model_state(self.module).params()
        if now is self._deployed:
            return
        gone = replaced(now, self._deployed)
        if not gone:  # rebuilt for another reason (a buffer or a module swapped alike)
            self._deployed = now
            return
        more = f" and {len(gone) - 3} more" if len(gone) > 3 else ""
        raise RaNNCError(
            f"parameter(s) {', '.join(repr(n) for n in gone[:3])}{more} of the model were "
            "replaced by other tensors after rannc deployed it (e.g. module.weight = "
            "nn.Parameter(...)): its stages, gradient reduction and optimizer hold the tensors "
            "deployed, so the new ones would be neither trained nor summed over the replicas. "
            "Fix: change a parameter in place (with torch.no_grad(): param.copy_(new)), or "
            "make the change before wrapping the model in RaNNCModule and building its optimizer")

    def _warn_released_writes(self) -> None:
        """Warn once where the user's code wrote into parameters this rank released, outside
        `gathered_parameters()`: random initialisation after wrapping (`model.apply(init)`)
        drew nothing for them here, so the parameters this rank holds got other numbers than
        the unwrapped model's (a stage's replicas alike, so training runs on, from another
        initialisation). Deterministic writes (`zero_()`, `fill_`) change nothing, and are
        warned about alike: a version counter cannot tell them apart."""
        written = self._held.written()
        if not written:
            return
        self._held.note_versions(self.module)
        more = f" and {len(written) - 3} more" if len(written) > 3 else ""
        warnings.warn(
            f"rannc: parameter(s) {', '.join(repr(n) for n in written[:3])}{more}, which this "
            "rank does not hold (they are empty here), were written in place since the model "
            "was deployed, e.g. by model.apply(init) or reset_parameters() after wrapping. A "
            "random initialisation drew no numbers for them here, so the parameters this rank "
            "holds got other values than the unwrapped model would have. Fix: initialise before "
            "wrapping, or inside `with model.gathered_parameters(modifier_rank=0):` (on every "
            "rank, from the same seed), which equals the unwrapped model's", UserWarning,
            stacklevel=4)

    def _forward_distributed(self, ctx: rdist.DistContext, args: tuple[Any, ...],
                             kwargs: dict[str, Any]) -> Any:
        if self._plan is None:
            validate.check_config(self.rannc_config, ctx.world_size)
        self._check_kept()
        self._warn_released_writes()
        if self.optimizer is not None and self._held.opt_groups is not None:
            self._held.groups(self.module, self.optimizer)  # (prunes groups added since)
        leaves, layout = flatten_inputs(args, kwargs)
        base = self._capture_base(layout)
        modes = base[2]
        key = _cached(self._runtimes, base, lambda r: r.cap.reads)
        rt = self._runtimes[key] if key is not None else None
        changes = self._changed_reads(self._runtimes, base, lambda r: r.cap.reads) \
            if rt is None else []
        # Before anything a rank might do alone: every rank raises at `resolve`, or none does.
        # A call like the last one runs on its row layout before the ranks agree (see
        # PipelineRuntime.forward); any other waits for the agreement here. (Where the runtime
        # carries the call's scalar sums in it, a guessed call posts it once they are known.)
        # The mode names the values of the model's attributes the capture run read (or what
        # changed), so that ranks whose models differ in them raise instead of running
        # different graphs.
        agreement = validate.post_call(args, kwargs, leaves, layout, ctx,
                                       validate.call_mode(base[1], base[3], modes)
                                       + _grad_inputs_text(args, kwargs)
                                       + _tree_text(base)
                                       + _reads_text(rt.cap.reads if rt is not None else None,
                                                     changes), start=False)
        guess = rt.guess_sizes(agreement) if rt is not None else None
        if guess is None or rt is None or not rt.carries_scalars:
            agreement.start()
        sizes = guess if guess is not None else agreement.resolve()
        if key is not None:
            self._runtimes.move_to_end(key)
        else:
            mark = leftovers.Mark()
            validate.check_capturable(self.module, leaves, sizes, self._plan is None)
            progress = progress_for(self.rannc_config.progress, ctx.rank)
            with self._held.shaped_params(self.module):
                cap, atomic = capture_signature(self.module, args, kwargs, progress,
                                                small_pieces=True)
            validate.agree_on_graph(cap.graph, sizes, ctx.device)
            validate.check_outputs_combine(cap, type(self.module).__name__)
            if self._plan is None:
                cfg = _pieces_within(self._planning_config(), cap, sum(sizes))
                plan = deployment_plan(cfg, self.module, self.optimizer, cap, atomic, ctx, leaves,
                                       sizes, progress)
                coupled = _coupling_optimizers(self.optimizer)
                if coupled and (len(plan.stages) > 1 or plan.zero_stage):  # (a loaded plan)
                    raise ConfigError(_coupled_text(coupled, f"the plan loaded ({len(plan.stages)} "
                                                             f"stages, zero_stage {plan.zero_stage})"))
                # (a loaded plan says nothing of it: taken as not counted)
                self._planned_accumulation = cfg.grad_accumulation == "on" \
                    and not cfg.load_deployment
                if ctx.rank == 0:
                    _show_plan(plan)
                self._plan = plan
            else:
                # Another mode or input shape of a deployed model: keep every rank's parameters
                # where they are and place the new graph on the same stages.
                plan = derive_plan(cap.graph, atomic, self._plan, recompute=base[1])
                if ctx.rank == 0:
                    log.info("rannc: %s (%s mode, %s): captured again and placed on the deployed "
                             "stages", _why_again(changes, self._runtimes, base),
                             "train" if base[1] else "eval", cap.graph.summary())
            rt = PipelineRuntime(self.module, cap, atomic, plan, ctx.rank, ctx.world_size, ctx.device,
                                 trace=self.rannc_config.trace,
                                 wrap_stage=_compile_stage if self.rannc_config.compile else None,
                                 batchnorm=self.rannc_config.batchnorm,
                                 bucket_mb=self.rannc_config.bucket_mb,
                                 accumulation=self._accumulation,
                                 planned_accumulation=self._planned_accumulation,
                                 buffers=self._bucket_buffers)
            rt.sync = self._sync
            if not self._runtimes:
                _seed_at_deployment(self.rannc_config)
                host_malloc(self.rannc_config, ctx.device, plan.stages_of_rank(ctx.rank))
            # (the tree as the capture left it: a model may register its hooks in its first
            # forward, as transformers' output recorders do)
            key = (*self._capture_base(layout), (cap.reads.values(), cap.batch_rows))
            self._runtimes[key] = rt
            self._held.release(self.module, self.optimizer, self._runtimes.values(), rt)
            self._owned = None
            self._deployed = model_state(self.module).params()
            # The runtime of the planned deployment stays: the parameters this rank holds are
            # its stage's (a derived plan's stages hold a subset of them). (Not the first key:
            # move_to_end reorders the cache at every call.)
            self._leftovers[key] = mark.new(cap.gm)
            self._bound_cache(self._runtimes, pinned=self._planned_key())
        assert rt is not None
        cap = rt.cap
        self._last_rt = rt
        flat = rt.forward(leaves, sizes, agreement)
        if torch.is_grad_enabled():
            idx = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
            names = [cap.graph.outputs[i] for i in idx]
            anchor = torch.empty((), requires_grad=True)
            ins = rt.grad_inputs(leaves)  # they get the gradients of this rank's rows
            scales = input_gradient_scales([x for _v, x in ins], ctx.world_size)
            outs = PipelineFunction.apply(rt, names, [v for v, _x in ins], scales, anchor,
                                          *[flat[i] for i in idx], *[x for _v, x in ins])
            node = next((o.grad_fn for o in outs if o.grad_fn is not None), None)
            if node is not None:
                with model_state(self.module).own_handles():
                    # (the anchor's gradient node: PipelineFunction's first tensor input)
                    node.register_prehook(_BackwardOnce(self._calls, node.next_functions[0][0]))
            for i, o in zip(idx, outs, strict=True):
                flat[i] = o
        n = cap.n_user_outputs
        if cap.stored:
            cap.store(self.module, flat[n:])
        return pytree.tree_unflatten(flat[:n], cap.out_spec)

    def _capture_base(self, layout: Any) -> tuple[Any, ...]:
        """A call's capture key but for the values its capture read (`_cached`): the input
        signature, the mode and the submodules in the other mode, autocast, the tree's version
        and its hooks (`ModelState.capture_key`). The mode is the wrapped model's own, as DDP
        runs it: `model.module.eval()` switches it too (the wrapper's flag is then set to it)."""
        tree, modes, hooks, dtypes = model_state(self.module).capture_key()
        self.training = self.module.training
        return (layout.signature, self.training, modes, autocast_state(), tree, hooks, dtypes)

    def _changed_reads(self, cache: OrderedDict[tuple[Any, ...], Any], base: tuple[Any, ...],
                       reads_of: Callable[[Any], attributes.Reads]
                       ) -> list[tuple[attributes.Read, Any]]:
        """Where a call keyed `base` captures again although `cache` holds a capture of it: the
        values that capture read and are now other (the most recently used capture's). Counted
        by attribute: one that changes at every step would capture the model at every step,
        which is said once."""
        key = next((k for k in reversed(cache) if k[:-1] == base), None)
        if key is None:
            return []
        changes = reads_of(cache[key]).changed()
        for r, _now in changes:
            n = self._recaptured_for[r.label] = self._recaptured_for.get(r.label, 0) + 1
            if n == RECAPTURES_WARNED and not self._warned_attributes:
                self._warned_attributes = True
                warnings.warn(
                    f"rannc: the model's attribute {r.label} has changed {n} times since it was "
                    "first captured; the captured graph holds it as a constant, so each change "
                    "captures the model again (seconds each, and each new capture is kept up to "
                    "max_captures). If it changes at every step, keep it in a tensor "
                    "(module.register_buffer) or pass it to forward as an input",
                    UserWarning, stacklevel=4)
        return changes

    def _planned_key(self) -> tuple[Any, ...] | None:
        """The capture key of the planned deployment's runtime in `_runtimes`."""
        return next((k for k, r in self._runtimes.items() if r is self._held.runtime), None)

    def _bound_cache(self, cache: OrderedDict[tuple[Any, ...], Any], pinned: Any) -> None:
        """Keep at most config.max_captures captures, dropping the least recently used (never
        `pinned`). Inputs whose shape changes at every call (an unpadded sequence length)
        would otherwise capture again at every call and keep every capture: memory grows
        without bound. Every rank sees the same calls (agree_on_call), so all drop alike."""
        limit = self.rannc_config.max_captures
        if len(cache) > limit and not self._warned_recapture:
            self._warned_recapture = True
            warnings.warn(
                f"rannc: the model was called with {len(cache)} different input signatures "
                "(shapes beyond the batch dim, keyword names, mode); each new one is captured "
                f"again, and only the {limit} most recently used are kept (max_captures). Fix: "
                "pad inputs to a few bucket lengths (e.g. sequence lengths to a multiple of 64: "
                "RaNNCTrainer(pad_to_multiple_of=64) or the data collator's pad_to_multiple_of; "
                "or one maximum length), or raise max_captures if a few more shapes recur",
                UserWarning, stacklevel=4)
        for key in list(cache):
            if len(cache) <= limit:
                break
            if key != pinned:
                del cache[key]
                leftovers.forget(self._leftovers.pop(key, None))

    def write_trace(self, path: str, *, predicted_from: str = "plan") -> list[str]:
        """Write the last iteration's per-rank events (recorded with `config.trace`) as a
        Chrome/Perfetto trace `path + ".json"` and a PNG timeline `path + ".png"`, the
        simulator's prediction for the same plan drawn below (from the plan's cost predictions,
        or `predicted_from="measured"`: from this run's mean action times). Every rank must
        call it (it gathers the events); rank 0 writes and returns the paths."""
        import torch.distributed as dist

        from rannc.schedule import chrome_trace, timeline_png
        from rannc.schedule.predict import measured_costs, plan_costs
        from rannc.schedule.simulate import simulate

        if predicted_from not in ("plan", "measured"):
            raise RaNNCError(f"predicted_from={predicted_from!r}: use 'plan' or 'measured'")
        rt = self._last_rt
        if rt is None or not rt.trace:
            raise RaNNCError("no trace recorded: set config trace=True (or RANNC_TRACE=1) and run "
                             "an iteration (forward and backward) first")
        mine = (rt.rank, ", ".join(map(str, rt.mine)), rt.iteration_s, rt.events)
        every: list[Any] = [None] * rt.world_size
        dist.all_gather_object(every, mine)
        if rt.rank != 0:
            return []
        events = {r: evs for r, _s, _t, evs in every}
        names = {r: f"rank {r} (stage{'s' if ',' in s else ''} {s})" for r, s, _t, _e in every}
        costs = plan_costs(rt.plan) if predicted_from == "plan" else measured_costs(rt.plan, events)
        predicted = simulate(rt.schedule, costs)
        # Each rank's events count from its forward() call, and iteration_s from it to its
        # gradients reduced (0 when no backward ran): the measured panel states the one
        # iteration time, drawn to, rather than the title giving another than the panel.
        iteration = {r: t for r, _s, t, _e in every}
        chrome_trace(events, path + ".json", names=names)
        timeline_png(path + ".png", measured=events, predicted=predicted,
                     measured_iteration=iteration if all(iteration.values()) else None,
                     title=f"schedule {rt.schedule.name}, {len(rt.plan.stages)} stages, "
                           f"{rt.plan.microbatches} microbatches")
        return [path + ".json", path + ".png"]

    # -- what a training script touches ------------------------------------
    def train(self, mode: bool = True) -> RaNNCModule:
        self.training = mode
        self.module.train(mode)
        return self

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        held = None if self._gathering else self._held_ids()
        for n, p in self.module.named_parameters(prefix, recurse, remove_duplicate):
            if held is None or id(p) in held:
                yield n, p

    def _held_ids(self) -> set[int] | None:
        """ids of the parameters this rank holds (None: all, before deployment or in one process)."""
        if not self._runtimes:
            return None
        return {id(p) for rt in self._runtimes.values() for p in rt.held.values()}

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def state_dict(self, *args: Any, rank0_only: bool = True, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The whole model's state dict (parameters and persistent buffers) under its original
        names, tied weights under every name, loadable into the unwrapped model with
        `load_state_dict(strict=True)`.

        After deployment this is a collective: EVERY rank must call it. Each entry comes from a
        rank that holds it (a buffer from a rank of the stage that updates it) and lands, as a CPU
        copy, on rank 0; the other ranks get an empty dict that refuses torch.save and loading
        (`checkpoint.OnRankZero`), or the same dict with `rank0_only=False`.
        Before the first call, and in one process, it is the module's own state_dict() on every
        rank (no communication), and so it is inside `gathered_parameters()` (an EMA updated
        from `model.state_dict()` there sees the whole model on every rank). `keep_vars` has no
        effect after deployment (entries are copies).
        """
        rt = self._last_rt
        if rt is None:
            return self.module.state_dict(*args, **kwargs)
        if self._gathering:  # (inside gathered_parameters(): the whole model is here)
            with ckpt.own_state_dict_reads():
                return self.module.state_dict(*args, **kwargs)
        if rt.world_size > 1 and callers.in_plain_hf_trainer_save():
            raise RaNNCError(
                "transformers.Trainer saves a checkpoint from rank 0 alone, but a deployed "
                "RaNNCModule's state_dict() is a collective every rank must join (each holds only "
                "its stages' parameters): the save would hang. Use rannc.hf.RaNNCTrainer (same "
                "arguments), which gathers on every rank and writes Trainer's usual checkpoint")
        if args:
            raise RaNNCError("after deployment state_dict() takes only keyword arguments "
                             "(destination=, prefix=, keep_vars=, rank0_only=)")
        if rank0_only and rt.world_size > 1 and callers.in_safetensors_load():
            # safetensors' load_model (Accelerate's load_state) reads the model's state_dict()
            # on every rank to find its tied weights before loading: each rank needs the whole
            rank0_only = False
        validate.agree_on_collective("state_dict()", rt.device)
        sd = ckpt.gather_state_dict(self.module, rt, rank0_only, prefix=kwargs.get("prefix", ""))
        destination = kwargs.get("destination")
        if destination is None:
            return sd
        # a parent module collecting its children's entries (a LightningModule's state_dict())
        if not isinstance(sd, ckpt.OnRankZero):
            destination.update(sd)
        else:
            # The parent's dict on this rank would hold the rest of the model without these
            # entries: saved to rank 0's path, it would overwrite the whole checkpoint with a
            # part, without a word. The refusing dict goes in as one entry, so that saving or
            # loading the parent's dict here is refused, naming the fix.
            destination[kwargs.get("prefix", "") + ckpt.GATHERED_ON_RANK_ZERO] = sd
        return cast(dict[str, Any], destination)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,  # type: ignore[override]
                        assign: bool = False) -> Any:
        """Load a full state dict (original names, as `state_dict()` or the unwrapped model's).

        Before the first call it loads into the module as usual. After deployment each rank
        copies the entries it holds (its parameters, the buffers) and ignores the rest; `strict`
        checks the keys against the whole model's. Not a collective: every rank should get the
        same dict (rank 0's gathered one broadcast, or one loaded from a file on every rank).
        """
        ckpt.refuse_rank_zero_only(state_dict)
        if self._last_rt is None:
            return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
        if assign:
            raise RaNNCError("load_state_dict(assign=True) is not supported after deployment: "
                             "ranks hold only their stage's parameters; load before the first call")
        missing, unexpected = ckpt.load_held_state(self.module, self._last_rt, state_dict, strict)
        return _IncompatibleKeys(missing, unexpected)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str,
                              local_metadata: dict[str, Any], strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        """A parent module's load_state_dict (a LightningModule holding the RaNNCModule; what
        its `state_dict()` gave, the entries under `prefix` + their original names): loaded
        as `load_state_dict` loads them (after deployment, each rank its own part). torch
        then visits `self.module` with `prefix + "module."`, under which nothing is, and
        would call every entry missing: `_loaded_through_a_parent` takes those back."""
        ours = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        ckpt.refuse_rank_zero_only(ours.get(ckpt.GATHERED_ON_RANK_ZERO, {}))
        result = self.load_state_dict(ours, strict=False)  # (the parent reports, with `prefix`)
        missing_keys.extend(prefix + k for k in result.missing_keys)
        unexpected_keys.extend(prefix + k for k in result.unexpected_keys)
        self._loading_as = prefix

    def optimizer_state_dict(self, rank0_only: bool = True) -> dict[str, Any]:
        """The optimizer's state for the whole model, keyed by ORIGINAL PARAMETER NAMES:
        `{"state": {name: {"exp_avg": ..., ...}}, "param_groups": [{hyper-parameters...,
        "params": [names]}]}` (the param groups as given to the optimizer, before pruning).

        After deployment EVERY rank must call it (collective); each parameter's state comes
        from a rank holding it and lands on rank 0 (others get an empty dict that refuses
        torch.save and loading; every rank with `rank0_only=False`). Load it with
        `load_optimizer_state_dict()`, also into another plan or number of ranks. The
        optimizer's own `optimizer.state_dict()` is gathered the same way, in torch's layout of
        the optimizer as built (numbered parameters: loadable into the unwrapped optimizer), and
        its `load_state_dict()` of that layout on every rank takes each rank's part
        (`deploy.Holdings._state_dict_hooks`).
        """
        opt = self._need_optimizer()
        groups = self._held.groups(self.module, opt)
        if self._last_rt is not None:
            validate.agree_on_collective("optimizer_state_dict()", self._last_rt.device)
        with self._held.without_placeholder(self.optimizer):
            return ckpt.gather_optimizer_state(self.module, opt, self._last_rt, groups, rank0_only)

    def load_optimizer_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load an `optimizer_state_dict()` (by parameter names) on every rank: each rank takes
        the state of the parameters it holds, and every group's hyper-parameters. Not a
        collective; every rank needs the whole dict. Works before and after the first call."""
        ckpt.refuse_rank_zero_only(state_dict)
        self._held.groups(self.module, self._need_optimizer())  # (prunes groups added since)
        with self._held.without_placeholder(self.optimizer):
            ckpt.load_optimizer_state(self.module, self._need_optimizer(), state_dict,
                                      only=self._held.stepped_names())

    def _need_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise RaNNCError("no optimizer: pass it as RaNNCModule(model, optimizer), or give "
                             "the model one built after wrapping: model.take_optimizer(optimizer)")
        return self.optimizer

    def take_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Make `optimizer`, built after wrapping, the model's, as if it had been passed to
        `RaNNCModule(model, optimizer)`: before the first call the plan counts its state; after
        it (on several ranks) it is pruned to the parameters each rank holds. An optimizer
        built on the model's parameters after wrapping becomes the model's at its first step
        without this call; call it to load its state (`load_checkpoint`,
        `load_optimizer_state_dict`) before that step."""
        if self.optimizer is not None and optimizer in members(self.optimizer):
            return
        if self.optimizer is not None:
            raise RaNNCError(f"take_optimizer: the model has an optimizer already "
                             f"({type(self.optimizer).__name__}); pass every optimizer as a list "
                             "when wrapping: RaNNCModule(model, [opt1, opt2])")
        if not self._called():
            self.optimizer = as_one(optimizer)
            return
        if not self._adopt(optimizer):
            raise RaNNCError(f"take_optimizer: the {type(optimizer).__name__} steps none of the "
                             "model's parameters")

    def _called(self) -> bool:
        """Whether the model was called (captured) since it was wrapped."""
        return bool(self._calls or self._deployments)

    def _adopt(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether `optimizer`, at one of its steps, steps parameters of this model (called at
        least once); one built after wrapping and not passed to RaNNCModule (DDP's habit:
        `model = RaNNCModule(model); opt = AdamW(model.parameters())`) becomes the model's
        optimizer, pruned and checkpointed as if it had been passed (`_late_optimizer_step`).

        Why: such an optimizer trained exactly (the parameters another rank holds have no
        gradient here, and torch's optimizers skip them), but its `state_dict()` held this
        rank's part of its state alone (rank 0 saving it lost the rest: on resume those
        parameters' Adam moments started again from zero, silently), and `save_checkpoint`
        saved no optimizer state (in one process too). Said once at INFO."""
        if not self._called():
            return False
        if self.optimizer is not None and optimizer in members(self.optimizer):
            return True
        names = {id(p): n for n, p in self.module.named_parameters(remove_duplicate=False)}
        if not any(id(p) in names for g in optimizer.param_groups for p in g["params"]):
            return False
        name = type(optimizer).__name__
        if self.optimizer is not None:  # (warned, not refused: it may wrap the one given)
            warnings.warn(
                f"rannc: an optimizer ({name}) that was not passed to RaNNCModule steps "
                f"parameters of the wrapped model, beside the one that was "
                f"({type(self.optimizer).__name__}): rannc prunes, checkpoints and shards the "
                "optimizers it was given alone, so this one's state_dict() holds this rank's "
                "part of its state only. Fix: pass every optimizer, as a list: "
                "RaNNCModule(model, [opt1, opt2])", stacklevel=3)
            return True
        if self._held.released and not any(names.get(id(p)) in self._held.released
                                           for g in optimizer.param_groups for p in g["params"]):
            # Built after the first call, on the parameters this rank holds (what
            # model.parameters() yields once deployed): each rank's covers other parameters, so
            # there is no whole optimizer to gather. (The same on every rank that released any.)
            warnings.warn(
                f"rannc: the {name} was built on the parameters this rank holds, after the "
                "model's first call: each rank's covers other parameters, so its state_dict() "
                "holds this rank's part of its state only, and the model's checkpoints hold "
                "none of it. Fix: build it before the first call (on model.parameters(): every "
                "parameter) and pass it: RaNNCModule(model, optimizer)", stacklevel=3)
            return True
        rt = self._last_rt
        split = rt is not None and rt.world_size > 1
        coupled = _coupling_optimizers(optimizer)
        if coupled and split:
            raise RaNNCError(
                f"{coupled[0]} computes its step from all parameters together, and this rank "
                "holds only some of them: it was built after wrapping, so the plan did not keep "
                "every parameter on every rank. Fix: pass it to RaNNCModule(model, optimizer)")
        self.optimizer = as_one(optimizer)
        if split:
            self._held.release(self.module, self.optimizer, self._runtimes.values(), rt)
        log.info("rannc: the %s built after wrapping steps this model's parameters: it is pruned "
                 "to the parameters each rank holds, and its state_dict() and the model's "
                 "checkpoints hold its whole state, as if it had been passed to RaNNCModule "
                 "(pass it there to have the plan count its state's memory)", name)
        return True

    def save_checkpoint(self, path: str | os.PathLike[str], **stateful: Any) -> None:
        """Save a sharded checkpoint (torch.distributed.checkpoint) into directory `path`:
        every parameter, persistent buffer and optimizer state, keyed by original names, each
        written once by a rank holding it (it loads into any plan or number of ranks), and every
        keyword: an object with `state_dict()`/`load_state_dict()` (torch.distributed.checkpoint's
        `Stateful`: LR scheduler, sampler, `rannc.checkpoint.RNGState()`) or plain data (a step
        number), each rank's own.

        EVERY rank must call it (collective; a rank that goes on without it is an error). Each
        save is a new version `path/v-N`, written aside and published by replacing the pointer
        `path/latest`, so a crash at any moment leaves the previous version loadable;
        `rannc.latest_checkpoint(path)` names the newest complete one. Older versions are removed
        once superseded; files of your own belong beside `latest` (never touched). `path` may
        be a symlink (written through) and must be on a file system every rank sees.
        """
        # No call digest here: rannc.checkpoint registers each rank's arrival itself and names a
        # rank that is elsewhere (or gone) within seconds ("call save_checkpoint on every rank"); a
        # digest all-gather first would meet a departed rank's closed socket instead.
        rdist.init_process_group(self.rannc_config.timeout_s)
        groups = None
        if self.optimizer is not None:
            groups = self._held.groups(self.module, self.optimizer)
        with self._held.without_placeholder(self.optimizer), health.phase("checkpoint write"):
            ckpt.save_checkpoint(self.module, self.optimizer, self._last_rt, groups, path, stateful)

    def load_checkpoint(self, path: str | os.PathLike[str], *, strict: bool = True,
                        **stateful: Any) -> dict[str, Any]:
        """Load the latest complete version saved by `save_checkpoint()` into `path` (by any
        plan or number of ranks): every rank reads the parameters it holds, the buffers, its
        optimizer state and the keywords' states (a Stateful is loaded in place; pass a plain
        value's placeholder, e.g. `step=0`, and read it from the returned dict). EVERY rank must
        call it (collective); before the first call, each rank reads the whole model.

        Like `load_state_dict(strict=True)`, a checkpoint whose model entries differ from the
        model's, or that lacks a keyword, is an error naming them; `strict=False` loads what
        both have. A file whose checksum differs from the saved one is an error naming it.
        """
        # No call digest here: rannc.checkpoint registers each rank's arrival itself and names a
        # rank that is elsewhere (or gone) within seconds ("call load_checkpoint on every rank"); a
        # digest all-gather first would meet a departed rank's closed socket instead.
        rdist.init_process_group(self.rannc_config.timeout_s)
        if self.optimizer is not None:
            self._held.groups(self.module, self.optimizer)  # (prunes groups added since)
        with self._held.without_placeholder(self.optimizer), health.phase("checkpoint read"):
            return ckpt.load_checkpoint(self.module, self.optimizer, self._last_rt, path, strict,
                                        stateful)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """Clip the gradients of all the model's parameters by their global norm; return that
        norm (the same tensor value on every rank).

        The result is what `torch.nn.utils.clip_grad_norm_(m.parameters(), ...)` gives on the
        unwrapped model `m` after the same backward: every parameter counts once (replicas of a
        stage and weights tied between stages included), `norm_type` may be any p (`inf` too),
        and every rank scales its held gradients by `min(max_norm / (norm + 1e-6), 1)`.

        Collective once deployed on several ranks: every rank must call it, after the
        synchronised backward (not inside `no_sync()`, whose gradients are still local).
        `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` calls this method (see
        `rannc.clip`). Before the first call, or in one process, it is torch's function.
        """
        rt = self._last_rt
        if rt is None:
            return rclip.torch_clip_grad_norm_(self.module.parameters(), max_norm, norm_type,
                                               error_if_nonfinite, foreach)
        self._accumulation.reconcile(rt.held)  # (sums a zero_grad() gave up are no longer pending)
        if self._accumulation.pending:  # local sums awaiting a reduce
            raise RaNNCError("clip_grad_norm_ after a backward under no_sync(): the gradients are "
                             "not yet summed over ranks. Clip after the last (synchronised) "
                             "backward of the accumulation, outside no_sync()")
        validate.agree_on_collective("clip_grad_norm_()", rt.device)
        if self._owned is None:
            self._owned = rclip.owned_parameters(self.module, rt.owners, rt.held, rt.rank)
        held = list({id(p): p for p in rt.held.values()}.values())
        dtype = held[0].dtype if held else torch.get_default_dtype()
        grads = [p.grad for p in self._owned if p.grad is not None]
        total = rclip.global_norm(grads, norm_type, device=rt.device, dtype=dtype)
        if error_if_nonfinite:
            rclip.check_finite(total, norm_type)
        torch.nn.utils.clip_grads_with_norm_(held, max_norm, total, foreach)
        return total

    def _parameter_set_match(self, ids: set[int]) -> bool:
        """Whether `ids` are this deployed module's parameters, the held ones or all; raises when
        they are only some of them (a local norm over them would be silently wrong)."""
        if self._last_rt is None:
            return False
        held = self._held_ids() or set()
        every = {id(p) for p in self.module.parameters()}
        if ids in (held, every):
            return True
        if ids & every:
            raise RaNNCError(
                f"torch.nn.utils.clip_grad_norm_ was given {len(ids & held)} of the "
                f"{len(held)} parameters this rank holds of a RaNNCModule (plus "
                f"{len(ids - held)} others); a norm over them would be local to this rank. Pass "
                "model.parameters() (all of them), or call model.clip_grad_norm_(max_norm) on "
                "every rank")
        return False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation, as `DistributedDataParallel.no_sync`: backward passes inside
        keep their gradients local (added into `.grad`), and the next backward outside sums the
        whole accumulation over the ranks holding each parameter (stage replicas, tied copies).

        Every rank must run the same calls inside it. Like DDP users, scale each micro-step's
        loss (`(loss / k).backward()` for k steps) to get the gradient of the mean loss over
        the k batches; clip (`clip_grad_norm_`) and step after the last, synchronised backward.
        """
        prev, self._sync = self._sync, False
        for rt in self._runtimes.values():
            rt.sync = False
        try:
            yield
        finally:
            self._sync = prev
            for rt in self._runtimes.values():
                rt.sync = prev

    @contextlib.contextmanager
    def gathered_parameters(self, modifier_rank: int | None = None) -> Iterator[None]:
        """A block in which every parameter and buffer of the model has its whole current value
        on this rank, as DeepSpeed's `GatheredParameters` gives under ZeRO-3; `parameters()`
        lists them all. For code that reads or writes every parameter on every rank:

            with model.gathered_parameters():              # an EMA of the weights
                ema.update_parameters(model)               # torch.optim.swa_utils.AveragedModel
            with model.gathered_parameters(modifier_rank=0):
                model.module.classifier.apply(init)        # re-initialise layers after wrapping

        Collective once deployed on several ranks: EVERY rank must enter it. When it ends the
        parameters this rank does not hold are freed again. With `modifier_rank=r`, rank r's
        values of every parameter and buffer then reach every rank (run the same writes on
        every rank from the same seed, and the result equals the unwrapped model's; the
        optimizer state is kept). Without it the block must not write into parameters: a write
        raises on every rank when the block ends. The whole model is in this rank's memory for
        the block. Before the first call, and in one process, every parameter is already here
        and the block runs as it is.
        """
        check_modifier(modifier_rank, rdist.get_world_size())
        rt = self._last_rt
        if rt is None or rt.world_size < 2:
            yield
            return
        validate.agree_on_collective(f"gathered_parameters(modifier_rank={modifier_rank})",
                                     rt.device)
        self._gathering += 1
        try:
            with health.phase("gathered_parameters", self._calls), \
                    gathered(self.module, rt, self._held.released, modifier_rank):
                yield
        finally:
            self._gathering -= 1
            self._held.note_versions(self.module)

    def extra_repr(self) -> str:
        return f"module={type(self.module).__name__}, deployments={len(self._deployments)}"


class _BackwardOnce:
    """A pre-hook on the pipeline's backward node: the pipeline's backward runs once per
    forward (its stages freed their activations and gradients were all-reduced), so a second
    backward through the same outputs (`retain_graph=True`) is refused before any rank sends
    anything. Every rank makes the same calls, so every rank raises alike. A backward the
    pipeline cannot run as the unwrapped model would (`check_whole_backward`) is refused first,
    and does not count."""

    def __init__(self, step: int, anchor: Any) -> None:
        self.step = step
        self.anchor = anchor
        self.calls = 0

    def __call__(self, grads: Any) -> None:
        check_whole_backward(self.anchor)
        self.calls += 1
        if self.calls > 1:
            raise RaNNCError(
                f"backward() through the outputs of step {self.step} a second time "
                "(retain_graph=True): the pipelined model runs its backward once per forward, "
                "across ranks. Fix: add the losses and call backward() once "
                "((loss_a + loss_b).backward()), or call the model again for another backward")


def _loaded_through_a_parent(model: nn.Module, keys: _IncompatibleKeys) -> None:
    """After a parent's load_state_dict visited a RaNNCModule (`_load_from_state_dict`): the
    wrapped module's entries, which torch looked for under `<prefix>module.` and called
    missing, were loaded under `<prefix>`; take them out of the missing keys."""
    if not isinstance(model, RaNNCModule) or model._loading_as is None:
        return
    prefix, model._loading_as = model._loading_as, None
    inner = prefix + "module."
    keys.missing_keys[:] = [k for k in keys.missing_keys if not k.startswith(inner)]


def _generate_refused(model_name: str, *args: Any, **kwargs: Any) -> Any:
    """`model.generate(...)` on a rank that holds only some stages: the wrapped model's own
    generate runs its own forward, which reads parameters released on this rank (it failed
    with a size mismatch deep inside a layer)."""
    raise RaNNCError(
        f"{model_name}.generate() after rannc deployed the model on several ranks: generation "
        "runs the model's own forward, one token at a time with its key/value cache, and this "
        "rank holds only its stages' parameters (the others are released here). Fix: "
        "gather the model and generate from an unwrapped copy: `sd = model.state_dict()` on "
        "every rank, then on rank 0 `copy.load_state_dict(sd)` into a model built as the "
        "original (e.g. from its config) and `copy.generate(...)`")


def _forget_leftovers(kept: dict[tuple[Any, ...], leftovers.Leftovers]) -> None:
    leftovers.forget_all(kept.values())


def _seed_at_deployment(config: Config) -> None:
    """Config.seed: the same torch RNG state on every rank from the first step on, after
    planning (which may draw random numbers on rank 0 alone, when it measures)."""
    if config.seed is not None:
        torch.manual_seed(config.seed)


_NO_OUTER_COMPILE = (
    "torch.compile(RaNNCModule(...)) is not supported: Dynamo cannot trace rannc's capture, "
    "planning and communication. Compile the stages instead: RaNNCModule(model, opt, "
    "compile=True) (or RANNC_COMPILE=1) runs torch.compile on each stage's graph.")


def _compile_stage(gm: fx.GraphModule) -> Any:
    """torch.compile one stage's module (Config.compile): the captured ATen graph rannc runs,
    which Dynamo traces without the wrapper's Python (planning, collectives) in the way. A
    model's own autograd.Functions run eagerly between the compiled pieces (their backward is
    Python that the compiled graph's autograd would not call)."""
    from rannc.graph.functions import eager_in_compile

    return torch.compile(eager_in_compile(gm))


def _show_plan(plan: Plan) -> None:
    """The plan table, once, on rank 0: in the log when rannc's logger shows INFO, else on
    stderr (under torchrun or mpiexec nothing configures logging, and the table is what a user
    checks first)."""
    if log.isEnabledFor(logging.INFO):
        log.info("%s", plan.summary())
    else:
        print(plan.summary(), file=sys.stderr, flush=True)


# torch's optimizers whose step couples every parameter: LBFGS's directions and line search are
# dot products and norms over the concatenation of all its parameters' gradients.
_COUPLING_OPTIMIZERS = (torch.optim.LBFGS,)


# Every RaNNCModule, for `_late_optimizer_step`; the optimizers it has looked at, with the
# number of called modules it looked at them against (a module called since: look again).
_WRAPPERS: weakref.WeakSet[RaNNCModule] = weakref.WeakSet()
_LOOKED_AT: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
_LATE_HOOK: list[Any] = []


def _watch_late_optimizers(module: RaNNCModule) -> None:
    """Look at every optimizer's steps (torch's global step pre-hook, registered once) for one
    built over a called module's parameters after wrapping (`RaNNCModule._adopt`)."""
    _WRAPPERS.add(module)
    if not _LATE_HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _LATE_HOOK.append(register_optimizer_step_pre_hook(_late_optimizer_step))


def _late_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    called = [m for m in list(_WRAPPERS) if m._called()]
    if _LOOKED_AT.get(optimizer) == len(called):  # (one lookup a step, once looked at)
        return
    for m in called:
        if m._adopt(optimizer):
            break
    _LOOKED_AT[optimizer] = len(called)


def _coupling_optimizers(optimizer: torch.optim.Optimizer | None) -> list[str]:
    return [type(o).__name__ for o in members(optimizer) if isinstance(o, _COUPLING_OPTIMIZERS)]


def _forced_split(cfg: Config) -> str:
    """The settings that force a rank to hold only part of the parameters or of their state."""
    forced = []
    if cfg.partition_num is not None and cfg.partition_num > 1:
        forced.append(f"partition_num={cfg.partition_num}")
    if cfg.replicas is not None and len(cfg.replicas) > 1:
        forced.append(f"replicas={cfg.replicas}")
    if cfg.zero_stage == 1:
        forced.append("zero_stage=1")
    return ", ".join(forced)


def _coupled_text(coupled: list[str], how: str) -> str:
    return (f"the optimizer {', '.join(sorted(set(coupled)))} computes its step from every "
            "parameter together (its directions and line search are dot products over all of "
            f"them), but {how} has each rank hold or step only part of them, so every rank "
            "would step its own part on its own and silently differ from the unwrapped model. "
            "Fix: leave partition_num, replicas and zero_stage unforced (rannc then plans one "
            "stage, data parallel, for it, exact), or use an optimizer that steps each "
            "parameter on its own (SGD, Adam, AdamW, ...)")


def _sync_for_sync_batch_norm(model: nn.Module, cfg: Config) -> Config:
    """A model holding `nn.SyncBatchNorm` (converted for DDP, as detection and segmentation
    recipes do) asks for statistics over every replica's rows: `batchnorm="sync"`, which is
    exactly the BatchNorm of the unwrapped model on the global batch (said once, at INFO)."""
    if cfg.batchnorm == "sync" or not any(isinstance(m, nn.SyncBatchNorm) for m in model.modules()):
        return cfg
    log.info("rannc: the model holds nn.SyncBatchNorm: batchnorm='sync' (statistics over the "
             "global batch, as SyncBatchNorm under DDP), in place of %r", cfg.batchnorm)
    return dataclasses.replace(cfg, batchnorm="sync")


def _refuse_lazy(model: nn.Module) -> None:
    """torch's lazy modules (nn.LazyLinear, nn.LazyConv2d, ...) hold uninitialized parameters
    until their first call sets their shapes. rannc captures and partitions the model by its
    parameters' shapes, and an optimizer built before that call holds parameters that are
    replaced (torch.export failed with "Attempted to use an uninitialized parameter" and the
    advice for control flow). Refused on every rank, as DistributedDataParallel refuses them."""
    lazy = [(name or "<root>", type(m).__name__) for name, m in model.named_modules()
            if any(nn.parameter.is_lazy(t) for t in itertools.chain(
                m.parameters(recurse=False), m.buffers(recurse=False)))]
    if lazy:
        more = f" and {len(lazy) - 3} more" if len(lazy) > 3 else ""
        raise CaptureError(
            f"module(s) {', '.join(f'{n!r} ({c})' for n, c in lazy[:3])}{more} still hold "
            "uninitialized parameters: torch's lazy modules set their shapes at their first "
            "call, and rannc captures and partitions the model by its parameters' shapes. Fix: "
            "call the model once on a sample batch before wrapping it (`with torch.no_grad(): "
            "model(**batch)`), then build the optimizer and wrap the model, as "
            "DistributedDataParallel requires")


def _count_as_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face's `num_items_in_batch` as a 0-dim tensor on the inputs' device: a Python
    number would be baked into the captured graph (a capture per distinct count), and the
    runtime finds the scalar outputs divided by it (`PipelineRuntime._summed_outputs`)."""
    x = kwargs.get(COUNT_KWARG)
    if isinstance(x, torch.Tensor) and x.numel() == 1 and x.dim() > 0:
        return {**kwargs, COUNT_KWARG: x.reshape(())}
    if not isinstance(x, int | float) or isinstance(x, bool):
        return kwargs
    device = next((t.device for t in pytree.tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor)), None)
    return {**kwargs, COUNT_KWARG: torch.tensor(x, device=device)}


def _cached(cache: OrderedDict[tuple[Any, ...], Any], base: tuple[Any, ...],
            reads_of: Callable[[Any], attributes.Reads],
            fits: Callable[[Any], bool] = lambda entry: True) -> tuple[Any, ...] | None:
    """The key of the capture in `cache` for a call keyed `base` whose Python values read
    still hold (`graph/attributes.py`) and that `fits` the call, the most recently used first;
    None: capture again. (A key is `base`, then the values its capture read and the batch
    rows it holds for: captures of one input signature with other values, e.g. a dropout's p
    set back, or of a model branching on the batch size, stay cached beside each other.)"""
    for key in reversed(cache):
        if key[:-1] == base and reads_of(cache[key]).hold() and fits(cache[key]):
            return key
    return None


def _pieces_within(cfg: Config, cap: CapturedModel, n_rows: int) -> Config:
    """The planning configuration with enough microbatches that every piece of a global batch
    of `n_rows` rows stays within the rows `cap`'s graph holds for, where the model's code
    branches on the batch size (`CapturedModel.batch_rows`; the runtime checks every call's
    pieces). Sufficient whatever the replicas: a piece holds at most a microbatch's rows."""
    need = cap.microbatches_for(n_rows)
    if need == 1:
        return cfg
    if cfg.microbatches is not None:
        if cfg.microbatches < need:
            raise ConfigError(
                f"the model's code branches on the batch size ({cap.rows_site}), and rannc's graph "
                f"holds the branch for {cap.rows_text()} rows; microbatches="
                f"{cfg.microbatches} would run the global batch of {n_rows} rows in pieces of up "
                f"to {-(-n_rows // cfg.microbatches)} rows. Fix: microbatches={need} or more, or "
                "leave microbatches unset (the planner then takes enough)")
        return cfg
    return dataclasses.replace(cfg, min_pipeline=max(cfg.min_pipeline, need),
                               max_pipeline=max(cfg.max_pipeline, need))


def _other_rows(cache: OrderedDict[tuple[Any, ...], Any], base: tuple[Any, ...],
                captured: Callable[[Any], CapturedModel], rows: int) -> str:
    """Why a call of `rows` rows captures again where a capture of its signature holds for
    other batch sizes only (the model's code branches on the batch size), or ''."""
    key = _cached(cache, base, lambda entry: captured(entry).reads)
    cap = captured(cache[key]) if key is not None else None
    if cap is None or cap.fits(rows):
        return ""
    return (f"a batch of {rows} rows, for which the model's code takes another branch than for "
            f"the {cap.rows_text()} rows captured ({cap.rows_site})")


# what each part of `_capture_base` is, for `_why_again`
_BASE_PARTS = ("input signature", "mode (train/eval)", "submodules in the other mode",
               "autocast", "module tree (a module, parameter or buffer added, removed or replaced)",
               "hooks (a forward or backward hook added or removed)",
               "parameter or buffer dtypes (e.g. model.half() or a module's .to(dtype))")


def _why_again(changes: list[tuple[attributes.Read, Any]],
               cache: OrderedDict[tuple[Any, ...], Any], base: tuple[Any, ...]) -> str:
    if changes:
        return ("the model's attributes changed since it was captured "
                f"({attributes.describe(changes)})")
    last = next(reversed(cache), None)
    if last is None:
        return "new input signature"
    differ = [what for what, a, b in zip(_BASE_PARTS, last[:-1], base, strict=True) if a != b]
    return "new " + ", ".join(differ or ["input signature"])


def _tree_text(base: tuple[Any, ...]) -> str:
    """The module tree's version and hooks, part of a call's mode (see `_forward_distributed`):
    a rank that swapped a module or added a hook captures again, so ranks must agree on them.
    (Hooks by module and count: their ids are each process's own.)"""
    tree, hooks, dtypes = base[4], base[5], base[6]
    text = f", module tree changed {tree} times" if tree else ""
    text += _dtypes_text(dtypes)
    if hooks:
        shown = [f"{table.strip('_').replace('_', ' ')} on '{path or '(the model)'}' ({len(ids)})"
                 for path, table, ids in hooks[:3]]
        more = f" and {len(hooks) - 3} more" if len(hooks) > 3 else ""
        text += ", hooks: " + ", ".join(shown) + more
    return text


@functools.lru_cache(maxsize=64)
def _dtypes_text(dtypes: tuple[tuple[str, torch.dtype], ...]) -> str:
    """The parameters' and buffers' dtypes (`ModelState.dtypes`), part of a call's mode: the
    first runs by name and a checksum of all of them."""
    if not dtypes:
        return ""
    shown = ", ".join(f"{str(dt).replace('torch.', '')} from '{name}'" for name, dt in dtypes[:3])
    more = f" and {len(dtypes) - 3} more runs" if len(dtypes) > 3 else ""
    return f", dtypes {shown}{more} ({zlib.crc32(repr(dtypes).encode()):08x})"


def _reads_text(reads: attributes.Reads | None,
                changes: list[tuple[attributes.Read, Any]]) -> str:
    """The attribute values a call runs with, part of its mode (see `_forward_distributed`)."""
    if reads is not None:
        return f", attributes as captured ({reads.digest})" if reads.reads else ""
    if changes:
        return f", attributes changed since captured ({attributes.describe(changes)})"
    return ""


def _grad_inputs_text(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The inputs requiring grad, part of the call mode every rank must agree on: the ranks
    that compute an input's gradients send each owner its rows' part, and the owners wait."""
    if not torch.is_grad_enabled():
        return ""
    tree = (tuple(args), {k: kwargs[k] for k in sorted(kwargs)})
    named = pytree.tree_flatten_with_path(tree)[0]
    want = [pytree.keystr(path) for path, x in named
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad]
    return f", inputs requiring grad {want}" if want else ""
