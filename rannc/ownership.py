"""Which rank owns each parameter tensor of a deployed model: the holder whose copy counts once.

Every rank holding a parameter (each replica of each stage that reads it, `Plan.holders`) has
an equal copy after every step. One of them owns it: that rank saves it in state dicts and
checkpoints, adds its gradient to the global norm (`rannc.clip`), and under ZeRO-1
(`Plan.zero_stage == 1`, `Config.zero_stage`) is the only rank whose optimizer steps it and
keeps its optimizer state; after the step it sends the new values to the other holders
(`PipelineRuntime.share_stepped_params`).

Without ZeRO the owner is the lowest holder. With it, the parameters of each set of holders are
spread over those ranks by size (largest first, each to the least loaded rank), so each keeps
about 1/R of that set's optimizer state. Only the holders need a parameter's owner, and they
hold its real size, so every holder computes the same answer without a collective.

A tied weight (one tensor under several names, possibly read by several stages) is one
parameter: its holders are the union over its names, and it is keyed by its first name in
`model.named_parameters()`.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from rannc.plans import Plan


def tensor_holders(model: nn.Module, plan: Plan) -> dict[str, tuple[int, ...]]:
    """First name of each parameter tensor some stage reads -> its holding ranks, ascending."""
    first: dict[int, str] = {}
    params = dict(model.named_parameters(remove_duplicate=False))
    for n, p in params.items():
        first.setdefault(id(p), n)
    out: dict[str, set[int]] = {}
    for n, ranks in plan.holders().items():
        out.setdefault(first[id(params[n])], set()).update(ranks)
    return {n: tuple(sorted(r)) for n, r in out.items()}


def parameter_owners(model: nn.Module, plan: Plan, rank: int) -> dict[str, int]:
    """First name -> owning rank, for every parameter tensor `rank` holds (see the module
    docstring). Sizes are read from `model`, where `rank`'s own parameters are whole."""
    holders = tensor_holders(model, plan)
    mine = {n: r for n, r in holders.items() if rank in r}
    if plan.zero_stage == 0:
        return {n: r[0] for n, r in mine.items()}
    params = dict(model.named_parameters(remove_duplicate=False))
    by_set: dict[tuple[int, ...], list[str]] = {}
    for n, r in mine.items():
        by_set.setdefault(r, []).append(n)
    out: dict[str, int] = {}
    for ranks, names in by_set.items():
        out.update(spread(ranks, {n: params[n].numel() for n in names}))
    return out


def spread(ranks: tuple[int, ...], numel: Mapping[str, int]) -> dict[str, int]:
    """Parameters to ranks, largest first, each to the rank holding the fewest elements so far
    (ties: the lower rank); names break ties between equal sizes, so the answer is the same on
    every rank."""
    load = dict.fromkeys(ranks, 0)
    out: dict[str, int] = {}
    for n in sorted(numel, key=lambda n: (-numel[n], n)):
        r = min(ranks, key=lambda r: (load[r], r))
        out[n] = r
        load[r] += numel[n]
    return out


__all__ = ["parameter_owners", "spread", "tensor_holders"]
