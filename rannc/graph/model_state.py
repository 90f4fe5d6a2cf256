"""The model's parameters and buffers by name, for every call, without walking the module tree.

Why: a call binds the graph's parameter and buffer inputs to the model's own tensors (so that
autograd and in-place updates reach them), and BatchNorm's deferred statistics read the
running buffers. `named_parameters()` / `named_buffers()` walk every module through generators
each time: on a ResNet stage 237 walks a step, about 1 ms of each rank's CPU (cProfile,
BENCHMARKS.md "Per-call lookups"). The tree almost never changes between calls.

How: the dictionaries are built once, with each tensor's slot (the module and the key in its
`_parameters` / `_buffers`) and every parent-child link of the tree. A call checks those by
identity (a few hundred dict lookups, no generators) and builds the dictionaries again where
anything was replaced: a parameter reassigned (`m.weight = nn.Parameter(...)`), a buffer
re-registered, a submodule swapped or removed. So a call sees exactly what
`named_parameters(remove_duplicate=False)` would give it, as before.

It also says what of the tree a capture depends on (`capture_key`): the modules, the names of
the parameters and buffers, each module's mode, and the forward hooks (what a hook computes into
a module's input or output is recorded in the graph, so one added or removed after a capture
needs a capture of its own; a backward hook added is then refused by the capture).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _module
from torch.utils.hooks import RemovableHandle

# The hook tables a capture depends on: forward hooks change what the graph computes; backward
# hooks are refused at capture (graph/hooks.py), so one added later must reach a capture too.
_HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")
# set on a hook rannc registers on the model itself (it changes nothing a capture records):
# not part of the capture key, nor of what the ranks compare
RANNC_OWN_HOOK = "_rannc_own_hook"


@dataclass(frozen=True, slots=True)
class _Slot:
    owner: nn.Module
    table: str  # "_parameters" or "_buffers"
    key: str
    value: torch.Tensor


class ModelState:
    """`params()` and `buffers()` of one model: `dict(model.named_parameters(
    remove_duplicate=False))` and the same for buffers, kept between calls while the module
    tree holds the same tensors (see the module docstring). Callers read the dictionaries and
    must not change them."""

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)  # (held by `model_state` beside the model: not kept alive)
        self._params: dict[str, torch.Tensor] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        self._slots: list[_Slot] = []
        self._links: list[tuple[nn.Module, str, nn.Module]] = []  # (parent, name, child)
        self._named: list[tuple[str, nn.Module]] = []  # every module but the model itself
        self.builds = 0  # how often the dictionaries were built (tests read it)
        # how often a module of the tree was replaced, added or removed, or a parameter or
        # buffer added or removed (`capture_key`)
        self.tree_version = 0
        # the hooks of the last look (`hooks()`): the key, the handle count then, and each
        # non-empty table with its length (a hook added takes a new handle id; one removed
        # shortens its table)
        self._hook_key: tuple[tuple[str, str, tuple[int, ...]], ...] = ()
        self._hook_next_id = -1
        self._hook_sizes: list[tuple[dict[int, object], int]] = []
        self.checks = 0  # how often the tree was checked (tests read it)
        # every parameter's and buffer's dtype, as last seen -> its runs (`dtypes()`)
        self._dtype_runs: dict[tuple[torch.dtype, ...], tuple[tuple[str, torch.dtype], ...]] = {}
        self._first_dtypes: tuple[tuple[str, torch.dtype], ...] | None = None  # (`capture_key`)
        self._held = 0  # open `unchanged()` blocks: the tree was checked at the outermost
        self._build()

    def params(self) -> dict[str, torch.Tensor]:
        self._check()
        return self._params

    def buffers(self) -> dict[str, torch.Tensor]:
        self._check()
        return self._buffers

    def both(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(`params()`, `buffers()`) after one check of the tree."""
        self._check()
        return self._params, self._buffers

    def modes(self) -> tuple[str, ...]:
        """The modules whose mode (`training`) is not the model's own: a BatchNorm frozen with
        `.eval()` under `model.train()`, dropout kept on with `.train()` under `model.eval()`.
        Part of a capture's key: the graph records each module's mode (BatchNorm's batch or
        running statistics, dropout or none), so a module switched after a capture needs a
        capture of its own."""
        self._check()
        model = self._model()
        assert model is not None, "ModelState of a model that is gone"
        root = model.training
        return tuple(path for path, m in self._named if m.training != root)

    def capture_key(self) -> tuple[int, tuple[str, ...], tuple[tuple[str, str, tuple[int, ...]], ...],
                                   tuple[tuple[str, torch.dtype], ...]]:
        """What of the module tree a capture depends on beside its inputs: the tree's version
        (a module swapped, `model.act = nn.GELU()`, runs other code than the captured graph
        recorded; a parameter removed, as pruning does, leaves an input of it unbound: each
        needs a capture of its own), `modes()`, `hooks()` and `dtypes()` (empty while they are
        as the first time this was asked: what calls and errors show stays as it was)."""
        with self.unchanged():  # (one check of the tree for all)
            dtypes = self.dtypes()
            if self._first_dtypes is None:
                self._first_dtypes = dtypes
            return (self.tree_version, self.modes(), self.hooks(),
                    () if dtypes == self._first_dtypes else dtypes)

    def dtypes(self) -> tuple[tuple[str, torch.dtype], ...]:
        """The parameters' and buffers' dtypes, as runs in their order: (the first name of
        each run, its dtype); one pair for a model of one dtype. Part of a capture's key: a
        graph records the dtypes it was captured with (casts such as an RMSNorm's
        `x.to(input_dtype)`, dtype-typed constants), so `model.half()` or
        `model.lm_head.to(torch.bfloat16)` after a capture needs a capture of its own. Their
        conversion (`Module._apply`) sets `param.data` and leaves the tree as it was, so this
        reads every tensor's dtype (about 16 us for 200 tensors)."""
        self._check()
        raw = tuple(t.dtype for t in itertools.chain(self._params.values(), self._buffers.values()))
        runs = self._dtype_runs.get(raw)
        if runs is None:
            names = itertools.chain(self._params, self._buffers)
            found: list[tuple[str, torch.dtype]] = []
            for name, dtype in zip(names, raw, strict=True):
                if not found or found[-1][1] != dtype:
                    found.append((name, dtype))
            runs = self._dtype_runs[raw] = tuple(found)
        return runs

    def hooks(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        """(module path, table, hook ids) of every hook table of the tree (and the global
        ones, path "*") that holds a hook. Looked at only where a hook may have been added
        (torch's count of hook handles moved) or removed (a table that held hooks is shorter):
        at most calls, a comparison of one integer and a few lengths."""
        self._check()
        if RemovableHandle.next_id == self._hook_next_id and all(
                len(d) == n for d, n in self._hook_sizes):
            return self._hook_key
        model = self._model()
        assert model is not None, "ModelState of a model that is gone"
        self._hook_next_id = RemovableHandle.next_id
        found: list[tuple[str, str, dict[int, object]]] = [
            ("*", name, getattr(_module, name)) for name in _GLOBAL_HOOKS]
        for path, m in [("", model), *self._named]:
            found += [(path, table, getattr(m, table)) for table in _HOOK_TABLES]
        held = [(path, table, d) for path, table, d in found if d]
        self._hook_sizes = [(d, len(d)) for _p, _t, d in held]
        users = [(path, table, tuple(k for k, f in d.items() if not getattr(f, RANNC_OWN_HOOK, False)))
                 for path, table, d in held]
        self._hook_key = tuple((path, table, ids) for path, table, ids in users if ids)
        return self._hook_key

    @contextlib.contextmanager
    def own_handles(self) -> Iterator[None]:
        """A block in which rannc registers hooks of its own (on a call's autograd node), not on
        the model: where nothing else took a hook handle since `hooks()` last looked, the handles
        taken in the block do not make the next call look at every module's hooks again."""
        before = RemovableHandle.next_id
        yield
        if before == self._hook_next_id:
            self._hook_next_id = RemovableHandle.next_id

    @contextlib.contextmanager
    def unchanged(self) -> Iterator[None]:
        """A block in which nothing replaces the model's tensors or modules (the graph of one
        call runs; user code does not): the tree is checked once, at its start, and `params()` /
        `buffers()` inside it answer without checking again. Why: a call reads them several
        times (binding the graph's inputs, the buffers a guessed call may put back, BatchNorm's
        running statistics), each check a walk over every slot and link (about 300 on a small
        ResNet, four times a call)."""
        self._check()
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1

    def _check(self) -> None:
        if self._held:
            return
        self.checks += 1
        for parent, name, child in self._links:
            if _entry(parent._modules, name) is not child:
                self._build()
                return
        for s in self._slots:
            if _entry(getattr(s.owner, s.table), s.key) is not s.value:
                self._build()
                return

    def _build(self) -> None:
        model = self._model()
        assert model is not None, "ModelState of a model that is gone"
        self.builds += 1
        modules = dict(model.named_modules(remove_duplicate=False))
        old = self._links
        old_names = (self._params.keys(), self._buffers.keys())
        self._params = dict(model.named_parameters(remove_duplicate=False))
        self._buffers = dict(model.named_buffers(remove_duplicate=False))
        self._hook_next_id = -1  # (another tree: look at its hooks again)
        self._links = []
        self._named = [(path, mod) for path, mod in modules.items() if path]
        for path, mod in modules.items():
            if path:
                parent_path, _, name = path.rpartition(".")
                self._links.append((modules[parent_path], name, mod))
        if self.builds > 1 and (len(old) != len(self._links) or any(
                a[0] is not b[0] or a[1] != b[1] or a[2] is not b[2]
                for a, b in zip(old, self._links, strict=True))
                or old_names != (self._params.keys(), self._buffers.keys())):
            self.tree_version += 1
        self._slots = []
        for table, found in (("_parameters", self._params), ("_buffers", self._buffers)):
            for full, t in found.items():
                owner_path, _, key = full.rpartition(".")
                self._slots.append(_Slot(modules[owner_path], table, key, t))


def _entry(table: Any, key: str) -> Any:
    """`table.get(key)` for a module's `_modules`, `_parameters` or `_buffers`, also where it
    is a TorchScript module's wrapper of them (no `get`)."""
    return table[key] if key in table else None


_STATES: weakref.WeakKeyDictionary[nn.Module, ModelState] = weakref.WeakKeyDictionary()


def model_state(model: nn.Module) -> ModelState:
    """The one `ModelState` of `model` (shared by every captured signature's calls and the
    wrapper's check that nothing it deployed was replaced)."""
    state = _STATES.get(model)
    if state is None:
        state = _STATES[model] = ModelState(model)
    return state


def replaced(now: dict[str, torch.Tensor], deployed: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensor in `now` is not the one in `deployed` (or is gone)."""
    return [n for n, t in deployed.items() if now.get(n) is not t]


__all__ = ["ModelState", "model_state", "replaced"]
