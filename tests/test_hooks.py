"""Hooks a capture cannot keep are said at capture (rannc.graph.hooks): before, a tensor hook
registered in forward and a module's backward hooks silently never ran (gradients off), and a
forward hook's side effects ran once, on a fake tensor."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import rannc
from rannc.errors import CaptureError

pytestmark = pytest.mark.layer("single_process")


class Net(nn.Module):
    def __init__(self, rescale: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 1)
        self.rescale = rescale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.rescale and h.requires_grad:
            h.register_hook(lambda g: g * 3)
        return self.b(h).sum()


def test_a_gradient_hook_registered_in_forward_is_refused_at_its_line() -> None:
    with pytest.raises(CaptureError, match=r"gradient hook is registered inside forward "
                                           r"\(Net.forward at .*test_hooks.py:\d+\)"):
        rannc.RaNNCModule(Net(rescale=True))(torch.randn(4, 3))


@pytest.mark.parametrize("register", [
    lambda m, seen: m.a.register_full_backward_hook(lambda mod, gi, go: seen.append(1)),
    lambda m, seen: m.register_full_backward_pre_hook(lambda mod, go: seen.append(1)),
], ids=["full_backward_hook", "full_backward_pre_hook"])
def test_backward_hooks_are_refused_naming_the_modules(register: Any) -> None:
    model = Net()
    register(model, [])
    with pytest.raises(CaptureError, match=r"backward hooks on '(a|\(the model itself\))' would "
                                           r"never run.*Fix: remove them"):
        rannc.RaNNCModule(model)(torch.randn(4, 3))


def test_a_global_backward_hook_is_refused() -> None:
    handle = torch.nn.modules.module.register_module_full_backward_hook(lambda m, gi, go: None)
    try:
        with pytest.raises(CaptureError, match=r"every module \(a global hook"):
            rannc.RaNNCModule(Net())(torch.randn(4, 3))
    finally:
        handle.remove()


def test_forward_hooks_are_warned_once_and_what_they_compute_stays_exact() -> None:
    """A pre-hook that doubles the input is part of the graph (exact); the warning names the
    module, once for the model's captures."""
    model = Net()
    model.a.register_forward_pre_hook(lambda mod, inputs: (inputs[0] * 2,))
    ref = copy.deepcopy(model)
    wrapped = rannc.RaNNCModule(model)
    x = torch.randn(4, 3)
    with pytest.warns(UserWarning, match=r"forward hooks or pre-hooks on 'a' ran once, while "
                                         r"capturing"):
        out = wrapped(x)
    torch.testing.assert_close(out, ref(x), rtol=0, atol=0)
    out.backward()
    ref(x).backward()
    assert model.a.weight.grad is not None and ref.a.weight.grad is not None
    torch.testing.assert_close(model.a.weight.grad, ref.a.weight.grad, rtol=0, atol=0)
