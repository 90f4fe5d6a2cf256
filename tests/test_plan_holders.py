"""Parameter ownership read from the Plan (`holder_stages`, `holders`, `owner`) and the one
replicas-divide-the-world check: pure, no process group."""

from __future__ import annotations

import pytest

from rannc.config import Config
from rannc.errors import ConfigError, RaNNCError
from rannc.plans import Plan, StagePlan, check_replicas_divide, stage_ranks
from rannc.profile.device import Cluster
from rannc.stage_dp.search import pipeline_layouts
from rannc.validate import check_config

pytestmark = pytest.mark.layer("pure")


def _plan() -> Plan:
    # 2 copies of a 2-stage pipeline [1, 2] over 6 ranks; "wte" tied: read by both stages
    ranks = stage_ranks([1, 2], 6)
    names = (("wte", "h0"), ("h1", "wte", "head"))
    stages = tuple(StagePlan(index=s, components=(s,), ranks=r, shares=(1 / len(r),) * len(r),
                             recompute=0.0, param_names=names[s]) for s, r in enumerate(ranks))
    return Plan(stages=stages, microbatches=2, world_size=6, fingerprint="x")


def test_holders_and_owner() -> None:
    plan = _plan()
    assert [st.ranks for st in plan.stages] == [(0, 3), (1, 2, 4, 5)]
    assert plan.holder_stages() == {"wte": (0, 1), "h0": (0,), "h1": (1,), "head": (1,)}
    assert plan.holders() == {"wte": (0, 1, 2, 3, 4, 5), "h0": (0, 3), "h1": (1, 2, 4, 5),
                              "head": (1, 2, 4, 5)}
    assert [plan.owner(n) for n in ("wte", "h0", "h1", "head")] == [0, 0, 1, 1]
    with pytest.raises(RaNNCError, match="'nope'"):
        plan.owner("nope")


_MESSAGE = ["replicas=[2, 1] sum to 3", "does not divide the 4 ranks", "Fix: give counts"]


@pytest.mark.parametrize("where", ["check", "config", "stage_ranks", "planner"])
def test_replicas_must_divide_the_world_one_message(where: str) -> None:
    """Forced replicas that do not divide the ranks: the same error and message wherever
    they are caught first (validate before the first collective, the planner, the plan)."""
    with pytest.raises(ConfigError) as e:
        if where == "check":
            check_replicas_divide([2, 1], 4)
        elif where == "config":
            check_config(Config(replicas=[2, 1]), 4)
        elif where == "stage_ranks":
            stage_ranks([2, 1], 4)
        else:
            pipeline_layouts(Cluster.homogeneous("V100-32GB", n=4, per_node=4), Config(replicas=[2, 1]))
    for part in _MESSAGE:
        assert part in str(e.value)
    check_replicas_divide([2, 1], 6)
