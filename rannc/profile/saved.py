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
k, v, its output and the log-sum-exp, and a mask as an additive bias (a boolean one converted
to q's dtype, one per call); the math path (the CPU's under attention dropout) keeps
copies of q, k and v and three (batch, heads, queries, keys) matrices: the softmax, the dropout
mask and the dropped weights. Dropout: the fused kernel keeps a one-byte mask, the composite one
a mask in the input's dtype (it multiplies the input by it).

Index conventions: t indexes graph tasks.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np

from rannc.graph.task_graph import TaskGraph, Value, ValueKind, eval_dim
from rannc.hostmem import is_host

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
# Ops autocast runs in half precision (CUDA's and the CPU's lists agree on these): they cast
# every floating input to half first, and autograd saves the casts.
_AUTOCAST_HALF = re.compile(
    r"aten\.(linear|mm|matmul|bmm|addmm|baddbmm|addbmm|addmv|mv|addr|einsum|conv\w*|convolution|"
    r"_convolution|prelu|chain_matmul|linalg_vecdot|linalg_multi_dot)\.")
_HALF = {"float16", "bfloat16"}
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


def requires_grad(graph: TaskGraph, inputs_need_grad: bool = False) -> set[str]:
    """The floating values autograd tracks: parameters (and, `inputs_need_grad`, the graph's
    floating inputs), and every floating output of a task that reads one (tasks are in
    topological order)."""
    seeds = (ValueKind.PARAM, ValueKind.INPUT) if inputs_need_grad else (ValueKind.PARAM,)
    out = {n for n, v in graph.values.items() if v.kind in seeds and v.dtype in _FLOAT}
    for task in graph.tasks:
        if any(v in out for v in task.inputs):
            out.update(v for v in task.outputs if graph.values[v].dtype in _FLOAT)
    return out


def weight_side(graph: TaskGraph) -> set[str]:
    """The floating values computed from trainable parameters alone (the parameters, their
    casts, transposes, views, and anything made of those and constants), none from a batch."""
    out = {n for n, v in graph.values.items() if v.kind is ValueKind.PARAM and v.dtype in _FLOAT}
    other = (ValueKind.PARAM, ValueKind.BUFFER, ValueKind.CONSTANT)
    for task in graph.tasks:
        ins = [graph.values[v] for v in task.inputs if graph.values[v].is_tensor]
        if any(v.name in out for v in ins) and all(v.name in out or v.kind in other for v in ins):
            out.update(v for v in task.outputs if graph.values[v].dtype in _FLOAT)
    return out


def wgrad_stash(graph: TaskGraph, inputs_need_grad: bool = False) -> np.ndarray:
    """(T, 2) bytes as c0 + c1 * batch: what a backward split into an input pass (B) and a
    weight pass (W) keeps from B for W per microbatch (`rannc.pipeline.split_backward`): the
    gradient flowing into each task where a weight's path meets the activations' (a task
    reading a weight-side value and an activation autograd tracks: a linear, a norm's
    weight, a tied head), the size of its output. It lives from B to W on top of the kept
    activations (the graph stays alive until W), so a zero-bubble schedule holds it for every
    microbatch whose W is deferred. `inputs_need_grad`: the graph's floating inputs need
    gradients too (a graph standing for a later stage, whose inputs are activations)."""
    T = len(graph.tasks)
    stash = np.zeros((T, 2))
    grad = requires_grad(graph, inputs_need_grad)
    wside = weight_side(graph)
    for t, task in enumerate(graph.tasks):
        ins = [v for v in task.inputs if v in grad]
        if any(v in wside for v in ins) and any(v not in wside for v in ins):
            out = next((graph.values[v] for v in task.outputs if v in grad), None)
            if out is not None:
                stash[t] = bytes_lin(out)
    return stash


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


def fused_kernels(device: str) -> bool:
    """Whether `device` (a `DeviceSpec` name such as "H100" or "local-cpu", or a torch device
    type such as "cuda") runs fused attention and dropout kernels, which save other tensors
    than the CPU's (`saved`'s `fused`): any device but a CPU. The one rule for the planner's
    estimate and the runtime's selective recomputation, so that both drop the same values."""
    return not is_host(device)


def saved(graph: TaskGraph, *, fused: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(kept, bwd_work), arrays (T, 2) of bytes as c0 + c1 * batch: `kept[t]` what autograd
    keeps for backward that task t made (or, for a batch-sized constant, first saved);
    `bwd_work[t]` the gradients and temporaries alive while t's backward runs."""
    s = _saves(graph, fused)
    return s.kept, s.bwd


@dataclass(frozen=True, slots=True)
class _Saves:
    kept: np.ndarray  # (T, 2), as `saved`
    bwd: np.ndarray  # (T, 2), as `saved`
    edges: tuple[tuple[int, str], ...]  # (task, graph value) for every value a task saves
    base: dict[str, str]
    at: dict[str, int]  # each base counted in `kept`: the task it is counted at
    own: np.ndarray  # (T, 2): of kept[t], what task t saves that is no graph value (internal)


def _saves(graph: TaskGraph, fused: bool) -> _Saves:
    T = len(graph.tasks)
    kept = np.zeros((T, 2))
    bwd = np.zeros((T, 2))
    grad = requires_grad(graph)
    base = bases(graph)
    vb = {n: bytes_lin(v) for n, v in graph.values.items()}
    counted: dict[str, int] = {}
    edges: list[tuple[int, str]] = []

    def keep(name: str, saver: int) -> None:
        edges.append((saver, name))
        b = base[name]
        val = graph.values[b]
        if b in counted or not val.is_tensor or val.kind in (ValueKind.PARAM, ValueKind.BUFFER,
                                                             ValueKind.INPUT):
            return
        p = graph.producer(b)
        at = p if p is not None and val.kind is ValueKind.ACTIVATION else saver
        counted[b] = at
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
            # its log-softmax, in the loss's dtype (float32 from half logits under autocast)
            wide = _widened(graph, logits, f_outs)
            kept[t] += vb[logits] * wide
            for v in ins[1:]:
                keep(v, t)
            bwd[t] += vb[logits] * wide  # the log-softmax's gradient beside the logits'
        elif _ATTENTION.match(op) and len(ins) >= 3:
            kept[t] += _attention_saved(graph, ins, f_outs, fused, keep, t)
            if not fused:
                bwd[t] += 2 * _attention_matrix(graph, ins) * _math_widening(graph.values[ins[0]])
        elif _SAVES_INPUTS.match(op):
            half = _autocast_half(graph, op, f_outs)
            for v in ins:
                val = graph.values[v]
                if half is None or val.dtype not in _FLOAT or val.dtype == half:
                    keep(v, t)
                elif val.kind is ValueKind.ACTIVATION or val.kind is ValueKind.INPUT:
                    # autocast casts v and saves the cast: a new tensor of v's shape (another
                    # op casting v makes its own), whatever else keeps v itself. (A parameter's
                    # cast is one per autocast region, which autocast's cache shares among the
                    # microbatches of a call: not a microbatch's activation.)
                    kept[t] += vb[v] * _ITEM[half] / _ITEM.get(val.dtype, 4)
        else:  # no rule: everything it could keep
            for v in ins:
                keep(v, t)
            for v in f_outs:
                keep(v, t)
    own = kept.copy()
    for b, at in counted.items():
        own[at] -= vb[b]
    return _Saves(kept, bwd, tuple(edges), base, counted, own)


def b_only(graph: TaskGraph, *, fused: bool = True, inputs_need_grad: bool = False) -> np.ndarray:
    """(T, 2) bytes as c0 + c1 * batch: of `saved`'s kept[t], what only the input pass (B) of a
    split backward reads, which the runtime releases once B has run
    (`rannc.pipeline.split_backward`), so a microbatch between its B and its W no longer holds
    it. B reads what every task on the activations' path saves; W what those of them that
    also read a weight-side value (the meeting tasks: a linear, a norm's weight) save, and
    what tasks off that path save. A value counts here when all its savers are B's alone (a
    softmax's output read by the next matmul of probabilities and values, a GELU's input,
    attention's q, k and v, a dropout's mask, cross-entropy's log-softmax); the layers' inputs,
    which the meeting tasks save, stay. The activations' path: the floating values autograd
    tracks (`requires_grad`) that depend on the batch (a graph input). Not counted: the path W
    walks again between two meeting tasks of one weight read twice in a stage (a tied embedding
    and head both there), where the runtime releases less."""
    s = _saves(graph, fused)
    grad = requires_grad(graph, inputs_need_grad)
    batch = {n for n, v in graph.values.items() if v.kind is ValueKind.INPUT}
    for task in graph.tasks:
        if any(v in batch for v in task.inputs):
            batch.update(task.outputs)
    path = grad & batch
    only_b = set()
    for t, task in enumerate(graph.tasks):
        ins = [v for v in task.inputs if v in grad]
        if any(v in path for v in ins) and all(v in path for v in ins):
            only_b.add(t)
    savers: dict[str, set[int]] = collections.defaultdict(set)
    for t, n in s.edges:
        savers[s.base[n]].add(t)
    out = np.zeros_like(s.kept)
    for b, at in s.at.items():
        if savers[b] <= only_b:
            out[at] += bytes_lin(graph.values[b])
    for t in only_b:
        out[t] += s.own[t]
    return out


def _autocast_half(graph: TaskGraph, op: str, f_outs: Sequence[str]) -> str | None:
    """The half dtype an autocast op computes in (its floating output's, where that is half
    and the op is one autocast casts to half), else None. A captured graph holds no casts:
    under autocast `linear` of float32 tensors gives a bfloat16 value."""
    if not f_outs or not _AUTOCAST_HALF.match(op):
        return None
    dt = graph.values[f_outs[0]].dtype
    return dt if dt in _HALF else None


def autocast_copies(graph: TaskGraph) -> dict[str, float]:
    """Bytes of the half-precision copy autocast keeps of each parameter, by parameter: an op
    autocast runs in half casts its float32 weight and autograd saves the cast where the op's
    backward computes an input gradient (not a bias's). Autocast's cache makes one copy per parameter and
    autocast region, which every microbatch of a call shares (their forwards run inside the
    user's autocast block), so it is no microbatch's activation: it belongs with the stage's
    parameters, once (`ValueUses.of`). Empty for a graph captured without autocast."""
    grad = requires_grad(graph)
    out: dict[str, float] = {}
    for task in graph.tasks:
        f_outs = [v for v in task.outputs if graph.values[v].is_tensor and graph.values[v].dtype in _FLOAT]
        half = _autocast_half(graph, task.op, f_outs)
        if half is None or not any(v in grad and graph.values[v].kind is not ValueKind.PARAM
                                   for v in task.inputs):
            continue
        for v in task.inputs:
            val = graph.values[v]
            # (a bias, 1-D, is cast too but not saved: its gradient is a sum of the output's)
            if val.kind is ValueKind.PARAM and val.dtype in _FLOAT and val.dtype != half \
                    and len(val.shape) >= 2:
                out[v] = float(bytes_lin(val)[0]) * _ITEM[half] / _ITEM.get(val.dtype, 4)
    return out


def _widened(graph: TaskGraph, v: str, f_outs: Sequence[str]) -> float:
    """How much larger an op's result dtype is than its input v's (float32 from bfloat16: 2,
    autocast running a float32 op on half values), else 1."""
    if not f_outs:
        return 1.0
    wide, narrow = _ITEM.get(graph.values[f_outs[0]].dtype, 4), _ITEM.get(graph.values[v].dtype, 4)
    return wide / narrow if wide > narrow else 1.0


# Ops that are cheap to run again (memory-bound: elementwise ops and norms), draw no random
# numbers and give the same bits every time: the candidates of selective recomputation
# (`recomputable`).
_RECOMPUTABLE = re.compile(
    r"aten\.(add|sub|rsub|mul|div|neg|silu|gelu|relu|tanh|sigmoid|rsqrt|sqrt|exp|pow|square|"
    r"reciprocal|_to_copy|to|contiguous|clone|layer_norm|rms_norm)\.")


# The most ops one rebuild may run (a recipe's own and those of the recipes it is made from):
# every read of a saved value rebuilds its whole chain, so a long chain (GPT-2's tanh gelu, 8
# ops, read three times) costs as much as the forward it spares; two or three ops (SwiGLU's
# product, RMSNorm's scaling) cost a few per cent of a Llama layer's forward.
MAX_CHAIN = 3


@dataclass(frozen=True, slots=True)
class Recomputable:
    """What selective recomputation drops (`recomputable`)."""

    values: frozenset[str]  # graph values autograd keeps as a recipe (the dropped and their views)
    freed: np.ndarray  # (T, 2) bytes as c0 + c1 * batch: of `saved`'s kept[t], what is dropped
    evals: np.ndarray  # (T,) times task t runs again in one microbatch's backward


def recomputable(graph: TaskGraph, *, fused: bool = True, tasks: Collection[int] | None = None,
                 held: Collection[str] = ()) -> Recomputable:
    """Selective recomputation: the saved activations autograd can keep as a recipe (op and
    inputs) and rebuild when backward reads them, freeing their memory at no risk: each is the
    output of a cheap op (`_RECOMPUTABLE`: elementwise, a norm) whose inputs are held anyway
    (parameters, model or stage inputs, values saved for backward) or are such recipes. What
    `tasks` (default all; a stage's) save counts; `held`: values the caller keeps regardless (a
    stage's outputs), never dropped, nor is a model output. The runtime
    (`rannc.pipeline.selective`) and the memory model read this one rule.

    A view of a recipe (one output: `view`, `reshape`, a no-op `to` ...) is a recipe too, so a
    value saved through such views is still dropped; one saved through any other view, or held,
    keeps its storage and is not dropped (nor is what was chosen because of it: the choice runs
    again without it until nothing changes). Each read in backward rebuilds the value and the
    recipes it is made from: `evals` counts those runs, charged at the ops' forward seconds."""
    s = _saves(graph, fused)
    T = len(graph.tasks)
    subset = set(range(T)) if tasks is None else set(tasks)
    sub = sorted(subset)
    base = s.base
    edges = [(t, n) for t, n in s.edges if t in subset]
    saved_bases = {base[n] for _, n in edges}
    made = {v for t in sub for v in graph.tasks[t].outputs}
    held = {v for v in (*held, *graph.outputs) if v is not None}
    blocked = {base[v] for v in held if v in base}
    written = {v for task in graph.tasks for v in task.mutates}  # (a buffer a write changes)
    while True:
        chosen, recipe = _choose(graph, sub, base, saved_bases, made, held, blocked, written)
        lost = {base[n] for _, n in edges if base[n] in chosen and n not in recipe}
        if not lost:
            break
        blocked |= lost
    freed = np.zeros((T, 2))
    evals = np.zeros(T)
    runs = collections.Counter(n for _, n in edges if n in recipe)
    for t in reversed(sub):  # a recipe's runs also run the recipes it reads
        outs = graph.tasks[t].outputs
        if not outs or outs[0] not in recipe:
            continue
        v = outs[0]
        if v in chosen:
            if v in saved_bases:  # (else it was never kept)
                freed[t] += bytes_lin(graph.values[v])
            evals[t] += runs[v]
        for u in graph.tasks[t].inputs:
            if u in recipe:
                runs[u] += runs[v]
    # (a recipe nothing saved is made from is not needed: an unsaved value is left alone)
    return Recomputable(frozenset(v for v in recipe if runs[v] > 0), freed, evals)


def _choose(graph: TaskGraph, tasks: Sequence[int], base: dict[str, str], saved_bases: set[str],
            made: set[str], held: set[str], blocked: set[str],
            written: set[str]) -> tuple[set[str], set[str]]:
    """(the values made by recipes, and those with the views of them: every value that is a
    recipe); of the first, those saved are dropped."""
    chosen: set[str] = set()
    recipe: set[str] = set()
    ops: dict[str, int] = {}  # ops one rebuild of a recipe runs (its own and its inputs')

    def available(u: str) -> bool:
        val = graph.values[u]
        if u in written:
            return False
        if not val.is_tensor or val.kind in (ValueKind.PARAM, ValueKind.BUFFER, ValueKind.INPUT):
            return True
        if u not in made or u in recipe or u in held:  # a stage input or output, a recipe
            return True
        return base[u] not in chosen and base[u] in saved_bases

    for t in tasks:
        task = graph.tasks[t]
        outs = [v for v in task.outputs if graph.values[v].is_tensor]
        if len(outs) != 1 or len(task.outputs) != 1:
            continue
        v = outs[0]
        ins = [u for u in task.inputs if graph.values[u].is_tensor]
        if base[v] != v:  # a view or a no-op: a recipe where what it views is one
            if ins and ins[0] in recipe and v not in held:
                recipe.add(v)
                ops[v] = ops[ins[0]]
            continue
        val = graph.values[v]
        if (not _RECOMPUTABLE.match(task.op) or v in blocked
                or val.kind is not ValueKind.ACTIVATION or val.dtype not in _FLOAT):
            continue
        # (a value nothing saves is a recipe too, so that one that is saved can be made from
        # it: the product in `gelu(x) * 0.5`, whose gelu nobody keeps)
        n_ops = 1 + sum(ops.get(u, 0) for u in task.inputs)
        if n_ops <= MAX_CHAIN and all(available(u) for u in task.inputs):
            chosen.add(v)
            recipe.add(v)
            ops[v] = n_ops
    return chosen, recipe


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
        lse = bytes_lin(q) / max(d, 1) / _ITEM.get(q.dtype, 4) * 4  # log-sum-exp, float32
        mask = graph.values[ins[3]] if len(ins) > 3 else None
        if mask is None or mask.dtype != "bool":
            if mask is not None:
                keep(ins[3], t)  # (a float mask is the bias the kernel reads again)
            return lse
        # a boolean mask is kept as an additive bias of its own shape in q's dtype (H100: the
        # memory-efficient kernel's float32, cuDNN's bfloat16; the CPU's flash kernel likewise:
        # benchmarks/attention_probe.py), one per call
        return lse + bytes_lin(mask) * _ITEM.get(q.dtype, 4)
    # math path: scaled copies of q and k, a contiguous v, the softmax, the dropout mask (as
    # floats) and the dropped weights, all in float32 where q is half (the math path computes
    # half inputs in float32)
    return (sum((bytes_lin(graph.values[v]) for v in ins[:3]), np.zeros(2)) +
            3 * _attention_matrix(graph, ins)) * _math_widening(q)


def _math_widening(q: Value) -> float:
    """Attention's math path computes half-precision q, k and v in float32: its copies and
    matrices are twice q's item size there."""
    return 4 / _ITEM[q.dtype] if q.dtype in _HALF else 1.0


__all__ = ["Recomputable", "autocast_copies", "b_only", "bases", "bytes_lin", "fused_kernels",
           "recomputable", "requires_grad", "saved", "weight_side", "wgrad_stash"]
