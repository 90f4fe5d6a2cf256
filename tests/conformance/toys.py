"""Small factories for testing `rannc.check` itself (the two return forms of its protocol)."""

from __future__ import annotations

import torch
from torch import nn

from rannc.check import Case


def mlp() -> tuple[nn.Module, object]:
    """The tuple form: (model, batch_fn); the loss defaults to the mean of squares."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    return model, lambda n: torch.randn(n, 8)


def batchnorm() -> Case:
    """BatchNorm normalises over the rows one microbatch has (DESIGN.md 1): with several
    microbatches it differs from the model on the global batch, and the check says so."""
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 8), torch.randint(0, 3, (n,))

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.net(x)

    return Case(Classifier(), batch, lambda out, inputs: nn.functional.cross_entropy(out, inputs[1]))


@torch.jit.script
def _gelu(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 * (1.0 + torch.erf(x / 1.4142135623730951))


class _Regressor(nn.Module):
    """Returns its loss as a bare scalar, through a TorchScript function (traced as Python)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.b(_gelu(self.a(x))), y)


def scalar_loss() -> Case:
    """The model's output is its loss (before, the check asked for a loss function)."""
    return Case(_Regressor(), lambda n: (torch.randn(n, 8), torch.randn(n, 4)))


class _Noisy(nn.Module):
    """Draws noise in forward in eval() too (as ViTMAE's random patch masking does)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x + torch.randn_like(x))


def noisy_eval() -> tuple[nn.Module, object]:
    """In one process the check compares random ops in eval() as in training (before, its
    eval outputs failed: the reference drew after rannc's call)."""
    return _Noisy(), lambda n: torch.randn(n, 8)
