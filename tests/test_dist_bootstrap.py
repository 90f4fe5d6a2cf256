"""rannc.dist bootstrap under mpiexec, torchrun and plain python, run as real multi-process jobs.

Each launch runs tests/scripts/bootstrap_check.py on every rank (identity vs the launcher's
environment, all_reduce, a send/recv ring, two subgroups) and expects one "OK" line per rank.
The failure tests check that a rank dying -- or hanging -- ends the job with an error within
the collective timeout instead of hanging the test run.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from mpi_harness import run_mpi, run_python, run_torchrun

from rannc import dist

SCRIPT = Path(__file__).resolve().parent / "scripts" / "bootstrap_check.py"
# Not anchored to line starts: mpiexec may still glue one rank's output to another's line.
OK = re.compile(
    r"OK rank (\d+) of (\d+) local (\d+) backend (gloo|nccl) launcher (mpi|torchrun|python|external)"
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.layer("multi_rank")]


def ok_ranks(stdout: str, world: int, launcher: str) -> set[int]:
    """The ranks that printed a well-formed OK line, checking world size, backend and launcher."""
    seen = set()
    for m in OK.finditer(stdout):
        rank, w, local, backend, launch = int(m[1]), int(m[2]), int(m[3]), m[4], m[5]
        assert (w, backend, launch) == (world, "gloo", launcher), m[0]
        assert local == rank, m[0]  # single node: the local rank is the global rank
        seen.add(rank)
    return seen


@pytest.mark.layer("single_process")
def test_plain_python_is_a_world_of_one() -> None:
    res = run_python(SCRIPT, ["--timeout-s", "30", "--expect-launcher", "python"], timeout=120)
    assert ok_ranks(res.stdout, 1, "python") == {0}, res.stdout


@pytest.mark.parametrize("n", [2, 3])
def test_mpiexec(n: int) -> None:
    res = run_mpi(SCRIPT, n, ["--timeout-s", "30", "--expect-launcher", "mpi"], timeout=180)
    assert ok_ranks(res.stdout, n, "mpi") == set(range(n)), res.stdout + res.stderr


def test_torchrun() -> None:
    res = run_torchrun(SCRIPT, 2, ["--timeout-s", "30", "--expect-launcher", "torchrun"], timeout=180)
    assert ok_ranks(res.stdout, 2, "torchrun") == {0, 1}, res.stdout + res.stderr


@pytest.mark.parametrize("launcher", ["mpi", "torchrun"])
def test_a_normal_exit_destroys_the_groups_rannc_made(launcher: str) -> None:
    """A script that never calls shutdown: rannc destroys its groups in an exit handler, while
    the interpreter still runs. Before, they were left to the interpreter's finalization, where
    a gloo worker freeing its last collective's tensors aborted the finished process now and
    then ("terminate called without an active exception", exit code 6: 1 launch in 16 of a
    2-rank training run on this machine)."""
    run = run_mpi if launcher == "mpi" else run_torchrun
    res = run(SCRIPT, 2, ["--timeout-s", "30", "--exit-without-shutdown"], timeout=180)
    assert ok_ranks(res.stdout, 2, launcher) == {0, 1}, res.stdout + res.stderr
    for r in (0, 1):
        assert f"EXIT rank {r} groups destroyed True" in res.stdout, res.stdout + res.stderr


def test_mpiexec_rank_raising_fails_the_job_without_hanging() -> None:
    t0 = time.monotonic()
    res = run_mpi(SCRIPT, 2, ["--timeout-s", "5", "--fail-rank", "1"], timeout=60, check=False)
    assert res.returncode != 0, res.stdout + res.stderr
    assert "fails on purpose" in res.stderr
    assert not OK.search(res.stdout), res.stdout
    assert time.monotonic() - t0 < 45  # a hang would have failed in run_mpi at 60 s


def test_mpiexec_hung_rank_is_aborted_after_the_collective_timeout() -> None:
    # Rank 1 sleeps without closing its sockets: rank 0's all_reduce times out (timeout_s=3),
    # and rannc's abort-on-uncaught-exception must then end rank 1 too (MPI_Abort), instead of
    # rank 0 waiting forever for it in MPI_Finalize.
    t0 = time.monotonic()
    res = run_mpi(SCRIPT, 2, ["--timeout-s", "3", "--hang-rank", "1"], timeout=60, check=False)
    assert res.returncode != 0, res.stdout + res.stderr
    assert "Timed out" in res.stderr, res.stderr  # rank 0's collective timeout, not ours
    # (MPICH's "Abort(1) ... MPI_Abort" line is not always forwarded before Hydra kills the job.)
    assert not OK.search(res.stdout), res.stdout
    assert time.monotonic() - t0 < 45  # a hang would have failed in run_mpi at 60 s


# ---- in-process checks (no process group is created in the pytest process) ----------------


def _clear_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for v in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PMI_RANK", "PMI_SIZE",
        "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALRANKID",
        "OMPI_COMM_WORLD_LOCAL_RANK",
    ):  # fmt: skip
        monkeypatch.delenv(v, raising=False)


def test_launcher_detection_and_env_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_launcher_env(monkeypatch)
    # Identity before a process group exists (an earlier test in this pytest process may have
    # started a one-rank group, e.g. a single-process checkpoint save).
    monkeypatch.setattr(dist, "_initialized", lambda: False)
    assert dist.detect_launcher() == "python"
    assert (dist.get_rank(), dist.get_world_size(), dist.get_local_rank()) == (0, 1, 0)
    monkeypatch.setenv("PMI_RANK", "2")
    monkeypatch.setenv("PMI_SIZE", "4")
    monkeypatch.setenv("MPI_LOCALRANKID", "1")
    assert dist.detect_launcher() == "mpi"
    assert (dist.get_rank(), dist.get_world_size(), dist.get_local_rank()) == (2, 4, 1)
    torchrun_env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    for k, v in torchrun_env.items():
        monkeypatch.setenv(k, v)
    assert dist.detect_launcher() == "torchrun"
    assert dist.get_rank() == 3


@pytest.mark.layer("pure")
def test_backend_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANNC_BACKEND", "gloo")
    assert dist._choose_backend(1) == "gloo"
    monkeypatch.setenv("RANNC_BACKEND", "mpi")
    with pytest.raises(ValueError, match="RANNC_BACKEND='mpi'"):
        dist._choose_backend(1)


@pytest.mark.layer("single_process")
def test_new_group_before_init_says_what_to_do() -> None:
    if dist._initialized():
        pytest.skip("a process group already exists in this pytest process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        dist.new_group([0])


def test_mpiexec_rendezvous_and_gloo_listen_on_loopback_only() -> None:
    # Single node: rannc's store (rank 0) and gloo's pair sockets must not be reachable from
    # other hosts (their protocols are unauthenticated).
    res = run_mpi(SCRIPT, 2, ["--timeout-s", "30", "--check-listen"], timeout=180)
    lines = re.findall(r"LISTEN rank (\d+) (.*)", res.stdout)
    assert {r for r, _ in lines} == {"0", "1"}, res.stdout + res.stderr
    assert any(addrs != "-" for _, addrs in lines), res.stdout  # rank 0 at least has its store
    assert ok_ranks(res.stdout, 2, "mpi") == {0, 1}, res.stdout + res.stderr
