"""ModelState: the model's parameters and buffers by name, kept between calls, rebuilt where the
module tree changed (a call must see what named_parameters() would give it)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rannc.graph.model_state import ModelState, model_state, replaced

pytestmark = pytest.mark.layer("pure")


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.Sequential(nn.Linear(3, 3)))
    return m


def _same(state: ModelState, m: nn.Module) -> None:
    assert state.params() == dict(m.named_parameters(remove_duplicate=False))
    assert state.buffers() == dict(m.named_buffers(remove_duplicate=False))
    assert state.both() == (state.params(), state.buffers())


def test_kept_while_nothing_changes() -> None:
    m = _model()
    state = ModelState(m)
    for _ in range(3):
        _same(state, m)
    with torch.no_grad():  # in-place updates keep the same tensors
        m[0].weight.add_(1.0)
        m[1].running_mean.fill_(2.0)
    _same(state, m)
    assert state.builds == 1


@pytest.mark.parametrize("change", ["parameter", "buffer", "submodule", "removed"])
def test_rebuilt_where_the_tree_changed(change: str) -> None:
    m = _model()
    state = ModelState(m)
    state.params()
    if change == "parameter":
        m[0].weight = nn.Parameter(torch.zeros(3, 2))
    elif change == "buffer":
        m[1].register_buffer("running_mean", torch.ones(3))
    elif change == "submodule":
        m[2] = nn.Sequential(nn.Linear(3, 3))
    else:
        del m[2][0].bias
        m[2][0].bias = None
    _same(state, m)
    assert state.builds == 2
    _same(state, m)
    assert state.builds == 2


def test_a_shared_parameter_under_two_names() -> None:
    lin = nn.Linear(3, 3)
    m = nn.ModuleDict({"a": lin, "b": nn.Sequential(lin)})
    state = ModelState(m)
    assert set(state.params()) == {"a.weight", "a.bias", "b.0.weight", "b.0.bias"}
    m["b"][0] = nn.Linear(3, 3)  # untied under one name only
    assert state.params()["b.0.weight"] is not state.params()["a.weight"]
    _same(state, m)


def test_one_state_per_model_and_what_was_replaced() -> None:
    m = _model()
    state = model_state(m)
    assert model_state(m) is state and model_state(_model()) is not state
    deployed = state.params()
    assert replaced(state.params(), deployed) == []
    m[0].weight = nn.Parameter(torch.zeros(3, 2))
    assert replaced(state.params(), deployed) == ["0.weight"]


def test_unchanged_checks_once_at_its_start() -> None:
    m = _model()
    state = ModelState(m)
    state.params()
    before = state.checks
    with state.unchanged():
        with state.unchanged():  # (nested: still the one check)
            for _ in range(3):
                state.params()
                state.both()
    assert state.checks == before + 1
    state.buffers()  # outside the block every read checks again
    assert state.checks == before + 2
    m[0].weight = nn.Parameter(torch.zeros(3, 2))  # a change between blocks is still seen
    with state.unchanged():
        assert state.params()["0.weight"] is m[0].weight
    assert state.builds == 2



def test_dtypes_are_part_of_the_capture_key() -> None:
    """`model.half()` or a module's `.to(dtype)` sets `param.data` and leaves the tree as it
    was; the capture key still changes (the captured graph records its dtypes), and converting
    back gives the key of before (its capture is used again)."""
    m = _model()
    state = ModelState(m)
    first = state.capture_key()
    runs = state.dtypes()
    # (the parameters, then the buffers: BatchNorm's num_batches_tracked is int64)
    assert runs == (("0.weight", torch.float32), ("1.num_batches_tracked", torch.int64))
    assert first[-1] == ()  # (as first seen: nothing in the key, nothing in what calls show)
    m[2].to(torch.float64)
    assert state.capture_key() != first
    assert state.dtypes() == (("0.weight", torch.float32), ("2.0.weight", torch.float64),
                              ("1.running_mean", torch.float32),
                              ("1.num_batches_tracked", torch.int64))
    m.half()
    assert [dt for _name, dt in state.dtypes()] == [torch.float16, torch.int64]
    m.float()
    assert state.capture_key() == first and state.dtypes() is runs
