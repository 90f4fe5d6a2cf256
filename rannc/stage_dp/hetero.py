"""Stages over a mixed cluster: a min-max DP over (blocks, devices) where each stage takes a run
of devices in memory order and its replicas split rows by speed within memory (`whale_shares`).

The homogeneous DP (`dp.py`) costs every stage on the weakest device, so on a mixed cluster it
cannot see that a stage on fast devices may take more blocks. Here a stage's time depends on
which devices it gets: devices are ordered by memory (then speed), so earlier stages, which
hold more microbatches' activations, get the larger memories, and stage s takes devices
[i, i + d) of that order. best[b][i] is the smallest bottleneck of the first b blocks on the
first i devices. Pure Python over k blocks and D devices, O(k^2 D^2) stage costs: meant for
the tens of devices of a mixed cluster, not for hundreds.

Index conventions: l, r first and last block of a stage; i its first device (in order), d its
device count; j a replica.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rannc.errors import RaNNCError
from rannc.profile.estimate import BlockProfile
from rannc.stage_dp.memory import (
    at_return_memory,
    bucket_memory,
    local_rows,
    returned_memory,
    stage_memory,
)
from rannc.stage_dp.shares import whale_shares
from rannc.stage_dp.tables import BlockIO, exposed_reduction


@dataclass(frozen=True, slots=True)
class HeteroStage:
    first_block: int
    last_block: int
    devices: tuple[int, ...]  # positions in the cluster (ranks)
    rows: tuple[float, ...]  # per replica, rows of each microbatch
    forward_s: float
    backward_s: float  # recomputation included
    recompute_s: float
    allreduce_s: float
    memory_bytes: float  # the fullest replica's
    recompute: bool
    selective: bool = False  # selective recomputation (`saved.recomputable`)
    selective_s: float = 0.0  # its rebuilds' seconds (in backward_s)


@dataclass(frozen=True, slots=True)
class HeteroDevices:
    speed: Sequence[float]  # effective FLOP/s per rank
    memory: Sequence[float]  # bytes a stage may use per rank (margin taken off)

    def order(self) -> list[int]:
        n = len(self.speed)
        return sorted(range(n), key=lambda r: (-self.memory[r], -self.speed[r], r))


def hetero_stages(prof: BlockProfile, io: BlockIO, static: np.ndarray, dev: HeteroDevices, *,
                  rows: float, batch_of: Sequence[int], in_flight: int, saved: int,
                  link_bw: float, allreduce_bw: float, microbatches: int, checkpointing: str,
                  stages: int | None = None, replicas: Sequence[int] | None = None,
                  bucket_bytes: float = 0.0, overlap: bool = False,
                  selective: bool = False, pending: int = 0) -> list[HeteroStage] | None:
    """The best split of all blocks over all devices (or into exactly `stages` stages, or with
    stage s on exactly `replicas[s]` devices), or None.

    `rows`: rows of one microbatch; `batch_of[d]`: the profile batch size to read a stage of d
    replicas at (its per-replica rows with equal shares); `prof`'s times are the weakest
    device's, scaled here by each device's speed. `bucket_bytes` and `overlap`: the gradient
    reduction's bucket (memory) and whether it runs during the last backward
    (`tables.reduction_overlaps_backward`). `static`: what a replica of [l, r] holds whatever
    the batch (`MemoryModel.static`, the rank's overhead included; the bucket apart).
    `selective`: a stage may also recompute selectively (`MemoryModel.selective`), where the
    profile has its figures: instead of recomputing its whole forward, or alone under
    checkpointing "selective". `pending`: the schedule runs B and W apart, and this many
    microbatches' gradients kept from B for W count besides (`tables.stage_tables`)."""
    k = io.params.shape[0]
    order = dev.order()
    n = len(order)
    # this rank's rows of every batch output, assembled when the call returns
    mine = io.returned_bytes(0, local_rows(round(rows * microbatches), 1, n))[1]
    slow = min(dev.speed)
    pre = prof.prefix_sums(("fwd", "bwd", "kept", "kept_sel", "selective", "stash", "bonly"))
    if not pending:
        pre.pop("stash", None)
        pre.pop("bonly", None)
    # (recompute the whole forward, keep a recipe of the cheap ops' activations) per option
    options = [(False, False), (True, False)] if checkpointing in ("auto", "stage_aware") else \
        [(checkpointing == "on", False)]
    if selective and "kept_sel" in pre and "selective" in pre:
        options = [(False, True)] if checkpointing == "selective" else [*options, (False, True)]
    elif checkpointing == "selective":
        options = [(False, False)]
    cache: dict[tuple[int, int, int, int], HeteroStage | None] = {}

    def stage(lo: int, r: int, i: int, d: int) -> HeteroStage | None:
        key = (lo, r, i, d)
        if key in cache:
            return cache[key]
        cache[key] = None
        b = batch_of[d]
        if b < 1 or b not in prof.batch_sizes:
            return None
        c = prof.column(b)
        f = (pre["fwd"][r + 1, c] - pre["fwd"][lo, c]) / b
        g = (pre["bwd"][r + 1, c] - pre["bwd"][lo, c]) / b
        kept = (pre["kept"][r + 1, c] - pre["kept"][lo, c]) / b
        # (what B changes of a microbatch's bytes per row: `tables.stage_tables`)
        stash = (pre["stash"][r + 1, c] - pre["stash"][lo, c]) / b if "stash" in pre and lo > 0 \
            else 0.0
        released = (pre["bonly"][r + 1, c] - pre["bonly"][lo, c]) / b \
            if "bonly" in pre and lo > 0 else 0.0
        work = float(prof.work[lo:r + 1, c].max())
        in0, in1 = io.inputs[0][lo, r], io.inputs[1][lo, r]
        out0, out1 = io.outputs[0][lo, r], io.outputs[1][lo, r]
        # the model's batch outputs this stage computes, held for every microbatch until the
        # call returns, and the stage's memory then: affine in the rows too (at0 + at1 * rows)
        ret0, ret1 = (0.0, 0.0) if io.returned is None else \
            (float(io.returned[0][lo, r]), float(io.returned[1][lo, r]))
        grads = float(io.grad_params[lo, r])
        bucket = float(bucket_memory(grads, float(io.shared_grad[lo, r]),
                                     float(io.shared_count()[lo, r]), d > 1, bucket_bytes))
        computes = ret0 > 0 or ret1 > 0
        held0 = returned_memory(ret0, mine, microbatches, in_flight, computes)
        held1 = returned_memory(ret1, 0.0, microbatches, in_flight, computes)
        at0 = float(at_return_memory(float(static[lo, r]) + bucket, in0, out0, 0.0, held0,
                                     in_flight=in_flight, saved_inputs=saved,
                                     microbatches=microbatches))
        at1 = float(at_return_memory(0.0, in1, out1, kept, held1, in_flight=in_flight,
                                     saved_inputs=saved, microbatches=microbatches))
        comm_row = (in1 + out1) / link_bw
        comm0 = (in0 + out0) / link_bw
        ranks = [order[p] for p in range(i, i + d)]
        v = [dev.speed[x] for x in ranks]
        reduce_s = 2.0 * grads * (d - 1) / d / allreduce_bw
        best: HeteroStage | None = None
        for rc, sel in options:
            k_row = (pre["kept_sel"][r + 1, c] - pre["kept_sel"][lo, c]) / b if sel else kept
            sel_row = (pre["selective"][r + 1, c] - pre["selective"][lo, c]) / b if sel else 0.0
            # the memory model is affine in the rows a replica computes: fixed + per_row * rows
            fixed = stage_memory(float(static[lo, r]) + bucket, work, in0, out0, 0.0,
                                 in_flight=in_flight, saved_inputs=saved, recompute=float(rc),
                                 microbatches=microbatches, held_outputs=held0.held)
            per_row = stage_memory(0.0, 0.0, in1, out1, k_row, in_flight=in_flight,
                                   saved_inputs=saved, recompute=float(rc),
                                   microbatches=microbatches, held_outputs=held1.held,
                                   stash=stash, released=0.0 if sel else released,
                                   pending=pending)
            caps = [min(_rows_within(dev.memory[x], fixed, per_row), _rows_within(dev.memory[x], at0, at1))
                    for x in ranks]
            try:
                x = whale_shares(rows, v, caps)
            except RaNNCError:
                continue
            pairs = list(zip(x, v, strict=True))
            fw = max(xj * (f * slow / vj + comm_row / 2) for xj, vj in pairs) + comm0 / 2
            rec = max(xj * f * slow / vj for xj, vj in pairs) if rc else 0.0
            rebuild = max(xj * sel_row * slow / vj for xj, vj in pairs) if sel else 0.0
            bw = max(xj * (g * slow / vj + comm_row / 2) for xj, vj in pairs) + comm0 / 2 + rec \
                + rebuild
            mem = max(max(fixed + per_row * xj, at0 + at1 * xj) for xj in x)
            ar = float(exposed_reduction(reduce_s, bw, grads, bucket_bytes, overlap))
            cand = HeteroStage(lo, r, tuple(ranks), tuple(x), fw, bw, rec, ar, mem, rc, sel,
                               rebuild)
            if best is None or _h(cand, microbatches) < _h(best, microbatches):
                best = cand
        cache[key] = best
        return best

    inf = math.inf
    # best[b, i]: the smallest bottleneck of the first b blocks on the first i devices (with
    # `stages` forced, over exactly that many stages: one more dimension)
    if replicas is not None:
        stages = len(replicas)
    layers = 1 if stages is None else stages
    best = np.full((layers + 1, k + 1, n + 1), inf)
    arg: dict[tuple[int, int, int], tuple[int, int, HeteroStage]] = {}
    best[0, 0, 0] = 0.0
    cut_ok = io.cut_ok
    for s in range(1, layers + 1):
        src = 0 if stages is None else s - 1
        for b in range(1, k + 1):
            if not cut_ok[b]:
                continue
            for i in range(1, n + 1):
                for lo in range(b):
                    if not cut_ok[lo]:
                        continue
                    for i0 in range(i):
                        if replicas is not None and i - i0 != replicas[s - 1]:
                            continue
                        prev = best[src, lo, i0] if stages is not None else (
                            0.0 if (lo, i0) == (0, 0) else best[1, lo, i0])
                        if prev == inf:
                            continue
                        st = stage(lo, b - 1, i0, i - i0)
                        if st is None:
                            continue
                        val = max(prev, _h(st, microbatches))
                        if val < best[s, b, i]:
                            best[s, b, i] = val
                            arg[(s, b, i)] = (lo, i0, st)
    top = layers
    if best[top, k, n] == inf:
        return None
    out: list[HeteroStage] = []
    s, b, i = top, k, n
    while b > 0:
        lo, i0, st = arg[(s, b, i)]
        out.append(st)
        b, i = lo, i0
        if stages is not None:
            s -= 1
    return list(reversed(out))


def _rows_within(capacity: float, c0: float, c1: float) -> float:
    """Rows that fit `capacity` bytes under c0 + c1 * rows (inf: any, where nothing scales)."""
    return (capacity - c0) / c1 if c1 > 0 else math.inf


def _h(st: HeteroStage, microbatches: int) -> float:
    return st.forward_s + st.backward_s + st.allreduce_s / microbatches


__all__ = ["HeteroDevices", "HeteroStage", "hetero_stages"]
