"""Cost tables for the stage DP: for every run of consecutive blocks l..r and every replica
count d, the time of one microbatch through that stage and the memory it needs, under the
memory model of DESIGN.md section 4.

Everything here is arithmetic on numpy arrays: a `BlockProfile` (per block and per-replica
batch size: forward/backward seconds, activation bytes kept, working bytes) from a cost oracle,
and the block boundary tables of `BlockIO` (stage inputs, outputs and parameters of every block
range, counted once per stage).

Index conventions: l, r are the first and last block of a stage (inclusive), d its replicas.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rannc.atomic.components import AtomicPartition
from rannc.graph.task_graph import TaskGraph, ValueKind
from rannc.profile.estimate import BlockProfile, _bytes


@dataclass(frozen=True, slots=True)
class BlockIO:
    """Per block range [l, r] (arrays indexed [l, r]); byte counts are c0 + c1 * batch."""

    inputs: np.ndarray  # (2, k, k): bytes a stage receives per microbatch (model inputs included)
    outputs: np.ndarray  # (2, k, k): bytes it sends on (or returns as model outputs)
    params: np.ndarray  # (k, k): bytes of the parameters and buffers it holds, each once
    grad_params: np.ndarray  # (k, k): bytes of the trainable parameters among them
    cut_ok: np.ndarray  # (k+1,): a stage may start or end at this block boundary

    @classmethod
    def of(cls, graph: TaskGraph, atomic: AtomicPartition, block_of: Sequence[int]) -> BlockIO:
        """O(values + k^2): each value adds its bytes to rectangles of [l, r] through 2-D
        difference arrays, summed once at the end (the planner's refinement builds these
        tables for groupings of a few hundred blocks, where a loop over l per value is slow).
        Byte counts are integers, so the sums are exact whatever their order."""
        k = max(block_of) + 1
        # difference arrays, (k+1, k+1): X[l, r] = sum of d[:l+1, :r+1] once summed
        d_in, d_out = np.zeros((2, k + 1, k + 1)), np.zeros((2, k + 1, k + 1))
        d_par, d_grad = np.zeros((k + 1, k + 1)), np.zeros((k + 1, k + 1))
        cut_ok = np.ones(k + 1, dtype=bool)
        blocks_of_task = [sorted({block_of[c] for c in h}) for h in atomic.holders]
        out_names = {v for v in graph.outputs if v is not None}

        def upto_next(d: np.ndarray, first: int, consumers: list[int], size: object) -> None:
            # rows l >= first: X[l, r] += size for r >= the first consumer block >= l
            lo = first
            for c in consumers:
                if c < lo:
                    continue
                d[..., lo, c] += size  # rows lo..c, columns c..k-1
                d[..., c + 1, c] -= size
                lo = c + 1

        for name, val in graph.values.items():
            consumers = sorted({b for t in graph.consumers(name) for b in blocks_of_task[t]})
            if val.kind in (ValueKind.PARAM, ValueKind.BUFFER):
                size = sum(_bytes(val))
                upto_next(d_par, 0, consumers, size)
                if val.kind is ValueKind.PARAM:
                    upto_next(d_grad, 0, consumers, size)
                continue
            if val.kind not in (ValueKind.INPUT, ValueKind.ACTIVATION) or not val.is_tensor:
                continue
            prod_task = graph.producer(name)
            if prod_task is not None and atomic.component_of[prod_task] < 0:
                continue  # a constant task's output: cloned where needed, never sent
            p = -1 if prod_task is None else block_of[atomic.component_of[prod_task]]
            last = k if name in out_names else max(consumers, default=p)
            b = np.array(_bytes(val))
            upto_next(d_in, p + 1, consumers, b)  # a stage starting after p receives it
            if p >= 0 and last > p:
                # stages l <= p ending in p .. last-1 send it on (or return it)
                d_out[:, 0, p] += b
                d_out[:, 0, last] -= b
                d_out[:, p + 1, p] -= b
                d_out[:, p + 1, last] += b
                if val.kind is ValueKind.ACTIVATION and val.batch_dim is None:
                    cut_ok[p + 1:min(last, k) + 1] = False  # not splittable by rows
        cut_ok[0] = cut_ok[k] = True

        def total(d: np.ndarray) -> np.ndarray:
            return np.cumsum(np.cumsum(d, axis=-2), axis=-1)[..., :k, :k]

        return cls(total(d_in), total(d_out), total(d_par), total(d_grad), cut_ok)


@dataclass(frozen=True, slots=True)
class MemoryModel:
    opt_param_factor: float  # optimizer state per parameter element (Adam: 2)
    limit: float  # bytes a stage may use (device memory after the margin)
    checkpointing: str  # auto / on / off / stage_aware


@dataclass(frozen=True, slots=True)
class StageTables:
    """For one (devices per pipeline, pipeline copies, microbatches): arrays over [l, r, d]."""

    h: np.ndarray  # bottleneck time per microbatch (inf: infeasible)
    fwd: np.ndarray  # forward seconds incl. receiving inputs
    bwd: np.ndarray  # backward seconds incl. recomputation and sending gradients back
    allreduce: np.ndarray  # gradient all-reduce seconds per iteration
    memory: np.ndarray  # predicted bytes (of the chosen recompute option)
    memory_min: np.ndarray  # the smaller of the two options' memory (for "needs N GB")
    recompute: np.ndarray  # fraction of kept activation memory recomputed
    recompute_s: np.ndarray  # the seconds that recomputation adds (inside bwd)
    batch: np.ndarray  # (D+1,) rows per replica per microbatch


def batch_per_replica(batch_size: int, copies: int, microbatches: int, d: int) -> int:
    """Rows the busiest replica computes per microbatch."""
    return math.ceil(batch_size / (copies * microbatches * d))


def stage_tables(prof: BlockProfile, io: BlockIO, mem: MemoryModel, *, batch_size: int,
                 devices: int, copies: int, microbatches: int, link_bw: float, allreduce_bw: float,
                 inflight: int | None = None, saved_inputs: int = 0) -> StageTables:
    """`inflight`: microbatches whose activations a stage holds at once (fill-drain: all of
    them; 1F1B: at most the stages from it to the end); `saved_inputs`: microbatches whose stage
    inputs are kept besides (eager schedules keep them for a late backward pass).

    Recomputation is a fraction f of a stage's kept activations dropped in forward and rebuilt
    before backward (Merak's stage-aware recomputation, by memory rather than by layer): the
    smallest f that fits, so a stage keeps all it can afford. f costs f * forward seconds more;
    memory = static + inflight * (inputs + outputs + (1 - f) * kept) + f * kept + working."""
    k = io.params.shape[0]
    shape = (k, k, devices + 1)
    out = {n: np.full(shape, math.inf) for n in ("h", "fwd", "bwd", "allreduce", "memory", "memory_min")}
    recompute = np.zeros(shape)
    recompute_s = np.zeros(shape)
    batch = np.zeros(devices + 1, dtype=np.int64)
    valid = np.triu(np.ones((k, k), dtype=bool)) & io.cut_ok[:k, None] & io.cut_ok[None, 1:]
    n_in = microbatches if inflight is None else inflight
    zero = np.zeros((1, prof.fwd.shape[1]))
    pre = {n: np.vstack([zero, np.cumsum(getattr(prof, n), axis=0)]) for n in ("fwd", "bwd", "kept")}
    work_max = np.zeros((k, k, prof.work.shape[1]))
    for lo in range(k):
        work_max[lo, lo:] = np.maximum.accumulate(prof.work[lo:], axis=0)
    static = io.params + io.grad_params * (1 + mem.opt_param_factor)
    f_min = 1.0 if mem.checkpointing == "on" else 0.0
    f_max = 0.0 if mem.checkpointing == "off" else 1.0
    for d in range(1, devices + 1):
        b = batch_per_replica(batch_size, copies, microbatches, d)
        batch[d] = b
        if b < 1:
            continue
        i = prof.column(b)

        def rng(name: str, i: int = i) -> np.ndarray:
            p = pre[name][:, i]
            return p[None, 1:] - p[:k, None]  # [l, r] = sum over blocks l..r

        fwd, bwd, kept = rng("fwd"), rng("bwd"), rng("kept")
        inb = io.inputs[0] + io.inputs[1] * b
        outb = io.outputs[0] + io.outputs[1] * b
        comm = (inb + outb) / link_bw
        ranks = d * copies
        ar = 2.0 * io.grad_params * (ranks - 1) / ranks / allreduce_bw
        base = static + n_in * (inb + outb) + saved_inputs * inb + work_max[:, :, i]
        full = base + n_in * kept  # nothing recomputed
        saved_per_f = (n_in - 1) * kept  # memory one unit of f frees
        with np.errstate(divide="ignore", invalid="ignore"):
            need = np.where(full <= mem.limit, 0.0,
                            np.where(saved_per_f > 0, (full - mem.limit) / saved_per_f, math.inf))
        f = np.maximum(need, f_min)
        ok = valid & (f <= f_max)
        f = np.where(ok, f, 0.0)
        memory = full - f * saved_per_f
        fw = fwd + comm / 2
        g = bwd + comm / 2 + f * fwd
        out["fwd"][:, :, d] = np.where(ok, fw, math.inf)
        out["bwd"][:, :, d] = np.where(ok, g, math.inf)
        out["allreduce"][:, :, d] = np.where(ok, ar, math.inf)
        out["h"][:, :, d] = np.where(ok, fw + g + ar / microbatches, math.inf)
        out["memory"][:, :, d] = np.where(ok, memory, math.inf)
        smallest = full - np.where(saved_per_f > 0, f_max * saved_per_f, 0.0)
        out["memory_min"][:, :, d] = np.where(valid, smallest, math.inf)
        recompute[:, :, d] = f
        recompute_s[:, :, d] = f * fwd
    return StageTables(recompute=recompute, recompute_s=recompute_s, batch=batch, **out)


def gpipe_iteration_time(fwd: Sequence[float], bwd: Sequence[float], allreduce: Sequence[float],
                         microbatches: int) -> float:
    """Fill-drain: the first microbatch crosses every stage, the rest follow at the pace of the
    slowest stage, in both directions; then the slowest gradient all-reduce."""
    return (sum(fwd) + (microbatches - 1) * max(fwd) + sum(bwd) + (microbatches - 1) * max(bwd)
            + max(allreduce))
