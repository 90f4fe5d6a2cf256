"""Each benchmark of this issue set runs at tiny sizes (`--smoke`), so the commands in
BENCHMARKS.md cannot rot. Figures are not checked here; BENCHMARKS.md holds them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.layer("pure")

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        res = subprocess.run([sys.executable, *args, "--smoke"], cwd=ROOT, env=env, text=True,
                             capture_output=True, timeout=600)
    except subprocess.TimeoutExpired as e:  # what it printed says where it was
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x or ""
                    for x in (e.stdout, e.stderr))
        pytest.fail(f"{args[0]} --smoke ran out of time (600 s):\n{out[-3000:]}\n{err[-6000:]}")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-8000:]
    return res.stdout


@pytest.mark.layer("multi_rank")
@pytest.mark.parametrize("part", ["simulated", "measured"])
def test_schedules_benchmark(part: str) -> None:
    out = run("benchmarks/schedules.py", "--only", part, "--steps", "2")
    rows = [ln for ln in out.splitlines() if ln.startswith("| bert")]
    assert rows, out


def test_new_schedules_benchmark() -> None:
    out = run("benchmarks/new_schedules.py")
    got = [(r[3], r[6]) for r in rows(out, "| BERT-Large")]
    assert [g[0] for g in got] == ["1f1b", "zero_bubble", "interleaved_1f1b", "zero_bubble_v"], out
    assert len(rows(out, "| 4 |")) == 12, out  # uniform: 4 schedules x 3 microbatch counts


@pytest.mark.layer("multi_rank")
@pytest.mark.parametrize("model", [pytest.param("bert", marks=pytest.mark.full), "standin"])
def test_new_schedules_measured_benchmark(model: str) -> None:
    out = run("benchmarks/new_schedules.py", "--only", "measured", "--ranks", "2", "--model", model)
    assert [r[1] for r in rows(out, "| 2 |")] == ["1f1b", "zero_bubble", "zero_bubble_lag1",
                                                  "zero_bubble_lag0", "interleaved_1f1b",
                                                  "zero_bubble_v"], out


def test_hetero_benchmark() -> None:
    out = run("benchmarks/hetero.py")
    assert out.count("x |") == 4, out


def rows(out: str, start: str) -> list[list[str]]:
    """The Markdown table rows starting with `start`, as lists of cells."""
    return [[c.strip() for c in ln.strip().strip("|").split("|")]
            for ln in out.splitlines() if ln.startswith(start)]


def test_capture_meta_benchmark() -> None:
    out = run("benchmarks/capture_meta.py")
    (row,) = rows(out, "| BertForPreTraining L2 H64 A2")
    assert int(row[5]) > 0 and int(row[7]) > 0, row  # tasks, atomic components


def test_coarsen_scale_benchmark() -> None:
    out = run("benchmarks/coarsen_scale.py")
    assert "k=8 " in out and "k=32 " in out and "identical: True" in out, out


def test_plan_balance_benchmark() -> None:
    out = run("benchmarks/plan_balance.py")
    assert [r[0] for r in rows(out, "| auto") + rows(out, "| 2 ")] == ["auto", "2"], out


def test_llm_plan_probe_benchmark() -> None:
    out = run("benchmarks/llm_plan_probe.py")
    assert "planned in" in out and "over the bound:" in out and "x the bound" in out, out


def test_plan_scale_benchmark(tmp_path: Path) -> None:
    png = tmp_path / "scale.png"
    out = run("benchmarks/plan_scale.py", "--plot", str(png))
    found = rows(out, "| 2x64") + rows(out, "| 4x64")
    assert [r[0] for r in found] == ["2x64", "4x64"], out
    assert all(int(r[2]) > 0 for r in found), found  # atomic components
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_profile_measure_benchmark() -> None:
    out = run("benchmarks/profile_measure.py")
    assert len(rows(out, "| 0 | 2 |") + rows(out, "| 1 | 2 |")) == 2, out
    assert rows(out, "| all | 2 |"), out


@pytest.mark.layer("single_process")
def test_single_stage_overhead_benchmark() -> None:
    out = run("benchmarks/single_stage_overhead.py")
    assert "rannc  median" in out and "throughput ratio rannc/plain:" in out, out


@pytest.mark.layer("single_process")
def test_gpu_study_benchmark(tmp_path: Path) -> None:
    """Issue 8 study 5 at tiny sizes on this machine's device: both variants for fp32 and bf16
    (autocast), and predicted vs measured times of the 1- and 2-stage splits."""
    png = tmp_path / "gpu.png"
    out = run("benchmarks/gpu_study.py", "--plot", str(png))
    assert out.startswith("machine: "), out
    for dtype in ("fp32", "bf16"):
        found = rows(out, f"| {dtype} | plain |") + rows(out, f"| {dtype} | rannc |")
        assert [r[1] for r in found] == ["plain", "rannc"], out
        assert all(float(r[3]) > 0 and r[6].endswith("%") for r in found), found  # samples/s, MFU
        splits = [(r[1], r[2]) for r in rows(out, f"| {dtype} | ") if r[1].isdigit()]
        assert splits == [("1", "0"), ("2", "0"), ("2", "1")], out
        assert all(float(r[7]) > 0 for r in rows(out, f"| {dtype} | ") if r[1].isdigit()), out
    assert "model FLOPs per iteration: fp32: formula" in out, out
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.layer("single_process")
def test_gpu_profile_benchmark() -> None:
    """Where an iteration's time goes (plain and rannc under torch.profiler), tiny, on this
    machine's device: a table per variant and the summary rows with their counts."""
    out = run("benchmarks/gpu_profile.py")
    found = rows(out, "| bf16 | plain |") + rows(out, "| bf16 | rannc |")
    assert [r[1] for r in found] == ["plain", "rannc"], out
    assert all(float(r[2]) > 0 and float(r[6]) > 0 for r in found), found  # wall ms, aten ops
    assert out.count("### bf16 ") == 2, out


def test_estimate_host_benchmark() -> None:
    """BERT's stages priced on a GPU spec, device time alone and with the host floor: a tiny
    BERT's ops are short, so the floor binds and lifts every stage."""
    out = run("benchmarks/estimate_host.py")
    found = [r for r in rows(out, "| ") if r[0].isdigit()]
    assert [(r[0], r[1]) for r in found] == [("1", "0"), ("2", "0"), ("2", "1"), ("4", "0"),
                                             ("4", "1"), ("4", "2"), ("4", "3")], out
    assert all(float(r[3]) > float(r[2]) > 0 for r in found), out


@pytest.mark.layer("multi_rank")
def test_pipeline_memory_benchmark() -> None:
    out = run("benchmarks/pipeline_memory.py")
    assert rows(out, "| rannc x2, rank 0") and rows(out, "| rannc x2, rank 1"), out
    assert rows(out, "| **sum of the 2 ranks**"), out


def test_plan_quality_benchmark(tmp_path: Path) -> None:
    import importlib.util

    png = tmp_path / "quality.png"
    out = run("benchmarks/plan_quality.py", "--plot", str(png))
    found = rows(out, "| BERT 2x64") + rows(out, "| ResNet (1, 1)x1") + rows(out, "| GPT-2 2x64")
    assert len(found) == 3, out
    peers = {"deepspeed": (4, 5), "torchgpipe": (6,), "pippy": (7,)}
    for r in found:
        assert len(r) == 11, r
        assert float(r[3].split()[0]) > 0 and float(r[8]) > 0, r  # rannc, bound
        assert float(r[10]) >= 1.0, r  # rannc is never faster than the bound
        for module, cols in peers.items():
            installed = importlib.util.find_spec(module) is not None
            for c in cols:
                assert (r[c] != "not installed") == installed, (module, r)
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.layer("multi_rank")
def test_soak_benchmark() -> None:
    out = run("benchmarks/soak.py")
    assert "no errors" in out and out.count("| - |") == 2, out


@pytest.mark.layer("multi_rank")
def test_runtime_peers_benchmark() -> None:
    """rannc, torch.distributed.pipelining on the same stages, and DDP: one row each, a positive
    speed, and the same loss (the script exits non-zero when the losses disagree)."""
    out = run("benchmarks/runtime_peers.py")
    rows = [ln.split("|")[1:-1] for ln in out.splitlines() if ln.startswith("| bert | 2 |")]
    assert [r[2].strip() for r in rows] == ["rannc 1f1b", "pipelining Schedule1F1B", "DDP"], out
    assert all(float(r[5]) > 0 for r in rows), out
    assert "loss check: every pipelining run agrees" in out, out


@pytest.mark.layer("multi_rank")
def test_data_parallel_benchmark() -> None:
    """rannc's one stage x 2 against DDP in the same processes: a row with both speeds, and the
    same losses (the worker exits non-zero when they differ by more than 1e-5 here)."""
    out = run("benchmarks/data_parallel.py", "--max-loss-gap", "1e-5")
    rows = [ln.split("|")[1:-1] for ln in out.splitlines() if ln.startswith("| bert | 2 |")]
    assert len(rows) == 1 and float(rows[0][3]) > 0 and float(rows[0][4]) > 0, out


@pytest.mark.layer("multi_rank")
def test_capacity_benchmark() -> None:
    """The planner-side table (rannc fits at least what DDP fits: DDP's layout is one of its
    candidates) and the measured rows of both runs."""
    out = run("benchmarks/capacity.py")
    layers = {r[2].strip(): int(r[3]) for r in (ln.split("|") for ln in out.splitlines())
              if len(r) > 3 and r[1].strip() == "64"}
    assert set(layers) == {"rannc", "rannc, ZeRO-1 off", "DDP", "DDP + ZeRO-1", "equal split"}, out
    assert layers["rannc"] >= layers["rannc, ZeRO-1 off"] >= layers["DDP"] > 0, out
    assert layers["DDP + ZeRO-1"] >= layers["DDP"], out
    measured = [ln.split("|")[1:-1] for ln in out.splitlines() if ln.startswith(("| rannc | L", "| DDP | L"))]
    assert sorted(r[0].strip() for r in measured) == ["DDP", "DDP", "rannc", "rannc"], out
    assert all(float(r[6]) > 0 and float(r[5]) > 0 for r in measured), out


@pytest.mark.layer("multi_rank")
def test_grad_reduce_benchmark() -> None:
    """The bucketed reduction's row (without --old-root only the new runtime runs): a positive
    step time and at most one bucket held beyond the gradients."""
    out = run("benchmarks/grad_reduce.py")
    rows = [ln.split("|")[1:-1] for ln in out.splitlines() if ln.startswith("| gpipe |")]
    assert len(rows) == 1 and float(rows[0][2]) > 0, out
    assert float(rows[0][4]) <= 0.01 + 1e-9, out


def test_plan_quality_llm_table() -> None:
    out = run("benchmarks/plan_quality.py", "--llm")
    plans = ("rannc", "equal layers", "FLOPs balanced", "parameter count")
    found = [r for r in rows(out, "| Llama 2x64") if r[1] not in plans]
    assert len(found) == 1, out
    r = found[0]
    assert len(r) == 12, r
    rannc, bound = float(r[2].split()[0]), float(r[6])
    assert 0 < bound <= rannc, r
    for c in (3, 4, 5):  # the three baselines: a time each (tiny model: every split fits)
        assert float(r[c].split()[0]) > 0, r
    # the second table: each plan's time = the bound + its terms over it (3 figures printed)
    over = {r[1]: r for r in rows(out, "| Llama 2x64") if r[1] in plans}
    assert set(over) == set(plans), out
    for r in over.values():
        t = float(r[2])
        assert float(r[3]) == pytest.approx(t / bound, rel=2e-3), r
        terms = [float(c.split()[0]) for c in r[4:10]]
        assert bound + sum(terms) == pytest.approx(t, rel=1e-2), r
        assert min(terms[1:5]) >= 0 and abs(terms[5]) <= 1e-3 * t, r  # nothing unaccounted


def test_minmax_bounds_is_the_best_contiguous_split() -> None:
    import itertools
    import random

    sys.path.insert(0, str(ROOT))
    from benchmarks.plan_quality import minmax_bounds

    rng = random.Random(0)
    for _ in range(50):
        w = [rng.randint(1, 20) for _ in range(rng.randint(1, 8))]
        for S in range(1, len(w) + 1):
            b = minmax_bounds(w, S)
            assert b is not None and b[0] == 0 and b[-1] == len(w) and len(b) == S + 1
            assert all(x < y for x, y in itertools.pairwise(b))
            got = max(sum(w[x:y]) for x, y in itertools.pairwise(b))
            best = min(max(sum(w[x:y]) for x, y in itertools.pairwise((0, *c, len(w))))
                       for c in itertools.combinations(range(1, len(w)), S - 1))
            assert got == best, (w, S, b)
        assert minmax_bounds(w, len(w) + 1) is None


@pytest.mark.full  # about a minute of launches; the memory model's own tests run in CI
@pytest.mark.layer("multi_rank")
def test_memory_forecast_benchmark() -> None:
    """A row per rank (BERT and GPT-2, 1 and 2 stages), each with a forecast and a measured peak."""
    out = run("benchmarks/memory_forecast.py")
    found = rows(out, "| bert |") + rows(out, "| gpt2 |")
    assert len(found) == 6, out
    assert all(float(r[4]) > 0 and float(r[5]) > 0 for r in found), out


def test_kept_activations_benchmark() -> None:
    out = run("benchmarks/kept_activations.py")
    assert len([ln for ln in out.splitlines() if ln.startswith(("| bert", "| gpt2"))]) == 2, out


@pytest.mark.layer("single_process")
def test_host_malloc_benchmark() -> None:
    """The three settings' rows and the ratios against "keep" (one process, one round)."""
    out = run("benchmarks/host_malloc.py")
    got = [r[0] for m in ("reuse", "release", "keep") for r in rows(out, f"| {m}")]
    assert got == ["reuse", "release", "keep"], out
    assert "release / keep" in out and "reuse / keep" in out, out


def test_selective_benchmark() -> None:
    out = run("benchmarks/selective.py")
    rows = [ln for ln in out.splitlines() if ln.startswith("| llama")]
    assert len(rows) == 1 and "| yes (yes) |" in rows[0], out


@pytest.mark.layer("single_process")
def test_gpu_memory_benchmark() -> None:
    """On the CPU (--smoke) the script plans and trains both variants; nothing is measured."""
    out = run("benchmarks/gpu_memory.py")
    (row,) = rows(out, "| llama |")
    assert float(row[3]) > 0, out
    rannc_loss, plain_loss = row[-1].split(" / ")
    assert rannc_loss == plain_loss, out


@pytest.mark.layer("single_process")
def test_attention_probe_benchmark() -> None:
    out = run("benchmarks/attention_probe.py")
    assert "bert: captured graph" in out and "dispatched, captured" in out, out


@pytest.mark.layer("multi_rank")
def test_signatures_benchmark() -> None:
    out = run("benchmarks/signatures.py")
    got = rows(out, "| ")[1:]  # (less the header)
    assert [r[1] for r in got] == ["8", "12", "16"], out
    assert {r[3] for r in got} == {"2"} and {r[4] for r in got} == {"1"}, out
    assert all(r[9] == r[2] for r in got), out  # a ShapeEnv alive per kept capture, no more


@pytest.mark.layer("multi_rank")
def test_ddp_teardown_benchmark() -> None:
    out = run("benchmarks/ddp_teardown.py")
    assert rows(out, "| wrapper first") == [["wrapper first", "1", "0"]], out
    assert len(rows(out, "| group first")) == 1, out  # (which may hang: a count, not a check)
