"""Predict a schedule's iteration time from per-stage costs, without running a model.

Each lane (the ranks running one line: one stage, or several under an interleaved schedule) is
one sequential worker running its line of actions. F, B and R take the stage's forward,
backward and recompute seconds; where the stage's backward is split, B takes the backward less
its weight-gradient share `wgrad` and W that share; a send takes no worker time and its data
reach the receiver `comm` seconds later; a receive waits until every matching send has arrived
(the runtime's isend / blocking recv). After its last action a lane all-reduces its stages'
gradients.
When no worker can move and some still have actions left, the schedule deadlocks, and
`simulate` names each stuck stage and what it waits for.

A schedule that does not run eagerly (fill-drain, "gpipe"; `ScheduleSpec.eager`) also has a
barrier between its forward and backward halves, as the runtime does (forward() returns, and
backward() starts with an all-reduce).

Also here (defined with the IR): the peak number of microbatches each stage holds activations
for, which is what the memory model multiplies, and the bubble ratio.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rannc.schedule.actions import COMPUTE, Action, Op, Schedule, ScheduleError, in_flight
from rannc.schedule.spec import SCHEDULES


@dataclass(frozen=True, slots=True)
class StageCosts:
    """Seconds per microbatch on each stage; comm_fwd[t]: for stage t's inputs to arrive once
    sent, comm_bwd[s]: for the gradients of stage s's outputs to arrive."""

    fwd: Sequence[float]
    bwd: Sequence[float]  # without recomputation
    recompute: Sequence[float]  # the R action (0 where a stage keeps everything)
    comm_fwd: Sequence[float]
    comm_bwd: Sequence[float]
    allreduce: Sequence[float]
    wgrad: Sequence[float] = ()  # the weight-gradient share of bwd (W); empty: none known

    @classmethod
    def uniform(cls, stages: int, fwd: float = 1.0, bwd: float = 2.0, recompute: float = 0.0,
                comm: float = 0.0, allreduce: float = 0.0, wgrad: float = 0.0) -> StageCosts:
        z = [0.0] * stages
        return cls([fwd] * stages, [bwd] * stages, [recompute] * stages, [comm] * stages,
                   [comm] * stages, [allreduce] * stages if allreduce else z, [wgrad] * stages)

    def weight(self, s: int) -> float:
        """Seconds of stage s's backward that compute weight gradients (0 when unknown)."""
        return float(self.wgrad[s]) if self.wgrad else 0.0


@dataclass(frozen=True, slots=True)
class Event:
    action: Action
    start: float
    end: float  # a receive spans its wait


@dataclass(frozen=True, slots=True)
class Timeline:
    schedule: Schedule
    events: tuple[tuple[Event, ...], ...]  # per lane (one stage per lane but interleaved;
    # empty lanes where simulated without `record`)
    iteration_time: float  # to the end of the slowest lane's all-reduce
    allreduce: tuple[float, ...]  # per lane

    @property
    def busy(self) -> list[float]:
        """Compute seconds per lane."""
        return [sum(e.end - e.start for e in evs if e.action.op in COMPUTE) for evs in self.events]

    @property
    def bubble_ratio(self) -> float:
        """Idle compute time over busy compute time, over all lanes, up to the last action
        (the all-reduce excluded): (S - 1) / M for uniform 1F1B without recomputation."""
        span = max((evs[-1].end for evs in self.events if evs), default=0.0)
        busy = sum(self.busy)
        return (span * len(self.events) - busy) / busy if busy else 0.0


def simulate(sched: Schedule, costs: StageCosts, *, record: bool = True) -> Timeline:
    """The timeline of `sched` under `costs` (see the module docstring). `record=False`: the
    iteration time and all-reduces alone, without the events (the planner simulates thousands
    of candidates and reads nothing else; the times are the same either way)."""
    S, L = sched.stages, sched.lanes
    consumers = [sched.consumers(s) for s in range(S)]
    # what each send sent when, per direction: (stage, micro) -> time (keys without the Op,
    # whose Enum hash is Python code, on the planner's hottest loop)
    sent_f: dict[tuple[int, int], float] = {}
    sent_b: dict[tuple[int, int], float] = {}
    clock = [0.0] * L
    nxt = [0] * L
    events: list[list[Event]] = [[] for _ in range(L)]
    split = [sched.splits_backward(s) for s in range(S)]
    f_s, r_s = list(costs.fwd), list(costs.recompute)
    b_s = [costs.bwd[s] - (costs.weight(s) if split[s] else 0.0) for s in range(S)]
    w_s = [costs.weight(s) for s in range(S)]
    comm_f, comm_b = list(costs.comm_fwd), list(costs.comm_bwd)
    remaining = sum(len(a) for a in sched.actions)
    # Fill-drain returns from forward() between its two halves: the outputs are gathered and
    # every rank meets in the loss gradient's all-reduce before any backward starts.
    spec = SCHEDULES.get(sched.name)  # a parsed schedule may have a name of its own: no barrier
    halves = [len(sched.forward_part(d)) if spec is not None and not spec.eager else -1
              for d in range(L)]
    fwd_end: dict[int, float] = {}
    F, B, R, W, SF, SB, RF = Op.F, Op.B, Op.R, Op.W, Op.SF, Op.SB, Op.RF
    while remaining:
        moved = False
        for d in range(L):
            acts = sched.actions[d]
            while nxt[d] < len(acts):
                a = acts[nxt[d]]
                if nxt[d] == halves[d]:
                    fwd_end[d] = clock[d]
                    if len(fwd_end) < L:
                        break
                    clock[d] = max(clock[d], max(fwd_end.values()))
                t0 = clock[d]
                op = a.op
                if op is F:
                    t1 = t0 + f_s[a.stage]
                elif op is B:
                    t1 = t0 + b_s[a.stage]
                elif op is W:
                    t1 = t0 + w_s[a.stage]
                elif op is R:
                    t1 = t0 + r_s[a.stage]
                elif op is SF:
                    sent_f[(a.stage, a.micro)] = t0
                    t1 = t0
                elif op is SB:
                    sent_b[(a.stage, a.micro)] = t0
                    t1 = t0
                else:  # a receive: when every matching send has arrived
                    fwd = op is RF
                    ready = _arrival(a.micro, sched.suppliers[a.stage] if fwd else consumers[a.stage],
                                     sent_f if fwd else sent_b,
                                     comm_f[a.stage] if fwd else comm_b[a.stage])
                    if ready is None:
                        break
                    t1 = max(t0, ready)
                if record:
                    events[d].append(Event(a, t0, t1))
                clock[d] = t1
                nxt[d] += 1
                remaining -= 1
                moved = True
        if not moved:
            stuck = [f"{'stage' if not sched.placement else 'lane'} {d} waits at "
                     f"{sched.actions[d][nxt[d]]}" for d in range(L) if nxt[d] < len(sched.actions[d])]
            raise ScheduleError(f"schedule {sched.name} deadlocks: " + "; ".join(stuck))
    ar = tuple(float(sum(costs.allreduce[s] for s in sched.stages_on(d))) for d in range(L))
    total = max((clock[d] + ar[d] for d in range(L)), default=0.0)
    return Timeline(sched, tuple(tuple(e) for e in events), total, ar)


def _arrival(micro: int, peers: Sequence[int], sent: dict[tuple[int, int], float],
             lag: float) -> float | None:
    """When microbatch `micro`'s messages from every one of `peers` have arrived (`lag` after
    each was sent); None while one is not sent yet."""
    latest = 0.0
    for p in peers:
        t = sent.get((p, micro))
        if t is None:
            return None
        latest = max(latest, t + lag)
    return latest


__all__ = ["Event", "StageCosts", "Timeline", "in_flight", "simulate"]
