"""One record per pipeline schedule, and the registry every part of rannc reads.

What a schedule means is decided here and nowhere else: config validation takes its names
from `SCHEDULES`, `make_schedule` its action lines, the simulator whether it has fill-drain's
barrier between forward and backward, the planner's memory model how many microbatches a
stage holds, and the runtime whether it runs eagerly and where it recomputes. Adding a
schedule is one `ScheduleSpec` (with its line generator) passed to `register`.

Registered: fill-drain ("gpipe"), 1F1B, Merak's shifted critical path ("scp"), ZB-H1
("zero_bubble": its lines carry W actions, so the runtime splits each backward into B and W),
ZB-H1 with each W deferred by at most one microbatch or by none ("zero_bubble_lag1",
"zero_bubble_lag0"), interleaved 1F1B
("interleaved_1f1b": `chunks` stages per lane, looped) and ZB-V ("zero_bubble_v": two stages
per lane in a V, with B and W split).

Index conventions: s stages; m microbatches; S, M their counts.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from rannc.schedule.actions import Action, Op, Schedule, ScheduleError, chain, in_flight, past_b, pending_w

# The schedule every model can run: forwards in forward(), backwards in backward(). Schedules
# that run eagerly fall back to it when the model does not return one scalar loss.
FILL_DRAIN = "gpipe"


@dataclass(frozen=True, slots=True)
class StageLine:
    """What a generator knows about the lane whose line it builds (one stage, or under an
    interleaved schedule several: `stages_here`), and the action groups every schedule is
    made of. The group helpers take the stage they are for (default: `stage`)."""

    stage: int  # the first stage on this lane
    microbatches: int
    suppliers: tuple[tuple[int, ...], ...]  # per stage: the stages it receives activations from
    recompute: bool  # this stage drops activations in F and rebuilds them (R) before B
    placement: tuple[int, ...] = ()  # per stage: its lane (empty: one stage per lane)
    recomputes: tuple[bool, ...] = ()  # per stage (empty: `recompute` for this lane's stage)
    # the stages some stage receives from (read per action group: built once)
    consumed: frozenset[int] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "consumed", frozenset(s for x in self.suppliers for s in x))

    @property
    def depth(self) -> int:
        """Longest chain of consumers after this stage (the last stage: 0)."""
        return _depth_to_end(self.suppliers, self.stage)

    @property
    def max_depth(self) -> int:
        """The longest chain of consumers after any stage (a chain of S stages: S - 1)."""
        return max(_depth_to_end(self.suppliers, t) for t in range(len(self.suppliers)))

    @property
    def lane(self) -> int:
        return self.placement[self.stage] if self.placement else self.stage

    @property
    def lanes(self) -> int:
        return max(self.placement) + 1 if self.placement else len(self.suppliers)

    @property
    def stages_here(self) -> list[int]:
        """The stages this lane runs, first to last."""
        if not self.placement:
            return [self.stage]
        return [t for t, d in enumerate(self.placement) if d == self.lane]

    def forward(self, m: int, s: int | None = None) -> list[Action]:
        """RF (with suppliers), F, SF (with consumers) of microbatch m."""
        s = self.stage if s is None else s
        out = [Action(s, m, Op.RF)] if self.suppliers[s] else []
        out.append(Action(s, m, Op.F))
        return out + ([Action(s, m, Op.SF)] if self._has_consumers(s) else [])

    def backward(self, m: int, early_recompute: bool = False, s: int | None = None) -> list[Action]:
        """RB, R (when recomputing; before RB if `early_recompute`), B, SB of microbatch m."""
        s = self.stage if s is None else s
        recv = [Action(s, m, Op.RB)] if self._has_consumers(s) else []
        r = [Action(s, m, Op.R)] if self._recomputes(s) else []
        out = r + recv if early_recompute else recv + r
        out.append(Action(s, m, Op.B))
        return out + ([Action(s, m, Op.SB)] if self.suppliers[s] else [])

    def weight(self, m: int, s: int | None = None) -> list[Action]:
        """W of microbatch m: the weight gradients, split off its B."""
        return [Action(self.stage if s is None else s, m, Op.W)]

    def _has_consumers(self, s: int) -> bool:
        return s in self.consumed

    def _recomputes(self, s: int) -> bool:
        return self.recomputes[s] if self.recomputes else self.recompute


def looped(s: int, lanes: int) -> int:
    """Stage s's lane under a looped placement (Megatron's interleaving): s % lanes, so lane d
    runs stages d, d + lanes, ..."""
    return s % lanes


def v_shape(s: int, lanes: int) -> int:
    """Stage s's lane under a V-shaped placement (ZB-V): down the lanes and back up, so lane d
    runs stages d and 2 * lanes - 1 - d, and the first and last stages share lane 0."""
    return s if s < lanes else 2 * lanes - 1 - s


def any_count(lanes: int, microbatches: int) -> bool:
    """A schedule whose lines run any microbatch count on any lanes."""
    return True


@dataclass(frozen=True, slots=True)
class HeldActivations:
    """What the memory model multiplies for one stage: microbatches whose activations are
    alive at once, microbatches whose stage inputs are kept for a late pass, and (a backward
    split into B and W) microbatches whose B-to-W gradients count besides (`pending_w`)."""

    in_flight: int
    saved_inputs: int
    pending: int = 0


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
    runs: bool = True
    """Whether the runtime runs it: `schedule="auto"` searches only these; one that does not is
    still planned and simulated when forced (`rannc.plan`, the `rannc plan` command)."""
    shared_lanes: bool = False
    """Whether its generator builds lines of several stages per lane (interleaved schedules,
    and fill-drain, which an interleaved plan falls back to without one scalar loss)."""
    chunks: int = 1
    """Stages per lane (the ranks of one pipeline position) by default: 1, or more for a
    schedule of several stages per rank, whose stage s runs on lane `lane_of(s, stages /
    chunks)`. A plan says its own placement (`Plan.placement`); this is what `make_schedule`
    assumes without one, and what the planner places."""
    lane_of: Callable[[int, int], int] = looped
    """(stage, lanes) -> the lane running it, where `chunks` > 1."""
    runnable: Callable[[int, int], bool] = any_count
    """(lanes, microbatches) -> whether its lines run that many microbatches on that many lanes
    without deadlock (interleaved 1F1B's rounds need a multiple of the lanes)."""
    pending: Callable[[int, int], int] = lambda S, M: 0
    """(stages S, microbatches M) -> where the backward is split into B and W, the most
    microbatches any stage holds between its B and its W (`actions.pending_w`): the bound the
    stage DP plans their gradients kept from B for W under, as `in_flight` bounds the
    activations (each candidate is then costed with its stages' own counts)."""

    def held(self, stages: int, microbatches: int, late: bool) -> HeldActivations:
        """The planner's memory model for this schedule's activations: the in-flight bound,
        and (eager schedules, when a batch output may also get a gradient: `late`) every
        microbatch's stage inputs kept for the runtime's late pass."""
        saved = microbatches if self.eager and late else 0
        return HeldActivations(self.in_flight(stages, microbatches), saved,
                               self.pending(stages, microbatches))

    def recomputes(self, s: int, n_stages: int, planned: bool) -> bool:
        """Whether stage s recomputes, given what the plan says."""
        return planned and (self.recompute_last or s != n_stages - 1)


def _fill_drain(line: StageLine) -> list[Action]:
    """Every forward, then every backward in reverse; a lane of several stages (an
    interleaved plan run without one scalar loss) runs its stages' forwards first to last and
    their backwards last to first, which the data flow between lanes allows."""
    acts: list[Action] = []
    here = line.stages_here
    for s in here:
        for m in range(line.microbatches):
            acts += line.forward(m, s)
    for s in reversed(here):
        for m in reversed(range(line.microbatches)):
            acts += line.backward(m, s=s)
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


def _zero_bubble_h1(line: StageLine, most_lag: int | None = None) -> list[Action]:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 3): 1F1B's order with
    each backward split into B (input gradients, sent back at once) and W (weight gradients),
    the W of stage s deferred by its distance from the first stage, so the chain of B
    passes that ends the iteration runs without the W passes on it and the later stages fill
    their cool-down waits with the deferred W. Stage s then holds at most the first stage's
    1F1B count of microbatches (theirs until its W), 1F1B's peak activation memory, and besides
    the gradients B keeps for W of s + 1 microbatches (`actions.pending_w`). `most_lag`: W
    deferred by at most that many microbatches (`_zero_bubble_lag1`, `_zero_bubble_lag0`)."""
    M = line.microbatches
    warm = min(line.depth, M)
    lag = line.max_depth - line.depth  # W passes deferred (torch's num_1f1b_microbatches: rank)
    if most_lag is not None:
        lag = min(lag, most_lag)
    acts: list[Action] = []
    for m in range(warm):
        acts += line.forward(m)
    for i in range(M):
        if warm + i < M:
            acts += line.forward(warm + i)
        acts += line.backward(i)
        if i >= lag:
            acts += line.weight(i - lag)
    for i in range(max(0, M - lag), M):
        acts += line.weight(i)
    return acts


def _zero_bubble_lag1(line: StageLine) -> list[Action]:
    """ZB-H1 with each W deferred by at most one microbatch: a later stage holds at most two
    microbatches between B and W (ZB-H1's stage s holds s + 1), each keeping what W reads and
    the gradients B keeps for it, so it needs about 1F1B's memory on every stage, not the
    first stage's count on each. Where the last stage is the largest (an LM head and its
    vocabulary-wide gradients), ZB-H1 does not fit at the memory limit and this does: its W
    passes fill less of the cool-down than ZB-H1's, but the B chain still runs without them
    (Llama-3-8B on 8 and 16 H100 by the estimate oracle: 1.1 and 1.5 % faster plans,
    BENCHMARKS.md)."""
    return _zero_bubble_h1(line, most_lag=1)


def _zero_bubble_lag0(line: StageLine) -> list[Action]:
    """1F1B's order with each backward split, B's input gradients sent before W runs, W right
    after: the chain of B passes that ends the iteration no longer waits for each stage's W,
    for 1F1B's memory (at most one microbatch between B and W, inside its backward as under
    1F1B). Gains (S - 1) x T_W of 1F1B's cool-down of (S - 1) x (T_F + T_B + T_W) where ZB-H1
    gains 2 (S - 1) x T_W, and fits wherever 1F1B does (Gemma-7B-like on 8 H100 by the
    estimate oracle: 53.77 -> 51.93 s, within 1.08 of the lower bound; BENCHMARKS.md)."""
    return _zero_bubble_h1(line, most_lag=0)


def _interleaved_one_f_one_b(line: StageLine) -> list[Action]:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM's virtual pipeline stages): lane d
    of P runs stages d, d + P, ... (v chunks), microbatches in rounds of P: each round's
    forwards go through chunk 0, then chunk 1, ..., and its backwards through the chunks in
    reverse; after (v - 1) rounds' worth plus 2 (P - 1 - d) warm-up forwards, one forward and
    one backward alternate. The bubble is 1F1B's divided by v; the warm-up holds more
    microbatches than 1F1B's first stage does (v stages' worth, each 1/v of the model)."""
    M, P = line.microbatches, line.lanes
    here = line.stages_here
    v, d = len(here), line.lane
    if M > P and M % P:
        # a short last round leaves the chunks' order without the slack the warm-up assumes
        # (the simulator finds it deadlocking, e.g. 4 lanes x 3 chunks, 5 microbatches)
        raise ScheduleError(f"interleaved_1f1b runs microbatches in rounds of its {P} lanes, so "
                            f"it needs fewer than {P} microbatches or a multiple of {P}, got {M}; "
                            f"use microbatches={M + P - M % P} or another schedule")
    rnd = min(P, M)  # microbatches per round

    def order(reverse: bool) -> list[tuple[int, int]]:  # (stage, microbatch) in run order
        out = []
        for r0 in range(0, M, rnd):
            mics = range(r0, min(r0 + rnd, M))
            for c in (reversed(range(v)) if reverse else range(v)):
                out += [(here[c], m) for m in mics]
        return out

    fwd, bwd = order(False), order(True)
    warm = min(len(fwd), (v - 1) * rnd + 2 * (P - 1 - d))
    acts: list[Action] = []
    for s, m in fwd[:warm]:
        acts += line.forward(m, s)
    for i, (s, m) in enumerate(bwd):
        if warm + i < len(fwd):
            fs, fm = fwd[warm + i]
            acts += line.forward(fm, fs)
        acts += line.backward(m, s=s)
    return acts


def _zero_bubble_v(line: StageLine) -> list[Action]:
    """ZB-V (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 6): lane d of P runs
    stage d (chunk 0, on the way down) and stage 2P - 1 - d (chunk 1, on the way back up), each
    backward split into B and W. Warm-up: 2 (P - d) - 1 forwards of chunk 0, then d pairs of
    (chunk 1 forward, chunk 0 forward), then P - d rounds of chunk 1's F, B, W; steady state:
    chunk 0's F (while any is left), B and W, then chunk 1's F, B and W; cool-down: d pairs of
    B (chunk 0, chunk 1), P - d of chunk 0's B and an outstanding W, then the remaining Ws.
    With F, B and W of equal length the lanes never wait once the pipeline is full, and a
    lane holds about as many microbatches as 1F1B's first stage (each over half the layers).
    The order is worked out for at least 2P - 1 microbatches; with fewer, the actions of the
    microbatches that do not exist are left out (what torch.distributed.pipelining's
    ScheduleZBVZeroBubble does: the data flow still allows the rest)."""
    M, P = line.microbatches, line.lanes
    here = line.stages_here
    if len(here) != 2:
        raise ScheduleError(f"zero_bubble_v puts two stages on each lane (stage d and 2P - 1 - d "
                            f"of P lanes); lane {line.lane} has {len(here)}")
    d = line.lane
    c0, c1 = here
    n = max(M, 2 * P - 1)
    acts: list[Action] = []
    f, b, w = ({c0: 0, c1: 0} for _ in range(3))  # per stage: its F, B, W passes so far

    def passes(done: dict[int, int],
               actions: Callable[[int, int], list[Action]]) -> Callable[[int], None]:
        def run(s: int) -> None:  # stage s's next pass; counted but left out past the last
            if done[s] < M:
                acts.extend(actions(done[s], s))
            done[s] += 1
        return run

    fwd = passes(f, lambda m, s: line.forward(m, s))
    bwd = passes(b, lambda m, s: line.backward(m, s=s))
    wgt = passes(w, lambda m, s: line.weight(m, s))

    for _ in range(2 * (P - d) - 1):
        fwd(c0)
    for _ in range(d):
        fwd(c1)
        fwd(c0)
    for _ in range(P - d):
        fwd(c1)
        bwd(c1)
        wgt(c1)
    while f[c1] < f[c0] or f[c0] < n:
        if f[c0] < n:
            fwd(c0)
        bwd(c0)
        wgt(c0)
        fwd(c1)
        bwd(c1)
        wgt(c1)
    for _ in range(d):
        bwd(c0)
        bwd(c1)
    for _ in range(P - d):
        bwd(c0)
        wgt(c0)
    while w[c1] < b[c1]:
        wgt(c1)
    while w[c0] < b[c0]:
        wgt(c0)
    return acts


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
                      in_flight=lambda S, M: M, summary="fill-drain (GPipe)", shared_lanes=True))
register(ScheduleSpec("1f1b", _one_f_one_b, eager=True, recompute_last=True,
                      in_flight=lambda S, M: min(S, M), summary="1F1B (PipeDream-flush order)"))
# Merak's shifted critical path: 1F1B whose recomputation runs before the stage waits for the
# gradient, so it fills that wait, and none on the last stage.
register(ScheduleSpec("scp", _shifted_critical_path, eager=True, recompute_last=False,
                      in_flight=lambda S, M: min(S, M), summary="Merak's shifted critical path"))
# ZB-H1: backward split into input gradients (B) and weight gradients (W), W deferred into the
# cool-down; every stage holds up to the first stage's count (its microbatches wait for W).
register(ScheduleSpec("zero_bubble", _zero_bubble_h1, eager=True, recompute_last=True,
                      in_flight=lambda S, M: min(S, M), pending=lambda S, M: min(S, M),
                      summary="zero-bubble ZB-H1 (backward split into input and weight passes)"))
# ZB-H1 with W deferred by at most one microbatch: at most 2 pending on any stage.
register(ScheduleSpec("zero_bubble_lag1", _zero_bubble_lag1, eager=True, recompute_last=True,
                      in_flight=lambda S, M: min(S, M), pending=lambda S, M: min(S, M, 2),
                      summary="ZB-H1 with each weight pass deferred by at most one microbatch "
                              "(less memory on the later stages)"))
# ... and by none: 1F1B with B sent back before W.
register(ScheduleSpec("zero_bubble_lag0", _zero_bubble_lag0, eager=True, recompute_last=True,
                      in_flight=lambda S, M: min(S, M), pending=lambda S, M: min(S, M, 1),
                      summary="1F1B with each backward split, input gradients sent before the "
                              "weight pass (1F1B's memory)"))
# Interleaved 1F1B: stage s on lane s % P (the ranks of pipeline position s % P).
register(ScheduleSpec("interleaved_1f1b", _interleaved_one_f_one_b, eager=True,
                      recompute_last=True,
                      in_flight=lambda S, M: _shared_in_flight("interleaved_1f1b", S, M),
                      summary="interleaved 1F1B (several stages per rank)", shared_lanes=True,
                      chunks=2, runnable=lambda P, M: M <= P or M % P == 0))
# ZB-V: two stages per rank in a V (stage d and 2P - 1 - d), backward split into B and W.
register(ScheduleSpec("zero_bubble_v", _zero_bubble_v, eager=True, recompute_last=True,
                      in_flight=lambda S, M: _shared_in_flight("zero_bubble_v", S, M),
                      pending=lambda S, M: _shared_pending("zero_bubble_v", S, M),
                      summary="zero-bubble ZB-V (two stages per rank in a V, backward split "
                              "into input and weight passes)",
                      shared_lanes=True, chunks=2, lane_of=v_shape))


def require_runs(name: str) -> None:
    """A ScheduleError unless the runtime runs schedule `name` (`ScheduleSpec.runs`)."""
    if name != "auto" and not get_spec(name).runs:
        can = ", ".join(n for n, sp in SCHEDULES.items() if sp.runs)
        raise ScheduleError(f"schedule {name!r} is planned and simulated (rannc.plan, `rannc plan`) "
                            f"but the runtime does not run it yet; train with schedule='auto' or "
                            f"one of {can}")


def make_schedule(name: str, microbatches: int, suppliers: Sequence[Sequence[int]],
                  recompute: Sequence[bool], placement: Sequence[int] | None = None) -> Schedule:
    """Build schedule `name` (a key of `SCHEDULES`) for the stage graph `suppliers`, where
    `recompute[s]` says the plan has stage s drop activations in forward and recompute them
    (the schedule may decline, see `ScheduleSpec.recompute_last`); `placement[s]`: the lane
    running stage s (default `default_placement`). Pure, so the planner's many calls with the
    same arguments (each candidate is simulated under several memory splits) share one."""
    return _make_schedule(get_spec(name), microbatches,
                          tuple(tuple(sorted(x)) for x in suppliers), tuple(bool(r) for r in recompute),
                          None if placement is None else tuple(placement))


@functools.lru_cache(maxsize=4096)
def _make_schedule(spec: ScheduleSpec, microbatches: int, sup: tuple[tuple[int, ...], ...],
                   recompute: tuple[bool, ...], placement: tuple[int, ...] | None) -> Schedule:
    name = spec.name
    n = len(sup)
    if len(recompute) != n:
        raise ScheduleError(f"recompute has {len(recompute)} entries for {n} stages")
    if microbatches < 1:
        raise ScheduleError(f"microbatches must be at least 1, got {microbatches}")
    place = default_placement(name, n) if placement is None else tuple(placement)
    if len(place) != n or sorted(set(place)) != list(range(max(place, default=-1) + 1)):
        raise ScheduleError(f"placement {list(place)} must give each of the {n} stages a lane, "
                            "the lanes numbered 0, 1, ... without gaps")
    lanes = max(place, default=-1) + 1
    if not spec.shared_lanes and lanes != n:
        raise ScheduleError(f"schedule {name!r} runs one stage per lane, but the placement "
                            f"{list(place)} puts {n} stages on {lanes} lanes; use an interleaved "
                            "schedule for several stages per rank")
    rc = tuple(spec.recomputes(s, n, recompute[s]) for s in range(n))
    firsts = [place.index(d) for d in range(lanes)]
    keep = place if lanes != n or any(d != s for s, d in enumerate(place)) else ()
    lines = tuple(tuple(spec.generate(StageLine(s, microbatches, sup, rc[s], keep, rc)))
                  for s in firsts)
    return Schedule(name, microbatches, sup, lines, keep)


def default_placement(name: str, n_stages: int) -> tuple[int, ...]:
    """Stage s's lane when a schedule is built without a placement: s, or for a schedule of
    `chunks` stages per lane, its `lane_of(s, n_stages / chunks)` (a ScheduleError where that
    does not divide)."""
    spec = get_spec(name)
    c = spec.chunks
    if c == 1:
        return tuple(range(n_stages))
    if n_stages % c:
        raise ScheduleError(f"schedule {name!r} puts {c} stages on each lane, so it needs a "
                            f"multiple of {c} stages, got {n_stages}; use partition_num "
                            f"{n_stages + c - n_stages % c} or another schedule")
    lanes = n_stages // c
    return tuple(spec.lane_of(s, lanes) for s in range(n_stages))


def _shared_in_flight(name: str, S: int, M: int) -> int:
    """`_shared_in_flight_of`, read once per (name, S, M): the search asks for every layout.
    (A plain function, as `_shared_pending` over `_split_counts`: the registrations above name
    it before its definition, which mypy cannot type for a decorated one.)"""
    return _shared_in_flight_of(name, S, M)


@functools.lru_cache(maxsize=1024)
def _shared_in_flight_of(name: str, S: int, M: int) -> int:
    """The most microbatches any stage of an S-stage chain holds under schedule `name` of
    several stages per lane (read off its lines, as the planner's memory model does); where it
    cannot run (stages not a multiple of its chunks, or a microbatch count its lines do not
    run) all M, the most any schedule holds, so a bound asked for there is never too small."""
    spec = get_spec(name)
    if S % spec.chunks or not spec.runnable(S // spec.chunks, M):
        return M
    return max(n for n, _ in in_flight(make_schedule(name, M, chain(S), [False] * S)))


def pending_counts(name: str, S: int, M: int) -> tuple[int, ...]:
    """Per stage of an S-stage chain, first to last: the most microbatches between their B and
    their W (`actions.pending_w`; all 0 where the backward is not split)."""
    return _split_counts(name, S, M)[0]


def past_b_counts(name: str, S: int, M: int) -> tuple[int, ...]:
    """Per stage of an S-stage chain, first to last: of its live peak, the microbatches past
    their B (`actions.past_b`; all 0 where the backward is not split, or not runnable)."""
    return _split_counts(name, S, M)[1]


@functools.lru_cache(maxsize=1024)
def _split_counts(name: str, S: int, M: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(`pending_counts`, `past_b_counts`), read off one S-stage chain's lines; where its lines
    do not run, every stage at the bounds: M pending (the most any line could hold), 0 past B."""
    if not splits_backward(name):
        return (0,) * S, (0,) * S
    spec = get_spec(name)
    if S % spec.chunks or not spec.runnable(S // spec.chunks, M):
        return (M,) * S, (0,) * S
    line = make_schedule(name, M, chain(S), [False] * S)
    return tuple(pending_w(line)), tuple(past_b(line))


def _shared_pending(name: str, S: int, M: int) -> int:
    """The most `pending_counts` of any stage (a schedule of several stages per lane, where
    no closed form is at hand)."""
    return max(pending_counts(name, S, M), default=0)


@functools.lru_cache(maxsize=64)
def splits_backward(name: str) -> bool:
    """Whether schedule `name` runs backwards as B (input gradients) and W (weight gradients)
    apart, read off its lines (two lanes, four microbatches): the memory model then counts the
    gradients B keeps for W (`rannc.stage_dp.memory.memory_terms`' stash)."""
    S = 2 * get_spec(name).chunks
    sched = make_schedule(name, 4, chain(S), [False] * S)
    return any(sched.splits_backward(s) for s in range(S))


def _depth_to_end(sup: tuple[tuple[int, ...], ...], s: int) -> int:
    """Longest chain of consumers after stage s (the last stage: 0)."""
    return _depths(sup)[s]


@functools.lru_cache(maxsize=1024)
def _depths(sup: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    n = len(sup)
    depth = [0] * n
    for t in reversed(range(n)):
        for u in range(t + 1, n):
            if t in sup[u]:
                depth[t] = max(depth[t], depth[u] + 1)
    return tuple(depth)


__all__ = ["FILL_DRAIN", "SCHEDULES", "HeldActivations", "ScheduleSpec", "StageLine",
           "default_placement", "get_spec", "looped", "make_schedule", "register", "registered",
           "past_b_counts", "pending_counts", "require_runs", "splits_backward", "v_shape"]
