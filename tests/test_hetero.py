"""Mixed clusters (issue 7, first part): Whale's row shares, a cluster described by hand, and
plans whose replicas' shares follow their devices' speeds and memories."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from model_zoo import make_case

import rannc
from rannc.atomic.components import atomic_components
from rannc.graph.capture import capture
from rannc.planner import plan_graph
from rannc.stage_dp.shares import whale_shares

pytestmark = pytest.mark.layer("pure")

logging.getLogger("transformers").setLevel(logging.ERROR)


def test_shares_follow_speed_then_memory() -> None:
    assert whale_shares(30, [2, 1], [100, 100]) == pytest.approx([20, 10])
    # the fast device can hold only 12 rows: it takes 12, the others share the rest by speed
    assert whale_shares(30, [2, 1, 1], [12, 100, 100]) == pytest.approx([12, 9, 9])
    with pytest.raises(rannc.RaNNCError, match="hold 20.0 rows"):
        whale_shares(30, [1, 1], [10, 10])


FAST = {"name": "fast", "memory_bytes": 16e9, "flops": 10e12, "mem_bandwidth": 1e12}
SLOW = {**FAST, "name": "slow", "flops": 5e12, "mem_bandwidth": 0.5e12}  # 2x slower
SMALL = {**FAST, "name": "small", "memory_bytes": 8e9}  # half the memory


def test_cluster_file_and_a_mixed_plan(tmp_path: Path) -> None:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"per_node": 4, "devices": [SMALL, FAST, SLOW, FAST]}))
    cluster = rannc.Cluster.load(path)
    assert [d.name for d in cluster.devices] == ["small", "fast", "slow", "fast"]
    assert not cluster.is_homogeneous
    case = make_case("gpt2", batch=32)
    g = capture(case.model, case.args, case.kwargs).graph
    atomic = atomic_components(g)
    plan = plan_graph(g, atomic, cluster, rannc.Config(replicas=[2, 2], microbatches=2),
                      batch_size=32)
    # earlier stages (more activations in flight) on the fastest devices with the most memory
    assert sorted(plan.stages[0].ranks) == [1, 3] and sorted(plan.stages[1].ranks) == [0, 2]
    for st in plan.stages:
        speeds = {"fast": 10.0, "slow": 5.0, "small": 10.0}
        want = [speeds[n] for n in st.devices]
        assert st.shares == pytest.approx([w / sum(want) for w in want], rel=1e-6)
    assert "2:slow:0.33" in plan.summary() and "0:small:0.67" in plan.summary()
    with pytest.raises(rannc.RaNNCError, match="cannot read the cluster file"):
        rannc.Cluster.load(tmp_path / "missing.json")


def test_identical_devices_reported_with_noise_stay_one_kind() -> None:
    a = rannc.DeviceSpec("cpu", 8e9, 1.00e11, 1e10)
    b = rannc.DeviceSpec("cpu", 8e9, 1.07e11, 1e10)
    assert rannc.Cluster.from_reports([a, b], per_node=2).is_homogeneous


def test_a_device_short_of_memory_gets_fewer_rows() -> None:
    case = make_case("gpt2", batch=64)
    g = capture(case.model, case.args, case.kwargs).graph
    atomic = atomic_components(g)
    cfg = rannc.Config(replicas=[2], microbatches=1, checkpointing="off", mem_margin=0.0)
    roomy = rannc.Cluster([rannc.DeviceSpec(**FAST), rannc.DeviceSpec(**SLOW)], per_node=2)
    plan = plan_graph(g, atomic, roomy, cfg, batch_size=64)
    assert plan.stages[0].shares == pytest.approx([2 / 3, 1 / 3])  # by speed alone
    need = plan.stages[0].predicted["memory_bytes"]
    # the fast device now holds just over what half the rows need: it takes what fits
    tight = rannc.Cluster([rannc.DeviceSpec(**d) for d in (
        {**FAST, "memory_bytes": need * 0.8}, SLOW)], per_node=2)
    plan = plan_graph(g, atomic, tight, cfg, batch_size=64)
    fast_share = plan.stages[0].shares[plan.stages[0].devices.index("fast")]
    assert 0.5 <= fast_share < 2 / 3 - 0.01
    assert plan.stages[0].predicted["memory_bytes"] <= need * 0.8 * (1 + 1e-9)


@pytest.mark.layer("multi_rank")
def test_a_really_slow_rank_gets_a_third_of_the_rows(tmp_path: Path) -> None:
    """One of 2 ranks shares its core with a busy process (the harness's throttle, about 2x
    slower). Declared 2x slower in a cluster file, it gets a third of the rows, and both plans
    train on the throttled ranks. The step times are printed, not asserted: a timed assertion
    failed now and then on a loaded or even a quiet 2-core machine (speed is a benchmark's
    business; earlier runs measured the balanced step at 0.74 to 0.78 of the equal one, and
    `pytest tests/test_hetero.py -k really_slow -s` prints this run's)."""
    import os
    import re

    from mpi_harness import TESTS, run_mpi

    if not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 cores and sched_setaffinity to throttle one rank")
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"per_node": 2, "devices": [FAST, SLOW]}))
    res = run_mpi(TESTS / "scripts" / "throttle_check.py", 2, [str(path)])
    m = re.search(r"TIME balanced ([\d.]+) equal ([\d.]+)", res.stdout)
    assert m, res.stdout
    balanced, equal = float(m.group(1)), float(m.group(2))
    print(f"throttled rank: balanced step {balanced:.4f} s, equal shares {equal:.4f} s, "
          f"ratio {balanced / equal:.2f}")
    shares = {k: [float(x) for x in v.split(",")]
              for k, v in re.findall(r"SHARES (balanced|equal) \(([^)]*)\)", res.stdout)}
    assert shares.get("equal") == [0.5, 0.5], res.stdout
    fast, slow = shares["balanced"]
    assert abs(fast - 2 / 3) < 0.02 and abs(slow - 1 / 3) < 0.02, res.stdout


def test_the_mixed_cluster_dp_gives_the_fast_device_more_layers() -> None:
    """Two stages on one fast and one 2x slower device: costing both on the slower one splits
    the layers evenly; the mixed-cluster DP gives the fast device more of them and predicts a
    shorter iteration."""
    case = make_case("gpt2", batch=32)
    g = capture(case.model, case.args, case.kwargs).graph
    atomic = atomic_components(g)
    cluster = rannc.Cluster([rannc.DeviceSpec(**FAST), rannc.DeviceSpec(**SLOW)], per_node=2)
    base = dict(partition_num=2, microbatches=4, schedule="1f1b")
    even = plan_graph(g, atomic, cluster, rannc.Config(extra={"hetero_dp": False}, **base),
                      batch_size=32)
    aware = plan_graph(g, atomic, cluster, rannc.Config(**base), batch_size=32)
    assert aware.predicted_iteration_time < 0.95 * even.predicted_iteration_time
    fast = next(st for st in aware.stages if st.devices == ("fast",))
    slow = next(st for st in aware.stages if st.devices == ("slow",))
    assert len(fast.components) > len(slow.components)


MIXED4 = [{"name": "big-fast", "memory_bytes": 32e9, "flops": 20e12, "mem_bandwidth": 1e12},
          {"name": "big-slow", "memory_bytes": 32e9, "flops": 10e12, "mem_bandwidth": 0.6e12},
          {"name": "small-fast", "memory_bytes": 16e9, "flops": 20e12, "mem_bandwidth": 1e12},
          {"name": "small-slow", "memory_bytes": 16e9, "flops": 10e12, "mem_bandwidth": 0.6e12}]


def test_a_mixed_cluster_gets_no_slower_plan_than_a_forced_stage_count() -> None:
    """The plan made on the weakest device is placed on the real ones; the fastest there need
    not be the fastest placed. plan_snapshot's "gpt2 mixed4 tight" (GPT-2 6 x 256, four
    devices of two speeds and two memories, 0.2 GB each) got a 2-stage plan at 27.29 ms where
    its best 1-stage plan placed gives 24.46 ms: the best plan of each other stage count is
    placed too, so no forced stage count plans faster than auto."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=6, n_embd=256, n_head=4, n_positions=256,
                                       vocab_size=1000, use_cache=False))
    ids = torch.zeros(32, 256, dtype=torch.long)
    kw = {"input_ids": ids, "labels": ids, "use_cache": False}
    cluster = rannc.Cluster(devices=[rannc.DeviceSpec(**d) for d in MIXED4], per_node=4)
    auto = rannc.plan(model, (), kw, cluster=cluster, config=rannc.Config(mem_limit_gb=0.2))
    assert auto.predicted_iteration_time is not None
    for n in (1, 2):
        forced = rannc.plan(model, (), kw, cluster=cluster,
                            config=rannc.Config(mem_limit_gb=0.2, partition_num=n))
        assert forced.predicted_iteration_time is not None
        assert auto.predicted_iteration_time <= forced.predicted_iteration_time * (1 + 1e-9), \
            (n, auto.summary(), forced.summary())


def test_the_mixed_cluster_dp_runs_once_per_memory_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mixed-cluster DP's split depends on a schedule only through what each stage holds
    (in-flight and kept inputs, B-to-W pending, the overlapped reduction), so schedules
    holding alike share one run (1F1B and scp), and every schedule still gets its plan."""
    from rannc.stage_dp import placement

    calls: list[tuple[object, ...]] = []
    real = placement.hetero_stages

    def counting(*args: object, **kw: object) -> object:
        calls.append((kw["microbatches"], kw["in_flight"], kw["saved"], kw["pending"],
                      kw["overlap"]))
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(placement, "hetero_stages", counting)
    case = make_case("gpt2", batch=32)
    g = capture(case.model, case.args, case.kwargs).graph
    atomic = atomic_components(g)
    cluster = rannc.Cluster([rannc.DeviceSpec(**FAST), rannc.DeviceSpec(**SLOW)], per_node=2)
    plan_graph(g, atomic, cluster, rannc.Config(partition_num=2, microbatches=4, zero_stage=0),
               batch_size=32)
    assert calls and len(set(calls)) == len(calls)
    runs = {name for name in rannc.schedule.SCHEDULES if rannc.schedule.get_spec(name).runs
            and rannc.schedule.get_spec(name).chunks == 1}
    assert len(calls) < len(runs)  # some shared
