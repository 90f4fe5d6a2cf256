"""The measure cost oracle (rannc.profile.measure) and its disk cache (rannc.profile.cache).

CPU and fast: measurement settings are loose (few repetitions, a short time cap per entry),
since these tests check what is measured and that profiling leaves no trace, not precision.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from model_zoo import make_case
from test_saved import autograd_saves
from torch import nn

from rannc.atomic.components import atomic_components
from rannc.graph.capture import capture, flatten_inputs
from rannc.profile.cache import ProfileCache, block_key
from rannc.profile.device import DeviceSpec
from rannc.profile.estimate import GraphCosts
from rannc.profile.measure import MeasureOracle, MeasureSettings, _chunks
from rannc.profile.saved import autocast_copies

pytestmark = pytest.mark.layer("pure")

FAST = MeasureSettings(warmup=1, min_reps=2, max_reps=4, max_seconds=0.15, min_sample_s=3e-3)
# A fixed spec (not measure_local_device, which varies run to run): only the estimate's
# relative component costs and CPU working memory come from it.
SPEC = DeviceSpec("test-cpu", 16e9, 50e9, 10e9, efficiency=1.0, op_overhead=2e-6)


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """One intra-op thread: on a shared 2-core machine two threads stall on each other's
    barriers for tens of milliseconds whenever another process takes a core."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _oracle(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], batch: int = 4,
            **kw: Any) -> tuple[MeasureOracle, int]:
    cap = capture(model, args, kwargs)
    atomic = atomic_components(cap.graph)
    leaves, _ = flatten_inputs(args, kwargs)
    costs = GraphCosts.of(cap.graph, atomic)
    kw.setdefault("settings", FAST)
    kw.setdefault("progress", False)
    return MeasureOracle(cap, atomic, model, leaves, torch.device("cpu"), costs, SPEC, **kw), \
        len(atomic.components)


@functools.cache
def _captured(name: str) -> tuple[Any, ...]:
    """One capture per zoo model for the tests that only read it (capture is the slow part)."""
    case = make_case(name, batch=4)
    cap = capture(case.model, case.args, case.kwargs)
    atomic = atomic_components(cap.graph)
    leaves, _ = flatten_inputs(case.args, case.kwargs)
    return case, cap, atomic, leaves, GraphCosts.of(cap.graph, atomic)


def _case_oracle(name: str, **kw: Any) -> tuple[MeasureOracle, int]:
    case, cap, atomic, leaves, costs = _captured(name)
    kw.setdefault("settings", FAST)
    kw.setdefault("progress", False)
    return MeasureOracle(cap, atomic, case.model, leaves, torch.device("cpu"), costs, SPEC, **kw), \
        len(atomic.components)


def _blocks(n: int, k: int) -> list[int]:
    return _chunks(np.ones(n), k)


class BnDropout(nn.Module):
    """BatchNorm running statistics (mutated buffers) and dropout (draws from the RNG)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.5)
        self.b = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.relu(self.bn(self.a(x)))))


@pytest.mark.parametrize("name", ["bert", "resnet", "fork_join", "kwargs"])
def test_block_profile_values(name: str) -> None:
    oracle, n = _case_oracle(name)
    k = min(4, n)
    prof = oracle.block_profile(_blocks(n, k), [1, 6])  # example batch 4: cut and tiled
    assert oracle.fallbacks == []
    assert prof.batch_sizes == (1, 6)
    for arr in (prof.fwd, prof.bwd, prof.kept, prof.work):
        assert arr.shape == (k, 2)
        assert np.isfinite(arr).all() and (arr >= 0).all()
    assert (prof.fwd > 0).all()
    assert (prof.bwd[:k - 1] > 0).all()  # every block but the loss head has tracked inputs
    assert (prof.kept.sum(axis=0) > 0).all()
    # kept activations grow with the batch (the same tensors with more rows)
    assert (prof.kept[:, 1] >= prof.kept[:, 0]).all()
    assert prof.kept[:, 1].sum() > prof.kept[:, 0].sum()
    if name == "bert":  # every block of a transformer keeps activations
        assert (prof.kept > 0).all(), prof.kept


def test_times_grow_with_batch() -> None:
    settings = MeasureSettings(warmup=1, min_reps=3, max_reps=6, max_seconds=0.3, min_sample_s=0.01)
    oracle, n = _case_oracle("resnet", settings=settings)
    prof = oracle.block_profile(_blocks(n, 2), [1, 16])
    total = (prof.fwd + prof.bwd).sum(axis=0)
    assert total[1] > total[0], total


def test_no_side_effects_on_the_user_model() -> None:
    torch.manual_seed(0)
    model = BnDropout().train()
    x = torch.randn(8, 16)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    oracle, n = _oracle(model, (x,), {})
    rng = torch.get_rng_state()
    assert all(p.grad is None for p in model.parameters())
    oracle.component_time(4)
    oracle.block_profile(_blocks(n, 3), [1, 5, 12])
    assert oracle.measured_entries > 0 and oracle.fallbacks == []
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in model.named_parameters():
        assert torch.equal(v, params[k]), k
        assert v.grad is None, k
    for k, b in model.named_buffers():
        assert torch.equal(b, buffers[k]), k


def test_resnet_batchnorm_statistics_untouched() -> None:
    case = make_case("resnet", batch=4)
    before = copy.deepcopy(case.model.state_dict())
    oracle, n = _oracle(case.model, case.args, case.kwargs)
    rng = torch.get_rng_state()
    oracle.block_profile(_blocks(n, 2), [2])
    assert torch.equal(torch.get_rng_state(), rng)
    after = case.model.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    assert all(p.grad is None for p in case.model.parameters())


def test_component_time_is_the_calibrated_estimate() -> None:
    oracle, n = _case_oracle("fork_join")
    ct = oracle.component_time(4)
    est = oracle.costs.component_time(SPEC, 4)
    assert ct.shape == (n,) and (ct > 0).all()
    factor = oracle.factors[4]
    np.testing.assert_allclose(ct, est * factor)
    whole = oracle.block_profile([0] * n, [4])  # what calibration measured
    np.testing.assert_allclose(ct.sum(), float((whole.fwd + whole.bwd).sum()), rtol=1e-9)


def test_disk_cache_reuses_measurements(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    case = make_case("fork_join", batch=4)
    first, n = _oracle(case.model, case.args, case.kwargs, cache_dir=str(tmp_path))
    blocks = _blocks(n, 3)
    p1 = first.block_profile(blocks, [1, 2, 6])
    c1 = first.component_time(2)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1

    second, _ = _oracle(case.model, case.args, case.kwargs, cache_dir=str(tmp_path))

    def boom(*a: Any, **k: Any) -> Any:
        raise AssertionError("measured although cached")

    monkeypatch.setattr(second, "_measure_entry", boom)
    monkeypatch.setattr(second, "_record", boom)
    p2 = second.block_profile(blocks, [1, 2, 6])
    for a in ("fwd", "bwd", "kept", "work"):
        assert np.array_equal(getattr(p1, a), getattr(p2, a)), a
    assert np.array_equal(second.component_time(2), c1)
    assert second.measured_entries == 0

    # a new batch size is measured and added to the same file
    monkeypatch.undo()
    third, _ = _oracle(case.model, case.args, case.kwargs, cache_dir=str(tmp_path))
    third.block_profile(blocks, [1, 3])
    assert third.measured_entries == 3
    data = json.loads(files[0].read_text())
    assert sum(k.endswith("@3") for k in data["entries"]) == 3


@pytest.mark.parametrize("content", ["{not json", json.dumps([1, 2]),
                                     json.dumps({"format": "rannc-profile-cache", "version": 1,
                                                 "fingerprint": "other", "device": "x",
                                                 "entries": {}}),
                                     "BAD_ENTRIES"])
def test_corrupt_or_foreign_cache_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                             content: str) -> None:
    case = make_case("fork_join", batch=4)
    oracle, n = _oracle(case.model, case.args, case.kwargs, cache_dir=str(tmp_path))
    assert oracle.cache is not None
    path = Path(oracle.cache.path)
    if content == "BAD_ENTRIES":
        key = ProfileCache.key(block_key(range(n)), 4)
        content = json.dumps({"format": "rannc-profile-cache", "version": 1,
                              "fingerprint": oracle.fingerprint, "device": oracle.device_key,
                              "entries": {key: ["x", 1, 2, 3]}})
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="rannc.profile.cache"):
        again, _ = _oracle(case.model, case.args, case.kwargs, cache_dir=str(tmp_path))
        prof = again.block_profile([0] * n, [4])
    assert "ignoring" in caplog.text
    assert again.measured_entries == 1 and np.isfinite(prof.fwd).all()
    data = json.loads(path.read_text())  # rewritten as a valid cache
    assert data["fingerprint"] == oracle.fingerprint and len(data["entries"]) == 1
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp")]


@pytest.mark.parametrize("error", [
    torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"),
])
def test_out_of_memory_marks_entries_infeasible(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                error: Exception) -> None:
    oracle, n = _case_oracle("fork_join", cache_dir=str(tmp_path))
    real = oracle._measure_entry
    calls: list[int] = []

    def fake(mod: Any, stage: Any, batch: int, params: Any) -> Any:
        calls.append(batch)
        if stage.index == 1 and batch >= 4:
            raise error
        return real(mod, stage, batch, params)

    monkeypatch.setattr(oracle, "_measure_entry", fake)
    prof = oracle.block_profile(_blocks(n, 2), [2, 4, 8])
    assert np.isfinite(prof.fwd[0]).all() and math.isfinite(prof.fwd[1, 0])
    for a in ("fwd", "bwd", "kept", "work"):
        assert np.isinf(getattr(prof, a)[1, 1:]).all(), a
    assert calls.count(8) == 1  # block 1 at batch 8 was skipped after batch 4 failed
    assert oracle.cache is not None and len(oracle.cache) == 4  # infeasible is not cached


def test_a_block_that_fails_to_run_falls_back_to_the_estimate(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    oracle, n = _case_oracle("fork_join", cache_dir=str(tmp_path))
    real = oracle._measure_entry

    def fake(mod: Any, stage: Any, batch: int, params: Any) -> Any:
        if stage.index == 0:
            raise ValueError("cannot run this op alone (simulated)")
        return real(mod, stage, batch, params)

    monkeypatch.setattr(oracle, "_measure_entry", fake)
    blocks = _blocks(n, 2)
    prof = oracle.block_profile(blocks, [2])
    est = oracle.costs.block_profile(SPEC, blocks, [2])
    assert [(j, b) for j, b, _ in oracle.fallbacks] == [(0, 2)]
    assert "simulated" in oracle.fallbacks[0][2]
    assert prof.fwd[0, 0] == est.fwd[0, 0] and prof.kept[0, 0] == est.kept[0, 0]
    assert oracle.cache is not None and len(oracle.cache) == 1  # estimates are not cached


def test_progress_line(capsys: pytest.CaptureFixture[str]) -> None:
    oracle, n = _case_oracle("fork_join", progress=True)
    oracle.block_profile(_blocks(n, 2), [1, 2])
    err = capsys.readouterr().err
    assert "rannc: profiling" in err and "4/4" in err  # a step per (block, batch) run
    assert err.endswith("\n")
    oracle, n = _case_oracle("fork_join")  # progress=False: nothing drawn
    oracle.block_profile(_blocks(n, 2), [1, 2])
    assert "rannc:" not in capsys.readouterr().err


def test_meta_model_is_refused() -> None:
    from rannc.errors import ConfigError

    with torch.device("meta"):
        model = BnDropout()
    with pytest.raises(ConfigError, match="meta"):
        _oracle(model, (torch.randn(4, 16),), {})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_measures_and_survives_oom() -> None:
    case = make_case("fork_join", batch=4)
    dev = torch.device("cuda")
    cap = capture(case.model, case.args, case.kwargs)
    atomic = atomic_components(cap.graph)
    leaves, _ = flatten_inputs(case.args, case.kwargs)
    costs = GraphCosts.of(cap.graph, atomic)
    oracle = MeasureOracle(cap, atomic, case.model, leaves, dev, costs, SPEC, settings=FAST)
    n = len(atomic.components)
    huge = torch.cuda.get_device_properties(dev).total_memory // 64 + 1  # 16 floats per row
    prof = oracle.block_profile([0] * n, [64, huge])
    assert oracle.fallbacks == []
    assert prof.fwd[0, 0] > 0 and prof.bwd[0, 0] > 0 and prof.kept[0, 0] > 0
    assert math.isinf(prof.fwd[0, 1])
    assert all(p.grad is None for p in case.model.parameters())


def test_rows_cut_and_tile_whole_samples() -> None:
    from rannc.graph.task_graph import Value, ValueKind
    from rannc.profile.measure import _rows

    val = Value("v", ValueKind.ACTIVATION, (3, "4*batch"), "float32", batch_dim=1, batch_scale=4)
    x = torch.arange(3 * 8).reshape(3, 8)  # 2 samples of 4 rows along dim 1
    assert torch.equal(_rows(x, val, 1), x[:, :4])
    assert torch.equal(_rows(x, val, 2), x)
    assert torch.equal(_rows(x, val, 5), torch.cat([x, x, x], dim=1)[:, :20])
    flat = Value("s", ValueKind.ACTIVATION, (), "float32")
    assert _rows(torch.tensor(1.0), flat, 7).shape == ()


def test_estimate_prices_autocast_products_at_the_half_precision_peak() -> None:
    """A bf16 matrix product (autocast) runs on tensor cores: the estimate charges it at
    `flops_half`, not at the fp32 peak, and an fp32 graph's products stay at `flops`."""
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
    x = torch.randn(64, 512)
    spec = DeviceSpec("tc", 1e10, 1e12, 1e15, flops_half=8e12, efficiency=1.0, op_overhead=0.0)
    no_tc = DeviceSpec("no-tc", 1e10, 1e12, 1e15, efficiency=1.0, op_overhead=0.0)

    def matmul_seconds(autocast: bool, s: DeviceSpec) -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            graph = capture(model, (x,), {}).graph
        costs = GraphCosts.of(graph, atomic_components(graph))
        fwd, _ = costs.task_times(s, 64)
        mm = [t for t, task in enumerate(graph.tasks) if "linear" in task.op or "addmm" in task.op
              or task.op.startswith("aten.mm")]
        assert mm, [t.op for t in graph.tasks]
        return float(fwd[mm].sum())

    fp32, bf16 = matmul_seconds(False, spec), matmul_seconds(True, spec)
    assert fp32 == pytest.approx(2 * 2 * 64 * 512 * 512 / 1e12, rel=0.05)
    assert bf16 == pytest.approx(fp32 / 8, rel=0.05)
    assert matmul_seconds(True, no_tc) == pytest.approx(fp32, rel=0.05)  # no tensor cores: fp32 peak


def test_the_oracle_measures_under_the_autocast_the_graph_was_captured_under() -> None:
    """A graph captured under autocast holds no casts (its products give bfloat16 only under
    autocast): measured from outside an autocast block (rannc.plan, a benchmark), it must still
    run as captured, keeping what autograd keeps under autocast (bfloat16 activations), not
    what the float32 graph keeps. The weights' bfloat16 copies autograd also keeps are one per
    autocast region, shared by a call's microbatches: not in a microbatch's kept bytes, but
    with the parameters (`autocast_copies`), where the first product's is not kept (its input
    needs no gradient)."""
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                          nn.Linear(256, 8))
    x = torch.randn(32, 64)
    for half in (False, True):
        with torch.autocast("cpu", torch.bfloat16, enabled=half):
            graph, real = autograd_saves(model, (x,))
            oracle, n = _oracle(model, (x,), {}, batch=32)
        assert oracle.cap.autocast[0] == ("cpu", half, torch.bfloat16 if half else None)
        copies = sum(autocast_copies(graph).values())
        assert copies == ((256 * 256 + 8 * 256) * 2 if half else 0)
        kept = float(oracle.block_profile([0] * n, [32]).kept.sum())  # (outside autocast)
        assert kept == pytest.approx(real - copies, rel=0.02), (half, kept, real, copies)


def test_the_estimate_floors_each_block_at_its_ops_host_time() -> None:
    """On a device that runs behind its host (`DeviceSpec.host_per_op`: a GPU), a block takes
    the larger of its device time and its ops' host time, forward, backward (twice a
    differentiable op's), weight gradients and selective recomputation alike; per block, not
    per op, and never in `component_time` (what coarsening balances)."""
    from rannc.profile.device import GPU_HOST_PER_OP, KNOWN_DEVICES

    _case, cap, atomic, _leaves, costs = _captured("llama")
    n = len(atomic.components)
    block_of = _blocks(n, 3)
    device_only = DeviceSpec("gpu-like", 16e9, 100e12, 2e12, efficiency=1.0)
    dev = costs.block_profile(device_only, block_of, [2, 8])
    # the ops of each block, counted here from the components (cloned tasks in each holder)
    ops = np.zeros(3)
    grad_ops, weight_ops = np.zeros(3), np.zeros(3)
    for comp in atomic.components:
        for t in comp.tasks:
            j = block_of[comp.index]
            ops[j] += costs.is_kernel[t]
            grad_ops[j] += costs.is_kernel[t] and costs.has_grad[t]
            weight_ops[j] += costs.is_kernel[t] and costs.has_grad[t] and costs.has_weight[t]
    for h in (1e-3, 1e-12):  # host-bound everywhere; never
        spec = dataclasses.replace(device_only, host_per_op=h)
        got = costs.block_profile(spec, block_of, [2, 8])
        for i in range(2):
            assert np.allclose(got.fwd[:, i], np.maximum(dev.fwd[:, i], h * ops))
            assert np.allclose(got.bwd[:, i], np.maximum(dev.bwd[:, i], 2 * h * grad_ops))
            assert got.wgrad is not None and dev.wgrad is not None
            assert np.allclose(got.wgrad[:, i], np.maximum(dev.wgrad[:, i], h * weight_ops))
            assert np.all(got.bwd[:, i] >= got.wgrad[:, i])  # a B pass left for zero-bubble
        assert got.selective is not None and dev.selective is not None
        assert np.all(got.selective >= dev.selective)
        assert np.array_equal(costs.component_time(spec, 4), costs.component_time(device_only, 4))
    assert np.allclose(costs.block_profile(dataclasses.replace(device_only, host_per_op=1e-3),
                                           block_of, [2]).fwd[:, 0], 1e-3 * ops)
    # the GPU entries carry the measured host time; a CPU's is in its device time
    assert all(d.host_per_op == GPU_HOST_PER_OP > 0 for d in KNOWN_DEVICES.values())
    assert DeviceSpec("cpu-like", 1e9, 1e11, 1e10).host_per_op == 0.0
