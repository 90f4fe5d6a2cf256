"""The terms of the memory model (DESIGN.md section 4) beyond parameters and activations: the
model's batch outputs the runtime keeps until a call returns, and the per-rank overhead."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rannc.profile.estimate import BlockProfile
from rannc.stage_dp.tables import BlockIO, MemoryModel, local_rows, returned_memory, stage_tables

pytestmark = pytest.mark.layer("pure")

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
                 returned=ret, returned_all=np.array([0.0, LOGITS]) if returned else None)
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
    assert returned_memory(io, rows=1, microbatches=4, in_flight=1, local=1).held[0, 0] == 0


def test_every_rank_assembles_its_own_rows_of_the_outputs() -> None:
    """When a call returns, each rank receives its rows of the logits and concatenates them:
    twice its rows' bytes, beside the static memory (the activations are freed by then)."""
    prof, io = two_blocks()
    rows = local_rows(batch_size=8, copies=2, devices=1)
    assert rows == 4
    ret = returned_memory(io, rows=1, microbatches=4, in_flight=1, local=rows)
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


def test_the_overhead_is_on_every_stage() -> None:
    prof, io = two_blocks()
    base = memory(io, prof, inflight=1)
    more = memory(io, prof, inflight=1, overhead=20 * MiB)
    upper = np.triu_indices(2)  # the stages l <= r (the others are infeasible: inf)
    assert np.allclose(more[upper] - base[upper], 20 * MiB)


def test_a_stage_whose_outputs_do_not_fit_at_return_is_infeasible() -> None:
    """Recomputation cannot free what the call returns: the head fits 120 MiB while it runs
    (112 MiB) but not when the call returns its 4 rows' logits beside all 4 microbatches' (132)."""

    def head(io: BlockIO) -> float:
        mem = MemoryModel(opt_param_factor=2.0, limit=120 * MiB, checkpointing="auto")
        tab = stage_tables(prof, io, mem, batch_size=8, devices=1, copies=2, microbatches=4,
                           link_bw=1e9, allreduce_bw=1e9, inflight=2)
        return float(tab.memory[1, 1, 1])

    prof, io = two_blocks()
    assert math.isinf(head(io))
    assert head(two_blocks(returned=False)[1]) == pytest.approx(4 * MiB + 2 * (17 + 5) * MiB + 32 * MiB)


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
