"""Deployment: what a RaNNCModule's first call does before anything runs, for one process or
many alike: capture the model, plan it (or load a saved plan) and give every rank the same
plan, then release the parameters this rank does not hold.

- `capture_signature`: torch.export and phase 1, for a new input signature;
- `deployment_plan`: in one process the whole model as one stage (`single_process_plan`:
  nothing to choose); on several ranks rank 0 reads the saved plan or plans for the cluster
  the ranks report, and broadcasts it (an error on rank 0 is raised on every rank, so none
  waits);
- `Holdings`: after a plan is deployed, what this rank holds of the user's model and
  optimizer: the parameters it released (and how to give them their shapes back for a
  capture), the optimizer's pruned param groups, the stand-in parameter of a rank that holds
  none, and under ZeRO-1 the hooks around the optimizer's step;
- `host_malloc`: `Config.host_malloc` for this rank's stage (`rannc.hostmem`), once.

`rannc.module` is the facade that calls these; the runtime is `rannc.pipeline`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rannc import checkpoint as ckpt
from rannc import dist as rdist
from rannc import health, hostmem, optimizers, validate
from rannc.atomic.components import AtomicPartition, atomic_components
from rannc.config import Config
from rannc.errors import ConfigError, RaNNCError
from rannc.graph.capture import CapturedModel, capture
from rannc.graph.model_state import model_state
from rannc.ownership import parameter_owners
from rannc.plans import Plan, StagePlan
from rannc.progress import Progress
from rannc.schedule.spec import require_runs

log = logging.getLogger(__name__)


def capture_signature(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                      progress: Progress, small_pieces: bool = False
                      ) -> tuple[CapturedModel, AtomicPartition]:
    """The captured graph of `module(*args, **kwargs)` and its atomic components (phase 1);
    `small_pieces`: for a pipeline (see `capture`)."""
    with progress.phase("capture"):
        cap = capture(module, args, kwargs, small_pieces=small_pieces)
    with progress.phase("atomic components"):
        atomic = atomic_components(cap.graph)
    return cap, atomic


def deployment_plan(cfg: Config, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                    cap: CapturedModel, atomic: AtomicPartition, ctx: rdist.DistContext | None,
                    leaves: list[Any], sizes: list[int], progress: Progress) -> Plan:
    """The plan every rank deploys (`ctx` None: one process, whose plan is the whole model as
    one stage). On several ranks: the saved plan, or one made on rank 0 for this world, and
    broadcast (one plan for all ranks even though each measures its own device).

    Only rank 0 reads a saved plan: on several nodes the file may exist on rank 0's disk
    alone, or an older copy on another node's, and ranks that each read their own would
    wait for different plans."""
    from rannc.planner import single_process_plan

    if ctx is None or ctx.world_size == 1:
        return single_process_plan(cap.graph, atomic, sum(sizes))
    require_runs(cfg.schedule)  # every rank alike, before any of them plans
    loaded = _load_on_rank0(cfg, cap, atomic, ctx, sizes)
    if loaded is not None:
        return loaded
    plan = _plan_on_rank0(cfg, module, optimizer, cap, atomic, ctx, leaves, sizes, progress)
    if cfg.save_deployment and ctx.rank == 0:
        plan.save(cfg.deployment_file)
    return plan


def _load_on_rank0(cfg: Config, cap: CapturedModel, atomic: AtomicPartition,
                   ctx: rdist.DistContext, sizes: list[int]) -> Plan | None:
    """The saved plan (load_deployment), read on rank 0 and broadcast, checked on every rank
    against this model and world; None when there is none to load."""
    import torch.distributed as dist

    if not cfg.load_deployment:
        return None
    source = f"the plan file {cfg.deployment_file}"
    loaded: list[Any] = [None]
    if ctx.rank == 0 and os.path.exists(cfg.deployment_file):
        try:
            loaded[0] = Plan.load(cfg.deployment_file).to_dict()
        except Exception as e:  # noqa: BLE001 - every rank raises it, none waits
            loaded[0] = {"error": f"{type(e).__name__}: {e}. Fix: delete the file, or "
                                  "load_deployment=False to plan again",
                         "type": type(e).__name__, "where": f"reading {source}"}
    dist.broadcast_object_list(loaded, src=0)
    if loaded[0] is None:
        return None
    if "error" in loaded[0]:
        raise validate.rebuild_error(loaded[0])
    plan = Plan.from_dict(loaded[0])
    plan.check(cap.graph, ctx.world_size, source=source, atomic=atomic, batch_rows=sum(sizes))
    require_runs(plan.schedule)
    return dataclasses.replace(plan, source=(cap.graph, atomic))


def _plan_on_rank0(cfg: Config, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                   cap: CapturedModel, atomic: AtomicPartition, ctx: rdist.DistContext,
                   leaves: list[Any], sizes: list[int], progress: Progress) -> Plan:
    """Plan on rank 0 for the devices every rank reports (or the cluster file's), broadcast."""
    import torch.distributed as dist

    from rannc.planner import plan_graph
    from rannc.profile.choice import make_oracle
    from rannc.profile.device import measure_local_device
    from rannc.profile.estimate import GraphCosts, runs_fused_kernels

    # Every rank reports its own device (a mixed cluster is planned as such), unless the
    # user described the cluster in a file.
    reports: list[Any] = [None] * ctx.world_size
    mine = None if cfg.cluster_file else dataclasses.asdict(measure_local_device())
    dist.all_gather_object(reports, mine)
    box: list[Any] = [None]
    if ctx.rank == 0:
        if cfg.opt_param_factor is None and optimizer is not None:
            cfg = Config.resolve(cfg, environ={}, opt_param_factor=optimizer_state_factor(optimizer))
        try:
            cluster = cluster_of(cfg, ctx, reports)
            costs = GraphCosts.of(cap.graph, atomic, fused=runs_fused_kernels(cluster))
            oracle = make_oracle(cfg, cap, atomic, module, leaves, costs, cluster, progress=progress)
            box[0] = plan_graph(cap.graph, atomic, cluster, cfg, batch_size=sum(sizes),
                                oracle=oracle, costs=costs, progress=progress).to_dict()
        except RaNNCError as e:  # every rank raises it, none waits for a plan
            box[0] = {"error": str(e), "type": type(e).__name__,
                      "needed_bytes": getattr(e, "needed_bytes", None)}
    dist.broadcast_object_list(box, src=0)
    if "error" in box[0]:
        raise validate.rebuild_error(box[0])
    return dataclasses.replace(Plan.from_dict(box[0]), source=(cap.graph, atomic))


@dataclass
class OneProcess:
    """One process's deployment of a captured signature: the whole graph as one stage module
    (torch.compile'd with Config.compile), run in this process without a pipeline."""

    captured: CapturedModel
    atomic: AtomicPartition
    stages: list[Any]  # rannc.graph.extract.StageGraph
    modules: list[Any]  # fx.GraphModule, or its torch.compile'd wrapper

    @classmethod
    def of(cls, cap: CapturedModel, atomic: AtomicPartition,
           wrap: Callable[[Any], Any] | None = None) -> OneProcess:
        from rannc.graph.extract import build_stage_module, split_graph

        stages = split_graph(cap.graph, atomic, [list(range(len(atomic.components)))])
        modules: list[Any] = [build_stage_module(cap.gm, cap.graph, s) for s in stages]
        if wrap is not None:
            modules = [wrap(m) for m in modules]
        return cls(cap, atomic, stages, modules)


def cluster_of(cfg: Config, ctx: rdist.DistContext, reports: list[Any]) -> Any:
    """The cluster to plan for: the cluster file's, or the devices the ranks reported."""
    from rannc.profile.device import Cluster, DeviceSpec

    if not cfg.cluster_file:
        return Cluster.from_reports([DeviceSpec(**d) for d in reports],
                                    per_node=ctx.local_world_size)
    cluster = Cluster.load(cfg.cluster_file)
    if cluster.size != ctx.world_size:
        raise ConfigError(f"the cluster file {cfg.cluster_file} describes {cluster.size} "
                          f"devices but {ctx.world_size} ranks run; describe one per rank")
    return cluster


@dataclass
class Holdings:
    """What this rank holds of the user's model and optimizer once a plan is deployed.

    `runtime` is the planned deployment's runtime (a `rannc.pipeline.runtime.PipelineRuntime`):
    the parameters this rank holds are its stage's (a plan derived for another input signature
    holds a subset of them), and its `owners` (rannc.ownership) say which holder's copy counts
    once. `step` names the training step in failure reports."""

    step: Callable[[], int] = lambda: 0
    released: dict[str, torch.Size] = field(default_factory=dict)  # names freed: their shapes
    placeholder: nn.Parameter | None = None  # the optimizer's stand-in on a rank holding none
    # (SparseAdam's: it steps sparse gradients only, so its stand-in has a sparse one)
    sparse_placeholder: nn.Parameter | None = None
    owners: dict[str, int] | None = None  # first name -> owning rank, of the planned deployment
    runtime: Any = None
    # per optimizer (an OptimizerSet's each), its groups' parameter names before pruning
    opt_groups: list[list[list[str]]] | None = None
    set_aside: list[tuple[nn.Parameter, torch.Tensor | None]] = field(default_factory=list)
    # the released parameters and their version counters when last released (`written`)
    versions: list[tuple[str, nn.Parameter, int]] = field(default_factory=list)

    def release(self, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                runtimes: Iterable[Any], rt: Any) -> None:
        """Free the parameters this rank does not hold (over every deployed signature's
        runtime in `runtimes`, `rt` the newest) and stop the optimizer stepping them.

        A parameter that no stage reads stays on every rank (state_dict() still has it)."""
        runtimes = list(runtimes)
        if self.owners is None:  # the planned deployment, before anything is released
            self.owners = parameter_owners(module, rt.plan, rt.rank)
            self.runtime = rt
            rt.owners = self.owners
        held = {id(p) for r in runtimes for p in r.held.values()}
        params = dict(module.named_parameters(remove_duplicate=False))
        read = {id(params[n]) for r in runtimes for n in r.plan.holders()}
        released = []
        for n, p in params.items():
            if id(p) in read and id(p) not in held and p.numel():
                self.released[n] = p.shape
                released.append(p)
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                p.grad = None
                ckpt.refuse_copies(n, p, rt.rank)
        if optimizer is not None:
            if self.opt_groups is None:  # the names before pruning, for optimizer_state_dict()
                # (the first release with an optimizer: the planned deployment's, or a later one
                # for an optimizer built after wrapping, `RaNNCModule._adopt`)
                self.opt_groups = [ckpt.group_names(module, o) for o in optimizers.members(optimizer)]
                self._state_dict_hooks(module, optimizer)
                if self.runtime.plan.zero_stage:
                    self._zero_hooks(optimizer)
            for p in released + (rt.not_stepped() if rt is self.runtime else []):
                optimizer.state.pop(p, None)  # (ZeRO-1: state another holder keeps)
            for group in optimizer.param_groups:
                _prune(group, [id(p) not in read or id(p) in held for p in group["params"]])
            for opt in optimizers.members(optimizer):
                if any(g["params"] for g in opt.param_groups):
                    continue
                # A rank holding none of an optimizer's parameters still runs the user's step of
                # it; a GradScaler needs a gradient to check there. The stand-in has gradient 0
                # (inf when another rank overflowed), so stepping it changes nothing that matters.
                if isinstance(opt, torch.optim.SparseAdam):
                    if self.sparse_placeholder is None:
                        self.sparse_placeholder = nn.Parameter(torch.zeros(1, device=rt.device))
                    opt.param_groups[0]["params"] = [self.sparse_placeholder]
                    continue
                if self.placeholder is None:
                    self.placeholder = nn.Parameter(torch.zeros(1, device=rt.device))
                opt.param_groups[0]["params"] = [self.placeholder]
        for r in runtimes:
            r.placeholder = self.placeholder
            r.sparse_placeholder = self.sparse_placeholder
            r.owners = self.owners
        self.note_versions(module)
        if released:
            ckpt.refuse_partial_reads(module, self.released, rt.rank)
            name = next(iter(self.released))
            with model_state(module).own_handles():
                ckpt.refuse_direct_calls(module, name, params[name], rt.rank)
            return_freed_heap()

    def groups(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
        """The names of each of the optimizer's param groups as the user gave them (before
        pruning). A group added after deployment (`optimizer.add_param_group`: layers unfrozen
        part-way through a fine-tuning) is recorded here and pruned as the first ones were: the
        parameters this rank released leave it, so its state dicts and checkpoints keep naming
        the whole model's parameters and loading puts no state on a released one."""
        if self.opt_groups is None:  # (nothing released yet)
            return ckpt.group_names(module, optimizer)
        # (by position: add_param_group appends, and load_state_dict keeps the groups' order)
        for opt, named in zip(optimizers.members(optimizer), self.opt_groups, strict=True):
            if len(opt.param_groups) == len(named):
                continue
            if len(opt.param_groups) < len(named):
                raise RaNNCError(
                    f"the optimizer {type(opt).__name__} has {len(opt.param_groups)} param "
                    f"group(s), {len(named)} when the model was deployed: rannc keeps each "
                    "group's parameter names by position. Fix: add param groups "
                    "(optimizer.add_param_group) instead of removing them")
            added = opt.param_groups[len(named):]
            params = dict(module.named_parameters(remove_duplicate=False))
            released = {id(params[n]) for n in self.released}
            named.extend(ckpt.group_names(module, opt, added))
            for group in added:
                _prune(group, [id(p) not in released for p in group["params"]])
        return [names for named in self.opt_groups for names in named]

    def _state_dict_hooks(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """torch's own `optimizer.state_dict()` / `load_state_dict()` of each optimizer, once its
        parameters are spread over the ranks, in the unwrapped optimizer's layout.

        Why: each rank's optimizer steps only the parameters it holds, so its own state dict
        covered those alone, numbered over its pruned groups. The common checkpoint
        (`if rank == 0: torch.save({"model": model.state_dict(), "optimizer":
        optimizer.state_dict()}, path)`: torchrun's, Accelerate's and Lightning's pattern) saved
        rank 0's part of the optimizer and lost the rest without a word; loading it back failed
        on torch's group sizes or, where two ranks' stages were alike, gave one rank another
        rank's moments. Now, as `model.state_dict()`: `state_dict()` is a collective every rank
        calls, the whole optimizer's state lands on rank 0 in the layout of the optimizer as the
        user built it (loadable into the unwrapped optimizer; the other ranks get a dict that
        refuses saving and loading, naming the fix), and `load_state_dict()` of that layout,
        on every rank, takes each rank's part. A dict in this rank's pruned layout (rannc's own
        loads, a file saved per rank) is loaded as it is."""
        me, mod, whole = weakref.ref(self), weakref.ref(module), weakref.ref(optimizer)

        def deployed() -> tuple[Holdings, nn.Module, Any] | None:
            h, m, opt = me(), mod(), whole()
            if h is None or m is None or opt is None or h.runtime is None \
                    or h.runtime.world_size < 2:
                return None
            h.groups(m, opt)  # (records a param group added since deployment)
            return h, m, opt

        def gathered(opt: torch.optim.Optimizer, state_dict: dict[str, Any],
                     k: int) -> dict[str, Any] | None:
            here = deployed()
            if here is None or ckpt.reading_own():  # (save_checkpoint's keywords: per rank)
                return None
            h, m, _ = here
            validate.agree_on_collective(ckpt.OPTIMIZER_STATE_DICT, h.runtime.device)
            assert h.opt_groups is not None
            by_name = ckpt.gather_optimizer_state(m, opt, h.runtime, h.opt_groups[k], rank0_only=True)
            if isinstance(by_name, ckpt.OnRankZero):
                return ckpt.OnRankZero(ckpt.OPTIMIZER_STATE_DICT, by_name.rank)
            return ckpt.to_torch_layout(by_name)

        def scattered(opt: torch.optim.Optimizer, state_dict: dict[str, Any],
                      k: int) -> dict[str, Any] | None:
            ckpt.refuse_rank_zero_only(state_dict)
            here = deployed()
            if here is None or "param_groups" not in state_dict:
                return None
            h, m, _ = here
            assert h.opt_groups is not None
            given = h.opt_groups[k]
            if [len(g["params"]) for g in state_dict["param_groups"]] != [len(n) for n in given]:
                return None  # this rank's own layout (or a mismatch torch names)
            name_of = {id(p): n for n, p in m.named_parameters()}
            names = [[name_of.get(id(p)) for p in g["params"]] for g in opt.param_groups]
            return ckpt.local_layout(opt, ckpt.from_torch_layout(state_dict, given), names,
                                     h.stepped_names())

        for k, opt in enumerate(optimizers.members(optimizer)):
            opt.register_state_dict_post_hook(functools.partial(gathered, k=k))
            opt.register_load_state_dict_pre_hook(functools.partial(scattered, k=k))

    def _zero_hooks(self, optimizer: torch.optim.Optimizer) -> None:
        """ZeRO-1 on the user's own optimizer: for its step, the gradients of the parameters
        other holders own are set aside (torch's optimizers skip a parameter without a
        gradient, so this rank neither updates them nor makes state for them); after it they
        come back, and each owner sends its parameters' new values to their other holders.
        Outside the step nothing differs: every held parameter's `.grad` is the full reduced
        gradient, `zero_grad()`, GradScaler's `unscale_` and clipping see every parameter."""
        me = weakref.ref(self)

        def before(opt: Any, args: Any, kwargs: Any) -> None:
            h = me()
            if h is not None and h.runtime is not None:
                h.set_aside = [(p, p.grad) for p in h.runtime.not_stepped()]
                for p, _g in h.set_aside:
                    p.grad = None

        def after(opt: Any, args: Any, kwargs: Any) -> None:
            h = me()
            if h is not None and h.runtime is not None:
                for p, g in h.set_aside:
                    p.grad = g
                h.set_aside = []
                with health.phase("ZeRO-1 parameter broadcast", h.step()):
                    h.runtime.share_stepped_params(
                        {id(p) for g in opt.param_groups for p in g["params"]})

        optimizer.register_step_pre_hook(before)
        optimizer.register_step_post_hook(after)

    def stepped_names(self) -> set[str] | None:
        """ZeRO-1: the parameters this rank's optimizer steps (None: every one it holds)."""
        rt = self.runtime
        if rt is None or not rt.plan.zero_stage or self.owners is None:
            return None
        return {n for n, r in self.owners.items() if r == rt.rank}

    @contextlib.contextmanager
    def without_placeholder(self, optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
        """The optimizer without the stand-in parameters, for state dicts by parameter name."""
        had = [(o.param_groups[0], ph) for o in optimizers.members(optimizer)
               for ph in (self.placeholder, self.sparse_placeholder)
               if ph is not None and o.param_groups and any(p is ph for p in o.param_groups[0]["params"])]
        for g, ph in had:
            g["params"] = [p for p in g["params"] if p is not ph]
        try:
            yield
        finally:
            for g, ph in had:
                g["params"].append(ph)

    def note_versions(self, module: nn.Module) -> None:
        """Record the released parameters' version counters (after a release, and after rannc
        itself gave them values: `rannc.gathered`)."""
        params = dict(module.named_parameters(remove_duplicate=False))
        self.versions = [(n, params[n], params[n]._version) for n in self.released]

    def written(self) -> list[str]:
        """The released parameters written in place since `note_versions` (an in-place op on
        an empty tensor still counts a version): `model.apply(init)` or `reset_parameters()`
        after wrapping, which drew no random numbers for them here. Measured: 200 parameters
        in about 20 us."""
        return [n for n, p, v in self.versions if p._version != v]

    @contextlib.contextmanager
    def shaped_params(self, module: nn.Module) -> Iterator[None]:
        """Released parameters get their shapes back (uninitialised, never read: torch.export
        traces with fake tensors; on CPU untouched pages cost no memory) while a new input
        signature is captured."""
        params = dict(module.named_parameters(remove_duplicate=False))
        for n, shape in self.released.items():
            p = params[n]
            p.data = torch.empty(shape, dtype=p.dtype, device=p.device)
        try:
            yield
        finally:
            for n in self.released:
                p = params[n]
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def _prune(group: dict[str, Any], keep: list[bool]) -> None:
    """Keep a param group's parameters (and their names, where the group has them) where
    `keep` says."""
    group["params"] = [p for p, k in zip(group["params"], keep, strict=True) if k]
    if "param_names" in group:
        group["param_names"] = [n for n, k in zip(group["param_names"], keep, strict=True) if k]


def optimizer_state_factor(optimizer: torch.optim.Optimizer) -> float:
    """Optimizer state elements per parameter element (DESIGN.md's memory model): the most any
    param group needs. Counted from torch's optimizers' state after a step (torch 2.13)."""
    return max(_group_state_factor(type(o).__name__, g)
               for o in optimizers.members(optimizer) for g in o.param_groups or [{}])


def _group_state_factor(name: str, group: Mapping[str, Any]) -> float:
    if name == "SGD":
        return 1.0 if group.get("momentum", 0) else 0.0  # momentum_buffer
    if name in ("Adam", "AdamW"):
        return 3.0 if group.get("amsgrad") else 2.0  # exp_avg, exp_avg_sq (+ max_exp_avg_sq)
    if name in ("Adagrad", "ASGD"):
        return 1.0  # state_sum; ax
    if name == "RMSprop":  # square_avg (+ momentum_buffer) (+ grad_avg)
        return 1.0 + (1.0 if group.get("momentum", 0) else 0.0) + (1.0 if group.get("centered") else 0.0)
    if name == "Adafactor":
        return 0.0  # factored second moment: one row and one column per matrix
    if name == "LBFGS":  # flat direction and gradient, and history_size pairs of updates
        return 2.0 + 2.0 * float(group.get("history_size", 100))
    return 2.0  # NAdam, RAdam, Adamax, Adadelta, Rprop (two tensors each) and unknown ones


def host_malloc(cfg: Config, device: torch.device, stages: Sequence[StagePlan]) -> None:
    """`Config.host_malloc` at deployment, for this rank's stages of the plan (one, or two under
    interleaved 1F1B and ZB-V; none in one process, which plans nothing): on a CPU, "auto"
    releases where their forecasts together are close enough to the memory the rank may use
    (`mem_limit_gb`, else the device's) for the heap's retention to matter, and reuses freed
    blocks elsewhere (`rannc.hostmem`)."""
    forecast = sum(st.predicted.memory_bytes for st in stages if st.predicted is not None) \
        if stages and all(st.predicted is not None for st in stages) else None
    memory = cfg.mem_limit_gb * 1e9 if cfg.mem_limit_gb is not None else math.inf
    if forecast is not None and cfg.mem_limit_gb is None and device.type == "cpu":
        from rannc.profile.device import measure_local_device

        memory = measure_local_device().memory_bytes
    hostmem.apply(cfg.host_malloc, device.type, forecast, memory * (1 - cfg.mem_margin))


def return_freed_heap() -> None:
    """Give the heap pages of the released parameters back to the OS (glibc only).

    Every rank builds the whole model before keeping its stages' parameters. glibc keeps the
    freed ~1 MB parameter blocks in its heap, so a CPU rank's resident memory stayed near the
    whole model's: a 40-layer H256 BERT built at +136 MiB was still at +128 MiB after three
    quarters of its parameters were released, and at +37 MiB after malloc_trim. CUDA tensors
    are unaffected (the caching allocator owns them); elsewhere this does nothing."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        pass


__all__ = ["Holdings", "OneProcess", "capture_signature", "cluster_of", "deployment_plan",
           "host_malloc", "optimizer_state_factor", "return_freed_heap"]
