"""`python -m rannc.check` (rannc/check.py), the users' tool the conformance suite runs on: its
tolerance arithmetic, and the command end to end (it launches mpiexec itself, prints a table
per model and exits 1 when a check fails)."""

from __future__ import annotations

import math

import pytest
import torch
from conformance import toys
from mpi_harness import find_mpiexec, run_rannc_check

from rannc.check import (
    ATOL64,
    RTOL64,
    CheckResult,
    Settings,
    _parser,
    default_loss,
    in_dtype,
    parse_results,
    rank_rows,
    run_case,
    settings_from,
)

TOYS = "tests/conformance/toys.py"

pytestmark = [pytest.mark.conformance, pytest.mark.layer("multi_rank")]


@pytest.mark.layer("pure")
def test_a_check_passes_within_tolerance_and_fails_beyond() -> None:
    c = CheckResult("grads")
    want = torch.tensor([1.0, -2.0, 0.0])
    c.add("a", want + torch.tensor([1e-4, -1e-4, 9e-6]), want, rtol=1e-4, atol=1e-5)
    assert c.passed and c.compared == 1
    assert math.isclose(c.max_abs, 1e-4, rel_tol=1e-3)
    assert math.isclose(c.max_rel, 1e-4, rel_tol=1e-3)  # not 9e-6 / 0: below atol, abs judges
    c.add("b", torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.001]), rtol=1e-4, atol=1e-5)
    assert not c.passed and c.worst == "b"


@pytest.mark.layer("pure")
def test_a_rank_compares_with_its_rows_of_the_reference_whichever_dimension_holds_them() -> None:
    """XLNet's memories are sequence x batch x hidden: rank 1 of 2 gets its rows of dimension 1,
    and the reference is cut there (it was compared whole, a shape mismatch)."""
    n, rows = 8, (4, 8)
    logits, mems = torch.randn(n, 5), torch.randn(12, n, 3)
    got = {"logits": logits[4:8], "mems": [mems[:, 4:8]], "loss": torch.tensor(1.0)}
    want = rank_rows({"logits": logits, "mems": [mems], "loss": torch.tensor(1.0)}, got, rows, n)
    assert torch.equal(want["logits"], logits[4:8]) and torch.equal(want["mems"][0], mems[:, 4:8])
    c = CheckResult("outputs")
    for k in ("logits", "loss"):
        c.add(k, got[k], want[k], rtol=0, atol=0)
    c.add("mems", got["mems"][0], want["mems"][0], rtol=0, atol=0)
    assert c.passed
    wrong = rank_rows({"mems": [mems]}, {"mems": [mems[:, 0:4]]}, rows, n)  # another rank's rows
    c.add("mems of rank 0", mems[:, 0:4], wrong["mems"][0], rtol=1e-4, atol=1e-5)
    assert not c.passed
    # batch x sequence flattened (dimension 0 a multiple of the batch) is cut as before
    flat = torch.randn(n * 3, 2)
    assert torch.equal(rank_rows(flat, flat[12:24], rows, n), flat[12:24])


@pytest.mark.layer("pure")
def test_missing_gradients_count_as_zeros_and_shapes_must_match() -> None:
    c = CheckResult("grads")
    c.add("unused", None, torch.zeros(3), rtol=1e-4, atol=1e-5)
    c.add("both none", None, None, rtol=1e-4, atol=1e-5)
    assert c.passed
    c.add("used", None, torch.ones(3), rtol=1e-4, atol=1e-5)
    assert not c.passed
    s = CheckResult("outputs")
    s.add("rows", torch.zeros(2, 3), torch.zeros(3, 3), rtol=1e-4, atol=1e-5)
    assert not s.passed and "shape (2, 3) != reference (3, 3)" in s.error
    n = CheckResult("outputs")
    n.add("nan", torch.tensor([float("nan"), 1.0]), torch.tensor([0.0, 1.0]), rtol=1e-4, atol=1e-5)
    assert not n.passed and "NaN" in n.error


@pytest.mark.layer("pure")
def test_float64_casts_the_model_and_the_floating_inputs_and_tightens_the_tolerances() -> None:
    case = in_dtype(toys.batchnorm(), "float64")
    x, y = case.batch(5)
    assert x.dtype == torch.float64 and y.dtype == torch.int64  # labels stay integers
    assert {p.dtype for p in case.model.parameters()} == {torch.float64}
    assert {b.dtype for b in case.model.buffers() if b.is_floating_point()} == {torch.float64}
    s = settings_from(_parser().parse_args(["toys:mlp", "--dtype", "float64"]))
    assert (s.dtype, s.rtol, s.atol) == ("float64", RTOL64, ATOL64)
    s = settings_from(_parser().parse_args(["toys:mlp", "--dtype", "float64", "--rtol", "1e-5"]))
    assert (s.rtol, s.atol) == (1e-5, ATOL64)  # what is given wins
    assert settings_from(_parser().parse_args(["toys:mlp"])).rtol == 1e-4
    with pytest.raises(ValueError, match="float16"):
        in_dtype(toys.batchnorm(), "float16")


@pytest.mark.layer("pure")
def test_the_default_loss_keeps_float64_outputs_in_float64() -> None:
    """A float64 check's default loss (the mean of squares of the batch outputs) is float64: in
    float32 it differed with the rows each rank summed (by 1.5e-8 for diffusers' UNet2DModel on
    3 ranks), which the check took for the model's error. Half outputs are summed in float32."""
    x = torch.randn(5, 3, dtype=torch.float64)
    assert default_loss({"a": x}, None).dtype == torch.float64
    assert default_loss({"a": x.half()}, None).dtype == torch.float32
    assert default_loss((x.float(),), None).dtype == torch.float32


@pytest.mark.layer("single_process")
def test_a_float64_check_runs_the_model_in_float64_and_passes_at_its_tolerance() -> None:
    rep = run_case("batchnorm", toys.batchnorm, Settings(batch=6, dtype="float64", rtol=RTOL64,
                                                         atol=ATOL64))
    assert rep.passed, rep.to_json()
    assert rep.checks[0].compared > 0


def test_the_command_passes_a_model_and_fails_one_it_cannot_run_exactly() -> None:
    """Two ranks, two stages, two microbatches: the MLP is exact; BatchNorm normalises each
    microbatch over its own rows (by design), so its outputs and gradients differ and the
    command exits 1 naming it."""
    if find_mpiexec() is None:
        pytest.skip("no mpiexec next to this python or on PATH")
    rc, out = run_rannc_check(f"{TOYS}:mlp", f"{TOYS}:batchnorm", "--ranks", "2", "--partition-num", "2",
                              "--microbatches", "2", "--batch", "8")
    assert rc == 1, out
    found = parse_results(out)
    assert found["mlp"]["passed"], out
    assert "2 stages, replicas [1, 1], 2 microbatches" in found["mlp"]["plan"], out
    bn = {c["check"]: c for c in found["batchnorm"]["checks"]}
    assert not found["batchnorm"]["passed"] and not bn["outputs"]["passed"], out
    assert bn["outputs"]["max_abs"] > 1e-3, bn
    assert "rannc.check: 1 of 2 passed; FAILED: batchnorm" in out
    # the table a user reads
    assert "mlp: PASS  [2 stages" in out and "batchnorm: FAIL" in out
    assert "  outputs " in out and "max abs err" in out


def test_the_command_in_one_process_exits_0() -> None:
    rc, out = run_rannc_check(f"{TOYS}:mlp", f"{TOYS}:batchnorm", f"{TOYS}:scalar_loss",
                              f"{TOYS}:noisy_eval", "--batch", "6")
    assert rc == 0, out
    assert parse_results(out)["scalar_loss"]["checks"][1]["compared"] > 0, out  # its loss compared
    assert all(d["passed"] and d["plan"] == "one process" for d in parse_results(out).values()), out


def test_a_bad_target_is_an_error_naming_it() -> None:
    rc, out = run_rannc_check("tests/conformance/toys.py:nothing")
    assert rc == 1 and "has no callable 'nothing'" in out, out
