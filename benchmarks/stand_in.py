"""A stand-in model whose layers wait instead of computing, for measuring pipeline schedules on
a machine with fewer cores than ranks.

On a GPU a stage that waits for its neighbour leaves the device idle: that idle time (the
bubble) is what zero-bubble and interleaved schedules remove. Four CPU ranks on two cores are
different: a rank that waits gives its core to another rank, so no schedule can shorten the
wall time except by doing less work in total. Layers that sleep make the ranks behave like
devices again: a sleeping rank holds no core, so the time a schedule leaves idle is lost as on a
GPU, and what remains of the CPU (the runtime's own work: sends, receives, autograd
bookkeeping) is small beside the sleeps.

Each layer is ``y = wait_input(x) + wait_weight(w)`` with two custom operators (captured by
``torch.export`` as opaque nodes, with their own autograd formulas):

* ``wait_input`` sleeps ``t_f`` in forward and ``t_b`` in its backward (the input gradient, B);
* ``wait_weight`` returns its weight in forward and sleeps ``t_w`` in its backward (the weight
  gradient, W).

The weight path joins the input path at the addition, so a runtime that splits a backward into
B (to the layer inputs) and W (to the weights) runs the two sleeps in separate passes, and a
full backward runs both. Sleeps do not scale with the rows of a microbatch.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

_REGISTERED = False


def _register() -> None:
    """Define the two operators once per process (torch.library refuses a second definition)."""
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True

    @torch.library.custom_op("rannc_stand_in::sleep", mutates_args=())
    def sleep(x: torch.Tensor, seconds: float) -> torch.Tensor:
        time.sleep(seconds)
        return x.clone()

    @sleep.register_fake
    def _(x: torch.Tensor, seconds: float) -> torch.Tensor:
        return torch.empty_like(x)

    @torch.library.custom_op("rannc_stand_in::wait_input", mutates_args=())
    def wait_input(x: torch.Tensor, t_f: float, t_b: float) -> torch.Tensor:
        time.sleep(t_f)
        return x.clone()

    @wait_input.register_fake
    def _(x: torch.Tensor, t_f: float, t_b: float) -> torch.Tensor:
        return torch.empty_like(x)

    def wait_input_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.t_b = inputs[2]

    def wait_input_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return torch.ops.rannc_stand_in.sleep(grad, ctx.t_b), None, None

    wait_input.register_autograd(wait_input_backward, setup_context=wait_input_setup)

    @torch.library.custom_op("rannc_stand_in::wait_weight", mutates_args=())
    def wait_weight(w: torch.Tensor, t_w: float) -> torch.Tensor:
        return w.clone()

    @wait_weight.register_fake
    def _(w: torch.Tensor, t_w: float) -> torch.Tensor:
        return torch.empty_like(w)

    def wait_weight_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.t_w = inputs[1]

    def wait_weight_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return torch.ops.rannc_stand_in.sleep(grad, ctx.t_w), None

    wait_weight.register_autograd(wait_weight_backward, setup_context=wait_weight_setup)


class WaitLayer(nn.Module):
    """Sleeps t_f in forward, t_b in the input gradient and t_w in the weight gradient (s)."""

    def __init__(self, hidden: int, t_f: float, t_b: float, t_w: float) -> None:
        super().__init__()
        _register()
        self.weight = nn.Parameter(torch.zeros(hidden))
        self.t_f, self.t_b, self.t_w = t_f, t_b, t_w

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, H)
        ops = torch.ops.rannc_stand_in
        # the weight first: the captured graph's first node of a layer is then one reading the
        # layer's parameter, so a cut at the layer's first such node is a cut between layers
        w = ops.wait_weight(self.weight, self.t_w)
        return ops.wait_input(x, self.t_f, self.t_b) + w


def layers(n: int, hidden: int, t_f: float, t_b: float, t_w: float) -> nn.Sequential:
    return nn.Sequential(*[WaitLayer(hidden, t_f, t_b, t_w) for _ in range(n)])
