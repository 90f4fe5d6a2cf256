"""A rank that fails -- raises or dies in forward, backward, the gradient all-reduce, a checkpoint
write or the user's own code, or skips backward() -- ends the whole job promptly, with a
message naming the failed rank and the step, under mpiexec and torchrun, and with no process
left behind (rannc.health's watchdog; tests/scripts/fault_check.py injects the faults).

The collective timeout is 5 s. "Promptly" is measured from the moment the faulty rank printed
its FAULT line to the end of the launch.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
from mpi_harness import run_mpi, run_torchrun

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fault_check.py"
TIMEOUT_S = 5.0
FAULT = re.compile(r"FAULT rank (\d+) step (\d+) at ([0-9.]+)")

pytestmark = [pytest.mark.timeout(300), pytest.mark.layer("multi_rank")]


def launch(launcher: str, *args: str, n: int = 2) -> tuple[subprocess.CompletedProcess[str], float]:
    run = run_mpi if launcher == "mpiexec" else run_torchrun
    res = run(SCRIPT, n, ["--timeout-s", str(TIMEOUT_S), *args], timeout=120, check=False)
    end = time.time()
    m = FAULT.search(res.stdout)
    assert m, res.stdout + res.stderr
    return res, end - float(m[3])


def assert_failed_cleanly(res: subprocess.CompletedProcess[str], seconds: float, limit: float) -> str:
    text = res.stdout + res.stderr
    assert res.returncode != 0, text
    assert "DONE" not in res.stdout, text
    assert seconds < limit, f"the job took {seconds:.1f} s after the fault to end\n{text}"
    assert res.leftovers == [], f"processes left behind: {res.leftovers}\n{text}"  # type: ignore[attr-defined]
    return text


@pytest.mark.parametrize("where,phase", [
    ("forward", "forward"),
    ("backward", "backward"),
    ("allreduce", "gradient all-reduce"),
    ("checkpoint", "checkpoint write"),
    ("between", "after backward"),
])
def test_a_rank_raising_stops_every_rank_naming_it(where: str, phase: str) -> None:
    # The gradient all-reduce only runs between replicas: one stage on both ranks, whatever
    # layout schedule="auto" would pick for this tiny model.
    layout = ("--partition-num", "1") if where == "allreduce" else ()
    res, seconds = launch("mpiexec", "--where", where, *layout)
    text = assert_failed_cleanly(res, seconds, TIMEOUT_S)
    # The failed rank says what happened, and the other rank says why it stops.
    assert f"rank 1 failed at step 3 ({phase}): " in text, text
    assert f"injected fault in {where} on rank 1" in text, text
    if where == "checkpoint":
        # torch.distributed.checkpoint gathers the writers' errors and raises on every rank.
        assert "rank 0 failed at step 3 (checkpoint write): CheckpointException: " \
            "CheckpointException ranks:dict_keys([1])" in text, text
    else:
        assert re.search(r"rank 0 stops at step \d+ \([^)]*\): rank 1 failed at step 3", text), text


def test_a_rank_killed_under_mpiexec_ends_the_job_and_its_pid_names_the_rank() -> None:
    # Hydra SIGKILLs every rank the moment one dies, so nobody can speak after it; Hydra names
    # the dead pid, and rannc's start-up line maps pids to ranks.
    # Now and then rank 0's watchdog sees the dead pid before Hydra acts, and names it itself.
    # On a loaded machine Hydra (mpich 4) has once named the pid of rank 0, which it had just
    # killed itself in the clean-up (both exit with signal 9): one more launch for that race.
    for attempt in range(2):
        res, seconds = launch("mpiexec", "--where", "backward", "--how", "die")
        text = assert_failed_cleanly(res, seconds, TIMEOUT_S)
        pids = dict(re.findall(r"rank (\d+) pid (\d+) on", text))
        named = f"PID {pids['1']} " in text or f"rank 1 (pid {pids['1']}) died at step 3" in text
        if named or attempt == 1:
            break
        assert f"PID {pids['0']} " in text, text  # the race: Hydra named the other rank
    assert named, text


def test_a_rank_skipping_backward_is_a_timeout_error_not_a_hang() -> None:
    res, seconds = launch("mpiexec", "--where", "skip-backward")
    text = assert_failed_cleanly(res, seconds, 2 * TIMEOUT_S + 3)
    assert "RankFailure" in text and "Timed out" in text, text
    assert "backward() on every rank or on none" in text, text
    assert re.search(r"rank 1: step 4 \(forward\)", text), text


def test_torchrun_a_rank_raising_stops_every_rank_naming_it() -> None:
    res, seconds = launch("torchrun", "--where", "backward")
    text = assert_failed_cleanly(res, seconds, TIMEOUT_S)
    assert "rank 1 failed at step 3 (backward): ValueError: injected fault" in text, text
    assert re.search(r"rank 0 stops at step 3 \([^)]*\): rank 1 failed at step 3", text), text


def test_torchrun_a_rank_killed_is_named_with_its_step() -> None:
    res, seconds = launch("torchrun", "--where", "backward", "--how", "die")
    text = assert_failed_cleanly(res, seconds, TIMEOUT_S)
    # The step is published when it starts; the phase only as often as the watchdog polls.
    assert re.search(r"rank 1 \(pid \d+\) died at step 3 \((forward|backward)\)", text), text


@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
def test_a_rank_finishing_later_than_the_others_is_not_a_failure(launcher: str) -> None:
    # Rank 0 is done first (under mpiexec it hosts the store, so it waits for the others); the
    # watchdogs must not take a rank that exited normally for a dead one.
    run = run_mpi if launcher == "mpiexec" else run_torchrun
    res = run(SCRIPT, 2, ["--timeout-s", str(TIMEOUT_S), "--where", "none", "--linger", "2"],
              timeout=120, check=False)
    text = res.stdout + res.stderr
    assert res.returncode == 0, text
    assert "DONE rank 0" in text and "DONE rank 1" in text, text
    assert not re.search(r"\[rannc\] rank \d+ (stops|failed)", text), text


def test_a_rank_late_in_user_code_is_blamed_with_where_it_was_and_the_timeout_to_raise() -> None:
    # Rank 1 spends 12 s in its own code after backward of step 3 (slow data loading); rank 0
    # waits for it in the forward of step 4 until timeout_s = 5 s. The late rank is named, not
    # the one that waited.
    res, seconds = launch("mpiexec", "--where", "between", "--how", "sleep")
    text = assert_failed_cleanly(res, seconds, TIMEOUT_S + 5)
    assert "rank 0 failed" not in text, text
    assert re.search(r"rank 1 did not arrive within timeout_s=5 s: rank 0 waited for it in the "
                     r"forward of step 4 \(rank 1: after backward of step 3, in user code for "
                     r"\d+ s\)\. If that is expected \(slow data loading", text), text
    assert "raise timeout_s" in text, text
    # ... and the late rank itself says so when it is stopped.
    assert re.search(r"rank 1 stops at step 3 \(after backward\): rank 1 did not arrive", text), text


def test_a_rank_calling_state_dict_while_another_trains_is_named_not_a_gloo_abort() -> None:
    res, seconds = launch("mpiexec", "--where", "state-dict")
    text = assert_failed_cleanly(res, seconds, TIMEOUT_S)
    says = ("CallOrderError: ranks made different rannc calls at the same time (rank 0: forward "
            "(a call of the model); rank 1: state_dict())")
    assert text.count(says) >= 2, text  # on both ranks
    assert "stop every rank at the same step" in text, text
    assert "`sd = model.state_dict(); if rank == 0: torch.save(sd, path)`" in text, text
    assert "Received data size" not in text, text


def test_sigterm_from_a_user_says_the_process_was_terminated_by_a_signal() -> None:
    res, seconds = launch("mpiexec", "--where", "between", "--how", "sigterm")
    text = assert_failed_cleanly(res, seconds, TIMEOUT_S)
    assert "rank 1 stops at step 3 (after backward): this process was terminated by a signal " \
        "(SIGTERM" in text, text
    assert "usually because another rank failed" not in text, text


def test_torchrun_max_restarts_comes_back_and_resumes_from_the_latest_checkpoint(
        tmp_path: Path) -> None:
    # torchrun's agent store outlives the restart: without rannc's per-attempt key space the new
    # workers' gloo rendezvous read the dead attempt's addresses (connectFullMesh timed out), and
    # the new watchdog read the dead attempt's failure record and stopped at once.
    import torch

    script = SCRIPT.parent / "elastic_check.py"
    out = tmp_path / "final.pt"
    res = run_torchrun(script, 2, ["--ckpt", tmp_path / "ck", "--marker", tmp_path / "fault",
                                   "--out", out], timeout=150, check=False,
                       launcher_args=["--max-restarts=1"])
    text = res.stdout + res.stderr
    assert res.returncode == 0, text
    assert "injected fault on rank 1 at step 3" in text, text
    for rank in (0, 1):
        assert f"ATTEMPT 0 rank {rank} resumes at step 0" in text, text
        assert f"ATTEMPT 1 rank {rank} resumes at step 4" in text, text

    import importlib.util
    spec = importlib.util.spec_from_file_location("elastic_check", script)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model, opt = mod.make()
    for step in range(6):
        x, y = mod.batch(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    got = torch.load(out)
    for name, want in model.state_dict().items():
        torch.testing.assert_close(got[name], want, rtol=0, atol=1e-6, msg=name)
