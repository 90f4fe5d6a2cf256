"""The stage DP (native) against its plain Python recurrence and against exhaustive search."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rannc.stage_dp.dp import exhaustive, split_value, stage_dp, stage_dp_reference

pytestmark = pytest.mark.layer("pure")


def random_table(rng: np.random.Generator, k: int, devices: int, mem_cap: float | None) -> np.ndarray:
    """Costs shaped like real stages: a stage's time is the sum of its blocks' times split over its
    replicas plus a per-replica overhead; memory (parameters + activations / replicas) must fit."""
    t = rng.uniform(0.1, 3.0, size=k) * (rng.random(k) < 0.8) + rng.uniform(0.0, 0.2, size=k)
    mem_p = rng.uniform(0.5, 2.0, size=k)
    mem_a = rng.uniform(0.5, 3.0, size=k)
    h = np.full((k, k, devices + 1), math.inf)
    for lo in range(k):
        for r in range(lo, k):
            for d in range(1, devices + 1):
                mem = mem_p[lo:r + 1].sum() + mem_a[lo:r + 1].sum() / d
                if mem_cap is None or mem <= mem_cap:
                    h[lo, r, d] = t[lo:r + 1].sum() / d + 0.05 * (d - 1) + 0.1
    return h


@pytest.mark.parametrize("seed", range(40))
def test_dp_matches_exhaustive_search(seed: int) -> None:
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 9))
    devices = int(rng.integers(1, 7))
    cap = None if seed % 3 == 0 else float(rng.uniform(2.0, 12.0))
    h = random_table(rng, k, devices, cap)
    native = stage_dp(h, devices, devices)
    ref = stage_dp_reference(h, devices, devices)
    for s in range(1, devices + 1):
        best = exhaustive(h, devices, s)
        got = native[s - 1].value
        assert got == pytest.approx(best, rel=1e-12) or got == best == math.inf
        assert ref[s - 1].value == native[s - 1].value
        if native[s - 1].feasible:
            sol = native[s - 1]
            assert len(sol.replicas) == s and sum(sol.replicas) == devices
            assert sol.bounds[0] == 0 and sol.bounds[-1] == k
            assert all(a < b for a, b in zip(sol.bounds, sol.bounds[1:], strict=False))
            assert split_value(h, sol.bounds, sol.replicas) == sol.value


def test_bad_tables_are_refused() -> None:
    with pytest.raises(ValueError, match="shape"):
        stage_dp(np.zeros((3, 3, 2)), devices=2, s_max=2)
    h = np.zeros((2, 2, 3))
    h[0, 0, 1] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        stage_dp(h, devices=2, s_max=2)


def test_more_stages_than_blocks_is_infeasible() -> None:
    h = np.ones((2, 2, 4))
    sols = stage_dp(h, devices=3, s_max=3)
    assert sols[0].feasible and sols[1].feasible and not sols[2].feasible
