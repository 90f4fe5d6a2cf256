"""What autograd keeps for backward, and what one task's backward needs besides, per task.

The memory forecast multiplies a stage's kept bytes by the microbatches it holds, so they must
be what autograd really saves (`torch.autograd.graph.saved_tensors_hooks` sees it), not every
task's output. They differ both ways, measured on BERT and GPT-2 (`benchmarks/kept_activations.py`):
an op whose gradient does not read its output saves nothing of it (`add`, `to`, the dropout's
output: it keeps a one-byte mask), many ops save an input that another op made (a `linear`
saves its input, not its output), views and no-op conversions (`to` of the same dtype,
`contiguous` of a contiguous tensor) keep their base, and some ops save tensors that are no
value of the graph (cross-entropy's log-softmax, the attention matrices of attention computed
by its math path).

So each task has a rule, from derivatives.yaml: which of its inputs and outputs its backward
reads, plus the bytes of what it makes internally and saves. A saved value counts once, by its
*base* (the value whose storage it shares), at the task that made the base; saved parameters,
buffers and model inputs count nowhere here (the memory model holds them as parameters and
stage inputs). A task no tensor requiring grad reaches records nothing. An op without a rule
saves its tensor inputs and floating outputs (the most it could).

Backward working memory (`bwd_work`): while task t's backward runs, the gradients of its
floating outputs arrive and those of its floating activation inputs are made (parameter
gradients are held for the whole step and counted with the parameters), plus the op's own
temporaries (cross-entropy: the log-softmax gradient and the logits' gradient, both the size of
the logits, alive together).

Two ops save by kernel (`fused`: what CUDA runs; else the composite path a CPU runs).
Attention (`scaled_dot_product_attention`): a fused kernel (flash or memory-efficient) keeps q,
k, v, its output and the log-sum-exp; the math path (the CPU's under attention dropout) keeps
copies of q, k and v and three (batch, heads, queries, keys) matrices: the softmax, the dropout
mask and the dropped weights. Dropout: the fused kernel keeps a one-byte mask, the composite one
a mask in the input's dtype (it multiplies the input by it).

Index conventions: t indexes graph tasks.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

from rannc.graph.task_graph import TaskGraph, Value, ValueKind, eval_dim

_FLOAT = {"float64", "float32", "float16", "bfloat16"}

# Ops whose output is a view of their (first tensor) input: no new storage.
_VIEWS = re.compile(
    r"aten\.(view|_unsafe_view|reshape|transpose|t|permute|expand|expand_as|slice|select|"
    r"unsqueeze|squeeze|flatten|split|split_with_sizes|chunk|unbind|alias|detach|as_strided|"
    r"unflatten|view_as|narrow|movedim|diagonal|_reshape_alias)\.")
# Views whose result is not contiguous in general (a later `contiguous` or `reshape` copies).
_STRIDED = re.compile(r"aten\.(transpose|t|permute|expand|expand_as|as_strided|movedim|diagonal)\.")
# Ops that return their input itself when nothing is to be done (same dtype, contiguous input).
_TO = re.compile(r"aten\.(to|type_as)\.")
# Ops whose gradient reads none of their tensors (only sizes or scalars).
_SAVES_NOTHING = re.compile(
    r"aten\.(add|add_|sub|sub_|rsub|neg|clone|cat|concat|stack|_to_copy|to|contiguous|sum|mean|"
    r"copy|copy_|pad|constant_pad_nd|repeat|flip|roll|tril|triu|cumsum|fill|fill_|zero_|"
    r"lift_fresh_copy|zeros_like|ones_like|full_like|empty_like|rand_like|randn_like|"
    r"new_zeros|new_ones|new_full|new_empty|scalar_tensor|arange|full|zeros|ones|empty)\.")
# Ops whose gradient reads their result.
_SAVES_OUTPUT = re.compile(
    r"aten\.(_?softmax|_?log_softmax|tanh|tanh_|sigmoid|sigmoid_|exp|exp_|sqrt|rsqrt|relu|relu_|"
    r"reciprocal|elu|elu_)\.")
# Ops whose gradient reads their tensor inputs (those that are parameters cost nothing here).
_SAVES_INPUTS = re.compile(
    r"aten\.(linear|mm|matmul|bmm|addmm|baddbmm|addbmm|addmv|mv|einsum|conv\w*|convolution|"
    r"_convolution|layer_norm|native_layer_norm|group_norm|native_group_norm|batch_norm|"
    r"native_batch_norm|_native_batch_norm_legit\w*|rms_norm|_fused_rms_norm|gelu|gelu_|silu|"
    r"silu_|mish|hardswish|hardsigmoid|softplus|leaky_relu|log|log1p|log2|pow|sin|cos|erf|abs|"
    r"embedding|embedding_bag|index|index_select|gather|take|where|masked_fill|masked_fill_|"
    r"clamp|clamp_min|clamp_max|hardtanh|minimum|maximum|nll_loss\w*|max_pool\w*|norm|"
    r"linalg_vector_norm|var|std|var_mean|prod|square)\.")
_MUL = re.compile(r"aten\.(mul|mul_|multiply)\.")
_DIV = re.compile(r"aten\.(div|div_|true_divide)\.")
_DROPOUT = re.compile(r"aten\.(dropout|feature_dropout|alpha_dropout|native_dropout)\.")
_CROSS_ENTROPY = re.compile(r"aten\.cross_entropy_loss\.")
_ATTENTION = re.compile(r"aten\.(_?scaled_dot_product\w*attention\w*)\.")


def bytes_lin(v: Value) -> np.ndarray:
    """A tensor value's bytes as (c0, c1): bytes(batch) = c0 + c1 * batch."""
    if not v.is_tensor:
        return np.zeros(2)
    n1, n2 = v.numel(1), v.numel(2)
    s = _ITEM.get(v.dtype, 4)
    return np.array([float(2 * n1 - n2), float(n2 - n1)]) * s


_ITEM = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def requires_grad(graph: TaskGraph) -> set[str]:
    """The floating values autograd tracks: parameters, and every floating output of a task
    that reads one (tasks are in topological order)."""
    out = {n for n, v in graph.values.items() if v.kind is ValueKind.PARAM and v.dtype in _FLOAT}
    for task in graph.tasks:
        if any(v in out for v in task.inputs):
            out.update(v for v in task.outputs if graph.values[v].dtype in _FLOAT)
    return out


def bases(graph: TaskGraph) -> dict[str, str]:
    """Each value's base: itself, or for a view (or a conversion that returns its input) the
    base of the value it views. A `contiguous` or `reshape` of a non-contiguous view copies."""
    base = {n: n for n in graph.values}
    strided: set[str] = set()  # values whose layout is not contiguous
    for task in graph.tasks:
        ins = [v for v in task.inputs if graph.values[v].is_tensor]
        if not ins:
            continue
        src = ins[0]
        op = task.op
        outs = [v for v in task.outputs if graph.values[v].is_tensor]
        if op.startswith("aten.reshape.") and src in strided:
            continue  # a copy
        if _VIEWS.match(op):
            for v in outs:
                base[v] = base[src]
                if _STRIDED.match(op) and graph.values[v].shape != graph.values[src].shape \
                        or src in strided or _cuts_inner(graph.values[src], graph.values[v], op):
                    strided.add(v)
        elif (op.startswith("aten.contiguous.") and src not in strided) or \
                (_TO.match(op) and len(outs) == 1 and graph.values[outs[0]].dtype == graph.values[src].dtype
                 and graph.values[outs[0]].shape == graph.values[src].shape):
            base[outs[0]] = base[src]
            if src in strided:
                strided.add(outs[0])
    return base


def _cuts_inner(src: Value, out: Value, op: str) -> bool:
    """Whether a slice/select/split/narrow view cuts a dim after the first one of size > 1
    (its rows are then not contiguous)."""
    if not re.match(r"aten\.(slice|select|split|split_with_sizes|chunk|unbind|narrow)\.", op):
        return False
    a, b = [eval_dim(d, 3) for d in src.shape], [eval_dim(d, 3) for d in out.shape]
    if len(a) != len(b):  # select/unbind drop the dim: compare the leading ones
        return a[1:] != b[:len(a) - 1] if a and a[0] > 1 else False
    cut = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    lead = next((i for i, x in enumerate(a) if x > 1), len(a))
    return bool(cut) and cut[0] > lead


def saved(graph: TaskGraph, *, fused: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(kept, bwd_work), arrays (T, 2) of bytes as c0 + c1 * batch: `kept[t]` what autograd
    keeps for backward that task t made (or, for a batch-sized constant, first saved);
    `bwd_work[t]` the gradients and temporaries alive while t's backward runs."""
    T = len(graph.tasks)
    kept = np.zeros((T, 2))
    bwd = np.zeros((T, 2))
    grad = requires_grad(graph)
    base = bases(graph)
    vb = {n: bytes_lin(v) for n, v in graph.values.items()}
    counted: set[str] = set()

    def keep(name: str, saver: int) -> None:
        b = base[name]
        val = graph.values[b]
        if b in counted or not val.is_tensor or val.kind in (ValueKind.PARAM, ValueKind.BUFFER,
                                                             ValueKind.INPUT):
            return
        counted.add(b)
        p = graph.producer(b)
        at = p if p is not None and val.kind is ValueKind.ACTIVATION else saver
        kept[at] += vb[b]

    for t, task in enumerate(graph.tasks):
        ins = [v for v in task.inputs if graph.values[v].is_tensor]
        outs = [v for v in task.outputs if graph.values[v].is_tensor]
        if not any(v in grad for v in ins):
            continue  # autograd records nothing for this task
        op = task.op
        if _VIEWS.match(op) or (outs and base[outs[0]] != outs[0]):
            continue  # a view or a no-op: its gradient is a view of the incoming one
        f_outs = [v for v in outs if graph.values[v].dtype in _FLOAT]
        # its backward: the gradients of its outputs arrive, those of its activation inputs leave
        bwd[t] = sum((vb[v] for v in f_outs), np.zeros(2)) + sum(
            (vb[v] for v in ins if v in grad and graph.values[v].kind is not ValueKind.PARAM),
            np.zeros(2))
        if _SAVES_NOTHING.match(op):
            continue
        if _SAVES_OUTPUT.match(op):
            for v in f_outs:
                keep(v, t)
            if re.match(r"aten\._?(log_)?softmax\.", op):
                bwd[t] += sum((vb[v] for v in f_outs), np.zeros(2))  # grad * result
        elif _MUL.match(op) or _DIV.match(op):
            if len(ins) == 2:
                a, b = ins
                if b in grad:
                    keep(a, t)
                if a in grad or (_DIV.match(op) and b in grad):
                    keep(b, t)
        elif _DROPOUT.match(op):
            masks = [v for v in outs if graph.values[v].dtype == "bool"]
            for v in masks:
                keep(v, t)
            if not masks and f_outs:  # a mask of the output's size: bool, or in its dtype
                kept[t] += vb[f_outs[0]] / _ITEM.get(graph.values[f_outs[0]].dtype, 4) \
                    if fused else vb[f_outs[0]]
        elif _CROSS_ENTROPY.match(op):
            logits = ins[0]
            kept[t] += vb[logits]  # its log-softmax
            for v in ins[1:]:
                keep(v, t)
            bwd[t] += vb[logits]  # the log-softmax's gradient beside the logits'
        elif _ATTENTION.match(op) and len(ins) >= 3:
            kept[t] += _attention_saved(graph, ins, f_outs, fused, keep, t)
            if not fused:
                bwd[t] += 2 * _attention_matrix(graph, ins)
        elif _SAVES_INPUTS.match(op):
            for v in ins:
                keep(v, t)
        else:  # no rule: everything it could keep
            for v in ins:
                keep(v, t)
            for v in f_outs:
                keep(v, t)
    return kept, bwd


def _attention_matrix(graph: TaskGraph, ins: list[str]) -> np.ndarray:
    """Bytes of one (batch, heads, queries, keys) matrix in q's dtype: q's bytes / d * keys."""
    q, k = graph.values[ins[0]], graph.values[ins[1]]
    d = eval_dim(q.shape[-1], 1) if q.shape else 1
    keys = eval_dim(k.shape[-2], 1) if len(k.shape) >= 2 else 1
    return bytes_lin(q) / max(d, 1) * keys


def _attention_saved(graph: TaskGraph, ins: list[str], outs: list[str], fused: bool,
                     keep: Callable[[str, int], None], t: int) -> np.ndarray:
    """Bytes attention saves beyond the graph values it keeps (which `keep` records)."""
    q = graph.values[ins[0]]
    if fused:
        for v in (*ins[:3], *outs):
            keep(v, t)
        d = eval_dim(q.shape[-1], 1) if q.shape else 1
        return bytes_lin(q) / max(d, 1) / _ITEM.get(q.dtype, 4) * 4  # log-sum-exp, float32
    # math path: scaled copies of q and k, a contiguous v, the softmax, the dropout mask (as
    # floats) and the dropped weights
    return sum((bytes_lin(graph.values[v]) for v in ins[:3]), np.zeros(2)) + \
        3 * _attention_matrix(graph, ins)


__all__ = ["bases", "bytes_lin", "requires_grad", "saved"]
