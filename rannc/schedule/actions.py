"""Pipeline schedules as data: each stage's ordered list of actions.

Every replica of a stage runs its stage's list, so a rank's schedule is its stage's line. An
action is one of

    F   forward of microbatch m           B   backward of microbatch m
    R   recompute microbatch m's forward  (activations dropped in F are rebuilt before B)
    W   the weight-gradient part of m's backward, split off B and run later
    RF  receive m's stage inputs          SF  send m's stage outputs on
    RB  receive m's output gradients      SB  send m's input gradients back

written `<op><stage>.<microbatch>` ("F1.3", "RB0.2"). Where a stage's line has W actions, its B
computes the stage inputs' gradients only (what SB sends back) and W the parameters' gradients
(zero-bubble schedules, Qi et al. 2023: W fills the waits); without them B does both.

Each line belongs to a *lane*: the ranks running it. One stage per lane is the usual case; an
interleaved schedule places several stages on each lane (`Schedule.placement`: stage s runs on
lane placement[s]), and the lane's line holds their actions in the order it runs them. A
schedule's text form is a header line and one line per lane; `Schedule.parse(str(s)) == s`.
Sends never block (the runtime uses isend); receives block until every matching send has
happened, which is what `simulate` models.

The generators in `rannc.schedule.spec` build the schedules rannc runs: fill-drain (GPipe),
1F1B (PipeDream-flush order) and Merak's shifted critical path ("scp": 1F1B whose recomputation
runs before the stage waits for the gradient, so it fills that wait, and none on the last
stage, which holds one microbatch at a time anyway). Merak also moves one forward of the penultimate
stage ahead; modelled as an extra warm-up forward our simulator predicts that slower (S=4, M=8,
uniform stages: 53 vs 39 time units), so it is left out (BENCHMARKS.md).
`suppliers[t]` lists the stages stage t receives activations from (a skip connection makes it
more than t - 1).

Index conventions: s, t stages; m microbatches; d lanes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from rannc.errors import ScheduleError


class Op(Enum):
    F = "F"
    B = "B"
    R = "R"
    W = "W"
    RF = "RF"
    SF = "SF"
    RB = "RB"
    SB = "SB"


COMPUTE = (Op.F, Op.B, Op.R, Op.W)
BACKWARD_SIDE = (Op.B, Op.R, Op.W, Op.RB, Op.SB)  # what fill-drain leaves for backward()
_ACTION = re.compile(r"^(RF|SF|RB|SB|F|B|R|W)(\d+)\.(\d+)$")


@dataclass(frozen=True, slots=True, order=True)
class Action:
    stage: int
    micro: int
    op: Op

    def __str__(self) -> str:
        return f"{self.op.value}{self.stage}.{self.micro}"

    @classmethod
    def parse(cls, text: str) -> Action:
        m = _ACTION.match(text.strip())
        if m is None:
            raise ScheduleError(f"cannot read action {text!r}; expected e.g. F0.3, RB1.2, SF2.0")
        return cls(int(m.group(2)), int(m.group(3)), Op(m.group(1)))


@dataclass(frozen=True, slots=True)
class Schedule:
    name: str
    microbatches: int
    suppliers: tuple[tuple[int, ...], ...]  # per stage: the stages it receives activations from
    actions: tuple[tuple[Action, ...], ...]  # per lane, in execution order
    placement: tuple[int, ...] = ()  # per stage: its lane (empty: stage s on lane s)

    @property
    def stages(self) -> int:
        return len(self.suppliers)

    @property
    def lanes(self) -> int:
        return len(self.actions)

    def lane_of(self, s: int) -> int:
        return self.placement[s] if self.placement else s

    def stages_on(self, d: int) -> list[int]:
        """The stages lane d runs, first to last."""
        return [s for s in range(self.stages) if self.lane_of(s) == d]

    def splits_backward(self, s: int) -> bool:
        """Whether stage s runs its backward as B (input gradients) then W (weight gradients)."""
        return any(a.op is Op.W and a.stage == s for a in self.actions[self.lane_of(s)])

    def consumers(self, s: int) -> list[int]:
        return [t for t, sup in enumerate(self.suppliers) if s in sup]

    def __str__(self) -> str:
        edges = ",".join(f"{s}>{t}" for t, sup in enumerate(self.suppliers) for s in sup)
        lanes = f" lanes={','.join(map(str, self.placement))}" if self.placement else ""
        lines = [f"schedule {self.name} stages={self.stages} microbatches={self.microbatches} "
                 f"edges={edges or '-'}{lanes}"]
        for d, acts in enumerate(self.actions):
            lines.append(f"{d}: " + " ".join(str(a) for a in acts))
        return "\n".join(lines)

    @classmethod
    def parse(cls, text: str) -> Schedule:
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        head = re.match(r"^schedule (\S+) stages=(\d+) microbatches=(\d+) edges=(\S+)"
                        r"(?: lanes=([\d,]+))?$", lines[0].strip()) if lines else None
        if head is None:
            raise ScheduleError("a schedule's first line must read "
                                "'schedule NAME stages=S microbatches=M edges=0>1,...' "
                                "(and ' lanes=0,1,0,1' where stages share lanes)")
        n_stages = int(head.group(2))
        sup: list[list[int]] = [[] for _ in range(n_stages)]
        if head.group(4) != "-":
            for e in head.group(4).split(","):
                s, t = (int(x) for x in e.split(">"))
                sup[t].append(s)
        placement = tuple(int(x) for x in head.group(5).split(",")) if head.group(5) else ()
        if placement and len(placement) != n_stages:
            raise ScheduleError(f"lanes= gives {len(placement)} stages' lanes for {n_stages} stages")
        n_lanes = max(placement) + 1 if placement else n_stages
        if len(lines) != n_lanes + 1:
            raise ScheduleError(f"schedule names {n_lanes} lanes but has {len(lines) - 1} lines")
        acts = []
        for d, ln in enumerate(lines[1:]):
            label, _, body = ln.partition(":")
            if label.strip() != str(d):
                raise ScheduleError(f"line {d + 2} should start with '{d}:', got {ln[:20]!r}")
            acts.append(tuple(Action.parse(t) for t in body.split()))
        return cls(head.group(1), int(head.group(3)), tuple(tuple(x) for x in sup), tuple(acts),
                   placement)

    def forward_part(self, d: int) -> tuple[Action, ...]:
        """Lane d's actions before its first backward-side action (what fill-drain runs in
        `forward()`; the rest waits for `backward()`)."""
        acts = self.actions[d]
        for i, a in enumerate(acts):
            if a.op in BACKWARD_SIDE:
                return acts[:i]
        return acts


def chain(n_stages: int) -> tuple[tuple[int, ...], ...]:
    """Suppliers of a plain chain of stages."""
    return tuple(() if t == 0 else (t - 1,) for t in range(n_stages))


def validate(sched: Schedule) -> None:
    """Raise ScheduleError unless every stage runs F and B of every microbatch once, in an
    order whose data are there: RF before F before SF; R (if any) after F and before B; RB
    before B before SB; W (if any: then for every microbatch) after B; receives and sends
    exactly where the stage has suppliers/consumers; every action on its stage's lane.
    Cross-stage order (deadlocks) is checked by `simulate`."""
    M = sched.microbatches
    S = sched.stages
    if sched.placement and (len(sched.placement) != S
                            or sorted(set(sched.placement)) != list(range(sched.lanes))):
        raise ScheduleError(f"placement {list(sched.placement)} must give each of the {S} stages "
                            f"one of the lanes 0..{sched.lanes - 1}, each lane at least one stage")
    pos: list[dict[tuple[Op, int], int]] = [{} for _ in range(S)]
    for d, acts in enumerate(sched.actions):
        for i, a in enumerate(acts):
            if not 0 <= a.stage < S or sched.lane_of(a.stage) != d:
                raise ScheduleError(f"lane {d}'s line holds {a}, an action of stage {a.stage}, "
                                    "which runs on another lane")
            if not 0 <= a.micro < M:
                raise ScheduleError(f"{a}: microbatch {a.micro} is outside 0..{M - 1}")
            if (a.op, a.micro) in pos[a.stage]:
                raise ScheduleError(f"{a} appears twice on stage {a.stage}")
            pos[a.stage][(a.op, a.micro)] = i
    for s in range(S):
        has_sup, has_cons = bool(sched.suppliers[s]), bool(sched.consumers(s))
        split = any(op is Op.W for op, _ in pos[s])
        for m in range(M):
            need = {Op.F: True, Op.B: True, Op.RF: has_sup, Op.SB: has_sup, Op.SF: has_cons,
                    Op.RB: has_cons, Op.W: split}
            for op, required in need.items():
                if required and (op, m) not in pos[s]:
                    raise ScheduleError(f"stage {s} never runs {Action(s, m, op)}")
                if not required and (op, m) in pos[s]:
                    why = "no suppliers" if op in (Op.RF, Op.SB) else "no consumers"
                    raise ScheduleError(f"stage {s} has {why}, but runs {Action(s, m, op)}")
            order = [(Op.RF, Op.F), (Op.F, Op.SF), (Op.F, Op.B), (Op.F, Op.R), (Op.R, Op.B),
                     (Op.RB, Op.B), (Op.B, Op.SB), (Op.B, Op.W)]
            for first, then in order:
                if (first, m) in pos[s] and (then, m) in pos[s] \
                        and pos[s][(first, m)] > pos[s][(then, m)]:
                    raise ScheduleError(f"stage {s} runs {Action(s, m, then)} before "
                                        f"{Action(s, m, first)}")


def in_flight(sched: Schedule) -> list[tuple[int, int]]:
    """Per stage: (the most microbatches whose forward ran and backward has not, the most
    whose recomputed activations are alive at once). Memory = static + first * (what a
    microbatch keeps through its backward) + second * (what recomputation rebuilds). Where the
    backward is split, a microbatch's activations stay until its W (the weight gradients read
    the layers' inputs; the runtime keeps the autograd graph until then)."""
    out = []
    for s in range(sched.stages):
        acts = [a for a in sched.actions[sched.lane_of(s)] if a.stage == s]
        done = Op.W if sched.splits_backward(s) else Op.B
        live = peak = rec = rec_peak = 0
        rebuilt = {a.micro for a in acts if a.op is Op.R}
        for a in acts:
            if a.op is Op.F:
                live += 1
                peak = max(peak, live)
            elif a.op is Op.R:
                rec += 1
                rec_peak = max(rec_peak, rec)
            elif a.op is done:
                live -= 1
                if a.micro in rebuilt:
                    rec -= 1
        out.append((peak, rec_peak))
    return out


def _most_between(sched: Schedule, s: int, opens: Op, closes: Op) -> int:
    """The most microbatches of stage s at once between their `opens` action and their
    `closes` one, along its lane's line."""
    now = most = 0
    for a in sched.actions[sched.lane_of(s)]:
        if a.stage != s:
            continue
        if a.op is opens:
            now += 1
            most = max(most, now)
        elif a.op is closes:
            now -= 1
    return most


def pending_w(sched: Schedule) -> list[int]:
    """Per stage where the backward is split: the most microbatches at once between their B
    and their W, each holding what W reads and the gradients B keeps for it (0 where the
    backward is not split). The memory model counts them besides the stage's peak of live
    microbatches (`in_flight`; `rannc.stage_dp.memory`: where B adds more than it releases);
    ZB-H1's stage s: s + 1 (M >= S)."""
    return [_most_between(sched, s, Op.B, Op.W) if sched.splits_backward(s) else 0
            for s in range(sched.stages)]


def past_b(sched: Schedule) -> list[int]:
    """Per stage where the backward is split: its peak of live microbatches (`in_flight`'s
    first count) less the most at once between their forward and their B. A microbatch past
    its B holds only what W reads, so where that is less than its activations the memory
    model counts this many of the peak's microbatches at that size (`rannc.stage_dp.memory`:
    at any moment the live ones before B number at most peak - past_b). ZB-H1's stage s: s
    (M >= S); 0 where the backward is not split."""
    return [peak - _most_between(sched, s, Op.F, Op.B) if sched.splits_backward(s) else 0
            for s, (peak, _) in enumerate(in_flight(sched))]


__all__ = ["BACKWARD_SIDE", "COMPUTE", "Action", "Op", "Schedule", "ScheduleError", "chain", "in_flight",
           "past_b", "pending_w", "validate"]
