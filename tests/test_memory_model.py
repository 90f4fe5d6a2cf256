"""THE memory model (rannc.stage_dp.memory): the stage tables (numpy arrays over every block
range), the mixed-cluster DP (scalars, affine in a replica's rows) and the placement on mixed
devices all compute a stage's bytes through it, and agree on the same stage; the gradient
bucket it counts, and the part of the gradient reduction the cost model counts; the terms
beyond parameters and activations: the model's batch outputs the runtime keeps until a call
returns, and the per-rank overhead."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import numpy as np
import pytest
from model_zoo import make_case

import rannc
from rannc.atomic.components import atomic_components
from rannc.graph.capture import capture
from rannc.profile.estimate import BlockProfile, GraphCosts
from rannc.stage_dp.hetero import HeteroDevices, hetero_stages
from rannc.stage_dp.memory import (
    MemoryModel,
    Returned,
    bucket_memory,
    local_rows,
    posted_ahead,
    returned_memory,
    rows_scaled,
    rows_that_fit,
    stage_peak,
    static_memory,
)
from rannc.stage_dp.tables import (
    BlockIO,
    exposed_reduction,
    reduction_overlaps_backward,
    stage_tables,
)

pytestmark = pytest.mark.layer("pure")

logging.getLogger("transformers").setLevel(logging.ERROR)

SPEC = rannc.DeviceSpec("test", 16e9, 10e12, 1e12)
BATCH, M = 16, 2  # global rows, microbatches


@pytest.fixture(scope="module")
def gpt2() -> tuple[BlockIO, object, int]:
    case = make_case("gpt2", batch=BATCH)
    g = capture(case.model, case.args, case.kwargs).graph
    atomic = atomic_components(g)
    n = len(atomic.components)
    block_of = [c * 6 // n for c in range(n)]  # 6 blocks in component order
    io = BlockIO.of(g, atomic, block_of)
    return io, GraphCosts.of(g, atomic), len(set(block_of))


@pytest.mark.parametrize("checkpointing", ["off", "on"])
@pytest.mark.parametrize("in_flight,saved,pending,past_b",
                         [(1, 0, 0, 0), (2, 0, 0, 0), (2, 2, 0, 0), (4, 1, 0, 0), (2, 2, 2, 0),
                          (4, 4, 3, 0), (4, 4, 3, 2)])
def test_tables_hetero_dp_and_the_model_agree_on_a_stage(
        gpt2: tuple[BlockIO, GraphCosts, int], checkpointing: str, in_flight: int, saved: int,
        pending: int, past_b: int) -> None:
    io, costs, k = gpt2
    d = 2  # replicas of the stage, each computing BATCH / (M * d) rows of a microbatch
    rows = BATCH // (M * d)
    prof = costs.block_profile(SPEC, [c * k // len(costs.comp_params)
                                      for c in range(len(costs.comp_params))], [rows])
    mem = MemoryModel(opt_param_factor=2.0, limit=1e30, checkpointing=checkpointing)
    tab = stage_tables(prof, io, mem, batch_size=BATCH, devices=d, copies=1, microbatches=M,
                       link_bw=1e10, allreduce_bw=1e10, inflight=in_flight, saved_inputs=saved,
                       only={d}, pending=pending, past_b=past_b)
    static = static_memory(io.params, io.grad_params, 2.0, d, 0)
    f = 1.0 if checkpointing == "on" else 0.0
    # one stage over every block, as the mixed-cluster DP sees it on d equal devices
    hs = hetero_stages(prof, io, static_memory(io.params, io.grad_params, 2.0, 1, 0),
                       HeteroDevices(speed=[1.0] * d, memory=[1e30] * d), rows=BATCH / M,
                       batch_of=[0] + [BATCH // (M * j) for j in range(1, d + 1)],
                       in_flight=in_flight, saved=saved, link_bw=1e10, allreduce_bw=1e10,
                       microbatches=M, checkpointing=checkpointing, stages=1, replicas=[d],
                       pending=pending)
    assert hs is not None and len(hs) == 1 and hs[0].rows == (rows, rows)
    # GPT-2 returns its logits: the stage computing them holds them until the call returns,
    # and every rank assembles its own rows of them then (`returned_memory`)
    per_mb, mine = io.returned_bytes(rows, local_rows(BATCH, 1, d))
    assert per_mb[k - 1, k - 1] > 0 and per_mb[0, 0] == 0

    def returned(lo: int, hi: int) -> Returned:
        return returned_memory(float(per_mb[lo, hi]), mine, M, in_flight)

    for lo, hi in [(0, k - 1), (0, 2), (3, k - 1), (2, 2)]:
        kept = float(prof.kept[lo:hi + 1, 0].sum())
        # (what a split backward's B changes of a microbatch's bytes: the gradients it keeps
        # for W less the activations only it reads; nothing where the stage is the first)
        stash, released = (float(prof.stash[lo:hi + 1, 0].sum()), float(prof.bonly[lo:hi + 1, 0].sum())) \
            if lo > 0 else (0.0, 0.0)
        assert lo == 0 or stash < released  # (GPT-2's layers: attention, GELU inputs, masks)
        work = float(prof.work[lo:hi + 1, 0].max())
        inb = float(io.inputs[0][lo, hi] + io.inputs[1][lo, hi] * rows)
        outb = float(io.outputs[0][lo, hi] + io.outputs[1][lo, hi] * rows)
        want = float(stage_peak(float(static[lo, hi]), work, inb, outb, kept,
                                returned(lo, hi), in_flight=in_flight, saved_inputs=saved,
                                microbatches=M, recompute=f, stash=stash, released=released,
                                pending=pending, past_b=past_b))
        assert float(tab.recompute[lo, hi, d]) == f
        assert float(tab.memory[lo, hi, d]) == pytest.approx(want, rel=1e-12)
        # the smallest memory (all it may recompute recomputed) is the chosen one here
        assert float(tab.memory_min[lo, hi, d]) == pytest.approx(want, rel=1e-12)
    # the whole model: the mixed-cluster DP's scalar (affine in rows, without ZeRO: all state)
    whole = stage_peak(float(static_memory(io.params, io.grad_params, 2.0, 1, 0)[0, k - 1]),
                       float(prof.work[:, 0].max()),
                       float(io.inputs[0][0, k - 1] + io.inputs[1][0, k - 1] * rows),
                       float(io.outputs[0][0, k - 1] + io.outputs[1][0, k - 1] * rows),
                       float(prof.kept[:, 0].sum()), returned(0, k - 1), in_flight=in_flight,
                       saved_inputs=saved, microbatches=M, recompute=f, pending=pending)
    assert hs[0].memory_bytes == pytest.approx(whole, rel=1e-9)
    assert hs[0].recompute == (checkpointing == "on")


def test_placement_scales_what_is_not_static_with_the_rows() -> None:
    assert rows_scaled(10.0, 4.0, 3.0, 3.0) == 10.0  # the rows it was planned for: unchanged
    assert rows_scaled(10.0, 4.0, 3.0, 6.0) == 16.0
    assert rows_that_fit(10.0, 4.0, 3.0, 16.0) == pytest.approx(6.0)
    assert rows_that_fit(4.0, 4.0, 3.0, 16.0) == float("inf")  # nothing scales: any rows fit


def test_a_stage_captured_under_autocast_holds_its_weights_half_copies_once() -> None:
    """Autocast keeps a bfloat16 copy of every weight a product reads (where its input needs
    a gradient), one per call, which the microbatches share: a stage's `params` count them
    beside the weights, its gradients (and so the optimizer state and the reduction) do not."""
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                          nn.Linear(256, 8))
    x = torch.randn(32, 64)
    weights = sum(p.numel() * 4 for p in model.parameters())
    for half in (False, True):
        with torch.autocast("cpu", torch.bfloat16, enabled=half):
            g = capture(model, (x,), {}).graph
        atomic = atomic_components(g)
        whole = BlockIO.of(g, atomic, [0] * len(atomic.components))
        # (the first product's input, the model input, needs no gradient: no copy kept)
        assert whole.params[0, 0] == weights + ((256 * 256 + 8 * 256) * 2 if half else 0)
        assert whole.grad_params[0, 0] == weights


def test_static_memory_spreads_only_the_optimizer_state_under_zero_1() -> None:
    params, grads = np.array([100.0]), np.array([80.0])
    assert static_memory(params, grads, 2.0, 4, 0)[0] == 100 + 80 * 3
    assert static_memory(params, grads, 2.0, 4, 1)[0] == 100 + 80 * (1 + 2 / 4)


def test_a_stage_whose_gradients_are_reduced_holds_one_bucket(
        gpt2: tuple[BlockIO, GraphCosts, int]) -> None:
    """One gradient bucket (Config.bucket_mb) beyond the gradients where a buffer is needed: on
    a stage with replicas, never more than the stage's gradients; without replicas only the
    tied parameters are reduced (GPT-2's token embedding is its LM head), and that one
    parameter is reduced in its own `.grad`, so no buffer (`rannc.pipeline.grads`)."""
    io, costs, k = gpt2
    n = len(costs.comp_params)
    prof = costs.block_profile(SPEC, [c * k // n for c in range(n)], [BATCH // M, BATCH // (2 * M)])
    bucket = 1000.0

    def memory(d: int, bucket_bytes: float) -> np.ndarray:
        mem = MemoryModel(opt_param_factor=2.0, limit=1e30, checkpointing="off",
                          bucket_bytes=bucket_bytes)
        tab = stage_tables(prof, io, mem, batch_size=BATCH, devices=2, copies=1, microbatches=M,
                           link_bw=1e10, allreduce_bw=1e10, only={d})
        return tab.memory[:, :, d]

    tied = io.shared_grad > 0
    assert tied[0, 0] and tied[k - 1, k - 1] and not tied[0, k - 1]  # embedding and head apart
    assert io.shared_params is not None and np.all(io.shared_params[tied] == 1)  # one: wte
    with np.errstate(invalid="ignore"):  # inf - inf where a range is no stage
        extra_1, extra_2 = memory(1, bucket) - memory(1, 0.0), memory(2, bucket) - memory(2, 0.0)
    upper = np.triu(np.ones((k, k), dtype=bool))
    want = np.minimum(io.grad_params, bucket)
    assert np.allclose(extra_2[upper], want[upper], rtol=1e-12, atol=1e-6)  # replicas: always
    assert np.all(extra_1[upper] == 0.0)  # one replica: the one tied weight needs no buffer
    assert bucket_memory(10.0, 10.0, 1, True, 1000.0) == 10.0  # never more than the gradients
    assert bucket_memory(10.0, 4.0, 2, False, 3.0) == 3.0  # two tied: their bucket, buffered
    assert bucket_memory(10.0, 4.0, 1, False, 1000.0) == 0.0  # one tied: reduced in place
    # without the count (a BlockIO built by hand), several are assumed: the safe side
    no_count = dataclasses.replace(io, shared_params=None)
    assert np.array_equal(no_count.shared_count() > 1, tied)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_reduction_overlaps_the_last_backward(
        gpt2: tuple[BlockIO, GraphCosts, int], overlap: bool) -> None:
    """The buckets are reduced while the last microbatch's backward runs, so a stage waits only
    for what outlasts it, and at least for the last bucket: under fill-drain and under the
    eager schedules alike (their buckets start inside forward())."""
    io, costs, k = gpt2
    n = len(costs.comp_params)
    prof = costs.block_profile(SPEC, [c * k // n for c in range(n)], [BATCH // (2 * M)])
    bucket, bw = 4096.0, 1e6  # a slow link: the reduction outlasts the backward
    mem = MemoryModel(opt_param_factor=2.0, limit=1e30, checkpointing="off", bucket_bytes=bucket)
    tab = stage_tables(prof, io, mem, batch_size=BATCH, devices=2, copies=1, microbatches=M,
                       link_bw=1e10, allreduce_bw=bw, only={2}, overlap=overlap)
    reduce_s = 2.0 * io.grad_params * (2 - 1) / 2 / bw
    upper = np.triu(np.ones((k, k), dtype=bool))
    got, g = tab.allreduce[:, :, 2][upper], tab.bwd[:, :, 2][upper]
    if not overlap:
        assert np.allclose(got, reduce_s[upper])
        return
    last = reduce_s[upper] * np.minimum(1.0, bucket / io.grad_params[upper])
    assert np.allclose(got, np.maximum(reduce_s[upper] - g, last))
    assert np.all(got < reduce_s[upper]) and np.all(got >= last)
    assert all(reduction_overlaps_backward(s) for s in ("gpipe", "1f1b", "scp", "zero_bubble"))
    assert exposed_reduction(5.0, 2.0, 100.0, 10.0, True) == 3.0
    assert exposed_reduction(5.0, 20.0, 100.0, 10.0, True) == 0.5  # the last bucket stays
    assert exposed_reduction(5.0, 2.0, 100.0, 10.0, False) == 5.0


# -- the batch outputs held until a call returns, and the per-rank overhead ------------------

MiB = 2.0**20
LOGITS = 16 * MiB  # per row of a microbatch: the last block's batch output


def two_blocks(returned: bool = True) -> tuple[BlockProfile, BlockIO]:
    """Block 0 (a body) and block 1 (a head returning LOGITS bytes per row); every byte count
    per row (c1), none constant."""
    prof = BlockProfile((1,), fwd=np.ones((2, 1)), bwd=np.ones((2, 1)),
                        kept=np.array([[10 * MiB], [5 * MiB]]), work=np.array([[1 * MiB], [32 * MiB]]))
    z = np.zeros((2, 2))
    outputs = np.stack([z, np.array([[1 * MiB, LOGITS], [0, LOGITS]])])
    inputs = np.stack([z, np.array([[0, 0], [0, 1 * MiB]])])
    ret = np.stack([z, np.array([[0, LOGITS], [0, LOGITS]])]) if returned else None
    io = BlockIO(inputs=inputs, outputs=outputs, params=np.full((2, 2), MiB),
                 grad_params=np.full((2, 2), MiB), cut_ok=np.ones(3, dtype=bool),
                 shared_grad=z, returned=ret,
                 returned_all=np.array([0.0, LOGITS]) if returned else None)
    return prof, io


def memory(io: BlockIO, prof: BlockProfile, *, inflight: int, m: int = 4, devices: int = 2,
           overhead: float = 0.0, batch_size: int | None = None) -> np.ndarray:
    """Each stage's memory on `devices` pipelines of one device, one row per microbatch."""
    mem = MemoryModel(opt_param_factor=2.0, limit=1e12, checkpointing="off", overhead=overhead)
    bs = devices * m if batch_size is None else batch_size
    tab = stage_tables(prof, io, mem, batch_size=bs, devices=1, copies=devices,
                       microbatches=m, link_bw=1e9, allreduce_bw=1e9, inflight=inflight)
    return tab.memory[:, :, 1]


def test_the_head_stage_holds_every_microbatchs_outputs_until_the_call_returns() -> None:
    """1F1B's last stage runs one microbatch at a time but keeps the logits of all 4 (sent to
    their ranks, released when the call returns): 3 more than its in-flight count."""
    prof, io = two_blocks()
    # one row per rank, so that the outputs each rank assembles at the end are small
    with_ret = memory(io, prof, inflight=1, batch_size=2)
    without = memory(two_blocks(returned=False)[1], prof, inflight=1, batch_size=2)
    assert with_ret[1, 1] - without[1, 1] == pytest.approx(3 * LOGITS)
    # the body computes none of them: nothing held while it runs
    assert returned_memory(*io.returned_bytes(rows=1, local=1), microbatches=4,
                           in_flight=1).held[0, 0] == 0


def test_every_rank_assembles_its_own_rows_of_the_outputs() -> None:
    """When a call returns, each rank receives its rows of the logits and concatenates them:
    twice its rows' bytes, beside the static memory (the activations are freed by then)."""
    prof, io = two_blocks()
    rows = local_rows(batch_size=8, copies=2, devices=1)
    assert rows == 4
    ret = returned_memory(*io.returned_bytes(rows=1, local=rows), microbatches=4, in_flight=1)
    assert ret.at_return[0, 0] == 2 * rows * LOGITS  # received pieces, then their concatenation
    assert ret.at_return[1, 1] == 4 * LOGITS + rows * LOGITS  # its own pieces, then one copy
    # a body stage with little else to hold peaks when the outputs arrive
    static = 4 * MiB  # params, grads, Adam state
    assert memory(io, prof, inflight=1)[0, 0] == pytest.approx(static + 2 * rows * LOGITS)


def test_fill_drain_holds_the_activations_when_the_outputs_arrive() -> None:
    """Under fill-drain (every microbatch in flight) forward() returns with every
    microbatch's activations alive, and the assembled outputs come on top."""
    prof, io = two_blocks()
    m = 4
    got = memory(io, prof, inflight=m, m=m)[0, 0]
    static, held = 4 * MiB, m * (1 * MiB + 10 * MiB)  # outputs and kept, per microbatch
    assert got == pytest.approx(static + held + 2 * local_rows(8, 2, 1) * LOGITS)


def test_the_next_microbatchs_inputs_count_where_not_every_microbatch_is_in_flight() -> None:
    """The runtime posts a receive while the action before it runs (`Transport.expect`): under
    1F1B the next microbatch's inputs arrive while the oldest one's backward runs, one stage
    input beyond the in-flight ones; under fill-drain (all in flight) or with every input kept
    for a late pass they are counted already."""
    assert posted_ahead(2, 0, 4) == 1
    assert posted_ahead(4, 0, 4) == 0 and posted_ahead(2, 4, 4) == 0
    kw: dict[str, Any] = dict(saved_inputs=0, microbatches=4)
    one_f_one_b = stage_peak(0.0, 0.0, 3.0, 5.0, 7.0, Returned(0.0, 0.0, 0.0), in_flight=2, **kw)
    assert one_f_one_b == 3 * 3.0 + 2 * 5.0 + 2 * 7.0  # three microbatches' inputs, two alive
    fill_drain = stage_peak(0.0, 0.0, 3.0, 5.0, 7.0, Returned(0.0, 0.0, 0.0), in_flight=4, **kw)
    assert fill_drain == 4 * (3.0 + 5.0 + 7.0)


def test_the_overhead_is_on_every_stage() -> None:
    prof, io = two_blocks()
    base = memory(io, prof, inflight=1)
    more = memory(io, prof, inflight=1, overhead=20 * MiB)
    upper = np.triu_indices(2)  # the stages l <= r (the others are infeasible: inf)
    assert np.allclose(more[upper] - base[upper], 20 * MiB)


def test_a_stage_whose_outputs_do_not_fit_at_return_is_infeasible() -> None:
    """Recomputation cannot free what the call returns: the head fits 120 MiB while it runs
    (113 MiB) but not when the call returns its 4 rows' logits beside all 4 microbatches' (132)."""

    def head(io: BlockIO) -> float:
        mem = MemoryModel(opt_param_factor=2.0, limit=120 * MiB, checkpointing="auto")
        tab = stage_tables(prof, io, mem, batch_size=8, devices=1, copies=2, microbatches=4,
                           link_bw=1e9, allreduce_bw=1e9, inflight=2)
        return float(tab.memory[1, 1, 1])

    prof, io = two_blocks()
    assert math.isinf(head(io))
    # (and a third microbatch's 1 MiB input, posted ahead: `posted_ahead`)
    assert head(two_blocks(returned=False)[1]) == pytest.approx(
        4 * MiB + 2 * (17 + 5) * MiB + 32 * MiB + 1 * MiB)


def test_an_eager_schedule_returns_with_its_activations_freed() -> None:
    """1F1B's first stage may hold every microbatch at once (M <= stages), but its backward ran
    inside the call: when the outputs arrive its activations are gone. It keeps its stage
    inputs for the late pass (saved_inputs = M), which is how the tables tell it from
    fill-drain."""
    prof, io = two_blocks()
    mem = MemoryModel(opt_param_factor=2.0, limit=1e12, checkpointing="off")
    eager = stage_tables(prof, io, mem, batch_size=8, devices=1, copies=2, microbatches=4,
                         link_bw=1e9, allreduce_bw=1e9, inflight=4, saved_inputs=4)
    static, rows = 4 * MiB, local_rows(8, 2, 1)
    running = static + 4 * (1 + 10) * MiB + 1 * MiB  # outputs, kept and work of 4 microbatches
    assert eager.memory[0, 0, 1] == pytest.approx(max(running, static + 2 * rows * LOGITS))
    fill_drain = memory(io, prof, inflight=4, m=4)[0, 0]
    assert fill_drain == pytest.approx(static + 4 * (1 + 10) * MiB + 2 * rows * LOGITS)


@pytest.mark.parametrize("name,S,M", [("zero_bubble", 4, 8), ("zero_bubble", 4, 3),
                                      ("zero_bubble_v", 8, 8)])
# per kept byte: B's gradients for W, and the activations it releases (B frees more, or less)
@pytest.mark.parametrize("stash,released", [(0.4, 1.0), (0.5, 0.2)])
def test_a_split_backward_is_counted_at_every_moment_of_its_line(name: str, S: int, M: int,
                                                                  stash: float, released: float) -> None:
    """Walking each stage's line action by action: a microbatch holds its kept activations
    from F to B (a fraction f of them dropped, except between its R and B), kept + stash at
    the end of its B, then kept + stash - released until W. The model is never below that,
    and on ZB-H1 (M >= S) equal to its peak with nothing or everything recomputed."""
    from rannc.schedule.actions import Op, chain, in_flight, past_b, pending_w
    from rannc.schedule.spec import make_schedule
    from rannc.stage_dp.memory import memory_terms

    kept = 1.0
    for f in (0.0, 0.5, 1.0):
        line = make_schedule(name, M, chain(S), [f > 0] * S)
        peaks = [n for n, _ in in_flight(line)]
        for s, (pend, past) in enumerate(zip(pending_w(line), past_b(line), strict=True)):
            before, rebuilt, after, most = 0, 0, 0, 0.0
            for a in line.actions[line.lane_of(s)]:
                if a.stage != s:
                    continue
                now = (before - rebuilt) * (1 - f) * kept + rebuilt * kept \
                    + after * (kept + stash - released)
                if a.op is Op.F:
                    before += 1
                elif a.op is Op.R:
                    rebuilt += 1
                elif a.op is Op.B:
                    most = max(most, now + stash)  # (its B ends holding the stash, nothing released)
                    before -= 1
                    rebuilt -= 1 if f > 0 else 0
                    after += 1
                elif a.op is Op.W:
                    after -= 1
                most = max(most, (before - rebuilt) * (1 - f) * kept + rebuilt * kept
                           + after * (kept + stash - released))
            full, per = memory_terms(0.0, 0.0, 0.0, 0.0, kept, in_flight=peaks[s],
                                     saved_inputs=0, microbatches=M, stash=stash,
                                     released=released, pending=pend, past_b=past)
            model = full - f * per
            assert model >= most - 1e-9, (s, f)
            if name == "zero_bubble" and M >= S and f in (0.0, 1.0):
                assert model == pytest.approx(most), (s, f)


def _binding_limit(gpt2: tuple[BlockIO, GraphCosts, int], checkpointing: str, selective: bool,
                   D: int) -> tuple[BlockProfile, MemoryModel, dict[str, Any]]:
    """GPT-2's 6-block profile for replica counts 1..D, a memory model whose limit lies between
    what its ranges need recomputing all and keeping all (some recompute, some do not fit),
    and `stage_tables`' other arguments: every branch of the tables."""
    io, costs, k = gpt2
    n = len(costs.comp_params)
    prof = costs.block_profile(SPEC, [c * k // n for c in range(n)],
                               sorted({-(-BATCH // (4 * d)) for d in range(1, D + 1)}))
    free = MemoryModel(opt_param_factor=2.0, limit=1e30, checkpointing=checkpointing,
                       selective=selective)
    kw: dict[str, Any] = dict(batch_size=BATCH, devices=D, copies=1, microbatches=4,
                              link_bw=1e10, allreduce_bw=1e9, inflight=4, saved_inputs=1,
                              pending=2, past_b=1, overlap=True)
    top = stage_tables(prof, io, dataclasses.replace(free, checkpointing="auto"), **kw)
    upper = np.triu(np.ones((k, k), dtype=bool))
    between = (top.memory_min[:, :, 1] + top.memory_keep[:, :, 1])[upper] / 2
    return prof, dataclasses.replace(free, limit=float(np.median(between))), kw


@pytest.mark.parametrize("checkpointing,selective", [("auto", False), ("auto", True), ("on", False)])
def test_tables_computed_for_several_replica_counts_at_once_match_each_alone(
        gpt2: tuple[BlockIO, GraphCosts, int], checkpointing: str, selective: bool) -> None:
    """`stage_tables` computes the replica counts' columns several at a time; each column
    is exactly (bitwise) what it is when tabled alone, and the tables built over one shared
    `BlockSums` equal those built from the profile afresh (the search's TableCache shares
    them across tables). A memory limit that makes some ranges recompute and others not fit
    exercises every branch."""
    from rannc.stage_dp.tables import BlockSums

    io, costs, k = gpt2
    D = 9  # more replica counts than one batch of columns
    prof, mem, kw = _binding_limit(gpt2, checkpointing, selective, D)
    upper = np.triu(np.ones((k, k), dtype=bool))
    sums = BlockSums(prof)
    together = stage_tables(prof, io, mem, sums=sums, **kw)
    again = stage_tables(prof, io, mem, sums=sums, **kw)
    ranges = together.h[:, :, 1:][upper]  # (ranges, replica counts 1..D)
    assert np.isfinite(ranges).any() and np.isinf(ranges).any()  # some do not fit
    assert (together.recompute > 0).any() and (together.selective.any() or not selective)
    for d in range(1, D + 1):
        alone = stage_tables(prof, io, mem, only={d}, **kw)
        for name in ("h", "fwd", "bwd", "allreduce", "memory", "memory_min", "memory_keep",
                     "recompute", "recompute_s", "selective", "selective_s", "wgrad"):
            assert np.array_equal(getattr(together, name)[:, :, d], getattr(alone, name)[:, :, d]), \
                (name, d)
            assert np.array_equal(getattr(again, name), getattr(together, name)), name
    with pytest.raises(ValueError, match="another profile"):
        stage_tables(costs.block_profile(SPEC, [0] * len(costs.comp_params), [1]), io, mem, sums=sums, **kw)
    with pytest.raises(ValueError):  # what every table shares cannot be written through
        sums.ranges("fwd", (0,))[0, 0, 0] = 1.0


@pytest.mark.parametrize("checkpointing,selective", [("auto", False), ("auto", True), ("on", False)])
def test_tables_computed_for_a_few_stages_alone_match_the_whole_tables(
        gpt2: tuple[BlockIO, GraphCosts, int], checkpointing: str, selective: bool) -> None:
    """`stage_tables(cells=...)` computes only the stages asked for (what a simulated plan
    reads of a key no table was built for: `TableCache.stage_cost`); every field of each is
    bitwise what the whole table holds there: every run of blocks, those starting at the first
    block (no B-to-W stash), empty runs (l > r, infeasible), under a limit where some recompute
    and some do not fit."""
    from rannc.stage_dp.tables import BlockSums

    io, costs, k = gpt2
    D = 5
    prof, mem, kw = _binding_limit(gpt2, checkpointing, selective, D)
    upper = np.triu(np.ones((k, k), dtype=bool))
    sums = BlockSums(prof)
    whole = stage_tables(prof, io, mem, sums=sums, **kw)
    assert np.isfinite(whole.h[upper]).any() and np.isinf(whole.h[upper]).any()
    assert (whole.recompute > 0).any() and (whole.selective.any() or not selective)
    first, last = (x.ravel() for x in np.indices((k, k)))  # every (l, r), l > r too
    order = np.random.default_rng(0).permutation(len(first))  # (in no particular order)
    cells = stage_tables(prof, io, mem, sums=sums, cells=(first[order], last[order]), **kw)
    fresh = stage_tables(prof, io, mem, cells=([0, 2], [k - 1, 2]), only={3}, **kw)
    for name in ("h", "fwd", "bwd", "allreduce", "memory", "memory_min", "memory_keep",
                 "recompute", "recompute_s", "selective", "selective_s", "wgrad"):
        dense, few = getattr(whole, name), getattr(cells, name)
        assert few.shape == (k * k, D + 1), name
        assert np.array_equal(few, dense[first[order], last[order]]), name
        assert np.array_equal(getattr(fresh, name)[:, 3], dense[[0, 2], [k - 1, 2], 3]), name


def test_a_plan_reads_its_stages_alone_where_no_whole_table_was_built(
        gpt2: tuple[BlockIO, GraphCosts, int]) -> None:
    """`TableCache.stage_cost` reads a stage from the key's whole table where one was built
    and else computes that stage alone (kept for the next read); both give the same costs,
    and `forget` (the search, after each layout) drops the whole tables and not those."""
    from rannc.stage_dp.search import TableCache, _stage_cost

    io, costs, k = gpt2
    n = len(costs.comp_params)
    D = 4
    prof = costs.block_profile(SPEC, [c * k // n for c in range(n)],
                               sorted({-(-BATCH // (2 * d)) for d in range(1, D + 1)}))
    mem = MemoryModel(opt_param_factor=2.0, limit=1e30, checkpointing="auto")
    cluster = rannc.Cluster.homogeneous(SPEC, D, D)
    cache = TableCache(prof, io, mem, cluster, BATCH, 1e10)
    args = dict(D=D, R=1, m=2, n_in=2, saved=0, sched="zero_bubble_v")
    stages = [(lo, hi, d) for lo in range(k) for hi in range(lo, k) for d in (1, 2)]
    for share in (None, 0.75):
        alone = [cache.stage_cost(**args, share=share, pending=1, past_b=0, first=lo, last=hi,
                                  replicas=d) for lo, hi, d in stages]
        assert not cache.tables  # (nothing built whole)
        tab = cache(**args, share=share, pending=1)
        assert [_stage_cost(tab, x) for x in stages] == alone
        assert [cache.stage_cost(**args, share=share, pending=1, past_b=0, first=lo, last=hi,
                                 replicas=d) for lo, hi, d in stages] == alone
        assert any(a is not None for a in alone)
        cache.forget()
    assert not cache.tables and cache._cells
