"""The schedule registry (pure): every part of rannc reads a schedule's meaning from its
`ScheduleSpec`, so a schedule registered there is accepted by Config, built, validated,
simulated and planned with no other file knowing its name."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import rannc
from rannc.errors import ConfigError
from rannc.schedule import (
    SCHEDULES,
    Action,
    Op,
    ScheduleError,
    ScheduleSpec,
    StageCosts,
    StageLine,
    chain,
    get_spec,
    in_flight,
    make_schedule,
    registered,
    simulate,
    validate,
)
from rannc.schedule.actions import pending_w

pytestmark = pytest.mark.layer("pure")


def _fifo_fill_drain(line: StageLine) -> list[Action]:
    """Fill-drain whose backwards run in forward order (a made-up schedule for the test)."""
    acts: list[Action] = []
    for m in range(line.microbatches):
        acts += line.forward(m)
    for m in range(line.microbatches):
        acts += line.backward(m)
    return acts


FIFO = ScheduleSpec("fifo", _fifo_fill_drain, eager=False, recompute_last=False,
                    in_flight=lambda S, M: M, summary="fill-drain, backwards first-in first-out")


@pytest.mark.parametrize(("name", "S", "M"), list(itertools.product(SCHEDULES, [1, 2, 4], [1, 3, 8])))
def test_the_in_flight_bound_is_what_the_lines_hold(name: str, S: int, M: int) -> None:
    spec = get_spec(name)
    if spec.chunks > 1 and (S % spec.chunks or M > S // spec.chunks and M % (S // spec.chunks)):
        return  # refused (tests/test_schedule.py)
    held = [n for n, _ in in_flight(make_schedule(name, M, chain(S), [False] * S))]
    assert max(held) == spec.in_flight(S, M)


def test_recompute_last_comes_from_the_spec() -> None:
    for name, spec in SCHEDULES.items():
        S = 3 * spec.chunks
        sched = make_schedule(name, 4 if spec.chunks == 1 else 3, chain(S), [True] * S)
        last_recomputes = any(a.op is Op.R for a in sched.actions[-1])
        assert last_recomputes == spec.recompute_last, name


def test_an_unknown_schedule_names_the_known_ones() -> None:
    with pytest.raises(ScheduleError, match=r"unknown schedule '1f1c'.*Did you mean '1f1b'"):
        make_schedule("1f1c", 2, chain(2), [False, False])


def test_a_registered_schedule_is_accepted_simulated_and_planned() -> None:
    with pytest.raises(ConfigError, match="schedule must be one of"):
        rannc.Config(schedule="fifo")
    with registered(FIFO):
        assert rannc.Config(schedule="fifo").schedule == "fifo"
        assert rannc.Config.resolve(environ={"RANNC_SCHEDULE": "fifo"}).schedule == "fifo"
        sched = make_schedule("fifo", 4, chain(3), [True] * 3)
        validate(sched)
        assert [a for a in sched.actions[2] if a.op is Op.B][0].micro == 0
        assert not any(a.op is Op.R for a in sched.actions[2])  # recompute_last=False
        tl = simulate(sched, StageCosts.uniform(3))
        assert tl.iteration_time > 0

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                              nn.Linear(16, 4))
        cluster = rannc.Cluster.homogeneous("V100-32GB", n=2, per_node=2)
        plan = rannc.plan(model, (torch.randn(8, 8),), cluster=cluster,
                          config=rannc.Config(schedule="fifo", partition_num=2, microbatches=2))
        assert plan.schedule == "fifo"
    assert "fifo" not in SCHEDULES
    with pytest.raises(ConfigError, match="schedule must be one of"):
        rannc.Config(schedule="fifo")


@pytest.mark.parametrize(("name", "S", "M"), list(itertools.product(SCHEDULES, [1, 2, 4, 6], [1, 3, 8])))
def test_the_pending_bound_is_what_the_lines_hold(name: str, S: int, M: int) -> None:
    # (the gradients a split backward keeps from B for W: `actions.pending_w`)
    spec = get_spec(name)
    if spec.chunks > 1 and (S % spec.chunks or M > S // spec.chunks and M % (S // spec.chunks)):
        return  # refused (tests/test_schedule.py)
    assert max(pending_w(make_schedule(name, M, chain(S), [False] * S))) == spec.pending(S, M)
