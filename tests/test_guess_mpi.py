"""A call run on the last call's row layout before the ranks agree on it (no collective at the
start of a step), when that guess is wrong, for models that write buffers in forward: the
writes are put back and BatchNorm's running statistics wait for the agreement, so the call run
again equals the unwrapped model (tests/scripts/guess_check.py)."""

from __future__ import annotations

import re

import pytest
from mpi_harness import TESTS, run_mpi

pytestmark = pytest.mark.layer("multi_rank")


def test_a_wrong_guess_puts_back_the_buffers_it_wrote() -> None:
    res = run_mpi(TESTS / "scripts" / "guess_check.py", 2,
                  ["--model", "writes,writes_no_grad,resnet"])
    for model in ("writes", "writes_no_grad", "resnet"):
        got = {int(r): (int(g), int(x), int(w)) for r, g, x, w in re.findall(
            rf"PASS {model} rank (\d+) guessed (\d+) rerun (\d+) written (\d+)", res.stdout)}
        assert sorted(got) == [0, 1], (model, res.stdout)
        # rank 0 ran two calls on a wrong guess, having written buffers on its stage
        assert got[0][1] == 2 and got[0][2] > 0, (model, got)


def test_one_stage_calls_carry_their_scalar_sums_in_the_agreement_and_rerun_when_a_batch_shrinks() -> None:
    res = run_mpi(TESTS / "scripts" / "carry_check.py", 3, [])
    got = {int(r): (int(c), int(g), int(x)) for r, c, g, x in re.findall(
        r"PASS carry rank (\d+) carried (\d+) guessed (\d+) rerun (\d+)", res.stdout)}
    assert sorted(got) == [0, 1, 2], res.stdout
    # calls 1, 2 and 4 carried their sums on every rank; at call 3 the last rank's batch shrank:
    # it did not guess, the others guessed wrong and ran the call again (and rank 0 guessed the
    # call that met the others' state_dict(), below)
    assert got == {0: (3, 5, 1), 1: (3, 4, 1), 2: (3, 3, 0)}, got
    # then rank 0 makes such a call while the others call state_dict(): all three say so
    says = ("CallOrderError: ranks made different rannc calls at the same time (rank 0: forward "
            "(a call of the model); ranks 1, 2: state_dict())")
    assert all(f"ORDER rank {r} {says}" in res.stdout for r in range(3)), res.stdout
