"""Which sends a receive proves arrived (`rannc.pipeline.arrivals`), without a process group:
every line of every registered schedule is run by a simulated set of ranks (each action runs
once what it receives has been sent), each rank dropping its sends as the messages it receives
prove them taken. Each drop must be of a message its receiver has really taken, and what a rank
holds must stay what its schedule keeps in flight, not grow with the microbatches."""

from __future__ import annotations

from collections import defaultdict

import pytest

from rannc.pipeline.arrivals import Arrivals
from rannc.pipeline.routes import OWNERS
from rannc.pipeline.transport import Key, Kind
from rannc.schedule import SCHEDULES, Action, Op, Schedule, chain, in_flight, make_schedule

pytestmark = pytest.mark.layer("pure")


class ChainRoutes:
    """The routes of a chain: stage s computes value "s", read by stage s + 1; stage 0 reads
    the model input "x" from its owners."""

    def supplier(self, v: str, t: int) -> int:
        return OWNERS if v == "x" else int(v)


Msg = tuple[int, int, Key]  # (from lane, to lane, key)


def _messages(sched: Schedule) -> tuple[dict[Action, list[Msg]], dict[Action, list[Msg]]]:
    """Per action, the messages between lanes it sends and those it receives, as the executor
    does: a stage's outputs in SF (F where it has none), its input gradients in SB (B where
    none), its inputs in RF (F where none), its outputs' gradients in RB (B where none)."""
    acts = {a for line in sched.actions for a in line}
    sends: dict[Action, list[Msg]] = defaultdict(list)
    recvs: dict[Action, list[Msg]] = defaultdict(list)
    S, lane = sched.stages, sched.lane_of

    def at(op: Op, alt: Op, s: int, m: int) -> Action:
        a = Action(s, m, op)
        return a if a in acts else Action(s, m, alt)

    for m in range(sched.microbatches):
        for s in range(S - 1):
            if lane(s) == lane(s + 1):
                continue  # handed over in memory
            fwd = (lane(s), lane(s + 1), Key(str(s), m, Kind.FWD, s + 1))
            sends[at(Op.SF, Op.F, s, m)].append(fwd)
            recvs[at(Op.RF, Op.F, s + 1, m)].append(fwd)
            grad = (lane(s + 1), lane(s), Key(str(s), m, Kind.GRAD, s + 1))
            sends[at(Op.SB, Op.B, s + 1, m)].append(grad)
            recvs[at(Op.RB, Op.B, s, m)].append(grad)
    return sends, recvs


def _run(sched: Schedule) -> list[int]:
    """Run every lane (round robin, an action once its messages are sent); per lane the most
    sends it held at once. Fails if a send is dropped before its receiver took it."""
    arrivals = Arrivals(sched, ChainRoutes())  # type: ignore[arg-type]
    sends, recvs = _messages(sched)
    sent: set[Key] = set()
    taken: set[Key] = set()
    held: list[list[tuple[int, Key]]] = [[] for _ in sched.actions]
    most = [0] * sched.lanes
    pos = [0] * sched.lanes
    while any(p < len(line) for p, line in zip(pos, sched.actions, strict=True)):
        moved = False
        for d, line in enumerate(sched.actions):
            if pos[d] == len(line):
                continue
            a = line[pos[d]]
            if any(k not in sent for _, _, k in recvs[a]):
                continue
            for src, _, k in recvs[a]:
                taken.add(k)
                proven = [(r, s) for r, s in held[d] if r == src and arrivals.proves(s, k)]
                for r, s in proven:
                    assert s in taken, f"{sched.name}: lane {d} dropped {s} on {k}, not yet taken"
                    held[d].remove((r, s))
            for _, dst, k in sends[a]:
                sent.add(k)
                held[d].append((dst, k))
            most[d] = max(most[d], len(held[d]))
            pos[d] += 1
            moved = True
        assert moved, f"{sched.name}: the lines deadlock"
    return most


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("S,M", [(2, 8), (4, 16), (4, 6)])
def test_a_rank_holds_only_the_sends_its_schedule_keeps_in_flight(name: str, S: int, M: int) -> None:
    sched = make_schedule(name, M, chain(S), [False] * S)
    most = _run(sched)
    alive = [first for first, _ in in_flight(sched)]
    for d in range(sched.lanes):
        # each stage of the lane: its outputs of the microbatches alive, and a gradient or two
        bound = sum(alive[s] for s in sched.stages_on(d)) + 2 * len(sched.stages_on(d))
        if name == "gpipe":
            bound = 2 * M  # fill-drain: every microbatch is in flight
        assert most[d] <= bound, (name, d, most, bound)
    print(name, S, M, most)
