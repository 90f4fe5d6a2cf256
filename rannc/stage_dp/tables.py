"""Cost tables for the stage DP: for every run of consecutive blocks l..r and every replica
count d, the time of one microbatch through that stage and the memory it needs, under the
memory model of DESIGN.md section 4 (`memory.py`, called here on whole arrays at once).

Everything here is arithmetic on numpy arrays: a `BlockProfile` (per block and per-replica
batch size: forward/backward seconds, activation bytes kept, working bytes) from a cost oracle,
and the block boundary tables of `BlockIO` (stage inputs, outputs and parameters of every block
range, counted once per stage).

Index conventions: l, r are the first and last block of a stage (inclusive), d its replicas.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rannc.atomic.components import AtomicPartition
from rannc.graph.row_mixing import unsplittable
from rannc.graph.task_graph import SHAPE_OPS, TaskGraph, ValueKind
from rannc.profile.estimate import BlockProfile, _bytes
from rannc.profile.saved import autocast_copies
from rannc.schedule.spec import get_spec
from rannc.stage_dp.memory import (
    MemoryModel,
    at_return_memory,
    bucket_memory,
    fraction_to_fit,
    local_rows,
    memory_terms,
    returned_memory,
    with_recompute,
)


@dataclass(frozen=True, slots=True)
class BlockIO:
    """Per block range [l, r] (arrays indexed [l, r]); byte counts are c0 + c1 * batch."""

    inputs: np.ndarray  # (2, k, k): bytes a stage receives per microbatch (model inputs included)
    outputs: np.ndarray  # (2, k, k): bytes it sends on (or returns as model outputs)
    # (k, k): bytes of the parameters and buffers it holds, each once, and of the
    # half-precision copies autocast keeps of its parameters (`saved.autocast_copies`)
    params: np.ndarray
    grad_params: np.ndarray  # (k, k): bytes of the trainable parameters among them
    cut_ok: np.ndarray  # (k+1,): a stage may start or end at this block boundary
    # (k, k): bytes of its trainable parameters that a block outside it also reads (tied
    # weights): their gradients are reduced across stages even without replicas
    shared_grad: np.ndarray
    # (2, k, k): bytes per microbatch of the model's batch outputs (logits) a stage computes:
    # the runtime holds every microbatch's until the call returns them (None: none)
    returned: np.ndarray | None = None
    # (2,): bytes of every batch output the model returns (c0 + c1 * rows): each rank
    # assembles its own rows of them at the end of a call
    returned_all: np.ndarray | None = None
    # (k, k): how many trainable parameters make up `shared_grad` (a reduction of one parameter
    # needs no bucket buffer: `memory.bucket_memory`; None: unknown, taken as several)
    shared_params: np.ndarray | None = None

    @classmethod
    def of(cls, graph: TaskGraph, atomic: AtomicPartition, block_of: Sequence[int],
           uses: ValueUses | None = None) -> BlockIO:
        """The tables for the grouping `block_of`; pass `uses` (`ValueUses.of`) when building
        them for several groupings of one graph."""
        return (uses if uses is not None else ValueUses.of(graph, atomic)).block_io(block_of)

    def shared_count(self) -> np.ndarray:
        """`shared_params`, or where unknown 2 wherever a range shares a gradient (several
        parameters: the bucket counted, the safe side)."""
        if self.shared_params is not None:
            return self.shared_params
        return np.where(self.shared_grad > 0, 2.0, 0.0)

    def returned_bytes(self, rows: int | np.ndarray, local: int) -> tuple[np.ndarray, float]:
        """(bytes of the batch outputs each stage [l, r] computes per microbatch of `rows` rows
        per replica, bytes of this rank's `local` rows of every batch output): the inputs of
        `memory.returned_memory`. `rows` an array of shape (n, 1, 1): [j, l, r] for rows[j]
        (of a `pick`: (n, 1), [j, cell])."""
        if self.returned is None or self.returned_all is None:
            return np.zeros(self.params.shape), 0.0
        return (self.returned[0] + self.returned[1] * rows,
                float(self.returned_all[0] + self.returned_all[1] * local))

    def pick(self, first: np.ndarray, last: np.ndarray) -> BlockIO:
        """The tables of the block ranges [first[i], last[i]] alone, each (k, k) array as
        (n,): what `stage_tables` reads for a few cells. `cut_ok` stays whole (it is per
        boundary, not per range)."""
        def at(x: np.ndarray | None) -> np.ndarray | None:
            return None if x is None else x[..., first, last]

        return BlockIO(self.inputs[:, first, last], self.outputs[:, first, last],
                       self.params[first, last], self.grad_params[first, last], self.cut_ok,
                       self.shared_grad[first, last], at(self.returned), self.returned_all,
                       at(self.shared_params))


@dataclass(frozen=True, slots=True)
class ValueUses:
    """What `BlockIO` reads from the graph, independent of the grouping, as flat arrays: built
    once per graph, so the planner's boundary refinement can table many groupings.

    Parameters and buffers (index i): `par_bytes` (with their autocast copies), `par_grad`
    (trainable), `par_own` (their own bytes, which the gradients mirror); inputs and
    activations a stage may receive or send (index j): `act_bytes` (c0, c1), `act_prod` (the
    producing component, -1 for a model input), `act_output` (a model output), `act_rows` (split
    by batch rows; a cut across one that is not is refused). `*_use` are (value, consumer
    component) pairs."""

    par_bytes: np.ndarray  # (P,)
    par_grad: np.ndarray  # (P,) bool
    par_own: np.ndarray  # (P,)
    par_use: np.ndarray  # (2, U) int64
    act_bytes: np.ndarray  # (A, 2)
    act_prod: np.ndarray  # (A,) int64
    act_output: np.ndarray  # (A,) bool
    act_rows: np.ndarray  # (A,) bool
    act_use: np.ndarray  # (2, U) int64

    @classmethod
    def of(cls, graph: TaskGraph, atomic: AtomicPartition) -> ValueUses:
        out_names = {v for v in graph.outputs if v is not None}
        copies = autocast_copies(graph)
        cannot = unsplittable(graph)  # may not cross a stage boundary
        par: list[tuple[float, bool, float]] = []
        act: list[tuple[float, float, int, bool, bool]] = []
        par_use: list[tuple[int, int]] = []
        act_use: list[tuple[int, int]] = []
        for name, val in graph.values.items():
            held = val.kind in (ValueKind.PARAM, ValueKind.BUFFER)
            # an input or activation read for its sizes alone moves no rows (`Routes.shape_only`)
            consumers = sorted({c for t in graph.consumers(name)
                                if held or graph.tasks[t].op not in SHAPE_OPS
                                for c in atomic.holders[t]})
            if held:
                par_use += [(len(par), c) for c in consumers]
                own = sum(_bytes(val))
                par.append((own + copies.get(name, 0.0), val.kind is ValueKind.PARAM, own))
                continue
            if val.kind not in (ValueKind.INPUT, ValueKind.ACTIVATION) or (
                    not val.is_tensor and name not in cannot):
                continue  # (a size from tensor values is in `cannot`: kept, to refuse its cuts)
            prod_task = graph.producer(name)
            if prod_task is not None and atomic.component_of[prod_task] < 0:
                continue  # a constant task's output: cloned where needed, never sent
            p = -1 if prod_task is None else atomic.component_of[prod_task]
            act_use += [(len(act), c) for c in consumers]
            size = _bytes(val) if val.is_tensor else (0.0, 0.0)
            act.append((*size, p, name in out_names, name not in cannot))

        def pairs(x: list[tuple[int, int]]) -> np.ndarray:
            return np.array(x, dtype=np.int64).reshape(-1, 2).T

        pa = np.array(par, dtype=np.float64).reshape(-1, 3)
        aa = np.array(act, dtype=np.float64).reshape(-1, 5)
        return cls(par_bytes=pa[:, 0], par_grad=pa[:, 1] > 0, par_own=pa[:, 2], par_use=pairs(par_use),
                   act_bytes=aa[:, :2], act_prod=aa[:, 2].astype(np.int64),
                   act_output=aa[:, 3] > 0, act_rows=aa[:, 4] > 0, act_use=pairs(act_use))

    def block_io(self, block_of: Sequence[int]) -> BlockIO:
        """O(values + k^2), without a Python loop: each value adds its bytes to rectangles of
        [l, r] in 2-D difference arrays, summed once at the end. Byte counts are integers, so the
        sums are exact whatever their order."""
        blk = np.asarray(block_of, dtype=np.int64)
        k = int(blk.max()) + 1
        p_par = np.full(len(self.par_bytes), -1, dtype=np.int64)
        p_act = np.where(self.act_prod >= 0, blk[np.maximum(self.act_prod, 0)], -1)
        # parameters: every stage l..r holding a consumer block holds them
        w_par = np.stack([self.par_bytes, self.par_own * self.par_grad, self.par_grad * 1.0],
                         axis=1)  # bytes (autocast copies too), trainable bytes, trainable count
        d_par = _upto_next(k, blk, self.par_use, p_par, w_par)
        # inputs: a stage starting after the producer's block receives the value when it holds
        # a consumer block
        d_in = _upto_next(k, blk, self.act_use, p_act, self.act_bytes)
        # outputs: a stage l <= p ending in p .. last-1 sends it on (or returns it), where last
        # is the last consumer block (k for a model output)
        last = p_act.copy()
        v, c = self.act_use
        np.maximum.at(last, v, blk[c])
        last = np.where(self.act_output, k, last)
        j = np.flatnonzero((p_act >= 0) & (last > p_act))
        pj, lj, wj = p_act[j], last[j], self.act_bytes[j]
        d_out = np.zeros((2, k + 1, k + 1))
        top = np.zeros_like(pj)
        for i in range(2):  # the rectangle rows 0..p, columns p..last-1
            for rows, cols, sign in ((top, pj, 1.0), (top, lj, -1.0), (pj + 1, pj, -1.0),
                                     (pj + 1, lj, 1.0)):
                np.add.at(d_out[i], (rows, cols), sign * wj[:, i])
        # a stage may not start or end inside a value that cannot be split by batch rows
        bad = j[~self.act_rows[j]]
        e = np.zeros(k + 2)
        np.add.at(e, p_act[bad] + 1, 1.0)
        np.add.at(e, np.minimum(last[bad], k) + 1, -1.0)
        cut_ok = np.cumsum(e)[:k + 1] == 0
        cut_ok[0] = cut_ok[k] = True

        def total(d: np.ndarray) -> np.ndarray:
            return np.cumsum(np.cumsum(d, axis=-2), axis=-1)[..., :k, :k]

        par = total(d_par)
        # trainable parameters read only inside [l, r]: l <= their first consumer block and
        # r >= their last, the rectangle rows 0..first, columns last..k-1
        pv, pc = self.par_use
        first = np.full(len(self.par_bytes), k, dtype=np.int64)
        final = np.full(len(self.par_bytes), -1, dtype=np.int64)
        np.minimum.at(first, pv, blk[pc])
        np.maximum.at(final, pv, blk[pc])
        used = np.flatnonzero(final >= 0)
        d_in_only = np.zeros((2, k + 1, k + 1))
        for i, w in enumerate(((self.par_own * self.par_grad)[used], self.par_grad[used] * 1.0)):
            np.add.at(d_in_only[i], (np.zeros_like(used), final[used]), w)
            np.add.at(d_in_only[i], (first[used] + 1, final[used]), -w)
        in_only = total(d_in_only)
        shared, shared_n = par[1] - in_only[0], par[2] - in_only[1]
        # batch outputs the model returns: every stage l <= p <= r computing one holds them
        ret = np.flatnonzero((p_act >= 0) & self.act_output & self.act_rows)
        d_ret = np.zeros((2, k + 1, k + 1))
        for i in range(2):  # the rectangle rows 0..p, columns p..k-1
            np.add.at(d_ret[i], (np.zeros_like(p_act[ret]), p_act[ret]), self.act_bytes[ret, i])
            np.add.at(d_ret[i], (p_act[ret] + 1, p_act[ret]), -self.act_bytes[ret, i])
        every = self.act_bytes[np.flatnonzero(self.act_output & self.act_rows)].sum(axis=0)
        return BlockIO(total(d_in), total(d_out), par[0], par[1], cut_ok, shared, total(d_ret),
                       np.asarray(every, dtype=np.float64).reshape(2), np.rint(shared_n))


def _upto_next(k: int, blk: np.ndarray, use: np.ndarray, lo: np.ndarray,
               weight: np.ndarray) -> np.ndarray:
    """Difference arrays (w, k+1, k+1) of X[l, r] += weight[v] for every value v, first block
    l > lo[v] and last block r >= the first consumer block of v at or after l."""
    v, c = use
    b = blk[c]
    keep = b > lo[v]
    key = np.unique(v[keep] * (k + 1) + b[keep])  # each (value, consumer block) once, sorted
    vv, cc = key // (k + 1), key % (k + 1)
    first = np.ones(len(vv), dtype=bool)
    first[1:] = vv[1:] != vv[:-1]
    prev = np.where(first, lo[vv], np.concatenate([[-1], cc[:-1]]))
    d = np.zeros((weight.shape[1], k + 1, k + 1))
    for i in range(weight.shape[1]):  # rows prev+1 .. cc, columns cc .. k-1
        np.add.at(d[i], (prev + 1, cc), weight[vv, i])
        np.add.at(d[i], (cc + 1, cc), -weight[vv, i])
    return d


@dataclass(frozen=True, slots=True)
class StageTables:
    """For one (devices per pipeline, pipeline copies, microbatches): arrays over [l, r, d]
    (over [cell, d] where `stage_tables` was given cells)."""

    h: np.ndarray  # bottleneck time per microbatch (inf: infeasible)
    fwd: np.ndarray  # forward seconds incl. receiving inputs
    bwd: np.ndarray  # backward seconds incl. recomputation and sending gradients back
    allreduce: np.ndarray  # gradient all-reduce seconds per iteration the stage waits for
    memory: np.ndarray  # predicted bytes (of the chosen recompute option)
    memory_min: np.ndarray  # the smaller of the two options' memory (for "needs N GB")
    memory_keep: np.ndarray  # bytes when nothing is recomputed, whatever the limit (inf: invalid)
    recompute: np.ndarray  # fraction of kept activation memory recomputed
    recompute_s: np.ndarray  # the seconds that recomputation adds (inside bwd)
    selective: np.ndarray  # bool: selective recomputation too (`saved.recomputable`)
    selective_s: np.ndarray  # the seconds its rebuilds add (inside bwd, not in recompute_s)
    wgrad: np.ndarray  # the weight-gradient seconds inside bwd (a zero-bubble schedule's W)
    batch: np.ndarray  # (D+1,) rows per replica per microbatch


class BlockSums:
    """What every stage table over one profile reads, computed once: per profile column (a
    per-replica batch size), each field's sum over every run of blocks l..r, and the largest
    working bytes of any block in the run. Why: the planner builds many tables over one
    profile (`search.TableCache`: one per in-flight count, pending count and memory share;
    the boundary refinement several per level), and these sums were most of each table's
    cost. The arrays are read-only: every table shares them."""

    FIELDS = ("fwd", "bwd", "kept", "wgrad", "kept_sel", "selective", "stash", "bonly")

    def __init__(self, prof: BlockProfile) -> None:
        self.prof = prof
        self.k = prof.fwd.shape[0]
        self._pre = prof.prefix_sums(self.FIELDS)
        # selective recomputation is offered only where the profile has both of its fields
        self.selective = "kept_sel" in self._pre and "selective" in self._pre
        for name in ("wgrad", "stash", "bonly"):  # (unknown: none)
            self._pre.setdefault(name, np.zeros_like(self._pre["fwd"]))
        self._got: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}

    def ranges(self, name: str, cols: tuple[int, ...]) -> np.ndarray:
        """[j, l, r] = field `name` summed over blocks l..r at profile column cols[j]. A stage
        starting at the first block has no B-to-W stash and releases nothing after B (its
        inputs need no gradient, so its B does nothing: `stage_tables`)."""
        key = (name, cols)
        if key not in self._got:
            p = self._pre[name][:, list(cols)].T  # (columns, k + 1)
            out = p[:, None, 1:] - p[:, :self.k, None]
            if name in ("stash", "bonly"):
                out[:, 0, :] = 0.0
            self._got[key] = _frozen(out)
        return self._got[key]

    def work_maxes(self, cols: tuple[int, ...]) -> np.ndarray:
        """[j, l, r] = the largest working bytes of blocks l..r at profile column cols[j]."""
        key = ("work", cols)
        if key not in self._got:
            k, w = self.k, self.prof.work[:, list(cols)]
            out = np.zeros((len(cols), k, k))
            for lo in range(k):
                out[:, lo, lo:] = np.maximum.accumulate(w[lo:], axis=0).T
            self._got[key] = _frozen(out)
        return self._got[key]


def _frozen(x: np.ndarray) -> np.ndarray:
    """`x`, read-only (what several tables share)."""
    x.flags.writeable = False
    return x


def batch_per_replica(batch_size: int, copies: int, microbatches: int, d: int) -> int:
    """Rows the busiest replica computes per microbatch."""
    return math.ceil(batch_size / (copies * microbatches * d))


def stage_tables(prof: BlockProfile, io: BlockIO, mem: MemoryModel, *, batch_size: int,
                 devices: int, copies: int, microbatches: int, link_bw: float, allreduce_bw: float,
                 inflight: int | None = None, saved_inputs: int = 0,
                 only: Collection[int] | None = None, overlap: bool = False,
                 world: int | None = None, pending: int = 0, past_b: int = 0,
                 sums: BlockSums | None = None,
                 cells: tuple[Sequence[int], Sequence[int]] | None = None) -> StageTables:
    """`inflight`: microbatches whose activations a stage holds at once (fill-drain: all of
    them; 1F1B: at most the stages from it to the end); `saved_inputs`: microbatches whose stage
    inputs are kept besides (eager schedules keep them for a late backward pass); `only`: the
    replica counts to table (None: 1..devices); the others stay infeasible, and the profile
    needs columns only for theirs; `overlap`: the gradient reduction runs during the last
    microbatch's backward (`reduction_overlaps_backward`), and only what outlasts it counts;
    `world`: the ranks feeding the global batch (default `devices * copies`; the tables may be
    narrower than the pipeline), whose rows of the batch outputs each rank assembles;
    `pending`, `past_b`: the schedule runs each backward as B and W apart, and a microbatch's
    B changes its bytes by the gradients it keeps for W (the profile's `stash`) less the
    activations only B reads, which the runtime releases (`bonly`; not under selective
    recomputation, whose saved tensors carry hooks of their own), counted as `memory_terms`
    says. A stage starting at the first block changes nothing: its inputs need no gradient,
    so its B does nothing and its W is the whole backward. `sums`: `prof`'s (`BlockSums`),
    where the caller builds several tables over one profile. `cells`: (first blocks, last
    blocks): only those stages, each array then (cells, replicas) instead of (l, r, replicas),
    for a caller that reads a few stages of one key (a memory share tried for one plan: `search.
    TableCache.stage_cost`); elementwise the same arithmetic, so the same values.

    Recomputation is a fraction f of a stage's kept activations dropped in forward and rebuilt
    before backward (Merak's stage-aware recomputation, by memory rather than by layer): the
    smallest f that fits, so a stage keeps all it can afford. f costs f * forward seconds more;
    memory = static + inflight * (inputs + outputs + (1 - f) * kept) + f * kept + working +
    the batch outputs held to be returned, or, if larger, what the stage holds when the call
    returns (`memory.at_return_memory`; recomputation frees none of it).

    Selective recomputation (`mem.selective`, `saved.recomputable`) replaces `kept` by the
    profile's `kept_sel` and adds its rebuild seconds to the backward, with a prefix fraction on
    top if that still does not fit; it is chosen where keeping everything does not fit and it
    costs fewer seconds than the prefix alone (under checkpointing "selective": everywhere)."""
    k = io.params.shape[0]
    sums = sums if sums is not None else BlockSums(prof)
    if sums.prof is not prof:
        raise ValueError("stage_tables: `sums` is another profile's")
    # what the sums are read at: [., l, r] every run of blocks, or [., i] the cells' (read
    # from the same arrays `sums` keeps, so the same values)
    sel: tuple[Any, ...] = (slice(None),)
    if cells is None:
        where: tuple[int, ...] = (k, k)
        valid = np.triu(np.ones((k, k), dtype=bool)) & io.cut_ok[:k, None] & io.cut_ok[None, 1:]
    else:
        first, last = (np.asarray(x, dtype=np.int64) for x in cells)
        where, sel = (len(first),), (slice(None), first, last)
        valid = (first <= last) & io.cut_ok[first] & io.cut_ok[last + 1]
        io = io.pick(first, last)

    def rng(name: str, cols: tuple[int, ...]) -> np.ndarray:
        return sums.ranges(name, cols)[sel]

    shape = (*where, devices + 1)
    ones = (1,) * len(where)  # (a column's scalars broadcast over the cells)
    out = {n: np.full(shape, math.inf)
           for n in ("h", "fwd", "bwd", "allreduce", "memory", "memory_min", "memory_keep")}
    recompute = np.zeros(shape)
    recompute_s = np.zeros(shape)
    wgrad = np.zeros(shape)
    batch = np.zeros(devices + 1, dtype=np.int64)
    n_in = microbatches if inflight is None else inflight
    local = local_rows(batch_size, 1, world) if world is not None else \
        local_rows(batch_size, copies, devices)
    sel_ok = mem.selective and sums.selective
    selective = np.zeros(shape, dtype=bool)
    selective_s = np.zeros(shape)
    f_min = 1.0 if mem.checkpointing == "on" else 0.0
    f_max = 0.0 if mem.checkpointing in ("off", "selective") else 1.0
    only_sel = mem.checkpointing == "selective"  # (every stage selective, nothing else)
    for d in range(1, devices + 1):
        batch[d] = batch_per_replica(batch_size, copies, microbatches, d)
    wanted = [d for d in range(1, devices + 1)
              if batch[d] >= 1 and (only is None or d in only)]
    # The replica counts' columns a few at a time, each array (columns, l, r): one numpy call
    # per term for several columns where the tables are small (the search's, where a call's
    # overhead is most of its cost), one at a time where they are large (the temporaries then
    # stay in the cache: 8 columns of 128 x 128 blocks at once took longer than one by one).
    per = max(1, _CELLS // math.prod(where))
    for at in range(0, len(wanted), per):
        ds = wanted[at:at + per]
        cols = tuple(prof.column(int(batch[d])) for d in ds)
        fwd, bwd, kept, stash, released = (rng(n, cols)
                                           for n in ("fwd", "bwd", "kept", "stash", "bonly"))
        work = sums.work_maxes(cols)[sel]
        b = batch[ds].reshape(-1, *ones)
        inb = io.inputs[0] + io.inputs[1] * b
        outb = io.outputs[0] + io.outputs[1] * b
        comm = (inb + outb) / link_bw
        ranks = np.asarray(ds, dtype=np.int64).reshape(-1, *ones) * copies
        reduce_s = 2.0 * io.grad_params * (ranks - 1) / ranks / allreduce_bw
        static = mem.static(io.params, io.grad_params, ranks, mem.zero_stage)
        bucket = bucket_memory(io.grad_params, io.shared_grad, io.shared_count(), ranks > 1,
                               mem.bucket_bytes)
        ret = returned_memory(*io.returned_bytes(b, local), microbatches, n_in)
        full, saved_per_f = memory_terms(static + bucket, work, inb, outb, kept,
                                         in_flight=n_in, saved_inputs=saved_inputs,
                                         microbatches=microbatches, held_outputs=ret.held,
                                         stash=stash, released=released, pending=pending,
                                         past_b=past_b)
        at_return = at_return_memory(static + bucket, inb, outb, kept, ret, in_flight=n_in,
                                     saved_inputs=saved_inputs, microbatches=microbatches)
        f = np.maximum(fraction_to_fit(full, saved_per_f, mem.limit), f_min)
        ok = valid & (f <= f_max) & (at_return <= mem.limit)
        f = np.where(ok, f, 0.0)
        memory = np.maximum(with_recompute(full, saved_per_f, f), at_return)
        extra = f * fwd  # recomputation's seconds
        if sel_ok:  # selective recomputation, with a prefix recomputed on top where needed
            full_s, per_s = memory_terms(static + bucket, work, inb, outb,
                                         rng("kept_sel", cols), in_flight=n_in,
                                         saved_inputs=saved_inputs, microbatches=microbatches,
                                         held_outputs=ret.held, stash=stash, pending=pending,
                                         past_b=past_b)
            f_s = np.maximum(fraction_to_fit(full_s, per_s, mem.limit), f_min)
            ok_s = valid & (f_s <= f_max) & (at_return <= mem.limit)
            f_s = np.where(ok_s, f_s, 0.0)
            extra_s = rng("selective", cols) + f_s * fwd
            use = ok_s & (~ok | ((f > 0) & (extra_s < extra)))  # (only where memory asks)
            if only_sel:
                ok, use = ok_s, ok_s
            selective[..., ds] = _last(use)
            selective_s[..., ds] = _last(np.where(use, rng("selective", cols), 0.0))
            ok = ok | use
            f = np.where(use, f_s, f)
            extra = np.where(use, extra_s, extra)
            memory = np.where(use, np.maximum(with_recompute(full_s, per_s, f_s), at_return), memory)
        fw = fwd + comm / 2
        g = bwd + comm / 2 + extra
        ar = exposed_reduction(reduce_s, g, io.grad_params, mem.bucket_bytes, overlap)
        if mem.zero_stage:  # the owners' new parameters go to the other replicas after the step
            ar = ar + 0.5 * reduce_s  # an all-gather: half an all-reduce
        out["fwd"][..., ds] = _last(np.where(ok, fw, math.inf))
        out["bwd"][..., ds] = _last(np.where(ok, g, math.inf))
        out["allreduce"][..., ds] = _last(np.where(ok, ar, math.inf))
        out["h"][..., ds] = _last(np.where(ok, fw + g + ar / microbatches, math.inf))
        out["memory"][..., ds] = _last(np.where(ok, memory, math.inf))
        smallest = np.maximum(with_recompute(full, saved_per_f, f_max), at_return)
        if sel_ok:
            smallest = np.minimum(smallest, np.maximum(with_recompute(full_s, per_s, f_max), at_return))
        out["memory_min"][..., ds] = _last(np.where(valid, smallest, math.inf))
        out["memory_keep"][..., ds] = _last(np.where(valid, np.maximum(full, at_return), math.inf))
        recompute[..., ds] = _last(f)
        recompute_s[..., ds] = _last(f * fwd)
        wgrad[..., ds] = _last(np.where(ok, rng("wgrad", cols), 0.0))
    return StageTables(recompute=recompute, recompute_s=recompute_s, selective=selective,
                       selective_s=selective_s,
                       wgrad=wgrad, batch=batch, **out)


_CELLS = 1 << 14  # (l, r, replicas) cells `stage_tables` computes in one go, about


def _last(x: np.ndarray) -> np.ndarray:
    """(columns, l, r) as (l, r, columns), the tables' layout (or (columns, cells) as (cells,
    columns))."""
    return np.moveaxis(x, 0, -1)


def reduction_overlaps_backward(schedule: str) -> bool:
    """THE switch for when a stage's gradient reduction runs (`rannc.pipeline.grads`): bucket by
    bucket during the last microbatch's backward, under fill-drain (whose backward runs in
    backward()) and under the eager schedules alike (whose backward runs inside forward(): the
    buckets start there for a unit loss gradient, and backward() scales the sums). A training
    step under no_sync() reduces nothing; the step after it reduces after its whole line (its
    pending local sums must not be scaled), which the plan does not cost."""
    get_spec(schedule)  # (an unknown name raises)
    return True


def exposed_reduction(reduce_s: Any, last_backward_s: Any, grad_bytes: Any, bucket_bytes: float,
                      overlapped: bool) -> Any:
    """The seconds of a stage's gradient reduction (`reduce_s` in all) that its iteration waits
    for after the stage's last backward. Overlapped, the buckets are reduced while the last
    microbatch's backward (`last_backward_s`) still runs, so only the part that outlasts it
    shows, and never less than the last bucket (the first layers' gradients, final only when
    backward ends); otherwise all of it. Arrays or floats alike."""
    if not overlapped:
        return reduce_s
    grads = np.asarray(grad_bytes, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        last = np.where(grads > 0, reduce_s * np.minimum(1.0, bucket_bytes / grads), 0.0)
    return np.maximum(reduce_s - last_backward_s, last)


def iteration_estimate(fwd: Sequence[float], bwd: Sequence[float], allreduce: Sequence[float],
                       microbatches: int, eager: bool, chunks: int = 1,
                       lanes: Sequence[int] = ()) -> float:
    """A closed form of the simulator's iteration time, to rank the DP's candidates before the
    few best are simulated: each stage's last backward ends at its own time and its gradient
    reduction (`allreduce`: the part it waits for) starts there, so a late stage's reduction
    is hidden by the earlier stages' drain, as in the simulator.

    Fill-drain: the forwards end at F = sum(fwd) + (m - 1) max(fwd) (the flow-shop makespan of m
    identical microbatches), then every stage starts backward from the barrier, and stage s's
    last backward ends at F + sum(bwd[s:]) + (m - 1) max(bwd[s:]). Eager (1F1B order): the
    first stage ends last, at sum(f + b) + (m - 1) max(f + b); stage s ends the backwards of the
    stages before it earlier. Several stages per lane (`chunks` v > 1, stage s on lane
    `lanes[s]`, given with them): each lane as one stage doing its v stages' work, the
    bubble v times smaller (Megatron's (p - 1) / v): (sum - max) / v + m max over the lanes'
    cycles (for ZB-V an upper bound: its W passes fill most of that bubble too)."""
    S, m = len(fwd), microbatches
    out = 0.0
    if chunks > 1:
        P = S // chunks
        lane = list(lanes)
        assert len(lane) == S, "several stages per lane: give each stage's lane"

        def per_lane(x: Sequence[float]) -> list[float]:
            return [sum(x[s] for s in range(S) if lane[s] == d) for d in range(P)]

        lane_f, lane_b = per_lane(fwd), per_lane(bwd)
        lane_ar = per_lane(allreduce)  # one reducer per rank, all its stages
        cycle = [f + b for f, b in zip(lane_f, lane_b, strict=True)]
        end, drained = (sum(cycle) - max(cycle)) / chunks + m * max(cycle), 0.0
        for d in range(P):
            out = max(out, end - drained + lane_ar[d])
            drained += lane_b[d] / chunks
        return out
    if eager:
        cycle = [f + b for f, b in zip(fwd, bwd, strict=True)]
        end, drained = sum(cycle) + (m - 1) * max(cycle), 0.0
        for s in range(S):
            out = max(out, end - drained + allreduce[s])
            drained += bwd[s]
        return out
    forwards = sum(fwd) + (m - 1) * max(fwd)
    tail = slowest = 0.0
    for s in reversed(range(S)):
        tail += bwd[s]
        slowest = max(slowest, bwd[s])
        out = max(out, forwards + tail + (m - 1) * slowest + allreduce[s])
    return out
