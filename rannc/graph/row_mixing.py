"""Batch values whose contents are not their own rows': they may not cross a stage boundary.

A value with a batch dimension travels between stages as rows: the rows a stage replica
computed go to whichever replica of the next stage holds them, and the pieces of several
replicas are concatenated. That is right when each row of the value depends on its own sample
alone. A sort over a flattened batch (a mixture-of-experts layer grouping its tokens by
expert: transformers' grouped-experts path sorts the (token, expert) pairs of the whole batch),
a cumulative sum along it, or an `arange` as long as the batch holds positions *within the
piece that computed it*: concatenated with another replica's piece, the permutation indices,
the sorted rows and the positions are wrong (Mixtral on replicas [2, 1, 1], cut inside its
experts: indices out of range, or rows from the wrong tokens). Such a value can still be
computed by any replica on any piece of rows, as microbatches do; it only must not be cut.

`row_mixed(graph)` finds them: the outputs of the sources below, and everything computed from
them, except two gathers along the batch: of mixed rows by a mixed index, taken as undoing the
permutation (the grouped-experts path's `out[inverse_permutation]`; its result is in token
order again), and of a sample's own rows by positions from an `arange` (the identity: Hugging
Face's mask builders index by `arange(batch)`). The first is a pattern, not a proof: a model
that permutes its rows twice would not be recognised. Sources: sort-like and scan ops on a
one-dimensional batch tensor (the only dimension is the batch's), and `arange` whose length
follows the batch.
"""

from __future__ import annotations

from collections.abc import Iterator

from rannc.graph.task_graph import Task, TaskGraph, Value, ValueKind

# ops that order or scan along their dimension (on a 1-D batch tensor: along the batch)
_ALONG_BATCH = frozenset(
    f"aten.{op}" for op in (
        "sort.default", "sort.stable", "argsort.default", "argsort.stable", "msort.default",
        "topk.default", "kthvalue.default", "cumsum.default", "cumprod.default",
        "cummax.default", "cummin.default", "logcumsumexp.default"))
_ARANGE = frozenset({"aten.arange.default", "aten.arange.start", "aten.arange.start_step"})
# gathers along the batch: (data, index, ...) inputs
_GATHER = frozenset({"aten.index.Tensor", "aten.index_select.default", "aten.gather.default"})
# ops that only reshape or convert (positions stay positions through them)
_SHAPE = frozenset(f"aten.{op}" for op in (
    "view.default", "reshape.default", "unsqueeze.default", "expand.default", "to.dtype",
    "_to_copy.default", "clone.default", "alias.default", "slice.Tensor", "select.int"))


def row_mixed(graph: TaskGraph) -> frozenset[str]:
    """The batch values that may not cross a stage boundary (module docstring)."""
    mixed: set[str] = set()
    # positions 0..n-1 of the rows (an arange as long as the batch, reshaped): gathering a
    # value's rows by them is the identity (Hugging Face's masks index by arange(batch))
    identity: set[str] = set()
    for task, ins, outs in _batch_tasks(graph):
        if task.op in _ARANGE or (task.op in _SHAPE and ins and ins[0] in identity):
            identity.update(outs)
            mixed.update(outs)
            continue
        if task.op in _ALONG_BATCH and ins and len(graph.values[ins[0]].shape) == 1:
            hit = True
        elif task.op in _GATHER and len(ins) >= 2:
            data, index = ins[0], ins[1:]
            if data in mixed and all(v in mixed for v in index):
                hit = False  # mixed rows gathered by a mixed index: the permutation undone
            elif data not in mixed and all(v in identity or v not in mixed for v in index):
                hit = False  # gathered by their own positions (or by a sample's own values)
            else:
                hit = True
        else:
            hit = any(v in mixed for v in task.inputs)
        if hit:
            mixed.update(outs)
    return frozenset(mixed)


# ops that regroup a tensor's dimensions without moving its elements (row-major order)
_REGROUP = frozenset(f"aten.{op}" for op in (
    "view.default", "reshape.default", "_unsafe_view.default", "view_copy.default",
    "_reshape_alias.default", "flatten.using_ints", "unflatten.int"))


def interleaved(graph: TaskGraph) -> frozenset[str]:
    """The batch values whose batch dimension holds several samples' rows interleaved.

    torch's `nn.MultiheadAttention` (batch-first or not) works on (seq, batch, embed) and
    flattens it to (seq * batch, embed) for its output projection: row i of that value belongs
    to sample i % batch, not to sample i // seq. rannc splits a batch dimension of size
    k * batch as k consecutive rows per sample, so a stage boundary there sent other samples'
    rows to each replica and microbatch, silently (a 3-rank plan with replicas [2, 1]: loss
    and gradients off by 1e-2). Tracked through the graph as each value's `outer`: how many
    slices of the dimensions before the batch one were merged into the batch dimension ahead
    of the samples (1: sample-major). A regrouping op sets it from the product of the
    dimensions before the batch dimension in and out (a flatten of (seq, batch) gives seq; the
    view back to (seq, batch, embed) gives 1 again); every other op passes on the largest of
    its batch inputs'. One that cannot be expressed so (a sample-major dimension viewed as
    (k, batch)) counts as interleaved too."""
    outer: dict[str, float] = {}  # (0: not expressible so, counted as interleaved)
    out: set[str] = set()
    for task, ins, outs in _batch_tasks(graph):
        if not outs or not ins:
            continue
        if task.op in _REGROUP:
            x = ins[0]
            before = _before_batch(graph.values[x])
            for y in outs:
                after = _before_batch(graph.values[y])
                o = outer.get(x, 1.0) * before / after if before and after else 0.0
                outer[y] = o if o >= 1 and o == int(o) else 0.0
        else:
            o = max(outer.get(v, 1.0) for v in ins)
            if any(outer.get(v, 1.0) == 0.0 for v in ins):
                o = 0.0
            for y in outs:
                outer[y] = o
        out.update(y for y in outs if outer[y] != 1.0)
    return frozenset(out)


def _batch_tasks(graph: TaskGraph) -> Iterator[tuple[Task, list[str], list[str]]]:
    """Each task in order, with its batch inputs and outputs (tensors with a batch dimension)."""
    def batch(v: str) -> bool:
        val = graph.values[v]
        return val.is_tensor and val.batch_dim is not None

    for task in graph.tasks:
        yield task, [v for v in task.inputs if batch(v)], [v for v in task.outputs if batch(v)]


def _before_batch(val: Value) -> int:
    """The product of a value's dimensions before its batch dimension (0: not a number)."""
    assert val.batch_dim is not None
    n = 1
    for d in val.shape[:val.batch_dim]:
        if not isinstance(d, int):
            return 0
        n *= d
    return n


def unsplittable(graph: TaskGraph) -> dict[str, str]:
    """The activations that may not cross a stage boundary, each with why: a tensor without
    a batch dimension (nothing to split by rows), or a row-mixed one (`row_mixed`). The one
    rule the stage tables, a derived placement and the deployment's routes all apply."""
    out: dict[str, str] = {}
    for v in row_mixed(graph):
        out[v] = ("its rows are not its samples' own (it is computed from a sort, scan or "
                  "arange along the batch: rannc.graph.row_mixing)")
    for v in interleaved(graph):
        out.setdefault(v, "its batch dimension holds several samples' rows interleaved (a "
                          "(seq * batch, ...) flattening, as nn.MultiheadAttention's: "
                          "rannc.graph.row_mixing.interleaved)")
    for name, val in graph.values.items():
        if val.kind is ValueKind.ACTIVATION and val.is_tensor and val.batch_dim is None:
            out[name] = "it has no batch dimension"
        elif val.kind is ValueKind.ACTIVATION and val.dtype == "sym_int" and size_from_values(val.sym_expr):
            out[name] = ("it is a size computed from tensor values (.item(), .tolist()): a "
                         "stage receiving it could not know it")
    return out


def size_from_values(expr: str | None) -> bool:
    """A size expression holding a symbol other than the batch's (torch's unbacked u0, ...)."""
    if not expr:
        return False
    import sympy

    return any(str(s) != "batch" for s in sympy.sympify(expr).free_symbols)


__all__ = ["interleaved", "row_mixed", "size_from_values", "unsplittable"]
