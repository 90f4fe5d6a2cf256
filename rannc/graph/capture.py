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

import inspect
import operator
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.export import Dim, ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind, TensorArgument

from rannc.errors import CaptureError
from rannc.graph.native import forward_reachable
from rannc.graph.task_graph import Task, TaskGraph, Value, ValueKind
from rannc.validate import output_type_error

BATCH = sympy.Symbol("batch")

# Checks torch.export inserts that compute nothing; keeping them would make
# atomic components that produce no value.
_DROPPED_OPS = {
    "aten._assert_tensor_metadata.default",
    "aten._assert_async.msg",
    "aten._assert_scalar.default",
    "aten.sym_constrain_range_for_size.default",
}


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

    def bind(self, model: nn.Module, leaves: Sequence[Any]) -> dict[str, Any]:
        """The graph's input values for one call: the model's own parameters and buffers
        (so autograd and in-place updates reach them), the lifted constants, and the
        call's flat input leaves, by value name."""
        params = dict(model.named_parameters(remove_duplicate=False))
        buffers = dict(model.named_buffers(remove_duplicate=False))
        env: dict[str, Any] = dict(self.constants)
        for name, v in self.graph.values.items():
            if v.kind is ValueKind.PARAM:
                env[name] = params[v.target or ""]
            elif v.kind is ValueKind.BUFFER and v.producer is None:
                env[name] = buffers[v.target or ""]
        for leaf_name, leaf in zip(self.leaf_values, leaves, strict=True):
            if leaf_name is not None:
                env[leaf_name] = leaf
        return env

    def unflatten_outputs(self, values: Mapping[str, Any]) -> Any:
        """The model's output structure from the computed values."""
        flat = [values[v] if v is not None else c
                for v, c in zip(self.graph.outputs, self.output_constants, strict=True)]
        return pytree.tree_unflatten(flat, self.out_spec)


def flatten_inputs(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[list[Any], InputLayout]:
    """Flatten a call's inputs (kwargs sorted by key) and describe their layout."""
    tree = (tuple(args), {k: kwargs[k] for k in sorted(kwargs)})
    leaves, spec = pytree.tree_flatten(tree)
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


def capture(
    model: nn.Module, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
) -> CapturedModel:
    """Capture `model(*args, **kwargs)` as a TaskGraph, with the batch dim symbolic."""
    kwargs = dict(kwargs or {})
    leaves, layout = flatten_inputs(args, kwargs)
    if not any(layout.batch_leaves):
        raise CaptureError(
            "rannc needs at least one tensor input with a batch dimension (dim 0) to "
            "split the batch; the model was called with none. Pass the batch as a tensor."
        )
    device = _model_device(model)
    leaves = [_prepare_leaf(x, b, device) for x, b in zip(leaves, layout.batch_leaves, strict=True)]
    ex_args, ex_kwargs = pytree.tree_unflatten(leaves, layout.spec)
    dynamic_shapes = _dynamic_shapes(model, layout)
    t0 = time.perf_counter()
    try:
        ep = torch.export.export(
            model, tuple(ex_args), dict(ex_kwargs),
            dynamic_shapes=dynamic_shapes,
            strict=False,
        )
    except Exception as e:  # torch.export raises many types; all become a CaptureError
        raise _capture_error(model, e) from e
    seconds = time.perf_counter() - t0
    return _from_exported(ep, layout, seconds)


def _dynamic_shapes(model: nn.Module, layout: InputLayout) -> dict[str, Any]:
    """torch.export's dynamic_shapes: dim 0 symbolic for every batched leaf, by parameter name."""
    batch = Dim("batch", min=1)
    flags = [{0: batch} if b else None for b in layout.batch_leaves]
    dyn_args, dyn_kwargs = pytree.tree_unflatten(flags, layout.spec)
    try:
        bound = inspect.signature(model.forward).bind(*dyn_args, **dyn_kwargs)
    except TypeError as e:
        raise CaptureError(
            f"the inputs do not match {type(model).__name__}.forward's signature: {e}"
        ) from e
    return dict(bound.arguments)


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


def _capture_error(model: nn.Module, e: BaseException) -> CaptureError:
    """Name the innermost user module on the failing stack, and say what usually causes it."""
    wrong_output = output_type_error(type(model).__name__, e)
    if wrong_output is not None:  # found after tracing: no module to name, the type says it all
        return wrong_output
    names = {id(m): n for n, m in model.named_modules()}
    path: str | None = None
    where = ""
    for frame, _ in traceback.walk_tb(e.__traceback__):
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            path = names[id(owner)] or "<root>"
            code = frame.f_code
            where = f"{type(owner).__name__}.{code.co_name} ({code.co_filename}:{frame.f_lineno})"
    reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
    if "specialized it to be a constant" in str(e):
        # Found after tracing, so the stack names no module: say what it means instead.
        reason += (" The model's code fixes the batch size (e.g. x.view(4, -1) or a "
                   "torch.zeros(4, ...)); derive it from the input with x.size(0) or -1.")
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
    syms = sorted(expr.free_symbols, key=str)
    # One dynamic dim is declared (the batch), so its symbol is the only free one.
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
    if isinstance(t, torch._ops.OpOverload):
        return f"aten.{t._schema.name.split('::')[-1]}.{t._overloadname}" if t.namespace == "aten" \
            else str(t)
    return getattr(t, "__name__", str(t))


def _mutated_args(node: fx.Node) -> list[fx.Node]:
    t = node.target
    if not isinstance(t, torch._ops.OpOverload):
        return []
    out: list[fx.Node] = []
    for i, a in enumerate(t._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
            if isinstance(v, fx.Node):
                out.append(v)
    return out


def _drop_dead_code(gm: fx.GraphModule, buffers: set[str]) -> None:
    """Erase tasks whose results nothing reads (a branch the model computes and drops).

    Besides costing time, a dead task split from its producer by a stage boundary would send
    back a zero gradient where the original model has none (`.grad` None, skipped by the
    optimizer). Kept: tasks writing a graph input or a buffer in place, tasks reading a buffer
    (BatchNorm in training updates its statistics without saying so in its schema), and
    random ops (dropping one would shift the random stream of the ops after it)."""
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


def _from_exported(ep: ExportedProgram, layout: InputLayout, seconds: float) -> CapturedModel:
    gm = ep.graph_module
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and _op_name(node) in _DROPPED_OPS and not node.users:
            gm.graph.erase_node(node)
    sig = ep.graph_signature
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
    edges = [(value_owner[v], j) for j, ins in enumerate(inputs_of) for v in ins if v in value_owner]
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
            values[o.name] = _make_value(o.name, o.meta.get("val"), kind, n.name, None)
        tasks.append(Task(
            name=n.name, op=_op_name(n), inputs=tuple(inputs_of[i]),
            outputs=tuple(o.name for o in outs), module_path=_module_path(n),
            mutates=tuple(a.name for a in _mutated_args(n)),
        ))

    outputs: list[str | None] = []
    output_constants: list[Any] = []
    for spec in sig.output_specs:
        if spec.kind is not OutputKind.USER_OUTPUT:
            raise CaptureError(
                f"unsupported graph output kind {spec.kind.name}: the model mutates an input "
                "in place or returns a mutated buffer; rannc supports in-place updates of "
                "buffers only"
            )
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
                         constants=constants, seconds=seconds)


def _make_value(name: str, val: Any, kind: ValueKind, producer: str | None,
                target: str | None) -> Value:
    if isinstance(val, torch.Tensor):
        shape, bdim, scale = _val_shape(val)
        return Value(name, kind, shape, _dtype_name(val), bdim, scale, producer, target)
    if isinstance(val, torch.SymInt | int):
        expr = _sym(val)
        return Value(name, kind, (), "sym_int", None, 1, producer, target, sym_expr=str(expr))
    raise CaptureError(f"value {name} has unsupported type {type(val).__name__}")


__all__ = ["CapturedModel", "InputLayout", "capture", "flatten_inputs"]
