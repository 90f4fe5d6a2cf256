"""Export a TaskGraph as an ONNX model, so a captured model and its partition can be looked at.

Why ONNX: it is the exchange format that graph viewers read, Netron
(https://netron.app) first among them. rannc does not run the exported model;
the file is for looking at what was captured and how the planner split it:
which ATen op each task is, which module issued it, what shape (symbolic batch
included) each value has, and which atomic component, block and stage each
task was put in.

Mapping:

* one ONNX node per Task, in the graph's topological order. Its ``op_type`` is
  the ATen op name without the ``aten.`` prefix and the overload (``linear``
  for ``aten.linear.default``), in the custom domain ``org.pytorch.aten``
  (declared in ``opset_import`` next to the default domain, opset 17); the
  node's name is the task's name, its inputs and outputs the value names.
* graph inputs: the user inputs (in ``graph.inputs`` order), then the
  parameters, buffers and lifted constants (values of kind PARAM, BUFFER or
  CONSTANT that no task produces). Graph outputs: the non-None entries of
  ``graph.outputs``. An output that is a graph input, or that is returned
  twice, is written through an ``Identity`` node (default domain) into a new
  value ``<name>__output<i>``, since ONNX needs every graph output produced
  once; only then are there more nodes than tasks.
* ``value_info`` for every other value. Sizes that are ints become
  ``dim_value``; symbolic sizes keep their expression in ``batch`` as
  ``dim_param`` (``"batch"``, ``"16*batch"``). A symbolic size value
  (dtype ``sym_int``, e.g. the result of ``aten.sym_size``) is an INT64 scalar.
* initializers: the given tensors of the parameters, buffers and constants
  that are materialised; a tensor on the ``meta`` device is left out (its
  input still carries the shape and type).

Node attributes (the vocabulary a viewer shows):

* ``op`` (string): the full ATen op, e.g. ``aten.linear.default``;
* ``module_path`` (string): the user's module that issued the op, e.g.
  ``bert.encoder.layer.1.attention`` (``""`` at the root); also the node's
  ``doc_string``, which Netron shows as the node's description;
* ``mutates`` (strings, only when not empty): the inputs the op writes in
  place (``add_`` on BatchNorm's ``num_batches_tracked``);
* whatever the caller passes in ``task_attrs[task.name]``, int or string:
  ``atomic_component`` (the index of the task's atomic component), ``block``
  (its block after coarsening) and ``stage`` (its pipeline stage) are the
  names rannc uses.

The model's ``metadata_props`` record the graph's fingerprint
(``rannc.fingerprint``) and summary (``rannc.summary``).

Grouping (``group_by="stage"``, what ``Plan.to_onnx`` writes): each stage's nodes go into an
ONNX local function ``stage<k>`` (domain ``rannc.stage``), and the main graph holds one call
node per stage, wired by the values that cross stages. Netron draws a function call as one
node with a "show function definition" button that opens the stage's own graph; it does not
group an ONNX graph's nodes by ``/`` name scopes (its ONNX reader has that code switched off),
so functions are the grouping it shows. Every task node also carries its group in a name
scope (``stage1/linear_3``, which Model Explorer and other scope-aware viewers fold into a
group), in its ``metadata_props`` (``stage`` = ``1``) and in its ``stage`` attribute.

``onnx`` is an optional dependency (``pip install onnx``); it is imported only
when an export is asked for.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from rannc.graph.task_graph import TaskGraph, Value, ValueKind

if TYPE_CHECKING:
    import onnx
    from onnx import FunctionProto

log = logging.getLogger(__name__)

ATEN_DOMAIN = "org.pytorch.aten"
ATEN_DOMAIN_VERSION = 1
GROUP_DOMAIN = "rannc.stage"  # the domain of the per-stage functions (group_by)
DEFAULT_OPSET = 17

# Attributes every node gets; task_attrs may not redefine them.
RESERVED_ATTRS = frozenset({"op", "module_path", "mutates"})

# rannc dtype names (torch dtypes without "torch.") -> onnx.TensorProto data type names.
_ONNX_DTYPES: dict[str, str] = {
    "float32": "FLOAT",
    "float64": "DOUBLE",
    "float16": "FLOAT16",
    "bfloat16": "BFLOAT16",
    "int8": "INT8",
    "int16": "INT16",
    "int32": "INT32",
    "int64": "INT64",
    "uint8": "UINT8",
    "uint16": "UINT16",
    "uint32": "UINT32",
    "uint64": "UINT64",
    "bool": "BOOL",
    "complex64": "COMPLEX64",
    "complex128": "COMPLEX128",
    "float8_e4m3fn": "FLOAT8E4M3FN",
    "float8_e4m3fnuz": "FLOAT8E4M3FNUZ",
    "float8_e5m2": "FLOAT8E5M2",
    "float8_e5m2fnuz": "FLOAT8E5M2FNUZ",
    "float8_e8m0fnu": "FLOAT8E8M0",
    "sym_int": "INT64",
}

# Initializers larger than this in total are saved as external data beside the file:
# a protobuf message cannot exceed 2 GiB.
_EXTERNAL_DATA_BYTES = 1 << 30

_GRAPH_INPUT_KINDS = (ValueKind.INPUT, ValueKind.PARAM, ValueKind.BUFFER, ValueKind.CONSTANT)


def _import_onnx() -> ModuleType:
    try:
        import onnx
    except ImportError as e:
        raise ImportError(
            "exporting a rannc task graph to ONNX needs the optional `onnx` package, which "
            "is not installed; install it with `pip install onnx` (or `pip install rannc[onnx]`)"
        ) from e
    return onnx


def op_type(op: str) -> str:
    """The ONNX op_type of an ATen op string: ``aten.linear.default`` -> ``linear``."""
    if op.startswith("aten."):
        parts = op.split(".")
        return parts[1] if len(parts) > 1 and parts[1] else op
    # Not an ATen overload (a Python builtin such as `mul`, or another namespace's op):
    # keep it whole, with "::" written as ".".
    return op.replace("::", ".")


def to_onnx_model(
    graph: TaskGraph,
    *,
    task_attrs: Mapping[str, Mapping[str, int | str]] | None = None,
    initializers: Mapping[str, torch.Tensor] | None = None,
    group_by: str | None = None,
) -> onnx.ModelProto:
    """The ONNX model of `graph` (see the module docstring for the mapping).

    `group_by` names an int attribute every task has in `task_attrs` (``"stage"``): the tasks
    sharing its value k become the local function ``<group_by><k>``, called once from the main
    graph, and their nodes are named ``<group_by><k>/<task>``.

    `task_attrs` maps a task name to extra node attributes (int or string), such as
    ``{"atomic_component": 3, "stage": 1}``. `initializers` maps a parameter, buffer or
    constant to its tensor, keyed by value name (``p_fc_weight``, as in
    ``CapturedModel.constants``) or by target (``fc.weight``, as in
    ``model.state_dict()``); keys matching no graph input are ignored, and tensors on the
    ``meta`` device are not embedded. Tied weights are named after one of their modules
    (BERT's word embedding is read as ``cls.predictions.decoder.weight``), which
    ``model.named_parameters()`` leaves out as a duplicate: pass ``model.state_dict()`` or
    ``named_parameters(remove_duplicate=False)``. Parameters and buffers not found are
    logged (at warning level) when a mapping is given.
    """
    onnx = _import_onnx()
    helper = onnx.helper
    task_attrs = task_attrs or {}
    initializers = initializers or {}

    task_names = {t.name for t in graph.tasks}
    unknown = sorted(set(task_attrs) - task_names)
    if unknown:
        raise ValueError(
            f"task_attrs names {len(unknown)} task(s) not in the graph: {', '.join(unknown[:5])}"
        )

    # -- graph inputs ----------------------------------------------------------
    input_names: list[str] = list(graph.inputs)
    seen_inputs = set(input_names)
    for name, v in graph.values.items():
        if v.producer is None and v.kind in _GRAPH_INPUT_KINDS and name not in seen_inputs:
            input_names.append(name)
            seen_inputs.add(name)
    for name in input_names:
        if graph.values[name].producer is not None:
            raise ValueError(f"graph input '{name}' is produced by task "
                             f"'{graph.values[name].producer}'")

    # -- nodes -----------------------------------------------------------------
    group_of = _groups(graph, task_attrs, group_by)
    nodes = []
    for task in graph.tasks:
        node = helper.make_node(
            op_type(task.op), list(task.inputs), list(task.outputs),
            name=task.name, domain=ATEN_DOMAIN, doc_string=task.module_path,
        )
        node.attribute.append(helper.make_attribute("op", task.op))
        node.attribute.append(helper.make_attribute("module_path", task.module_path))
        if task.mutates:
            node.attribute.append(helper.make_attribute("mutates", list(task.mutates)))
        for key, val in (task_attrs.get(task.name) or {}).items():
            node.attribute.append(_task_attr(helper, task.name, key, val))
        if group_by is not None:
            node.name = f"{group_by}{group_of[task.name]}/{task.name}"
            helper.set_metadata_props(node, {group_by: str(group_of[task.name])})
        nodes.append(node)

    # -- graph outputs -----------------------------------------------------------
    used_names = set(graph.values) | task_names
    output_infos = []
    emitted: set[str] = set()
    for i, maybe_name in enumerate(graph.outputs):
        if maybe_name is None:
            continue
        name = maybe_name
        v = graph.values[name]
        if v.producer is None or name in emitted:
            # ONNX wants each graph output produced by a node, once: copy it.
            out = f"{name}__output{i}"
            while out in used_names:
                out += "_"
            used_names.add(out)
            nodes.append(helper.make_node(
                "Identity", [name], [out], name=out,
                doc_string=f"graph output {i}: the value {name}",
            ))
            output_infos.append(_value_info(onnx, v, out))
        else:
            output_infos.append(_value_info(onnx, v, name))
        emitted.add(name)

    inner = [
        _value_info(onnx, v, n) for n, v in graph.values.items()
        if n not in seen_inputs and n not in emitted
    ]
    functions: list[FunctionProto] = []  # (the name onnx is the module object here)
    if group_by is not None:
        nodes, inner, functions = _group_nodes(onnx, nodes[:len(graph.tasks)],
                                               nodes[len(graph.tasks):], inner, group_of,
                                               group_by, [o.name for o in output_infos])

    # -- initializers --------------------------------------------------------------
    tensors = []
    missing: list[str] = []
    for name in input_names:
        v = graph.values[name]
        if v.kind is ValueKind.INPUT:
            continue
        t = initializers.get(name)
        if t is None and v.target is not None:
            t = initializers.get(v.target)
        if t is None:
            if v.kind is not ValueKind.CONSTANT:
                missing.append(v.target or name)
            continue
        if t.device.type != "meta":
            tensors.append(_tensor_proto(onnx, v, t))
    if initializers and missing:
        log.warning("ONNX export: no tensor given for %d parameter(s)/buffer(s), not embedded: "
                    "%s (tied weights? pass model.state_dict())", len(missing),
                    ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else ""))

    onnx_graph = helper.make_graph(
        nodes, "rannc_task_graph",
        [_value_info(onnx, graph.values[n], n) for n in input_names],
        output_infos, initializer=tensors, value_info=inner,
        doc_string=graph.summary(),
    )
    model = helper.make_model(
        onnx_graph,
        opset_imports=_opsets(helper) + ([helper.make_opsetid(GROUP_DOMAIN, 1)] if functions else []),
        functions=functions,
        producer_name="rannc",
        doc_string="A rannc task graph: one node per ATen operation (not runnable ONNX).",
    )
    helper.set_model_props(model, {"rannc.fingerprint": graph.fingerprint(),
                                   "rannc.summary": graph.summary()})
    return model


def export_onnx(
    graph: TaskGraph,
    path: str | os.PathLike[str],
    *,
    task_attrs: Mapping[str, Mapping[str, int | str]] | None = None,
    initializers: Mapping[str, torch.Tensor] | None = None,
    group_by: str | None = None,
) -> None:
    """Write `graph` as an ONNX file at `path` (open it in Netron).

    When the embedded tensors exceed 1 GiB they go to ``<file name>.data`` beside the
    file (ONNX external data), as one protobuf message cannot hold more than 2 GiB.
    """
    onnx = _import_onnx()
    model = to_onnx_model(graph, task_attrs=task_attrs, initializers=initializers,
                          group_by=group_by)
    path = os.fspath(path)
    size = sum(len(t.raw_data) for t in model.graph.initializer)
    if size > _EXTERNAL_DATA_BYTES:
        onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                        location=os.path.basename(path) + ".data")
    else:
        onnx.save_model(model, path)


def _opsets(helper: ModuleType) -> list[onnx.OperatorSetIdProto]:
    return [helper.make_opsetid("", DEFAULT_OPSET), helper.make_opsetid(ATEN_DOMAIN, ATEN_DOMAIN_VERSION)]


def _groups(graph: TaskGraph, task_attrs: Mapping[str, Mapping[str, int | str]],
            group_by: str | None) -> dict[str, int]:
    """Each task's group: its `group_by` attribute, which every task must have as an int."""
    if group_by is None:
        return {}
    out = {}
    for task in graph.tasks:
        k = (task_attrs.get(task.name) or {}).get(group_by)
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"group_by={group_by!r}: task '{task.name}' has {group_by}={k!r}; "
                             f"give every task a {group_by} >= 0 in task_attrs")
        out[task.name] = k
    return out


def _group_nodes(ox: ModuleType, tasks: list[onnx.NodeProto], extra: list[onnx.NodeProto],
                 inner: list[onnx.ValueInfoProto], group_of: Mapping[str, int], group_by: str,
                 graph_outputs: list[str]) -> tuple[list[onnx.NodeProto], list[onnx.ValueInfoProto],
                                                    list[onnx.FunctionProto]]:
    """The main graph's nodes (a call per group, then `extra`), its value_info (the values
    crossing groups) and the functions, one per group, holding the groups' task nodes."""
    helper = ox.helper
    members: dict[int, list[onnx.NodeProto]] = {}
    for node in tasks:
        members.setdefault(group_of[node.name.split("/", 1)[1]], []).append(node)
    made = {o: k for k, ns in members.items() for n in ns for o in n.output if o}
    # values some other group, an extra node or the graph reads: a group's function outputs
    read_outside = set(graph_outputs) | {i for n in extra for i in n.input}
    reads: dict[int, list[str]] = {}
    for k, ns in members.items():
        seen: dict[str, None] = {}
        for n in ns:
            for i in n.input:
                if i and made.get(i) != k:
                    seen[i] = None
                    read_outside.add(i)
        reads[k] = list(seen)
    # Groups in dependency order (a plan's stages are convex: index order, but the exporter
    # should not rely on it); a cycle between groups has no ONNX form.
    after = {k: {made[i] for i in reads[k] if i in made} for k in members}
    order: list[int] = []
    while len(order) < len(members):
        ready = sorted(k for k in members if k not in order and after[k] <= set(order))
        if not ready:
            raise ValueError(f"group_by={group_by!r}: the groups "
                             f"{sorted(set(members) - set(order))} read each other's values in "
                             "a cycle; each group must be convex (as a plan's stages are)")
        order += ready
    infos = {vi.name: vi for vi in inner}
    calls: list[onnx.NodeProto] = []
    functions: list[onnx.FunctionProto] = []
    for k in order:
        name = f"{group_by}{k}"
        outs = [o for n in members[k] for o in n.output if o and o in read_outside]
        own = {o for n in members[k] for o in n.output if o} - set(outs)
        fn = helper.make_function(GROUP_DOMAIN, name, reads[k], outs, members[k], _opsets(helper),
                                  doc_string=f"{group_by} {k}: {len(members[k])} task(s)")
        fn.value_info.extend(infos[v] for v in sorted(own) if v in infos)
        functions.append(fn)
        call = helper.make_node(name, reads[k], outs, name=name, domain=GROUP_DOMAIN,
                                doc_string=f"{group_by} {k}")
        helper.set_metadata_props(call, {group_by: str(k)})
        calls.append(call)
    inside = {o for ns in members.values() for n in ns for o in n.output if o} - read_outside
    return calls + extra, [vi for vi in inner if vi.name not in inside], functions


def _task_attr(helper: ModuleType, task: str, key: str, val: object) -> onnx.AttributeProto:
    if key in RESERVED_ATTRS:
        raise ValueError(f"task_attrs for task '{task}': '{key}' is reserved "
                         f"({', '.join(sorted(RESERVED_ATTRS))} are set by the exporter)")
    if isinstance(val, bool):
        val = int(val)
    if not isinstance(val, int | str):
        raise TypeError(f"task_attrs['{task}']['{key}'] is a {type(val).__name__}; "
                        "node attributes must be int or str")
    attr: onnx.AttributeProto = helper.make_attribute(key, val)
    return attr


def _elem_type(ox: ModuleType, dtype: str) -> int:
    name = _ONNX_DTYPES.get(dtype)
    return int(getattr(ox.TensorProto, name)) if name and hasattr(ox.TensorProto, name) \
        else int(ox.TensorProto.UNDEFINED)


def _value_info(ox: ModuleType, v: Value, name: str) -> onnx.ValueInfoProto:
    shape: list[int | str] = [] if v.dtype == "sym_int" else list(v.shape)
    info: onnx.ValueInfoProto = ox.helper.make_tensor_value_info(
        name, _elem_type(ox, v.dtype), shape)
    doc = f"{v.kind.value}"
    if v.target:
        doc += f" {v.target}"
    if v.sym_expr:
        doc += f" = {v.sym_expr}"
    if v.batch_dim is not None:
        doc += f"; batch dim {v.batch_dim}" + (f" ({v.batch_scale} rows per sample)"
                                                if v.batch_scale != 1 else "")
    info.doc_string = doc
    return info


def _tensor_proto(ox: ModuleType, v: Value, t: torch.Tensor) -> onnx.TensorProto:
    if tuple(t.shape) != v.shape:
        raise ValueError(f"initializer for '{v.name}' ({v.target}) has shape {tuple(t.shape)}; "
                         f"the graph has {v.shape}")
    t = t.detach().cpu().contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype != v.dtype:
        raise ValueError(f"initializer for '{v.name}' ({v.target}) has dtype {dtype}; "
                         f"the graph has {v.dtype}")
    try:
        array = t.numpy()
    except TypeError:
        # A dtype numpy lacks (bfloat16, float8): write its bytes under the ONNX type, so
        # the initializer keeps the input's type exactly (ONNX raw data is little-endian,
        # as are the hosts torch runs on).
        elem = _elem_type(ox, v.dtype)
        if elem == ox.TensorProto.UNDEFINED:
            raise TypeError(f"cannot embed '{v.name}': no ONNX type for dtype {v.dtype}") from None
        raw = t.view(torch.uint8).numpy().tobytes() if t.dim() > 0 \
            else t.reshape(1).view(torch.uint8).numpy().tobytes()
        proto: onnx.TensorProto = ox.helper.make_tensor(v.name, elem, list(t.shape), raw,
                                                          raw=True)
        return proto
    proto = ox.numpy_helper.from_array(array, name=v.name)
    return proto


__all__ = ["ATEN_DOMAIN", "GROUP_DOMAIN", "export_onnx", "op_type", "to_onnx_model"]
