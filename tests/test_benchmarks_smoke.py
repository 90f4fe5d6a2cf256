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


def test_soak_benchmark() -> None:
    out = run("benchmarks/soak.py")
    assert "no errors" in out and out.count("| - |") == 2, out
