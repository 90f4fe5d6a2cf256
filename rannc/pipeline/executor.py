"""Walks a rank's line of schedule actions for one call.

An action names its stage (`F1.3`: forward of stage 1, microbatch 3), so a line may hold the
actions of several stages this rank holds (interleaved schedules): everything per microbatch
is kept per (stage, microbatch), and each action goes to its own `Stage`. Receiving an
action's inputs and sending its results is done here, from the routes (which stage or rank
each value comes from and goes to) and the call's row layout (which rows each replica holds),
through the call's `Transport`; the computation is the stage's.

Model outputs: a batch output's rows go back to the ranks owning them; a scalar output (a loss)
is summed here, piece by piece, with each (microbatch, replica) piece weighted by its share of
the global value (`piece_weight`), and the runtime all-reduces the sums.

Index conventions: s, t stages; m microbatches; r ranks.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import _profiler_enabled

from rannc.graph.task_graph import eval_dim
from rannc.pipeline.arrivals import Arrivals
from rannc.pipeline.grads import GradReducer
from rannc.pipeline.routes import OWNERS, Routes
from rannc.pipeline.rows import Range, RowLayout, intersect
from rannc.pipeline.stage import Micro, Stage
from rannc.pipeline.transport import Key, Kind, Transport
from rannc.plans import Plan
from rannc.schedule import Action, Event, Op, Schedule


@dataclass
class Call:
    """One call of the model on this rank: its layout, inputs, messages and per-(stage,
    microbatch) state."""

    layout: RowLayout
    env: dict[str, Any]  # the call's bound inputs (and parameters), by value name
    mode: str  # "forward" (no grad), "split" (fill-drain: backward() runs the rest), "eager"
    transport: Transport
    micro: dict[tuple[int, int], Micro]  # (stage, microbatch) -> its state
    grad_inputs: frozenset[str] = frozenset()  # model inputs whose rows get gradients back
    used: set[str] = field(default_factory=set)  # batch outputs some rank back-propagates from
    # the model outputs seeding the backward pass running (None: every float one): gradients
    # travel only along what they depend on (`Routes.grad_edges_from`)
    grad_from: frozenset[str] | None = None
    stash: dict[str, torch.Tensor] | None = None  # eager: gradients for a unit loss gradient
    input_stash: dict[str, torch.Tensor] = field(default_factory=dict)  # eager: likewise
    reducing: bool = False  # eager: the gradient reducer's buckets started in forward()
    # the scalar outputs' all-reduce once started (`Executor.share_scalars`): names, sums, work
    scalar_share: tuple[list[str], torch.Tensor, Any] | None = None
    t0: float = 0.0
    forwarded: set[int] = field(default_factory=set)  # stages whose first forward has run

    def release(self) -> None:
        """Once its backward has run: drop what it kept for it. The user's loss keeps the call
        (its autograd node) until the next forward() returns, and with it, otherwise, the
        microbatches' stage inputs and outputs and the eager line's gradients where `.grad`
        got other tensors (a loss gradient other than 1, gradients accumulated under
        no_sync()): a copy of the stage's gradients alive through the next call's line."""
        self.stash = None
        self.input_stash = {}
        self.micro = {}
        self.env = {}


class Executor:
    """Runs the actions of the `stages` this rank holds (one replica each)."""

    def __init__(self, stages: Sequence[Stage], routes: Routes, plan: Plan, schedule: Schedule,
                 grads: GradReducer, summed: set[str], rank: int, world_size: int,
                 trace: bool = False) -> None:
        self.stages: dict[int, Stage] = {st.index: st for st in stages}
        self.routes, self.plan, self.schedule, self.grads = routes, plan, schedule, grads
        self.summed = summed  # scalar outputs whose pieces add up (`piece_weight`)
        self.rank, self.world_size = rank, world_size
        self.arrivals = Arrivals(schedule, routes)  # which sends a receive proves arrived
        self._has_consumers = {s: bool(schedule.consumers(s)) for s in self.stages}
        self._split = {s: schedule.splits_backward(s) for s in self.stages}  # B and W apart
        self._keeps_inputs = routes.has_batch_grad_outputs()
        # per stage: the inputs other stages or the input owners send (`_input_sources`), and
        # the outputs whose gradients come back (`_grad_sources`); a stage's inputs also name
        # every parameter and buffer it reads, so `_expect` looks only at these
        self._sent_inputs = {s: tuple(v for v in st.inputs if routes.receives(v, s)
                                      and routes.graph.values[v].dtype != "sym_int")
                             for s, st in self.stages.items()}
        self._own_inputs = {s: frozenset(v for v in st.inputs if not routes.moves(v)
                                         and routes.graph.values[v].dtype != "sym_int")
                            for s, st in self.stages.items()}
        self._grad_outputs = {s: tuple(v for v in st.outputs if routes.moves(v) and routes.is_float(v))
                              for s, st in self.stages.items()}
        # the stages of this rank computing a scalar output (a loss): its pieces add up there
        self._scalar_stages = {routes.out_stage[v] for v in routes.scalar_outputs()} & set(self.stages)
        self.trace = trace
        # the scalar outputs' all-reduce waits for the end of the call, to carry BatchNorm's
        # statistics with it (`PipelineRuntime._forward`): the same on every rank
        self.scalars_at_end = False
        self.events: list[Event] = []  # the last call's actions, when tracing

    def new_micro(self, layout: RowLayout) -> dict[tuple[int, int], Micro]:
        return {(s, m): Micro(layout.rows[s][m][st.replica])
                for s, st in self.stages.items() for m in range(self.plan.microbatches)}

    def replicas(self, t: int, m: int, layout: RowLayout) -> list[tuple[int, Range]]:
        """(rank, rows) of each replica of stage t in microbatch m."""
        return list(zip(self.plan.stages[t].ranks, layout.rows[t][m], strict=True))

    # -- the line ------------------------------------------------------------------------------
    def run(self, call: Call, acts: Sequence[Action], scalars: dict[str, torch.Tensor],
            scalar_g: dict[str, torch.Tensor] | None = None, arm: Action | None = None) -> None:
        """Run `acts`; `arm`: the action before which the gradient reducer is armed. The scalar
        outputs' all-reduce starts as soon as this rank's last piece of them is in (and the
        layout is agreed), so that the ranks do not meet for it at the end of the call. While
        the line runs, a send is dropped once a receive proves it arrived (`Arrivals`)."""
        call.transport.arrivals = self.arrivals
        try:
            self._run_line(call, acts, scalars, scalar_g, arm)
        finally:
            call.transport.arrivals = None

    def _run_line(self, call: Call, acts: Sequence[Action], scalars: dict[str, torch.Tensor],
                  scalar_g: dict[str, torch.Tensor] | None, arm: Action | None) -> None:
        last = max((i for i, a in enumerate(acts) if a.op is Op.F and a.stage in self._scalar_stages
                    and not call.micro[(a.stage, a.micro)].empty), default=-1)
        # the actions that receive from other ranks, by index: each one's receives are posted
        # while the action before it runs (`_expect`)
        receiving = [i for i, a in enumerate(acts) if a.op in _RECEIVING
                     and not call.micro[(a.stage, a.micro)].empty]
        ahead = 0  # receiving[ahead]: the next receiving action after the one running
        posted = -1  # the last receiving action whose receives are posted (by its index)
        for i, a in enumerate(acts):
            if (scalars and call.scalar_share is None and i > last and call.transport.guess is None
                    and not self.scalars_at_end):
                self.share_scalars(call, scalars)
            mic = call.micro[(a.stage, a.micro)]
            if mic.empty:
                continue
            while ahead < len(receiving) and receiving[ahead] <= i:
                ahead += 1
            if a.op in _RECEIVING and posted != i:  # all its pieces at once (the first
                self._expect(call, a, settle=True)  # settles a guessed layout)
            if ahead < len(receiving) and posted != receiving[ahead] and call.transport.guess is None:
                posted = receiving[ahead]
                self._expect(call, acts[posted])
            if a == arm:
                call.transport.settle()  # (the buckets are collectives: not on a guessed layout)
                self.grads.arm()
            t0 = time.perf_counter() if self.trace else 0.0
            # A named range per action (F0.3: forward of stage 0, microbatch 3) in torch.profiler
            # traces; only under a profiler (its name and range cost about 6 us an action)
            with (torch.profiler.record_function(f"rannc {a}") if _profiler_enabled()
                  else contextlib.nullcontext()):
                self._run_action(call, a, mic, scalars, scalar_g)
            if self.trace:
                self.events.append(Event(a, t0 - call.t0, time.perf_counter() - call.t0))
            call.transport.poll()  # the held-back transfers go as soon as they can
        call.transport.check_drained()

    def _expect(self, call: Call, a: Action, settle: bool = False) -> None:
        """Post the receives from other ranks that action `a` will make (`Transport.expect`):
        a stage's inputs (RF; F of a stage whose inputs no RF received) and its outputs'
        gradients from the stages reading them (RB; B of a stage without an RB). A model
        output's gradient from its owners (a late pass's) is received when it is needed. On
        a guessed layout nothing is posted, unless `settle` (`a` runs now): then the layout
        is settled first, as its first receive from another rank would."""
        st, m = self.stages[a.stage], a.micro
        mic = call.micro[(a.stage, m)]
        msgs: list[tuple[Key, list[tuple[int, Range]]]] = []
        if a.op in (Op.RF, Op.F):
            if mic.ins is None:
                for v in self._sent_inputs[st.index]:
                    src = self._input_sources(call, st, v, m)
                    assert src is not None
                    msgs.append((Key(v, m, Kind.FWD, st.index), src))
        elif mic.out_grads is None:  # RB, or B
            for v in self._grad_outputs[st.index]:
                msgs += self._grad_sources(call, st, v, m)
        for key, src in msgs:
            call.transport.expect(key, mic.rows, src, settle)

    def share_scalars(self, call: Call, scalars: Mapping[str, torch.Tensor],
                      extra: torch.Tensor | None = None) -> tuple[torch.Tensor, Any] | None:
        """Start the all-reduce of this rank's sums of the scalar outputs' pieces (its stages'
        share of each; zeros elsewhere). Every rank starts it once per call, after the call's
        layout is agreed (a collective must not start on a guessed layout). `extra`: more
        float64 sums over the world to carry in the same all-reduce; returns (their reduced
        view, the work to wait for), or None without `extra`."""
        names = sorted(scalars)
        flat = torch.stack([scalars[v] for v in names])
        if extra is not None:
            flat = torch.cat([flat, extra.to(flat.device)])
        work = dist.all_reduce(flat, async_op=True)
        call.scalar_share = (names, flat[:len(names)], work)
        return None if extra is None else (flat[len(names):], work)

    def shared_scalars(self, call: Call, scalars: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The scalar outputs' global sums (starting their all-reduce if not yet started)."""
        if call.scalar_share is None:
            self.share_scalars(call, scalars)
        assert call.scalar_share is not None
        names, flat, work = call.scalar_share
        work.wait()
        return dict(zip(names, flat, strict=True))

    def _run_action(self, call: Call, a: Action, mic: Micro, scalars: dict[str, torch.Tensor],
                    scalar_g: dict[str, torch.Tensor] | None) -> None:
        st = self.stages[a.stage]
        if a.op is Op.RF:
            self._receive_inputs(call, st, a.micro)
        elif a.op is Op.F:
            if mic.ins is None:  # the first stage: only model inputs, received here
                self._receive_inputs(call, st, a.micro)
            first = a.stage not in call.forwarded
            call.forwarded.add(a.stage)
            st.forward(mic, call.mode != "forward", call.mode == "eager" and self._keeps_inputs,
                       first=first)
            if not self._has_consumers[a.stage]:  # no SF action: model outputs leave right away
                self._send_outputs(call, st, a.micro, scalars)
        elif a.op is Op.SF:
            self._send_outputs(call, st, a.micro, scalars)
        elif a.op is Op.RB:
            mic.out_grads = [self._output_grad(call, st, v, a.micro, scalar_g) for v in st.outputs]
        elif a.op is Op.R:
            st.recompute(mic)
        elif a.op is Op.B:
            if mic.out_grads is None:  # a stage without consumers: only model-output grads
                mic.out_grads = [self._output_grad(call, st, v, a.micro, scalar_g)
                                 for v in st.outputs]
            if self._split[a.stage]:  # B now, W (the weight gradients) later
                st.backward_input(mic, call.grad_inputs)
            else:
                st.backward(mic, call.grad_inputs)
            # model inputs' gradients go back to their owners now: a stage reading only
            # model inputs has no SB action
            self._send_input_grads(call, st, a.micro, model_inputs=True)
        elif a.op is Op.SB:
            self._send_input_grads(call, st, a.micro)
        elif a.op is Op.W:
            st.backward_weight(mic)

    # -- forward -------------------------------------------------------------------------------
    def send_inputs(self, call: Call) -> None:
        """My input rows, every microbatch, straight to the stages that read them."""
        mine = call.layout.owned[self.rank]
        for v in self.routes.graph.inputs:
            if not self.routes.moves(v):
                continue
            for t in self.routes.consumers(v, OWNERS):
                for m in range(self.plan.microbatches):
                    call.transport.send_rows(call.env[v], Key(v, m, Kind.FWD, t), mine,
                                             self.replicas(t, m, call.layout))

    def _receive_inputs(self, call: Call, st: Stage, m: int) -> None:
        mic = call.micro[(st.index, m)]
        own = self._own_inputs[st.index]  # (parameters, buffers, constants: the call's own)
        ins = [call.env[v] if v in own else self._stage_input(call, st, v, m, mic.rows)
               for v in st.inputs]
        mic.ins = st.as_leaves(ins, call.grad_inputs) if call.mode != "forward" else ins

    def _stage_input(self, call: Call, st: Stage, v: str, m: int, rows: Range) -> Any:
        val = self.routes.graph.values[v]
        if val.dtype == "sym_int":
            return eval_dim(val.sym_expr or "batch", rows[1] - rows[0])
        if self.routes.shape_only(v, st.index):
            return call.transport.stand_in(v, rows[1] - rows[0])
        src = self._input_sources(call, st, v, m)
        if src is None:
            return call.env[v]
        return call.transport.recv_rows(Key(v, m, Kind.FWD, st.index), rows, src)

    def _input_sources(self, call: Call, st: Stage, v: str, m: int) -> list[tuple[int, Range]] | None:
        """(rank, rows) of the senders of stage input v in microbatch m (None: not sent, a
        parameter, a constant, a size or read only for its sizes)."""
        if self.routes.graph.values[v].dtype == "sym_int" or not self.routes.receives(v, st.index):
            return None
        g = self.routes.supplier(v, st.index)
        return self._owners(call) if g == OWNERS else self.replicas(g, m, call.layout)

    def _send_outputs(self, call: Call, st: Stage, m: int, scalars: dict[str, torch.Tensor]) -> None:
        mic = call.micro[(st.index, m)]
        assert mic.outs is not None
        for v, o in zip(st.outputs, mic.outs, strict=True):
            self._send_output(call, st.index, v, o, m, mic.rows, scalars)
        mic.outs = None

    def _send_output(self, call: Call, s: int, v: str, o: Any, m: int, rows: Range,
                     scalars: dict[str, torch.Tensor]) -> None:
        layout = call.layout
        if self.routes.moves(v):
            for t in self.routes.consumers(v, s):
                call.transport.send_rows(o, Key(v, m, Kind.FWD, t), rows, self.replicas(t, m, layout))
        if self.routes.out_stage.get(v) != s:
            return
        if v in scalars:
            scalars[v] += o.detach().to(torch.float64) * self.piece_weight(v, rows, layout)
        else:
            call.transport.send_rows(o, Key(v, m, Kind.OUT, s), rows, self._owners(call))

    def piece_weight(self, v: str, rows: Range, layout: RowLayout) -> float:
        """The weight of one (microbatch, replica) piece of scalar output v in its global value:
        1 (a sum) where v is divided by the global `num_items_in_batch`, each piece being
        sum / global count; else the piece's share of the rows (a row-weighted mean)."""
        return 1.0 if v in self.summed else (rows[1] - rows[0]) / layout.n_rows

    def receive_outputs(self, call: Call, scalars: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's rows of every batch model output, from the stages computing them."""
        layout = call.layout
        mine = layout.owned[self.rank]
        out: dict[str, torch.Tensor] = {}
        for v, s in self.routes.out_stage.items():
            if v in scalars:
                continue
            pieces = []
            for m in range(self.plan.microbatches):
                part = intersect(mine, layout.micro[m])
                if part is not None:
                    pieces.append(call.transport.recv_rows(Key(v, m, Kind.OUT, s), part,
                                                           self.replicas(s, m, layout)))
            out[v] = _cat(pieces, self._dim(v)) if pieces else call.transport.empty(v, 0)
        return out

    # -- backward ------------------------------------------------------------------------------
    def _output_grad(self, call: Call, st: Stage, v: str, m: int,
                     scalar_g: dict[str, torch.Tensor] | None) -> torch.Tensor | None:
        """The gradient of stage output v for microbatch m: the sum over the stages reading it,
        plus, for a model output, the seed (scalar_g None: an eager pass, seeded with a unit
        loss gradient and nothing from batch outputs)."""
        val = self.routes.graph.values[v]
        if not self.routes.is_float(v):
            return None
        s, rows = st.index, call.micro[(st.index, m)].rows
        total: torch.Tensor | None = None
        for key, src in self._grad_sources(call, st, v, m):
            g = call.transport.recv_rows(key, rows, src)
            total = g if total is None else total + g
        if self.routes.out_stage.get(v) == s:
            if val.batch_dim is None:
                seed = torch.ones((), dtype=torch.float64) if scalar_g is None else scalar_g.get(v)
                if seed is None:  # no rank back-propagated through it: .grad stays None
                    return total
                w = self.piece_weight(v, rows, call.layout)
                g = (seed * w).to(getattr(torch, val.dtype)).reshape(())
            elif scalar_g is None or v not in call.used:
                return total
            else:
                g = call.transport.recv_rows(Key(v, m, Kind.OUT_GRAD, s), rows, self._owners(call))
            total = g if total is None else total + g
        return total

    def _grad_sources(self, call: Call, st: Stage, v: str,
                      m: int) -> list[tuple[Key, list[tuple[int, Range]]]]:
        """The messages carrying stage output v's gradient back from the stages reading it in
        microbatch m: (key, (rank, rows) of its senders) per reading stage."""
        if not self.routes.is_float(v) or not self.routes.moves(v):
            return []
        edges = self._grad_edges(call)
        return [(Key(v, m, Kind.GRAD, t), self.replicas(t, m, call.layout))
                for t in self.routes.consumers(v, st.index) if (v, t) in edges]

    def _grad_edges(self, call: Call) -> frozenset[tuple[str, int]] | set[tuple[str, int]]:
        """The activations' gradient edges of the backward pass running in `call`."""
        return self.routes.grad_edges if call.grad_from is None \
            else self.routes.grad_edges_from(call.grad_from)

    def _send_input_grads(self, call: Call, st: Stage, m: int, model_inputs: bool = False) -> None:
        """Stage input gradients back to their senders: a model input's to the ranks owning
        those rows. With `model_inputs`, only those (the rest wait for the SB action)."""
        mic = call.micro[(st.index, m)]
        if mic.in_grads is None:
            return
        edges = self._grad_edges(call)
        for i, (v, g) in enumerate(zip(st.inputs, mic.in_grads, strict=True)):
            if g is None:
                continue
            src = self.routes.supplier(v, st.index)
            if model_inputs and src != OWNERS:
                continue
            if src != OWNERS and (v, st.index) not in edges:  # (what this pass's seeds reach)
                mic.in_grads[i] = None
                continue
            dests = self._owners(call) if src == OWNERS else self.replicas(src, m, call.layout)
            call.transport.send_rows(g, Key(v, m, Kind.GRAD, st.index), mic.rows, dests)
            mic.in_grads[i] = None
        if not model_inputs:
            mic.in_grads = None

    def receive_input_grads(self, call: Call) -> dict[str, torch.Tensor]:
        """The gradients of this rank's rows of the model inputs that require grad: the pieces
        every (microbatch, replica) of every stage reading them sent back, in row order, summed
        over the stages."""
        layout = call.layout
        mine = layout.owned[self.rank]
        out: dict[str, torch.Tensor] = {}
        for v in sorted(call.grad_inputs):
            for t in self.routes.consumers(v, OWNERS):
                if (v, t) not in self.routes.input_edges:
                    continue
                pieces = []
                for m in range(self.plan.microbatches):
                    part = intersect(mine, layout.micro[m])
                    if part is not None:
                        pieces.append(call.transport.recv_rows(Key(v, m, Kind.GRAD, t), part,
                                                               self.replicas(t, m, layout)))
                g = _cat(pieces, self._dim(v)) if pieces else call.transport.empty(v, 0)
                out[v] = g if v not in out else out[v] + g
        return out

    def send_output_grads(self, call: Call, grad_of: Mapping[str, torch.Tensor | None]) -> None:
        """My rows of each batch output's gradient (scaled 1/W, as DDP) to their producers."""
        layout = call.layout
        mine = layout.owned[self.rank]
        w = float(self.world_size)
        for v, s in self.routes.out_stage.items():
            if v not in call.used:
                continue
            gv = grad_of.get(v)
            if gv is None:
                gv = call.transport.empty(v, mine[1] - mine[0]).zero_()
            for m in range(self.plan.microbatches):
                call.transport.send_rows(gv / w, Key(v, m, Kind.OUT_GRAD, s), mine,
                                         self.replicas(s, m, layout))

    def late_pass(self, call: Call, grad_of: Mapping[str, torch.Tensor | None]) -> None:
        """Eager schedules ran backward from the loss alone; when a batch output (logits, say)
        also got a gradient, its contribution goes through a fill-drain backward that
        recomputes each microbatch from its saved stage inputs (gradients add)."""
        self.send_output_grads(call, grad_of)
        call.grad_from = frozenset(call.used)
        for st, m in self._backward_order():
            mic = call.micro[(st.index, m)]
            if mic.empty:
                continue
            # (the scalar outputs seed nothing here: the eager line ran for the loss; seeded
            # with 0, a parameter only they reach got a zero .grad where PyTorch leaves None)
            mic.out_grads = [self._output_grad(call, st, v, m, {}) for v in st.outputs]
            st.late_backward(mic, call.grad_inputs)
            self._send_input_grads(call, st, m)

    def _backward_order(self) -> Iterator[tuple[Stage, int]]:
        """Fill-drain's backward order over this rank's stages: the last stage first, the last
        microbatch first."""
        for s in sorted(self.stages, reverse=True):
            for m in reversed(range(self.plan.microbatches)):
                yield self.stages[s], m

    # -- helpers -------------------------------------------------------------------------------
    def _owners(self, call: Call) -> list[tuple[int, Range]]:
        """(rank, rows) of the ranks owning the call's rows: every rank's local batch."""
        return list(enumerate(call.layout.owned))

    def _dim(self, v: str) -> int:
        return self.routes.graph.values[v].batch_dim or 0


# the actions whose stage may receive from other ranks: RF and F (inputs), RB and B (gradients)
_RECEIVING = frozenset({Op.RF, Op.F, Op.RB, Op.B})


def _cat(pieces: Sequence[torch.Tensor], d: int) -> torch.Tensor:
    return torch.cat(list(pieces), d)


__all__ = ["Call", "Executor"]
