"""Phase 3 (paper III-C, Algorithm 1): stages as runs of consecutive blocks, and how many
replicas each stage gets, minimising the slowest stage.

The input is a cost table `h[l][r][d]`: the time of one microbatch through the stage made of
blocks l..r (inclusive) when it has d replicas, `inf` where that stage does not fit device
memory. Building the table (profiles, memory model, communication) is the planner's job
(`rannc.planner`); this module only searches. `stage_dp` runs the native DP (`rannc._C`);
`stage_dp_reference` is the same recurrence in plain Python and `exhaustive` enumerates every
split, for the tests.

A stage's memory can depend on its position: under 1F1B the stage j-th from the end holds
min(j, M) microbatches in flight. `stage_dp_by_position` takes a table per position, counted
from the end (it runs over the blocks reversed, so the stage it adds is always the j-th from
the end, whatever the final stage count); `stage_dp_by_position_reference` and
`exhaustive_by_position` are its plain versions.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

INF = math.inf


@dataclass(frozen=True, slots=True)
class StageSplit:
    value: float  # the slowest stage's time (inf: infeasible)
    bounds: tuple[int, ...]  # S+1 block boundaries: stage i holds blocks bounds[i] .. bounds[i+1]-1
    replicas: tuple[int, ...]  # per stage

    @property
    def feasible(self) -> bool:
        return self.value < INF


def _check(h: np.ndarray, devices: int) -> tuple[int, int]:
    if h.ndim != 3 or h.shape[0] != h.shape[1] or h.shape[2] != devices + 1:
        raise ValueError(f"the cost table must have shape (k, k, devices+1) = (k, k, {devices + 1}); "
                         f"got {h.shape}")
    if np.isnan(h).any():
        raise ValueError("the cost table holds NaN; mark infeasible stages with inf")
    return h.shape[0], devices


def stage_dp(h: np.ndarray, devices: int, s_max: int) -> list[StageSplit]:
    """The best split for every stage count S = 1..s_max (index S-1), using exactly `devices`."""
    from rannc import _C  # type: ignore[attr-defined]

    k, _ = _check(h, devices)
    raw = _C.stage_dp(k, devices, s_max, np.ascontiguousarray(h, dtype=np.float64).ravel().tolist())
    return [StageSplit(float(v), tuple(b), tuple(r)) for v, b, r in raw]


def stage_dp_reference(h: np.ndarray, devices: int, s_max: int) -> list[StageSplit]:
    """The recurrence of `csrc/stage_dp.cpp`, written plainly."""
    k, _ = _check(h, devices)
    n_s = min(s_max, k, devices)
    E: dict[tuple[int, int, int], tuple[float, int, int]] = {(0, 0, 0): (0.0, -1, -1)}
    for s in range(1, n_s + 1):
        for b in range(s, k + 1):
            for d in range(s, devices + 1):
                best = (INF, -1, -1)
                for bp in range(s - 1, b):
                    for dp in range(s - 1, d):
                        prev = E.get((s - 1, bp, dp), (INF, -1, -1))[0]
                        v = max(prev, float(h[bp, b - 1, d - dp]))
                        if v < best[0]:
                            best = (v, bp, dp)
                E[(s, b, d)] = best
    out = []
    for s in range(1, s_max + 1):
        v = E.get((s, k, devices), (INF, -1, -1))[0]
        if v == INF:
            out.append(StageSplit(INF, (), ()))
            continue
        bounds, reps = [k], []
        b, d = k, devices
        for i in range(s, 0, -1):
            _, pb, pd = E[(i, b, d)]
            bounds.append(pb)
            reps.append(d - pd)
            b, d = pb, pd
        out.append(StageSplit(v, tuple(reversed(bounds)), tuple(reversed(reps))))
    return out


def _tables_and_positions(hs: Sequence[np.ndarray], table_of: Sequence[int], devices: int,
                          s_max: int) -> int:
    if not hs:
        raise ValueError("stage_dp_by_position needs at least one cost table")
    k, _ = _check(hs[0], devices)
    for h in hs[1:]:
        if h.shape != hs[0].shape:
            raise ValueError(f"every cost table must have the shape {hs[0].shape}; got {h.shape}")
        _check(h, devices)
    need = min(s_max, k, devices)
    if len(table_of) < need or any(not 0 <= t < len(hs) for t in table_of):
        raise ValueError(f"table_of must name one of the {len(hs)} tables for each of the "
                         f"{need} positions; got {list(table_of)}")
    return k


def stage_dp_by_position(hs: Sequence[np.ndarray], table_of: Sequence[int], devices: int,
                         s_max: int) -> list[StageSplit]:
    """The best split for every stage count S = 1..s_max, the j-th stage from the end (the last:
    j = 1) costed with `hs[table_of[j - 1]]`."""
    from rannc import _C  # type: ignore[attr-defined]

    k = _tables_and_positions(hs, table_of, devices, s_max)
    flat = np.concatenate([np.ascontiguousarray(h, dtype=np.float64).ravel() for h in hs])
    raw = _C.stage_dp_by_position(k, devices, s_max, flat.tolist(), [int(t) for t in table_of])
    return [StageSplit(float(v), tuple(b), tuple(r)) for v, b, r in raw]


def stage_dp_by_position_reference(hs: Sequence[np.ndarray], table_of: Sequence[int], devices: int,
                                   s_max: int) -> list[StageSplit]:
    """The recurrence of `csrc/stage_dp.cpp`'s `stage_dp_by_position`, written plainly."""
    k = _tables_and_positions(hs, table_of, devices, s_max)
    n_s = min(s_max, k, devices)
    F: dict[tuple[int, int, int], tuple[float, int, int]] = {(0, k, 0): (0.0, -1, -1)}
    for j in range(1, n_s + 1):
        h = hs[table_of[j - 1]]
        for b in range(k - j, -1, -1):
            for d in range(j, devices + 1):
                best = (INF, -1, -1)
                for bn in range(b + 1, k - (j - 1) + 1):
                    for dn in range(j - 1, d):
                        rest = F.get((j - 1, bn, dn), (INF, -1, -1))[0]
                        v = max(rest, float(h[b, bn - 1, d - dn]))
                        if v < best[0]:
                            best = (v, bn, dn)
                F[(j, b, d)] = best
    out = []
    for s in range(1, s_max + 1):
        v = F.get((s, 0, devices), (INF, -1, -1))[0]
        if v == INF:
            out.append(StageSplit(INF, (), ()))
            continue
        bounds, reps = [0], []
        b, d = 0, devices
        for j in range(s, 0, -1):
            _, nb, nd = F[(j, b, d)]
            bounds.append(nb)
            reps.append(d - nd)
            b, d = nb, nd
        out.append(StageSplit(v, tuple(bounds), tuple(reps)))
    return out


def exhaustive_by_position(hs: Sequence[np.ndarray], table_of: Sequence[int], devices: int,
                           stages: int) -> float:
    """`exhaustive` with stage i of `stages` costed by `hs[table_of[stages - i - 1]]`."""
    k = _tables_and_positions(hs, table_of, devices, stages)
    best = INF
    if stages > k or stages > devices:
        return best
    for cuts in itertools.combinations(range(1, k), stages - 1):
        bounds = (0, *cuts, k)
        for dcuts in itertools.combinations(range(1, devices), stages - 1):
            ds = (0, *dcuts, devices)
            v = max(float(hs[table_of[stages - i - 1]][bounds[i], bounds[i + 1] - 1, ds[i + 1] - ds[i]])
                    for i in range(stages))
            best = min(best, v)
    return best


def split_value(h: np.ndarray, bounds: tuple[int, ...], replicas: tuple[int, ...]) -> float:
    """The slowest stage of a given split."""
    return max(float(h[bounds[i], bounds[i + 1] - 1, replicas[i]]) for i in range(len(replicas)))


def exhaustive(h: np.ndarray, devices: int, stages: int) -> float:
    """The optimum over every split into `stages` runs and every replica assignment summing to
    `devices` (small instances only)."""
    k, _ = _check(h, devices)
    best = INF
    if stages > k or stages > devices:
        return best
    for cuts in itertools.combinations(range(1, k), stages - 1):
        bounds = (0, *cuts, k)
        for dcuts in itertools.combinations(range(1, devices), stages - 1):
            ds = (0, *dcuts, devices)
            reps = tuple(ds[i + 1] - ds[i] for i in range(stages))
            best = min(best, split_value(h, bounds, reps))
    return best
