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
JSON file, never a pickle. A save is written into a temporary directory beside the target and
renamed into place by rank 0 once every rank has written, so a crash mid-save leaves the
previous checkpoint whole.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rannc.errors import RaNNCError
from rannc.graph.task_graph import ValueKind
from rannc.pipeline.runtime import PipelineRuntime

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
META_FILE = "rannc_meta.json"
_MODEL, _OPTIM = "model/", "optim/"  # DCP key prefixes: "model/<name>", "optim/<name>/<state key>"


@dataclass(frozen=True, slots=True)
class Holdings:
    """Where every state-dict entry of the model lives; identical on every rank."""

    tensors: dict[str, torch.Tensor]  # canonical name -> this rank's tensor (empty if released)
    canonical: dict[str, str]  # every parameter/buffer name -> its canonical name
    persistent: tuple[str, ...]  # canonical names of state-dict entries, in state-dict order
    source: dict[str, int]  # canonical name -> the rank whose copy is authoritative
    held: frozenset[str]  # canonical names whose tensor this rank holds

    @classmethod
    def of(cls, model: nn.Module, rt: PipelineRuntime | None) -> Holdings:
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
        for n, ranks in _holders(rt, canonical).items():
            source[n] = min(ranks)
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


def _holders(rt: PipelineRuntime, canonical: Mapping[str, str]) -> dict[str, tuple[int, ...]]:
    """Canonical name -> the ranks of the stage whose copy counts: parameters, every stage
    holding them (their copies are equal); buffers, the first stage reading them."""
    out: dict[str, set[int]] = {}
    for st in rt.plan.stages:
        for n in st.param_names:
            out.setdefault(canonical[n], set()).update(st.ranks)
    graph = rt.graph
    for s, sg in enumerate(rt.stages):
        for v in sg.inputs:
            val = graph.values[v]
            c = canonical.get(val.target or "") if val.kind is ValueKind.BUFFER else None
            if c is not None and c not in out:
                out[c] = set(rt.plan.stages[s].ranks)
    return {n: tuple(sorted(r)) for n, r in out.items()}


# -- a gathered state dict -----------------------------------------------------------------------

def gather_state_dict(model: nn.Module, rt: PipelineRuntime, rank0_only: bool,
                      prefix: str = "") -> dict[str, Any]:
    """The full state dict, each entry from its source rank (collective)."""
    h = Holdings.of(model, rt)
    rank = dist.get_rank()
    mine = {n: h.tensors[n].detach().cpu() for n in h.mine(rank)}
    parts = _gather(mine, rank0_only)
    if parts is None:
        return {}
    whole: dict[str, torch.Tensor] = {}
    for p in parts:
        whole.update(p)
    local = model.state_dict(keep_vars=False)
    out = type(local)()
    for k, v in local.items():  # the unwrapped model's keys, order and aliases
        out[prefix + k] = whole[h.canonical[k]] if k in h.canonical else v
    meta = getattr(local, "_metadata", None)
    if meta is not None:
        out._metadata = type(meta)((prefix + k if k else prefix.rstrip("."), v)  # type: ignore[attr-defined]
                                   for k, v in meta.items())
    return out


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

def group_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The canonical names of each param group's parameters."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    out = []
    for g in optimizer.param_groups:
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
        return {}
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
                         state_dict: Mapping[str, Any]) -> None:
    """Load a by-name optimizer state dict into this rank's (possibly pruned) optimizer."""
    if not {"state", "param_groups"} <= set(state_dict):
        raise RaNNCError("an optimizer state dict by name has 'state' and 'param_groups' (from "
                         "RaNNCModule.optimizer_state_dict())")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise RaNNCError(f"the optimizer state dict has {len(saved_groups)} param group(s), the "
                         f"optimizer {len(optimizer.param_groups)}")
    by_name = state_dict["state"]
    state: dict[int, Any] = {}
    groups = []
    i = 0
    for g_idx, (saved, names) in enumerate(zip(saved_groups, group_names(model, optimizer),
                                               strict=True)):
        extra = set(names) - set(saved["params"])
        if extra:
            raise RaNNCError(f"param group {g_idx} of the optimizer holds {sorted(extra)[:3]}, "
                             "which the saved param group does not")
        idx = []
        for n in names:
            if n in by_name:
                state[i] = by_name[n]
            idx.append(i)
            i += 1
        cur = optimizer.param_groups[g_idx]
        hyper = {k: tuple(v) if isinstance(cur.get(k), tuple) and isinstance(v, list) else v
                 for k, v in _hyper(saved).items()}
        groups.append({**hyper, "params": idx})
        if "param_names" in cur:
            groups[-1]["param_names"] = list(cur["param_names"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# -- sharded checkpoints ----------------------------------------------------------------------------

def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    rt: PipelineRuntime | None, groups: list[list[str]] | None,
                    path: str | os.PathLike[str]) -> None:
    """Every rank writes the entries it is the source of; rank 0 moves the result into place."""
    import torch.distributed.checkpoint as dcp

    final = Path(path)
    rank = dist.get_rank()
    box = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    tmp = final.with_name(f"{final.name}.tmp-{box[0]}")
    h = Holdings.of(model, rt)
    tensors: dict[str, torch.Tensor] = {_MODEL + n: h.tensors[n].detach() for n in h.mine(rank)}
    values: dict[str, dict[str, Any]] = {}
    if optimizer is not None:
        for n, st in _local_optimizer_state(model, optimizer, h, rank).items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    tensors[f"{_OPTIM}{n}/{k}"] = v
                else:
                    values.setdefault(n, {})[k] = v
    every = _gather(values, rank0_only=True)
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(tmp)))
    if rank == 0:
        assert every is not None
        meta: dict[str, Any] = {"format": CHECKPOINT_FORMAT, "world_size": dist.get_world_size(),
                                "optimizer": None}
        if optimizer is not None:
            assert groups is not None
            meta["optimizer"] = {
                "param_groups": [{**_hyper(g), "params": list(names)}
                                 for g, names in zip(optimizer.param_groups, groups, strict=True)],
                "values": {n: v for part in every for n, v in part.items()}}
        _write_json(tmp / META_FILE, meta)
    dist.barrier()
    if rank == 0:
        _publish(tmp, final)
    dist.barrier()


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


def _publish(tmp: Path, final: Path) -> None:
    """Move a completely written checkpoint into place. A previous checkpoint is first renamed
    aside, so at every moment one whole checkpoint exists (`_resolve` finds an aside one)."""
    old = final.with_name(f"{final.name}.old-{tmp.name.rsplit('-', 1)[-1]}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)
    for stale in final.parent.glob(f"{final.name}.tmp-*"):  # left by saves that crashed
        shutil.rmtree(stale, ignore_errors=True)


def _resolve(path: str | os.PathLike[str]) -> Path:
    """The checkpoint directory; after a crash between _publish's two renames, the aside one."""
    final = Path(path)
    if (final / META_FILE).exists():
        return final
    aside = sorted(final.parent.glob(f"{final.name}.old-*"))
    if not final.exists() and len(aside) == 1 and (aside[0] / META_FILE).exists():
        log.warning("rannc: %s is missing; loading %s (a save was interrupted)", final, aside[0])
        return aside[0]
    raise RaNNCError(f"no rannc checkpoint at {final} (no {META_FILE} in it)")


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


def load_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    rt: PipelineRuntime | None, path: str | os.PathLike[str]) -> None:
    """Every rank reads the entries it holds (all of them before deployment)."""
    import torch.distributed.checkpoint as dcp

    where = _resolve(path)
    with open(where / META_FILE) as f:
        meta = json.load(f)
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise RaNNCError(f"checkpoint {where} has format {meta.get('format')!r}, this rannc reads "
                         f"{CHECKPOINT_FORMAT}")
    reader = _safe_reader(str(where))
    saved = reader.read_metadata().state_dict_metadata
    h = Holdings.of(model, rt)
    want: dict[str, torch.Tensor] = {}
    missing = []
    for n in h.persistent:
        if n not in h.held:
            continue
        key = _MODEL + n
        if key not in saved:
            missing.append(n)
            continue
        size = tuple(getattr(saved[key], "size", ()))
        if size != tuple(h.tensors[n].shape):
            raise RaNNCError(f"checkpoint {where}: {n} has shape {list(size)}, the model's is "
                             f"{list(h.tensors[n].shape)}")
        want[key] = h.tensors[n].detach()
    if missing:
        raise RaNNCError(f"checkpoint {where} lacks {len(missing)} entr(ies) of the model, e.g. "
                         f"{missing[:5]}; was it saved from another model?")
    opt_keys: dict[str, list[str]] = {}
    if optimizer is not None and meta["optimizer"] is not None:
        held = {n for names in group_names(model, optimizer) for n in names}
        for key, md in saved.items():
            if not key.startswith(_OPTIM):
                continue
            n, k = key[len(_OPTIM):].rsplit("/", 1)
            if n in held:
                want[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)  # type: ignore[union-attr]
                opt_keys.setdefault(n, []).append(k)
    targets = dict(want)
    dcp.load(want, storage_reader=reader)
    with torch.no_grad():
        for key, t in targets.items():
            if key.startswith(_MODEL) and want[key] is not t:
                t.copy_(want[key])
    if optimizer is not None and meta["optimizer"] is not None:
        om = meta["optimizer"]
        state: dict[str, dict[str, Any]] = {n: dict(v) for n, v in om["values"].items() if n in held}
        for n, ks in opt_keys.items():
            for k in ks:
                state.setdefault(n, {})[k] = want[f"{_OPTIM}{n}/{k}"]
        load_optimizer_state(model, optimizer, {"state": state, "param_groups": om["param_groups"]})
