"""One record per pipeline schedule, and the registry every part of rannc reads.

What a schedule means is decided here and nowhere else: config validation takes its names
from `SCHEDULES`, `make_schedule` its action lines, the simulator whether it has fill-drain's
barrier between forward and backward, the planner's memory model how many microbatches a
stage holds, and the runtime whether it runs eagerly and where it recomputes. Adding a
schedule is one `ScheduleSpec` (with its line generator) passed to `register`.

Index conventions: s stages; m microbatches; S, M their counts.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from rannc.schedule.actions import Action, Op, Schedule, ScheduleError

# The schedule every model can run: forwards in forward(), backwards in backward(). Schedules
# that run eagerly fall back to it when the model does not return one scalar loss.
FILL_DRAIN = "gpipe"


@dataclass(frozen=True, slots=True)
class StageLine:
    """What a generator knows about the stage whose line it builds, and the action groups
    every schedule is made of."""

    stage: int
    microbatches: int
    suppliers: tuple[tuple[int, ...], ...]  # per stage: the stages it receives activations from
    recompute: bool  # this stage drops activations in F and rebuilds them (R) before B

    @property
    def depth(self) -> int:
        """Longest chain of consumers after this stage (the last stage: 0)."""
        return _depth_to_end(self.suppliers, self.stage)

    def forward(self, m: int) -> list[Action]:
        """RF (with suppliers), F, SF (with consumers) of microbatch m."""
        s = self.stage
        out = [Action(s, m, Op.RF)] if self.suppliers[s] else []
        out.append(Action(s, m, Op.F))
        return out + ([Action(s, m, Op.SF)] if self._has_consumers else [])

    def backward(self, m: int, early_recompute: bool = False) -> list[Action]:
        """RB, R (when recomputing; before RB if `early_recompute`), B, SB of microbatch m."""
        s = self.stage
        recv = [Action(s, m, Op.RB)] if self._has_consumers else []
        r = [Action(s, m, Op.R)] if self.recompute else []
        out = r + recv if early_recompute else recv + r
        out.append(Action(s, m, Op.B))
        return out + ([Action(s, m, Op.SB)] if self.suppliers[s] else [])

    @property
    def _has_consumers(self) -> bool:
        return any(self.stage in x for x in self.suppliers)


@dataclass(frozen=True, slots=True)
class HeldActivations:
    """What the memory model multiplies for one stage: microbatches whose activations are
    alive at once, and microbatches whose stage inputs are kept for a late pass."""

    in_flight: int
    saved_inputs: int


@dataclass(frozen=True, slots=True)
class ScheduleSpec:
    """Everything rannc needs to know about one schedule."""

    name: str
    generate: Callable[[StageLine], list[Action]]
    """Builds one stage's line of actions."""
    eager: bool
    """The whole line runs inside forward(), seeded with a unit loss gradient, and backward()
    scales the gradients (needs the model to return one scalar loss). False: forward() runs
    the line up to its first backward-side action and backward() the rest (with a barrier
    between the halves, which the simulator models)."""
    recompute_last: bool
    """Whether the last stage recomputes when the plan says so (False where it holds one
    microbatch at a time anyway, so recomputation would save nothing)."""
    in_flight: Callable[[int, int], int]
    """(stages S, microbatches M) -> the most microbatches any stage holds activations for:
    the bound the planner's stage DP is run under before per-stage refinement."""
    summary: str = ""
    """One line for Config's help."""

    def held(self, stages: int, microbatches: int, late: bool) -> HeldActivations:
        """The planner's memory model for this schedule's activations: the in-flight bound,
        and (eager schedules, when a batch output may also get a gradient: `late`) every
        microbatch's stage inputs kept for the runtime's late pass."""
        saved = microbatches if self.eager and late else 0
        return HeldActivations(self.in_flight(stages, microbatches), saved)

    def recomputes(self, s: int, n_stages: int, planned: bool) -> bool:
        """Whether stage s recomputes, given what the plan says."""
        return planned and (self.recompute_last or s != n_stages - 1)


def _fill_drain(line: StageLine) -> list[Action]:
    acts: list[Action] = []
    for m in range(line.microbatches):
        acts += line.forward(m)
    for m in reversed(range(line.microbatches)):
        acts += line.backward(m)
    return acts


def _one_f_one_b(line: StageLine, early_recompute: bool = False) -> list[Action]:
    M = line.microbatches
    warm = min(line.depth, M)  # forwards before the first backward
    acts: list[Action] = []
    for m in range(warm):
        acts += line.forward(m)
    for i in range(M - warm):
        acts += line.forward(warm + i)
        acts += line.backward(i, early_recompute)
    for i in range(M - warm, M):
        acts += line.backward(i, early_recompute)
    return acts


def _shifted_critical_path(line: StageLine) -> list[Action]:
    return _one_f_one_b(line, early_recompute=True)


SCHEDULES: dict[str, ScheduleSpec] = {}


def register(spec: ScheduleSpec) -> ScheduleSpec:
    """Add `spec` to the registry (replacing one of the same name)."""
    SCHEDULES[spec.name] = spec
    return spec


@contextmanager
def registered(spec: ScheduleSpec) -> Iterator[ScheduleSpec]:
    """`spec` in the registry for the duration of a with-block (tests, experiments)."""
    old = SCHEDULES.get(spec.name)
    register(spec)
    try:
        yield spec
    finally:
        if old is None:
            del SCHEDULES[spec.name]
        else:
            SCHEDULES[spec.name] = old


def get_spec(name: str) -> ScheduleSpec:
    """The registered schedule `name`, or a ScheduleError naming the known ones."""
    spec = SCHEDULES.get(name)
    if spec is None:
        close = difflib.get_close_matches(name, SCHEDULES, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ScheduleError(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}.{hint}")
    return spec


register(ScheduleSpec(FILL_DRAIN, _fill_drain, eager=False, recompute_last=True,
                      in_flight=lambda S, M: M, summary="fill-drain (GPipe)"))
register(ScheduleSpec("1f1b", _one_f_one_b, eager=True, recompute_last=True,
                      in_flight=lambda S, M: min(S, M), summary="1F1B (PipeDream-flush order)"))
# Merak's shifted critical path: 1F1B whose recomputation runs before the stage waits for the
# gradient, so it fills that wait, and none on the last stage.
register(ScheduleSpec("scp", _shifted_critical_path, eager=True, recompute_last=False,
                      in_flight=lambda S, M: min(S, M), summary="Merak's shifted critical path"))


def make_schedule(name: str, microbatches: int, suppliers: Sequence[Sequence[int]],
                  recompute: Sequence[bool]) -> Schedule:
    """Build schedule `name` (a key of `SCHEDULES`) for the stage graph `suppliers`, where
    `recompute[s]` says the plan has stage s drop activations in forward and recompute them
    (the schedule may decline, see `ScheduleSpec.recompute_last`)."""
    spec = get_spec(name)
    sup = tuple(tuple(sorted(x)) for x in suppliers)
    n = len(sup)
    if len(recompute) != n:
        raise ScheduleError(f"recompute has {len(recompute)} entries for {n} stages")
    if microbatches < 1:
        raise ScheduleError(f"microbatches must be at least 1, got {microbatches}")
    lines = tuple(tuple(spec.generate(StageLine(s, microbatches, sup,
                                                spec.recomputes(s, n, recompute[s]))))
                  for s in range(n))
    return Schedule(name, microbatches, sup, lines)


def _depth_to_end(sup: Sequence[Sequence[int]], s: int) -> int:
    """Longest chain of consumers after stage s (the last stage: 0)."""
    n = len(sup)
    depth = [0] * n
    for t in reversed(range(n)):
        for u in range(t + 1, n):
            if t in sup[u]:
                depth[t] = max(depth[t], depth[u] + 1)
    return depth[s]


__all__ = ["FILL_DRAIN", "SCHEDULES", "HeldActivations", "ScheduleSpec", "StageLine", "get_spec",
           "make_schedule", "register", "registered"]
