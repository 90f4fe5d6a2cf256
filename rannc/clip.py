"""Gradient clipping by the global norm of a model whose parameters are spread over ranks.

Every rank holds only its stage's parameters, and a parameter held by several ranks (a
stage's replicas, a weight tied between stages) carries the same, already reduced, gradient on
each of them. So the global norm is one all-reduce of per-rank contributions, where each rank
counts only the parameters it *owns* (`rannc.ownership`: the lowest holder, or under
ZeRO-1 the holder whose optimizer steps it), and a tied weight (several names, one tensor)
is one parameter, exactly as `torch.nn.utils.clip_grad_norm_` on the unwrapped model counts
it. Every rank then scales the
gradients it holds by the same coefficient, with torch's own `clip_grads_with_norm_`.

Training scripts written for DDP call `torch.nn.utils.clip_grad_norm_(model.parameters(), c)`.
On a deployed multi-rank RaNNCModule that would be a local norm, silently wrong, so the first
RaNNCModule installs a thin wrapper on that function (`install_torch_wrapper`): given exactly a
deployed module's parameters it delegates to the global version, given only some of them it
raises, and otherwise it is torch's function.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

# torch's function, kept before any wrapper is installed.
torch_clip_grad_norm_ = torch.nn.utils.clip_grad.clip_grad_norm_


def owned_parameters(model: nn.Module, owners: Mapping[str, int], held: Mapping[str, nn.Parameter],
                     rank: int) -> list[nn.Parameter]:
    """The held parameters `rank` owns (`owners`: `rannc.ownership.parameter_owners` of the
    deployment), each tensor once: tied names are one parameter on every rank."""
    first: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), n)
    out: dict[int, nn.Parameter] = {}
    for p in held.values():
        if owners.get(first[id(p)]) == rank:
            out[id(p)] = p
    return list(out.values())


def global_norm(grads: Sequence[torch.Tensor], norm_type: float, *, device: torch.device,
                dtype: torch.dtype, group: Any = None) -> torch.Tensor:
    """The `norm_type`-norm of the norms of `grads` over every rank of `group` (one all-reduce),
    as `torch.nn.utils.get_total_norm` would give on the concatenated list."""
    p = float(norm_type)
    norms = [torch.linalg.vector_norm(g.detach(), p).to(device, torch.float64) for g in grads]
    count = float(len(norms))
    if math.isinf(p):
        # MAX (MIN for -inf) of the norms; a NaN flag travels beside, as max may drop NaNs.
        sign = 1.0 if p > 0 else -1.0
        ext = torch.stack(norms).mul(sign).max() if norms else torch.tensor(-math.inf, dtype=torch.float64)
        nan = float(any(bool(x.isnan()) for x in norms))
        vec = torch.tensor([float(ext), nan, count], dtype=torch.float64, device=device)
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
        total = vec[0] * sign if vec[1] == 0 else torch.tensor(math.nan, dtype=torch.float64)
    elif p == 0:
        # torch's 0-norm of the per-tensor norms: how many gradients are not all zero.
        vec = torch.tensor([sum(float(x != 0) for x in norms), count], dtype=torch.float64,
                           device=device)
        dist.all_reduce(vec, group=group)
        total = vec[0]
    else:
        acc = torch.stack(norms).pow(p).sum() if norms else torch.zeros((), dtype=torch.float64)
        vec = torch.stack([acc.to(device), torch.tensor(count, dtype=torch.float64, device=device)])
        dist.all_reduce(vec, group=group)
        total = vec[0].pow(1.0 / p)
    if vec[-1] == 0:  # no gradient anywhere: torch returns 0
        total = torch.zeros((), dtype=torch.float64)
    return total.to(device=device, dtype=dtype)


def check_finite(total: torch.Tensor, norm_type: float) -> None:
    """torch's `error_if_nonfinite` check, with torch's message."""
    if bool(total.isnan() | total.isinf()):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
            "by the non-finite norm anyway, set `error_if_nonfinite=False`")


class _Clippable(Protocol):
    """What the torch wrapper asks of a RaNNCModule."""

    def _parameter_set_match(self, ids: set[int]) -> bool: ...

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor: ...


_modules: weakref.WeakSet[Any] = weakref.WeakSet()


def register(module: _Clippable) -> None:
    """Let `torch.nn.utils.clip_grad_norm_` recognise `module`'s parameters (weakly held)."""
    _modules.add(module)
    install_torch_wrapper()


def install_torch_wrapper() -> None:
    """Replace `torch.nn.utils.clip_grad_norm_` (and `torch.nn.utils.clip_grad.clip_grad_norm_`,
    which the deprecated `clip_grad_norm` calls) by `clip_grad_norm_` below; idempotent.

    A reference taken earlier (`from torch.nn.utils import clip_grad_norm_` before the first
    RaNNCModule is built) still names torch's function: call `model.clip_grad_norm_` instead.
    """
    import torch.nn.utils.clip_grad as torch_clip_module

    mods: list[Any] = [torch.nn.utils, torch_clip_module]
    for mod in mods:
        if not getattr(mod.clip_grad_norm_, "_rannc", False):
            mod.clip_grad_norm_ = clip_grad_norm_


def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_`, but by the global norm when `parameters` are a deployed
    RaNNCModule's (`model.parameters()`: the held ones, or `model.module.parameters()`)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    ids = {id(p) for p in params}
    for m in list(_modules):
        if m._parameter_set_match(ids):
            return m.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, foreach)
    return torch_clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)


clip_grad_norm_._rannc = True  # type: ignore[attr-defined]
