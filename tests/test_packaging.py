"""What a user installing the wheel sees: `rannc --version`, `rannc plan module:FACTORY` for a
factory in an installed package (examples/ is not shipped), the license, and the `mpi` extra
that brings an mpiexec."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import rannc

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}  # plan_factories importable by name
    return subprocess.run([sys.executable, "-m", "rannc", *args], cwd=cwd, text=True,
                          capture_output=True, timeout=300, env=env)


def test_version() -> None:
    res = run("--version")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"rannc {rannc.__version__}"


def test_plan_from_an_importable_module(tmp_path: Path) -> None:
    res = run("plan", "plan_factories:tiny_bert", "--devices", "2", "--batch-size", "8",
              cwd=tmp_path)  # no file path: found by import
    assert res.returncode == 0, res.stderr
    assert "2 rank(s)" in res.stdout


def test_plan_from_a_missing_module_says_what_to_do() -> None:
    res = run("plan", "no_such_pkg.models:f", "--devices", "2", "--batch-size", "8")
    assert res.returncode != 0
    assert "cannot import module 'no_such_pkg.models'" in res.stderr and "FILE.py:FACTORY" in res.stderr
    res = run("plan", "missing/file.py:f", "--devices", "2", "--batch-size", "8")
    assert res.returncode != 0 and "no such file" in res.stderr


def test_license_and_mpi_extra() -> None:
    text = (ROOT / "pyproject.toml").read_text()  # (tomllib is 3.11+; rannc supports 3.10)
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert re.search(r'^license = "Apache-2.0"$', text, re.M)
    assert re.search(rf'^version = "{re.escape(rannc.__version__)}"$', text, re.M)
    # mpi4py alone gives no mpiexec; the mpich wheel does.
    mpi = re.search(r"^mpi = \[(.*)\]$", text, re.M)
    assert mpi and '"mpich' in mpi[1] and '"mpi4py' in mpi[1], mpi
