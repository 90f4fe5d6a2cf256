"""A model's own autograd.Functions keep their backward under rannc (rannc.graph.functions):
before, torch.export recorded their forward's ops and autograd of those replaced the backward
they define, so straight-through estimators, gradient reversal, clipped gradients and PhiMoE's
router trained with other gradients, silently, even in one process."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from function_models import ClippedSqrt, FunctionsNet, GradReverse, RoundSTE, functions_net
from mpi_harness import run_rannc_check
from torch import nn

import rannc
from rannc.check import Settings, find_mpiexec, parse_results, run_case
from rannc.errors import CaptureError
from rannc.graph import functions
from rannc.graph.capture import capture

pytestmark = pytest.mark.layer("single_process")


def _ops(model: nn.Module, *args: Any) -> list[str]:
    return [t.op for t in capture(model, args).graph.tasks]


def test_each_call_of_a_models_function_is_one_op_of_the_graph() -> None:
    """FunctionsNet applies four Functions (one of them applies a fifth inside its forward,
    which stays part of it): four ops, and none of their forwards' own ops (round, sqrt)."""
    ops = _ops(FunctionsNet(), torch.randn(4, 8))
    assert ops.count(functions.OP_NAME) == 4, ops
    assert not any(op.startswith(("aten.round", "aten.sqrt")) for op in ops), ops


@pytest.mark.parametrize("options", [{}, {"compile": True}], ids=["eager", "compiled"])
def test_gradients_are_the_functions_own_in_one_process(options: dict[str, Any]) -> None:
    """Outputs, gradients and AdamW steps equal the unwrapped model's (exactly, eager): before,
    the gradients of every layer below a Function were off (rel. error up to 30). Compiled, each
    Function runs eagerly between the compiled pieces."""
    rep = run_case("functions_net", functions_net, Settings(batch=6, options=options))
    assert rep.passed, rep.to_json()
    if not options:
        assert all(c.max_abs == 0 for c in rep.checks), rep.to_json()


def test_the_gradient_reaches_the_layers_below_a_straight_through_estimator() -> None:
    """The straight-through estimator alone: autograd of round() is zero, so below it every
    gradient was zero under rannc."""

    class Quantised(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(RoundSTE.apply(self.a(x))).sum()

    torch.manual_seed(0)
    model = Quantised()
    ref = copy.deepcopy(model)
    x = torch.randn(6, 4)
    rannc.RaNNCModule(model)(x).backward()
    ref(x).backward()
    assert ref.a.weight.grad is not None and ref.a.weight.grad.abs().sum() > 0
    torch.testing.assert_close(model.a.weight.grad, ref.a.weight.grad, rtol=0, atol=0)


def test_a_function_that_writes_into_its_input_is_refused_by_name() -> None:
    class AddOneInPlace(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.mark_dirty(x)
            return x.add_(1)

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return AddOneInPlace.apply(self.lin(x))

    with pytest.raises(CaptureError, match=r"AddOneInPlace writes into its input.*mark_dirty"):
        capture(M(), (torch.randn(3, 4),))


def test_a_function_given_a_symbolic_size_is_refused_by_name() -> None:
    """The batch size is symbolic in the capture: the Function cannot be kept whole with it as a
    constant, and tracing its forward would drop its backward, so the capture says so."""

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, n: int) -> torch.Tensor:
            return x / n

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
            return g, None

    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Scale.apply(x, x.shape[0])

    with pytest.raises(CaptureError, match=r"Scale.*symbolic"):
        capture(M(), (torch.randn(3, 4),))


def test_torchs_own_functions_are_traced_as_before() -> None:
    assert not functions._kept_whole(torch.utils.checkpoint.CheckpointFunction, (torch.ones(1),))
    assert functions._kept_whole(GradReverse, (torch.ones(1), 0.5))
    assert not functions._kept_whole(ClippedSqrt, (3,))  # no tensor: nothing to differentiate


@pytest.mark.layer("multi_rank")
@pytest.mark.parametrize("args", [
    ("--ranks", "2", "--partition-num", "2", "--microbatches", "2", "--schedule", "1f1b",
     "--batch", "8"),
    ("--ranks", "3", "--replicas", "2,1", "--microbatches", "4", "--schedule", "zero_bubble",
     "--batch", "10"),
], ids=["2r-pn2-m2-1f1b", "3r-rep21-m4-zb"])
def test_gradients_are_the_functions_own_on_several_ranks(args: tuple[str, ...]) -> None:
    """Stages, replicas, 1F1B and zero-bubble's split backward (B then W walk the Functions'
    own backward nodes) against the unwrapped model on the global batch."""
    if find_mpiexec() is None:
        pytest.skip("no mpiexec next to this python or on PATH")
    rc, out = run_rannc_check("function_models:functions_net", *args)
    found = parse_results(out)
    assert rc == 0 and found["functions_net"]["passed"], out


def test_a_function_defined_again_under_the_same_name_is_another_function() -> None:
    """As a notebook cell run twice defines it: the second model's graph calls the second
    class, whose backward differs."""
    def make(k: float) -> nn.Module:
        class Scaled(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
                return x * 1.0

            @staticmethod
            def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
                return g * k

        class M(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = nn.Linear(2, 2)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return Scaled.apply(self.lin(x)).sum()

        return M()

    for k in (2.0, 3.0):
        model = make(k)
        rannc.RaNNCModule(model)(torch.randn(3, 2)).backward()
        assert model.lin.bias.grad is not None
        torch.testing.assert_close(model.lin.bias.grad, torch.full((2,), 3 * k))
