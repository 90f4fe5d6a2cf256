"""Forward, recomputation and backward of one microbatch of one stage.

A stage runs as two fx modules built from the captured graph: a *recomputed* prefix, run
without autograd in forward and again with it just before the backward (its RNG replayed, so
dropout draws the same masks), and a *kept* suffix whose activations autograd keeps. Either
part may be absent (no recomputation: only a kept part; the whole stage recomputed: only a
recomputed part). The recomputed part's float outputs feed the kept part through detached
leaves (`Micro.links`), so the kept part's backward stops there and the recomputed part's
backward continues from their gradients.

What one microbatch's actions pass to each other lives in `Micro`; where its inputs come from
and where its outputs and input gradients go is the executor's business, so a rank can hold
several `Stage`s (interleaved schedules). `backward` computes input and weight gradients in one
autograd pass; a zero-bubble schedule splits it into `backward_input` (B: the stage inputs'
gradients, which the previous stage waits for) and `backward_weight` (W: the parameters', run
later in an idle slot), from the same autograd graphs, of which B releases what only it reads
(`rannc.pipeline.split_backward`).

Index conventions: m microbatches; v value names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from rannc.atomic.components import AtomicPartition
from rannc.graph.capture import AutocastState, CapturedModel, running_as
from rannc.graph.extract import StageGraph, build_stage_module, split_graph
from rannc.graph.reductions import per_call_writes
from rannc.pipeline import batchnorm as bnorm
from rannc.pipeline.routes import Routes
from rannc.pipeline.rows import Range
from rannc.pipeline.selective import Recorder, instrument
from rannc.pipeline.split_backward import WeightPass, backward_input
from rannc.profile.saved import recomputable


@dataclass
class Micro:
    """One microbatch of one stage on this replica: what its actions pass to each other."""

    rows: Range
    ins: list[Any] | None = None  # stage inputs (float activations as leaves when training)
    rng: torch.Tensor | None = None  # RNG state before the forward ran
    saved: list[Any] | None = None  # eager schedules: the stage inputs, for a late pass
    outs: list[Any] | None = None  # stage outputs, to send (SF)
    kept: list[Any] | None = None  # outputs of the kept part, with their autograd graph
    links: dict[str, torch.Tensor] = field(default_factory=dict)  # recomputed part -> kept part
    rec: list[Any] | None = None  # outputs of the recomputed part, rebuilt with a graph (R)
    out_grads: list[torch.Tensor | None] | None = None  # per stage output (RB)
    in_grads: list[Any] | None = None  # per stage input (B), to send (SB)
    weight: list[WeightPass] | None = None  # split backward: what B left for W, per part

    @property
    def empty(self) -> bool:
        return self.rows[0] == self.rows[1]


@dataclass(frozen=True, slots=True)
class Part:
    """The recomputed prefix or the kept suffix of a stage."""

    graph: StageGraph
    module: Any
    recorder: Recorder | None = None  # selective recomputation's (None: every saved tensor kept)

    def saving(self) -> contextlib.AbstractContextManager[None]:
        """The context its forward with autograd runs in (selective recomputation's hooks)."""
        return self.recorder.saving() if self.recorder is not None else contextlib.nullcontext()


def build_parts(captured: CapturedModel, atomic: AtomicPartition, stages: Sequence[StageGraph],
                groups: Sequence[Sequence[int]], s: int, n_rec: int,
                wrap: Callable[[fx.GraphModule], Any] | None, selective: bool = False,
                fused: bool = False) -> tuple[Part | None, Part | None]:
    """Split stage s into the prefix of its first `n_rec` components, whose activations are
    dropped in forward and rebuilt before backward, and the suffix that keeps them; with
    `selective` (and no `wrap`: a compiler chooses what it saves), each part keeps the values
    `recomputable` names as recipes (`fused`: the device runs fused attention, `saved`)."""
    comps = list(groups[s])

    def part(st: StageGraph) -> Part:
        gm = build_stage_module(captured.gm, captured.graph, st)
        if wrap is not None:
            return Part(st, wrap(gm))
        if not selective:
            return Part(st, gm)
        rule = recomputable(captured.graph, fused=fused, tasks=st.tasks, held=st.outputs)
        rec = Recorder()
        return Part(st, gm, rec if instrument(gm, rule.values, rec) else None)

    if n_rec in (0, len(comps)):
        whole = part(stages[s])
        return (whole, None) if n_rec else (None, whole)
    cut = [*groups[:s], comps[:n_rec], comps[n_rec:], *groups[s + 1:]]
    sub = split_graph(captured.graph, atomic, cut)
    return part(sub[s]), part(sub[s + 1])


class Stage:
    """Stage `index` as held by this rank (replica `replica` of it)."""

    def __init__(self, index: int, replica: int, graph: StageGraph, rec_part: Part | None,
                 keep_part: Part | None, routes: Routes, bn: bnorm.BatchNormState,
                 weights: Sequence[nn.Parameter] = (), autocast: AutocastState = ()) -> None:
        """`weights`: the parameters this stage holds (what a split backward's W computes);
        `autocast`: the state the graph was captured under, which its forwards run under (a
        fill-drain schedule recomputes in backward(), outside the user's autocast block)."""
        self.index, self.replica, self.graph = index, replica, graph
        self.autocast = autocast
        self.rec_part, self.keep_part = rec_part, keep_part
        self.routes, self._bn = routes, bn
        self.weights = list({id(p): p for p in weights}.values())
        # per set of model inputs requiring grad: the positions of the inputs whose gradient
        # this stage computes, and of those whose gradient goes back to a sender (a stage's
        # inputs name every parameter and buffer it reads: looked at once, not per microbatch)
        self._grad_positions: dict[frozenset[str], tuple[tuple[int, ...], tuple[int, ...]]] = {}
        # the inputs that are buffers this stage writes in place (a counter, a running mean):
        # a recomputation or a late pass must read them as this microbatch's forward did
        written = {v for t in graph.tasks for v in routes.graph.tasks[t].mutates}
        self._written_at = tuple(i for i, v in enumerate(graph.inputs)
                                 if v in written and routes.is_buffer(v))
        # ... of which those whose new value does not depend on the batch (a counter, spectral
        # norm's power iteration on the weights): every microbatch of a call starts them from
        # the call's values, so the call updates them once, as the model does
        per_call = per_call_writes(routes.graph, graph.tasks)
        self._per_call_at = tuple(i for i in self._written_at if graph.inputs[i] in per_call)
        self._call_start: list[torch.Tensor] = []

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.graph.inputs

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.graph.outputs

    def modules(self) -> list[Any]:
        return [p.module for p in (self.rec_part, self.keep_part) if p is not None]

    # -- inputs --------------------------------------------------------------------------------
    def wants_grad(self, v: str, grad_inputs: frozenset[str]) -> bool:
        """Whether this stage computes stage input v's gradient in a call whose model inputs
        `grad_inputs` require grad."""
        if self.routes.shape_only(v, self.index):
            return False
        return self.routes.is_activation(v) or (
            v in grad_inputs and (v, self.index) in self.routes.input_edges)

    def grad_positions(self, grad_inputs: frozenset[str]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(positions of the inputs whose gradient this stage computes (`wants_grad`), positions
        of those whose gradient it sends back (`Routes.sends_grad_back`)) in a call whose model
        inputs `grad_inputs` require grad."""
        got = self._grad_positions.get(grad_inputs)
        if got is None:
            got = self._grad_positions[grad_inputs] = (
                tuple(i for i, v in enumerate(self.inputs) if self.wants_grad(v, grad_inputs)),
                tuple(i for i, v in enumerate(self.inputs)
                      if self.routes.sends_grad_back(v, self.index, grad_inputs)))
        return got

    def as_leaves(self, ins: Sequence[Any], grad_inputs: frozenset[str]) -> list[Any]:
        """The received inputs of a call with gradients: those whose gradient this stage
        computes as autograd leaves."""
        out = list(ins)
        for i in self.grad_positions(grad_inputs)[0]:
            out[i] = _leaf(out[i])
        return out

    # -- forward -------------------------------------------------------------------------------
    def forward(self, mic: Micro, grad: bool, keep_inputs: bool, first: bool = True) -> None:
        """Microbatch `mic`'s forward from its inputs (`mic.ins`) to its outputs (`mic.outs`);
        with `keep_inputs`, the inputs stay for a late pass. `first`: the call's first forward
        of this stage (the per-call buffers' values are taken there, put back before later ones)."""
        assert mic.ins is not None
        if self._per_call_at:
            if first:
                self._call_start = [mic.ins[i].detach().clone() for i in self._per_call_at]
            else:
                with torch.no_grad():
                    for i, x in zip(self._per_call_at, self._call_start, strict=True):
                        mic.ins[i].copy_(x)
        env = dict(zip(self.inputs, mic.ins, strict=True))
        mic.rng = torch.get_rng_state()
        if self._written_at and (keep_inputs or (grad and self.rec_part is not None)):
            # (the forward below writes into the buffers themselves; what runs it again later
            # starts from their values now: before, it read what this forward had written,
            # and its gradients were those of other activations)
            before = list(mic.ins)
            for i in self._written_at:
                before[i] = before[i].detach().clone()
            mic.ins = before
        if keep_inputs:
            mic.saved = list(mic.ins)
        self._bn.accumulate = True  # BatchNorm statistics count in this first forward only
        try:
            with running_as(self.autocast):
                self._forward_parts(mic, env, grad)
        finally:
            self._bn.accumulate = False
        mic.outs = [env[v] for v in self.outputs]
        if not grad:
            mic.ins = None

    def _forward_parts(self, mic: Micro, env: dict[str, Any], grad: bool) -> None:
        if self.rec_part is not None:
            with torch.no_grad():
                outs = self.rec_part.module(*[env[v] for v in self.rec_part.graph.inputs])
            for v, o in zip(self.rec_part.graph.outputs, outs, strict=True):
                if grad and isinstance(o, torch.Tensor) and o.is_floating_point():
                    o = o.detach().requires_grad_(True)
                    mic.links[v] = o
                env[v] = o
        if self.keep_part is not None:
            saving = self.keep_part.saving() if grad else contextlib.nullcontext()
            with torch.set_grad_enabled(grad), saving:
                outs = self.keep_part.module(*[env[v] for v in self.keep_part.graph.inputs])
            env.update(zip(self.keep_part.graph.outputs, outs, strict=True))
            mic.kept = list(outs) if grad else None

    def recompute(self, mic: Micro) -> None:
        """Rebuild the recomputed part's activations, replaying its dropout; buffers get
        copies so BatchNorm statistics update once per microbatch, as without recomputation."""
        part = self.rec_part
        assert part is not None and mic.ins is not None and mic.rng is not None
        env = dict(zip(self.inputs, mic.ins, strict=True))
        ins = [env[v].clone() if self.routes.is_buffer(v) else env[v] for v in part.graph.inputs]
        with torch.random.fork_rng(devices=[]), torch.enable_grad(), running_as(self.autocast), \
                part.saving():
            torch.set_rng_state(mic.rng)
            mic.rec = list(part.module(*ins))

    # -- backward ------------------------------------------------------------------------------
    def backward(self, mic: Micro, grad_inputs: frozenset[str]) -> None:
        """Backward from the output gradients (`mic.out_grads`) through the kept part, then the
        recomputed part, into the stage inputs (`mic.in_grads`) and the parameters."""
        assert mic.out_grads is not None and mic.ins is not None
        grad_of = dict(zip(self.outputs, mic.out_grads, strict=True))
        if self.keep_part is not None and mic.kept is not None:
            _backward(mic.kept, [grad_of.get(v) for v in self.keep_part.graph.outputs])
        if self.rec_part is not None:
            _backward(*self._recomputed_grads(mic, grad_of))
        mic.in_grads = self.input_grads(mic.ins, grad_inputs)
        mic.ins = mic.kept = mic.rec = mic.out_grads = None
        mic.links = {}

    def _recomputed_grads(self, mic: Micro, grad_of: dict[str, Any]) -> tuple[list[Any], list[Any]]:
        """The recomputed part's outputs and their gradients (recomputing it first if the schedule has not):
        from the later stage, plus what the kept part sent back into its values (`mic.links`)."""
        assert self.rec_part is not None
        if mic.rec is None:
            self.recompute(mic)
        assert mic.rec is not None
        gs = []
        for v in self.rec_part.graph.outputs:
            g, link = grad_of.get(v), mic.links.get(v)
            if link is not None and link.grad is not None:
                g = link.grad if g is None else g + link.grad
            gs.append(g)
        return mic.rec, gs

    def backward_input(self, mic: Micro, grad_inputs: frozenset[str]) -> None:
        """B of a split backward (zero-bubble schedules): as `backward`, but into the stage
        inputs alone (`mic.in_grads`, sent back at once); the parameters' gradients wait in
        `mic.weight` for `backward_weight`, the autograd graphs kept until then less what only
        B reads (`rannc.pipeline.split_backward`). One W pass per part, so a parameter read by both
        parts accumulates twice per microbatch, as in `backward` (the reducer counts that)."""
        assert mic.out_grads is not None and mic.ins is not None
        grad_of = dict(zip(self.outputs, mic.out_grads, strict=True))
        leaves = [x for x in mic.ins if isinstance(x, torch.Tensor) and x.requires_grad
                  and x.grad_fn is None and not isinstance(x, nn.Parameter)]
        passes = []
        if self.keep_part is not None and mic.kept is not None:
            passes.append(backward_input(mic.kept, [grad_of.get(v) for v in self.keep_part.graph.outputs],
                                         leaves + list(mic.links.values()), self.weights))
        if self.rec_part is not None:
            rec, gs = self._recomputed_grads(mic, grad_of)
            passes.append(backward_input(rec, gs, leaves, self.weights))
        mic.in_grads = self.input_grads(mic.ins, grad_inputs)
        mic.weight = passes
        mic.ins = mic.kept = mic.rec = mic.out_grads = None
        mic.links = {}

    def backward_weight(self, mic: Micro) -> None:
        """W of a split backward: the parameters' gradients of microbatch `mic`, accumulated
        into `.grad` (post-accumulate-grad hooks fire as after `backward`); frees its graph."""
        for wp in mic.weight or ():
            wp.run()
        mic.weight = None

    def late_backward(self, mic: Micro, grad_inputs: frozenset[str]) -> None:
        """An eager schedule's late pass: forward again from the saved inputs (RNG replayed)
        with autograd, and backward from `mic.out_grads` (gradients add to the eager pass's)."""
        assert mic.saved is not None and mic.rng is not None and mic.out_grads is not None
        ins = [x.detach().clone() if self.routes.is_buffer(v) else
               x.detach().requires_grad_(True) if self.wants_grad(v, grad_inputs) else x
               for v, x in zip(self.inputs, mic.saved, strict=True)]
        env = dict(zip(self.inputs, ins, strict=True))
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            torch.set_rng_state(mic.rng)
            for part in (self.rec_part, self.keep_part):
                if part is not None:
                    outs = part.module(*[env[v] for v in part.graph.inputs])
                    env.update(zip(part.graph.outputs, outs, strict=True))
        _backward([env[v] for v in self.outputs], mic.out_grads)
        mic.in_grads = self.input_grads(ins, grad_inputs)
        mic.saved = mic.out_grads = None

    def input_grads(self, ins: Sequence[Any], grad_inputs: frozenset[str]) -> list[Any]:
        """Per stage input: its gradient (zeros if none reached it) where the sender waits for
        one (`Routes.sends_grad_back`), else None."""
        out: list[Any] = [None] * len(ins)
        for i in self.grad_positions(grad_inputs)[1]:
            x = ins[i]
            if isinstance(x, torch.Tensor):
                out[i] = x.grad if x.grad is not None else torch.zeros_like(x)
        return out


def _leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and not isinstance(x, nn.Parameter):
        if x.grad_fn is None and not x.requires_grad:
            return x.detach().requires_grad_(True)
    return x


def _backward(outs: Sequence[Any], grads: Sequence[torch.Tensor | None]) -> None:
    """Backward from the outputs that have both a graph and a gradient."""
    ts, gs = [], []
    for o, g in zip(outs, grads, strict=True):
        if g is not None and isinstance(o, torch.Tensor) and o.requires_grad:
            ts.append(o)
            gs.append(g)
    if ts:
        torch.autograd.backward(ts, gs)


__all__ = ["Micro", "Part", "Stage", "build_parts"]
