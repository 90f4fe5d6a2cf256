"""A plan's schedule and its predicted timeline, from the plan's own cost predictions or from
per-action times measured on the ranks (to check the simulator against a real run)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from rannc.plans import Plan
from rannc.schedule.actions import Op, Schedule, chain
from rannc.schedule.simulate import Event, StageCosts, Timeline, simulate
from rannc.schedule.spec import make_schedule


def plan_schedule(plan: Plan, suppliers: Sequence[Sequence[int]] | None = None) -> Schedule:
    """The schedule `plan` runs (stage graph `suppliers`; default a chain)."""
    sup = chain(len(plan.stages)) if suppliers is None else suppliers
    return make_schedule(plan.schedule, plan.microbatches, sup,
                         [st.recomputed_components > 0 for st in plan.stages], plan.placement())


def plan_costs(plan: Plan) -> StageCosts:
    """Per-stage seconds from the plan's predictions (the planner's cost oracle)."""
    missing = [st.index for st in plan.stages if st.predicted is None]
    if missing:
        raise ValueError(f"stages {missing} carry no predicted times; plan with rannc.plan()")
    p = [st.predicted for st in plan.stages if st.predicted is not None]
    zero = [0.0] * len(p)
    return StageCosts(fwd=[x.forward_s for x in p], bwd=[x.backward_s - x.recompute_s for x in p],
                      recompute=[x.recompute_s for x in p], comm_fwd=zero, comm_bwd=zero,
                      allreduce=[x.allreduce_s for x in p],
                      wgrad=[x.backward_weight_s or 0.0 for x in p])


def measured_costs(plan: Plan, events: Mapping[int, Sequence[Event]]) -> StageCosts:
    """Per-stage seconds as the mean of each compute action's measured duration over the
    stage's ranks (the mean, not the median: the iteration pays for the slow ones too);
    transfers are taken as free (they are waits in the measured events)."""
    n = len(plan.stages)
    dur: dict[tuple[int, Op], list[float]] = {}
    for evs in events.values():
        for e in evs:
            if e.action.op in (Op.F, Op.B, Op.R, Op.W):
                dur.setdefault((e.action.stage, e.action.op), []).append(e.end - e.start)

    def mean(s: int, op: Op) -> float:
        xs = dur.get((s, op))
        return statistics.fmean(xs) if xs else 0.0

    zero = [0.0] * n
    # where W ran apart, the backward is B + W and W its weight share
    return StageCosts(fwd=[mean(s, Op.F) for s in range(n)],
                      bwd=[mean(s, Op.B) + mean(s, Op.W) for s in range(n)],
                      recompute=[mean(s, Op.R) for s in range(n)], comm_fwd=zero, comm_bwd=zero,
                      allreduce=zero, wgrad=[mean(s, Op.W) for s in range(n)])


def predict(plan: Plan, costs: StageCosts | None = None,
            suppliers: Sequence[Sequence[int]] | None = None) -> Timeline:
    """The simulated timeline of one iteration of `plan`."""
    return simulate(plan_schedule(plan, suppliers), plan_costs(plan) if costs is None else costs)


__all__ = ["measured_costs", "plan_costs", "plan_schedule", "predict"]
