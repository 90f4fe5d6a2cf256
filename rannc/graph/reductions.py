"""How the model's outputs depend on the rows of the batch: what splitting the rows keeps exact.

The pipeline runs the graph on pieces of the global batch, one per (microbatch, stage replica),
and puts the pieces back together: a batch output's rows are concatenated, and a scalar output
(a loss) is combined from its per-piece values. That is exact where

* each row of a batch output depends on its own sample alone ("row-wise"), and
* a scalar output is a **mean** over rows of row-wise values (`cross_entropy`, `mse_loss`,
  `.mean()`), up to scaling and added constants: the pieces combine as a row-weighted mean;
  or a **sum** over rows (`reduction="sum"`, `.sum()`, divided by the global
  `num_items_in_batch` or not), up to scaling: the pieces combine as a sum.

Anything else mixes rows: a contrastive loss over the batch's pairs (`u @ v.T` is batch x
batch), statistics over the batch dimension used in the outputs (`x - x.mean(0)`, a running
mean updated from the batch in forward), a softmax along the batch. Computed on pieces, such
outputs are not the model's on the global batch (as under DDP, each rank computes them on its
own rows): `analyse` finds them so the runtime can say so (BatchNorm, which rannc handles
itself, is left out).

The analysis is a forward data-flow over the captured graph with a small lattice per value:
CONST (no batch dependence), ROW (a batch value, row-wise), MEAN / SUM (a value without the
batch dimension that is an affine function of row means / a linear function of row sums),
OTHER (any other value computed from several rows), MIXED (a batch value whose rows depend on
other rows). Ops it does not know are taken as row-wise where they keep the batch dimension
(most of a network) and as OTHER where they drop it, so an unknown reduction is never taken
for exact.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from rannc.graph.task_graph import TaskGraph, Value, ValueKind


class Kind(enum.Enum):
    CONST = "const"
    ROW = "row"
    MEAN = "mean"
    SUM = "sum"
    OTHER = "other"
    MIXED = "mixed"


# loss ops: index of the `reduction` argument (0 none, 1 mean, 2 sum; default 1), and of a
# per-class `weight` that makes a mean a weighted one (data-dependent denominator)
_LOSSES: dict[str, tuple[int, int | None]] = {
    "aten.mse_loss.default": (2, None),
    "aten.l1_loss.default": (2, None),
    "aten.smooth_l1_loss.default": (2, None),
    "aten.huber_loss.default": (2, None),
    "aten.soft_margin_loss.default": (2, None),
    "aten.kl_div.default": (2, None),
    "aten.binary_cross_entropy.default": (3, None),
    "aten.binary_cross_entropy_with_logits.default": (4, None),
    "aten.cross_entropy_loss.default": (3, 2),
    "aten.nll_loss.default": (3, 2),
    "aten.nll_loss_nd.default": (3, 2),
    "aten.nll_loss2d.default": (3, 2),
    "aten.hinge_embedding_loss.default": (3, None),
    "aten.margin_ranking_loss.default": (4, None),
    "aten.cosine_embedding_loss.default": (4, None),
    "aten.poisson_nll_loss.default": (5, None),
}
_MEAN_OPS = frozenset({"aten.mean.default", "aten.mean.dim"})
_SUM_OPS = frozenset({"aten.sum.default", "aten.sum.dim_IntList"})
# ops whose result is a linear combination of their inputs (sums, stacking, reshaping, picking
# elements by constant positions): on values without the batch dimension they keep MEAN / SUM
_LINEAR = frozenset(f"aten.{op}" for op in (
    "add.Tensor", "add.Scalar", "sub.Tensor", "sub.Scalar", "rsub.Tensor", "rsub.Scalar",
    "neg.default", "stack.default", "cat.default", "sum.default", "sum.dim_IntList",
    "mean.default", "mean.dim", "view.default", "reshape.default", "squeeze.default",
    "squeeze.dim", "squeeze.dims", "unsqueeze.default", "clone.default", "_to_copy.default",
    "to.dtype", "to.dtype_layout", "to.device", "detach.default", "alias.default",
    "expand.default", "select.int", "slice.Tensor", "flatten.using_ints", "contiguous.default",
    "lift_fresh_copy.default")) | {"<built-in function getitem>", "getitem"}
_SCALING = frozenset(f"aten.{op}" for op in ("mul.Tensor", "mul.Scalar", "div.Tensor", "div.Scalar"))
_ARITHMETIC = _SCALING | frozenset(f"aten.{op}" for op in (
    "add.Tensor", "add.Scalar", "sub.Tensor", "sub.Scalar", "rsub.Tensor", "rsub.Scalar",
    "div.Tensor_mode", "div.Scalar_mode", "floor_divide.default", "true_divide.Tensor",
    "pow.Tensor_Scalar", "pow.Scalar"))
# ops that act along one dimension (their argument after the input)
_ALONG_DIM = frozenset(f"aten.{op}" for op in (
    "softmax.int", "_softmax.default", "log_softmax.int", "_log_softmax.default", "cumsum.default",
    "cumprod.default", "logcumsumexp.default", "cummax.default", "cummin.default"))
# Routing: ops that order, count, find or split rows (a mixture of experts grouping its
# tokens by expert: sort the (token, expert) pairs, count tokens per expert, split by the
# counts, put the results back in token order). Each piece routes its own tokens, so the
# model's outputs stay row-wise; their results are taken as structure (row-wise where they keep
# the batch dimension, constants where not), not as statistics of the batch. (So a model that
# returns its rows sorted along the batch is not found: `row_mixing.row_mixed` recognises the
# undoing of a permutation by a pattern, which misses JetMoE's, so it is not used here.)
_ROUTING = frozenset(f"aten.{op}" for op in (
    "sort.default", "sort.stable", "argsort.default", "argsort.stable", "topk.default",
    "kthvalue.default", "histc.default", "bincount.default", "split_with_sizes.default",
    "nonzero.default", "_unique2.default", "unique_dim.default", "unique_consecutive.default",
    "searchsorted.Tensor", "bucketize.Tensor"))
# ops whose values do not depend on their tensor inputs' data (only dtype, device, or shape)
_DATA_FREE = frozenset(f"aten.{op}" for op in (
    "new_ones.default", "new_zeros.default", "new_full.default", "new_empty.default",
    "new_empty_strided.default", "zeros_like.default", "ones_like.default", "empty_like.default",
    "full_like.default", "sym_size.int", "sym_numel.default", "sym_stride.int"))
# BatchNorm mixes rows too; rannc handles it itself (pipeline/batchnorm.py, its own warning)
_BATCH_NORM = frozenset({"aten.batch_norm.default", "aten.native_batch_norm.default",
                         "aten._native_batch_norm_legit.default",
                         "aten._native_batch_norm_legit_functional.default",
                         "aten._native_batch_norm_legit_no_training.default"})
# attention in one op (query, key, value first): its keys and values are gathered along their
# dim -2, so a batch there (a sequence-first model's sequence taken for the batch:
# nn.MultiheadAttention(batch_first=False) views its (seq, batch, embed) input so) mixes rows
_ATTENTION = re.compile(r"^aten\.(_?scaled_dot_product\w*attention\w*|_flash_attention_forward|"
                        r"_efficient_attention_forward)\.")
_LINEAR_IN_BATCH = re.compile(r"^(\d+\*)?batch(\*\d+)?$")
_UNBACKED = re.compile(r"\bu\d+\b")  # torch's sizes computed from tensor values


@dataclass
class Reductions:
    """What `analyse` found (see the module doc)."""

    kinds: dict[str, Kind] = field(default_factory=dict)
    # scalar model outputs whose per-piece values combine as a sum
    summed: frozenset[str] = frozenset()
    # model outputs that splitting the rows changes -> (task, module path, op) where rows
    # first mix
    inexact: dict[str, tuple[str, str, str]] = field(default_factory=dict)


def _join(kinds: list[Kind], additive: bool) -> Kind:
    """The kind of a linear combination of values of `kinds` (none with the batch dim).
    `additive`: constants are added (a sum plus a constant is no sum of pieces)."""
    if Kind.OTHER in kinds or Kind.MIXED in kinds or Kind.ROW in kinds:
        return Kind.OTHER
    live = set(kinds) - {Kind.CONST}
    if not live:
        return Kind.CONST
    if live == {Kind.MEAN}:
        return Kind.MEAN
    if live == {Kind.SUM}:
        return Kind.SUM if not (additive and Kind.CONST in kinds) else Kind.OTHER
    return Kind.OTHER


def _arg(node: fx.Node | None, i: int, default: Any) -> Any:
    if node is None:
        return default
    return node.args[i] if i < len(node.args) else default


def analyse(gm: fx.GraphModule, graph: TaskGraph) -> Reductions:
    """Classify every value of `graph` (captured as `gm`) and its outputs (module doc)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    values = graph.values
    kinds: dict[str, Kind] = {}
    where: dict[str, tuple[str, str, str]] = {}  # a value that is not exact -> where it began
    for name, v in values.items():
        if v.producer is None:
            rows = v.kind is ValueKind.INPUT and v.is_tensor and v.batch_dim is not None
            kinds[name] = Kind.ROW if rows else Kind.CONST

    def batch(name: str) -> bool:
        v = values[name]
        return v.is_tensor and v.batch_dim is not None

    for task in graph.tasks:
        node = nodes.get(task.name)
        ins = [kinds.get(i, Kind.CONST) for i in task.inputs]
        # where rows began to mix: an input's that is not exact; for rows combined with a
        # statistic of the batch, the reduction computing it (`x - x.mean(0)`: the mean); else
        # here (two means multiplied: the product)
        origin = next((where[i] for i, k in zip(task.inputs, ins, strict=True)
                       if i in where and k in (Kind.OTHER, Kind.MIXED)), None)
        reduced = next((where[i] for i, k in zip(task.inputs, ins, strict=True)
                        if i in where and k in (Kind.MEAN, Kind.SUM)), None)
        here = (task.name, task.module_path, task.op.removeprefix("aten.").removesuffix(".default"))
        for out in task.outputs:
            k = _kind(task.op, node, task.inputs, ins, out, batch, values)
            kinds[out] = k
            if k in (Kind.MEAN, Kind.SUM) and origin is None:
                where[out] = reduced or here  # (where the statistic was taken)
            elif k is Kind.MIXED and batch(out):
                where[out] = origin or reduced or here
            elif k in (Kind.OTHER, Kind.MIXED):
                where[out] = origin or here
    outputs = [o for o in graph.outputs if o is not None]
    summed = frozenset(o for o in outputs if not batch(o) and kinds[o] is Kind.SUM)
    inexact = {o: where.get(o, ("", "", "")) for o in outputs
               if kinds[o] in (Kind.OTHER, Kind.MIXED)}
    return Reductions(kinds, summed, inexact)


def _kind(op: str, node: fx.Node | None, inputs: tuple[str, ...], ins: list[Kind], out: str,
          batch: Callable[[str], bool], values: dict[str, Value]) -> Kind:
    tensors = [(i, k) for i, k in zip(inputs, ins, strict=True) if values[i].is_tensor]
    # sizes that follow the batch (x.shape[0]): each piece has its own, so where they enter
    # the arithmetic of a value, it is not the model's (but for a sum / batch size: a mean)
    sized = any(not values[i].is_tensor and "batch" in (values[i].sym_expr or "") for i in inputs)
    if op in _DATA_FREE and sized and not batch(out):
        return Kind.OTHER  # (a tensor holding the batch size: `x.new_full((), x.shape[0])`)
    if op in _BATCH_NORM or op in _DATA_FREE or op in _ROUTING:
        return Kind.ROW if batch(out) else Kind.CONST
    if batch(out):
        if any(k in (Kind.MIXED, Kind.MEAN, Kind.SUM, Kind.OTHER) for _i, k in tensors):
            return Kind.MIXED  # (rows combined with statistics of the batch)
        if sized and op in _ARITHMETIC:
            return Kind.MIXED  # (rows scaled by the batch size)
        if sum(_follows_batch(d) for d in values[out].shape) > 1:
            return Kind.MIXED  # (a batch x batch value: pairs of rows)
        if op in _ALONG_DIM and inputs and batch(inputs[0]):
            dim = _arg(node, 1, None)
            rank = len(values[inputs[0]].shape)
            if isinstance(dim, int) and dim % max(rank, 1) == values[inputs[0]].batch_dim:
                return Kind.MIXED
        if _ATTENTION.match(op) and any(
                batch(i) and values[i].batch_dim == len(values[i].shape) - 2 for i in inputs[1:3]):
            return Kind.MIXED  # (keys and values along the batch: each row attends to others)
        return Kind.ROW
    if not values[out].is_tensor:
        return Kind.CONST  # (a size)
    if any(_UNBACKED.search(str(d)) for d in values[out].shape):
        # rows in a routed order (an expert's tokens: sizes from the routing's counts)
        statistics = any(k in (Kind.MIXED, Kind.MEAN, Kind.SUM, Kind.OTHER) for _i, k in tensors)
        return Kind.MIXED if statistics else Kind.ROW
    from_rows = [k for _i, k in tensors if k is Kind.ROW]
    if from_rows:
        # a reduction over the batch: of row-wise values only
        if len(from_rows) != sum(1 for _i, k in tensors if k is not Kind.CONST):
            return Kind.OTHER
        # a mean over rows the data selected (`h[labels != -100]`: a size torch computed from
        # the values) divides by how many each piece kept, not by its rows: no row-weighted
        # mean of the pieces' means is the model's
        counted = any(_UNBACKED.search(str(d)) for i, _k in tensors for d in values[i].shape)
        if op in _MEAN_OPS:
            return Kind.OTHER if counted else Kind.MEAN
        if op in _SUM_OPS:
            return Kind.SUM
        if op in _LOSSES:
            r_at, w_at = _LOSSES[op]
            reduction = _arg(node, r_at, 1)
            weighted = w_at is not None and _arg(node, w_at, None) is not None
            if reduction == 1 and not weighted:
                return Kind.OTHER if counted else Kind.MEAN
            if reduction == 2:
                return Kind.SUM
        return Kind.OTHER
    live = [k for _i, k in tensors if k is not Kind.CONST]
    if sized:
        if op.startswith("aten.div") and live == [Kind.SUM] and tensors[0][1] is Kind.SUM \
                and _divides_by_batch(inputs, values):
            return Kind.MEAN  # (sum over rows / batch size)
        return Kind.OTHER  # (a tensor made from the batch size, or a value scaled by it)
    if not live:
        return Kind.CONST
    if op in _LINEAR:
        additive = op.startswith(("aten.add", "aten.sub", "aten.rsub"))
        # (a number added: `loss.sum() + 1.0` is no sum of pieces)
        numbers = [Kind.CONST] if additive and node is not None and any(
            isinstance(a, (int, float)) and a != 0 for a in node.args) else []
        return _join([k for _i, k in tensors] + numbers, additive=additive)
    if op in _SCALING and len(live) == 1:
        first = tensors[0][1] if tensors else Kind.CONST
        if first is Kind.CONST:  # (c * x: scaling; c / x: not linear in x)
            return live[0] if op.startswith("aten.mul") else Kind.OTHER
        return live[0]
    return Kind.OTHER


def _follows_batch(d: Any) -> bool:
    """Whether dimension size `d` grows with the batch. Not a count the data decided split
    over the rows (`(u1//batch)`: BART's classification head views the end-of-sentence
    tokens it selected as (batch, -1, hidden), each row's own, which a pair count would take
    for a batch x batch value)."""
    s = str(d)
    return "batch" in s and not _UNBACKED.search(s)


def _divides_by_batch(inputs: tuple[str, ...], values: dict[str, Value]) -> bool:
    """The divisor (second input) is a size proportional to the batch (`x.shape[0]`)."""
    if len(inputs) < 2:
        return False
    v = values[inputs[1]]
    return not v.is_tensor and v.sym_expr is not None and bool(_LINEAR_IN_BATCH.match(
        v.sym_expr.replace(" ", "")))




# loss ops that skip the targets equal to their `ignore_index` (argument index, default) and,
# reducing by their mean, divide by how many targets they kept
_IGNORING = {"aten.cross_entropy_loss.default": (4, -100), "aten.nll_loss.default": (4, -100),
             "aten.nll_loss_nd.default": (4, -100), "aten.nll_loss2d.default": (4, -100)}
# ops through which a target keeps its rows' ignored entries (or adds as many to each row:
# Hugging Face's causal-LM loss pads each row with one ignore_index before shifting)
_TARGET_SHAPING = frozenset(f"aten.{op}" for op in (
    "view.default", "_unsafe_view.default", "reshape.default", "slice.Tensor", "clone.default",
    "contiguous.default", "_to_copy.default", "to.dtype", "to.dtype_layout", "to.device",
    "alias.default", "flatten.using_ints", "constant_pad_nd.default", "pad.default",
    "lift_fresh_copy.default"))


@dataclass(frozen=True)
class IgnoredTargets:
    """A loss that is the mean over its kept targets of a model input (`labels`), skipping those
    equal to `ignore_index`: its denominator is how many the rows hold, so where rows hold
    different numbers, the row-weighted mean of per-piece means is not the global mean."""

    task: str  # the loss op's task
    input: str  # the model input its targets are
    ignore_index: int


def ignored_target_means(gm: fx.GraphModule, graph: TaskGraph) -> list[IgnoredTargets]:
    """The mean-reduced losses of `graph` (captured as `gm`) whose targets are a model input
    with a batch dimension, reshaped, sliced or padded (`IgnoredTargets`). A loss summed and
    divided by `num_items_in_batch` reduces by its sum, so it is not among them."""
    nodes = {n.name: n for n in gm.graph.nodes}
    out = []
    for task in graph.tasks:
        site = _IGNORING.get(task.op)
        node = nodes.get(task.name)
        if site is None or node is None or _arg(node, _LOSSES[task.op][0], 1) != 1:
            continue
        target = _arg(node, 1, None)
        while isinstance(target, fx.Node) and target.op == "call_function" \
                and str(target.target) in _TARGET_SHAPING and target.args:
            target = target.args[0]
        v = graph.values.get(target.name) if isinstance(target, fx.Node) else None
        if v is not None and v.kind is ValueKind.INPUT and v.batch_dim == 0:
            out.append(IgnoredTargets(task.name, target.name,
                                      int(_arg(node, site[0], site[1]))))
    return out


def per_call_writes(graph: TaskGraph, tasks: Iterable[int]) -> frozenset[str]:
    """The buffers that `tasks` write in place only from values that do not depend on the
    batch (a counter, spectral norm's power iteration on the weights): each microbatch of a
    call would compute the same update from the same old values, so a pipeline that starts
    every microbatch from the call's values updates them once per call, as the model does. A
    buffer written by any task reading something computed from the batch (its rows or its
    size) is not among them."""
    rows: set[str] = {v for v in graph.inputs if graph.values[v].batch_dim is not None
                      or graph.values[v].dtype == "sym_int"}
    for task in graph.tasks:  # (topological order: what the batch reaches)
        if any(v in rows for v in task.inputs if v not in task.mutates):
            rows.update(task.outputs)
    written: dict[str, bool] = {}  # buffer -> every write of it is batch-independent
    for t in tasks:
        task = graph.tasks[t]
        clean = not any(v in rows for v in task.inputs if v not in task.mutates)
        for v in task.mutates:
            if graph.values[v].kind is ValueKind.BUFFER:
                written[v] = written.get(v, True) and clean
    return frozenset(v for v, ok in written.items() if ok)


__all__ = ["Kind", "Reductions", "analyse", "per_call_writes"]
