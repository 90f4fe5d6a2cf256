"""`plan_split` (pure): a split chosen elsewhere is costed exactly as the planner costs its own,
so benchmarks/plan_quality.py can compare other partitioners' splits with the planner's."""

from __future__ import annotations

import logging

import pytest
import torch

import rannc
from rannc.atomic.components import atomic_components
from rannc.errors import ConfigError
from rannc.graph.capture import capture
from rannc.planner import PlanInfeasibleError, plan_graph, plan_split
from rannc.profile.estimate import GraphCosts

pytestmark = pytest.mark.layer("pure")

logging.getLogger("transformers").setLevel(logging.ERROR)

SPEC = rannc.DeviceSpec("test-gpu", memory_bytes=16e9, flops=10e12, mem_bandwidth=1e12)


@pytest.fixture(scope="module")
def bert() -> tuple[object, object, GraphCosts]:
    from transformers import BertConfig, BertForPreTraining

    cfg = BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
                     intermediate_size=256)
    with torch.device("meta"):
        model = BertForPreTraining(cfg)
    kw = {k: torch.zeros(32, 64, dtype=torch.long, device="meta") for k in ("input_ids", "labels")}
    g = capture(model, (), kw).graph
    at = atomic_components(g)
    return g, at, GraphCosts.of(g, at)


def stage_blocks(plan: rannc.Plan, n: int) -> list[int]:
    """One block per stage of `plan`."""
    block_of = [0] * n
    for st in plan.stages:
        for c in st.components:
            block_of[c] = st.index
    return block_of


@pytest.mark.parametrize("devices", [2, 4])
def test_the_planners_own_split_costs_what_the_planner_predicted(bert: tuple, devices: int) -> None:
    g, at, costs = bert
    cluster = rannc.Cluster.homogeneous(SPEC, n=devices, per_node=devices)
    cfg = rannc.Config(partition_num=2)
    plan = plan_graph(g, at, cluster, cfg, batch_size=32, costs=costs)
    S = len(plan.stages)
    reps = [st.replicas for st in plan.stages]
    same = rannc.Config(partition_num=2, microbatches=plan.microbatches, schedule=plan.schedule)
    again = plan_split(g, at, cluster, same, batch_size=32, block_of=stage_blocks(plan, len(at.components)),
                       bounds=list(range(S + 1)), replicas=reps, costs=costs)
    assert again.predicted_iteration_time == pytest.approx(plan.predicted_iteration_time, rel=1e-9)
    assert [st.components for st in again.stages] == [st.components for st in plan.stages]
    # searching microbatch counts and schedules itself, it finds this split no slower
    best = plan_split(g, at, cluster, cfg, batch_size=32, block_of=stage_blocks(plan, len(at.components)),
                      bounds=list(range(S + 1)), replicas=reps, costs=costs)
    assert best.predicted_iteration_time <= plan.predicted_iteration_time * (1 + 1e-9)


def test_a_split_puts_the_bounded_components_on_each_stage(bert: tuple) -> None:
    g, at, costs = bert
    n = len(at.components)
    cluster = rannc.Cluster.homogeneous(SPEC, n=2, per_node=2)
    cfg = rannc.Config(microbatches=2, schedule="gpipe")
    whole = plan_split(g, at, cluster, cfg, batch_size=32, block_of=[0] * n, bounds=[0, 1],
                       replicas=[2], costs=costs)
    lopsided = plan_split(g, at, cluster, cfg, batch_size=32, block_of=list(range(n)),
                          bounds=[0, 2, n], replicas=[1, 1], costs=costs)
    assert lopsided.stages[0].components == (0, 1)
    assert lopsided.stages[1].components == tuple(range(2, n))
    f0, f1 = (st.predicted["forward_s"] for st in lopsided.stages)
    assert f1 > 10 * f0
    # one stage on 2 replicas computes half the rows of the two 1-replica stages together
    assert whole.stages[0].predicted["forward_s"] < f0 + f1


def test_bad_splits_are_refused_with_their_values(bert: tuple) -> None:
    g, at, costs = bert
    n = len(at.components)
    cluster = rannc.Cluster.homogeneous(SPEC, n=2, per_node=2)
    with pytest.raises(ConfigError, match=r"bounds \[0, 5, 5, 9\] must rise strictly"):
        plan_split(g, at, cluster, rannc.Config(), batch_size=32, block_of=list(range(9)) + [8] * (n - 9),
                   bounds=[0, 5, 5, 9], replicas=[1, 1, 1], costs=costs)
    with pytest.raises(ConfigError, match=r"replicas \[1, 2\] must be positive and use the 2"):
        plan_split(g, at, cluster, rannc.Config(), batch_size=32, block_of=[0] + [1] * (n - 1),
                   bounds=[0, 1, 2], replicas=[1, 2], costs=costs)
    with pytest.raises(PlanInfeasibleError, match="fits no microbatch count"):
        plan_split(g, at, cluster, rannc.Config(mem_limit_gb=1e-4), batch_size=32,
                   block_of=[0] * (n // 2) + [1] * (n - n // 2), bounds=[0, 1, 2], replicas=[1, 1],
                   costs=costs)


def test_a_split_costed_with_zero_1_says_so(bert: tuple) -> None:
    """A split planned under zero_stage=1 was costed with the replicas' optimizer state sharded,
    so its plan must deploy with ZeRO-1 (zero_stage 1), as plan_graph's plans do; without it the
    plan would run unsharded beyond the memory it was costed in."""
    g, at, costs = bert
    n = len(at.components)
    cluster = rannc.Cluster.homogeneous(SPEC, n=2, per_node=2)
    for zero in (0, 1):
        p = plan_split(g, at, cluster, rannc.Config(microbatches=2, schedule="gpipe", zero_stage=zero),
                       batch_size=32, block_of=[0] * n, bounds=[0, 1], replicas=[2], costs=costs)
        assert p.zero_stage == zero
