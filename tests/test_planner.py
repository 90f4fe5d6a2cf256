"""The planner (pure): properties of every plan it emits, forced options, the infeasible-plan
error, imbalance handling (the paper's BERT vocabulary-projection example) and plan files."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import pytest
import torch
from model_zoo import BUILDERS, make_case

import rannc
from rannc.atomic.components import atomic_components
from rannc.graph.capture import capture
from rannc.planner import PlanInfeasibleError, PlanStats, plan_graph
from rannc.profile.estimate import GraphCosts

pytestmark = pytest.mark.layer("pure")

logging.getLogger("transformers").setLevel(logging.ERROR)

SPEC = rannc.DeviceSpec("test-gpu", memory_bytes=16e9, flops=10e12, mem_bandwidth=1e12)


def check_plan(plan: rannc.Plan, n_components: int, world: int, limit: float) -> None:
    comps = sorted(c for st in plan.stages for c in st.components)
    assert comps == list(range(n_components)), "every atomic component in exactly one stage"
    # (an interleaved plan's stages s and s + P share their ranks: each set counts once)
    ranks = sorted(r for rs in {st.ranks for st in plan.stages} for r in rs)
    assert ranks == list(range(world)), "every device used by exactly one pipeline position"
    for st in plan.stages:
        assert sum(st.shares) == pytest.approx(1.0)
    for rs in {st.ranks for st in plan.stages}:  # what each device holds, all its stages
        assert sum(st.predicted["memory_bytes"] for st in plan.stages if st.ranks == rs) <= limit
    assert plan.predicted_iteration_time is not None and plan.predicted_iteration_time > 0


CLUSTERS = [(1, 1), (2, 2), (4, 4), (8, 4), (6, 3)]


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_every_plan_covers_the_model_fits_and_uses_every_device(name: str) -> None:
    case = make_case(name, batch=8)
    graph = capture(case.model, case.args, case.kwargs).graph
    atomic = atomic_components(graph)
    for world, per_node in CLUSTERS:
        cluster = rannc.Cluster.homogeneous(SPEC, n=world, per_node=per_node)
        for cfg in (rannc.Config(), rannc.Config(checkpointing="on"), rannc.Config(microbatches=2),
                    rannc.Config(mem_limit_gb=0.001)):
            plan = plan_graph(graph, atomic, cluster, cfg, batch_size=8)
            limit = (cfg.mem_limit_gb * 1e9 if cfg.mem_limit_gb else SPEC.memory_bytes)
            check_plan(plan, len(atomic.components), world, limit * (1 - cfg.mem_margin))
            if cfg.checkpointing == "on" and len(plan.stages) > 1:
                # the shifted critical path never recomputes on its last stage
                last = len(plan.stages) - (1 if plan.schedule == "scp" else 0)
                assert all(st.recompute == 1.0 for st in plan.stages[:last])


def test_forced_layout_is_honoured() -> None:
    case = make_case("gpt2", batch=8)
    cluster = rannc.Cluster.homogeneous(SPEC, n=6, per_node=6)
    plan = rannc.plan(case.model, case.args, case.kwargs, cluster=cluster,
                      config=rannc.Config(replicas=[1, 2], microbatches=4))
    assert [len(st.ranks) for st in plan.stages] == [2, 4]  # the pipeline of 3 is replicated twice
    assert plan.microbatches == 4
    plan = rannc.plan(case.model, case.args, case.kwargs, cluster=cluster,
                      config=rannc.Config(partition_num=3))
    assert len(plan.stages) == 3


def test_a_memory_limit_forces_more_stages_and_too_small_a_limit_says_what_is_needed() -> None:
    case = make_case("bert", batch=8)
    cluster = rannc.Cluster.homogeneous(SPEC, n=4, per_node=4)
    with pytest.raises(PlanInfeasibleError) as one:
        rannc.plan(case.model, case.args, case.kwargs, cluster=cluster,
                   config=rannc.Config(partition_num=1, mem_limit_gb=1e-9))
    with pytest.raises(PlanInfeasibleError) as anyp:
        rannc.plan(case.model, case.args, case.kwargs, cluster=cluster,
                   config=rannc.Config(mem_limit_gb=1e-9))
    need_one, need_any = one.value.needed_bytes, anyp.value.needed_bytes
    assert need_any < need_one
    assert "needs at least" in str(anyp.value) and "mem_limit_gb" in str(anyp.value)
    # the stated figure is right: with exactly that much memory a plan exists, and it splits
    plan = rannc.plan(case.model, case.args, case.kwargs, cluster=cluster,
                      config=rannc.Config(mem_limit_gb=need_any * 1.0001 / 1e9))
    assert len(plan.stages) >= 2
    check_plan(plan, sum(len(st.components) for st in plan.stages), 4, need_any * 1.0001 * 0.9)
    with pytest.raises(PlanInfeasibleError):
        rannc.plan(case.model, case.args, case.kwargs, cluster=cluster,
                   config=rannc.Config(mem_limit_gb=need_any * 0.999 / 1e9))


def _vocab_heavy_bert() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    from transformers import BertConfig, BertForPreTraining

    cfg = BertConfig(vocab_size=30522, hidden_size=128, num_hidden_layers=4, num_attention_heads=2,
                     intermediate_size=512)
    with torch.device("meta"):
        model = BertForPreTraining(cfg)
    kw = {k: torch.zeros(32, 128, dtype=torch.long, device="meta") for k in ("input_ids", "labels")}
    return model, kw


class _LossOnly(torch.nn.Module):
    """BertForPreTraining's masked-LM loss, and nothing else returned."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=input_ids).prediction_logits
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


@pytest.mark.parametrize("partition_num", [None, 2])
def test_a_dominant_last_layer_is_balanced_by_replicas(partition_num: int | None) -> None:
    """The paper's example: BERT's vocabulary projection dominates. On 4 devices the slowest
    stage stays within 1.25x of the ideal (total time / devices)."""
    model, kw = _vocab_heavy_bert()
    spec = rannc.DeviceSpec("test", 16e9, 10e12, 1e12, op_overhead=0.0, link_bandwidth=1e15)
    cluster = rannc.Cluster.homogeneous(spec, n=4, per_node=4)
    cfg = rannc.Config(partition_num=partition_num, checkpointing="off", microbatches=4)
    plan = rannc.plan(model, (), kw, cluster=cluster, config=cfg)
    cap = capture(model, (), kw)
    costs = GraphCosts.of(cap.graph, atomic_components(cap.graph))
    total = float(costs.component_time(spec, 32 // 4).sum())
    slowest = max(st.predicted["forward_s"] + st.predicted["backward_s"] for st in plan.stages)
    share = max(costs.component_time(spec, 8)) / total
    assert share > 0.5, "the vocabulary projection must dominate for this test to mean anything"
    assert slowest <= 1.25 * total / 4, plan.summary()


def test_plan_files_round_trip_and_are_checked_against_the_model(tmp_path: object) -> None:
    import pathlib

    case = make_case("fork_join", batch=8)
    cluster = rannc.Cluster.homogeneous(SPEC, n=2, per_node=2)
    plan = rannc.plan(case.model, case.args, case.kwargs, cluster=cluster,
                      config=rannc.Config(partition_num=2))
    path = pathlib.Path(str(tmp_path)) / "plan.json"
    plan.save(path)
    again = rannc.Plan.load(path)
    assert again == plan
    graph = capture(case.model, case.args, case.kwargs).graph
    again.check(graph, 2)
    other = make_case("shared_param", batch=8)
    with pytest.raises(rannc.RaNNCError, match="another model"):
        again.check(capture(other.model, other.args, other.kwargs).graph, 2)
    with pytest.raises(rannc.RaNNCError, match="ranks"):
        again.check(graph, 4)
    text = plan.summary()
    assert "stage" in text and "predicted" in text and "modules" in text


def test_planning_is_fast_and_reports_its_steps() -> None:
    case = make_case("bert", batch=8)
    stats = PlanStats()
    rannc.plan(case.model, case.args, case.kwargs,
               cluster=rannc.Cluster.homogeneous("V100-32GB", n=16, per_node=8), stats=stats)
    assert stats.blocks >= 1 and stats.components >= stats.blocks and stats.candidates >= 1
    assert set(stats.seconds) >= {"capture", "costs", "blocks", "profile", "stage_dp"}
    assert all(math.isfinite(s) for s in stats.seconds.values())


def test_unknown_device_names_are_refused_with_the_known_ones() -> None:
    with pytest.raises(rannc.ConfigError, match="V100-32GB"):
        rannc.Cluster.homogeneous("V100-64GB", n=2)


def test_the_measure_oracle_plans_a_materialised_model(tmp_path: object) -> None:
    """profiler="measure": blocks are run on this CPU; the plan has the same properties, and a
    second planning run with the same cache directory reuses the measured profiles."""
    case = make_case("bert", batch=8)
    cluster = rannc.Cluster.homogeneous(SPEC, n=4, per_node=4)
    cfg = rannc.Config(profiler="measure", profile_cache_dir=str(tmp_path), blocks=8)
    first, second = PlanStats(), PlanStats()
    plan = rannc.plan(case.model, case.args, case.kwargs, cluster=cluster, config=cfg, stats=first)
    n = len(atomic_components(capture(case.model, case.args, case.kwargs).graph).components)
    check_plan(plan, n, 4, SPEC.memory_bytes * 0.9)
    again = rannc.plan(case.model, case.args, case.kwargs, cluster=cluster, config=cfg, stats=second)
    assert [st.components for st in again.stages] == [st.components for st in plan.stages]
    assert second.seconds["profile"] < first.seconds["profile"]


def test_each_stage_is_budgeted_for_the_microbatches_its_position_holds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under 1F1B the last stage holds one microbatch in flight, the first min(S, M). With the
    vocabulary projection on the last stage, a memory limit that fits the last stage at one
    microbatch (and the first at two) has a plan; budgeting every stage for the first stage's
    two microbatches, as the search did before, finds none."""
    from rannc import planner
    from rannc.stage_dp import search

    monkeypatch.setattr(planner, "_FINER_BLOCKS", 0)  # the budget alone, not finer blocks
    model, kw = _vocab_heavy_bert()
    # the loss alone: the logits a model returns are held for every microbatch until the call
    # returns, whatever the position (`returned_memory`), and would hide the in-flight budget
    model = _LossOnly(model)
    cap = capture(model, (), kw)
    graph, atomic = cap.graph, atomic_components(cap.graph)
    cluster = rannc.Cluster.homogeneous(SPEC, n=2, per_node=2)
    opts = dict(partition_num=2, microbatches=4, schedule="1f1b", checkpointing="off")
    roomy = plan_graph(graph, atomic, cluster, rannc.Config(**opts), batch_size=32)
    assert [st.predicted["in_flight"] for st in roomy.stages] == [2.0, 1.0]
    need = max(st.predicted["memory_bytes"] for st in roomy.stages)
    cfg = rannc.Config(**opts, mem_limit_gb=need * 1.001 / 0.9 / 1e9)  # mem_margin 0.1
    tight = plan_graph(graph, atomic, cluster, cfg, batch_size=32)
    assert [st.predicted["in_flight"] for st in tight.stages] == [2.0, 1.0]
    monkeypatch.setattr(search, "in_flight_by_position", lambda sched, D, m: None)
    with pytest.raises(PlanInfeasibleError):
        plan_graph(graph, atomic, cluster, cfg, batch_size=32)


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble", "gpipe"])
def test_an_accumulation_counts_the_gradients_of_an_eager_line_twice(schedule: str) -> None:
    """Under an accumulation (Config.grad_accumulation "on") a schedule that runs backward inside
    forward() holds the micro-step's own gradients beside the accumulated `.grad`: each stage's
    forecast grows by exactly its gradients' bytes. Fill-drain runs backward in backward(),
    where activations are being freed: unchanged. "auto" plans, without a call, as "off"."""
    model, kw = _vocab_heavy_bert()
    model = _LossOnly(model)
    cap = capture(model, (), kw)
    graph, atomic = cap.graph, atomic_components(cap.graph)
    cluster = rannc.Cluster.homogeneous(SPEC, n=2, per_node=2)
    opts = dict(partition_num=2, microbatches=4, schedule=schedule, checkpointing="off")
    plans = {acc: plan_graph(graph, atomic, cluster, rannc.Config(**opts, grad_accumulation=acc),
                             batch_size=32) for acc in ("off", "on", "auto")}
    params = dict(model.named_parameters(remove_duplicate=False))
    eager = schedule != "gpipe"
    for off, on, auto in zip(*(plans[a].stages for a in ("off", "on", "auto")), strict=True):
        assert off.components == on.components == auto.components
        held = {id(params[n]): params[n] for n in off.param_names}  # (a tied weight once)
        grads = sum(p.numel() * p.element_size() for p in held.values())
        assert grads > 0
        grew = on.predicted["memory_bytes"] - off.predicted["memory_bytes"]
        assert grew == pytest.approx(grads if eager else 0.0, rel=1e-9, abs=1.0), (off.index, grew)
        assert auto.predicted["memory_bytes"] == off.predicted["memory_bytes"]


def test_when_nothing_fits_in_k_blocks_the_planner_tries_finer_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage is a run of whole blocks, so k blocks allow at most k stages and none smaller than
    a block; when nothing fits, the search runs again on 2k and then 4k blocks (never more
    than the atomic components), and the last attempt's error is raised. (Llama-3-70B on 64
    H100 fits only that way: BENCHMARKS.md.)"""
    from rannc import planner

    tried: list[tuple[int, Any]] = []
    explained: list[bool] = []  # whether each attempt's error would carry the memory needed
    real = planner._plan_graph

    def fits_from(k_ok: int) -> Any:
        def attempt(*args: Any, **kwargs: Any) -> rannc.Plan:
            cfg = args[3]
            tried.append((cfg.blocks, cfg.zero_stage))
            explained.append(kwargs.get("explain", True))
            if cfg.blocks < k_ok:
                raise PlanInfeasibleError(f"nothing fits in {cfg.blocks} blocks", needed_bytes=1.0)
            return real(*args, **kwargs)
        return attempt

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(12)])
    args = (torch.zeros(8, 64),)
    cluster = rannc.Cluster.homogeneous(SPEC, n=4, per_node=4)
    monkeypatch.setattr(planner, "_plan_graph", fits_from(8))
    plan = rannc.plan(model, args, cluster=cluster, config=rannc.Config(blocks=2, zero_stage=0))
    assert tried == [(2, 0), (4, 0), (8, 0)] and plan.blocks is not None and plan.blocks >= 8
    tried.clear()
    monkeypatch.setattr(planner, "_plan_graph", fits_from(1000))
    explained.clear()
    with pytest.raises(PlanInfeasibleError, match="nothing fits in 8 blocks"):
        rannc.plan(model, args, cluster=cluster, config=rannc.Config(blocks=2, zero_stage=0))
    assert tried == [(2, 0), (4, 0), (8, 0)]
    # only the attempt whose error reaches the user works out the memory it would need (a
    # stage DP per layout tried)
    assert explained == [False, False, True]
    tried.clear()
    n = len(capture(model, args, {}).graph.tasks)  # more than the atomic components
    with pytest.raises(PlanInfeasibleError):
        rannc.plan(model, args, cluster=cluster, config=rannc.Config(blocks=n, zero_stage=0))
    assert tried == [(n, 0)]  # already at or beyond the components: nothing finer to try
    # zero_stage "auto" (the default): at each block count, without ZeRO-1 and then with it;
    # where a plan fits and has replicas, ZeRO-1 too, and the faster is kept
    tried.clear()
    monkeypatch.setattr(planner, "_plan_graph", fits_from(4))
    plan = rannc.plan(model, args, cluster=cluster, config=rannc.Config(blocks=2))
    weighed = [(4, 1)] if any(st.replicas > 1 for st in plan.stages) else []
    assert tried == [(2, 0), (2, 1), (4, 0), *weighed]


def _stated_need(config: rannc.Config) -> tuple[float, Any]:
    """The memory the planner says a BERT on 4 devices needs under `config` (from its error at
    a tiny limit), and a function planning it with a given limit in GB."""
    case = make_case("bert", batch=8)
    cluster = rannc.Cluster.homogeneous(SPEC, n=4, per_node=4)

    def plan_with(gb: float) -> Any:
        return rannc.plan(case.model, case.args, case.kwargs, cluster=cluster,
                          config=dataclasses.replace(config, mem_limit_gb=gb))
    with pytest.raises(PlanInfeasibleError) as small:
        plan_with(1e-9)
    need = small.value.needed_bytes
    assert math.isfinite(need) and need > 0, str(small.value)
    return need, plan_with


@pytest.mark.parametrize("schedule", ["zero_bubble_v", "interleaved_1f1b"])
def test_a_forced_interleaved_split_that_does_not_fit_says_what_is_needed(schedule: str) -> None:
    """Several stages per device with partition_num forced: the error states the memory with
    which that split exists (it said "needs at least inf GB": the stage counts it looked up
    were per stage, the search's per lane)."""
    need, plan_with = _stated_need(rannc.Config(schedule=schedule, partition_num=8, microbatches=4))
    plan = plan_with(need * 1.0001 / 1e9)
    assert len(plan.stages) == 8 and plan.schedule == schedule
    with pytest.raises(PlanInfeasibleError):
        plan_with(need * 0.99 / 1e9)


def test_forced_lanes_that_do_not_divide_the_devices_say_what_is_needed() -> None:
    """3 lanes of ZB-V on 4 devices (one lane with two replicas): the error is about memory, not
    about a batch too small to split."""
    need, plan_with = _stated_need(
        rannc.Config(schedule="zero_bubble_v", partition_num=6, microbatches=4))
    assert len(plan_with(need * 1.0001 / 1e9).stages) == 6


def test_the_search_tables_are_dropped_once_its_plans_are_simulated_and_plan_the_same(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner drops the search's whole stage tables once its candidates are simulated
    (`TableCache.forget`: the 12.96 B BERT's search held 1,059, 2.0 GB, to the end of
    planning); the refinement and the layer alignment then read what they need of the search's
    plans alone (`TableCache.stage_cost`). The plans are the same as with every table kept,
    roomy and under memory limits where stages recompute selectively or a prefix, with
    ZeRO-1."""
    from rannc.stage_dp import search

    case = make_case("gpt2", batch=8)
    graph = capture(case.model, case.args, case.kwargs).graph
    atomic = atomic_components(graph)
    cluster = rannc.Cluster.homogeneous(SPEC, n=8, per_node=4)
    roomy = plan_graph(graph, atomic, cluster, rannc.Config(), batch_size=8)
    need = max(st.predicted["memory_bytes"] for st in roomy.stages)
    configs = [rannc.Config()] + [rannc.Config(mem_limit_gb=need * f / 0.9 / 1e9) for f in (0.4, 0.3)]
    held: list[int] = []  # the tables each forget() dropped
    forget = search.TableCache.forget

    def counted(self: Any) -> None:
        held.append(len(self.tables))
        forget(self)
        assert not self.tables

    monkeypatch.setattr(search.TableCache, "forget", counted)
    plans = [plan_graph(graph, atomic, cluster, c, batch_size=8).to_dict() for c in configs]
    assert any(st["selective"] for st in plans[1]["stages"])  # (memory binds)
    assert any(st["recompute"] > 0 for st in plans[2]["stages"])
    assert len(held) >= len(configs) and min(held) > 10  # (every search's, once)
    monkeypatch.setattr(search.TableCache, "forget", lambda self: None)
    assert [plan_graph(graph, atomic, cluster, c, batch_size=8).to_dict() for c in configs] == plans
