"""Selective recomputation at run time: while a stage part runs forward, each activation the
plan drops (`rannc.profile.saved.recomputable`: outputs of cheap elementwise ops whose inputs
are kept anyway, and views of them) is noted with its op and inputs; when autograd saves it for
backward, a saved-tensor hook keeps that recipe instead of the tensor, and when backward reads
it the op runs again on the same inputs (no grad; the same bits: elementwise, no random
numbers). Every other saved tensor is kept detached, so no saved tensor refers back to the
graph through its own node (a cycle through C++ that would keep a split backward's graph
alive: `rannc.pipeline.split_backward`).

A recipe holds its inputs: tensors autograd keeps anyway (the rule's condition) or other
recipes, never the dropped tensor, which is freed once forward is done with it. Each read
rebuilds it: the cost model charges every read (`Recomputable.evals`).

torch.utils.checkpoint's selective policy keeps the same kind of choice, but recomputes a
region once per backward call and refuses a second: a zero-bubble schedule's W pass is one.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from rannc.graph.capture import AutocastState, autocast_state, running_as


class Recipe:
    """An op and its inputs (tensors, detached, or other recipes) to rebuild a dropped value."""

    __slots__ = ("args", "fn", "kwargs")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs

    def build(self) -> torch.Tensor:
        def real(a: Any) -> Any:
            return a.build() if isinstance(a, (Recipe, ViewOf)) else a

        with torch.no_grad():
            return self.fn(*tree_map(real, self.args), **tree_map(real, self.kwargs))


class ViewOf:
    """A view of a recipe's value (what a composite op such as `linear` saves: its input
    reshaped): rebuilt as the same strides over the rebuilt value."""

    __slots__ = ("offset", "recipe", "size", "stride")

    def __init__(self, recipe: Recipe, size: tuple[int, ...], stride: tuple[int, ...],
                 offset: int) -> None:
        self.recipe, self.size, self.stride, self.offset = recipe, size, stride, offset

    def build(self) -> torch.Tensor:
        base = self.recipe.build()
        return base.as_strided(self.size, self.stride, base.storage_offset() + self.offset)


class Recorder:
    """The recipes of one forward of one stage part (`saving`), and the saved-tensor hooks."""

    def __init__(self, track: bool = False) -> None:
        """`track`: record the storages autograd keeps through these hooks (`kept_bytes`)."""
        # storage address -> (the value, weakly; its recipe): autograd may save the value or a
        # view of it (a composite op's reshaped input), found by the storage either way
        self._made: dict[int, tuple[weakref.ref[torch.Tensor], Recipe]] = {}
        self._on = False
        self.dropped = 0  # tensors saved as recipes (for tests and logs)
        self._kept: dict[int, int] | None = {} if track else None  # storage address -> bytes
        # autocast as the forward ran: a recipe rebuilds in backward, outside the user's autocast
        # block, where an op autocast runs in float32 (CUDA: pow, exp, ...) would otherwise
        # rebuild in the input's lower precision
        self._autocast: AutocastState = ()

    def note(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
             out: Any) -> None:
        if not self._on or not isinstance(out, torch.Tensor):
            return

        def arg(a: Any) -> Any:
            if isinstance(a, torch.Tensor):
                hit = self._recipe(a)  # (a recipe's input is a recipe, a view of one, or kept)
                return hit if hit is not None else a.detach()
            return a

        recipe = Recipe(fn, tree_map(arg, args), tree_map(arg, kwargs))
        self._made[_address(out)] = (weakref.ref(out), recipe)

    def _recipe(self, t: torch.Tensor) -> Recipe | ViewOf | None:
        """t's recipe, if t is a noted value or a view of one."""
        hit = self._made.get(_address(t))
        if hit is None:
            return None
        value = hit[0]()
        if value is None or _address(value) != _address(t):  # freed; the address reused
            return None
        if t is value:
            return hit[1]
        return ViewOf(hit[1], tuple(t.size()), tuple(t.stride()),
                      int(t.storage_offset() - value.storage_offset()))

    def _pack(self, t: torch.Tensor) -> Any:
        hit = self._recipe(t)
        if hit is not None:
            self.dropped += 1
        out = hit if hit is not None else t.detach()
        if self._kept is not None:
            self._track(out)
        return out

    def _track(self, x: Any) -> None:
        if isinstance(x, ViewOf):
            self._track(x.recipe)
        elif isinstance(x, Recipe):
            for a in (*x.args, *x.kwargs.values()):
                self._track(a)
        elif isinstance(x, torch.Tensor) and self._kept is not None:
            st = x.untyped_storage()
            self._kept[st.data_ptr()] = st.nbytes()

    def kept_bytes(self, skip: Collection[int] = ()) -> int:
        """With `track`: the bytes of the distinct storages autograd has kept through these
        hooks (a recipe's inputs included), less those at the addresses `skip` (parameters,
        model inputs)."""
        assert self._kept is not None, "Recorder(track=True) records what is kept"
        return sum(n for ptr, n in self._kept.items() if ptr not in skip)

    def _unpack(self, x: Any) -> torch.Tensor:
        if not isinstance(x, (Recipe, ViewOf)):
            return x
        with running_as(self._autocast):
            return x.build()

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Run a forward whose dropped values autograd keeps as recipes."""
        self._on = True
        self._autocast = autocast_state()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._on = False
            self._made.clear()


def _address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def instrument(gm: fx.GraphModule, values: Collection[str], recorder: Recorder) -> int:
    """Make the nodes of `gm` that compute `values` note their recipes with `recorder`;
    returns how many. (Node names are the graph's value names: `build_stage_module`.)"""
    n = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.name in values:
            node.target = _noting(node.target, recorder)
            n += 1
    if n:
        gm.recompile()
    return n


def _noting(fn: Callable[..., Any], recorder: Recorder) -> Callable[..., Any]:
    def noted(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        recorder.note(fn, args, kwargs, out)
        return out

    noted.__name__ = noted.__qualname__ = f"noted_{getattr(fn, '__name__', 'op').replace('.', '_')}"
    return noted


__all__ = ["Recipe", "Recorder", "ViewOf", "instrument"]
