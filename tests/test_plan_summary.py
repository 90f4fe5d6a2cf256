"""Plan.summary(): the plan table rank 0 prints, read by eye, so its columns must line up; and
the stage predictions it shows, as plan files store them (old files included)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import rannc
from rannc.errors import PlanMismatchError
from rannc.plans import StagePlan, StagePrediction, fmt_ranks, stage_ranks

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
            predicted=StagePrediction(forward_s=1.5 * 10.0 ** (s - 3), backward_s=3e-3 * (s + 1),
                                      memory_bytes=1.2e9 * 10 ** s, microbatch_rows=2.0 ** (s + 1)),
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


# A plan file as rannc wrote it while predictions were a dict of floats (block indices and
# in-flight counts stored as 3.0): the plan of `rannc plan` for a 2-stage split, trimmed.
_OLD_FILE = {
    "format": 1, "microbatches": 4, "world_size": 2, "fingerprint": "f", "schedule": "1f1b",
    "predicted_iteration_time": 0.5, "batch_size": 8, "blocks": 32, "zero_stage": 0,
    "stages": [
        {"index": 0, "components": [0, 1], "ranks": [0], "shares": [1.0], "recompute": 0.0,
         "param_names": ["a.weight"], "modules": "a", "devices": [],
         "predicted": {"forward_s": 0.1, "backward_s": 0.2, "allreduce_s": 0.0,
                       "memory_bytes": 1.5e9, "microbatch_rows": 2.0, "in_flight": 2.0,
                       "recompute_memory_fraction": 0.0, "recompute_s": 0.0,
                       "first_block": 0.0, "last_block": 3.0}},
        {"index": 1, "components": [2], "ranks": [1], "shares": [1.0], "recompute": 0.0,
         "param_names": [], "modules": "b", "devices": [],
         "predicted": {"forward_s": 0.1, "backward_s": 0.2, "recompute_s": 0.0,
                       "allreduce_s": 0.0, "memory_bytes": 1e9, "microbatch_rows": 2.0,
                       "first_block": 4.0, "last_block": 31.0}}]}


def test_a_plan_file_from_before_typed_predictions_loads(tmp_path: Path) -> None:
    path = tmp_path / "old.json"
    path.write_text(json.dumps(_OLD_FILE))
    plan = rannc.Plan.load(path)
    p0, p1 = (st.predicted for st in plan.stages)
    assert p0 is not None and p1 is not None
    assert (p0.first_block, p0.last_block, p0.in_flight) == (0, 3, 2)
    assert isinstance(p0.last_block, int) and isinstance(p0.in_flight, int)
    assert p1.in_flight is None and p1.recompute_memory_fraction is None  # not stored: unknown
    assert p0["memory_bytes"] == 1.5e9 and p1.get("in_flight") is None  # the dict spelling
    assert "1.50 GB" in plan.summary()
    # saved again, it is the same plan, and the file keeps the old keys
    plan.save(tmp_path / "new.json")
    again = json.loads((tmp_path / "new.json").read_text())
    assert rannc.Plan.load(tmp_path / "new.json") == plan
    assert set(again["stages"][0]["predicted"]) == set(_OLD_FILE["stages"][0]["predicted"])
    assert set(again["stages"][1]["predicted"]) == set(_OLD_FILE["stages"][1]["predicted"])


@pytest.mark.parametrize("bad,match", [({"forward_s": 0.1, "backward_s": 0.2, "speed": 3.0}, "speed"),
                                        ({"forward_s": 0.1}, "lack"),
                                        ({"forward_s": 0.1, "backward_s": 0.2, "first_block": 2.5},
                                         "first_block")])
def test_predictions_this_version_cannot_read_are_a_plan_mismatch(
        tmp_path: Path, bad: dict[str, float], match: str) -> None:
    d = json.loads(json.dumps(_OLD_FILE))
    d["stages"][1]["predicted"] = bad
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(PlanMismatchError, match=match):
        rannc.Plan.load(path)
