"""A model's own `torch.autograd.Function`s kept whole through capture, so that their backward
is the one they define.

torch.export (non-strict) runs a Function's `forward` and records the ops it calls; its
`backward` is dropped, and autograd of the recorded ops takes its place. Often that is the same
math (BLOOM's GELU with its analytic derivative), but many Functions exist precisely because
their backward is not the derivative of their forward: straight-through estimators
(quantisation-aware training), gradient reversal, gradients clipped or rescaled
(RecurrentGemma's `SqrtBoundDerivative`), a router's gradient estimate (PhiMoE's
`PhimoeMultiplier`: its router weights' gradients came out 20 to 70 % off). Under rannc such a
model trained, silently, with other gradients.

While rannc captures, `Function.apply` of a Function defined outside torch records one op
instead, `rannc::autograd_function(key, tensors) -> Tensor[]`, whose kernels call the Function
itself: the autograd kernel calls `apply` (so autograd records the Function's own backward, its
context, saved tensors and `needs_input_grad` as in eager), the fake kernel runs its `forward`
on fake tensors for the outputs' shapes. `key` names an entry of a process-wide table: the
Function, its arguments with the tensors taken out (non-tensor arguments are constants of the
capture, as torch.export makes every non-tensor value), and the outputs' structure. Every rank
captures its own graphs, so a key has to mean the same only within one process; plans name
tasks by index, never by key.

Traced as before (their ops recorded): Functions defined in torch itself (reentrant
checkpointing; torch's own are traced by design) and calls given no tensor. Refused with a
CaptureError naming the Function (kept whole they cannot be, traced they would be wrong):
keyword arguments, a symbolic size (`x.shape[0]` of a batch), and a forward that writes into
its input (`ctx.mark_dirty`). Non-tensor outputs are constants of the capture, as arguments are.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import is_fake
from torch.autograd.function import Function, FunctionCtx

from rannc.errors import CaptureError

OP_NAME = "rannc.autograd_function.default"

_LIB = torch.library.Library("rannc", "FRAGMENT")  # noqa: TOR901 - kernels registered below
_LIB.define("autograd_function(str key, Tensor[] tensors) -> Tensor[]",
            # its Function may draw random numbers: never folded into a constant at capture
            tags=(torch.Tag.nondeterministic_seeded,))


class _Tensor:
    """Where the i-th tensor argument goes in a call's arguments."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i

    def __repr__(self) -> str:
        return f"<tensor {self.i}>"


@dataclass
class _Entry:
    """One recorded call site: the Function, its arguments (tensors replaced by `_Tensor`s), and
    the structure of its outputs (found by the fake kernel, the first time it runs)."""

    fn: type[Function]
    args: tuple[Any, ...]
    out_spec: pytree.TreeSpec | None = None
    out_leaves: list[Any] = field(default_factory=list)  # tensors as `_Tensor`s

    def call_args(self, tensors: list[torch.Tensor]) -> tuple[Any, ...]:
        return tuple(pytree.tree_map_only(_Tensor, lambda p: tensors[p.i], self.args))


_TABLE: dict[str, _Entry] = {}
_state = threading.local()
_APPLY = Function.__dict__["apply"]  # the classmethod itself, put back as it was
_REAL_APPLY = _APPLY.__func__


def _entry(key: str) -> _Entry:
    try:
        return _TABLE[key]
    except KeyError:
        raise RuntimeError(f"rannc::autograd_function: no recorded Function '{key}' in this "
                           "process (a graph captured in another process?)") from None


def _flat_outputs(entry: _Entry, out: Any) -> list[torch.Tensor]:
    leaves, spec = pytree.tree_flatten(out)
    if entry.out_spec is None:
        entry.out_spec = spec
        entry.out_leaves = [_Tensor(i) if isinstance(x, torch.Tensor) else x
                            for i, x in enumerate(leaves)]
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def _run(key: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The Function itself on the call's arguments, its tensor outputs flattened."""
    entry = _entry(key)
    return _flat_outputs(entry, _REAL_APPLY(entry.fn, *entry.call_args(tensors)))


def _apply(key: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run time, above autograd: the Function itself, so its backward is recorded. While a
    graph is traced again (functionalisation), the op below autograd: recorded as it is."""
    if any(is_fake(t) for t in tensors):
        with torch._C._AutoDispatchBelowAutograd():
            return torch.ops.rannc.autograd_function.default(key, tensors)  # type: ignore[no-any-return]
    return _run(key, tensors)


def _below_autograd(key: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Called without autograd (inference mode): the forward alone."""
    with torch.no_grad():
        return _run(key, tensors)


def _fake(key: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The outputs' shapes: the forward on fake tensors, with a context that records what the
    Function asks of it. An output that is an input, or a view of one, is copied: the op's
    outputs are new tensors (at run time `apply` makes such outputs views, as in eager)."""
    entry = _entry(key)
    args = entry.call_args(tensors)
    # (a forward may choose what to save by needs_input_grad: as if every tensor needed one)
    ctx = _RecordingCtx(tuple(isinstance(a, torch.Tensor) for a in args))
    with torch.no_grad():
        if _has_setup_context(entry.fn):
            out = entry.fn.forward(*args)
            entry.fn.setup_context(ctx, args, out)
        else:
            out = entry.fn.forward(ctx, *args)
    if ctx.dirty:
        raise CaptureError(
            f"autograd.Function {_name(entry.fn)} writes into its input in place "
            "(ctx.mark_dirty); rannc keeps a model's own Functions whole, so their backward is "
            "theirs, but cannot keep one that writes into its input. Fix: return a new tensor "
            "from its forward instead of writing into the input")
    flat = _flat_outputs(entry, out)
    bases = {t.untyped_storage()._cdata for t in tensors if isinstance(t, torch.Tensor)}
    return [t.clone() if t.untyped_storage()._cdata in bases else t for t in flat]


_LIB.impl("autograd_function", _apply, "Autograd")
for _key_name in ("CPU", "CUDA"):  # not CompositeExplicitAutograd: export would trace into it
    _LIB.impl("autograd_function", _below_autograd, _key_name)
torch.library.register_fake("rannc::autograd_function", _fake, lib=_LIB)


class _RecordingCtx(FunctionCtx):
    """A context for a forward run only for its shapes: records `mark_dirty`."""

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.dirty = False
        self.needs_input_grad = needs_input_grad

    def mark_dirty(self, *args: torch.Tensor) -> None:
        self.dirty = True

    def save_for_backward(self, *tensors: torch.Tensor | None) -> None:
        pass

    def save_for_forward(self, *tensors: torch.Tensor | None) -> None:
        pass

    def mark_non_differentiable(self, *args: torch.Tensor) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


def _has_setup_context(fn: type[Function]) -> bool:
    return getattr(fn, "setup_context", None) is not getattr(Function, "setup_context", None)


def _name(fn: type) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def _kept_whole(fn: type[Function], args: tuple[Any, ...]) -> bool:
    """A model's own Function given a tensor (torch's own are traced by design)."""
    module = getattr(fn, "__module__", "") or ""
    if module == "torch" or module.startswith(("torch.", "rannc.")):
        return False
    return any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(args))


def _refuse(fn: type[Function], why: str, fix: str) -> CaptureError:
    return CaptureError(
        f"rannc could not capture the model: autograd.Function {_name(fn)} {why}. rannc keeps a "
        "model's own Functions whole, so that their backward is theirs (traced, autograd of "
        f"their forward's ops would replace it). Fix: {fix}")


def _key(fn: type[Function], template: tuple[Any, ...]) -> str:
    """The same key for the same Function and constants, so a model's layers share an entry
    and the captures of new input shapes reuse it: the table grows with a model's distinct
    call sites, not with its captures. The Function's id is in it (a class defined again
    under the same name, as a notebook cell run twice does, is another Function); it and any
    constant whose repr is its address (an object) stay alive in their entry, so no other
    object takes that address and its key. Keys differ between ranks; a plan names tasks, not
    keys."""
    digest = hashlib.sha1(repr(template).encode()).hexdigest()[:16]
    return f"{_name(fn)}@{id(fn):x}/{digest}"


def _traced_apply(cls: type[Function], *args: Any, **kwargs: Any) -> Any:
    if getattr(_state, "inside", False) or not _kept_whole(cls, args):
        return _REAL_APPLY(cls, *args, **kwargs)
    if kwargs:
        raise _refuse(cls, f"is applied with keyword arguments {sorted(kwargs)}",
                      "pass them positionally")
    symbolic = [x for x in pytree.tree_leaves(args)
                if isinstance(x, torch.SymInt | torch.SymFloat | torch.SymBool)]
    if symbolic:
        raise _refuse(cls, f"is given a symbolic size ({symbolic[0]}: the batch size, or a "
                           "size computed from it), which a kept call cannot hold as a constant",
                      "compute the size inside the Function's forward from its tensor inputs "
                      "(x.shape[0] there)")
    tensors: list[torch.Tensor] = []

    def take(x: torch.Tensor) -> _Tensor:
        tensors.append(x)
        return _Tensor(len(tensors) - 1)

    template = tuple(pytree.tree_map_only(torch.Tensor, take, args))
    key = _key(cls, template)
    entry = _TABLE.setdefault(key, _Entry(cls, template))
    _state.inside = True  # a Function applied inside this one's forward is traced as part of it
    try:
        flat = torch.ops.rannc.autograd_function(key, tensors)
    finally:
        _state.inside = False
    if entry.out_spec is None:  # the fake kernel did not run: nothing is kept whole
        raise CaptureError(f"autograd.Function {_name(cls)}: its outputs' structure was not "
                           "recorded while capturing")
    it = iter(flat)
    leaves = [next(it) if isinstance(x, _Tensor) else x for x in entry.out_leaves]
    return pytree.tree_unflatten(leaves, entry.out_spec)


@torch.compiler.disable
def _eager(key: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return torch.ops.rannc.autograd_function.default(key, tensors)  # type: ignore[no-any-return]


def eager_in_compile(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` with each kept Function called through a function torch.compile does not trace
    (a graph break there): compiled, the op's autograd kernel, which records the Function's own
    backward, would be replaced by autograd of what the fake kernel traced. The stage module
    itself is changed (it is compiled, not run, after this)."""
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.rannc.autograd_function.default:
            node.target = _eager
            changed = True
    if changed:
        gm.recompile()
    return gm


@contextlib.contextmanager
def kept_whole() -> Iterator[None]:
    """While capturing: a model's own Functions recorded as one op each (see the module doc)."""
    Function.apply = classmethod(_traced_apply)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        Function.apply = _APPLY  # type: ignore[method-assign]
