"""Models with their own `torch.autograd.Function`s whose backward is not the derivative of
their forward (what `rannc.graph.functions` keeps whole through capture), as `rannc.check`
factories (`python -m rannc.check function_models:functions_net --ranks 2 ...`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rannc.check import Case


class RoundSTE(torch.autograd.Function):
    """Quantise to quarters; the gradient passes straight through (autograd of round is 0)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


class GradReverse(torch.autograd.Function):
    """Domain-adversarial gradient reversal: the identity forward (a view of its input, as the
    usual implementation returns), the gradient negated and scaled by a constant."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return -ctx.scale * g, None


class ScaledPair(torch.autograd.Function):
    """Two inputs, two outputs, `setup_context` style, saved tensors, one path's gradient
    scaled; its forward applies another Function (kept whole as part of this one)."""

    @staticmethod
    def forward(a: torch.Tensor, b: torch.Tensor, k: float) -> tuple[torch.Tensor, torch.Tensor]:
        return RoundSTE.apply(a) * b, a + b

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        a, b, k = inputs
        ctx.save_for_backward(a, b)
        ctx.k = k

    @staticmethod
    def backward(ctx: Any, g1: torch.Tensor, g2: torch.Tensor) -> tuple[Any, ...]:
        a, b = ctx.saved_tensors
        return g1 * b * ctx.k + g2, g1 * a + g2, None


class ClippedSqrt(torch.autograd.Function):
    """RecurrentGemma's SqrtBoundDerivative: the square root, its gradient clipped."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        if ctx.needs_input_grad[0]:  # (as fused kernels choose what to save)
            ctx.save_for_backward(x)
        return x.sqrt()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return g / torch.sqrt(x).clamp(min=0.5) / 2


class FunctionsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.l2 = nn.Linear(16, 16)
        self.l3 = nn.Linear(16, 16)
        self.l4 = nn.Linear(16, 16)
        self.l5 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(x))
        h = RoundSTE.apply(h)
        h = torch.tanh(self.l2(h))
        a, b = ScaledPair.apply(h, self.l3(h), 0.5)
        h = GradReverse.apply(a + b, 0.3)
        h = ClippedSqrt.apply(torch.sigmoid(self.l4(h)))
        return self.l5(h)


def functions_net() -> Case:
    return Case(FunctionsNet(), lambda n: torch.randn(n, 8))

