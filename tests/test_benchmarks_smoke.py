"""Each benchmark of this issue set runs at tiny sizes (`--smoke`), so the commands in
BENCHMARKS.md cannot rot. Figures are not checked here; BENCHMARKS.md holds them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, *args, "--smoke"], cwd=ROOT, env=env, text=True,
                         capture_output=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res.stdout


@pytest.mark.parametrize("part", ["simulated", "measured"])
def test_schedules_benchmark(part: str) -> None:
    out = run("benchmarks/schedules.py", "--only", part, "--steps", "2")
    rows = [ln for ln in out.splitlines() if ln.startswith("| bert")]
    assert rows, out


def test_hetero_benchmark() -> None:
    out = run("benchmarks/hetero.py")
    assert out.count("x |") == 4, out


def test_runtime_peers_benchmark() -> None:
    """rannc, torch.distributed.pipelining on the same stages, and DDP: one row each, a positive
    speed, and the same loss (the script exits non-zero when the losses disagree)."""
    out = run("benchmarks/runtime_peers.py")
    rows = [ln.split("|")[1:-1] for ln in out.splitlines() if ln.startswith("| bert | 2 |")]
    assert [r[2].strip() for r in rows] == ["rannc 1f1b", "pipelining Schedule1F1B", "DDP"], out
    assert all(float(r[5]) > 0 for r in rows), out
    assert "loss check: every pipelining run agrees" in out, out


def test_capacity_benchmark() -> None:
    """The planner-side table (rannc fits at least what DDP fits: DDP's layout is one of its
    candidates) and the measured rows of both runs."""
    out = run("benchmarks/capacity.py")
    layers = {r[2].strip(): int(r[3]) for r in (ln.split("|") for ln in out.splitlines())
              if len(r) > 3 and r[1].strip() == "64"}
    assert set(layers) == {"rannc", "DDP", "equal split"}, out
    assert layers["rannc"] >= layers["DDP"] > 0, out
    measured = [ln.split("|")[1:-1] for ln in out.splitlines() if ln.startswith(("| rannc | L", "| DDP | L"))]
    assert sorted(r[0].strip() for r in measured) == ["DDP", "DDP", "rannc", "rannc"], out
    assert all(float(r[6]) > 0 and float(r[5]) > 0 for r in measured), out
