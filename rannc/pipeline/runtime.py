"""The synchronous pipeline runtime (fill-drain / GPipe), with a replica count per stage.

Every rank runs one replica of one stage. A call's global batch is the
concatenation of the ranks' local batches; it is cut into microbatches, and
each microbatch's rows are cut among each stage's replicas by their shares
(`rows.RowLayout`, computed identically on every rank, so a sender and a
receiver always agree on a transfer without asking each other). Every value
moves as rows: model inputs from the ranks that own them straight to the
stages that read them; stage outputs from the producing replicas to the
consuming replicas; batch outputs back to the ranks that own those rows.
Gradients travel the same routes backwards.

The user sees ordinary tensors: the outputs come out of an autograd Function
whose backward runs this rank's part of the pipeline backward, so
`loss.backward()` on every rank drives the whole thing.

Gradient semantics (DDP): rank r's `backward()` of L_r sends d L_r / d(out) / W
for its rows (W = world size) and the average of the scalar outputs'
gradients; each (microbatch, replica) piece of a scalar output carries the
weight rows/N of the global row-weighted mean; parameter gradients are then
summed over every rank holding the parameter (stage replicas, tied copies).

Index conventions: s, t stages; m microbatches; j replicas; r ranks.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rannc.atomic.components import AtomicPartition
from rannc.errors import InputMismatchError, RaNNCError
from rannc.graph.capture import CapturedModel
from rannc.graph.extract import StageGraph, build_stage_module, split_graph
from rannc.graph.task_graph import Value, ValueKind, eval_dim
from rannc.pipeline.rows import Range, RowLayout, intersect
from rannc.plans import Plan

log = logging.getLogger(__name__)

# Message kinds, part of every tag so two transfers between the same ranks never mix.
_FWD, _OUT, _GRAD, _OUT_GRAD = range(4)


@dataclass
class _Micro:
    """What one microbatch's forward keeps for its backward."""

    rows: Range
    inputs: list[Any]
    rng: torch.Tensor
    outputs: tuple[Any, ...] | None  # None when the stage recomputes


@dataclass
class _Call:
    layout: RowLayout
    micro: list[_Micro] = field(default_factory=list)
    sends: list[Any] = field(default_factory=list)


class PipelineRuntime:
    def __init__(self, model: nn.Module, captured: CapturedModel, atomic: AtomicPartition,
                 plan: Plan, rank: int, world_size: int, device: torch.device) -> None:
        self.model, self.cap, self.plan = model, captured, plan
        self.rank, self.world_size, self.device = rank, world_size, device
        self.graph = captured.graph
        self.stages: list[StageGraph] = split_graph(
            self.graph, atomic, [list(s.components) for s in plan.stages])
        self.s = plan.stage_of_rank(rank).index
        self.j = plan.stages[self.s].ranks.index(rank)
        self.me = self.stages[self.s]
        self.module = build_stage_module(captured.gm, self.graph, self.me)
        self.recompute = plan.stages[self.s].recompute
        self.vid = {v: i for i, v in enumerate(sorted(self.graph.values))}
        self.out_stage = self._output_stages()
        self._suppliers, self._consumers = self._routes()
        self._check_boundaries()
        self.held = self._held_params()
        self._groups = self._param_groups()
        self._pending: dict[str, torch.Tensor] = {}
        self.sync = True
        self._call: _Call | None = None

    # -- static routing ----------------------------------------------------
    def _routes(self) -> tuple[dict[tuple[str, int], int], dict[tuple[str, int], list[int]]]:
        """Fixed at deployment: the stage sending each moved input of stage t (-1: a model
        input, from its owners), and the stages reading each value from a given sender."""
        suppliers: dict[tuple[str, int], int] = {}
        consumers: dict[tuple[str, int], list[int]] = {}
        for t, st in enumerate(self.stages):
            for v in st.inputs:
                if not self._moves(v):
                    continue
                g = self._find_supplier(v, t)
                suppliers[(v, t)] = g
                consumers.setdefault((v, g), []).append(t)
        return suppliers, consumers

    def _find_supplier(self, v: str, t: int) -> int:
        if self.graph.values[v].kind is ValueKind.INPUT:
            return -1
        for g in range(t - 1, -1, -1):
            if v in self.stages[g].outputs:
                return g
        raise RaNNCError(f"no stage before {t} supplies value {v}")

    def supplier(self, v: str, t: int) -> int:
        """The stage that sends moved value v to stage t (-1: a model input, from its owners)."""
        return self._suppliers[(v, t)]

    def consumers(self, v: str, s: int) -> list[int]:
        """Stages that read moved value v from stage s (or from the input owners when s == -1)."""
        return self._consumers.get((v, s), [])

    def _moves(self, v: str) -> bool:
        val = self.graph.values[v]
        return val.is_tensor and val.batch_dim is not None and val.kind in (
            ValueKind.INPUT, ValueKind.ACTIVATION)

    def _output_stages(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for v in self.graph.outputs:
            if v is None:
                continue
            prods = [s for s, st in enumerate(self.stages) if v in st.outputs]
            if not prods:
                raise RaNNCError(f"model output {v} is not computed by any stage (it is a "
                                 f"{self.graph.values[v].kind.value}); return a computed tensor")
            out[v] = prods[-1]
        return out

    def _check_boundaries(self) -> None:
        for t, st in enumerate(self.stages):
            for v in st.inputs:
                val = self.graph.values[v]
                if val.kind is ValueKind.ACTIVATION and val.is_tensor and val.batch_dim is None:
                    raise RaNNCError(
                        f"value {v} ({val.shape}) has no batch dimension but crosses into stage "
                        f"{t}; it cannot be split by rows. Choose another partition_num or cut")

    def _held_params(self) -> dict[str, nn.Parameter]:
        params = dict(self.model.named_parameters(remove_duplicate=False))
        return {n: params[n] for n in self.plan.stages[self.s].param_names}

    def _param_groups(self) -> list[tuple[tuple[int, ...], list[str], Any]]:
        """(ranks, parameter names, process group) per distinct set of holding ranks.

        Every rank creates every group in the same order, as torch.distributed requires.
        """
        holders: dict[str, set[int]] = {}
        for st in self.plan.stages:
            for n in st.param_names:
                holders.setdefault(n, set()).update(st.ranks)
        by_set: dict[tuple[int, ...], list[str]] = {}
        for n in sorted(holders):
            by_set.setdefault(tuple(sorted(holders[n])), []).append(n)
        out = []
        for ranks in sorted(by_set):
            group = dist.new_group(list(ranks)) if len(ranks) > 1 else None
            if self.rank in ranks:
                out.append((ranks, by_set[ranks], group))
        return out

    # -- transfers ---------------------------------------------------------
    def _tag(self, v: str, m: int, kind: int) -> int:
        return ((self.vid[v] * max(self.plan.microbatches, 1) + m) * 4 + kind) % (2**31 - 1)

    def _row_slice(self, x: torch.Tensor, v: str, base: Range, rows: Range) -> torch.Tensor:
        val = self.graph.values[v]
        k, d = val.batch_scale, val.batch_dim or 0
        return x.narrow(d, (rows[0] - base[0]) * k, (rows[1] - rows[0]) * k)

    def _empty(self, v: str, n_rows: int) -> torch.Tensor:
        val = self.graph.values[v]
        shape = [eval_dim(dim, n_rows) for dim in val.shape]
        return torch.empty(shape, dtype=getattr(torch, val.dtype), device=self.device)

    def _send(self, x: torch.Tensor, dst: int, tag: int, call: _Call, local: dict[Any, Any]) -> None:
        if dst == self.rank:
            local[tag] = x.detach()
        else:
            call.sends.append(dist.isend(x.detach().contiguous(), dst, tag=tag))

    def _recv_rows(self, v: str, rows: Range, sources: Sequence[tuple[int, Range]], kind: int,
                   m: int, local: dict[Any, Any]) -> torch.Tensor:
        """Assemble value v's rows `rows` from pieces held by (rank, range) sources."""
        pieces = []
        for r, have in sources:
            part = intersect(rows, have)
            if part is None:
                continue
            tag = self._tag(v, m, kind)
            if r == self.rank:
                pieces.append(local.pop(tag))  # sliced to `part` by the sender (this rank)
            else:
                buf = self._empty(v, part[1] - part[0])
                dist.recv(buf, r, tag=tag)
                pieces.append(buf)
        d = self.graph.values[v].batch_dim or 0
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, d)

    def _replicas(self, t: int, m: int, layout: RowLayout) -> list[tuple[int, Range]]:
        return list(zip(self.plan.stages[t].ranks, layout.rows[t][m], strict=True))

    # -- forward -----------------------------------------------------------
    def forward(self, leaves: Sequence[Any], signature: Any) -> list[Any]:
        """Run this rank's part of the forward; returns the flat outputs for this rank."""
        local_n = _local_batch(self.cap, leaves)
        sizes = self._allgather_sizes(local_n, signature)
        layout = RowLayout(sizes, self.plan.microbatches, [s.shares for s in self.plan.stages])
        call = _Call(layout)
        local: dict[Any, Any] = {}
        env = self.cap.bind(self.model, leaves)
        mine = layout.owned[self.rank]
        for v in self.graph.inputs:  # my input rows to the stages that read them
            if not self._moves(v):
                continue
            for t in self.consumers(v, -1):
                for m in range(self.plan.microbatches):
                    for r, rows in self._replicas(t, m, layout):
                        part = intersect(mine, rows)
                        if part is not None:
                            self._send(self._row_slice(env[v], v, mine, part), r,
                                       self._tag(v, m, _FWD), call, local)
        scalars = {v: torch.zeros((), dtype=torch.float64, device=self.device)
                   for v in self._scalar_outputs()}
        for m in range(self.plan.microbatches):
            rows = layout.rows[self.s][m][self.j]
            if rows[0] == rows[1]:
                call.micro.append(_Micro(rows, [], torch.get_rng_state(), None))
                continue
            ins = [self._stage_input(v, m, rows, env, layout, local) for v in self.me.inputs]
            rng = torch.get_rng_state()
            keep = torch.is_grad_enabled() and not self.recompute
            if keep:
                ins = [_leaf(x) if self._is_activation(v) else x
                       for v, x in zip(self.me.inputs, ins, strict=True)]
            with torch.set_grad_enabled(keep):
                outs = self.module(*ins)
            call.micro.append(_Micro(rows, ins, rng, outs if keep else None))
            for v, o in zip(self.me.outputs, outs, strict=True):
                self._send_output(v, o, m, rows, layout, call, local, scalars)
        return self._collect_outputs(call, layout, scalars, local)

    def _stage_input(self, v: str, m: int, rows: Range, env: dict[str, Any], layout: RowLayout,
                     local: dict[Any, Any]) -> Any:
        val = self.graph.values[v]
        if val.dtype == "sym_int":
            return eval_dim(val.sym_expr or "batch", rows[1] - rows[0])
        if not self._moves(v):
            return env[v]
        g = self.supplier(v, self.s)
        if g == -1:
            src = list(enumerate(layout.owned))
        else:
            src = self._replicas(g, m, layout)
        return self._recv_rows(v, rows, src, _FWD, m, local)

    def _send_output(self, v: str, o: Any, m: int, rows: Range, layout: RowLayout, call: _Call,
                     local: dict[Any, Any], scalars: dict[str, torch.Tensor]) -> None:
        if self._moves(v):
            for t in self.consumers(v, self.s):
                for r, theirs in self._replicas(t, m, layout):
                    part = intersect(rows, theirs)
                    if part is not None:
                        self._send(self._row_slice(o, v, rows, part), r, self._tag(v, m, _FWD),
                                   call, local)
        if self.out_stage.get(v) != self.s:
            return
        if v in scalars:
            w = (rows[1] - rows[0]) / layout.n_rows
            scalars[v] += o.detach().to(torch.float64) * w
        else:
            for r, owned in enumerate(layout.owned):
                part = intersect(rows, owned)
                if part is not None:
                    self._send(self._row_slice(o, v, rows, part), r, self._tag(v, m, _OUT),
                               call, local)

    def _scalar_outputs(self) -> list[str]:
        return [v for v in self.out_stage if self.graph.values[v].batch_dim is None]

    def _collect_outputs(self, call: _Call, layout: RowLayout, scalars: dict[str, torch.Tensor],
                         local: dict[Any, Any]) -> list[Any]:
        if scalars:
            names = sorted(scalars)
            flat = torch.stack([scalars[v] for v in names])
            dist.all_reduce(flat)
            for v, x in zip(names, flat, strict=True):
                scalars[v] = x.to(getattr(torch, self.graph.values[v].dtype))
        mine = layout.owned[self.rank]
        batch_out: dict[str, torch.Tensor] = {}
        for v, s in self.out_stage.items():
            if v in scalars:
                continue
            pieces = []
            for m in range(self.plan.microbatches):
                src = self._replicas(s, m, layout)
                part = intersect(mine, layout.micro[m])
                if part is not None:
                    pieces.append(self._recv_rows(v, part, src, _OUT, m, local))
            d = self.graph.values[v].batch_dim or 0
            batch_out[v] = torch.cat(pieces, d) if pieces else self._empty(v, 0)
        for w in call.sends:
            w.wait()
        call.sends.clear()
        self._call = call if torch.is_grad_enabled() else None
        out = []
        for name, c in zip(self.graph.outputs, self.cap.output_constants, strict=True):
            out.append(c if name is None else scalars[name] if name in scalars else batch_out[name])
        return out

    def _allgather_sizes(self, local_n: int, signature: Any) -> list[int]:
        """Every rank's local batch size; also checks that every rank passed the same kind of
        inputs (a mismatch would otherwise hang or corrupt the transfers)."""
        # A stable digest (Python's hash() of a str differs between processes).
        sig = int.from_bytes(hashlib.sha256(repr(signature).encode()).digest()[:7], "big")
        mine = torch.tensor([local_n, sig], dtype=torch.int64)
        allv = [torch.zeros(2, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(allv, mine)
        sigs = {int(x[1]) for x in allv}
        if len(sigs) > 1:
            raise InputMismatchError(
                "ranks called the model with inputs of different structure, dtypes or non-batch "
                "shapes; every rank must pass the same kinds of inputs (only the batch size, "
                f"dim 0, may differ). Local batch sizes: {[int(x[0]) for x in allv]}")
        return [int(x[0]) for x in allv]

    # -- backward ----------------------------------------------------------
    def backward(self, grad_of: dict[str, torch.Tensor | None]) -> None:
        call = self._call
        if call is None:
            raise RaNNCError("backward() without a forward() whose outputs need gradients")
        self._call = None
        layout, local = call.layout, {}  # type: ignore[var-annotated]
        w = float(self.world_size)
        scalar_names = sorted(self._scalar_outputs())
        scalar_g: dict[str, torch.Tensor] = {}
        if scalar_names:
            g = torch.stack([_grad_or_zero(grad_of.get(v)) for v in scalar_names]).to(torch.float64)
            dist.all_reduce(g)
            scalar_g = {v: x / w for v, x in zip(scalar_names, g, strict=True)}
        mine = layout.owned[self.rank]
        for v, s in self.out_stage.items():  # my output rows' gradients to their producers
            if v in scalar_g:
                continue
            gv = grad_of.get(v)
            if gv is None:
                gv = self._empty(v, mine[1] - mine[0]).zero_()
            for m in range(self.plan.microbatches):
                for r, rows in self._replicas(s, m, layout):
                    part = intersect(mine, rows)
                    if part is not None:
                        self._send(self._row_slice(gv / w, v, mine, part), r,
                                   self._tag(v, m, _OUT_GRAD), call, local)
        before = {n: p.grad for n, p in self.held.items()}
        for p in self.held.values():
            p.grad = None
        for m in reversed(range(self.plan.microbatches)):
            self._backward_micro(m, call, layout, local, scalar_g)
        self._reduce_grads(before)
        for work in call.sends:
            work.wait()

    def _backward_micro(self, m: int, call: _Call, layout: RowLayout, local: dict[Any, Any],
                        scalar_g: dict[str, torch.Tensor]) -> None:
        mic = call.micro[m]
        rows = mic.rows
        if rows[0] == rows[1]:
            return
        out_grads: list[torch.Tensor | None] = []
        for v in self.me.outputs:
            out_grads.append(self._output_grad(v, m, rows, layout, local, scalar_g))
        ins, outs = mic.inputs, mic.outputs
        if outs is None:  # recompute, replaying dropout; buffers get copies (no second update)
            ins = [x.clone() if self._is_buffer(v) else _leaf(x) if self._is_activation(v) else x
                   for v, x in zip(self.me.inputs, mic.inputs, strict=True)]
            with torch.random.fork_rng(devices=[]), torch.enable_grad():
                torch.set_rng_state(mic.rng)
                outs = self.module(*ins)
        ts, gs = [], []
        for o, g in zip(outs, out_grads, strict=True):
            if g is not None and isinstance(o, torch.Tensor) and o.requires_grad:
                ts.append(o)
                gs.append(g)
        if ts:
            torch.autograd.backward(ts, gs)
        for v, x in zip(self.me.inputs, ins, strict=True):
            if not self._is_activation(v):
                continue
            g_in = x.grad if isinstance(x, torch.Tensor) and x.grad is not None else torch.zeros_like(x)
            src = self.supplier(v, self.s)
            for r, theirs in self._replicas(src, m, layout):
                part = intersect(rows, theirs)
                if part is not None:
                    self._send(self._row_slice(g_in, v, rows, part), r, self._tag(v, m, _GRAD),
                               call, local)

    def _is_activation(self, v: str) -> bool:
        """A float value received from an earlier stage: gradients flow back along it."""
        val = self.graph.values[v]
        return self._moves(v) and val.kind is ValueKind.ACTIVATION and _is_float(val)

    def _is_buffer(self, v: str) -> bool:
        return self.graph.values[v].kind is ValueKind.BUFFER

    def _output_grad(self, v: str, m: int, rows: Range, layout: RowLayout, local: dict[Any, Any],
                     scalar_g: dict[str, torch.Tensor]) -> torch.Tensor | None:
        val = self.graph.values[v]
        if not _is_float(val):
            return None
        total: torch.Tensor | None = None
        if self._moves(v):
            for t in self.consumers(v, self.s):
                g = self._recv_rows(v, rows, self._replicas(t, m, layout), _GRAD, m, local)
                total = g if total is None else total + g
        if self.out_stage.get(v) == self.s:
            if v in scalar_g:
                w = (rows[1] - rows[0]) / layout.n_rows
                g = (scalar_g[v] * w).to(getattr(torch, val.dtype)).reshape(())
            else:
                g = self._recv_rows(v, rows, list(enumerate(layout.owned)), _OUT_GRAD, m, local)
            total = g if total is None else total + g
        return total

    def _reduce_grads(self, before: dict[str, torch.Tensor | None]) -> None:
        """Sum this backward's gradients over the ranks holding each parameter and add them to
        what `.grad` held before. Under no_sync the local sums wait in `_pending` (and show in
        `.grad`) until the next synchronised backward reduces them together."""
        new = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in self.held.items()}
        if not self.sync:
            for n, p in self.held.items():
                pend = self._pending.get(n)
                self._pending[n] = new[n] if pend is None else pend + new[n]
                prev = before[n]
                p.grad = new[n] if prev is None else prev + new[n]
            return
        base: dict[str, torch.Tensor | None] = {}
        for n in self.held:
            pend = self._pending.pop(n, None)
            prev = before[n]
            base[n] = prev if pend is None or prev is None else prev - pend
            if pend is not None:
                new[n] = new[n] + pend
        for _ranks, names, group in self._groups:
            if group is None:
                continue
            tensors = [new[n] for n in names]
            flat = torch.cat([t.reshape(-1) for t in tensors])
            dist.all_reduce(flat, group=group)
            at = 0
            for n, t in zip(names, tensors, strict=True):
                new[n] = flat[at:at + t.numel()].view_as(t)
                at += t.numel()
        for n, p in self.held.items():
            b = base[n]
            p.grad = new[n] if b is None else b + new[n]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        prev, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = prev


class PipelineFunction(torch.autograd.Function):
    """Connects the pipeline to the user's autograd graph: its outputs are this rank's
    outputs, and its backward runs this rank's part of the pipeline backward."""

    @staticmethod
    def forward(ctx: Any, runtime: PipelineRuntime, names: list[str],  # type: ignore[override]
                anchor: torch.Tensor, *outs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.runtime, ctx.names = runtime, names
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:  # type: ignore[override]
        grad_of: dict[str, torch.Tensor | None] = {}
        for v, g in zip(ctx.names, grads, strict=True):
            prev = grad_of.get(v)
            grad_of[v] = g if prev is None else prev if g is None else prev + g
        ctx.runtime.backward(grad_of)
        return (None, None, None, *([None] * len(grads)))


def _is_float(val: Value) -> bool:
    return val.is_tensor and getattr(torch, val.dtype).is_floating_point


def _leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and not isinstance(x, nn.Parameter):
        if x.grad_fn is None and not x.requires_grad:
            return x.detach().requires_grad_(True)
    return x


def _grad_or_zero(g: torch.Tensor | None) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float64) if g is None else g.detach().reshape(()).to(torch.float64)


def _local_batch(cap: CapturedModel, leaves: Sequence[Any]) -> int:
    for b, x in zip(cap.layout.batch_leaves, leaves, strict=True):
        if b:
            return int(x.shape[0])
    return 0


__all__ = ["PipelineFunction", "PipelineRuntime"]
