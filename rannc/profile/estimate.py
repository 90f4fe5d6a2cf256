"""The *estimate* cost oracle: a roofline model over the task graph's shapes.

Every task gets FLOPs and bytes moved as linear functions of the per-replica batch size
(`c0 + c1 * batch`, exact for the shapes torch.export gives, which are linear in `batch`), from
its op and the shapes in the TaskGraph alone: no tensor is created, so a 13 B-parameter model
on the `meta` device costs nothing to estimate. Time on a `DeviceSpec` is
`max(flops / (peak * efficiency), bytes / (bandwidth * efficiency)) + launch overhead`, the
peak being the fp16/bf16 tensor-core one for tasks whose outputs are half precision (autocast);
backward is counted as twice the forward (grad of input and grad of weight) for differentiable
tasks, half of it the weight gradient's (`wgrad`, what zero-bubble schedules run as a separate W
pass) where the task reads a trainable parameter, none of it elsewhere. That is device time; a
GPU runs behind the host that issues its kernels, so a block of tasks takes the larger of its
device time and its ops' host time (`DeviceSpec.host_per_op`, backward about twice the
forward's): where kernels are short (small microbatches in bf16) the host binds. The floor
applies per block, the unit the stage DP adds up, not per task (a long kernel hides the host
time of the short ones after it); `component_time`, what coarsening balances and the
plan-quality bounds sum, stays device time. Memory kept for
backward is what autograd saves (`rannc.profile.saved`: per op, the inputs or outputs its
gradient reads, each storage once); a task's working memory is the larger of its forward's
(inputs and outputs) and its backward's (gradients and temporaries).

Index conventions: t indexes graph tasks, c atomic components, j blocks, i batch sizes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rannc.atomic.components import AtomicPartition
from rannc.graph.task_graph import TaskGraph, Value, ValueKind, eval_dim
from rannc.profile.device import Cluster, DeviceSpec
from rannc.profile.saved import b_only, fused_kernels, recomputable, saved, wgrad_stash

DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
FLOAT_DTYPES = {"float64", "float32", "float16", "bfloat16"}
_HALF_DTYPES = {"float16", "bfloat16"}

# Ops whose output aliases an input (no kernel, no memory) or that only read metadata.
_VIEW_OPS = re.compile(
    r"aten\.(view|_unsafe_view|reshape|transpose|t|permute|expand|expand_as|slice|select|unsqueeze|"
    r"squeeze|flatten|split|split_with_sizes|chunk|unbind|alias|detach|as_strided|sym_size|"
    r"sym_numel|sym_stride|unflatten|view_as|narrow|movedim|lift_fresh_copy|_assert\w*)\."
)
_MATMUL_OPS = re.compile(r"aten\.(linear|mm|matmul|bmm|addmm|baddbmm|addbmm|addmv|mv|einsum)\.")
_CONV_OPS = re.compile(r"aten\.(conv\w*|convolution|_convolution)\.")
_ATTN_OPS = re.compile(r"aten\.(_?scaled_dot_product\w*attention\w*)\.")


def _linear_numel(v: Value) -> tuple[float, float]:
    """numel(batch) = c0 + c1 * batch, from its value at batch 1 and 2."""
    n1, n2 = v.numel(1), v.numel(2)
    return float(2 * n1 - n2), float(n2 - n1)


def _bytes(v: Value) -> tuple[float, float]:
    if not v.is_tensor:
        return 0.0, 0.0
    c0, c1 = _linear_numel(v)
    s = DTYPE_BYTES.get(v.dtype, 4)
    return c0 * s, c1 * s


@dataclass(frozen=True, slots=True)
class GraphCosts:
    """Device-independent costs of every task and component of one graph (arrays over tasks)."""

    flops: np.ndarray  # (T, 2): forward FLOPs = [:,0] + [:,1] * batch
    moved: np.ndarray  # (T, 2): bytes read and written
    kept: np.ndarray  # (T, 2): activation bytes autograd keeps for backward (`saved.saved`)
    work: np.ndarray  # (T, 2): bytes live while the task's forward or backward runs
    is_kernel: np.ndarray  # (T,) bool: launches a kernel (not a view)
    has_grad: np.ndarray  # (T,) bool: produces a floating activation (runs in backward)
    has_weight: np.ndarray  # (T,) bool: reads a trainable parameter (a weight gradient)
    half: np.ndarray  # (T,) bool: computes in fp16/bf16 (autocast), at the tensor-core peak
    pair_task: np.ndarray  # (P,) task of each (component, task) holding; cloned tasks repeat
    pair_comp: np.ndarray  # (P,) its component
    comp_params: np.ndarray  # (C,) bytes of the parameters/buffers each component reads
    n_components: int
    # selective recomputation (`saved.recomputable`): of `kept`, the bytes dropped, and the
    # times each task runs again in one microbatch's backward
    freed: np.ndarray | None = None  # (T, 2)
    evals: np.ndarray | None = None  # (T,)
    # (T, 2): bytes a split backward keeps from B for W (`saved.wgrad_stash`), and of `kept`
    # those only B reads, which the runtime releases after B (`saved.b_only`)
    stash: np.ndarray | None = None
    bonly: np.ndarray | None = None

    @classmethod
    def of(cls, graph: TaskGraph, atomic: AtomicPartition, *,
           fused: bool = True) -> GraphCosts:
        """`fused`: the device runs the fused kernels of attention and dropout (CUDA), not the
        composite ones a CPU runs, which keep more for backward (`rannc.profile.saved`;
        `runs_fused_kernels`)."""
        T = len(graph.tasks)
        flops = np.zeros((T, 2))
        moved = np.zeros((T, 2))
        work = np.zeros((T, 2))
        is_kernel = np.zeros(T, dtype=bool)
        has_grad = np.zeros(T, dtype=bool)
        has_weight = np.zeros(T, dtype=bool)
        half = np.zeros(T, dtype=bool)
        vbytes = {name: _bytes(v) for name, v in graph.values.items()}
        for t, task in enumerate(graph.tasks):
            ins = [graph.values[v] for v in task.inputs]
            outs = [graph.values[v] for v in task.outputs]
            in_b = np.sum([vbytes[v.name] for v in ins], axis=0) if ins else np.zeros(2)
            out_b = np.sum([vbytes[v.name] for v in outs], axis=0) if outs else np.zeros(2)
            work[t] = in_b + out_b
            if _VIEW_OPS.match(task.op):
                continue
            is_kernel[t] = True
            moved[t] = in_b + out_b
            flops[t] = _task_flops(task.op, ins, outs)
            half[t] = any(v.dtype in _HALF_DTYPES for v in outs)
            act_out = [v for v in outs if v.kind is ValueKind.ACTIVATION and v.dtype in FLOAT_DTYPES]
            has_grad[t] = bool(act_out)
            has_weight[t] = any(v.kind is ValueKind.PARAM and v.dtype in FLOAT_DTYPES for v in ins)
        kept, bwd_work = saved(graph, fused=fused)
        sel = recomputable(graph, fused=fused)
        work = np.maximum(work, bwd_work)
        pairs = [(t, c.index) for c in atomic.components for t in c.tasks]
        comp_params = np.zeros(len(atomic.components))
        for c in atomic.components:
            seen: set[str] = set()
            for t in c.tasks:
                for vname in graph.tasks[t].inputs:
                    pv = graph.values[vname]
                    if pv.kind in (ValueKind.PARAM, ValueKind.BUFFER) and vname not in seen:
                        seen.add(vname)
                        comp_params[c.index] += vbytes[vname][0] + vbytes[vname][1]
        return cls(flops=flops, moved=moved, kept=kept, work=work, is_kernel=is_kernel,
                   has_grad=has_grad, has_weight=has_weight, half=half,
                   pair_task=np.array([p[0] for p in pairs], dtype=np.int64),
                   pair_comp=np.array([p[1] for p in pairs], dtype=np.int64),
                   comp_params=comp_params, n_components=len(atomic.components),
                   freed=sel.freed, evals=sel.evals, stash=wgrad_stash(graph),
                   bonly=b_only(graph, fused=fused))

    # -- per task ----------------------------------------------------------------------------
    def task_times(self, spec: DeviceSpec, batch: float) -> tuple[np.ndarray, np.ndarray]:
        """Forward and backward seconds of every task at a per-replica batch size."""
        f = self.flops[:, 0] + self.flops[:, 1] * batch
        m = self.moved[:, 0] + self.moved[:, 1] * batch
        # Under autocast the matrix products run in bf16/fp16 on tensor cores, at a peak many
        # times the fp32 one (H100: 989 against 67 TFLOP/s); pricing them at fp32 would make
        # every bf16 stage look compute-bound and mislead the balance against memory-bound tasks.
        peak = np.where(self.half & (spec.flops_half > 0), spec.flops_half, spec.flops) * spec.efficiency
        bw = spec.mem_bandwidth * spec.efficiency
        fwd = np.maximum(f / peak, m / bw) + spec.op_overhead * self.is_kernel
        bwd = 2 * fwd * self.has_grad
        return fwd, bwd

    def task_wgrad(self, fwd: np.ndarray) -> np.ndarray:
        """The weight-gradient seconds inside each task's backward, given its forward seconds:
        half of the backward (dW, beside dX) where it reads a trainable parameter."""
        return fwd * (self.has_grad & self.has_weight)

    # -- per component / block ------------------------------------------------------------------
    def component_time(self, spec: DeviceSpec, batch: float) -> np.ndarray:
        """Forward + backward seconds of every atomic component."""
        fwd, bwd = self.task_times(spec, batch)
        return np.bincount(self.pair_comp, weights=(fwd + bwd)[self.pair_task],
                           minlength=self.n_components)

    def component_memory(self, batch: float) -> np.ndarray:
        """Bytes a component needs alone: its parameters with gradients and activations kept."""
        kept = self.kept[:, 0] + self.kept[:, 1] * batch
        return 2 * self.comp_params + np.bincount(self.pair_comp, weights=kept[self.pair_task],
                                                  minlength=self.n_components)

    def _host_floors(self, spec: DeviceSpec, blk: np.ndarray,
                     nb: int) -> tuple[np.ndarray, ...] | None:
        """Per block, the host seconds of running its ops (`DeviceSpec.host_per_op`): forward,
        backward (twice a differentiable op's forward), the weight gradients within it (once a
        differentiable op reading a parameter), and its selective recomputation (the recomputed
        ops' forwards); None where the host time is in the device time (0)."""
        h = spec.host_per_op
        if h <= 0:
            return None
        k = self.is_kernel.astype(np.float64)
        per_task = [h * k, 2 * h * k * self.has_grad, h * k * (self.has_grad & self.has_weight),
                    h * k * (self.evals if self.evals is not None else 0.0)]
        return tuple(np.bincount(blk, weights=w[self.pair_task], minlength=nb) for w in per_task)

    def block_profile(self, spec: DeviceSpec, block_of: Sequence[int],
                      batch_sizes: Sequence[int]) -> BlockProfile:
        blk = np.asarray(block_of, dtype=np.int64)[self.pair_comp]
        nb = int(blk.max()) + 1 if len(blk) else 0
        shape = (nb, len(batch_sizes))
        fwd, bwd, wgrad, kept, work, kept_sel, sel, stash, bonly = (np.zeros(shape) for _ in range(9))
        host = self._host_floors(spec, blk, nb)
        for i, b in enumerate(batch_sizes):
            f, g = self.task_times(spec, b)
            fwd[:, i] = np.bincount(blk, weights=f[self.pair_task], minlength=nb)
            bwd[:, i] = np.bincount(blk, weights=g[self.pair_task], minlength=nb)
            wgrad[:, i] = np.bincount(blk, weights=self.task_wgrad(f)[self.pair_task], minlength=nb)
            if host is not None:
                for col, floor in zip((fwd, bwd, wgrad), host[:3], strict=True):
                    np.maximum(col[:, i], floor, out=col[:, i])
            k = self.kept[:, 0] + self.kept[:, 1] * b
            kept[:, i] = np.bincount(blk, weights=k[self.pair_task], minlength=nb)
            w = self.work[:, 0] + self.work[:, 1] * b
            np.maximum.at(work[:, i], blk, w[self.pair_task])
            if self.stash is not None:
                st = self.stash[:, 0] + self.stash[:, 1] * b
                stash[:, i] = np.bincount(blk, weights=st[self.pair_task], minlength=nb)
            if self.bonly is not None:
                bo = self.bonly[:, 0] + self.bonly[:, 1] * b
                bonly[:, i] = np.bincount(blk, weights=bo[self.pair_task], minlength=nb)
            if self.freed is not None and self.evals is not None:
                dropped = self.freed[:, 0] + self.freed[:, 1] * b
                kept_sel[:, i] = kept[:, i] - np.bincount(blk, weights=dropped[self.pair_task],
                                                          minlength=nb)
                sel[:, i] = np.bincount(blk, weights=(self.evals * f)[self.pair_task], minlength=nb)
                if host is not None:
                    np.maximum(sel[:, i], host[3], out=sel[:, i])
        if self.freed is None:
            return BlockProfile(tuple(batch_sizes), fwd, bwd, kept, work, wgrad, stash=stash,
                                bonly=bonly)
        return BlockProfile(tuple(batch_sizes), fwd, bwd, kept, work, wgrad, kept_sel, sel,
                            stash=stash, bonly=bonly)


@dataclass(frozen=True, slots=True)
class BlockProfile:
    """Per block (rows) and per-replica microbatch size (columns): seconds and bytes."""

    batch_sizes: tuple[int, ...]
    fwd: np.ndarray
    bwd: np.ndarray  # without recomputation
    kept: np.ndarray  # activation bytes kept for backward by one microbatch
    work: np.ndarray  # the largest single task's live bytes
    wgrad: np.ndarray | None = None  # the weight-gradient seconds within bwd (None: unknown)
    # selective recomputation (`saved.recomputable`; None: not offered): the bytes kept for
    # backward when its recipes are dropped, and the seconds rebuilding them adds to backward
    kept_sel: np.ndarray | None = None
    selective: np.ndarray | None = None
    # the bytes a backward split into B and W keeps from B for W by one microbatch
    # (`saved.wgrad_stash`; None: unknown, taken as none), and of `kept` what the runtime
    # releases after B, which only B reads (`saved.b_only`; None: unknown, taken as none)
    stash: np.ndarray | None = None
    bonly: np.ndarray | None = None

    def column(self, batch: int) -> int:
        return self.batch_sizes.index(batch)

    def prefix_sums(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        """Per field name, its sums over blocks 0..i-1 as row i (row 0 zeros), so blocks l..r
        sum to row r + 1 less row l; a field that is None is left out."""
        zero = np.zeros((1, self.fwd.shape[1]))
        return {n: np.vstack([zero, np.cumsum(getattr(self, n), axis=0)]) for n in names
                if getattr(self, n) is not None}


def runs_fused_kernels(cluster: Cluster) -> bool:
    """Whether every device of `cluster` runs fused attention and dropout kernels
    (`rannc.profile.saved.fused_kernels`)."""
    return all(fused_kernels(d.name) for d in cluster.devices)


def _shape(v: Value, batch: int) -> list[int]:
    return [eval_dim(d, batch) for d in v.shape]


def _numel_lin(v: Value) -> np.ndarray:
    return np.array(_linear_numel(v)) if v.is_tensor else np.zeros(2)


def _task_flops(op: str, ins: list[Value], outs: list[Value]) -> np.ndarray:
    """Forward FLOPs as (c0, c1) in the batch size."""
    tens_in = [v for v in ins if v.is_tensor]
    out = outs[0] if outs and outs[0].is_tensor else None
    if out is None:
        return np.zeros(2)
    out_n = _numel_lin(out)
    if _MATMUL_OPS.match(op) and tens_in:
        # the contracted size: the last dim of the (batched) left operand; addmm-style ops
        # take the bias first
        left = tens_in[1] if op.split(".")[1] in ("addmm", "baddbmm", "addbmm", "addmv") and \
            len(tens_in) > 1 else tens_in[0]
        k = _shape(left, 1)[-1] if left.shape else 1
        return 2.0 * k * out_n
    if _CONV_OPS.match(op) and len(tens_in) > 1:
        w = _shape(tens_in[1], 1)
        per_out = float(np.prod(w[1:])) if len(w) > 1 else 1.0
        return 2.0 * per_out * out_n
    if _ATTN_OPS.match(op) and len(tens_in) >= 3:
        q, key = tens_in[0], tens_in[1]
        s_len = _shape(key, 1)[-2] if len(key.shape) >= 2 else 1
        return 4.0 * s_len * _numel_lin(q)
    biggest = max((_numel_lin(v) for v in tens_in), key=lambda a: a[1] * 64 + a[0], default=out_n)
    return np.maximum(out_n, biggest)
