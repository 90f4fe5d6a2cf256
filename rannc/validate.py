"""Checks of a call's inputs and of the configuration, made before any rank waits on another.

A check that depends on one rank's inputs must give the same verdict on every rank: a rank
that raised alone would leave the others waiting in the next collective (or, worse, matching
their transfers against the wrong graph). So `agree_on_call` all-gathers a digest of the call
(its structure, keyword names, and per tensor the dtype, device type and sizes beyond the batch
dimension) together with the local batch size, the all-gather every call needs anyway for the
row layout: checking costs no extra collective, and the digest is of the capture key the call
computes anyway. Only when the digests differ do the ranks gather a full `CallSignature` each
(with argument names), to say which rank passed what. Checks that read only what the digest
covers, like the input devices, then give the same verdict everywhere by construction.

The all-gather need not be waited for at once: `post_call` starts it, and a rank that guesses
the row layout from its last call computes until the first transfer to or from another rank,
which waits for it (`PipelineRuntime.forward`); so stage 0 starts its next forwards while the
last stage still runs its optimizer step. A rank whose call sends nothing to another rank
before its scalar outputs are summed (one stage on every rank) may instead post it at the end
of the call, carrying those sums (`CallAgreement.start`): one meeting of the ranks for both.
Everything but `agree_on_call`, `post_call` and
`agree_on_collective`/`agree_on_graph` is a pure function.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from rannc.config import Config
from rannc.errors import (  # CallOrderError and output_type_error: re-exported, once defined here
    CallOrderError,
    CaptureError,
    ConfigError,
    InputDeviceError,
    InputMismatchError,
    PlanInfeasibleError,
    PlanMismatchError,
    RaNNCError,
    output_type_error,
)
from rannc.graph.capture import input_name
from rannc.graph.row_mixing import interleaved, size_from_values
from rannc.plans import check_replicas_divide

if TYPE_CHECKING:  # (annotations only)
    from rannc.dist import DistContext
    from rannc.graph.capture import CapturedModel, InputLayout
    from rannc.graph.task_graph import TaskGraph

_SAME_INPUTS = ("Every rank must pass the same arguments, each tensor with the same dtype, "
                "device type and sizes in every dimension but the batch dimension (dim 0); only "
                "the local batch size may differ.")


@dataclass(frozen=True, slots=True)
class LeafSignature:
    """One input leaf as the other ranks must also pass it."""

    name: str  # where the user passed it: "args[0]", "attention_mask", "batch['ids']"
    tensor: bool
    batched: bool  # dim 0 is the batch dimension
    shape: tuple[int, ...]  # sizes after the batch dim (batched), else every size
    dtype: str  # "float32"; a non-tensor's repr
    device: str  # device type ("cpu", "cuda", "meta"); "" for a non-tensor

    def describe(self) -> str:
        if not self.tensor:
            return f"the value {self.dtype}"
        dims = ["B", *map(str, self.shape)] if self.batched else list(map(str, self.shape))
        return f"a tensor [{', '.join(dims)}] {self.dtype} on {self.device}"


@dataclass(frozen=True, slots=True)
class CallSignature:
    """What every rank's call must have in common."""

    mode: str  # "train mode, grad enabled" and any autocast: how the pipeline runs
    positional: int
    keywords: tuple[str, ...]
    structure: str  # the pytree spec of (args, kwargs)
    leaves: tuple[LeafSignature, ...]


def call_mode(training: bool, autocast: Sequence[tuple[str, bool, Any]],
              other_modes: Sequence[str] = ()) -> str:
    """How this call runs the pipeline: every rank must agree (a rank under no_grad runs only
    forwards while the others wait for gradients). `autocast`: (device type, on, dtype);
    `other_modes`: the modules in the other mode than the model (`ModelState.modes`)."""
    casts = [f"autocast({dev}, {str(dtype).removeprefix('torch.')})"
             for dev, on, dtype in autocast if on]
    grad = "grad enabled" if torch.is_grad_enabled() else "no_grad"
    mode = f"{'train' if training else 'eval'} mode"
    if other_modes:
        shown = ", ".join(other_modes[:3]) + (f" and {len(other_modes) - 3} more"
                                              if len(other_modes) > 3 else "")
        mode += f" ({shown} in {'eval' if training else 'train'} mode)"
    return ", ".join([mode, grad, *casts])


def call_signature(args: Sequence[Any], kwargs: Mapping[str, Any],
                   batch_leaves: Sequence[bool], mode: str = "") -> CallSignature:
    """Describe a call made in `mode` (`call_mode`); `batch_leaves` flags the leaves whose dim
    0 is the batch (as `flatten_inputs` found them), in the same (kwargs sorted by key) order."""
    tree = (tuple(args), {k: kwargs[k] for k in sorted(kwargs)})
    pairs, spec = pytree.tree_flatten_with_path(tree)
    leaves = tuple(_leaf_signature(input_name(path), x, b)
                   for (path, x), b in zip(pairs, batch_leaves, strict=True))
    return CallSignature(mode, len(args), tuple(sorted(kwargs)), str(spec), leaves)


def _leaf_signature(name: str, x: Any, batched: bool) -> LeafSignature:
    if not isinstance(x, torch.Tensor):
        return LeafSignature(name, False, False, (), repr(x), "")
    shape = tuple(x.shape[1:]) if batched else tuple(x.shape)
    return LeafSignature(name, True, batched, shape, str(x.dtype).removeprefix("torch."),
                         x.device.type)


def call_digest(layout: InputLayout, leaves: Sequence[Any], mode: str = "") -> int:
    """A 56-bit hash of what every rank's call must share: the mode, the capture key
    (structure, keyword names, dtypes, non-batch sizes) and the device types. Stable across
    processes (Python's hash() of a str is not)."""
    devices = tuple(x.device.type for x in leaves if isinstance(x, torch.Tensor))
    text = repr((mode, layout.signature, devices))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")


class CallAgreement:
    """A call's all-gather of [local rows, digest, carried sums], posted without waiting
    (`post_call`).

    A rank that can guess the row layout (its runtime's last call, `PipelineRuntime.forward`)
    computes while the all-gather completes, and `resolve`s it before any data leaves the
    rank; every other rank resolves it at once. `resolve` returns every rank's local batch
    size, or raises the same error on every rank (`agree_on_call`).

    Not started (`start=False`), it is posted when the guessing rank calls `start` with the
    sums it carries (a call's scalar outputs), or at `resolve` without. `carried` is then the
    sums over the ranks where every rank carried some, else None: the same on every rank, so
    all of them sum those values in a collective of their own, or none does."""

    def __init__(self, args: Sequence[Any], kwargs: Mapping[str, Any], leaves: Sequence[Any],
                 layout: InputLayout, ctx: DistContext, mode: str, start: bool = True) -> None:
        self._call: tuple[Any, ...] | None = (args, kwargs, leaves, layout, ctx, mode)
        self.rows = layout.batch or 0
        self.digest = call_digest(layout, leaves, mode)
        # (not in the digest: a guess of the row layout holds whatever these values are)
        self._values = whole_values_hash(leaves, layout.batch_leaves, ctx.device)
        self._device, self._world = ctx.device, ctx.world_size
        self._every: list[torch.Tensor] | None = None
        self._work: Any = None
        self._sizes: list[int] | None = None
        self.carried: torch.Tensor | None = None  # float64, CARRIED long (see the class)
        if start:
            self.start()

    @property
    def started(self) -> bool:
        return self._every is not None

    def start(self, carry: Sequence[torch.Tensor] = ()) -> None:
        """Post the all-gather, with up to CARRIED float64 sums of this rank's to add up."""
        assert self._every is None
        self._every, self._work = _gather_digest(self.rows, self.digest, self._device,
                                                 self._world, async_op=True, carry=carry,
                                                 values=self._values)

    @property
    def resolved(self) -> bool:
        return self._sizes is not None

    def ready(self) -> bool:
        """Whether `resolve` would return without waiting on another rank."""
        return self._sizes is not None or (
            self._every is not None and (self._work is None or self._work.is_completed()))

    def resolve(self) -> list[int]:
        if self._sizes is not None:
            return self._sizes
        if self._every is None:
            self.start()
        if self._work is not None:
            self._work.wait()
        assert self._call is not None and self._every is not None
        args, kwargs, leaves, layout, ctx, mode = self._call
        every = torch.stack(self._every).cpu()  # (one copy to the host, not one per number)
        sizes = every[:, 0].tolist()
        if len(set(every[:, 1].tolist())) > 1:  # all ranks see this, so all gather the details
            sigs: list[Any] = [None] * ctx.world_size
            dist.all_gather_object(sigs, call_signature(args, kwargs, layout.batch_leaves, mode))
            if any(isinstance(x, str) for x in sigs):
                raise CallOrderError(describe_call_order(sigs))
            raise InputMismatchError(describe_mismatch(sigs, sizes))
        if any(isinstance(x, torch.Tensor) and x.device.type != ctx.device.type for x in leaves):
            check_devices(call_signature(args, kwargs, layout.batch_leaves), ctx.device)
        if len(set(every[:, VALUES].tolist())) > 1:
            hashes: list[Any] = [None] * ctx.world_size
            dist.all_gather_object(hashes, _leaf_hashes(args, kwargs, leaves, layout))
            raise InputMismatchError(describe_whole_mismatch(hashes, sizes, layout, args, kwargs))
        self._sizes = sizes
        self._call = None  # (the call's inputs need not outlive it)
        if bool((every[:, 2] == 1).all()):
            self.carried = every[:, 3:VALUES].contiguous().view(torch.float64).sum(0)
        return sizes


def post_call(args: Sequence[Any], kwargs: Mapping[str, Any], leaves: Sequence[Any],
              layout: InputLayout, ctx: DistContext, mode: str, start: bool = True) -> CallAgreement:
    """Start the call's agreement (one all-gather, not waited for; with `start=False`, when
    the caller says); see `CallAgreement`."""
    return CallAgreement(args, kwargs, leaves, layout, ctx, mode, start)


def agree_on_call(args: Sequence[Any], kwargs: Mapping[str, Any], leaves: Sequence[Any],
                  layout: InputLayout, ctx: DistContext, mode: str) -> list[int]:
    """Every rank's local batch size, after checking that every rank made the same kind of
    call, in the same `mode` (`call_mode`), with inputs on its device. Collective (one
    all-gather per call; a second only when the calls differ), and every rank raises the same
    `InputMismatchError` or `InputDeviceError`, or none does."""
    return post_call(args, kwargs, leaves, layout, ctx, mode).resolve()


# Hugging Face's keyword for the global number of loss items (tokens not labelled -100): a loss
# given it is sum / count, so its (microbatch, replica) pieces add up to the global loss.
COUNT_KWARG = "num_items_in_batch"

# How many float64 sums a call's agreement can carry (`CallAgreement.start`): a model's scalar
# outputs (its loss, and a few more), beside the flag saying it carries them.
CARRIED = 3
# Where the agreement holds the hash of the call's whole (not split) tensor inputs' values.
VALUES = 3 + CARRIED


def whole_values_hash(leaves: Sequence[Any], batch_leaves: Sequence[bool],
                      device: torch.device) -> torch.Tensor | None:
    """A hash of the values of the call's tensor inputs that are not split by rows (dim 0
    not the batch size: a mask shared by every row, a table, Hugging Face's
    `num_items_in_batch`), computed on `device` without waiting for it; None when there is
    none. rannc hands such an input whole to every stage that reads it, for every rank's rows,
    so it must be the same on every rank: one that differs (labels or EmbeddingBag offsets of
    the rank's own samples, where another input set the batch size) gave silently other
    numbers than the model on the global batch."""
    out: torch.Tensor | None = None
    for i, (x, batched) in enumerate(zip(leaves, batch_leaves, strict=True)):
        if not _whole(x, batched):
            continue
        h = (_value_hash(x).to(device) % _PRIME) * (i + 1)
        out = h if out is None else out + h
    return out


def _whole(x: Any, batched: bool) -> bool:
    """Whether input leaf `x` is a whole tensor whose values `whole_values_hash` reads."""
    return (not batched and isinstance(x, torch.Tensor) and x.layout == torch.strided
            and x.device.type != "meta")


_PRIME = 2_147_483_647
_HASHED = 1 << 16  # 8- or 16-bit words of a tensor hashed; a larger tensor's evenly spaced sample
_WEIGHTS: dict[torch.device, torch.Tensor] = {}  # position weights 1 .. 65521, by device


def _value_hash(x: torch.Tensor) -> torch.Tensor:
    """A position-weighted sum of `x`'s bits as 16-bit (or 8-bit) integers: int64, 0-dim, on
    x's device. Every term is below 2**32, so the sum cannot overflow. Beyond `_HASHED` words,
    an evenly spaced sample of them (a whole 512 x 512 float mask cost 3.7 ms a call here, a
    sample 0.1 ms): the inputs that differ by rank in practice (labels, offsets, counts) are
    small, and a large shared mask that differs does so in many places."""
    x = x.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    flat = x.reshape(-1)
    bits = flat.view(torch.uint8) if flat.element_size() == 1 else flat.view(torch.int16)
    n = bits.numel()
    if n > _HASHED:
        bits = bits[:: -(-n // _HASHED)]
    w = _WEIGHTS.get(x.device)
    if w is None:
        w = _WEIGHTS[x.device] = torch.arange(_HASHED, dtype=torch.int64, device=x.device) % 65521 + 1
    return (bits.to(torch.int64) * w[:bits.numel()]).sum() + n


def _leaf_hashes(args: Sequence[Any], kwargs: Mapping[str, Any], leaves: Sequence[Any],
                 layout: InputLayout) -> list[tuple[str, str, int]]:
    """(name, shape, hash) of each whole tensor input, to say which differ across ranks."""
    sig = call_signature(args, kwargs, layout.batch_leaves)
    return [(s.name, s.describe(), int(_value_hash(x))) for s, x, b in
            zip(sig.leaves, leaves, layout.batch_leaves, strict=True) if _whole(x, b)]


def describe_whole_mismatch(hashes: Sequence[list[tuple[str, str, int]]], sizes: Sequence[int],
                            layout: InputLayout, args: Sequence[Any],
                            kwargs: Mapping[str, Any]) -> str:
    """Name the whole inputs whose values differ across ranks, with the fix."""
    differ = [column[0] for column in zip(*hashes, strict=True)
              if len({h for _n, _d, h in column}) > 1]
    names = [name for name, _d, _h in differ]
    if names == [COUNT_KWARG]:
        return (f"{COUNT_KWARG} differs across ranks: it must be the count of loss items in the "
                "GLOBAL batch, the same on every rank. Fix: sum the local counts over the ranks "
                "(e.g. torch.distributed.all_reduce of (labels != -100).sum()) and pass that on "
                "every rank")
    sig = call_signature(args, kwargs, layout.batch_leaves)
    first = next((s for s in sig.leaves if s.batched), None)
    shown = ", ".join(f"{name!r} ({desc})" for name, desc, _h in differ[:4])
    more = f" and {len(differ) - 4} more" if len(differ) > 4 else ""
    batch = (f"rannc takes dim 0 of the first tensor input, {first.name!r}, as the batch "
             f"(local sizes {list(sizes)})" if first is not None else
             "rannc takes dim 0 of the first tensor input as the batch")
    return (f"input(s) {shown}{more} differ across ranks in their values, but are not split by "
            f"rows: {batch}, and a tensor whose dim 0 is another size goes whole to every stage "
            "that reads it, for every rank's rows, so it must be the same on every rank. "
            "Computed on each rank's own values, the result would silently differ from the "
            "model on the global batch. Fix: if it holds one entry per sample (labels, "
            "per-sample weights), give every such input the batch in dim 0, the same local "
            "batch size as the first; for nn.EmbeddingBag, pass 2-D ids (B, bag length) padded "
            "with its padding_idx instead of 1-D ids with offsets. If it is shared (a mask, a "
            "table), pass the same values on every rank (e.g. torch.distributed.broadcast from "
            "rank 0)")


def _gather_digest(rows: int, digest: int, device: torch.device, world: int,
                   async_op: bool = False, carry: Sequence[torch.Tensor] = (),
                   values: torch.Tensor | None = None) -> tuple[list[torch.Tensor], Any]:
    """The all-gather every rannc collective call starts with: [rows, digest of the call,
    1 if it carries sums, CARRIED float64 sums as their bits, the hash of its whole tensor
    inputs' values (`whole_values_hash`; 0 without)]. One shape for every kind of call,
    so ranks in different calls still meet here and compare, instead of pairing unrelated
    transfers (gloo aborted: "Received data size doesn't match"). Returns the gathered rows
    and, with `async_op`, the work to wait for."""
    assert len(carry) <= CARRIED
    sums = torch.zeros(CARRIED, dtype=torch.float64)
    if carry:
        sums[:len(carry)] = torch.stack([x.detach().reshape(()).to("cpu", torch.float64)
                                         for x in carry])
    head = torch.tensor([rows, digest, int(bool(carry))], dtype=torch.int64)
    mine = torch.cat([head, sums.view(torch.int64)]).to(device)
    mine = torch.cat([mine, values.reshape(1) if values is not None
                      else torch.zeros(1, dtype=torch.int64, device=device)])
    every = [torch.zeros(VALUES + 1, dtype=torch.int64, device=device) for _ in range(world)]
    work = dist.all_gather(every, mine, async_op=async_op)
    return every, work


def agree_on_collective(kind: str, device: torch.device) -> None:
    """Before a collective that is not a forward (`kind`: "state_dict()", "save_checkpoint()"
    ...): check that every rank is making this same call. Every rank raises the same
    CallOrderError, or none does. One small all-gather."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    digest = int.from_bytes(hashlib.sha256(kind.encode()).digest()[:7], "big")
    every, _ = _gather_digest(0, digest, device, dist.get_world_size())
    if len({int(x[1]) for x in every}) > 1:
        calls: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(calls, kind)
        raise CallOrderError(describe_call_order(calls))


def _digest_of(fingerprint: str) -> int:
    return int(fingerprint[:13], 16) if re.fullmatch(r"[0-9a-f]{13,}", fingerprint) else \
        int.from_bytes(hashlib.sha256(fingerprint.encode()).digest()[:6], "big")


def check_outputs_combine(cap: CapturedModel, model_name: str) -> None:
    """On several ranks, before planning (every rank has the same graph: the same error on
    every rank): each tensor output without rows must be a scalar. The pipeline computes the
    model on pieces of the global batch and combines such an output from the pieces (their
    row-weighted mean, or their sum) as a number; one with other dimensions (a statistic per
    feature, `h.mean(0)`; a parameter returned; an output of a model that takes its batch in
    another dimension than 0) failed at the first call with torch's "output with shape []
    doesn't match the broadcast shape". Nor may a batch output interleave its samples' rows
    (`row_mixing.interleaved`: a (seq, batch, ...) tensor flattened to (seq * batch, ...)): the
    pieces' rows are joined one sample after another, which scrambled it silently."""
    mixed = interleaved(cap.graph)
    for v in cap.graph.outputs:
        if v is None:
            continue
        val = cap.graph.values[v]
        if val.dtype == "sym_int" and size_from_values(val.sym_expr):
            raise CaptureError(
                f"{model_name}'s output {cap.output_label(v)} is a Python int computed from "
                f"tensor values ({val.sym_expr}: .item(), .tolist(), a nonzero count): on "
                "several ranks each piece of the global batch computes its own, and an int "
                "cannot be combined from them. Fix: return it as a tensor (drop the .item(); a "
                "count per row, or a scalar mean or sum, is combined exactly)")
        if v in mixed:
            raise CaptureError(
                f"{model_name}'s output {cap.output_label(v)} has shape "
                f"{tuple(cap.graph.values[v].shape)} whose first dimension interleaves the "
                "samples' rows: it was flattened from (seq, batch, ...) (sequence-first), so "
                "its row i belongs to sample i % batch. On several ranks rannc computes the "
                "model on pieces of the global batch and joins their rows sample after sample, "
                "which would scramble it. Fix: flatten it batch-first, "
                "x.transpose(0, 1).reshape(-1, ...) (rows sample after sample), or return it "
                "unflattened")
    for v in cap.graph.outputs:
        if v is None:  # (a constant output: returned as it is)
            continue
        val = cap.graph.values[v]
        if val.is_tensor and val.batch_dim is None and val.shape != ():
            raise CaptureError(
                f"{model_name}'s output {cap.output_label(v)} has shape "
                f"{tuple(val.shape)} and no batch dimension (its dim 0 is not the batch's rows): "
                "on several ranks rannc computes the model on pieces of the global batch "
                "(microbatches, replicas) and combines an output without rows only where it is "
                "a scalar (a loss: the pieces' row-weighted mean, or their sum). Fix: return "
                "it per row (e.g. the per-sample values instead of their mean over dim 0) and "
                "reduce it outside the model, or reduce it to a scalar; read a tensor that does "
                "not depend on the batch (a parameter) from the model instead. If the model "
                "takes its batch in another dimension than dim 0 (sequence-first, e.g. "
                "nn.TransformerEncoderLayer(batch_first=False)), give it batch-first inputs: "
                "rannc splits every input along dim 0")


def agree_on_graph(graph: TaskGraph, sizes: Sequence[int], device: torch.device) -> None:
    """After a capture: every rank must have captured the same graph, or their pipelines would
    exchange values of different graphs (a hang or silent garbage). Ranks capture from their own
    local batch, so code that depends on the rank, on input values, or on the local batch size
    (a 1-row batch is captured as 2 duplicated rows) can give different graphs; and code that
    iterates a set of strings traces its operations in an order that differs from process to
    process (Python's hash randomisation: ModernBERT's rotary embeddings, one per attention
    type). One small all-gather per capture (a second where the graphs differ, to tell the two
    apart); every rank raises the same CaptureError, or none does."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    world = dist.get_world_size()
    every, _ = _gather_digest(0, _digest_of(graph.fingerprint()), device, world)
    prints = [int(x[1]) for x in every]
    if len(set(prints)) > 1:
        per = _by_rank([f"graph {p:013x}" for p in prints])
        every, _ = _gather_digest(0, _digest_of(graph.content_fingerprint()), device, world)
        if len({int(x[1]) for x in every}) == 1:
            seed = os.environ.get("PYTHONHASHSEED") or "not set"
            raise CaptureError(
                f"the ranks captured the same operations in a different order ({per}; the "
                "same tasks, ops and shapes on every rank): the model's code iterates a set "
                "(or a dict built from one) of strings, whose order Python's hash randomisation "
                f"makes differ from process to process (PYTHONHASHSEED is {seed} here). Fix: "
                "launch every rank with the same PYTHONHASHSEED, e.g. "
                "`mpiexec -genv PYTHONHASHSEED 0 ...` (Open MPI: `-x PYTHONHASHSEED=0`) or "
                "`PYTHONHASHSEED=0 torchrun ...`")
        raise CaptureError(
            f"the ranks captured different graphs ({per}; local batch sizes {list(sizes)}): the "
            "model's forward depends on something other than the input shapes -- the rank, "
            "input values, or the local batch size (a 1-row batch is captured as 2 rows). "
            "Fix: make forward() the same computation on every rank (no branches on the rank "
            "or on tensor values), or give every rank at least 2 rows at the first call")


def describe_call_order(calls: Sequence[CallSignature | str]) -> str:
    """Which rank made which call, when they differ in kind (a forward or a named collective)."""
    names = [c if isinstance(c, str) else "forward (a call of the model)" for c in calls]
    what = "optimizer" if "optimizer.state_dict()" in names else "model"
    return (f"ranks made different rannc calls at the same time ({_by_rank(names)}); each is a "
            "collective, so every rank must make the same calls in the same order. Fix: a rank "
            "that leaves the training loop early (a smaller last batch, a break on one rank) "
            "must not skip steps the others run: stop every rank at the same step, then call "
            "state_dict() / save_checkpoint() on every rank" + (
                ". A save on rank 0 only, as DDP scripts write it (`if rank == 0: "
                f"torch.save({what}.state_dict(), path)`), calls state_dict() on one rank: call "
                f"it on every rank (it gathers the {what} onto rank 0) and save on rank 0 only: "
                f"`sd = {what}.state_dict(); if rank == 0: torch.save(sd, path)`"
                if any("state_dict" in n for n in names) else ""))


def describe_mismatch(sigs: Sequence[CallSignature], sizes: Sequence[int]) -> str:
    """Name the first way the ranks' calls differ, with each rank's value and the fix."""
    if len({s.mode for s in sigs}) > 1:
        per = _by_rank([s.mode for s in sigs])
        if len({s.mode.split(", attributes ")[0] for s in sigs}) == 1:
            return (f"ranks called the model with different values of its Python attributes "
                    f"({per}); each rank's captured graph holds them as constants, so the ranks "
                    "would run different graphs. Fix: set such attributes (a dropout's p, a "
                    "scale, config flags) alike on every rank, at the same step.")
        # (the mode without its tree, dtypes and hooks, and the attribute values read, which a
        # capture of its own reads anew)
        if len({re.sub(r", (module tree changed \d+ times|dtypes .*?\([0-9a-f]{8}\)|hooks: .*?)"
                       r"(?=, attributes |, hooks: |$)", "", s.mode.split(", attributes ")[0])
                for s in sigs}) == 1:
            return (f"ranks called the model with different module trees, dtypes or hooks ({per}); "
                    "a module swapped, a parameter removed, the model converted to another dtype "
                    "(model.to(torch.bfloat16)) or a forward hook added or removed captures the "
                    "model again, so the ranks would run different graphs. Fix: make such a "
                    "change on every rank alike, at the same step.")
        return (f"ranks called the model in different modes ({per}); the pipeline runs one way "
                "on every rank. Fix: call model.train() or model.eval() on every rank, and "
                "torch.no_grad() / torch.autocast around the call on every rank alike.")
    if len({s.keywords for s in sigs}) > 1:
        per = _by_rank([str(list(s.keywords)) for s in sigs])
        return (f"ranks called the model with different keyword arguments ({per}). {_SAME_INPUTS} "
                "Pass every keyword on every rank; where a rank has nothing to pass, pass a "
                "placeholder of the same shape and dtype (e.g. an all-ones attention mask).")
    if len({s.positional for s in sigs}) > 1:
        per = _by_rank([str(s.positional) for s in sigs])
        return (f"ranks called the model with different numbers of positional arguments "
                f"({per}). {_SAME_INPUTS}")
    if len({s.structure for s in sigs}) > 1 or len({len(s.leaves) for s in sigs}) > 1:
        per = _by_rank([s.structure for s in sigs])
        return (f"ranks called the model with differently nested arguments ({per}). "
                f"{_SAME_INPUTS}")
    for i, leaf in enumerate(sigs[0].leaves):
        column = [s.leaves[i] for s in sigs]
        if any(x != leaf for x in column):
            first = next((x.name for x in sigs[0].leaves if x.batched), None)
            return _leaf_mismatch(column, sizes, first)
    return f"ranks called the model with different inputs. {_SAME_INPUTS}"  # digests collided


def _leaf_mismatch(column: Sequence[LeafSignature], sizes: Sequence[int],
                   batch_from: str | None = None) -> str:
    name = column[0].name
    per = _by_rank([x.describe() for x in column])
    what = ("dtypes" if len({x.dtype for x in column}) > 1 else
            "device types" if len({x.device for x in column}) > 1 else
            "shapes" if len({(x.shape, x.batched) for x in column}) > 1 else "values")
    fix = {
        "dtypes": "cast it to one dtype on every rank (e.g. x.to(torch.float32)).",
        "device types": "move it to the rank's device on every rank (e.g. x.to('cuda')).",
        "shapes": ("pad it to one size on every rank (e.g. every sequence to a fixed maximum "
                   "length; rannc.hf.RaNNCTrainer pads a padding collator's token inputs to the "
                   f"longest across ranks). The local batch sizes (B) were {list(sizes)}."),
        "values": "pass the same non-tensor value on every rank.",
    }[what]
    if what == "shapes" and batch_from is not None and all(x.tensor and not x.batched
                                                          for x in column):
        # (its dim 0 differs from the batch size: a per-sample input rannc did not take for one)
        fix += (f" If it holds one entry per sample (labels, offsets), it is not split by rows: "
                f"rannc takes dim 0 of the first tensor input, {batch_from!r}, as the batch; give "
                "every per-sample input that same dim 0 (for nn.EmbeddingBag, pass 2-D ids "
                "(B, bag length) padded with its padding_idx instead of 1-D ids with offsets).")
    return (f"argument {name!r} differs across ranks in its {what}: {per}. Only the local batch "
            f"size (dim 0) may differ between ranks. Fix: {fix}")


def _by_rank(texts: Sequence[str]) -> str:
    """'rank 0: X; ranks 1, 2: Y' -- each distinct value once, with the ranks that gave it."""
    groups: dict[str, list[int]] = {}
    for r, t in enumerate(texts):
        groups.setdefault(t, []).append(r)
    parts = []
    for t, ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        parts.append(f"{who}: {t}")
    return "; ".join(parts)


def check_devices(sig: CallSignature, device: torch.device) -> None:
    """Refuse a tensor input on another device type than the rank computes on (inputs are
    sent between ranks as they are; a meta or CPU tensor under NCCL cannot be)."""
    wrong = [x for x in sig.leaves if x.tensor and x.device != device.type]
    if wrong:
        listed = ", ".join(f"{x.name!r} on {x.device}" for x in wrong)
        raise InputDeviceError(
            f"{'inputs' if len(wrong) > 1 else 'input'} {listed} "
            f"{'are' if len(wrong) > 1 else 'is'} not on this rank's device {device} (device type "
            f"{device.type!r}); rannc sends inputs between ranks as they are. Fix: move every "
            f"input to the rank's device before the call: x.to({str(device)!r}) here (under "
            "NCCL each rank computes on cuda:<local rank>, under gloo on cpu).")


def check_config(config: Config, world_size: int) -> None:
    """What `Config` cannot check alone: the forced sizes against the number of ranks. Every
    rank runs it before its first collective, with the same config, so all raise or none. A
    schedule of v chunks (interleaved 1F1B, ZB-V) puts v stages on each rank: its `replicas`
    are per rank of a pipeline (the stages sharing those ranks share them: s and s + P, or s
    and 2P - 1 - s) and `partition_num` counts every stage."""
    from rannc.schedule.spec import get_spec

    per = get_spec(config.schedule).chunks if config.schedule != "auto" else 1
    each = f" ({per} per rank under {config.schedule})" if per > 1 else " (one stage per rank)"
    if config.replicas is not None:
        check_replicas_divide(config.replicas, world_size)
        if config.partition_num is not None and config.partition_num != per * len(config.replicas):
            raise ConfigError(
                f"partition_num={config.partition_num} but replicas={config.replicas} lists "
                f"{len(config.replicas)} {'ranks per pipeline' if per > 1 else 'stages'}{each}. "
                "Fix: give one replica count per "
                f"{'pipeline position' if per > 1 else 'stage'}, or drop partition_num.")
    if config.partition_num is not None and config.partition_num > per * world_size:
        raise ConfigError(
            f"partition_num={config.partition_num} stages need at least "
            f"{'that many' if per == 1 else -(-config.partition_num // per)} ranks but "
            f"{world_size} run{each}. Fix: launch at least "
            f"{-(-config.partition_num // per)} ranks or lower partition_num.")


def check_capturable(model: torch.nn.Module, leaves: Sequence[Any], sizes: Sequence[int],
                     first: bool) -> None:
    """Before a call captures the model (its first call, or a new input signature): refuse
    what would fail obscurely later. Reads only what every rank shares (the all-gathered local
    batch sizes; the model every rank built alike), so every rank raises alike.

    A rank with 0 rows cannot capture (torch.export needs an example row; it reported a "fixed
    batch size" in module None). A model left on the meta device computes nothing: called with
    real inputs, it is a model that was never materialised."""
    empty = [r for r, n in enumerate(sizes) if n == 0]
    if empty:
        who = (f"rank {empty[0]}" if len(empty) == 1 and len(sizes) > 1 else
               "the call" if len(sizes) == 1 else f"ranks {empty}")
        raise InputMismatchError(
            f"{who} passed a batch of 0 rows (local batch sizes {list(sizes)}) to a call that "
            "captures the model (the first call, or a new input shape or mode); capture needs "
            "at least one example row on every rank. Fix: give every rank at least one row at "
            "that call (e.g. DataLoader(drop_last=True)), or skip an empty batch on every rank "
            "alike")
    if not first:
        return
    on_meta = [n for n, t in (*model.named_parameters(), *model.named_buffers())
               if t.device.type == "meta"]
    real = any(isinstance(x, torch.Tensor) and x.device.type != "meta" for x in leaves)
    if on_meta and real:
        raise RaNNCError(
            f"{len(on_meta)} of the model's parameters and buffers are on the meta device "
            f"(e.g. {', '.join(on_meta[:3])}): the model was never materialised, and it was "
            "called with real inputs. Fix: before the first call, materialise it "
            "(model.to_empty(device='cpu'), then initialise its weights, e.g. "
            "model.apply(model._init_weights) for Hugging Face, or load a state dict or "
            "checkpoint); to plan without running, use rannc.plan(model, ...) or `rannc plan`")


def rebuild_error(info: Mapping[str, Any]) -> RaNNCError:
    """The error rank 0 met while planning (sent as {"type", "error", ...}), raised again on
    every rank with its own type, so `except PlanInfeasibleError` works on every rank."""
    message = f"{info.get('where', 'planning')} failed on rank 0: {info['error']}"
    if info["type"] == PlanInfeasibleError.__name__:
        return PlanInfeasibleError(message, needed_bytes=info.get("needed_bytes", math.nan))
    known: dict[str, type[RaNNCError]] = {
        c.__name__: c for c in (ConfigError, CaptureError, InputMismatchError, PlanMismatchError)}
    return known.get(info["type"], RaNNCError)(message)


__all__ = ["CallAgreement", "CallOrderError", "CallSignature", "LeafSignature", "agree_on_call",
           "agree_on_collective", "agree_on_graph", "describe_call_order", "call_digest", "call_mode",
           "call_signature", "post_call",
           "check_capturable", "check_config",
           "check_devices", "describe_mismatch", "output_type_error", "rebuild_error"]
