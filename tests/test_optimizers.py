"""Several optimizers of one model as one (`rannc.optimizers`): what rannc reads and changes of
them goes to the optimizer that steps each parameter. Exactness on several ranks:
test_semantics_mpi.py "optimizers"."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rannc.deploy import optimizer_state_factor
from rannc.errors import ConfigError
from rannc.optimizers import OptimizerSet, as_one, members

pytestmark = pytest.mark.layer("pure")


def _pair() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    matrices = [model[0].weight, model[2].weight]
    rest = [model[0].bias, model[1].weight, model[1].bias, model[2].bias]
    return model, torch.optim.SGD(matrices, lr=0.1, momentum=0.9), torch.optim.AdamW(rest, lr=0.01)


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(5, 3)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_one_optimizer_is_itself_and_a_list_is_a_set() -> None:
    _model, sgd, adamw = _pair()
    assert as_one(None) is None and as_one(sgd) is sgd and as_one([sgd]) is sgd
    both = as_one([sgd, adamw])
    assert isinstance(both, OptimizerSet) and members(both) == [sgd, adamw]
    assert members(sgd) == [sgd] and members(None) == []
    # the groups are the optimizers' own dicts: pruning one prunes the optimizer it belongs to
    assert both.param_groups[0] is sgd.param_groups[0] and both.param_groups[1] is adamw.param_groups[0]
    assert optimizer_state_factor(both) == 2.0 and optimizer_state_factor(sgd) == 1.0


def test_anything_else_or_a_parameter_in_two_optimizers_is_refused() -> None:
    model, sgd, _adamw = _pair()
    with pytest.raises(ConfigError, match=r"\['SGD', 'Linear'\]: pass a torch.optim.Optimizer, a list"):
        as_one([sgd, model[0]])
    with pytest.raises(ConfigError, match="optimizer is dict"):
        as_one({"sgd": sgd})
    other = torch.optim.Adam(model[0].parameters())
    with pytest.raises(ConfigError, match=r"optimizers 0 and 1 \(SGD, Adam\) both step a parameter of "
                                          r"shape \(4, 3\)"):
        as_one([sgd, other])


def test_state_step_hooks_and_state_dicts_go_to_each_optimizer() -> None:
    model, sgd, adamw = _pair()
    both = as_one([sgd, adamw])
    assert isinstance(both, OptimizerSet)
    calls: list[str] = []
    handle = both.register_step_pre_hook(lambda opt, *_: calls.append(type(opt).__name__))
    _train(model, both)
    assert calls == ["SGD", "AdamW"]
    handle.remove()
    _train(model, both)
    assert calls == ["SGD", "AdamW"]
    assert len(both.state) == 6 and model[0].weight in both.state and model[1].bias in both.state
    assert set(both.state[model[0].weight]) == {"momentum_buffer"}
    assert set(both.state[model[1].bias]) == {"step", "exp_avg", "exp_avg_sq"}
    kept = both.state.pop(model[2].bias)
    assert model[2].bias not in adamw.state and "exp_avg" in kept
    adamw.state[model[2].bias] = kept
    # torch's layout over the groups together (rannc's by-name loading builds this one)
    flat = {"state": {0: both.state[model[0].weight], 5: both.state[model[2].bias]},
            "param_groups": [{**sgd.param_groups[0], "params": [0, 1], "lr": 0.5},
                             {**adamw.param_groups[0], "params": [2, 3, 4, 5]}]}
    _model2, sgd2, adamw2 = _pair()
    both2 = as_one([sgd2, adamw2])
    assert both2 is not None
    both2.load_state_dict(flat)
    assert sgd2.param_groups[0]["lr"] == 0.5 and len(sgd2.state) == 1 and len(adamw2.state) == 1
    torch.testing.assert_close(sgd2.state[sgd2.param_groups[0]["params"][0]]["momentum_buffer"],
                               sgd.state[model[0].weight]["momentum_buffer"])
    torch.testing.assert_close(adamw2.state[adamw2.param_groups[0]["params"][3]]["exp_avg"],
                               adamw.state[model[2].bias]["exp_avg"])
    both2.load_state_dict(both.state_dict())  # (each optimizer's own, in order)
    assert len(both2.state) == 6 and sgd2.param_groups[0]["lr"] == 0.1
