"""Plan.summary(): the plan table rank 0 prints, read by eye, so its columns must line up."""

from __future__ import annotations

import pytest

import rannc
from rannc.plans import StagePlan, fmt_ranks, stage_ranks

pytestmark = pytest.mark.layer("pure")


@pytest.mark.parametrize(("ranks", "text"), [
    ((0, 1, 2, 3, 6), "0-3,6"), ((4, 5), "4,5"), ((7,), "7"), ((3, 1, 2, 0), "0-3"),
    (tuple(range(0, 32, 4)), "0,4,8,12,16,20,24,28"), ((), "-"),
])
def test_rank_lists_are_compressed_into_ranges(ranks: tuple[int, ...], text: str) -> None:
    assert fmt_ranks(ranks) == text


def _plan(world: int, replicas: list[int]) -> rannc.Plan:
    ranks = stage_ranks(replicas, world)
    stages = []
    for s, rs in enumerate(ranks):
        shares = tuple(1.0 / len(rs) for _ in rs)
        if s == 1:  # uneven shares: listed rank by rank
            shares = tuple(x / sum(range(1, len(rs) + 1)) for x in range(1, len(rs) + 1))
        stages.append(StagePlan(
            index=s, components=tuple(range(100 * s, 100 * s + 10 ** s)), ranks=rs, shares=shares,
            recompute=s / 4, param_names=tuple(f"p{i}" for i in range(3 * s)),
            predicted={"forward_s": 1.5 * 10.0 ** (s - 3), "backward_s": 3e-3 * (s + 1),
                       "memory_bytes": 1.2e9 * 10 ** s, "microbatch_rows": 2.0 ** (s + 1)},
            modules=f"encoder.layer.{s} .. encoder.layer.{3 * s + 1}"))
    return rannc.Plan(stages=tuple(stages), microbatches=8, world_size=world, fingerprint="x",
                      schedule="1f1b", predicted_iteration_time=0.25, batch_size=256, blocks=32)


def test_every_row_puts_each_column_at_the_same_position() -> None:
    plan = _plan(64, [12, 2, 1, 1])  # 4 copies: stage 0 holds 48 ranks, stage 1 uneven shares
    lines = plan.summary().splitlines()
    header, rows = lines[1], lines[2:]
    assert len(rows) == 4
    assert "0-11,16-27,32-43,48-59" in rows[0]
    assert "12:0.03" in rows[1]  # shares stay visible per rank
    names = header.split()
    for name in names:
        start = header.index(name)
        end = start + len(name)
        for row in rows:
            if name in ("ranks", "modules"):  # left-aligned: every cell starts where its label does
                assert row[start - 2:start] == "  " and row[start] != " ", (name, row)
            else:  # right-aligned: every cell ends where its label ends
                assert row[end - 1] != " " and row[end:end + 2] == "  ", (name, row)
    assert all(line == line.rstrip() for line in lines)
