"""The stage DP (native) against its plain Python recurrence and against exhaustive search."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rannc.stage_dp.dp import (
    exhaustive,
    exhaustive_by_position,
    split_value,
    stage_dp,
    stage_dp_by_position,
    stage_dp_by_position_reference,
    stage_dp_reference,
)

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


def positional_tables(rng: np.random.Generator, k: int, devices: int, positions: int,
                      cap: float) -> list[np.ndarray]:
    """One table per in-flight count n = 1..positions, as 1F1B's memory model makes them: the
    same stage costs the same time, but its activations count n times against the cap."""
    t = rng.uniform(0.1, 3.0, size=k) + 0.05
    mem_p = rng.uniform(0.5, 2.0, size=k)
    mem_a = rng.uniform(0.2, 1.5, size=k)
    hs = []
    for n in range(1, positions + 1):
        h = np.full((k, k, devices + 1), math.inf)
        for lo in range(k):
            for r in range(lo, k):
                for d in range(1, devices + 1):
                    if mem_p[lo:r + 1].sum() + n * mem_a[lo:r + 1].sum() / d <= cap:
                        h[lo, r, d] = t[lo:r + 1].sum() / d + 0.05 * (d - 1) + 0.1
        hs.append(h)
    return hs


@pytest.mark.parametrize("seed", range(30))
def test_positional_dp_matches_exhaustive_search(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    k, devices = int(rng.integers(1, 8)), int(rng.integers(1, 6))
    hs = positional_tables(rng, k, devices, devices, float(rng.uniform(2.0, 10.0)))
    table_of = list(range(devices))  # 1F1B: the j-th stage from the end holds j microbatches
    native = stage_dp_by_position(hs, table_of, devices, devices)
    ref = stage_dp_by_position_reference(hs, table_of, devices, devices)
    for s in range(1, devices + 1):
        best = exhaustive_by_position(hs, table_of, devices, s)
        got = native[s - 1]
        assert got.value == pytest.approx(best, rel=1e-12) or got.value == best == math.inf
        assert ref[s - 1] == got
        if got.feasible:
            assert len(got.replicas) == s and sum(got.replicas) == devices
            assert got.bounds[0] == 0 and got.bounds[-1] == k
            assert max(float(hs[table_of[s - i - 1]][got.bounds[i], got.bounds[i + 1] - 1, got.replicas[i]])
                       for i in range(s)) == got.value


@pytest.mark.parametrize("seed", range(10))
def test_positional_dp_with_one_table_is_the_stage_dp(seed: int) -> None:
    rng = np.random.default_rng(200 + seed)
    k, devices = int(rng.integers(1, 9)), int(rng.integers(1, 7))
    h = random_table(rng, k, devices, None if seed % 2 else 8.0)
    got = stage_dp_by_position([h], [0] * devices, devices, devices)
    want = stage_dp(h, devices, devices)
    assert [g.value for g in got] == [w.value for w in want]


def test_a_plan_that_fits_only_when_later_stages_hold_fewer_microbatches() -> None:
    """Two blocks with activations 1, parameters 1 (first) and 1.5 (last), cap 3, one device
    each, 1F1B: budgeted for the first stage's two microbatches in flight, the last stage does
    not fit (1.5 + 2 > 3); by position it holds one (1.5 + 1) and the split exists."""
    def table(n: int) -> np.ndarray:
        h = np.full((2, 2, 3), math.inf)
        for b, params in ((0, 1.0), (1, 1.5)):
            if params + n * 1.0 <= 3.0:
                h[b, b, 1] = 1.0
        return h
    assert not stage_dp(table(2), devices=2, s_max=2)[1].feasible
    got = stage_dp_by_position([table(1), table(2)], [0, 1], devices=2, s_max=2)
    assert got[1].feasible and got[1].bounds == (0, 1, 2) and got[1].replicas == (1, 1)


def test_bad_positional_tables_are_refused() -> None:
    h = np.ones((2, 2, 3))
    with pytest.raises(ValueError, match="name one of the 1 tables"):
        stage_dp_by_position([h], [0, 1], devices=2, s_max=2)
    with pytest.raises(ValueError, match="shape"):
        stage_dp_by_position([h, np.ones((3, 3, 3))], [0, 1], devices=2, s_max=2)


# -- several stages per lane (ZB-V, interleaved): balance the lanes, not the stages -------------
def _run_costs(block_costs: list[float]) -> np.ndarray:
    """h[l, r]: the sum of blocks l..r (inf below the diagonal), as the stage tables give it."""
    k = len(block_costs)
    c = np.concatenate([[0.0], np.cumsum(block_costs)])
    h = np.full((k, k), math.inf)
    for lo in range(k):
        h[lo, lo:] = c[lo + 1:] - c[lo]
    return h


def _lane_loads(h: np.ndarray, bounds: tuple[int, ...], lanes: tuple[int, ...]) -> list[float]:
    out = [0.0] * (max(lanes) + 1)
    for s, lane in enumerate(lanes):
        out[lane] += float(h[bounds[s], bounds[s + 1] - 1])
    return out


def test_zero_bubble_v_bounds_balance_each_device_not_each_stage() -> None:
    """An LLM-like chain: a light embedding, 12 equal layers, a head of 6. ZB-V runs stage d
    and 2P - 1 - d on device d, so stage 0 (embedding) and stage 3 (head) share a device; the
    slowest-stage split leaves that device far busier than the other, the lane split evens them
    out, and the best split under exhaustive search has the same slowest device."""
    import itertools

    from rannc.schedule import default_placement
    from rannc.stage_dp.search import balance_lanes, min_max_bounds, split_options

    h = _run_costs([0.2] + [1.0] * 12 + [6.0])
    hs = [h] * 4
    lanes = default_placement("zero_bubble_v", 4)
    assert lanes == (0, 1, 1, 0)
    first = min_max_bounds(hs)
    assert first is not None
    balanced = balance_lanes(hs, lanes, first)
    before, after = max(_lane_loads(h, first, lanes)), max(_lane_loads(h, balanced, lanes))
    assert after < before
    k = h.shape[0]
    exhaustive = min(max(_lane_loads(h, (0, *cuts, k), lanes))
                     for cuts in itertools.combinations(range(1, k), 3))
    assert after == pytest.approx(exhaustive)
    assert split_options(hs, "zero_bubble_v") == [first, balanced]
    # one stage per lane: the slowest stage is the slowest device, one option
    assert split_options(hs, "1f1b") == [first]
