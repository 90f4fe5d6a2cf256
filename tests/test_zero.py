"""ZeRO-1's pure parts: which holder owns (and steps) each parameter, the memory the planner
counts for it, the planner's "auto" choice, the plan file and the option's validation. The
multi-rank exactness runs are test_pipeline_mpi.py (test_zero_1_*), test_train_ops_mpi.py
and test_checkpoint_mpi.py (checkpoints across ZeRO stages)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rannc
from rannc.config import ConfigError
from rannc.ownership import parameter_owners, spread
from rannc.planner import PlanInfeasibleError
from rannc.plans import Plan, StagePlan
from rannc.stage_dp.memory import static_memory

pytestmark = pytest.mark.layer("pure")


def test_spread_balances_largest_first_and_is_deterministic() -> None:
    numel = {"a": 100, "b": 60, "c": 50, "d": 10, "e": 10}
    got = spread((2, 3), numel)
    assert got == {"a": 2, "b": 3, "c": 3, "d": 2, "e": 2}  # loads 120 and 110 (a tie: rank 2)
    assert spread((2, 3), dict(reversed(numel.items()))) == got  # input order does not matter
    assert spread((5,), numel) == dict.fromkeys(numel, 5)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.emb.weight  # one tensor, two names


def _plan(zero: int) -> Plan:
    # stage 0 on ranks 0, 1 reads emb and mid; stage 1 on rank 2 reads head (= emb)
    st0 = StagePlan(index=0, components=(0,), ranks=(0, 1), shares=(0.5, 0.5), recompute=0.0,
                    param_names=("emb.weight", "mid.weight", "mid.bias"))
    st1 = StagePlan(index=1, components=(1,), ranks=(2,), shares=(1.0,), recompute=0.0,
                    param_names=("head.weight",))
    return Plan(stages=(st0, st1), microbatches=2, world_size=3, fingerprint="x", zero_stage=zero)


def test_owners_are_the_lowest_holder_without_zero_and_spread_with_it() -> None:
    model = _Tied()
    assert parameter_owners(model, _plan(0), 0) == {"emb.weight": 0, "mid.weight": 0, "mid.bias": 0}
    assert parameter_owners(model, _plan(0), 2) == {"emb.weight": 0}  # tied: one parameter
    owners = [parameter_owners(model, _plan(1), r) for r in range(3)]
    # the tied weight has holders 0, 1, 2 (alone in its set); mid's two go to 0 and 1
    assert owners[0] == {"emb.weight": 0, "mid.weight": 0, "mid.bias": 1}
    assert owners[1] == owners[0]  # every holder computes the same answer
    assert owners[2] == {"emb.weight": 0}


def test_zero_1_divides_the_optimizer_state_by_the_replicas() -> None:
    assert static_memory(100.0, 100.0, 2.0, 4, 0) == 400.0  # weights, grads, Adam's 2 moments
    assert static_memory(100.0, 100.0, 2.0, 4, 1) == 250.0
    assert static_memory(100.0, 100.0, 2.0, 1, 1) == 400.0


class _Wide(nn.Module):
    """One layer too big to split: only replicas with ZeRO-1 make it fit."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(1024, 1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).relu().sum()


def test_auto_plans_zero_1_when_nothing_fits_without_it() -> None:
    spec = rannc.DeviceSpec("test-gpu", memory_bytes=16e9, flops=10e12, mem_bandwidth=1e12)
    cluster = rannc.Cluster.homogeneous(spec, n=4, per_node=4)
    with torch.device("meta"):
        model = _Wide()
    x = torch.empty(8, 1024, device="meta")
    margin = rannc.Config().mem_margin
    # A gradient bucket (counted where gradients are reduced: on replicas) of 4 KB, not 25 MB:
    # at the default, a layer without replicas would fit where the replicated one needs ZeRO-1.
    kb = 0.004

    def need(zero: int) -> float:  # per device, the layer on 4 replicas
        plan = rannc.plan(model, (x,), cluster=cluster,
                          config=rannc.Config(zero_stage=zero, replicas=[4], mem_limit_gb=1.0,
                                              bucket_mb=kb))
        return plan.stages[0].predicted["memory_bytes"]

    p_bytes = 4 * (1024 * 1024 + 1024)
    assert need(0) - need(1) == pytest.approx(2 * p_bytes * 3 / 4)  # Adam's 2 moments: 3/4 fewer
    limit_gb = (need(0) + need(1)) / 2 / 1e9 / (1 - margin)
    with pytest.raises(PlanInfeasibleError):
        rannc.plan(model, (x,), cluster=cluster, config=rannc.Config(mem_limit_gb=limit_gb,
                                                                     zero_stage=0, bucket_mb=kb))
    plan = rannc.plan(model, (x,), cluster=cluster, config=rannc.Config(mem_limit_gb=limit_gb,
                                                                        bucket_mb=kb))
    assert plan.zero_stage == 1 and plan.stages[0].replicas > 1  # the layer on replicas
    assert plan.stages[0].predicted["memory_bytes"] <= limit_gb * 1e9
    assert "ZeRO-1" in plan.summary()
    assert Plan.from_dict(plan.to_dict()).zero_stage == 1
    roomy = rannc.plan(model, (x,), cluster=cluster, config=rannc.Config(mem_limit_gb=10 * limit_gb,
                                                                         bucket_mb=kb))
    assert roomy.zero_stage == 0  # auto: no ZeRO when it is not needed


def test_zero_stage_option() -> None:
    assert rannc.Config().zero_stage == "auto"
    assert rannc.Config(zero_stage=1).zero_stage == 1
    assert rannc.Config.resolve(environ={"RANNC_ZERO_STAGE": "1"}).zero_stage == 1
    assert rannc.Config.resolve(environ={"RANNC_ZERO_STAGE": "auto"}).zero_stage == "auto"
    for bad in (2, True, "one"):
        with pytest.raises(ConfigError, match="zero_stage must be one of 0, 1, 'auto'"):
            rannc.Config(zero_stage=bad)
