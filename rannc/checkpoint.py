"""Model and optimizer state of a deployed model: gathered whole, or saved sharded.

After deployment a rank holds only its stage's parameters (the others are released), so the
model's own `state_dict()` would hold empty tensors. Every entry instead has one *source rank*,
computed identically on every rank from the plan: for a parameter, the lowest rank of the stages
that hold it (tied copies and stage replicas are identical); for a buffer, the lowest rank of
the first stage whose tasks read it (that stage updates it: BatchNorm statistics); for anything
no stage reads, rank 0 (every rank keeps it). Gathering, saving and the optimizer state all
take each entry from its source rank, so there is one answer however many ranks hold a copy.

Names are the model's original names; a tensor reachable under several names (tied weights) is
stored once under its *canonical* name, the first under which `named_parameters()` or
`named_buffers()` reaches it, and appears under every name in a gathered state dict.

Sharded checkpoints use torch.distributed.checkpoint (DCP) for the tensors, keyed by name, so
they load into another plan or another number of ranks: every rank reads what it now holds.
The few non-tensor values (optimizer hyper-parameters, non-tensor optimizer state) go into a
JSON file, never a pickle; the Stateful objects saved beside them (LR scheduler, sampler, RNG)
in a file read with `torch.load(weights_only=True)`. Every file's sha256 is in the metadata and
checked on load. The directory layout (versions, the `latest` pointer, what survives a crash)
is described where it is implemented, below.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import io
import itertools
import json
import logging
import os
import random
import re
import shutil
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from rannc import health
from rannc.errors import CheckpointError, CheckpointMismatchError, RaNNCError
from rannc.graph.model_state import RANNC_OWN_HOOK
from rannc.graph.task_graph import ValueKind
from rannc.pipeline.runtime import PipelineRuntime

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 2  # 2: versions under a `latest` pointer, checksums, Stateful objects
_READABLE = {1, 2}
META_FILE = "rannc_meta.json"
_MODEL, _OPTIM = "model/", "optim/"  # DCP key prefixes: "model/<name>", "optim/<name>/<state key>"


@dataclass(frozen=True, slots=True)
class Holdings:
    """Where every state-dict entry of the model lives; identical on every rank."""

    tensors: dict[str, torch.Tensor]  # canonical name -> this rank's tensor (empty if released)
    canonical: dict[str, str]  # every parameter/buffer name -> its canonical name
    persistent: tuple[str, ...]  # canonical names of state-dict entries, in state-dict order
    source: dict[str, int]  # canonical name -> the rank whose copy is authoritative (for a
    # parameter this rank holds: its owner, which also keeps its optimizer state under ZeRO-1)
    held: frozenset[str]  # canonical names whose tensor this rank holds

    @classmethod
    def of(cls, model: nn.Module, rt: PipelineRuntime | None) -> Holdings:
        with own_state_dict_reads():
            keys = list(model.state_dict(keep_vars=True))
        key_set = set(keys)
        names: dict[int, list[str]] = {}
        by_id: dict[int, torch.Tensor] = {}
        for n, t in _named_tensors(model):
            names.setdefault(id(t), []).append(n)
            by_id[id(t)] = t
        canonical: dict[str, str] = {}
        tensors: dict[str, torch.Tensor] = {}
        for i, ns in names.items():
            c = next((n for n in ns if n in key_set), ns[0])
            tensors[c] = by_id[i]
            canonical.update((n, c) for n in ns)
        persistent = tuple(dict.fromkeys(canonical[k] for k in keys if k in canonical))
        if rt is None:
            return cls(tensors, canonical, persistent, dict.fromkeys(tensors, 0), frozenset(tensors))
        source = dict.fromkeys(tensors, 0)
        for n, ranks in holders(rt, canonical).items():
            source[n] = min(ranks)
        for n, r in rt.owners.items():  # this rank's parameters: their owners (rannc.ownership)
            source[canonical[n]] = r
        # Buffers and parameters no stage reads stay on every rank.
        held_ids = {id(p) for p in rt.held.values()}
        in_stages = {canonical[n] for st in rt.plan.stages for n in st.param_names}
        held = frozenset(c for c, t in tensors.items()
                         if not isinstance(t, nn.Parameter) or id(t) in held_ids or c not in in_stages)
        return cls(tensors, canonical, persistent, source, held)

    def mine(self, rank: int) -> list[str]:
        """Canonical names of the persistent entries this rank is the source of."""
        return [n for n in self.persistent if self.source[n] == rank]


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def holders(rt: PipelineRuntime, canonical: Mapping[str, str]) -> dict[str, tuple[int, ...]]:
    """Canonical name -> the ranks of the stage whose copy counts: parameters, every stage
    holding them (their copies are equal); buffers, the first stage reading them."""
    out: dict[str, set[int]] = {}
    for n, ranks in rt.plan.holders().items():
        out.setdefault(canonical[n], set()).update(ranks)
    graph = rt.graph
    for s, sg in enumerate(rt.stages):
        for v in sg.inputs:
            val = graph.values[v]
            c = canonical.get(val.target or "") if val.kind is ValueKind.BUFFER else None
            if c is not None and c not in out:
                out[c] = set(rt.plan.stages[s].ranks)
    return {n: tuple(sorted(r)) for n, r in out.items()}


# -- a gathered state dict -----------------------------------------------------------------------

OPTIMIZER_STATE_DICT = "optimizer.state_dict()"  # torch's own call, gathered once deployed (deploy.py)

class OnRankZero(dict):  # type: ignore[type-arg]
    """What a gathered state dict is on a rank other than 0 (`rank0_only=True`): empty, and
    refusing to be saved or loaded. Why: a script saving on every rank (harmless under DDP,
    where every rank holds the same state) wrote this rank's empty dict to the path of rank 0's
    whole model, and whichever rank wrote last won: a checkpoint lost without a word. And one
    that keeps `best = copy.deepcopy(model.state_dict())` to load it back later loaded nothing
    on these ranks (`strict=False`) or failed on every key."""

    def __init__(self, what: str, rank: int) -> None:
        super().__init__()
        self.what, self.rank = what, rank

    def _whole(self) -> tuple[str, str]:
        """What this is (the model, the optimizer), and how to have the whole of it on every
        rank (torch's own `optimizer.state_dict()` takes no argument)."""
        if self.what == OPTIMIZER_STATE_DICT:
            return "optimizer", "call model.optimizer_state_dict(rank0_only=False)"
        return "model", "pass rank0_only=False"

    def refused(self, doing: str) -> RaNNCError:
        whole, every_rank = self._whole()
        call = self.what if whole == "optimizer" else f"model.{self.what}"
        return RaNNCError(
            f"{doing} {self.what}'s result on rank {self.rank}: it gathers the whole {whole} onto "
            "rank 0 only, and this rank's is empty (saved to rank 0's path it would overwrite "
            f"the checkpoint). Fix: save on rank 0 alone (`sd = {call}` on every rank, then "
            f"`if rannc.get_rank() == 0: torch.save(sd, path)`), or {every_rank} to have the "
            "whole of it on every rank (to keep a copy in memory and load it back)")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise self.refused("pickling (torch.save) of")

    # Reading its entries: an EMA updated from `model.state_dict()` (timm's ModelEmaV2 zips its
    # values, many hand-written ones loop over its items) updated nothing on these ranks,
    # silently, and evaluated the initial weights there.
    def _read_refused(self, *args: Any) -> Any:
        inside = ("do it inside `with model.gathered_parameters():` on every rank, where "
                  "state_dict() is the whole model on each, or " if self.what == "state_dict()" else "")
        raise RaNNCError(
            f"reading the entries of {self.what}'s result on rank {self.rank}: it gathers them "
            "onto rank 0 only, and this rank's is empty (code updating an EMA from it would "
            f"update nothing here). Fix: {inside}{self._whole()[1]} to gather it onto every rank")

    __iter__ = keys = values = items = _read_refused  # type: ignore[assignment]

    def copy(self) -> OnRankZero:  # (torch's optimizer.load_state_dict copies what it loads first)
        return OnRankZero(self.what, self.rank)

    def __deepcopy__(self, memo: dict[int, Any]) -> OnRankZero:
        return OnRankZero(self.what, self.rank)


# The key under which a parent module's state dict holds a RaNNCModule's `OnRankZero` (on the
# ranks other than 0, where the parent's dict would otherwise be a part of the model)
GATHERED_ON_RANK_ZERO = "<gathered onto rank 0>"


def refuse_rank_zero_only(state: Mapping[str, Any]) -> None:
    """Loading what a rank other than 0 got from a gathered state dict is refused (above)."""
    if isinstance(state, OnRankZero):
        raise state.refused("loading")


def gather_state_dict(model: nn.Module, rt: PipelineRuntime, rank0_only: bool,
                      prefix: str = "") -> dict[str, Any]:
    """The full state dict, each entry from its source rank (collective)."""
    h = Holdings.of(model, rt)
    rank = dist.get_rank()
    mine = {n: h.tensors[n].detach().cpu() for n in h.mine(rank)}
    parts = _gather(mine, rank0_only)
    if parts is None:
        return OnRankZero("state_dict()", rank)
    whole: dict[str, torch.Tensor] = {}
    for p in parts:
        whole.update(p)
    with own_state_dict_reads():
        local = model.state_dict(keep_vars=False)
    out = type(local)()
    for k, v in local.items():  # the unwrapped model's keys, order and aliases
        out[prefix + k] = whole[h.canonical[k]] if k in h.canonical else v
    meta = getattr(local, "_metadata", None)
    if meta is not None:
        out._metadata = type(meta)((prefix + k if k else prefix.rstrip("."), v)  # type: ignore[attr-defined]
                                   for k, v in meta.items())
    return out


# rannc's own reads of a deployed module's state_dict() in progress (see `refuse_partial_reads`)
_OWN_READS = [0]


@contextlib.contextmanager
def own_state_dict_reads() -> Iterator[None]:
    """A block in which rannc reads a deployed module's own state_dict() (its keys, the entries
    this rank holds): not the partial read `refuse_partial_reads` stops."""
    _OWN_READS[0] += 1
    try:
        yield
    finally:
        _OWN_READS[0] -= 1


def reading_own() -> bool:
    """Whether rannc itself is reading this rank's own state (`own_state_dict_reads`)."""
    return _OWN_READS[0] > 0


def refuse_partial_reads(model: nn.Module, released: Mapping[str, Any], rank: int) -> None:
    """After this rank released parameters (`deploy.Holdings.release`): a state_dict() of the
    wrapped model itself, or of a submodule holding one of them, raises instead of returning
    their empty tensors. Why: `model.module.save_pretrained(path)`, `torch.save(
    model.module.state_dict(), path)` or a PEFT adapter's save wrote a checkpoint of zero-size
    tensors for every parameter another rank holds, found broken only when loaded. A state dict
    pre-hook on each module owning a released parameter (once per module)."""
    owners = {name.rpartition(".")[0] for name in released}
    for path in owners:
        module = model.get_submodule(path)
        if module not in _REFUSING:
            _REFUSING.add(module)
            module.register_state_dict_pre_hook(_partial_read_refused(released, rank))


_REFUSING: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # modules `refuse_partial_reads` hooked


def refuse_direct_calls(model: nn.Module, name: str, param: nn.Parameter, rank: int) -> None:
    """After this rank released parameters, a call of the wrapped model's own forward
    (`model.module(x)`, as DDP scripts evaluate through the unwrapped module) raises by name
    instead of failing inside a layer on an empty weight ("mat2 must be a matrix, got 1-D
    tensor"). A forward pre-hook on the wrapped model (once), which lets a capture of a new
    input signature through: the released parameters have their shapes back then
    (`Holdings.shaped_params`), as `param` (one of them, `name`) shows."""
    if model not in _CALLS_REFUSED:
        _CALLS_REFUSED.add(model)
        model.register_forward_pre_hook(_DirectCallRefused(name, param, rank))


_CALLS_REFUSED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # `refuse_direct_calls` hooked


def refuse_copies(name: str, param: nn.Parameter, rank: int) -> None:
    """A parameter this rank released (`deploy.Holdings.release`) raises when it is copied or
    pickled while empty, instead of giving an empty tensor. Why: `ema = copy.deepcopy(
    model.module)` after wrapping made an EMA model with an empty tensor for every parameter
    another rank holds; its lerp_ with those empty tensors ran, and the EMA's state_dict() saved
    them, found broken only when evaluated or loaded; `torch.save(model.module, path)` failed
    with an unclear pickling error. `copy.deepcopy` and pickle look these two methods up on the
    object itself, so the parameter's own attributes stand in for nn.Parameter's (the
    parameter stays an nn.Parameter for the optimizer and torch)."""
    released = _Released(name, param, rank)
    param.__deepcopy__ = released.deepcopy  # type: ignore[method-assign]
    param.__reduce_ex__ = released.reduce_ex  # type: ignore[method-assign,assignment]


class _Released:
    """A parameter this rank released (held weakly: the guards below hang on it or on its
    module), and what copying it while it is empty raises."""

    def __init__(self, name: str, param: nn.Parameter, rank: int) -> None:
        self.name, self.ref, self.rank = name, weakref.ref(param), rank

    def empty(self) -> bool:
        """Released now (between captures; `Holdings.shaped_params` gives it its shape back
        while a new input signature is captured)."""
        p = self.ref()
        return p is not None and p.numel() == 0

    def refused(self, what: str) -> RaNNCError:
        return RaNNCError(
            f"{what} of the wrapped model on rank {self.rank}: its parameter {self.name!r} is "
            "released here (this rank holds only its stages' parameters; the others are empty "
            "tensors), so the copy would be broken. Fix: copy the model before wrapping it (`ema "
            "= copy.deepcopy(model)`, then `rannc.RaNNCModule(model, optimizer)`), or inside "
            "`with model.gathered_parameters():` on every rank (the whole model is here then; "
            "update an EMA there too); to save, call model.state_dict() or "
            "model.save_pretrained(path) on every rank, or model.save_checkpoint(dir)")

    def deepcopy(self, memo: dict[int, Any]) -> nn.Parameter:
        """The parameter's `__deepcopy__`: nn.Parameter's own copy (which leaves these
        attributes behind) while it has its shape."""
        p = self.ref()
        if p is None or self.empty():
            raise self.refused("copy.deepcopy")
        out: nn.Parameter = nn.Parameter.__deepcopy__(p, memo)
        return out

    def reduce_ex(self, protocol: int) -> Any:
        """The parameter's `__reduce_ex__`: nn.Parameter's, without its state."""
        p = self.ref()
        if p is None or self.empty():
            raise self.refused("pickling (torch.save)")
        return torch._utils._rebuild_parameter, (p.data, p.requires_grad, OrderedDict())


class _DirectCallRefused(_Released):
    """`refuse_direct_calls`' hook. It travels with the module it hooks, so copying or pickling
    it refuses as the released parameters do (`refuse_copies`; copy.deepcopy and pickle reach
    a module's hooks before its submodules' parameters)."""

    def __init__(self, name: str, param: nn.Parameter, rank: int) -> None:
        super().__init__(name, param, rank)
        setattr(self, RANNC_OWN_HOOK, True)  # (not the model's: not in the capture key)

    def __call__(self, module: nn.Module, args: Any) -> None:
        if self.empty():
            raise RaNNCError(
                f"{type(module).__name__}.forward called directly (model.module(...)) on rank "
                f"{self.rank} after rannc deployed the model on several ranks: this rank holds "
                f"only its stages' parameters, and the others ({self.name!r} among them) are "
                "released here (empty tensors). Fix: call the wrapper, model(...), on every rank "
                "(under torch.no_grad() to evaluate); for a whole copy, gather the model with "
                "model.state_dict() on every rank and load it into an unwrapped model on rank 0")

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        if self.empty():
            raise self.refused("copy.deepcopy")
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        if self.empty():
            raise self.refused("pickling (torch.save)")
        return _no_hook, ()


def _no_hook() -> Any:
    """What a pickled `_DirectCallRefused` comes back as: a hook that does nothing."""
    return lambda module, args: None


def _partial_read_refused(released: Mapping[str, Any], rank: int) -> Any:
    def hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if _OWN_READS[0]:
            return
        names = list(released)  # (read now: a later input signature may release more)
        shown = ", ".join(repr(n) for n in names[:2]) + (
            f" and {len(names) - 2} more" if len(names) > 2 else "")
        raise RaNNCError(
            f"state_dict() of the wrapped model's own modules on rank {rank}: this rank holds "
            f"only its stages' parameters, and {len(names)} others ({shown}) are released here "
            "(empty tensors), so a checkpoint saved from it would be broken. Fix: call the "
            "wrapper's state_dict() on every rank, which gathers the whole model onto rank 0 "
            "(`sd = model.state_dict(); if rank == 0: torch.save(sd, path)`), or "
            "model.save_pretrained(path) on every rank for a Hugging Face or PEFT model (rank 0 "
            "writes it), or model.save_checkpoint(dir) for a sharded checkpoint")
    return hook


def _gather(obj: Any, rank0_only: bool) -> list[Any] | None:
    """Every rank's `obj` on rank 0 (None elsewhere), or on every rank."""
    world = dist.get_world_size()
    if not rank0_only:
        every: list[Any] = [None] * world
        dist.all_gather_object(every, obj)
        return every
    box: list[Any] | None = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(obj, box, dst=0)
    return box


def load_held_state(model: nn.Module, rt: PipelineRuntime, state_dict: Mapping[str, Any],
                    strict: bool) -> tuple[list[str], list[str]]:
    """Copy the entries this rank holds; returns (missing, unexpected) over the full model."""
    h = Holdings.of(model, rt)
    with own_state_dict_reads():
        keys = list(model.state_dict(keep_vars=True))
    missing = [k for k in keys if k not in state_dict]
    unexpected = [k for k in state_dict if k not in keys]
    if strict and (missing or unexpected):
        raise RuntimeError(f"Error(s) in loading state_dict for {type(model).__name__}: missing keys "
                           f"{missing}, unexpected keys {unexpected}")
    with torch.no_grad():
        for k, v in state_dict.items():
            c = h.canonical.get(k)
            if c is None or c not in h.held:
                continue
            _copy_into(h.tensors[c], v, k)
    return missing, unexpected


def _copy_into(t: torch.Tensor, v: Any, name: str) -> None:
    if not isinstance(v, torch.Tensor):
        raise RaNNCError(f"state dict entry {name} is a {type(v).__name__}, not a tensor")
    if v.shape != t.shape:
        raise RuntimeError(f"size mismatch for {name}: copying a param with shape {tuple(v.shape)} "
                           f"from checkpoint, the shape in current model is {tuple(t.shape)}")
    with torch.no_grad():
        t.copy_(v)


# -- optimizer state keyed by parameter names ------------------------------------------------------

def group_names(model: nn.Module, optimizer: torch.optim.Optimizer,
                groups: Sequence[Mapping[str, Any]] | None = None) -> list[list[str]]:
    """The canonical names of each param group's parameters (of `groups`, by default all the
    optimizer's)."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    out = []
    for g in optimizer.param_groups if groups is None else groups:
        missing = [tuple(p.shape) for p in g["params"] if id(p) not in name_of]
        if missing:
            raise RaNNCError(f"the optimizer steps {len(missing)} tensor(s) that are not parameters "
                             f"of the model (shapes {missing[:3]}); rannc names optimizer state by "
                             "the model's parameter names")
        out.append([name_of[id(p)] for p in g["params"]])
    return out


def gather_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                           rt: PipelineRuntime | None, groups: list[list[str]],
                           rank0_only: bool) -> dict[str, Any]:
    """{"state": {name: {key: value}}, "param_groups": [{hyper-parameters, "params": [names]}]}
    over the whole model, each parameter's state from its source rank (collective when rt)."""
    h = Holdings.of(model, rt)
    mine = _local_optimizer_state(model, optimizer, h, dist.get_rank() if rt is not None else 0)
    if rt is None:
        parts: list[Any] | None = [mine]
    else:
        parts = _gather(mine, rank0_only)
    if parts is None:
        return OnRankZero("optimizer_state_dict()", dist.get_rank())
    state: dict[str, Any] = {}
    for p in parts:
        state.update(p)
    order = [n for names in groups for n in names]
    return {"state": {n: state[n] for n in order if n in state},
            "param_groups": [{**_hyper(g), "params": list(names)}
                             for g, names in zip(optimizer.param_groups, groups, strict=True)]}


def _local_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, h: Holdings,
                           rank: int) -> dict[str, dict[str, Any]]:
    name_of = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            n = name_of.get(id(p))
            if n is None or h.source.get(n, 0) != rank or p not in optimizer.state:
                continue
            out[n] = {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
                      for k, v in optimizer.state[p].items()}
    return out


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                         state_dict: Mapping[str, Any], only: Collection[str] | None = None) -> None:
    """Load a by-name optimizer state dict into this rank's (possibly pruned) optimizer; with
    `only`, the state of those parameters alone (ZeRO-1: the ones this rank steps)."""
    if not {"state", "param_groups"} <= set(state_dict):
        raise RaNNCError("an optimizer state dict by name has 'state' and 'param_groups' (from "
                         "RaNNCModule.optimizer_state_dict())")
    optimizer.load_state_dict(local_layout(optimizer, state_dict, group_names(model, optimizer),
                                           only))


def local_layout(optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any],
                 names: Sequence[Sequence[str | None]],
                 only: Collection[str] | None = None) -> dict[str, Any]:
    """A by-name optimizer state dict in torch's layout over this rank's (possibly pruned)
    param groups, whose parameters' names are `names` (None: a stand-in, which gets no state);
    with `only`, the state of those parameters alone."""
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise RaNNCError(f"the optimizer state dict has {len(saved_groups)} param group(s), the "
                         f"optimizer {len(optimizer.param_groups)}")
    by_name = state_dict["state"]
    state: dict[int, Any] = {}
    groups = []
    i = 0
    for g_idx, (saved, group_names_) in enumerate(zip(saved_groups, names, strict=True)):
        extra = {n for n in group_names_ if n is not None} - set(saved["params"])
        if extra:
            raise RaNNCError(f"param group {g_idx} of the optimizer holds {sorted(extra)[:3]}, "
                             "which the saved param group does not")
        idx = []
        for n in group_names_:
            if n is not None and n in by_name and (only is None or n in only):
                state[i] = by_name[n]
            idx.append(i)
            i += 1
        cur = optimizer.param_groups[g_idx]
        hyper = {k: tuple(v) if isinstance(cur.get(k), tuple) and isinstance(v, list) else v
                 for k, v in _hyper(saved).items()}
        groups.append({**hyper, "params": idx})
        if "param_names" in cur:
            groups[-1]["param_names"] = list(cur["param_names"])
    return {"state": state, "param_groups": groups}


def to_torch_layout(by_name: Mapping[str, Any]) -> dict[str, Any]:
    """A by-name optimizer state dict (`gather_optimizer_state`) in torch's own layout, the
    unwrapped optimizer's `state_dict()`: parameters numbered in the order of the param groups
    as given, state keyed by those numbers."""
    index: dict[str, int] = {}
    for g in by_name["param_groups"]:
        for n in g["params"]:
            index.setdefault(n, len(index))
    return {"state": {index[n]: st for n, st in by_name["state"].items()},
            "param_groups": [{**_hyper(g), "params": [index[n] for n in g["params"]]}
                             for g in by_name["param_groups"]]}


def from_torch_layout(state_dict: Mapping[str, Any], groups: Sequence[Sequence[str]]) -> dict[str, Any]:
    """torch's layout of an optimizer over the param groups as given (`groups`: their
    parameters' names), as a by-name optimizer state dict."""
    numbered = [n for names in groups for n in names]
    return {"state": {numbered[int(i)]: st for i, st in state_dict["state"].items()
                      if int(i) < len(numbered)},
            "param_groups": [{**_hyper(g), "params": list(names)}
                             for g, names in zip(state_dict["param_groups"], groups, strict=True)]}



# -- the checkpoint directory: versions and the `latest` pointer -----------------------------------
#
# A checkpoint directory holds one sub-directory per saved version and a pointer to the newest
# complete one:
#
#     ckpt/latest            text: "v-000007" (replaced atomically: the commit point of a save)
#     ckpt/v-000007/         rannc_meta.json, DCP's .metadata and __<rank>_<i>.distcp shards,
#                            stateful.pt (the Stateful objects and plain values)
#     ckpt/.tmp-<id>/        a version being written (or left by a crashed save)
#
# A save writes `.tmp-<id>`, renames it to the next `v-N`, then replaces `latest`; only then does
# it remove what that supersedes (older versions, temporary leftovers). A crash at any point,
# any number of times, leaves `latest` naming a whole version, because nothing `latest` names is
# ever changed. The directory itself is never renamed, so a symlink to it is written through and
# `os.path.exists(ckpt)` stays true once a save has begun. Files a user puts at the top level
# (beside `latest`) are never touched; files added inside a version directory are kept when the
# version is superseded (only rannc's own files are removed, and the directory is left, with a
# warning, if anything else remains in it).

LATEST = "latest"
STATEFUL_FILE = "stateful.pt"
_VERSION = re.compile(r"v-(\d+)")
_TMP = ".tmp-"


def latest_checkpoint(path: str | os.PathLike[str]) -> str | None:
    """The directory of the newest complete checkpoint version under `path`, or None if there
    is none (no save into `path` has finished): the test a training script uses to resume."""
    root = Path(os.path.realpath(path))
    if not root.is_dir():
        return _legacy_aside(root)
    pointed = _read_pointer(root)
    if pointed is not None and _complete(root / pointed):
        return str(root / pointed)
    versions = [v for v in _versions(root) if _complete(v)]
    if versions:
        if pointed is not None:  # `latest` names a version someone removed: say which is used
            log.warning("rannc: %s names %s, which is not a complete checkpoint; using %s",
                        root / LATEST, pointed, versions[-1].name)
        return str(versions[-1])
    if _complete(root):  # the flat layout of rannc <= 0.1: the directory is the checkpoint
        return str(root)
    return None


def _legacy_aside(root: Path) -> str | None:
    """rannc <= 0.1 renamed the previous checkpoint to `<dir>.old-<id>` while publishing; a crash
    there left only that copy. Found so that a job killed before an upgrade still resumes."""
    aside = sorted((p for p in root.parent.glob(f"{glob.escape(root.name)}.old-*") if _complete(p)),
                   key=lambda p: p.stat().st_mtime)
    if not aside:
        return None
    log.warning("rannc: %s is missing; using %s, left by an interrupted save", root, aside[-1])
    return str(aside[-1])


def _complete(d: Path) -> bool:
    # rannc_meta.json is written last, after every rank's files, before the rename into place.
    return (d / META_FILE).is_file()


def _read_pointer(root: Path) -> str | None:
    try:
        name = (root / LATEST).read_text().strip()
    except OSError:
        return None
    return name if _VERSION.fullmatch(name) else None


def _versions(root: Path) -> list[Path]:
    """The `v-N` directories, oldest first."""
    found = [(int(m[1]), p) for p in root.iterdir() if (m := _VERSION.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def _checked_root(path: str | os.PathLike[str]) -> Path:
    """The directory a save writes into: symlinks resolved, created if need be."""
    text = os.fspath(path)
    if os.path.basename(os.path.normpath(text)) in ("", ".", "..") or not text.strip():
        raise CheckpointError(
            f"checkpoint path {text!r} does not name a directory of its own (it ends in "
            f"'.', '..' or '/' after normalisation: {os.path.normpath(text)!r}); a save keeps "
            "versions and a 'latest' pointer in it, so name one, e.g. 'ckpt' or 'runs/ckpt'")
    root = Path(os.path.realpath(text))  # a symlink is written through: the link stays a link
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"checkpoint path {text!r} ({root}) is a file, not a directory; "
                              "save into a directory (it is created if missing)")
    root.mkdir(parents=True, exist_ok=True)
    return root


def _begin(path: str | os.PathLike[str]) -> tuple[Path, str, str]:
    """(root, temporary directory name, version name) of a new save: rank 0 decides."""
    root = _checked_root(path)
    top = max((int(m[1]) for p in root.iterdir() if (m := _VERSION.fullmatch(p.name))), default=0)
    return root, f"{_TMP}{uuid.uuid4().hex}", f"v-{top + 1:06d}"


def _publish(root: Path, tmp: str, version: str) -> None:
    """Move a completely written version into place, point `latest` at it, then remove what
    it supersedes. Each step is one rename; a crash between any two leaves `latest` whole."""
    os.replace(root / tmp, root / version)
    _fsync_dir(root)
    pointer = root / f"{LATEST}{_TMP}{uuid.uuid4().hex}"
    with open(pointer, "w") as f:
        f.write(version + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, root / LATEST)
    _fsync_dir(root)
    _clean(root, keep=version)


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _clean(root: Path, keep: str) -> None:
    """Remove every version but `keep` and every temporary leftover of a crashed save."""
    for p in root.iterdir():
        if p.name.startswith(_TMP) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        elif p.name.startswith(f"{LATEST}{_TMP}"):
            p.unlink(missing_ok=True)
        elif _VERSION.fullmatch(p.name) and p.name != keep and p.is_dir():
            _remove_version(p)


def _remove_version(d: Path) -> None:
    """Remove rannc's files from a superseded version; keep anything a user added there."""
    ours = {META_FILE, STATEFUL_FILE, ".metadata"}
    with contextlib.suppress(Exception):
        ours |= set(json.loads((d / META_FILE).read_text()).get("files", {}))
    meta = d / META_FILE
    for p in d.iterdir():  # the metadata last: a half-removed version is then not "complete"
        if p != meta and (p.name in ours or p.suffix == ".distcp"):
            p.unlink(missing_ok=True)
    meta.unlink(missing_ok=True)
    left = sorted(p.name for p in d.iterdir())
    if left:
        log.warning("rannc: kept %s (superseded checkpoint version) because it holds files rannc "
                    "did not write: %s; put your own files beside %s instead", d, left[:5],
                    d.parent / LATEST)
        return
    d.rmdir()


# -- per-file checksums ------------------------------------------------------------------------

def _digest(path: Path) -> dict[str, Any]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            size += len(chunk)
    return {"sha256": h.hexdigest(), "bytes": size}


def _problem(d: Path, name: str, want: Mapping[str, Any]) -> str | None:
    """Why file `name` of version `d` is not what was saved, or None."""
    p = d / name
    if not p.is_file():
        return f"{p} is missing"
    got = _digest(p)
    if got["bytes"] != want["bytes"]:
        return f"{p} is truncated or extended: {got['bytes']} bytes, saved {want['bytes']}"
    if got["sha256"] != want["sha256"]:
        return f"{p} is corrupt: its sha256 is {got['sha256'][:16]}..., saved {want['sha256'][:16]}..."
    return None


def _verify(d: Path, files: Mapping[str, Mapping[str, Any]], rank: int, world: int) -> None:
    """Every file's checksum, each read by one rank; the same error on every rank."""
    names = sorted(files)[rank::world]
    problems = [p for n in names if (p := _problem(d, n, files[n])) is not None]
    every = _gather(problems, rank0_only=False) if world > 1 else [problems]
    assert every is not None
    found = [p for part in every for p in part]
    if found:
        raise CheckpointError(
            f"checkpoint {d} is damaged: {'; '.join(found[:5])}"
            f"{f' (and {len(found) - 5} more)' if len(found) > 5 else ''}. Load an older copy "
            "(a backup) or save again from a run that holds the state")


# -- training state beside the model: Stateful objects and plain values ---------------------------

@runtime_checkable
class Stateful(Protocol):
    """torch.distributed.checkpoint's protocol: an LR scheduler, a sampler, a step counter."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class RNGState:
    """A Stateful holding this process's random number generators (torch's CPU and CUDA ones,
    Python's `random`, numpy's global one), so dropout after a resume draws what an
    uninterrupted run draws: `save_checkpoint(d, rng=RNGState())`,
    `load_checkpoint(d, rng=RNGState())`. Each rank keeps its own."""

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        sd: dict[str, Any] = {"torch": torch.get_rng_state(),
                              "python": [version, list(internal), gauss]}
        if torch.cuda.is_available():
            sd["cuda"] = torch.cuda.get_rng_state_all()
        with contextlib.suppress(ImportError):
            import numpy as np

            kind, keys, pos, has_gauss, cached = cast(tuple[Any, ...], np.random.get_state())
            sd["numpy"] = [kind, [int(k) for k in keys], pos, has_gauss, cached]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["torch"])
        version, internal, gauss = state_dict["python"]
        random.setstate((version, tuple(internal), gauss))
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state_dict["cuda"])
        if "numpy" in state_dict:
            import numpy as np

            kind, keys, pos, has_gauss, cached = state_dict["numpy"]
            np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def _local_states(stateful: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """{key: ("stateful" | "value", state)} of this rank, and what cannot be stored, if anything:
    stored states must load back under torch.load(weights_only=True), as every file rannc reads
    is read without unpickling arbitrary objects."""
    out: dict[str, Any] = {}
    for key, obj in stateful.items():
        with own_state_dict_reads():  # (each rank stores its own: an optimizer's is not gathered)
            entry = ("stateful", obj.state_dict()) if isinstance(obj, Stateful) else ("value", obj)
        buf = io.BytesIO()
        try:
            torch.save(entry[1], buf)
            buf.seek(0)
            torch.load(buf, weights_only=True)
        except Exception as e:
            return out, (f"save_checkpoint({key}=...): a {type(obj).__name__} is neither a "
                         "Stateful (state_dict()/load_state_dict()) nor plain data (tensors, "
                         "numbers, strings, lists, tuples, dicts), so it cannot be stored safely "
                         f"({type(e).__name__}: {_first_line(e)}); pass its state instead")
        out[key] = entry
    return out, None


def _stateful_problem(checks: list[tuple[list[str], str | None]]) -> str | None:
    """Every rank's (keywords, problem) -> the first problem, or None."""
    if len({tuple(k) for k, _ in checks}) > 1:
        return ("ranks passed different keywords to save_checkpoint ("
                + "; ".join(f"rank {r}: {k}" for r, (k, _) in enumerate(checks)) + "); pass the "
                "same ones on every rank (each rank's own state is saved under each)")
    return next((p for _, p in checks if p is not None), None)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and bool(torch.equal(a, b)))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and bool(a == b)


def _merge_states(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's states -> {key: {"kind", "states": [one] if all ranks agree, else per rank}}."""
    out = {}
    for key in parts[0]:
        kind = parts[0][key][0]
        states = [p[key][1] for p in parts]
        same = all(_same(states[0], s) for s in states[1:])
        out[key] = {"kind": kind, "states": states[:1] if same else states}
    return out


def _restore(entries: Mapping[str, Any], stateful: Mapping[str, Any], where: Path, strict: bool,
             rank: int, world: int) -> dict[str, Any]:
    """Load every requested entry; returns key -> the Stateful (loaded in place) or the value."""
    out: dict[str, Any] = {}
    absent = [k for k in stateful if k not in entries]
    if absent and strict:
        raise CheckpointMismatchError(
            f"checkpoint {where} holds no {absent} (it holds {sorted(entries)}); save them with "
            "save_checkpoint(dir, name=obj), or pass strict=False to load_checkpoint to skip them")
    for key, obj in stateful.items():
        if key not in entries:
            log.warning("rannc: checkpoint %s holds no %r; left as it is (strict=False)", where, key)
            continue
        e = entries[key]
        states = e["states"]
        if len(states) > 1 and len(states) != world:
            raise CheckpointError(
                f"checkpoint {where}: {key!r} was saved by {len(states)} ranks with different "
                f"values on each, so it cannot be given to {world} ranks; load it with "
                f"{len(states)} ranks, or leave {key!r} out and set it up afresh")
        state = states[rank] if len(states) > 1 else states[0]
        if isinstance(obj, Stateful):
            if e["kind"] != "stateful":
                raise CheckpointError(f"checkpoint {where}: {key!r} was saved as a plain value, "
                                      f"not a Stateful's state; pass a value, not a "
                                      f"{type(obj).__name__}, to load it")
            obj.load_state_dict(state)
            out[key] = obj
        else:
            out[key] = state
    return out


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else repr(e)


# -- every rank, or none --------------------------------------------------------------------------

_calls = itertools.count()


def _all_arrive(what: str) -> None:
    """Return once every rank has called `what` (its n-th checkpoint call). A rank that has gone
    on past this point (a later step, or finished its script) did not call it, a mistake
    (`if rank == 0: save_checkpoint(...)`) that would otherwise wait in a collective until
    timeout_s: it is named within a fraction of a second, by the ranks' watchdog beats."""
    h = health.current()
    n = next(_calls)
    if h is None:
        return
    key = f"checkpoint/{n}"
    h.store.set(f"{key}/{h.rank}", what)
    h.store.add(key, 1)
    deadline = time.monotonic() + h.timeout_s
    while h.store.add(key, 0) < h.world:
        gone = [r for r in range(h.world) if r != h.rank and h.gone_past(r)]
        late = time.monotonic() > deadline
        if (gone or late) and h.store.add(key, 0) < h.world:
            absent = [r for r in range(h.world) if not h.store.check([f"{key}/{r}"])]
            why = (f"rank(s) {gone} went on past it" if gone
                   else f"rank(s) {absent} did not reach it within {h.timeout_s:.0f} s (timeout_s)")
            raise CheckpointError(
                f"rank {h.rank} called {what}() and {why}: call {what} on every rank (it is "
                f"collective: each rank writes or reads its own part). {h.explain()}")
        time.sleep(0.02)


# -- sharded checkpoints ----------------------------------------------------------------------------

def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    rt: PipelineRuntime | None, groups: list[list[str]] | None,
                    path: str | os.PathLike[str], stateful: Mapping[str, Any]) -> None:
    """Every rank writes the entries it is the source of into a new version directory; rank 0
    publishes it (see the layout above)."""
    import torch.distributed.checkpoint as dcp

    _all_arrive("save_checkpoint")
    rank, world = dist.get_rank(), dist.get_world_size()
    box: list[Any] = [None]
    if rank == 0:
        try:
            box[0] = _begin(path)
        except (RaNNCError, OSError) as e:
            box[0] = str(e) if isinstance(e, RaNNCError) else (
                f"cannot create checkpoint directory {os.fspath(path)!r}: {e}")
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise CheckpointError(box[0])
    root, tmp_name, version = box[0]
    tmp = root / tmp_name
    states, problem = _local_states(stateful)
    checks = _gather((sorted(stateful), problem), rank0_only=False)
    assert checks is not None
    problem = _stateful_problem(checks)
    if problem is not None:  # raised alike on every rank, before anything is written
        raise CheckpointError(problem)
    every_state = _gather(states, rank0_only=True)
    tensors, values = _shard(model, optimizer, Holdings.of(model, rt), rank)
    every = _gather(values, rank0_only=True)
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(tmp)))
    if rank == 0 and stateful:
        assert every_state is not None
        torch.save({"world_size": world, "entries": _merge_states(every_state)}, tmp / STATEFUL_FILE)
    # Each rank checksums the shards it wrote (DCP names them __<rank>_<i>.distcp); rank 0 the
    # rest, so no file is read twice.
    ours = [p for p in tmp.iterdir() if p.name.startswith(f"__{rank}_")
            or rank == 0 and not p.name.startswith("__")]
    sums = _gather({p.name: _digest(p) for p in ours}, rank0_only=True)
    if rank == 0:
        assert every is not None and sums is not None
        meta: dict[str, Any] = {"format": CHECKPOINT_FORMAT, "world_size": world,
                                "optimizer": None, "stateful": sorted(stateful),
                                "files": {n: s for part in sums for n, s in sorted(part.items())}}
        if optimizer is not None:
            assert groups is not None
            meta["optimizer"] = {
                "param_groups": [{**_hyper(g), "params": list(names)}
                                 for g, names in zip(optimizer.param_groups, groups, strict=True)],
                "values": {n: v for part in every for n, v in part.items()}}
        _write_json(tmp / META_FILE, meta)
    dist.barrier()
    if rank == 0:
        _publish(root, tmp_name, version)
    dist.barrier()


def _shard(model: nn.Module, optimizer: torch.optim.Optimizer | None, h: Holdings,
           rank: int) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """What this rank writes: DCP tensors by key, and non-tensor optimizer state by name."""
    tensors: dict[str, torch.Tensor] = {_MODEL + n: h.tensors[n].detach() for n in h.mine(rank)}
    values: dict[str, dict[str, Any]] = {}
    if optimizer is not None:
        for n, st in _local_optimizer_state(model, optimizer, h, rank).items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    tensors[f"{_OPTIM}{n}/{k}"] = v
                else:
                    values.setdefault(n, {})[k] = v
    return tensors, values


def _write_json(path: Path, obj: Any) -> None:
    try:
        text = json.dumps(obj, indent=1)
    except TypeError as e:
        raise RaNNCError(f"the optimizer's hyper-parameters or state hold a value JSON cannot store "
                         f"({e}); rannc checkpoints keep tensors and plain numbers only") from e
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _find(path: str | os.PathLike[str]) -> Path:
    """The version to load (rank 0 looks; every rank gets its answer or its error)."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        found = latest_checkpoint(path)
        box[0] = Path(found) if found is not None else (
            f"no rannc checkpoint in {os.fspath(path)!r} (no complete version: nothing named by "
            f"{LATEST}, no v-N directory with {META_FILE}); test with "
            "rannc.latest_checkpoint(dir) before resuming, and call save_checkpoint on every rank")
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise CheckpointError(box[0])
    return Path(box[0])


def _read_meta(where: Path) -> dict[str, Any]:
    path = where / META_FILE
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"checkpoint metadata {path} cannot be read ({type(e).__name__}: "
                              f"{_first_line(e)}); the file is truncated or damaged. Load an "
                              "older copy, or save again") from e
    if not isinstance(meta, dict) or meta.get("format") not in _READABLE:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"checkpoint {where} has format {got!r}, this rannc reads "
                              f"{sorted(_READABLE)}")
    return meta


def load_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    rt: PipelineRuntime | None, path: str | os.PathLike[str], strict: bool,
                    stateful: Mapping[str, Any]) -> dict[str, Any]:
    """Every rank reads the entries it holds (all of them before deployment) and its Stateful
    objects; returns key -> the loaded Stateful or value."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    _all_arrive("load_checkpoint")
    rank, world = dist.get_rank(), dist.get_world_size()
    where = _find(path)
    meta = _read_meta(where)
    _verify(where, meta.get("files", {}), rank, world)
    reader = _safe_reader(str(where))
    saved = reader.read_metadata().state_dict_metadata
    h = Holdings.of(model, rt)
    _check_keys(where, h, {k[len(_MODEL):] for k in saved if k.startswith(_MODEL)}, strict)
    want = _model_targets(where, h, saved)
    opt_keys: dict[str, list[str]] = {}
    held: set[str] = set()
    load_opt = optimizer is not None and meta["optimizer"] is not None
    if optimizer is None and meta["optimizer"] is not None and rank == 0:
        # (an optimizer built after wrapping becomes the model's only at its first step,
        # RaNNCModule._adopt: too late for this load)
        log.warning("rannc: %s holds optimizer state, and this model was given no optimizer, so "
                    "that state is not loaded. To resume it, pass the optimizer when wrapping "
                    "(RaNNCModule(model, optimizer)), or give it to the model before loading: "
                    "model.take_optimizer(optimizer)", where)
    if optimizer is not None and load_opt and not strict:
        load_opt = _optimizer_covered(where, meta["optimizer"]["param_groups"],
                                      group_names(model, optimizer))
    if optimizer is not None and load_opt:
        held = {n for names in group_names(model, optimizer) for n in names}
        if rt is not None and rt.plan.zero_stage:  # ZeRO-1: only the state this rank steps
            held = {n for n in held if h.source.get(n) == rank}
        for key, md in saved.items():
            if not key.startswith(_OPTIM):
                continue
            n, k = key[len(_OPTIM):].rsplit("/", 1)
            if n in held:
                want[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)  # type: ignore[union-attr]
                opt_keys.setdefault(n, []).append(k)
    targets = dict(want)
    try:
        dcp.load(want, storage_reader=reader)
    except CheckpointException as e:  # a BaseException: `except Exception` would miss it
        raise CheckpointError(f"reading checkpoint {where} failed ({_first_line(e)}): one of its "
                              f"files ({sorted(p.name for p in where.iterdir())[:8]}) is damaged "
                              "or missing. Load an older copy, or save again") from e
    with torch.no_grad():
        for key, t in targets.items():
            if key.startswith(_MODEL) and want[key] is not t:
                t.copy_(want[key])
    if optimizer is not None and load_opt:
        om = meta["optimizer"]
        state: dict[str, dict[str, Any]] = {n: dict(v) for n, v in om["values"].items() if n in held}
        for n, ks in opt_keys.items():
            for k in ks:
                state.setdefault(n, {})[k] = want[f"{_OPTIM}{n}/{k}"]
        load_optimizer_state(model, optimizer, {"state": state, "param_groups": om["param_groups"]})
    entries: dict[str, Any] = {}
    if stateful and (where / STATEFUL_FILE).exists():
        entries = torch.load(where / STATEFUL_FILE, weights_only=True)["entries"]
    return _restore(entries, stateful, where, strict, rank, world)


def _model_targets(where: Path, h: Holdings, saved: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """DCP key -> this rank's tensor, for the saved entries this rank holds (DCP loads in place)."""
    want: dict[str, torch.Tensor] = {}
    for n in h.persistent:
        key = _MODEL + n
        if n not in h.held or key not in saved:
            continue
        size = tuple(getattr(saved[key], "size", ()))
        if size != tuple(h.tensors[n].shape):
            raise CheckpointMismatchError(f"checkpoint {where}: {n} has shape {list(size)}, the "
                                          f"model's is {list(h.tensors[n].shape)}")
        want[key] = h.tensors[n].detach()
    return want


def _check_keys(where: Path, h: Holdings, saved: set[str], strict: bool) -> None:
    """load_state_dict(strict=True)'s rule over the whole model (so every rank agrees)."""
    missing = [n for n in h.persistent if n not in saved]
    unexpected = sorted(saved - set(h.persistent))
    if not (missing or unexpected):
        return
    if strict:
        raise CheckpointMismatchError(
            f"checkpoint {where} does not match the model: missing keys {missing[:8]}"
            f"{f' ({len(missing)} in all)' if len(missing) > 8 else ''}, unexpected keys "
            f"{unexpected[:8]}{f' ({len(unexpected)} in all)' if len(unexpected) > 8 else ''}. "
            "Was it saved from another model? Pass strict=False to load_checkpoint to load only "
            "the entries both have")
    log.warning("rannc: loading %s with strict=False: %d missing key(s) %s keep their values, "
                "%d unexpected key(s) %s are ignored", where, len(missing), missing[:5],
                len(unexpected), unexpected[:5])


def _optimizer_covered(where: Path, saved_groups: list[dict[str, Any]],
                       groups: list[list[str]]) -> bool:
    """Whether the saved param groups hold every parameter the optimizer steps (strict=False
    loads of another model's checkpoint): if not, the optimizer state is left as it is."""
    if len(saved_groups) == len(groups) and all(
            set(names) <= set(g["params"]) for g, names in zip(saved_groups, groups, strict=True)):
        return True
    log.warning("rannc: checkpoint %s: the saved optimizer param groups do not cover the "
                "optimizer's parameters; its state is left as it is (strict=False)", where)
    return False


def _safe_reader(path: str) -> Any:
    """A torch.distributed.checkpoint reader whose metadata file is read as
    `torch.load(weights_only=True)` would read it: only checkpoint-metadata classes, torch's
    dtypes, sizes and layouts and plain containers may be rebuilt. DCP itself uses `pickle.load`
    there, so a doctored `.metadata` file could run code on every rank that loads it."""
    import pickle

    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.metadata as md

    def allowed(module: str, name: str) -> Any:
        obj = getattr(md, name, None) if module == md.__name__ else None
        if isinstance(obj, type) and obj.__module__ == md.__name__:
            return obj
        if module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.memory_format, torch.layout)) or obj is torch.Size:
                return obj
        if (module, name) == ("torch.distributed.checkpoint.filesystem", "_StorageInfo"):
            return dcp.filesystem._StorageInfo  # a dataclass: file name, offset, length
        if (module, name) == ("torch.serialization", "_get_layout"):  # a name -> layout table
            return torch.serialization._get_layout
        if (module, name) in {("collections", "OrderedDict"), ("builtins", "set"),
                              ("builtins", "frozenset"), ("pathlib", "PosixPath"),
                              ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
                              ("pathlib", "PureWindowsPath")}:  # StorageMeta's checkpoint_id
            return getattr(__import__(module), name)
        return None

    class Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            obj = allowed(module, name)
            if obj is None:
                raise pickle.UnpicklingError(f"{module}.{name} is not checkpoint metadata")
            return obj

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> md.Metadata:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as f:
                try:
                    metadata = Restricted(f).load()
                except Exception as e:
                    raise RaNNCError(
                        f"checkpoint metadata {path} holds something other than checkpoint "
                        f"metadata ({type(e).__name__}: {str(e).splitlines()[0][:300]}); rannc "
                        "never unpickles arbitrary objects. Was the file written by "
                        "save_checkpoint()?") from e
            if not isinstance(metadata, md.Metadata):
                raise RaNNCError(f"checkpoint metadata {path} is a {type(metadata).__name__}, "
                                 "not torch.distributed.checkpoint metadata")
            storage = metadata.storage_meta or md.StorageMeta()
            storage.load_id = self.load_id
            metadata.storage_meta = storage
            return metadata

    return SafeReader(path)
