"""What a user installing the wheel sees: `rannc --version`, `rannc plan module:FACTORY` for a
factory in an installed package (examples/ is not shipped), the license, and the `mpi` extra
that brings an mpiexec. With --full: the wheel built, installed with its `mpi` extra into a
fresh venv outside the checkout, running the README's examples from there."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import rannc

pytestmark = pytest.mark.layer("pure")

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


# -- the wheel, installed outside the checkout ---------------------------------------------------
# Slow (a C++ build, a fresh virtual environment, torch unpacked into it: several minutes on
# 2 cores), so it runs with --full or CONFORMANCE_FULL=1. Nothing large is downloaded: torch
# comes from a local wheel, everything is pinned by constraints.txt.

def full_mode(config: pytest.Config) -> bool:
    return bool(config.getoption("--full")) or os.environ.get("CONFORMANCE_FULL", "") not in ("", "0")


def local_torch_wheel() -> Path | None:
    """The wheel of the torch this venv runs, from pip's find-links folders (PIP_FIND_LINKS or
    pip's configuration): what scripts/setup_env.sh installs torch from."""
    import torch

    dirs = os.environ.get("PIP_FIND_LINKS", "").split()
    res = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                         text=True, timeout=60)
    for line in res.stdout.splitlines():
        if "find-links=" in line:
            dirs += line.split("=", 1)[1].strip("'\"").split()
    for d in dirs:
        found = sorted(Path(d.removeprefix("file://")).glob(f"torch-{torch.__version__}-*.whl"))
        if found:
            return found[0]
    return None


def readme_block(after: str, lang: str) -> str:
    """The first ```lang block after the text `after` in the README."""
    text = (ROOT / "README.md").read_text()
    start = text.index(after)
    m = re.search(rf"^```{lang}\n(.*?)^```", text[start:], re.M | re.S)
    assert m, f"no {lang} block after {after!r} in README.md"
    return m[1]


def readme_line(prefix: str) -> str:
    lines = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith(prefix)]
    assert lines, f"README.md has no line starting {prefix!r}"
    return lines[0]


def _sources(dest: Path) -> None:
    """The repository's tracked files (no .venv, build outputs or caches) into `dest`."""
    res = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    if res.returncode == 0 and res.stdout:
        for name in res.stdout.decode().split("\0"):
            if name and (ROOT / name).is_file():
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, dest / name)
        return
    shutil.copytree(ROOT, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "*.egg-info", "__pycache__", "*.so", ".*_cache"))


def _pip(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                          timeout=timeout)


OFFLINE = ("No matching distribution found", "Could not find a version", "Failed to establish",
           "Temporary failure in name resolution", "Network is unreachable")


@pytest.fixture(scope="module")
def installed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv outside the checkout with the built wheel installed as `rannc[mpi]`; its bin/."""
    if not full_mode(request.config):
        pytest.skip("slow (builds and installs a wheel: minutes): runs with --full or CONFORMANCE_FULL=1")
    torch_wheel = local_torch_wheel()
    if torch_wheel is None:
        pytest.skip("no local torch wheel in pip's find-links (PIP_FIND_LINKS): installing torch "
                    "would download the CUDA build")
    tmp = tmp_path_factory.mktemp("wheel")
    src, wheels, venv = tmp / "src", tmp / "wheels", tmp / "venv"
    src.mkdir()
    _sources(src)
    try:
        import pybind11  # noqa: F401  (the build requirements, from the test extra)
        import setuptools  # noqa: F401
        isolation = ["--no-build-isolation"]
    except ImportError:
        isolation = []  # pip fetches the build requirements
    t0 = time.perf_counter()
    res = _pip(["wheel", "--no-deps", *isolation, "-w", str(wheels), str(src)], timeout=1200)
    if res.returncode and any(s in res.stdout + res.stderr for s in OFFLINE):
        pytest.skip(f"cannot build the wheel offline: {res.stderr[-500:]}")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    built = sorted(wheels.glob("rannc-*.whl"))
    assert len(built) == 1, built
    t1 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    res = _pip(["--python", str(venv / "bin" / "python"), "install", "-c", str(ROOT / "constraints.txt"),
                str(torch_wheel), f"{built[0]}[mpi]"], timeout=1500)
    if res.returncode and any(s in res.stdout + res.stderr for s in OFFLINE):
        pytest.skip(f"a dependency of the wheel is not available offline: {res.stderr[-500:]}")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    print(f"wheel built in {t1 - t0:.0f} s, venv with it installed in {time.perf_counter() - t1:.0f} s")
    return venv / "bin"


def _user_env(bin_dir: Path) -> dict[str, str]:
    """A user's shell with the venv first on PATH: nothing of the checkout, no outer launcher."""
    from mpi_harness import _LAUNCHER_VARS

    drop = set(_LAUNCHER_VARS) | {"PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "HYDRA_HOST_FILE"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("RANNC_")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1",
               HYDRA_LAUNCHER="fork", PYTHONUNBUFFERED="1")
    return env


@pytest.mark.layer("multi_rank")
@pytest.mark.timeout(2400)  # the fixture's build and install count too (390 s here, loaded)
def test_wheel_installs_outside_the_checkout(installed: Path, tmp_path: Path) -> None:
    env = _user_env(installed)

    def sh(*cmd: str) -> subprocess.CompletedProcess[str]:
        res = subprocess.run(list(cmd), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, f"{cmd}: {res.stdout[-2000:]}{res.stderr[-2000:]}"
        return res

    where = sh(str(installed / "python"), "-c", "import rannc, rannc._C; print(rannc.__file__)").stdout
    assert str(installed.parent) in where and str(ROOT) not in where, where
    assert sh(str(installed / "rannc"), "--version").stdout.strip() == f"rannc {rannc.__version__}"
    license = sh(str(installed / "python"), "-c", "from importlib.metadata import metadata; "
                 "print(metadata('rannc')['License-Expression'])").stdout.strip()
    assert license == "Apache-2.0", license

    # README: rannc plan from a factory in a file of the user's own
    (tmp_path / "my_models.py").write_text(readme_block("`my_models.py`:", "python"))
    cmd = shlex.split(readme_line("rannc plan my_models.py:"))
    out = sh(str(installed / "rannc"), *cmd[1:]).stdout
    assert "4 rank(s)" in out and (tmp_path / "plan.json").is_file(), out

    # README's quick start train.py on 2 ranks, mpiexec from the mpich wheel: the planner's
    # choice, then 2 pipeline stages forced; both train the same model to the same losses.
    from mpi_harness import run_command

    (tmp_path / "train.py").write_text(readme_block("Your own script, `train.py`", "python"))
    assert "mpiexec -n 2 python train.py" in readme_line("mpiexec -n 2 python train.py")
    launch = ["env", "-C", str(tmp_path), str(installed / "mpiexec"), "-n", "2",
              str(installed / "python"), "train.py"]
    auto = run_command(launch, 240, env).stdout
    staged = run_command(launch, 240, {**env, "RANNC_PARTITION_NUM": "2"}).stdout
    losses = re.findall(r"^step \d+: loss ([\d.]+)$", auto, re.M)
    assert len(losses) == 5 and losses[-1] < losses[0], auto
    assert re.findall(r"^step \d+: loss ([\d.]+)$", staged, re.M) == losses, (auto, staged)
