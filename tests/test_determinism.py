"""With a seed, deterministic mode and the same plan, two runs of 20 training steps on 3 ranks
(a pipeline with a replicated stage, dropout, recomputation) give bit-identical parameters.

The same plan: the planner prices the graph on this machine's speeds, measured at start-up, so
two runs can cut the model one component apart (this one did, about every other launch: the
splits' sums round differently). The first run saves its plan, the second loads it, as the
README tells users who need bit-identical runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from mpi_harness import run_mpi

SCRIPT = Path(__file__).resolve().parent / "scripts" / "determinism_check.py"
DIGEST = re.compile(r"DIGEST ([0-9a-f]{64}) initial ([0-9a-f]{64}) loss (\S+)")

pytestmark = [pytest.mark.timeout(600), pytest.mark.layer("multi_rank")]


def test_two_seeded_runs_end_with_bit_identical_parameters(tmp_path: Path) -> None:
    runs = []
    plan = tmp_path / "plan.json"
    for how in ("--save-plan", "--load-plan"):
        res = run_mpi(SCRIPT, 3, ["--seed", "0", "--steps", "20", how, str(plan)], timeout=280)
        m = DIGEST.search(res.stdout)
        assert m, res.stdout + res.stderr
        runs.append(m)
    assert runs[0][1] != runs[0][2]  # the 20 steps changed the parameters ...
    assert runs[0][1] == runs[1][1], (runs[0][0], runs[1][0])  # ... the same way, to the bit
