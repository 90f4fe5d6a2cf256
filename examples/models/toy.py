"""Small models for rannc's tests: fork/join, shared parameters, keyword inputs, and a model
torch.export cannot capture (Python control flow on a tensor's value)."""

from __future__ import annotations

import torch
from torch import nn


class ForkJoin(nn.Module):
    """Two branches (Linear+ReLU, Linear+Tanh) summed with an input skip, then Linear to 4."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.left = nn.Linear(d, d)
        self.right = nn.Linear(d, d)
        self.out = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.left(x))
        b = torch.tanh(self.right(x))
        return self.out(a + b + x)


class SharedParam(nn.Module):
    """One Linear applied twice, at two depths, with another Linear in between."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.shared = nn.Linear(d, d)
        self.middle = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.shared(x))
        h = torch.relu(self.middle(h))
        return self.shared(h)


class KwargsModel(nn.Module):
    """Keyword-only inputs (mask, Python-float scale, extra); returns {"out", "loss"}."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.linear = nn.Linear(d, d)

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        scale: float = 1.0,
        extra: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        h = x * mask if mask is not None else x
        h = self.linear(h)
        if extra is not None:
            h = h + extra
        out = h * scale
        return {"out": out, "loss": (out**2).mean()}


class _Gate(nn.Module):
    """A Linear whose sign depends on the input's value: data-dependent control flow."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # branches on a tensor value: torch.export cannot capture this
            return self.linear(x)
        return -self.linear(x)


class DataDependent(nn.Module):
    """A wrapper whose child `gate` branches on `x.sum() > 0` (not capturable by torch.export)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.pre = nn.Linear(d, d)
        self.gate = _Gate(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.pre(x))


__all__ = ["DataDependent", "ForkJoin", "KwargsModel", "SharedParam"]
