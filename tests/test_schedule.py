"""Schedules as data (pure): text round trip, the validator, the simulator (textbook bubble
ratios, deadlocks, in-flight counts), the shifted critical path's gain, and how the planner
chooses schedules and per-stage recomputation."""

from __future__ import annotations

import dataclasses
import itertools
import logging

import pytest
from model_zoo import make_case

import rannc
from rannc.atomic.components import atomic_components
from rannc.graph.capture import capture
from rannc.planner import PlanInfeasibleError, plan_graph
from rannc.schedule import (
    SCHEDULES,
    Action,
    Op,
    Schedule,
    ScheduleError,
    StageCosts,
    chain,
    default_placement,
    get_spec,
    in_flight,
    make_schedule,
    simulate,
    validate,
)
from rannc.schedule.actions import pending_w
from rannc.schedule.predict import plan_costs, predict
from rannc.schedule.spec import registered, require_runs
from rannc.stage_dp import search

pytestmark = pytest.mark.layer("pure")

logging.getLogger("transformers").setLevel(logging.ERROR)

SKIP = ((), (0,), (0, 1), (2,))  # stage 2 reads stages 0 and 1 (a skip connection)
GRID = list(itertools.product(SCHEDULES, [1, 2, 3, 4, 6], [1, 2, 5, 8], [False, True]))


def _refused(name: str, S: int, M: int) -> str | None:
    """What a schedule of several stages per lane refuses: stages not a multiple of its chunks
    per lane, or (interleaved 1F1B) microbatches that are neither fewer than its lanes nor a
    multiple of them."""
    spec = get_spec(name)
    if spec.chunks == 1:
        return None
    if S % spec.chunks:
        return "needs a multiple of"
    return None if spec.runnable(S // spec.chunks, M) else "rounds of"


@pytest.mark.parametrize(("name", "S", "M", "rc"), GRID)
def test_generated_schedules_validate_round_trip_and_finish(name: str, S: int, M: int, rc: bool) -> None:
    why = _refused(name, S, M)
    if why is not None:
        with pytest.raises(ScheduleError, match=why):
            make_schedule(name, M, chain(S), [rc] * S)
        return
    sched = make_schedule(name, M, chain(S), [rc] * S)
    validate(sched)
    assert Schedule.parse(str(sched)) == sched
    assert all(Action.parse(str(a)) == a for line in sched.actions for a in line)
    tl = simulate(sched, StageCosts.uniform(S, recompute=1.0 if rc else 0.0))
    assert tl.iteration_time > 0


@pytest.mark.parametrize("name", SCHEDULES)
def test_a_stage_graph_with_a_skip_connection(name: str) -> None:
    sched = make_schedule(name, 4, SKIP, [True, True, False, False])
    validate(sched)
    assert Schedule.parse(str(sched)) == sched
    assert sched.consumers(0) == [1, 2]
    simulate(sched, StageCosts.uniform(4))


@pytest.mark.parametrize("name", SCHEDULES)
def test_the_planners_simulation_without_events_times_the_same(name: str) -> None:
    """The planner simulates without recording events (`record=False`); the times are
    those of the recorded timeline, whose lanes end where the iteration says, under uneven
    stages with transfers, recomputation, weight passes and all-reduces."""
    S = 4
    place = default_placement(name, S)
    sched = make_schedule(name, 8, chain(S), [True, False, True, False], place)
    costs = StageCosts(fwd=[1.0, 1.3, 0.7, 1.1], bwd=[2.1, 2.5, 1.2, 2.0],
                       recompute=[0.9, 0.0, 0.6, 0.0], comm_fwd=[0.0, 0.2, 0.1, 0.3],
                       comm_bwd=[0.15, 0.05, 0.25, 0.0], allreduce=[0.4, 0.0, 0.3, 0.8],
                       wgrad=[0.9, 1.0, 0.5, 0.7])
    full, quick = simulate(sched, costs), simulate(sched, costs, record=False)
    assert quick.iteration_time == full.iteration_time and quick.allreduce == full.allreduce
    assert all(not lane for lane in quick.events)
    ends = [lane[-1].end + ar for lane, ar in zip(full.events, full.allreduce, strict=True)]
    assert max(ends) == full.iteration_time


@pytest.mark.parametrize(("S", "M"), [(2, 1), (2, 4), (4, 4), (4, 8), (8, 32)])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_bubble_ratio_matches_the_textbook_for_uniform_stages(name: str, S: int, M: int) -> None:
    tl = simulate(make_schedule(name, M, chain(S), [False] * S), StageCosts.uniform(S, 1.0, 2.0))
    assert tl.bubble_ratio == pytest.approx((S - 1) / M)
    assert tl.iteration_time == pytest.approx((M + S - 1) * 3.0)


def test_communication_and_allreduce_lengthen_the_iteration() -> None:
    S, M = 3, 4
    for name in ("gpipe", "1f1b"):
        sched = make_schedule(name, M, chain(S), [False] * S)
        base = simulate(sched, StageCosts.uniform(S)).iteration_time
        slow = simulate(sched, StageCosts.uniform(S, comm=0.5, allreduce=2.0)).iteration_time
        # fill-drain: the first microbatch crosses 2 boundaries each way, then the all-reduce;
        # 1F1B alternates directions, so transfers also sit on its steady-state path
        if name == "gpipe":
            assert slow == pytest.approx(base + 4 * 0.5 + 2.0)
        else:
            assert slow > base + 4 * 0.5 + 2.0


def test_in_flight_counts() -> None:
    S, M = 4, 8
    assert [n for n, _ in in_flight(make_schedule("gpipe", M, chain(S), [False] * S))] == [M] * S
    assert [n for n, _ in in_flight(make_schedule("1f1b", M, chain(S), [False] * S))] == [4, 3, 2, 1]
    # scp: no recomputation on the last stage, at most one rebuilt microbatch elsewhere
    assert [r for _, r in in_flight(make_schedule("scp", M, chain(S), [True] * S))] == [1, 1, 1, 0]


def test_shifted_critical_path_beats_1f1b_under_recomputation() -> None:
    for S, M in [(4, 5), (4, 8), (8, 16)]:
        costs = StageCosts.uniform(S, 1.0, 2.0, recompute=1.0)
        one = simulate(make_schedule("1f1b", M, chain(S), [True] * S), costs).iteration_time
        scp = simulate(make_schedule("scp", M, chain(S), [True] * S), costs).iteration_time
        assert one == pytest.approx((M + S - 1) * 4.0)
        assert scp < one
    # Merak's Fig. 3 case, 4 stages and 5 microbatches: 27 against 1F1B's 32 units
    assert simulate(make_schedule("scp", 5, chain(4), [True] * 4),
                    StageCosts.uniform(4, recompute=1.0)).iteration_time == pytest.approx(27.0)


def test_a_deadlock_is_found_and_named() -> None:
    good = make_schedule("1f1b", 2, chain(2), [False, False])
    # stage 0 waits for microbatch 0's gradient before sending microbatch 0 on
    line = [Action(0, 0, Op.F), Action(0, 0, Op.RB), Action(0, 0, Op.SF), Action(0, 0, Op.B),
            Action(0, 1, Op.F), Action(0, 1, Op.SF), Action(0, 1, Op.RB), Action(0, 1, Op.B)]
    bad = Schedule("bad", 2, good.suppliers, (tuple(line), good.actions[1]))
    validate(bad)  # each line is locally fine ...
    with pytest.raises(ScheduleError, match=r"deadlocks: stage 0 waits at RB0\.0; stage 1 waits at RF1\.0"):
        simulate(bad, StageCosts.uniform(2))  # ... but together they wait on each other


@pytest.mark.parametrize(("edit", "message"), [
    (lambda a: a[1:], "never runs F0.0"),
    (lambda a: a + a[:1], "appears twice"),
    (lambda a: [a[3], a[0], a[1], a[2]], "runs B0.0 before F0.0"),
    (lambda a: [Action(1, 0, Op.F) if x == a[0] else x for x in a], "action of stage 1"),
    (lambda a: [Action(0, 0, Op.RF), *a], "no suppliers, but runs RF0.0"),
])
def test_the_validator_names_what_is_wrong(edit: object, message: str) -> None:
    sched = make_schedule("gpipe", 2, chain(1), [False])
    line = list(sched.actions[0])
    assert [str(x) for x in line] == ["F0.0", "F0.1", "B0.1", "B0.0"]
    bad = Schedule("x", 2, sched.suppliers, (tuple(edit(line)),))  # type: ignore[operator]
    with pytest.raises(ScheduleError, match=message):
        validate(bad)


def test_text_form_errors_are_clear() -> None:
    with pytest.raises(ScheduleError, match="cannot read action 'X0.1'"):
        Action.parse("X0.1")
    with pytest.raises(ScheduleError, match="first line"):
        Schedule.parse("0: F0.0")


# -- the planner's use of schedules ----------------------------------------------------------------

SPEC = rannc.DeviceSpec("test-gpu", memory_bytes=16e9, flops=10e12, mem_bandwidth=1e12)


@pytest.fixture(scope="module")
def gpt2() -> tuple[object, object]:
    case = make_case("gpt2", batch=32)
    g = capture(case.model, case.args, case.kwargs).graph
    return g, atomic_components(g)


def test_auto_picks_the_fastest_schedule_and_forcing_is_honoured(gpt2: tuple) -> None:
    graph, atomic = gpt2
    cluster = rannc.Cluster.homogeneous(SPEC, n=4, per_node=4)
    times = {}
    for name in SCHEDULES:
        cfg = rannc.Config(schedule=name, partition_num=4, microbatches=8)
        p = plan_graph(graph, atomic, cluster, cfg, batch_size=32)
        assert p.schedule == name
        assert p.predicted_iteration_time == pytest.approx(predict(p).iteration_time)
        times[name] = p.predicted_iteration_time
    auto = plan_graph(graph, atomic, cluster, rannc.Config(partition_num=4, microbatches=8),
                      batch_size=32)
    # (a forced partition_num counts one stage per rank: auto leaves interleaved out then)
    runnable = [t for name, t in times.items() if get_spec(name).runs and get_spec(name).chunks == 1]
    assert auto.predicted_iteration_time == pytest.approx(min(runnable))


def test_auto_takes_the_fastest_prediction_within_memory(gpt2: tuple) -> None:
    """Nothing forced but the microbatches: auto takes the fastest prediction (a schedule over
    two stages per rank at 16 and 4 microbatches, interleaved 1F1B or ZB-V; ZB-H1 beats 1F1B at
    both, ZB-V beats ZB-H1 at 4, where its bubble over two stages per rank is the smaller);
    under a memory limit the ZB-V plan's busiest device exceeds and ZB-H1's meets, auto takes
    the fastest of the schedules that fit it, within the limit."""
    graph, atomic = gpt2
    cluster = rannc.Cluster.homogeneous(SPEC, n=4, per_node=4)

    def plan(**kw: object) -> rannc.Plan:
        return plan_graph(graph, atomic, cluster, rannc.Config(checkpointing="off", **kw),  # type: ignore[arg-type]
                          batch_size=32)

    def busiest(p: rannc.Plan) -> float:  # a device's stages together
        return max(sum(st.predicted["memory_bytes"] for st in p.stages if st.ranks == rs)
                   for rs in {st.ranks for st in p.stages})

    for M in (16, 4):
        times = {n: plan(schedule=n, microbatches=M).predicted_iteration_time for n in SCHEDULES}
        fastest = min(times, key=lambda n: times[n] or 0.0)
        assert fastest in ("interleaved_1f1b", "zero_bubble_v"), times
        assert times["zero_bubble"] < times["1f1b"] and times["interleaved_1f1b"] < times["1f1b"]
        assert plan(microbatches=M).schedule == fastest
        if M == 4:
            assert times["zero_bubble_v"] < times["zero_bubble"], times
    zb, zbv = plan(schedule="zero_bubble", microbatches=4), plan(schedule="zero_bubble_v", microbatches=4)
    assert busiest(zb) < busiest(zbv)
    usable = 1.0 - rannc.Config().mem_margin  # (plans keep a margin below the limit)
    limit = (busiest(zb) + busiest(zbv)) / 2 / usable
    fits = {}
    for n in SCHEDULES:
        try:
            p = plan(schedule=n, microbatches=4, mem_limit_gb=limit / 1e9)
        except rannc.PlanInfeasibleError:
            continue
        if busiest(p) <= usable * limit:
            fits[n] = p.predicted_iteration_time
    assert "zero_bubble" in fits
    auto = plan(microbatches=4, mem_limit_gb=limit / 1e9)
    assert auto.schedule == min(fits, key=lambda n: fits[n]) and busiest(auto) <= usable * limit, fits


def test_a_devices_two_stages_split_its_memory_unevenly_where_that_is_faster(
        gpt2: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """ZB-V pairs the first stage of a device (many microbatches in flight) with a later one
    (few): under a memory limit where half the device makes stage 3 recompute, giving it more
    than half (its partner needs less) keeps everything and is faster, and every device's
    stages still fit together; the even split is what the planner falls back to."""
    graph, atomic = gpt2
    cluster = rannc.Cluster.homogeneous(SPEC, n=4, per_node=4)

    def plan() -> rannc.Plan:
        return plan_graph(graph, atomic, cluster, rannc.Config(schedule="zero_bubble_v",
                                                               microbatches=8, mem_limit_gb=0.002),
                          batch_size=32)

    usable = 0.002e9 * (1.0 - rannc.Config().mem_margin)
    split = plan()
    mem = [st.predicted["memory_bytes"] for st in split.stages]
    assert split.placement() == (0, 1, 2, 3, 3, 2, 1, 0)
    assert all(st.recompute == 0 for st in split.stages)
    assert max(mem) > usable / 2
    for d in range(4):  # a device's two stages together
        assert sum(m for m, lane in zip(mem, split.placement(), strict=True) if lane == d) <= usable
    monkeypatch.setattr(search, "lane_share_options", lambda *a: [])
    even = plan()
    assert max(st.predicted["memory_bytes"] for st in even.stages) <= usable / 2
    assert any(st.recompute > 0 for st in even.stages)
    assert split.predicted_iteration_time < even.predicted_iteration_time


def test_stage_aware_recomputation_between_none_and_all(gpt2: tuple) -> None:
    """Under 1F1B the first stage holds 4 microbatches and the last one; under a memory limit
    where keeping everything fits no split, each stage recomputes only what it must, so the plan
    is faster than recomputing everything and uses more (allowed) memory."""
    graph, atomic = gpt2
    cluster = rannc.Cluster.homogeneous(SPEC, n=4, per_node=4)
    base = dict(schedule="1f1b", partition_num=4, microbatches=8)

    def needs(mode: str) -> float:  # the least memory any split needs, from the planner's error
        with pytest.raises(PlanInfeasibleError) as e:
            plan_graph(graph, atomic, cluster, rannc.Config(checkpointing=mode, mem_limit_gb=1e-9,
                                                            **base), batch_size=32)
        return e.value.needed_bytes

    need_full, need_keep = needs("on"), needs("off")
    assert need_full < need_keep
    limit = (need_full + need_keep) / 2
    keep = plan_graph(graph, atomic, cluster, rannc.Config(checkpointing="off", **base), batch_size=32)
    full = plan_graph(graph, atomic, cluster, rannc.Config(checkpointing="on", mem_limit_gb=limit / 1e9,
                                                           **base), batch_size=32)
    # (the prefix's fraction alone: selective recomputation, which "auto" also weighs, is
    # test_selective's)
    aware = plan_graph(graph, atomic, cluster, rannc.Config(mem_limit_gb=limit / 1e9,
                                                            selective_recompute=False, **base),
                       batch_size=32)
    sel = plan_graph(graph, atomic, cluster, rannc.Config(mem_limit_gb=limit / 1e9, **base),
                     batch_size=32)
    assert sel.predicted_iteration_time <= aware.predicted_iteration_time
    fr = [st.predicted["recompute_memory_fraction"] for st in aware.stages]
    # not all-or-nothing: some stage recomputes part of its activations, and the last stage,
    # which holds one microbatch at a time under 1F1B, recomputes nothing
    assert max(fr) > 0 and fr[-1] == 0.0 and len(set(fr)) > 1
    assert all(st.predicted["memory_bytes"] <= limit * 0.9 * (1 + 1e-9) for st in aware.stages)
    assert keep.predicted_iteration_time < aware.predicted_iteration_time < full.predicted_iteration_time
    assert sum(st.predicted["memory_bytes"] for st in aware.stages) > sum(
        st.predicted["memory_bytes"] for st in full.stages)


def test_plan_costs_and_the_cli_timeline(tmp_path: object, gpt2: tuple) -> None:
    graph, atomic = gpt2
    cluster = rannc.Cluster.homogeneous(SPEC, n=2, per_node=2)
    p = plan_graph(graph, atomic, cluster, rannc.Config(partition_num=2, microbatches=4,
                                                        checkpointing="on", schedule="1f1b"),
                   batch_size=32)
    costs = plan_costs(p)
    assert costs.recompute[0] > 0
    assert costs.fwd[0] == p.stages[0].predicted["forward_s"]


# -- zero-bubble (ZB-H1) and interleaved 1F1B ------------------------------------------------------

@pytest.mark.parametrize(("S", "M"), [(2, 2), (2, 8), (4, 4), (4, 8), (4, 13), (8, 16)])
@pytest.mark.parametrize(("tf", "tb", "tw"), [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (2.0, 1.0, 1.0),
                                              (1.0, 1.5, 0.5)])
def test_zero_bubble_matches_the_published_bubbles(S: int, M: int, tf: float, tb: float,
                                                   tw: float) -> None:
    """Qi et al. 2023, section 3: 1F1B idles (p - 1)(T_F + T_B + T_W) per stage, ZB-H1
    (p - 1)(T_F + T_B - T_W) (their case T_W <= T_B; B here is the backward less W)."""
    costs = StageCosts.uniform(S, tf, tb + tw, wgrad=tw)
    work = M * (tf + tb + tw)
    one = simulate(make_schedule("1f1b", M, chain(S), [False] * S), costs)
    zb = simulate(make_schedule("zero_bubble", M, chain(S), [False] * S), costs)
    assert one.iteration_time == pytest.approx(work + (S - 1) * (tf + tb + tw))
    assert zb.iteration_time == pytest.approx(work + (S - 1) * (tf + tb - tw))
    assert zb.bubble_ratio == pytest.approx((S - 1) * (tf + tb - tw) / work)


def test_zero_bubble_is_1f1b_when_nothing_is_split_off() -> None:
    for S, M in [(2, 4), (4, 8)]:
        costs = StageCosts.uniform(S, 1.0, 2.0)  # no weight share known: W takes no time
        one = simulate(make_schedule("1f1b", M, chain(S), [False] * S), costs).iteration_time
        zb = simulate(make_schedule("zero_bubble", M, chain(S), [False] * S), costs).iteration_time
        assert zb == pytest.approx(one)


def test_zero_bubble_lines_and_memory() -> None:
    S, M = 4, 8
    sched = make_schedule("zero_bubble", M, chain(S), [True] * S)
    # stage s defers s weight passes: its first W comes after its (s+1)-th B
    for s, line in enumerate(sched.actions):
        ops = [a for a in line if a.op in (Op.B, Op.W)]
        first_w = next(i for i, a in enumerate(ops) if a.op is Op.W)
        assert first_w == s + 1 and ops[first_w].micro == 0
        assert all(a.micro == i for i, a in enumerate(x for x in ops if x.op is Op.W))
    # every stage holds what 1F1B's first stage holds (a microbatch is alive until its W), and
    # recomputed activations too are kept until W
    assert in_flight(sched) == [(4, 1), (4, 2), (4, 3), (4, 4)]
    # and stage s holds s + 1 microbatches' gradients kept from B for W at once (what the
    # memory model counts besides the activations), as many as it has rebuilt at once
    assert pending_w(sched) == [1, 2, 3, 4] == [r for _, r in in_flight(sched)]
    assert pending_w(make_schedule("1f1b", M, chain(S), [True] * S)) == [0] * S
    assert max(n for n, _ in in_flight(make_schedule("1f1b", M, chain(S), [False] * S))) == 4
    # the gain asked for: 4 stages, 8 microbatches, T_F = T_B = T_W
    costs = StageCosts.uniform(S, 1.0, 2.0, wgrad=1.0)
    one = simulate(make_schedule("1f1b", M, chain(S), [False] * S), costs).iteration_time
    zb = simulate(make_schedule("zero_bubble", M, chain(S), [False] * S), costs).iteration_time
    assert one / zb >= 1.1


@pytest.mark.parametrize("lag", [0, 1])
def test_zero_bubble_with_its_lag_capped_sits_between_1f1b_and_zb_h1(lag: int) -> None:
    """W deferred by at most `lag` microbatches: a stage holds at most lag + 1 microbatches
    between B and W (ZB-H1's stage s: s + 1) and at most `lag` more activations than 1F1B's
    same stage; uniform stages, T_F = T_B = T_W: ZB-H1 <= lag 1 <= lag 0 < 1F1B (27, 29, 30,
    33 time units on 4 stages, 8 microbatches: B no longer waits for W)."""
    S, M = 4, 8
    capped = make_schedule(f"zero_bubble_lag{lag}", M, chain(S), [False] * S)
    for s, line in enumerate(capped.actions):
        ops = [a for a in line if a.op in (Op.B, Op.W)]
        first_w = next(i for i, a in enumerate(ops) if a.op is Op.W)
        assert first_w == min(s, lag) + 1 and ops[first_w].micro == 0
    assert pending_w(capped) == [min(s, lag) + 1 for s in range(S)]
    one_f = in_flight(make_schedule("1f1b", M, chain(S), [False] * S))
    assert [n for n, _ in in_flight(capped)] == [n + min(s, lag) for s, (n, _) in enumerate(one_f)]
    costs = StageCosts.uniform(S, 1.0, 2.0, wgrad=1.0)
    t = {n: simulate(make_schedule(n, M, chain(S), [False] * S), costs).iteration_time
         for n in ("1f1b", "zero_bubble_lag0", "zero_bubble_lag1", "zero_bubble")}
    assert t == {"1f1b": 33.0, "zero_bubble_lag0": 30.0, "zero_bubble_lag1": 29.0, "zero_bubble": 27.0}


@pytest.mark.parametrize(("P", "v", "M"), [(2, 2, 2), (2, 2, 8), (2, 3, 4), (4, 2, 8), (4, 2, 16),
                                           (4, 3, 8), (4, 4, 12), (3, 2, 9)])
@pytest.mark.parametrize(("tf", "tb"), [(1.0, 2.0), (1.0, 1.0), (2.0, 1.0)])
def test_interleaved_divides_the_1f1b_bubble_by_the_chunks(P: int, v: int, M: int, tf: float,
                                                           tb: float) -> None:
    """Narayanan et al. 2021, section 2.2: P devices of v stages each (1/v of the model's
    T_F + T_B per stage) idle (P - 1)(T_F + T_B) / v, 1F1B's bubble over v."""
    S = P * v
    place = [s % P for s in range(S)]
    sched = make_schedule("interleaved_1f1b", M, chain(S), [False] * S, place)
    validate(sched)
    assert Schedule.parse(str(sched)) == sched
    assert sched.lanes == P and sched.stages_on(0) == list(range(0, S, P))
    tl = simulate(sched, StageCosts.uniform(S, tf / v, tb / v))
    one = simulate(make_schedule("1f1b", M, chain(P), [False] * P), StageCosts.uniform(P, tf, tb))
    assert one.iteration_time == pytest.approx(M * (tf + tb) + (P - 1) * (tf + tb))
    assert tl.iteration_time == pytest.approx(M * (tf + tb) + (P - 1) * (tf + tb) / v)


@pytest.mark.parametrize("P", [1, 2, 3, 4, 6])
def test_zbv_places_two_stages_per_lane_in_a_v_and_idles_only_while_filling(P: int) -> None:
    """ZB-V (Qi et al. 2023, section 6): lane d runs stages d and 2P - 1 - d. With F, B and W of
    one stage (half a 1F1B stage) all of length t, once there are at least 2P microbatches a
    lane idles only until its first input arrives, at most (P - 1) t: the iteration is
    2M 3t + (P - 1) t, against 1F1B's M 6t + (P - 1) 6t and ZB-H1's M 6t + (P - 1) 2t on the
    same P lanes. Its busiest lane holds P + 1/2 1F1B stages' worth of microbatches (lane 0:
    2P in its first stage, one in its last, each half a stage) against 1F1B's P. Fewer
    microbatches than its warm-up still run (no deadlock)."""
    S = 2 * P
    for M in range(1, 3 * P + 2):
        sched = make_schedule("zero_bubble_v", M, chain(S), [False] * S)
        validate(sched)
        assert Schedule.parse(str(sched)) == sched
        assert sched.placement == (*range(P), *reversed(range(P)))
        assert all(sched.stages_on(d) == [d, S - 1 - d] for d in range(P))
        assert all(sched.splits_backward(s) for s in range(S))
        tl = simulate(sched, StageCosts.uniform(S, 1.0, 2.0, wgrad=1.0))
        if M >= 2 * P:
            assert tl.iteration_time == pytest.approx(6 * M + (P - 1))
            one = simulate(make_schedule("1f1b", M, chain(P), [False] * P),
                           StageCosts.uniform(P, 2.0, 4.0)).iteration_time
            zb = simulate(make_schedule("zero_bubble", M, chain(P), [False] * P),
                          StageCosts.uniform(P, 2.0, 4.0, wgrad=2.0)).iteration_time
            assert one == pytest.approx(6 * M + 6 * (P - 1))
            assert zb == pytest.approx(6 * M + 2 * (P - 1))
            held = in_flight(sched)
            worth = max((held[d][0] + held[S - 1 - d][0]) / 2 for d in range(P))
            assert worth == P + 0.5
            assert get_spec("zero_bubble_v").in_flight(S, M) == max(n for n, _ in held)
            rebuilt = in_flight(make_schedule("zero_bubble_v", M, chain(S), [True] * S))
            assert pending_w(sched) == [r for _, r in rebuilt]


def test_zbv_refuses_what_it_cannot_place() -> None:
    with pytest.raises(ScheduleError, match="multiple of 2 stages, got 3"):
        make_schedule("zero_bubble_v", 4, chain(3), [False] * 3)
    with pytest.raises(ScheduleError, match="two stages on each lane"):
        make_schedule("zero_bubble_v", 4, chain(6), [False] * 6, [0, 1, 0, 1, 0, 1])


def test_interleaved_memory_and_what_it_refuses() -> None:
    sched = make_schedule("interleaved_1f1b", 8, chain(8), [False] * 8)  # 4 lanes x 2 chunks
    held = [n for n, _ in in_flight(sched)]
    # the first lane's chunks hold 8 and 4 microbatches at their peaks, each chunk half a 1F1B
    # stage: up to 6 stages' worth against 1F1B's 4 (Megatron's memory cost of interleaving)
    assert held == [8, 8, 7, 5, 4, 4, 3, 1]
    assert get_spec("interleaved_1f1b").in_flight(8, 8) == 8
    with pytest.raises(ScheduleError, match="needs fewer than 4 microbatches or a multiple of 4, "
                                            "got 5; use microbatches=8"):
        make_schedule("interleaved_1f1b", 5, chain(8), [False] * 8)
    with pytest.raises(ScheduleError, match="multiple of 2 stages, got 3; use partition_num 4"):
        make_schedule("interleaved_1f1b", 4, chain(3), [False] * 3)
    with pytest.raises(ScheduleError, match="runs one stage per lane"):
        make_schedule("1f1b", 4, chain(4), [False] * 4, [0, 1, 0, 1])


@pytest.mark.parametrize(("edit", "message"), [
    (lambda a: [x for x in a if str(x) != "W0.1"], "never runs W0.1"),
    (lambda a: [*a[:4], a[5], a[4]], "runs W0.1 before B0.1"),
])
def test_the_validator_checks_the_weight_passes(edit: object, message: str) -> None:
    sched = make_schedule("zero_bubble", 2, chain(1), [False])
    line = list(sched.actions[0])
    assert [str(x) for x in line] == ["F0.0", "B0.0", "W0.0", "F0.1", "B0.1", "W0.1"]
    validate(Schedule("x", 2, sched.suppliers, (tuple(line),)))
    bad = Schedule("x", 2, sched.suppliers, (tuple(edit(line)),))  # type: ignore[operator]
    with pytest.raises(ScheduleError, match=message):
        validate(bad)


def test_lanes_in_the_text_form_and_the_validator() -> None:
    sched = make_schedule("interleaved_1f1b", 2, chain(4), [False] * 4)
    text = str(sched)
    assert text.splitlines()[0].endswith("lanes=0,1,0,1") and len(text.splitlines()) == 3
    moved = Schedule(sched.name, 2, sched.suppliers, (sched.actions[1], sched.actions[0]),
                     sched.placement)
    with pytest.raises(ScheduleError, match="lane 0's line holds RF1.0, an action of stage 1"):
        validate(moved)
    with pytest.raises(ScheduleError, match="2 lanes but has 1 lines"):
        Schedule.parse("\n".join(text.splitlines()[:2]))


def test_the_planner_prices_weight_passes_and_plans_interleaved(gpt2: tuple) -> None:
    graph, atomic = gpt2
    cluster = rannc.Cluster.homogeneous(SPEC, n=4, per_node=4)
    cfg = dict(partition_num=4, microbatches=8, checkpointing="off")
    one = plan_graph(graph, atomic, cluster, rannc.Config(schedule="1f1b", **cfg), batch_size=32)
    zb = plan_graph(graph, atomic, cluster, rannc.Config(schedule="zero_bubble", **cfg),
                    batch_size=32)
    # the estimate oracle gives every stage a weight-gradient share of its backward ...
    share = [st.predicted["backward_weight_s"] / st.predicted["backward_s"] for st in zb.stages]
    assert all(0 < x < 1 for x in share)
    # ... which ZB-H1 moves off the critical path: faster than 1F1B on the same split, every
    # stage holding what 1F1B's first stage holds
    assert plan_costs(zb).wgrad == [st.predicted["backward_weight_s"] for st in zb.stages]
    assert zb.predicted_iteration_time < one.predicted_iteration_time
    assert [st.predicted["in_flight"] for st in zb.stages] == [4.0] * 4
    assert [st.predicted["in_flight"] for st in one.stages] == [4.0, 3.0, 2.0, 1.0]
    # interleaved: 4 stages on 2 lanes of 2 replicas each, stages s and s + 2 on the
    # same ranks with the same replicas, each rank's two stages within its memory together
    il = plan_graph(graph, atomic, cluster, rannc.Config(schedule="interleaved_1f1b", **cfg),
                    batch_size=32)
    assert il.schedule == "interleaved_1f1b" and il.placement() == (0, 1, 0, 1)
    assert il.stages[0].ranks == il.stages[2].ranks and il.stages[1].ranks == il.stages[3].ranks
    assert predict(il).schedule.lanes == 2
    assert il.predicted_iteration_time == pytest.approx(predict(il).iteration_time)
    limit = SPEC.memory_bytes * 0.9
    for d in range(2):
        assert sum(st.predicted["memory_bytes"] for st in il.stages
                   if il.placement()[st.index] == d) <= limit
    # auto searches only what the runtime runs; forcing the rest is refused at deployment
    slow = dataclasses.replace(get_spec("interleaved_1f1b"), name="planned_only", runs=False)
    with registered(slow):
        auto = plan_graph(graph, atomic, cluster, rannc.Config(microbatches=8), batch_size=32)
        assert auto.schedule != "planned_only"
        with pytest.raises(ScheduleError, match="does not run it yet"):
            require_runs("planned_only")
    for name in SCHEDULES:
        require_runs(name)
