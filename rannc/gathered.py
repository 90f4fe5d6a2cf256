"""Every parameter's whole current value on every rank, for a block of the user's code
(`RaNNCModule.gathered_parameters`): DeepSpeed's `GatheredParameters` for a model whose
parameters rannc spread over the ranks.

Why: after deployment a rank holds only its stages' parameters; the others are empty tensors
(`deploy.Holdings.release`). Code that reads or writes every parameter on every rank then went
wrong:

* an EMA of the weights (torch's `AveragedModel.update_parameters(model)`, timm's ModelEmaV3,
  diffusers' `EMAModel.step(model.parameters())`) paired its full list with this rank's
  held parameters (the wrapper's `parameters()`) and failed on a size mismatch, or averaged
  same-shaped layers into each other;
* re-initialising layers after wrapping (`model.apply(init)`, `layer.reset_parameters()`):
  a rank drew no random numbers for the parameters it released, so the ones it holds got
  other draws than the unwrapped model's, silently.

Inside the block every released parameter has its shape and current value (each from the
first rank of the stage holding it), and so has every buffer (from the stage updating it); the wrapper's
`parameters()` lists them all. When it ends they are released again. With `modifier_rank=r`,
rank r's values of every parameter and buffer then reach every rank (the others' writes are
replaced), so a re-initialisation run on every rank from the same seed equals the unwrapped
model's. Without it, a write into a parameter raises on every rank: it would stay on the rank
that made it (replicas of a stage would differ) and be lost on the others.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rannc import checkpoint as ckpt
from rannc.errors import RaNNCError


@contextlib.contextmanager
def gathered(model: nn.Module, rt: Any, released: dict[str, torch.Size],
             modifier_rank: int | None) -> Iterator[None]:
    """The block with every parameter and buffer of `model` whole and current on this rank
    (a collective: every rank enters it). `rt` is a deployed runtime (its plan names each
    tensor's holders); `released` the parameters this rank freed, by name, with their shapes
    (`deploy.Holdings.released`)."""
    world, rank = rt.world_size, rt.rank  # (`modifier_rank` checked by the caller: check_modifier)
    h = ckpt.Holdings.of(model, rt)
    names = list(h.tensors)  # canonical names: each tensor once, parameters first
    empty = {h.canonical[n]: shape for n, shape in released.items()}
    for c, shape in empty.items():
        p = h.tensors[c]
        p.data = torch.empty(shape, dtype=p.dtype, device=p.device)
    try:
        # (the same list on every rank: each parameter some rank released, and the buffers,
        # whose copies outside the stage updating them are stale)
        holders = ckpt.holders(rt, h.canonical)
        spread = [n for n in names if not isinstance(h.tensors[n], nn.Parameter)
                  or len(holders.get(n, range(world))) < world]

        def source(n: str) -> int:
            # (the plan's, alike on every rank: `h.source` names ZeRO-1's owner only for this
            # rank's own parameters, and a stage's replicas hold equal values)
            return min(holders.get(n, (0,)))
        _broadcast(h, spread, rank, world, rt.device, src_of=source)
        versions = {n: h.tensors[n]._version for n in names}
        yield
        written = [n for n in names if h.tensors[n]._version != versions[n]]
        if modifier_rank is None:
            _refuse_writes(written, rank, world, rt.device, h, source)
        else:
            _broadcast(h, names, rank, world, rt.device, src_of=lambda n: modifier_rank)
    finally:
        for c in empty:
            p = h.tensors[c]
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def check_modifier(modifier_rank: int | None, world: int) -> None:
    """`modifier_rank` names a rank (or is None)."""
    if modifier_rank is not None and not (isinstance(modifier_rank, int)
                                          and 0 <= modifier_rank < world):
        raise RaNNCError(f"gathered_parameters(modifier_rank={modifier_rank!r}): the ranks are "
                         f"0 to {world - 1}. Fix: name one of them (0: rank 0's writes reach "
                         "every rank), or None to only read")


def _broadcast(h: ckpt.Holdings, names: Sequence[str], rank: int, world: int,
               device: torch.device, src_of: Callable[[str], int]) -> None:
    """Each tensor in `names` from the rank `src_of(name)` to every other rank: one broadcast
    per source rank and dtype, of the tensors flattened together, written in place on the
    receivers (so what the block's code holds, and the optimizer's parameters, stay the same
    objects)."""
    for src in range(world):
        by_dtype: dict[torch.dtype, list[str]] = {}
        for n in names:
            if src_of(n) == src:
                by_dtype.setdefault(h.tensors[n].dtype, []).append(n)
        for dtype, group in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
            tensors = [h.tensors[n] for n in group]
            if rank == src:
                flat = torch.cat([t.detach().reshape(-1).to(device) for t in tensors])
            else:
                flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=device)
            dist.broadcast(flat, src)
            if rank == src:
                continue
            with torch.no_grad():
                at = 0
                for t in tensors:
                    t.copy_(flat[at:at + t.numel()].view(t.shape))
                    at += t.numel()


def _refuse_writes(written: list[str], rank: int, world: int, device: torch.device,
                   h: ckpt.Holdings, source: Callable[[str], int]) -> None:
    """A block without a modifier rank that wrote into a parameter raises on every rank (one
    all-reduce of the count of such writes), after each parameter's owner has sent its value to
    the other holders, so that a stage's replicas stay equal. Buffers are left to the stages
    that update them: the next forward overwrites what the block wrote into another rank's
    copy."""
    mine = [n for n in written if isinstance(h.tensors[n], nn.Parameter)]
    count = torch.tensor([len(mine)], dtype=torch.int64, device=device)
    dist.all_reduce(count)
    if int(count.item()) == 0:
        return
    _broadcast(h, [n for n, t in h.tensors.items() if isinstance(t, nn.Parameter)], rank, world,
               device, src_of=source)
    shown = ", ".join(repr(n) for n in mine[:3]) or "none here"
    raise RaNNCError(
        f"gathered_parameters() without modifier_rank: {int(count.item())} write(s) into the "
        f"model's parameters across the ranks (on rank {rank}: {shown}). Such a write stays on "
        "the rank that made it (a stage's replicas would differ) and is lost on the others. "
        "Fix: gathered_parameters(modifier_rank=0) when every rank runs the same writes from the "
        "same seed (re-initialising layers: model.apply(init)); rank 0's values then reach "
        "every rank")


__all__ = ["check_modifier", "gathered"]
