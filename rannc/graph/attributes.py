"""Python values a capture read from the model, guarded at every call.

rannc runs the graph torch.export recorded. A plain Python value the model's code read while
it was recorded (`self.scale`, a dropout's `p`, `self.config.output_hidden_states`, a
temperature annealed between epochs) is a constant of that graph: changed after the capture,
the unwrapped model would compute with the new value and the graph with the old one. So,
as torch.compile guards what it specialised on, a capture records every such read and a call
reuses the capture only while each value read is what it was (`Reads.hold`); otherwise the
model is captured again (`Reads.changed` names what changed, for logs and for ranks that do
not agree).

What is recorded, while torch.export runs the model's code: an attribute read from a module
of the model, or from a Hugging Face config one of them holds, whose value is in the object's
own `__dict__` and is plain (None, bool, int, float, str, torch.dtype, or a tuple, list or
dict of up to 64 of them: PEFT's `merged_adapters` after `merge_adapter()`, its `scaling` after
`set_scale()`; a list or dict is compared by its contents with a copy taken when read), or
is a tensor that is neither a parameter nor a buffer (`self.mask = torch.ones(...)`): torch.export
makes such a tensor a constant of the graph, which holds the tensor object itself, so a change in
place reaches the graph but a new tensor assigned to the attribute would not. A tensor is
guarded by identity (its contents are the graph's).
Not recorded: `training` (part of the capture key as the modes: `ModelState.modes`), what
nn.Module keeps for itself (hooks, `_parameters`, ...), attributes of the class, values that
are other objects (a list holding tensors or modules, a longer list: not followed), and attributes the forward
writes itself (`self.calls += 1`): torch.export puts those back after the trace, so they keep
the value the capture read, and a guard on them would say nothing new.

Also recorded: `torch.is_grad_enabled()` called from the model's code (not torch's own), a
model that computes otherwise under `torch.no_grad()`: its capture holds for calls in the grad
mode it was captured in (a `Read` of owner None, label `torch.is_grad_enabled()`).

How: `nn.Module.__getattribute__` (which nn.Module leaves to `object`) and the config class's
own `__getattribute__` are replaced for the time of the export by functions that record a
read of a watched object; nn.Module's `__setattr__` likewise records writes.
"""

from __future__ import annotations

import contextlib
import os
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rannc.graph.hooks import TORCH_DIR

_PLAIN = (type(None), bool, int, float, str, torch.dtype)
# what every nn.Module keeps in its __dict__ for itself (hooks, tables, the mode)
_MODULE_OWN = frozenset(nn.Module().__dict__) | {"training", "_compiled_call_impl"}
_MISSING = object()
_RANNC_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep
_GRAD_MODE = "is_grad_enabled()"  # (the name of the grad mode's read, owner None, where "torch")


_MAX_ITEMS = 64  # the longest tuple, list or dict of plain values guarded (by its contents)


def _plain(v: Any) -> bool:
    t = type(v)
    if t in _PLAIN:
        return True
    if t is tuple or t is list:
        return len(v) <= _MAX_ITEMS and all(type(x) in _PLAIN for x in v)
    return t is dict and len(v) <= _MAX_ITEMS and all(
        type(k) in _PLAIN and type(x) in _PLAIN for k, x in v.items())


def _snapshot(v: Any) -> Any:
    """What a guard compares with: a copy of a list or dict (changed in place later, the copy
    keeps what the capture read), the value itself otherwise."""
    t = type(v)
    return list(v) if t is list else dict(v) if t is dict else v


def _tensor(v: Any) -> bool:
    return type(v) is torch.Tensor  # (not a Parameter: those are in `_parameters`)


def _same(a: Any, b: Any) -> bool:
    # (1 == 1.0 == True: a value of another type is another value; a NaN read back is the same
    # object when nothing changed it; a tensor is the same object or another)
    return a is b or (type(a) is type(b) and not _tensor(a) and a == b)


def _shown(v: Any) -> str:
    if _tensor(v):
        return f"a tensor of shape {tuple(v.shape)} and {v.dtype}"
    if type(v) is dict:  # by key: equal dicts built in another order (a set's) read the same
        return "{" + ", ".join(f"{k!r}: {x!r}" for k, x in sorted(v.items(), key=repr)) + "}"
    return "(deleted)" if v is _MISSING else repr(v)


@dataclass(frozen=True, slots=True)
class Read:
    """One plain value the capture read: `where.name` was `value`."""

    owner: Any  # the module or config (None: the grad mode, `torch.is_grad_enabled()`)
    where: str  # its path in the model ("" the model; "encoder.config")
    name: str
    value: Any

    @property
    def label(self) -> str:
        return f"{self.where}.{self.name}" if self.where else self.name


class Reads:
    """The plain values one capture read (see the module doc)."""

    def __init__(self, reads: tuple[Read, ...] = ()) -> None:
        self.reads = reads
        # (the owners' instance dicts, looked up once: a config's own __getattribute__ is slow)
        self._checks = [(object.__getattribute__(r.owner, "__dict__"), r.name, r.value)
                        for r in reads if r.owner is not None and not _tensor(r.value)]
        self._tensors = [(object.__getattribute__(r.owner, "__dict__"), r.name, r.value)
                         for r in reads if r.owner is not None and _tensor(r.value)]
        self._grad = next((r.value for r in reads if r.owner is None), None)
        # (a short name for these values, for the call mode every rank agrees on: a tensor by
        # its shape and dtype, as its identity is each rank's own)
        shown = tuple(f"{r.label}={_shown(r.value)}" for r in reads)
        self.digest = f"{zlib.crc32(repr(shown).encode()):08x}"

    def __repr__(self) -> str:
        return f"Reads({len(self.reads)} values)"

    def hold(self) -> bool:
        """Every value read is still what the capture read (a few dict lookups per value; at
        every call)."""
        for d, name, value in self._checks:
            now = d.get(name, _MISSING)
            if now is not value and (type(now) is not type(value) or now != value):
                return False
        for d, name, value in self._tensors:
            if d.get(name, _MISSING) is not value:
                return False
        return self._grad is None or torch.is_grad_enabled() is self._grad

    def changed(self) -> list[tuple[Read, Any]]:
        """(read, value now) of each value that is no longer what the capture read."""
        out = []
        for r in self.reads:
            now = torch.is_grad_enabled() if r.owner is None \
                else object.__getattribute__(r.owner, "__dict__").get(r.name, _MISSING)
            if not _same(now, r.value):
                out.append((r, now))
        return out

    def values(self) -> tuple[str, ...]:
        """The values read, in order, as their reprs (part of the capture's key beside its
        inputs' shapes; as text because 1 == 1.0 == True; a tensor by its identity)."""
        return tuple(f"{r.label}=tensor at {id(r.value):x}" if _tensor(r.value)
                     else f"{r.label}={r.value!r}" for r in self.reads)


NONE = Reads()


def describe(changes: list[tuple[Read, Any]], limit: int = 3) -> str:
    """'layers.0.dropout.p 0.1 -> 0.0, ...' for messages."""
    shown = [f"{r.label} {_shown(r.value)} -> "
             + ("another tensor" if _tensor(r.value) and _tensor(now) else _shown(now))
             for r, now in changes[:limit]]
    more = f" and {len(changes) - limit} more" if len(changes) > limit else ""
    return ", ".join(shown) + more


def _is_config(obj: Any) -> bool:
    return any(c.__name__ in ("PretrainedConfig", "PreTrainedConfig") for c in type(obj).__mro__)


class _Recorder:
    def __init__(self, model: nn.Module) -> None:
        self.where: dict[int, str] = {}
        self.objects: list[Any] = []  # (kept alive while recording: ids stay theirs)
        config_classes: set[type] = set()
        for path, m in model.named_modules(remove_duplicate=False):
            if id(m) not in self.where:
                self.where[id(m)] = path
                self.objects.append(m)
            for key, v in m.__dict__.items():
                if _is_config(v) and id(v) not in self.where:
                    self.where[id(v)] = f"{path}.{key}" if path else key
                    self.objects.append(v)
                    config_classes.add(type(v))
        # the class in each config's MRO that defines the __getattribute__ it uses
        self.config_owners = {next(c for c in cls.__mro__ if "__getattribute__" in c.__dict__)
                              for cls in config_classes} - {object}
        self.seen: set[tuple[int, str]] = set()
        self.written: set[tuple[int, str]] = set()
        self.reads: list[Read] = []
        self.grad_mode: bool | None = None  # what torch.is_grad_enabled() gave the model's code

    def read(self, obj: Any, name: str, value: Any) -> None:
        key = (id(obj), name)
        if key in self.seen or key[0] not in self.where or name in _MODULE_OWN:
            return
        self.seen.add(key)
        if key in self.written or not (_plain(value) or _tensor(value)):
            return
        if object.__getattribute__(obj, "__dict__").get(name, _MISSING) is not value:
            return  # (a class attribute or a property's result)
        self.reads.append(Read(obj, self.where[key[0]], name, _snapshot(value)))

    def wrote(self, obj: Any, name: str) -> None:
        if id(obj) in self.where:
            self.written.add((id(obj), name))

    def unreturned_writes(self) -> list[str]:
        """'path.name' of each attribute forward assigned a value computed from tensors that
        the graph does not return (`CapturedModel.stored` takes tensors only): a number from a
        tensor's values (`self.stat = loss.item()`), tensors inside a list, tuple or dict."""
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
        from torch.utils._pytree import tree_leaves

        def computed(v: Any) -> bool:
            if isinstance(v, list | tuple | dict):
                # (the module's own parameters listed again, as torch's LSTM keeps
                # `_flat_weights`, are nothing forward computed)
                tensors = [x for x in tree_leaves(v) if isinstance(x, torch.Tensor)]
                return any(not isinstance(x, nn.Parameter) for x in tensors)
            return isinstance(v, torch.SymFloat | torch.SymBool) or (
                isinstance(v, torch.SymInt) and bool(free_unbacked_symbols(v)))

        return [f"{where}.{name}" if where else name
                for _obj, where, name, v in self._written_values() if computed(v)]

    def tensor_writes(self) -> list[tuple[str, str, torch.Tensor]]:
        """(module path, name, value) of each attribute of a module of the model that the
        forward so far assigned a tensor to (`self.aux_loss = ...`, `self.attn = p.detach()`),
        as it holds now, in a fixed order (every rank captures the same)."""
        return [(where, name, v) for obj, where, name, v in self._written_values()
                if isinstance(obj, nn.Module) and isinstance(v, torch.Tensor)]

    def _written_values(self) -> Iterator[tuple[Any, str, str, Any]]:
        """(object, its path, name, value now) of each attribute forward wrote, by object in
        the model's order and by name."""
        for obj in self.objects:
            d = object.__getattribute__(obj, "__dict__")
            for name in sorted(n for i, n in self.written if i == id(obj)):
                yield obj, self.where[id(obj)], name, d.get(name)

    def carried(self) -> list[Read]:
        """The tensors forward read from an attribute and then replaced (state carried from
        one call to the next, as Transformer-XL's memory `self.mems = h.detach()`)."""
        return [r for r in self.reads if _tensor(r.value) and (id(r.owner), r.name) in self.written]

    def result(self) -> Reads:
        """The reads whose value is still the one read (see the module doc: what the forward
        wrote itself is left out, but for a tensor it read first (`carried`): the graph holds
        the tensor it read as a constant, so the capture holds while the attribute is that
        tensor; the next call, after the call stored a new one, captures again)."""
        carried = {(id(r.owner), r.name) for r in self.carried()}
        keep = [r for r in self.reads
                if ((id(r.owner), r.name) not in self.written or (id(r.owner), r.name) in carried)
                and _same(object.__getattribute__(r.owner, "__dict__").get(r.name, _MISSING),
                          r.value)]
        if self.grad_mode is not None:
            keep.append(Read(None, "torch", _GRAD_MODE, self.grad_mode))
        return Reads(tuple(keep))


@contextlib.contextmanager
def recorded(model: nn.Module) -> Iterator[_Recorder]:
    """While the block runs (torch.export of `model`), record the plain values read from the
    model's modules and configs; `.result()` after it."""
    rec = _Recorder(model)
    had_get = "__getattribute__" in nn.Module.__dict__
    real_set = nn.Module.__setattr__

    def module_get(self: Any, name: str) -> Any:
        value = object.__getattribute__(self, name)
        rec.read(self, name, value)
        return value

    def module_set(self: nn.Module, name: str, value: Any) -> None:
        rec.wrote(self, name)
        real_set(self, name, value)

    originals = {cls: cls.__dict__["__getattribute__"] for cls in rec.config_owners}
    real_grad = torch.is_grad_enabled

    def is_grad_enabled() -> bool:
        value = real_grad()
        if rec.grad_mode is None and not sys._getframe(1).f_code.co_filename.startswith(
                (TORCH_DIR, _RANNC_DIR)):
            rec.grad_mode = value
        return value

    def config_get(real: Any) -> Any:
        def get(self: Any, name: str) -> Any:
            value = real(self, name)
            rec.read(self, name, value)
            return value
        return get

    assert not had_get, "nn.Module defines __getattribute__ (another recorder running?)"
    nn.Module.__getattribute__ = module_get  # type: ignore[method-assign,assignment]
    nn.Module.__setattr__ = module_set  # type: ignore[method-assign]
    for cls, real in originals.items():
        cls.__getattribute__ = config_get(real)  # type: ignore[method-assign]
    torch.is_grad_enabled = is_grad_enabled
    try:
        yield rec
    finally:
        del nn.Module.__getattribute__
        nn.Module.__setattr__ = real_set  # type: ignore[method-assign]
        torch.is_grad_enabled = real_grad
        for cls, real in originals.items():
            cls.__getattribute__ = real  # type: ignore[method-assign]


__all__ = ["NONE", "Read", "Reads", "describe", "recorded"]
