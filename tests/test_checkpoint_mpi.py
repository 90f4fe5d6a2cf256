"""Checkpoints under mpiexec (gloo, CPU): gathered state dicts and optimizer state against the
unwrapped model, sharded checkpoints saved on 4 ranks (replicas 1,1,2) and loaded on 2 (two
stages), resume exactness, across ZeRO stages (saved under ZeRO-1, where GPT-2's last stage
and its embedding tied over three ranks keep each parameter's optimizer state on one holder;
resumed under 0, which saves again; loaded on 2 ranks under 1), a save killed before it is moved
into place, a resume bit-identical
to an uninterrupted run with an LR scheduler and dropout RNG (2 ranks), and a save called on rank
0 only (an error within seconds). The single-process layout tests are test_checkpoint_layout.py.

The launches build on each other (save -> resume, then a killed save -> load elsewhere), so they
are module fixtures, each run once; the tests read their outputs. GPT-2 has tied embeddings and
the ResNet BatchNorm statistics (placed one replica per stage and one microbatch, the layout in
which BatchNorm equals the unwrapped model on the global batch).

The 2-rank runs share two launches (tests/mpi_harness.py's CaseLaunches): the first runs
(interleaved save, uninterrupted exact run), then in new processes the runs that resume or load
from them, the bit-identical resume first.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from mpi_harness import TESTS, Case, CaseLaunches, case_launches_fixture, run_mpi, run_python

import rannc

# (timeout: the first test of a launch waits for all its cases)
pytestmark = [pytest.mark.layer("multi_rank"), pytest.mark.timeout(3600)]

SCRIPT = TESTS / "scripts" / "checkpoint_check.py"
MODELS = ("gpt2", "resnet")
ON_4 = ["--layout", "gpt2=1,1,2/2", "--layout", "resnet=1,1,1,1/1"]
ON_2 = ["--layout", "gpt2=1,1/2", "--layout", "resnet=1,1/1"]


def _in(name: str, *args: str) -> Callable[[Path], list[str]]:
    """Arguments with `--dir` the folder `name` beside the launches' folders (a later launch
    reads what an earlier one saved there)."""
    def make(launch: Path) -> list[str]:
        (launch.parent / name).mkdir(exist_ok=True)
        return [*args, "--dir", str(launch.parent / name)]
    return make


CASES = {
    "exact-train": Case(2, _in("exact", "--phase", "exact"), group="first"),
    "interleaved-save": Case(2, _in("interleaved", "--phase", "save", "--layout",
                                    "gpt2=1,1/2/interleaved_1f1b/4"), group="first"),
    "zbv-save": Case(2, _in("zbv", "--phase", "save", "--layout", "gpt2=1,1/2/zero_bubble_v/4"),
                     group="first"),
    # (new processes; the bit-identical resume first, in processes that ran nothing before)
    "exact-resume": Case(2, _in("exact", "--phase", "exact", "--resume"), group="second"),
    "interleaved-resume": Case(2, _in("interleaved", "--phase", "resume", "--layout", "gpt2=1,1/2"),
                               group="second"),
    "zbv-resume": Case(2, _in("zbv", "--phase", "resume", "--layout", "gpt2=1,1/2"), group="second"),
    "load": Case(2, _in("ckpt", "--phase", "load", *ON_2), {"RANNC_ZERO_STAGE": "1"}, group="second"),
}
launches = case_launches_fixture(SCRIPT, CASES)


@pytest.fixture(scope="module")
def ckpt_dir(launches: CaseLaunches) -> Path:
    path = launches.folder / "ckpt"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="module")
def second(launches: CaseLaunches, request: pytest.FixtureRequest) -> CaseLaunches:
    """The launches, once the runs the second 2-rank launch resumes or loads from have ended
    (whether they passed is their tests' to say: a load from a failed save fails on its own)."""
    if "load" in launches.wanted:
        try:
            request.getfixturevalue("resumed")
        except (Exception, pytest.fail.Exception):
            pass
    for c in ("exact-train", "interleaved-save", "zbv-save"):
        if c in launches.wanted:
            try:
                launches.result(c)
            except pytest.fail.Exception:
                pass
    return launches


@pytest.fixture(scope="module")
def saved(ckpt_dir: Path) -> subprocess.CompletedProcess[str]:
    return run_mpi(SCRIPT, 4, ["--phase", "save", "--dir", str(ckpt_dir), *ON_4],
                   env={"RANNC_ZERO_STAGE": "1"})


@pytest.fixture(scope="module")
def resumed(saved: subprocess.CompletedProcess[str],
            ckpt_dir: Path) -> subprocess.CompletedProcess[str]:
    """New processes resume from the checkpoint, then rank 0 dies inside another save."""
    return run_mpi(SCRIPT, 4, ["--phase", "resume", "--dir", str(ckpt_dir), *ON_4, "--crash"],
                   check=False, env={"RANNC_ZERO_STAGE": "0"})


@pytest.fixture(scope="module")
def loaded(second: CaseLaunches) -> subprocess.CompletedProcess[str]:
    return second.result("load")


def _passed(out: str, what: str, model: str) -> list[str]:
    return sorted(re.findall(rf"PASS {what} {model} rank (\d+)", out))


def test_state_dict_and_optimizer_state_round_trip(saved: subprocess.CompletedProcess[str]) -> None:
    """Gathered state dict == reference (strict load into the unwrapped model); optimizer state
    by name == reference; load_state_dict before and after the first call; reloaded optimizer
    state gives the reference's next step."""
    assert "ZeRO-1" in saved.stderr, saved.stderr  # (the plan table rank 0 prints)
    for model in MODELS:
        assert _passed(saved.stdout, "state_dict", model) == ["0", "1", "2", "3"], saved.stdout
        assert _passed(saved.stdout, "save", model) == ["0", "1", "2", "3"], saved.stdout


def test_resume_after_3_steps_equals_6_steps(resumed: subprocess.CompletedProcess[str]) -> None:
    for model in MODELS:
        assert _passed(resumed.stdout, "resume", model) == ["0", "1", "2", "3"], resumed.stdout


@pytest.mark.cases("load")
def test_killed_save_leaves_the_last_checkpoint(resumed: subprocess.CompletedProcess[str],
                                                loaded: subprocess.CompletedProcess[str],
                                                ckpt_dir: Path) -> None:
    """The killed save left its temporary directory; the load run (state dict equal to the
    step-3 one, bit for bit) read the previous checkpoint."""
    assert "CRASHING rank 0" in resumed.stdout and resumed.returncode != 0, resumed.stdout
    assert list((ckpt_dir / "gpt2").glob(".tmp-*")), list((ckpt_dir / "gpt2").iterdir())
    assert rannc.latest_checkpoint(ckpt_dir / "gpt2") == str(ckpt_dir / "gpt2" / "v-000002")
    assert _passed(loaded.stdout, "load", "gpt2") == ["0", "1"], loaded.stdout


@pytest.mark.cases("load")
def test_checkpoint_from_4_ranks_loads_on_2(loaded: subprocess.CompletedProcess[str]) -> None:
    """Saved by replicas 1,1,2 on 4 ranks, loaded after deployment by 2 stages on 2 ranks:
    the same state, and the next 3 steps' losses equal the 4-rank continuation."""
    for model in MODELS:
        assert _passed(loaded.stdout, "load", model) == ["0", "1"], loaded.stdout


@pytest.mark.parametrize(("case", "schedule"), [
    pytest.param("interleaved", "interleaved_1f1b",
                 marks=pytest.mark.cases("interleaved-save", "interleaved-resume")),
    pytest.param("zbv", "zero_bubble_v", marks=pytest.mark.cases("zbv-save", "zbv-resume"))])
def test_interleaved_checkpoint_loads_on_one_stage_per_rank(case: str, schedule: str,
                                                            second: CaseLaunches) -> None:
    """Interleaved 1F1B or ZB-V, 4 stages on 2 ranks (each rank two non-adjacent stages: s and
    s + 2, or s and 3 - s, so under ZB-V the embedding and the tied LM head are both rank 0's):
    state dict, optimizer state and checkpoint as in the save phase; new processes on 2 stages
    of one rank each resume from it and continue exactly as the two-stages-per-rank run did."""
    save = second.result(f"{case}-save")
    assert _passed(save.stdout, "save", "gpt2") == ["0", "1"], save.stdout
    assert schedule in save.stderr, save.stderr  # (the plan table rank 0 prints)
    res = second.result(f"{case}-resume")
    assert _passed(res.stdout, "resume", "gpt2") == ["0", "1"], res.stdout


@pytest.mark.layer("single_process")
def test_single_process(tmp_path: Path) -> None:
    res = run_python(SCRIPT, ["--phase", "single", "--dir", str(tmp_path), "--layout", "gpt2"])
    assert "PASS single gpt2 rank 0" in res.stdout, res.stdout


@pytest.mark.cases("exact-train", "exact-resume")
def test_resume_is_bit_identical_with_scheduler_and_dropout_rng(second: CaseLaunches) -> None:
    """2 ranks (two stages, dropout in both): 6 uninterrupted steps saving after step 3, then
    new processes resume from that checkpoint with the LR scheduler, a Stateful step counter
    and RNGState: steps 4-6 give the same losses, parameters and learning rate, bit for bit."""
    train = second.result("exact-train")
    assert sorted(re.findall(r"PASS exact-train rank (\d)", train.stdout)) == ["0", "1"], train.stdout
    res = second.result("exact-resume")
    assert sorted(re.findall(r"PASS exact-resume rank (\d)", res.stdout)) == ["0", "1"], res.stdout


@pytest.mark.parametrize("then", ["step", "exit"])
def test_save_on_rank_0_only_fails_fast(tmp_path: Path, then: str) -> None:
    """`if rank == 0: model.save_checkpoint(d)`: an error saying to call it on every rank,
    within seconds (the collective would wait timeout_s = 60 s)."""
    res = run_mpi(SCRIPT, 2, ["--phase", "rank0-only", "--dir", str(tmp_path), "--then", then],
                  check=False, timeout=150)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "SAVING rank 0" in out, out
    assert "call save_checkpoint on every rank" in out, out
    took = re.search(r"REFUSED after ([\d.]+) s", out)
    assert took is not None and float(took[1]) < 10, out
