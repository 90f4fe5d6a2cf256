"""Capture: torch.export (non-strict, training IR, batch dim dynamic) into a TaskGraph.

Why torch.export and not TorchScript tracing (which RaNNC used): it gives ATen
ops with parameters and buffers lifted to graph inputs (exactly the
constant/non-constant split that phase 1 needs), keyword inputs, pytree
outputs such as Hugging Face's `ModelOutput`, and a symbolic batch size, so
one capture serves every microbatch size. It also runs on `meta` tensors, so a
model too large for the host captures without allocating its parameters.

The batch dim: every tensor input whose dim 0 has the size of the first tensor
input's dim 0 is taken to be batched along dim 0.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import itertools
import linecache
import logging
import math
import operator
import os
import re
import sys
import time
import traceback
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.export import Dim, ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind, OutputSpec, TensorArgument
from torch.utils._sympy.symbol import SymT, symbol_is_type

from rannc.errors import CaptureError, output_type_error
from rannc.graph import attributes, functions, hooks
from rannc.graph.model_state import model_state
from rannc.graph.native import forward_reachable
from rannc.graph.task_graph import COPY_OP, WRITE_BACK_OP, Task, TaskGraph, Value, ValueKind

BATCH = sympy.Symbol("batch")

# Checks torch.export inserts that compute nothing; keeping them would make
# atomic components that produce no value.
_DROPPED_OPS = {
    "aten._assert_tensor_metadata.default",
    "aten._assert_async.msg",
    "aten._assert_scalar.default",
    "aten.sym_constrain_range_for_size.default",
}


# per device type: (device type, autocast on, its dtype or None)
AutocastState = tuple[tuple[str, bool, Any], ...]
_AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_state() -> AutocastState:
    """What torch.autocast is doing now, per device type. A captured graph does not hold
    autocast's casts (an `aten.linear` of float32 weights gives bfloat16 only when it runs
    under autocast), so it must run under the state it was captured under: the state is part of
    the capture key, and recorded with the graph (`CapturedModel.autocast`)."""
    out: list[tuple[str, bool, Any]] = []
    for dev in _AUTOCAST_DEVICES:
        on = torch.is_autocast_enabled(dev)
        out.append((dev, on, torch.get_autocast_dtype(dev) if on else None))
    return tuple(out)


@contextlib.contextmanager
def running_as(state: AutocastState) -> Iterator[None]:
    """Run under autocast `state` whatever the caller's (a pipeline's backward() runs outside
    the user's `torch.autocast` block, and recomputes forwards there). Enters a context only
    for a device type whose state differs: the common case costs two checks."""
    with contextlib.ExitStack() as stack:
        for dev, on, dtype in state:
            if torch.is_autocast_enabled(dev) == on and (
                    not on or torch.get_autocast_dtype(dev) == dtype):
                continue
            stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=on))
        yield


@dataclass(frozen=True, slots=True)
class InputLayout:
    """How a call's (args, kwargs) were laid out when the model was captured."""

    spec: pytree.TreeSpec  # of (args, kwargs-sorted-by-key)
    batch_leaves: tuple[bool, ...]  # per flat leaf: a tensor batched along dim 0
    signature: tuple[Any, ...]  # what must match for this capture to be reused
    batch: int | None = None  # rows in this call: dim 0 of the batched leaves


@dataclass
class CapturedModel:
    """A TaskGraph plus what it takes to run it: the fx graph and the input/output layouts."""

    graph: TaskGraph
    gm: fx.GraphModule  # the exported graph; placeholders named like the TaskGraph values
    layout: InputLayout
    out_spec: pytree.TreeSpec
    leaf_values: list[str | None]  # per flat input leaf: its value name (None: a Python constant)
    output_constants: list[Any]  # flat outputs that are not values (None where they are)
    constants: dict[str, torch.Tensor]  # lifted tensor constants, by value name
    seconds: float  # how long torch.export took
    # torch.autocast as it was when captured (`autocast_state`): whatever runs the graph later
    # (recomputation in backward, the measure oracle) runs it under this (`running_as`)
    autocast: AutocastState = ()
    # the plain Python values the model's code read while captured (`graph/attributes.py`): a
    # call reuses this capture only while they hold
    reads: attributes.Reads = attributes.NONE
    # (module path, name) of each tensor forward stores on a module, the last len(stored)
    # graph outputs (None: dropped, see `_split_stored`); `store` assigns them after a call
    stored: tuple[tuple[str, str] | None, ...] = ()
    # the rows (inclusive; None: no bound) a batch may have for this graph to be the model's:
    # the model's code branches on the batch size (diffusers' upsampling, `if x.shape[0] >=
    # 64`), and the graph holds the branch taken for these sizes; `rows_site` names that line
    batch_rows: tuple[int, int | None] = (1, None)
    rows_site: str = ""

    def fits(self, rows: int) -> bool:
        """Whether a batch (or a piece of it) of `rows` rows takes this graph's branches."""
        lo, hi = self.batch_rows
        return rows >= lo and (hi is None or rows <= hi)

    def microbatches_for(self, n_rows: int) -> int:
        """The fewest microbatches that keep every piece of a batch of `n_rows` rows within
        the rows this graph holds for (a piece holds at most a microbatch's rows)."""
        hi = self.batch_rows[1]
        return 1 if hi is None else -(-n_rows // hi)

    def rows_text(self) -> str:
        """`batch_rows` in words: "1 to 63", "64 or more"."""
        lo, hi = self.batch_rows
        return f"{lo} to {hi}" if hi is not None else f"{lo} or more"

    def store(self, model: nn.Module, values: Sequence[Any]) -> None:
        """Assign the stored tensors' values of a call (the last `len(self.stored)` graph
        outputs, in order) to their modules' attributes, as the model's forward does."""
        for where, v in zip(self.stored, values, strict=True):
            if where is not None:
                path, name = where
                setattr(model.get_submodule(path), name, v)

    @property
    def n_user_outputs(self) -> int:
        """The graph outputs that are the model's own (then the `stored` ones)."""
        return len(self.graph.outputs) - len(self.stored)

    def bind(self, model: nn.Module, leaves: Sequence[Any]) -> dict[str, Any]:
        """The graph's input values for one call: the model's own parameters and buffers
        (so autograd and in-place updates reach them), the lifted constants, and the
        call's flat input leaves, by value name."""
        params, buffers = model_state(model).both()
        env: dict[str, Any] = dict(self.constants)
        for name, is_param, target in self._state_values:
            env[name] = params[target] if is_param else buffers[target]
        for leaf_name, leaf in zip(self.leaf_values, leaves, strict=True):
            if leaf_name is not None:
                env[leaf_name] = leaf
        return env

    @functools.cached_property
    def _state_values(self) -> list[tuple[str, bool, str]]:
        """(value name, is a parameter, its name in the model) of each parameter and input
        buffer the graph reads: `bind`'s list, once (the graph's values are thousands, and
        bind runs every call)."""
        return [(name, v.kind is ValueKind.PARAM, v.target or "")
                for name, v in self.graph.values.items()
                if v.kind is ValueKind.PARAM or (v.kind is ValueKind.BUFFER and v.producer is None)]

    def output_label(self, v: str) -> str:
        """A model output by its place in the outputs (a pytree path where one is known)."""
        i = self.graph.outputs.index(v)
        if i >= self.n_user_outputs:
            where = self.stored[i - self.n_user_outputs]
            return f"{where[0]}.{where[1]} (stored in forward)" if where else f"#{i}"
        try:
            paths = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(
                pytree.tree_unflatten(list(range(self.n_user_outputs)), self.out_spec))[0]]
            return f"'{paths[i]}'" if paths[i] else "(the return value)"
        except Exception:
            return f"#{i}"

    def unflatten_outputs(self, values: Mapping[str, Any]) -> Any:
        """The model's output structure from the computed values."""
        flat = [values[v] if v is not None else c
                for v, c in zip(self.graph.outputs, self.output_constants, strict=True)]
        n = self.n_user_outputs
        return pytree.tree_unflatten(flat[:n], self.out_spec)


def input_name(path: Sequence[Any]) -> str:
    """An input leaf's name by its path in `(args, kwargs)` (`pytree.tree_flatten_with_path`):
    'args[1]' for a positional argument, the keyword for a keyword one, then the inner path."""
    top, key, rest = cast(Any, path[0]), cast(Any, path[1]), path[2:]
    if top.idx == 0:
        return f"args[{key.idx}]" + pytree.keystr(tuple(rest))
    return f"{key.key}" + pytree.keystr(tuple(rest))


def flatten_inputs(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[list[Any], InputLayout]:
    """Flatten a call's inputs (kwargs sorted by key) and describe their layout."""
    tree = (tuple(args), {k: kwargs[k] for k in sorted(kwargs)})
    leaves, spec = pytree.tree_flatten(tree)
    if any(not isinstance(x, _PLAIN_LEAVES) and _holds_tensors(x) for x in leaves):
        _refuse_opaque_inputs(tree)
    batch = next((x.shape[0] for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0), None)
    batch_leaves = tuple(
        isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch for x in leaves
    )
    sig: list[Any] = [str(spec)]
    for x, b in zip(leaves, batch_leaves, strict=True):
        if isinstance(x, torch.Tensor):
            shape = tuple(x.shape[1:]) if b else tuple(x.shape)
            sig.append(("tensor", b, shape, x.dtype))
        else:
            sig.append(("const", repr(x)))
    return leaves, InputLayout(spec, batch_leaves, tuple(sig), batch)


_PLAIN_LEAVES = (torch.Tensor, int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


def _holds_tensors(x: Any) -> bool:
    """Whether `x`, an input leaf torch's pytree did not open, holds tensors in its attributes
    (a dataclass or plain object used as a batch)."""
    fields = getattr(x, "__dict__", None)
    if isinstance(x, type) or not isinstance(fields, dict):
        return False
    return any(isinstance(v, torch.Tensor) for v in fields.values())


def _refuse_opaque_inputs(tree: Any) -> None:
    for path, x in pytree.tree_flatten_with_path(tree)[0]:
        if not isinstance(x, _PLAIN_LEAVES) and _holds_tensors(x):
            kind = "a dataclass" if dataclasses.is_dataclass(x) else "an object"
            cls = type(x).__name__
            raise CaptureError(
                f"argument {input_name(path)!r} is {kind} ({cls}) holding tensors, which torch's "
                "pytree does not open: rannc would take it for a constant, see no batch in it "
                "and split nothing. Fix: register the class once before the first call, "
                f"`torch.export.register_dataclass({cls})` (for a dataclass; other classes: "
                "torch.utils._pytree.register_pytree_node), or pass its tensors as arguments "
                "(`model(**vars(batch))`)")


def capture(
    model: nn.Module, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
    small_pieces: bool = False,
) -> CapturedModel:
    """Capture `model(*args, **kwargs)` as a TaskGraph, with the batch dim symbolic.

    Where the model's code branches on the batch size, the graph is that of this batch's
    branch, for the range of sizes that take it (`CapturedModel.batch_rows`); with
    `small_pieces` (a pipeline, which runs the batch in pieces), that of the branch for the
    sizes below the threshold where this batch is above it."""
    kwargs = dict(kwargs or {})
    leaves, layout = flatten_inputs(args, kwargs)
    if not any(layout.batch_leaves):
        raise CaptureError(
            "rannc needs at least one tensor input with a batch dimension (dim 0) to "
            "split the batch; the model was called with none. Pass the batch as a tensor."
        )
    device = _model_device(model)
    _warn_autocast_on_meta(device)
    hooks.check_module_hooks(model)
    _refuse_script_modules(model)
    _say_checkpointing_is_rannc_s(model)
    leaves = [_prepare_leaf(x, b, device) for x, b in zip(leaves, layout.batch_leaves, strict=True)]
    ex_args, ex_kwargs = pytree.tree_unflatten(leaves, layout.spec)
    named = _signature_naming(model, ex_kwargs)
    rows: tuple[int, int | None] = (1, None)
    dynamic_shapes = _dynamic_shapes(model, layout, named, rows)
    t0 = time.perf_counter()
    reads = attributes.NONE
    written: list[tuple[str, str]] = []  # (module path, name) of the outputs forward() stored

    def export() -> ExportedProgram:
        nonlocal reads
        with _keywords_in_signature(model, named), _layerdrop_draws(), functions.kept_whole(), \
                hooks.tensor_hooks_refused(), hooks.reentrant_checkpoint_refused(), \
                _conversions_that_change_nothing(), _data_as_detach(model), \
                _torch_transformer_layers(model), _packed_sequences_refused(model), \
                _sync_batch_norms_as_batch_norms(model), \
                attributes.recorded(model) as rec, _stored_tensors_returned(model, rec, written):
            ep = torch.export.export(model, tuple(ex_args), dict(ex_kwargs),
                                     dynamic_shapes=dynamic_shapes, strict=False)
        reads = rec.result()
        return ep
    rows_site = ""
    for _ in range(_RANGE_TRIES):
        try:
            ep = export()
            break
        except Exception as e:  # torch.export raises many types; all become a CaptureError
            narrowed = _guarded_rows(e)
            if narrowed is None or narrowed == rows:
                site = _specialising_site(model, e, export) if _BATCH_FIXED in str(e) else None
                raise _capture_error(model, e, site,
                                     _coincident_batch_inputs(args, kwargs, layout)) from e
            if not rows_site:
                found = _guard_site(model, export, _is_range_guard)
                rows_site = found[1] if found else "(a line of the model's code)"
            rows = narrowed
            if small_pieces and rows[0] > 2:
                # this batch is on the large side of the branch; the pipeline's pieces are
                # smaller: capture the branch below from the batch's first rows
                leaves = [x[:rows[0] - 1] if b and isinstance(x, torch.Tensor) else x
                          for x, b in zip(leaves, layout.batch_leaves, strict=True)]
                ex_args, ex_kwargs = pytree.tree_unflatten(leaves, layout.spec)
                rows = (1, rows[0] - 1)
            dynamic_shapes = _dynamic_shapes(model, layout, named, rows)
    else:
        raise CaptureError(f"rannc could not capture the model: its code branches on the batch "
                           f"size in more than {_RANGE_TRIES} places ({rows_site}, rows {rows})")
    _refuse_writes_into_inputs_or_parameters(ep)
    _refuse_collectives(ep.graph_module)
    functional = _writes_through_a_view(ep.graph_module) or _batching_transforms(ep.graph_module)
    if functional:
        try:
            # Functionalise (no decompositions beyond it): see _write_back_mutations and
            # _batching_transforms for why.
            ep = ep.run_decompositions({})
        except Exception as e:
            raise _capture_error(model, e) from e
    seconds = time.perf_counter() - t0
    cap = _from_exported(ep, layout, seconds, functional)
    cap.reads = reads
    cap.batch_rows, cap.rows_site = rows, rows_site
    _split_stored(cap, written)
    return cap


# how often capture narrows the batch's range (one per branch on the batch size met)
_RANGE_TRIES = 4


def _guarded_rows(e: BaseException) -> tuple[int, int | None] | None:
    """The batch sizes torch.export found the model's code to hold for (the range of its
    suggested `Dim('batch', min=, max=)`), where it branches on the batch size; None for any
    other failure (a size pinned to a constant is `_BATCH_FIXED`)."""
    fix = re.search(r"batch = Dim\('batch'([^)]*)\)", str(e))
    if fix is None or _BATCH_FIXED in str(e):
        return None
    lo = re.search(r"min=(\d+)", fix.group(1))
    hi = re.search(r"max=(\d+)", fix.group(1))
    if lo is None and hi is None:
        return None
    return (max(1, int(lo.group(1))) if lo else 1, int(hi.group(1)) if hi else None)


def _is_range_guard(msg: str) -> bool:
    """A shape-environment log line adding a guard that compares a size with a number."""
    found = re.search(r"eval (.*) \[guard added\]", msg)
    return found is not None and re.search(r"[<>]", found.group(1)) is not None


@contextlib.contextmanager
def _stored_tensors_returned(model: nn.Module, rec: attributes._Recorder,
                             written: list[tuple[str, str]]) -> Iterator[None]:
    """While exporting, forward also returns the tensors it stored on the model's modules
    (`self.aux_loss = ...`, `self.attn = p.detach()`), each a scalar or with the batch's rows,
    after its own outputs: `(outputs, (stored, ...))`; `written` gets their (module path,
    name). Why: torch.export puts back what forward assigns after the trace, and rannc runs the
    graph, not forward, so such an attribute kept its value from before the first call (a
    training loop adding up the layers' stored auxiliary losses added zeros). As graph outputs
    they are computed in every call, and the call assigns them (`CapturedModel.store`)."""
    orig = model.forward

    def forward(*args: Any, **kw: Any) -> Any:
        out = orig(*args, **kw)
        batch = next((x.shape[0] for x in pytree.tree_leaves((args, kw))
                      if isinstance(x, torch.Tensor) and x.dim() > 0), None)
        stored = [(path, name, v) for path, name, v in rec.tensor_writes()
                  if v.dim() == 0 or _has_rows(v, batch)]
        written[:] = [(path, name) for path, name, _v in stored]
        kept = {f"{p}.{n}" if p else n for p, n in written}
        stale = [r.label for r in rec.carried() if r.label not in kept]
        if stale:
            warnings.warn(
                f"rannc: forward reads the tensor in {', '.join(stale[:3])} and replaces it with "
                "one that is neither a scalar nor has the batch's rows (state carried from call "
                "to call): rannc cannot return it from the captured graph, so the attribute "
                "keeps its first value and every call computes with it. Keep such state in a "
                "buffer updated in place (`self.register_buffer('mems', ...)`, then "
                "`self.mems.copy_(new)`), or pass it to forward as an input",
                UserWarning, stacklevel=2)
        lost = rec.unreturned_writes()
        if lost:
            warnings.warn(
                f"rannc: forward stores a number computed from a tensor's values, or tensors "
                f"inside a list or dict, in {', '.join(lost[:3])} (e.g. `self.stat = "
                "loss.item()`): rannc runs the captured graph, not forward, so calls do not "
                "update it. Store each tensor in an attribute of its own instead (`self.stat = "
                "loss.detach()`): a tensor forward stores on a module is assigned after every "
                "call", UserWarning, stacklevel=2)
        return (out, tuple(v for *_p, v in stored)) if stored else out

    forward.__signature__ = inspect.signature(orig)  # type: ignore[attr-defined]
    with hooks.replaced_attribute(model, "forward", forward), warnings.catch_warnings():
        # (torch.export's advice to make them buffers: rannc assigns them itself)
        warnings.filterwarnings("ignore", message=r"The tensor attributes? .* (was|were) "
                                r"assigned during export")
        yield


def _has_rows(v: torch.Tensor, batch: Any) -> bool:
    """Whether `v`'s dim 0 is the traced batch size (a symbol of it: v has its rows)."""
    if not isinstance(batch, torch.SymInt) or not isinstance(v.shape[0], torch.SymInt):
        return False
    return bool(batch.node.expr.free_symbols) and \
        batch.node.expr.free_symbols <= v.shape[0].node.expr.free_symbols


def _split_stored(cap: CapturedModel, written: list[tuple[str, str]]) -> None:
    """After an export whose forward also returned the tensors it stored
    (`_stored_tensors_returned`): the model's own output structure, and the stored ones as the
    last graph outputs (`CapturedModel.stored`). One that came out without rows (a symbol
    other than the batch), or that the graph does not compute (a parameter stored as it is: on
    several ranks no stage would send it; a model input stored as it is is a copy the graph
    computes, `_inputs_returned_as_copies`), is dropped from the outputs and keeps its value,
    as before."""
    if not written:
        return
    user, _stored = pytree.tree_unflatten(list(range(len(cap.graph.outputs))), cap.out_spec)
    cap.out_spec = pytree.tree_flatten(user)[1]
    first = len(cap.graph.outputs) - len(written)
    kept: list[tuple[str, str] | None] = []
    for i, where in enumerate(written):
        v = cap.graph.outputs[first + i]
        val = cap.graph.values.get(v) if v is not None else None
        if val is None or val.producer is None or (val.batch_dim is None and val.shape != ()):
            cap.graph.outputs[first + i] = None
            kept.append(None)
        else:
            kept.append(where)
    cap.stored = tuple(kept)


class _LayerDropDraw:
    """What `torch.rand([])` gives Hugging Face code while it is captured: LayerDrop's draw.

    Transformers before 5.2x (and every 4.x) draw one number per layer in training and skip
    the layer when it is below the layer-drop probability, `if torch.rand([]) < p:`, also
    when p is 0 (BART, Whisper, OPT, Pegasus, M2M100, mBART, Wav2Vec2, Speech2Text and about
    50 more). torch.export cannot branch on a tensor's value, so those models did not capture
    at all. A draw is uniform in [0, 1): against p <= 0 or p >= 1 every comparison has one
    answer, given here as a Python bool, so the branch is fixed as it is in every eager call.
    Against 0 < p < 1 the layers a step runs are random, which one captured graph cannot be:
    refused, naming the setting. The draw itself is still made (a random op the graph keeps, as
    `_drop_dead_code` keeps every one), so the random ops after it draw what they draw in eager."""

    def __init__(self, where: str) -> None:
        self.where = where

    def _against(self, p: Any, below: bool, inclusive: bool) -> bool:
        """`draw < p` (below, not inclusive), `<=`, `>` or `>=`, where the answer is the same
        for every draw in [0, 1)."""
        if isinstance(p, bool) or not isinstance(p, (int, float)):
            raise CaptureError(
                f"rannc could not capture the model: {self.where} compares a random draw "
                f"(torch.rand([])) with a {type(p).__name__}; a pipeline needs the same graph "
                "in every step. Compare it with a number, or draw outside forward().")
        if p >= 1:
            return below
        # p < 0: never below it, always above; p == 0: never below it, always at or above it
        if p < 0 or (p == 0 and inclusive != below):
            return not below
        raise CaptureError(
            f"rannc could not capture the model: {self.where} skips layers at random in "
            f"training (LayerDrop, probability {p:g}); the layers a step runs must be the same "
            "in every step for a pipeline. Set the model's layer-drop probability to 0 "
            "(Hugging Face: config.layerdrop, encoder_layerdrop and decoder_layerdrop), as "
            "fine-tuning usually does.")

    def __lt__(self, p: Any) -> bool:
        return self._against(p, below=True, inclusive=False)

    def __le__(self, p: Any) -> bool:
        return self._against(p, below=True, inclusive=True)

    def __gt__(self, p: Any) -> bool:
        return self._against(p, below=False, inclusive=False)

    def __ge__(self, p: Any) -> bool:
        return self._against(p, below=False, inclusive=True)

    def __bool__(self) -> bool:
        raise CaptureError(f"rannc could not capture the model: {self.where} uses a random "
                           "draw (torch.rand([])) as a condition; a pipeline needs one graph.")


_SAID_CHECKPOINTING: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _say_checkpointing_is_rannc_s(model: nn.Module) -> None:
    """A Hugging Face model with gradient checkpointing on (`gradient_checkpointing_enable()`)
    recomputes nothing under rannc: torch.export traces the checkpointed layers' forward, and
    rannc's own recomputation (`Config.checkpointing`) decides what is kept. Said once per
    model, at INFO: the values are exact either way; the memory is rannc's plan's."""
    if model in _SAID_CHECKPOINTING or not any(
            getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        return
    _SAID_CHECKPOINTING.add(model)
    logging.getLogger(__name__).info(
        "rannc: the model's own gradient checkpointing (gradient_checkpointing_enable) is "
        "replaced by rannc's recomputation: checkpointing='auto' (the default) recomputes the "
        "stages whose memory needs it, checkpointing='on' every stage")


def _refuse_script_modules(model: nn.Module) -> None:
    """A TorchScript module inside the model (`torch.jit.script(m)`, `torch.jit.trace`)
    cannot be traced by torch.export: it failed with "Sub.forward() takes 2 positional
    arguments but 3 were given" and the advice for control flow. Named, with the fix.
    (A scripted function, `@torch.jit.script def f(x)`, is traced as Python and is fine.)"""
    scripted: list[tuple[str, str]] = []
    for path, m in model.named_modules():
        if isinstance(m, torch.jit.ScriptModule) and not any(
                path.startswith(p + ".") or p == "<root>" for p, _ in scripted):  # (outermost)
            scripted.append((path or "<root>", getattr(m, "original_name", type(m).__name__)))
    if scripted:
        more = f" and {len(scripted) - 3} more" if len(scripted) > 3 else ""
        raise CaptureError(
            f"rannc could not capture the model: module(s) "
            f"{', '.join(f'{p!r} ({c})' for p, c in scripted[:3])}{more} are TorchScript modules "
            "(torch.jit.script or torch.jit.trace), which torch.export cannot trace. Fix: use "
            "the Python module they were made from (keep `m`, not `torch.jit.script(m)`); to "
            "compile, `RaNNCModule(..., compile=True)` compiles each stage's graph",
            module_path=scripted[0][0])


@contextlib.contextmanager
def _sync_batch_norms_as_batch_norms(model: nn.Module) -> Iterator[None]:
    """While exporting, each `nn.SyncBatchNorm` runs as the BatchNorm it is over one process's
    rows (`_BatchNorm.forward`): rannc's own BatchNorm handling then sums the statistics over
    a stage's replicas (`Config.batchnorm="sync"`, which a model holding SyncBatchNorm runs
    under: `rannc.module`). Traced as it is, SyncBatchNorm refused CPU tensors ("expected input
    tensor to be on GPU") and on a GPU would put its own collectives in the graph."""
    with contextlib.ExitStack() as stack:
        for m in model.modules():
            if isinstance(m, nn.SyncBatchNorm):
                stack.enter_context(hooks.replaced_attribute(
                    m, "forward", types.MethodType(nn.modules.batchnorm._BatchNorm.forward, m)))
        yield


@contextlib.contextmanager
def _conversions_that_change_nothing() -> Iterator[None]:
    """While exporting: `module.to(dtype or device)` that would convert none of the module's
    tensors returns the module as it is. Models call it in forward to be sure of a dtype (NLLB-MoE
    and Switch Transformers' routers: `self.classifier = self.classifier.to(self.dtype)`); in
    eager it changes nothing, but torch.export traces it on fake parameters, which `_apply`
    cannot swap ("Couldn't swap Linear.weight"). A conversion that would change a tensor is left
    to torch (and fails as before: a model that changes its weights' dtype in forward)."""
    real = nn.Module.to

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _non_blocking, fmt = torch._C._nn._parse_to(*args, **kwargs)
        if fmt is None and all(
                (device is None or t.device == device)
                and (dtype is None or t.dtype == dtype
                     or not (t.is_floating_point() or t.is_complex()))
                for t in itertools.chain(self.parameters(), self.buffers())):
            return self
        return real(self, *args, **kwargs)

    nn.Module.to = to  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.to = real  # type: ignore[method-assign]


@contextlib.contextmanager
def _data_as_detach(model: nn.Module) -> Iterator[None]:
    """While exporting: `t.data` reads as `t.detach()`. torch.export cannot trace `.data`: any
    use in forward fails after tracing with "We found a fake tensor in the exported program
    constant's list", naming no line. A read gives the same values without autograd history,
    which is what forward uses it for (`F.linear(x, self.weight.data)`, `x.data` for a
    detached input); an in-place write through it into a parameter is then refused by name as
    any in-place write into one is (`_refuse_writes_into_inputs_or_parameters`), and an
    assignment to it from the model's code (`p.data = new`: a momentum encoder updated in
    forward) is refused here, naming the line. (The class attribute is process-wide while it
    is set; nothing else runs Python on tensors during a capture.)"""
    names = {id(m): n for n, m in model.named_modules()}
    base: Any = torch._C.TensorBase.data  # (the C descriptor: __set__ is torch's assignment)
    had = torch.Tensor.__dict__.get("data")

    def get(self: torch.Tensor) -> torch.Tensor:
        return self.detach()

    def assign(self: torch.Tensor, value: torch.Tensor) -> None:
        site = _calling_module(names)
        if site is None:  # (torch's own code, not the model's)
            base.__set__(self, value)
            return
        raise CaptureError(
            f"rannc cannot capture an assignment to a tensor's .data in forward() (at "
            f"{site[1]}): torch.export records operations, and `.data = ` replaces a tensor's "
            "contents outside them. Fix: update parameters outside "
            "forward() (a momentum or EMA encoder: in the training loop, after "
            "optimizer.step(), under torch.no_grad(), with in-place ops: "
            "p_k.mul_(m).add_(p_q, alpha=1 - m)); for a value without gradient history use "
            "x.detach()", module_path=site[0])

    torch.Tensor.data = property(get, assign)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        if had is None:
            del torch.Tensor.data
        else:
            torch.Tensor.data = had  # type: ignore[method-assign]


@contextlib.contextmanager
def _torch_transformer_layers(model: nn.Module) -> Iterator[None]:
    """While exporting, torch's own transformer layers:

    * `nn.TransformerEncoder` and `nn.TransformerDecoder` given a mask and no `is_causal` apply
      the mask as given instead of comparing it with a causal mask. The comparison
      (`_detect_is_causal_mask`) branches on the mask's values, which a graph cannot; it only
      chooses a kernel, since `is_causal` is a hint that the mask is causal, and the layers
      apply a causal mask alike with or without it (equal up to rounding). A mask that is not
      causal is applied as given either way.
    * An encoder in eval mode called with a padding mask alone is warned about: under
      `torch.no_grad()` the unwrapped one takes its nested-tensor fast path, which leaves zeros
      at the padded positions, and a graph cannot (it computes them as training does).

    (Both are torch's module and class attributes, looked up at each call; nothing else runs
    Python during a capture.)"""
    from torch.nn.modules import transformer

    real = transformer._detect_is_causal_mask
    real_encoder = nn.TransformerEncoder.forward
    names = {id(m): n for n, m in model.named_modules()}

    def encoder(self: nn.TransformerEncoder, src: torch.Tensor, mask: torch.Tensor | None = None,
                src_key_padding_mask: torch.Tensor | None = None,
                is_causal: bool | None = None) -> torch.Tensor:
        if (getattr(self, "use_nested_tensor", False) and not self.layers[0].training
                and mask is None and src_key_padding_mask is not None and src.dim() == 3
                and torch.backends.mha.get_fastpath_enabled()):
            warnings.warn(
                f"rannc: torch's nn.TransformerEncoder '{names.get(id(self), '?')}' runs in eval "
                "mode with src_key_padding_mask: under torch.no_grad() the unwrapped encoder "
                "takes its nested-tensor fast path, which leaves zeros (before its final norm) at "
                "the padded positions, and rannc's graph computes those positions as training "
                "does; every position not padded is equal. For the same outputs at every "
                "position build the encoder with enable_nested_tensor=False.",
                UserWarning, stacklevel=2)
        return real_encoder(self, src, mask=mask, src_key_padding_mask=src_key_padding_mask,
                            is_causal=is_causal)

    def detect(mask: torch.Tensor | None, is_causal: bool | None = None,
               size: int | None = None) -> bool:
        if is_causal is None and mask is not None:
            return False
        return real(mask, is_causal, size)

    transformer._detect_is_causal_mask = detect
    nn.TransformerEncoder.forward = encoder  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        transformer._detect_is_causal_mask = real
        nn.TransformerEncoder.forward = real_encoder  # type: ignore[method-assign]


@contextlib.contextmanager
def _packed_sequences_refused(model: nn.Module) -> Iterator[None]:
    """While exporting: a `PackedSequence` made by the model's code (`pack_padded_sequence`
    before an RNN) is refused naming the line, with an exact rewrite. Its batch size at each
    time step comes from the lengths' values, which a graph cannot hold; torch.export failed
    later inside the RNN with "zeros(): argument 'size' failed to unpack the object ...
    FakeTensor", naming only the RNN. (The class attribute is process-wide while it is set;
    nothing else runs Python during a capture.)"""
    from torch.nn.utils.rnn import PackedSequence

    names = {id(m): n for n, m in model.named_modules()}
    real = PackedSequence.__dict__["__new__"]

    def new(cls: type, *args: Any, **kwargs: Any) -> Any:
        site = _calling_module(names)
        if site is None:  # (torch's own code, not the model's)
            return real.__get__(None, cls)(cls, *args, **kwargs)
        raise CaptureError(
            f"rannc cannot capture a PackedSequence (pack_padded_sequence, at {site[1]}): its "
            "batch size at each time step comes from the lengths' values, which a graph cannot "
            "hold. Fix: run the RNN on the padded batch and take each row's output at its last "
            "step, `out[torch.arange(out.size(0)), lengths - 1]` (batch_first; for a "
            "unidirectional RNN it equals the packed run's final hidden state h_n[-1]), and "
            "leave the padded steps out of the loss", module_path=site[0])

    PackedSequence.__new__ = staticmethod(new)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        PackedSequence.__new__ = real  # type: ignore[method-assign]


@contextlib.contextmanager
def _layerdrop_draws() -> Iterator[None]:
    """While exporting: `torch.rand([])` called from Hugging Face's code (a module under a
    `transformers` package, with no other argument) gives a `_LayerDropDraw`; any other call
    is torch's own."""
    real = torch.rand

    def rand(*size: Any, **kwargs: Any) -> Any:
        shape = kwargs.get("size", size[0] if len(size) == 1 else size)
        if not kwargs.keys() - {"size"} and isinstance(shape, (list, tuple)) and len(shape) == 0:
            caller = inspect.currentframe()
            caller = caller.f_back if caller is not None else None
            path = caller.f_code.co_filename if caller is not None else ""
            if re.search(r"[/\\]transformers[/\\]", path):
                assert caller is not None
                real(*size, **kwargs)  # (drawn as eager draws it: the random stream stays aligned)
                return _LayerDropDraw(f"{caller.f_code.co_qualname} "
                                      f"({path}:{caller.f_lineno})")
        return real(*size, **kwargs)

    torch.rand = rand  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.rand = real


def _dynamic_shapes(model: nn.Module, layout: InputLayout, named: inspect.Signature | None,
                    rows: tuple[int, int | None]) -> dict[str, Any]:
    """torch.export's dynamic_shapes: dim 0 symbolic for every batched leaf, by parameter name
    (`named`: forward's signature with the keywords its `**kwargs` catches named, see
    _signature_naming; None: forward's own), in the range `rows`."""
    batch = Dim("batch", min=rows[0], max=rows[1]) if rows[1] is not None else \
        Dim("batch", min=rows[0])
    flags = iter([{0: batch} if b else None for b in layout.batch_leaves])
    dyn_args, dyn_kwargs = _shapes_tree(layout.spec, flags)
    sig = named if named is not None else inspect.signature(model.forward)
    try:
        bound = sig.bind(*dyn_args, **dyn_kwargs)
    except TypeError as e:
        raise CaptureError(
            f"the inputs do not match {type(model).__name__}.forward's signature: {e}"
        ) from e
    return dict(bound.arguments)


def _shapes_tree(spec: pytree.TreeSpec, leaves: Iterator[Any]) -> Any:
    """`leaves` in the structure `spec`, as torch.export's dynamic_shapes wants it: the
    built-in containers as they are, any other registered node (a dataclass registered with
    torch.export.register_dataclass) as the list of its children (tree_unflatten made the
    dataclass itself: "Node type mismatch; expected <class 'list'>")."""
    if spec.is_leaf():
        return next(leaves)
    children = [_shapes_tree(spec.child(i), leaves) for i in range(spec.num_children)]
    if spec.type not in _BUILT_IN_NODES:
        return children
    return pytree.tree_unflatten(children, pytree.TreeSpec(spec.type, spec.context,
                                                           [pytree.treespec_leaf()] * len(children)))


# the pytree node types torch.export takes in dynamic_shapes as they are (a namedtuple's spec
# type is collections.namedtuple itself)
_BUILT_IN_NODES: tuple[Any, ...] = (tuple, list, dict, collections.OrderedDict,
                                    collections.defaultdict, collections.deque,
                                    collections.namedtuple)


def _signature_naming(model: nn.Module, kwargs: Mapping[str, Any]) -> inspect.Signature | None:
    """forward's signature with each keyword that its `**kwargs` would catch as a named
    keyword-only parameter instead; None when no keyword is caught (forward's own serves).

    torch.export (2.13) cannot match dynamic shapes to a var-keyword argument ("Must provide a
    tree_name when there might be a mismatch": it lists the caught keywords both inside
    `kwargs` and on their own), so Hugging Face's `num_items_in_batch` or a user's `mask=`
    passed through `**kwargs` must be named for the export."""
    sig = inspect.signature(model.forward)
    params = list(sig.parameters.values())
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    caught = [k for k in kwargs if k not in sig.parameters]
    if not caught:
        return None
    params = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params += [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=None) for k in caught]
    return sig.replace(parameters=params)


@contextlib.contextmanager
def _keywords_in_signature(model: nn.Module, named: inspect.Signature | None) -> Iterator[None]:
    """While exporting, forward shows signature `named` (see _signature_naming; None: left
    as it is); the model's own forward is restored after."""
    if named is None:
        yield
        return
    orig = model.forward

    def forward(*args: Any, **kw: Any) -> Any:
        return orig(*args, **kw)

    forward.__signature__ = named  # type: ignore[attr-defined]
    with hooks.replaced_attribute(model, "forward", forward):
        yield


def _warn_autocast_on_meta(device: torch.device | None) -> None:
    """Autocast acts on the tensors of its own device type only: a model on the meta device
    (planned without allocating) is traced in its own dtype under any autocast, so its graph,
    and the plan's time and memory, are float32 where the run will compute in half. Said
    once, with the ways out."""
    on = [f"{dev}, {str(dtype).removeprefix('torch.')}" for dev, enabled, dtype in autocast_state()
          if enabled]
    if device is not None and device.type == "meta" and on:
        warnings.warn(
            f"rannc: captured the model on the meta device under torch.autocast({'; '.join(on)}): "
            "autocast does not act on meta tensors, so the graph computes in the parameters' "
            "dtype and the plan's times and memory are those of a float32 run, not of the "
            "autocast run (half-precision products, their casts kept for backward). Plan with "
            "the model on its device, or build the meta model in the half dtype "
            "(model.to(torch.bfloat16)) for an estimate of the products; the weights' float32 "
            "copies and optimizer state are then under-counted.", stacklevel=3)


def _model_device(model: nn.Module) -> torch.device | None:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return None


def _prepare_leaf(x: Any, batched: bool, device: torch.device | None) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    if device is not None and device.type == "meta":
        x = x.to("meta")
    if batched and x.shape[0] == 1:
        # A batch of one would be specialised to the constant 1 by torch.export.
        x = torch.cat([x, x])
    return x


# torch.export's words when the model's code pinned a dynamic dimension (the batch) to a constant
_BATCH_FIXED = "specialized it to be a constant"
_SHAPES_LOG = "torch.fx.experimental.symbolic_shapes"


def _calling_module(names: dict[int, str]) -> tuple[str, str] | None:
    """`_innermost_module` of the stack of the function calling this one (a patched torch
    function or attribute, called from the model's code or from torch's own)."""
    # (from that caller's caller: walk_stack(None) would start at this frame's caller)
    frames = [f for f, _ in traceback.walk_stack(sys._getframe(2))]
    return _innermost_module(reversed(frames), names)


def _innermost_module(frames: Iterator[Any], names: dict[int, str]) -> tuple[str, str] | None:
    """(module path, "Class.method (file:line)") of the innermost of `frames` (outermost
    first) running a method of one of the model's modules (`names`: id -> path)."""
    found = None
    for frame in frames:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            code = frame.f_code
            found = (names[id(owner)] or "<root>",
                     f"{type(owner).__name__}.{code.co_name} ({code.co_filename}:{frame.f_lineno})")
    return found


def _specialising_site(model: nn.Module, e: BaseException,
                       export: Any) -> tuple[str, str] | None:
    """Where the model's code pinned the batch size to a constant: torch.export says so only
    after tracing, with no stack. Export once more (a failure costs it) while the shape
    environment logs each guard it adds, and take the module on the Python stack when the
    guard pinning a symbol to the constant of `e`'s message was added."""
    constant = re.search(r"specialized it to be a constant \((-?\d+)\)", str(e))
    if constant is None:
        return None
    eq = re.compile(rf"Eq\(\w+, {constant.group(1)}\)")  # with "[guard added]"
    replaced = re.compile(rf"set_replacement \S+ = {constant.group(1)}\b")
    return _guard_site(model, export, lambda msg: bool(("[guard added]" in msg and eq.search(msg))
                                                       or replaced.search(msg)))


def _guard_site(model: nn.Module, export: Any,
                wanted: Callable[[str], bool]) -> tuple[str, str] | None:
    """(module path, "Class.method (file:line): `the line`") where the model's code made the
    shape environment log the first message that is `wanted`: `export` once more (which may
    fail again, as expected) with the log at INFO, shown to no one."""
    names = {id(m): n for n, m in model.named_modules()}
    sites: list[tuple[str, str]] = []

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if sites:
                return
            msg = record.getMessage()
            if not wanted(msg):
                return
            stack = [frame for frame, _ in traceback.walk_stack(None)]  # innermost first
            site = _innermost_module(reversed(stack), names)
            if site is not None:
                line = _model_code_line(stack)
                if line and line[0] not in site[1]:  # a function it calls (CLIP's loss)
                    site = (site[0], f"{site[1]}, the line {line[0]}: `{line[1]}`")
                elif line:
                    site = (site[0], f"{site[1]}: `{line[1]}`")
                sites.append(site)

    log = logging.getLogger(_SHAPES_LOG)
    saved = (log.level, log.propagate, list(log.handlers))
    log.setLevel(logging.INFO)  # (the guards are logged at INFO; shown to no one here)
    log.propagate = False
    log.handlers = [Watch()]
    try:
        export()
    except Exception:  # the same failure, expected
        pass
    finally:
        log.setLevel(saved[0])
        log.propagate = saved[1]
        log.handlers = saved[2]
    return sites[0] if sites else None


_NOT_MODEL_CODE = tuple(os.path.dirname(m.__file__ or "") + os.sep for m in (torch, logging))
_RANNC_CODE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _model_code_line(stack: Sequence[Any]) -> tuple[str, str] | None:
    """("file:line", its source) of the innermost of `stack` (innermost first) in the model's
    own code: not torch's, rannc's or the logging module's (whose frames lie between the
    model's line and the logged guard)."""
    for frame in stack:
        name = frame.f_code.co_filename
        if name.startswith((*_NOT_MODEL_CODE, _RANNC_CODE)) or name.startswith("<"):
            continue
        source = linecache.getline(name, frame.f_lineno).strip()
        return f"{name}:{frame.f_lineno}", source
    return None


def _sequence_first(model: nn.Module, path: str | None) -> str:
    """'LSTM 'rnn'' where the module at `path` (or one inside it) is torch's recurrent layer
    or attention built sequence-first, else ''."""
    if path is None:
        return ""
    try:
        mod = model if path == "<root>" else model.get_submodule(path)
    except AttributeError:
        return ""
    for name, m in mod.named_modules():
        if isinstance(m, (nn.RNNBase, nn.MultiheadAttention)) and not m.batch_first:
            full = ".".join(x for x in (path if path != "<root>" else "", name) if x)
            return f"{type(m).__name__} '{full}'"
    return ""


def _coincident_batch_inputs(args: Sequence[Any], kwargs: Mapping[str, Any],
                             layout: InputLayout) -> list[str]:
    """The inputs taken for batched (dim 0 the batch size) that may be so only by chance: a
    square one beside the first batched input (a (seq, seq) mask with seq equal to the batch
    size), which the model uses whole, not by rows."""
    tree = (tuple(args), {k: kwargs[k] for k in sorted(kwargs)})  # (flatten_inputs' order)
    pairs = pytree.tree_flatten_with_path(tree)[0]
    batched = [i for i, b in enumerate(layout.batch_leaves) if b]
    return [input_name(pairs[i][0]) for i in batched[1:]
            if pairs[i][1].dim() > 1 and pairs[i][1].shape[0] in pairs[i][1].shape[1:]]


def _capture_error(model: nn.Module, e: BaseException,
                   site: tuple[str, str] | None = None, chance: Sequence[str] = ()) -> CaptureError:
    """Name the innermost user module on the failing stack (or at `site`, where the failure
    is found after tracing), and say what usually causes it."""
    wrong_output = output_type_error(type(model).__name__, e)
    if wrong_output is not None:  # found after tracing: no module to name, the type says it all
        return wrong_output
    names = {id(m): n for n, m in model.named_modules()}
    path, where = site or _innermost_module(
        (frame for frame, _ in traceback.walk_tb(e.__traceback__)), names) or (None, "")
    if isinstance(e, CaptureError):  # rannc's own refusal from inside the trace says it all
        return CaptureError(f"{e} (in module '{path}')", module_path=path)
    reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
    if _BATCH_FIXED in str(e):
        reason += (" The model's code fixes the batch size (e.g. x.view(4, -1) or a "
                   "torch.zeros(4, ...)), or makes a Python number of it (len(x), "
                   "float(x.size(0)), int(...), range(...): torch.export fixes such a number to "
                   "this call's value); derive it from the input with x.size(0) or -1, and keep "
                   "it a size in arithmetic (`loss.sum() / x.size(0)`, not `/ len(x)`).")
        package = re.search(r"[/\\](?:site|dist)-packages[/\\]([^/\\]+)", where)
        if package:
            reason += (f" That code is in an installed package ({package.group(1)}), not in yours: "
                       "rannc cannot capture the model while that line runs in forward (where "
                       "it computes a loss, call the model without asking for it and compute "
                       "the loss from the outputs).")
        first = _sequence_first(model, path)
        if first:
            reason = (f"{first} is sequence-first (batch_first=False): rannc takes dim 0 of every "
                      "input as the batch, so its time steps were taken for the rows. Fix: build "
                      "it with batch_first=True and pass (batch, sequence, ...) inputs. " + reason)
        if chance:
            reason += (f" Or: input(s) {', '.join(chance)} have the batch size as their first "
                       "dimension by chance (e.g. a (seq, seq) mask with seq equal to the batch "
                       "size), so rannc took them for batched inputs, whose rows it splits; pass "
                       "such a tensor with another first dimension (mask[None]) or hold it on "
                       "the model (register_buffer).")
    generators = _generators(model)
    if generators:
        reason += (f" The model keeps a torch.Generator of its own ({', '.join(generators)}): "
                   f"torch.export cannot trace draws from one (`generator=`). {_GENERATOR_FIX}.")
    text = (
        f"rannc could not capture the model: torch.export failed in module '{path}' "
        f"[{where}]: {type(e).__name__}: {reason}\n"
        "Usual causes: Python control flow on a tensor's value (`if x.sum() > 0:`), "
        ".item()/.tolist() used for shapes, code that fixes the batch size (use x.size(0) "
        "or -1), or an output that is not a tensor, number or pytree of them (for Hugging "
        "Face models set `use_cache=False`). Fix: rewrite that line with torch.where/"
        "torch.cond or move it out of forward(); the original error is chained below."
    )
    return CaptureError(text, module_path=path)


_GENERATOR_FIX = ("Fix: draw from the default generator (seeded by torch.manual_seed), or make "
                  "the noise outside forward() and pass it in as an input")


def _generators(model: nn.Module) -> list[str]:
    """The `torch.Generator`s held as attributes of the model's modules, by path (a model
    drawing its noise from its own generator; named only when a capture fails)."""
    return [f"{path}.{attr}" if path else attr for path, m in model.named_modules()
            for attr, v in vars(m).items() if isinstance(v, torch.Generator)]


def _val_shape(val: Any) -> tuple[tuple[int | str, ...], int | None, int]:
    """Shape with symbolic sizes as strings, the batch dim, and rows per sample along it."""
    shape: list[int | str] = []
    batch_dim: int | None = None
    scale = 1
    for i, d in enumerate(val.shape):
        expr = _sym(d)
        if isinstance(expr, int):
            shape.append(expr)
            continue
        shape.append(str(expr))
        if batch_dim is None and BATCH in expr.free_symbols:
            ratio = sympy.simplify(expr / BATCH)
            if ratio.is_Integer and int(ratio) > 0:
                batch_dim, scale = i, int(ratio)
    return tuple(shape), batch_dim, scale


def _sym(d: Any) -> int | sympy.Expr:
    if isinstance(d, int):
        return d
    expr = sympy.sympify(d.node.expr)
    if expr.is_Integer:
        return int(expr)
    # One dynamic dim is declared (the batch), so its symbols are the only backed free ones.
    # A size computed from tensor values (.item(), .tolist(), nonzero: torch's unbacked u0,
    # u1, ...) keeps its own symbol: it is not the batch (a mixture of experts' token count
    # per expert, from .tolist(), was taken for the batch size, and a stage reading it got the
    # row count instead), and such a value may not cross a stage boundary
    # (rannc.graph.row_mixing.unsplittable).
    syms = sorted((s for s in expr.free_symbols if not symbol_is_type(s, SymT.UNBACKED_INT)),
                  key=str)
    return expr.subs({s: BATCH for s in syms})


def _dtype_name(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        return str(val.dtype).removeprefix("torch.")
    if isinstance(val, torch.SymInt | int):
        return "sym_int"
    raise TypeError(f"unsupported value type {type(val).__name__}")


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = str(list(stack.values())[-1][0])
    if path.startswith("_empty"):  # torch's placeholder for "no module recorded"
        return ""
    return path.removeprefix("L['self'].").removeprefix("L['self']")


def _op_name(node: fx.Node) -> str:
    t = node.target
    if t is write_back:
        return WRITE_BACK_OP
    if t is functional_copy:
        return COPY_OP
    if isinstance(t, torch._ops.OpOverload):
        return f"aten.{t._schema.name.split('::')[-1]}.{t._overloadname}" if t.namespace == "aten" \
            else str(t)
    return getattr(t, "__name__", str(t))


def _mutated_args(node: fx.Node) -> list[fx.Node]:
    t = node.target
    if t is write_back:
        return [node.args[0]] if isinstance(node.args[0], fx.Node) else []
    if isinstance(t, torch._ops.HigherOrderOperator):
        return _mutated_in_region(node)
    if not isinstance(t, torch._ops.OpOverload):
        return []
    out: list[fx.Node] = []
    for i, a in enumerate(t._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
            if isinstance(v, fx.Node):
                out.append(v)
    return out


def _mutated_in_region(node: fx.Node) -> list[fx.Node]:
    """The operands a region op writes in place: torch.export records a `torch.no_grad()` or
    `torch.autocast` block inside forward as one op calling a submodule on the operands after
    it (`wrap_with_set_grad_enabled(False, submod, *operands)`), and a buffer updated in such a
    block (a counter, a running mean) is written inside the submodule, where the op's own
    schema does not say so. Without this the write was not known: a call run again after a
    wrong guess of the batch layout updated the buffer twice."""
    owner = node.graph.owning_module
    for i, a in enumerate(node.args):
        if not (isinstance(a, fx.Node) and a.op == "get_attr"):
            continue
        sub = getattr(owner, str(a.target), None) if owner is not None else None
        if not isinstance(sub, fx.GraphModule):
            continue
        operands = node.args[i + 1:]
        places = [n for n in sub.graph.nodes if n.op == "placeholder"]
        written = {m for n in sub.graph.nodes if n.op == "call_function"
                   for m in _mutated_args(n) if m.op == "placeholder"}
        return [op for p, op in zip(places, operands, strict=False)
                if p in written and isinstance(op, fx.Node)]
    return []


def _drop_dead_code(gm: fx.GraphModule, buffers: set[str]) -> None:
    """Erase tasks whose results nothing reads (a branch the model computes and drops).

    Besides costing time, a dead task split from its producer by a stage boundary would send
    back a zero gradient where the original model has none (`.grad` None, skipped by the
    optimizer). Kept: tasks writing a graph input or a buffer in place (the write-backs of a
    functionalised graph among them), tasks reading a buffer (unless functionalised, BatchNorm
    in training updates its statistics without saying so in its schema), and random ops
    (dropping one would shift the random stream of the ops after it)."""
    for node in reversed(list(gm.graph.nodes)):
        if node.op != "call_function" or node.users:
            continue
        t = node.target
        if isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags:
            continue
        if any(a.op == "placeholder" for a in _mutated_args(node)):
            continue
        if any(a.op == "placeholder" and a.name in buffers for a in node.all_input_nodes):
            continue
        gm.graph.erase_node(node)


def write_back(buffer: torch.Tensor, new: torch.Tensor) -> None:
    """Store a buffer's new value computed by the functionalised graph (task op
    `WRITE_BACK_OP`).

    Through `.data`, which has a version counter of its own, as the eager kernels update
    BatchNorm's statistics: the functional BatchNorm saves the old statistics for its backward,
    and a visible in-place write would make that backward fail ("modified by an inplace
    operation")."""
    with torch.no_grad():
        buffer.data.copy_(new.detach())


def functional_copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Functionalisation's `aten.copy(dst, src)` (task op `COPY_OP`): src's values in a new
    tensor of dst's size, strides and dtype. Autograd has no formula for `aten.copy` (AOTAutograd
    normally runs such graphs); a `copy_` into a fresh tensor has one (the gradient goes to src
    only). The strides matter: the view ops functionalisation replays afterwards assume them."""
    out = torch.empty_strided(dst.size(), dst.stride(), dtype=dst.dtype, device=dst.device)
    return out.copy_(src)


def _runnable_in_eager(gm: fx.GraphModule) -> None:
    """Make the functional graph run under eager autograd on real tensors: every `aten.copy`
    becomes `functional_copy`, and every `view` a `reshape`. Why the views: functionalisation
    drops a `.contiguous()` that the fake tensors' strides say is a no-op, but eager kernels
    (T5's attention matmul) can return other strides than the fake ones, and the `view` that
    follows then fails. With no in-place op left on activations, a view and a reshape
    compute the same values; a reshape copies only where a view would fail."""
    aten = torch.ops.aten
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is aten.copy.default:
            node.target = functional_copy
        elif node.target in (aten.view.default, aten._unsafe_view.default):
            node.target = aten.reshape.default


def _constant(node: fx.Node, memo: dict[fx.Node, Any], batch: int | None = None) -> Any:
    """The value of `node` where it is computed from literals alone (no graph input, parameter,
    buffer or symbolic size), else None; evaluated once, on the CPU whatever device the graph
    names (a meta-device capture, which `rannc.plan` makes, must give the same graph as a real
    one: a plan is checked against the graph it was made for). With `batch`, a model input's
    size along dim 0 (the one symbolic size rannc's capture makes) counts as that literal: the
    value for a call of `batch` rows, of what depends on the inputs' shapes alone."""
    if node in memo:
        return memo[node]
    memo[node] = None
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) \
            or torch.Tag.nondeterministic_seeded in node.target.tags:
        return None
    if node.target is torch.ops.aten.sym_size.int:
        if batch is not None and node.args[1] == 0 and isinstance(node.args[0], fx.Node) \
                and node.args[0].op == "placeholder":
            memo[node] = batch
        return memo[node]
    if any(isinstance(x, torch.SymInt | torch.SymFloat | torch.SymBool)
           for x in pytree.tree_leaves((node.args, node.kwargs))):
        return None
    inputs = {}
    for n in node.all_input_nodes:
        value = _constant(n, memo, batch)
        if value is None:
            return None
        inputs[n] = value
    args, kwargs = pytree.tree_map_only(fx.Node, inputs.__getitem__, (node.args, node.kwargs))
    if "device" in kwargs:
        kwargs = {**kwargs, "device": torch.device("cpu")}
    out = node.target(*args, **kwargs)
    memo[node] = out if isinstance(out, torch.Tensor) else None
    return memo[node]


def _sdpa_masks(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    """(each `scaled_dot_product_attention` node given a mask, that mask's node): positional
    (argument 3) or by keyword."""
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is sdpa:
            mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
            if isinstance(mask, fx.Node):
                out.append((node, mask))
    return out


def _set_attention_mask(node: fx.Node, mask: fx.Node | None) -> None:
    """Make the attention `node` read `mask` instead of the one it was given."""
    if len(node.args) > 3:
        node.args = (*node.args[:3], mask, *node.args[4:])
    else:
        node.kwargs = {**node.kwargs, "attn_mask": mask}


# The most elements of a literal mask the capture evaluates (`_drop_all_true_attention_masks`):
# BERT's is batch-free, one per query (S); a causal S x S mask of a long sequence (Llama at
# 32k: 2^30) is not worth the host memory, and it is never all True anyway.
_LITERAL_MASK_ELEMENTS = 1 << 20


def _drop_all_true_attention_masks(gm: fx.GraphModule) -> None:
    """Pass no mask to a `scaled_dot_product_attention` whose boolean mask is all True and
    made from literals alone (an expansion of such a tensor included): every key takes part
    either way, so the attention is the same, and eager PyTorch passes none there.

    Traced, Hugging Face's bidirectional mask for a call without an attention mask (BERT's) is
    `arange(S) >= 0` expanded over the batch and the keys, where eager decides from the data that
    no mask is needed. With it the GPU's fused kernels take a mask (the memory-efficient one, or
    none at all: see `_dense_attention_masks`) and keep it as an additive bias per layer, batch
    x S x S elements in the query's dtype (`benchmarks/attention_probe.py`)."""
    memo: dict[fx.Node, torch.Tensor | None] = {}
    for node, mask in _sdpa_masks(gm):
        base = mask.args[0] if mask.target is torch.ops.aten.expand.default else mask
        val = base.meta.get("val") if isinstance(base, fx.Node) else None
        if not isinstance(base, fx.Node) or not isinstance(val, torch.Tensor) \
                or not isinstance(n := val.numel(), int) or n > _LITERAL_MASK_ELEMENTS:
            continue
        value = _constant(base, memo)
        if value is not None and value.dtype == torch.bool and bool(value.all()):
            _set_attention_mask(node, None)


# The most elements of a mask the capture evaluates to find it causal (`_causal_attention_masks`),
# per batch size tried: a sequence of 8k at batch 2 (the host memory of a few such tensors).
_CAUSAL_MASK_ELEMENTS = 1 << 27


def _causal_attention_masks(gm: fx.GraphModule) -> None:
    """Pass `is_causal=True` and no mask to a `scaled_dot_product_attention` whose boolean
    mask depends on the inputs' shapes alone and is the lower triangle (query i sees keys up to
    i, queries and keys of one length) in every row and head.

    Traced, Hugging Face's causal masks (GPT-2's, Llama's, ... in transformers 5) are built from
    position ids (an `arange` expanded over the symbolic batch) and compared in the graph, where
    eager finds from the data that no mask is needed and passes `is_causal` instead. With the
    mask, the attention kernels keep it as an additive bias per layer (batch x S x S elements in
    the query's dtype: `benchmarks/attention_probe.py` on the H100), and FlashAttention, which
    takes no mask, is out of reach. The mask is evaluated for a batch of 1 and of 2 rows (its
    rows must not differ: nothing in it depends on the data); where both are causal, the call
    is what eager makes."""
    memos: dict[int, dict[fx.Node, Any]] = {1: {}, 2: {}}
    tril: dict[int, torch.Tensor] = {}
    for node, mask in _sdpa_masks(gm):
        q, k = (a.meta.get("val") if isinstance(a, fx.Node) else None for a in node.args[:2])
        if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
            continue
        lq, lk = q.shape[-2], k.shape[-2]
        causal_given = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
        val = mask.meta.get("val")
        if not (isinstance(lq, int) and lq == lk and lq > 1) or causal_given \
                or not isinstance(val, torch.Tensor) or val.dtype != torch.bool \
                or math.prod(d if isinstance(d, int) else 2 for d in val.shape) > _CAUSAL_MASK_ELEMENTS:
            continue
        if lq not in tril:
            tril[lq] = torch.ones(lq, lq, dtype=torch.bool).tril()
        if all(isinstance(value := _constant(mask, memo, b), torch.Tensor) and value.dim() >= 2
               and tuple(value.shape[-2:]) == (lq, lq) and bool((value == tril[lq]).all())
               for b, memo in memos.items()):
            _set_attention_mask(node, None)
            if len(node.args) > 5:
                node.args = (*node.args[:5], True, *node.args[6:])
            else:
                node.kwargs = {**node.kwargs, "is_causal": True}


def _dense_attention_masks(gm: fx.GraphModule) -> None:
    """Give every `scaled_dot_product_attention` a mask that is dense along the keys.

    A mask expanded across the keys has stride 0 in its last dimension, and on any device but
    the CPU PyTorch's fused attention kernels refuse a mask whose last dimension is not stride
    1 (`check_last_dim_stride_equals_1_dense`, pytorch/pytorch#158424): the graph then runs the
    unfused math attention on a GPU, saving the probabilities, the dropout mask and the dropped
    probabilities of every layer. Found on BERT called without a mask (traced, `arange(S) >= 0`
    expanded so; now dropped by `_drop_all_true_attention_masks`): 1.49x plain PyTorch's peak
    memory (H100, BertForMaskedLM L12 H768, 32 x 512, fp32: 27.5 against 18.4 GiB;
    `benchmarks/gpu_memory.py`). Masks computed from the data can take that shape too. One
    contiguous copy of each such mask (batch x queries x keys elements, shared by every layer
    reading it) holds the same values; the CPU kernels, which accept either, copy such a mask
    themselves."""
    dense: dict[fx.Node, fx.Node] = {}
    for node, mask in _sdpa_masks(gm):
        val = mask.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() == 0:
            continue
        last, size = val.stride()[-1], val.shape[-1]
        if not (isinstance(last, int) and last != 1 and not (isinstance(size, int) and size <= 1)):
            continue
        if mask not in dense:
            with gm.graph.inserting_after(mask):
                copy = gm.graph.call_function(torch.ops.aten.clone.default, (mask,),
                                              {"memory_format": torch.contiguous_format})
            copy.meta = {**mask.meta, "val": val.clone(memory_format=torch.contiguous_format)}
            dense[mask] = copy
        _set_attention_mask(node, dense[mask])


def _alias_base(node: fx.Node) -> fx.Node:
    """The tensor a view (slice, select, transpose, view, ...) of a view ... aliases."""
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        schema = node.target._schema
        if not (schema.arguments and schema.returns and node.args
                and isinstance(node.args[0], fx.Node)):
            break
        arg0, ret0 = schema.arguments[0].alias_info, schema.returns[0].alias_info
        if arg0 is None or arg0.is_write or ret0 is None:
            break
        node = node.args[0]
    return node


def _writes(gm: fx.GraphModule, outer: dict[fx.Node, fx.Node],
            ) -> Iterator[tuple[fx.Node, fx.Node, fx.Node]]:
    """(in-place node, the tensor it writes, the top-level tensor that one is or views), also
    inside the subgraphs of higher-order ops (`with torch.no_grad():` is one); `outer` maps a
    subgraph's placeholders to the top-level nodes passed in."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        # (a region op's writes are its subgraph's: found there, below, with their own lines)
        own = [] if isinstance(node.target, torch._ops.HigherOrderOperator) else _mutated_args(node)
        for written in own:
            base = _alias_base(written)
            yield node, written, outer.get(base, base)
        subs = [a for a in node.args if isinstance(a, fx.Node) and a.op == "get_attr"
                and isinstance(getattr(gm, str(a.target), None), fx.GraphModule)]
        if len(subs) == 1:
            sub = getattr(gm, str(subs[0].target))
            operands = [a for a in node.args[node.args.index(subs[0]) + 1:] if isinstance(a, fx.Node)]
            inner = [n for n in sub.graph.nodes if n.op == "placeholder"]
            mapping = {p: outer.get(_alias_base(a), _alias_base(a))
                       for p, a in zip(inner, operands, strict=False)}
            yield from _writes(sub, mapping)


def _writes_through_a_view(gm: fx.GraphModule) -> bool:
    """Whether some in-place op writes through a view (`s[..., 1:] = ...`, `t.transpose(0, 1)[1]
    .add_(...)`): the only writes the training IR does not make visible to later readers.

    An in-place op on a whole tensor (`h.relu_()`, `c.index_put_(...)`, BatchNorm's counter)
    is safe as it is: torch.export makes every later reader read the in-place op's result, so
    the data flow holds the write. A write through a view changes the view's base, whose later
    readers read the base, so only functionalisation (`run_decompositions({})`: `slice_scatter`
    and friends, new values for the base) keeps it. It is done only then, because it costs:
    BERT 24x1024 on meta, export 57.8 s, export + functionalisation 181.3 s
    (benchmarks/capture_functionalize.py)."""
    return any(_alias_base(w) is not w for _, w, _ in _writes(gm, {}))


def _batching_transforms(gm: fx.GraphModule) -> bool:
    """Whether the graph holds torch.vmap's plumbing (`_vmap_increment_nesting`,
    `_add_batch_dim`, ...: the training IR records a vmap as calls into functorch's
    interpreter stack). Hugging Face's masks before transformers 5 are built with vmap
    (`masking_utils._vmap_for_bhqkv`: Llama, Mistral, Qwen2, GPT-2 and most decoders of 4.5x).
    Those calls take and return no tensor the graph can follow (a nesting level, or nothing),
    so split into tasks they would be dropped as dead code or placed apart from the region they
    open and close, and running the graph fails ("your tensor may have escaped from inside a
    function being vmapped"). `run_decompositions({})` retraces below the functorch layer,
    where the vmap has run: plain batched ops instead, at the cost of the functionalisation
    `_writes_through_a_view` describes."""
    return any(n.op == "call_function"
               and getattr(n.target, "__module__", "") == "torch._functorch.predispatch"
               for n in gm.graph.nodes)


def _refuse_writes_into_inputs_or_parameters(ep: ExportedProgram) -> None:
    """A write into a user input or a parameter (directly or through a view) cannot be kept:
    the input's rows live on other ranks, and the parameter on other stages and replicas.
    Found here, in the training IR, where each op still carries the user's stack."""
    kinds = {spec.arg.name: spec for spec in ep.graph_signature.input_specs
             if spec.kind in (InputKind.USER_INPUT, InputKind.PARAMETER)
             and isinstance(spec.arg, TensorArgument)}
    for node, _, base in _writes(ep.graph_module, {}):
        spec = kinds.get(base.name) if base.op == "placeholder" else None
        if spec is not None:
            what = "parameter" if spec.kind is InputKind.PARAMETER else "input"
            name = spec.target if spec.kind is InputKind.PARAMETER else base.name
            raise _unkept_write(f"{what} '{name}'", node)


def _refuse_collectives(gm: fx.GraphModule) -> None:
    """A torch.distributed collective in forward (an all_gather of features for a contrastive
    loss over every rank's samples, as DDP training scripts write): rannc distributes the model
    itself, so the collective would run on the ranks of one stage only, once per microbatch
    and replica, and the other ranks never join (a time-out after minutes, on several ranks).
    Refused by name at capture, in one process too (the same model fails on several)."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = _op_name(node)
        if name.startswith(("_c10d_functional.", "c10d.", "_c10d_functional_autograd.")):
            path = _module_path(node)
            trace = str(node.meta.get("stack_trace", "")) + str(node.meta.get("nn_module_stack", ""))
            fix = ("convert nn.SyncBatchNorm back to BatchNorm and wrap with "
                   "RaNNCModule(..., batchnorm='sync'), which sums the statistics over a stage's "
                   "replicas itself") if "SyncBatchNorm" in trace or "sync_batch_norm" in trace \
                else ("return what it needs from forward (each rank gets back its own rows) and "
                      "combine them across ranks outside the model, e.g. all_gather the returned "
                      "features and compute the loss there; the model on the global batch needs "
                      "no collective")
            raise CaptureError(
                f"rannc could not capture the model: it calls a torch.distributed collective "
                f"({name.split('.')[1]}) in forward, in module '{path or '(the model itself)'}' "
                f"at {_source_line(node)}. rannc splits the model and the batch over the ranks "
                "itself: the collective would run on one stage's ranks only, once per "
                f"microbatch, and the other ranks would never join. Fix: {fix}",
                module_path=path or None)


def _unkept_write(target: str, node: fx.Node | None) -> CaptureError:
    """The error for a write into an input or a parameter ("input 'x'"), at `node`'s line."""
    where = "" if node is None else \
        f" ({_op_name(node)}), in module '{_module_path(node)}' at {_source_line(node)}"
    fix = ("Fix: write into a copy (e.g. `x = x.clone()` before the in-place op), or update "
           "parameters outside forward().")
    if node is not None and "embedding_renorm" in _op_name(node):
        fix = ("It is nn.Embedding(max_norm=...), which renormalises the looked-up rows of its "
               "weight in forward. Fix: build it with max_norm=None; to keep the "
               "renormalisation, apply it before each call, outside forward, with the global "
               "batch's ids: `with torch.no_grad(): torch.embedding_renorm_(emb.weight, ids, "
               "max_norm, 2.0)` where the rank holds the weight (`emb.weight.numel() > 0`).")
    return CaptureError(
        f"rannc cannot preserve a mutation: the model writes into its {target} in place{where}. "
        f"An input or parameter written inside forward() would be changed on one rank only. {fix}",
        module_path=(_module_path(node) or None) if node is not None else None,
    )


def _source_line(node: fx.Node) -> str:
    """The innermost user source line of a node's stack trace ("file:line: code")."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)',
                        str(node.meta.get("stack_trace") or ""))
    if not frames:
        return "unknown source line"
    file, line, code = frames[-1]
    return f"{file}:{line}: {code.strip()}"


def _inputs_returned_as_copies(gm: fx.GraphModule, specs: list[OutputSpec],
                               user_inputs: set[str]) -> list[OutputSpec]:
    """A model input the model returns as it is (`return {"logits": ..., "labels": labels}`)
    becomes a copy the graph computes (`aten.clone`), so a stage computes it as any output and
    every rank gets its own rows back (gradients, where the input requires them, flow through
    the copy as through the identity). Before, on several ranks, the first call failed with
    "model output labels is not computed by any stage". Called after `_write_back_mutations`:
    the output node's arguments are then the user outputs, one per spec."""
    (out_node,) = [n for n in gm.graph.nodes if n.op == "output"]
    args = list(out_node.args[0])
    copies: dict[fx.Node, fx.Node] = {}
    for i, arg in enumerate(args):
        if not (isinstance(arg, fx.Node) and arg.op == "placeholder" and arg.name in user_inputs
                and isinstance(arg.meta.get("val"), torch.Tensor)):
            continue
        if arg not in copies:
            with gm.graph.inserting_before(out_node):
                copies[arg] = gm.graph.call_function(torch.ops.aten.clone.default, (arg,))
            copies[arg].meta = dict(arg.meta)
        args[i] = copies[arg]
        specs[i] = OutputSpec(kind=specs[i].kind, arg=TensorArgument(name=copies[arg].name),
                              target=specs[i].target)
    if copies:
        out_node.args = (tuple(args),)
    return specs


def _write_back_mutations(ep: ExportedProgram) -> list[OutputSpec]:
    """Turn the functionalised graph's buffer mutations back into explicit in-place writes;
    returns the user output specs.

    Why functionalise at all: torch.export's training IR keeps the model's in-place ops, and a
    write through a view (`s = x.new_zeros(...); s[..., 1:] = x[..., :-1]`, Hugging Face's
    `shift_tokens_right`, Swin's attention mask) is a `copy_` into a `slice` whose result
    nothing reads. Nothing in the graph says that the later readers of `s` depend on it, so
    dead-code removal, reordering and stage boundaries all lose the write. Functionalisation
    rewrites every such write as a new value (`slice_scatter`), so the data flow is the graph.

    What stays a side effect is a write into state that outlives the call: buffers (BatchNorm
    statistics) come back as a `write_back` into the buffer's placeholder, placed after the new
    value and after the last task reading the old one, so the stage holding them updates the
    user's own buffer as the original does. Writes into the inputs or the parameters cannot be
    kept across ranks: they are a CaptureError naming the line."""
    gm, sig = ep.graph_module, ep.graph_signature
    nodes = {n.name: n for n in gm.graph.nodes}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    placeholder_of = {spec.target: nodes[spec.arg.name] for spec in sig.input_specs
                      if spec.kind is InputKind.BUFFER and isinstance(spec.arg, TensorArgument)}
    (out_node,) = [n for n in gm.graph.nodes if n.op == "output"]
    out_args = list(out_node.args[0])
    keep_args: list[Any] = []
    user_specs: list[OutputSpec] = []
    for spec, arg in zip(sig.output_specs, out_args, strict=True):
        if spec.kind is OutputKind.USER_OUTPUT:
            keep_args.append(arg)
            user_specs.append(spec)
            continue
        new = arg if isinstance(arg, fx.Node) else None
        if spec.kind is OutputKind.BUFFER_MUTATION and new is not None:
            buf = placeholder_of[spec.target]
            anchor = max([new, *buf.users], key=order.__getitem__)
            with gm.graph.inserting_after(anchor):
                w = gm.graph.call_function(write_back, (buf, new))
            w.meta = {**new.meta, "val": None}
            continue
        # A write the training-IR check missed (_refuse_writes_into_inputs_or_parameters).
        what = {OutputKind.USER_INPUT_MUTATION: "input", OutputKind.PARAMETER_MUTATION: "parameter"}
        raise _unkept_write(f"{what.get(spec.kind, spec.kind.name)} '{spec.target}'", new)
    out_node.args = (tuple(keep_args),)
    return user_specs


def _from_exported(ep: ExportedProgram, layout: InputLayout, seconds: float,
                   functional: bool) -> CapturedModel:
    gm = ep.graph_module
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and _op_name(node) in _DROPPED_OPS and not node.users:
            gm.graph.erase_node(node)
    sig = ep.graph_signature
    user_outputs = _inputs_returned_as_copies(
        gm, _write_back_mutations(ep), {str(getattr(spec.arg, "name", "")) for spec in
                                        sig.input_specs if spec.kind is InputKind.USER_INPUT})
    if functional:
        _runnable_in_eager(gm)
    _drop_all_true_attention_masks(gm)
    _causal_attention_masks(gm)
    _dense_attention_masks(gm)
    _drop_dead_code(gm, {str(getattr(spec.arg, "name", "")) for spec in sig.input_specs
                         if spec.kind is InputKind.BUFFER})
    gm.recompile()

    kind_of: dict[str, tuple[ValueKind, str | None]] = {}
    constants: dict[str, torch.Tensor] = {}
    user_inputs: list[str | None] = []
    for spec in sig.input_specs:
        name = str(getattr(spec.arg, "name", ""))
        if spec.kind is InputKind.PARAMETER:
            kind_of[name] = (ValueKind.PARAM, spec.target)
        elif spec.kind is InputKind.BUFFER:
            kind_of[name] = (ValueKind.BUFFER, spec.target)
        elif spec.kind is InputKind.CONSTANT_TENSOR:
            kind_of[name] = (ValueKind.CONSTANT, spec.target)
            constants[name] = ep.constants[spec.target]  # type: ignore[index,assignment]
        elif spec.kind is InputKind.USER_INPUT:
            user_inputs.append(name if isinstance(spec.arg, TensorArgument) else None)
        elif isinstance(ep.constants.get(spec.target), torch.Generator):  # type: ignore[arg-type]
            raise CaptureError(
                "rannc cannot capture draws from a torch.Generator of the model's own "
                "(`torch.randn(..., generator=g)` in forward): torch.export lifts the generator "
                "into the graph as an object, which rannc cannot place on a stage or replay "
                f"per call. {_GENERATOR_FIX}")
        else:
            raise CaptureError(f"unsupported graph input kind {spec.kind.name} ({spec.target})")
    for i, leaf_is_tensor in enumerate(user_inputs):
        if leaf_is_tensor is not None:
            kind_of[leaf_is_tensor] = (ValueKind.INPUT, f"input[{i}]")

    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    value_owner: dict[str, int] = {}  # value name -> index of the task producing it
    for i, n in enumerate(nodes):
        val = n.meta.get("val")
        if isinstance(val, tuple | list):
            for u in n.users:
                value_owner[u.name] = i
        elif val is not None:
            value_owner[n.name] = i

    def input_names(n: fx.Node) -> list[str]:
        seen: list[str] = []
        for a in n.all_input_nodes:
            if a.op == "get_attr":
                continue
            if a.op == "call_function" and a.name not in value_owner:
                raise CaptureError(
                    f"op {_op_name(n)} in module '{_module_path(n)}' reads the whole "
                    f"multi-output result of {_op_name(a)}; rannc cannot represent it"
                )
            if a.name not in seen:
                seen.append(a.name)
        return seen

    inputs_of = [input_names(n) for n in nodes]
    # Through tensors only: what depends on the inputs' sizes alone is constant (see
    # rannc.atomic.components.non_constant_tasks).
    sizes = {n.name for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.SymInt | int)}
    edges = [(value_owner[v], j) for j, ins in enumerate(inputs_of) for v in ins
             if v in value_owner and v not in sizes]
    sources = [j for j, ins in enumerate(inputs_of)
               if any(kind_of.get(v, (None,))[0] is ValueKind.INPUT for v in ins)]
    non_constant = forward_reachable(len(nodes), edges, sources)

    values: dict[str, Value] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.name in kind_of:
            kind, target = kind_of[n.name]
            values[n.name] = _make_value(n.name, n.meta.get("val"), kind, None, target)
    tasks: list[Task] = []
    for i, n in enumerate(nodes):
        kind = ValueKind.ACTIVATION if non_constant[i] else ValueKind.CONSTANT
        val = n.meta.get("val")
        outs = [u for u in n.users if u.target is operator.getitem] if isinstance(val, tuple | list) \
            else ([n] if val is not None else [])
        for o in outs:
            try:
                values[o.name] = _make_value(o.name, o.meta.get("val"), kind, n.name, None)
            except CaptureError as e:  # say where, with the module, as the export's errors do
                raise CaptureError(f"rannc could not capture the model: {e} in module "
                                   f"'{_module_path(n)}' ({_source_line(n)})",
                                   module_path=_module_path(n)) from None
        tasks.append(Task(
            name=n.name, op=_op_name(n), inputs=tuple(inputs_of[i]),
            outputs=tuple(o.name for o in outs), module_path=_module_path(n),
            mutates=tuple(a.name for a in _mutated_args(n)),
        ))

    outputs: list[str | None] = []
    output_constants: list[Any] = []
    for spec in user_outputs:
        out_name = getattr(spec.arg, "name", None)
        if out_name is not None and out_name in values:
            outputs.append(out_name)
            output_constants.append(None)
        else:
            outputs.append(None)
            output_constants.append(getattr(spec.arg, "value", None))
    graph = TaskGraph(tasks=tasks, values=values,
                      inputs=[u for u in user_inputs if u is not None], outputs=outputs)
    return CapturedModel(graph=graph, gm=gm, layout=layout, out_spec=ep.call_spec.out_spec,
                         leaf_values=user_inputs, output_constants=output_constants,
                         constants=constants, seconds=seconds, autocast=autocast_state())


def _make_value(name: str, val: Any, kind: ValueKind, producer: str | None,
                target: str | None) -> Value:
    if isinstance(val, torch.Tensor):
        shape, bdim, scale = _val_shape(val)
        return Value(name, kind, shape, _dtype_name(val), bdim, scale, producer, target)
    if isinstance(val, torch.SymInt | int):
        expr = _sym(val)
        return Value(name, kind, (), "sym_int", None, 1, producer, target, sym_expr=str(expr))
    if isinstance(val, torch.SymFloat | torch.SymBool | float | bool):
        # (a float or bool the graph computes, from a tensor's value (.item()) or from shapes:
        # a graph value rannc cannot carry between stages nor size tensors by)
        raise CaptureError(
            f"{name} is a Python {type(val).__name__} computed inside forward() (from a "
            "tensor's value, e.g. .item(), or a float of its shape); rannc's graph carries "
            "tensors and integer sizes. Keep it a tensor (torch.where instead of an `if`); "
            "divide a tensor by a size instead of making a float of it (`t / x.size(0)`, not "
            "`t * (1.0 / x.size(0))`); or compute it from Python numbers (for a Hugging Face "
            "model a newer transformers may)")
    raise CaptureError(f"value {name} has unsupported type {type(val).__name__}")


__all__ = ["AutocastState", "CapturedModel", "InputLayout", "autocast_state", "capture",
           "flatten_inputs", "running_as"]
