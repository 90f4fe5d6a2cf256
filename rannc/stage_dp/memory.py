"""THE memory model of a stage (DESIGN.md section 4): what one device holding one replica of a
stage needs, in bytes. Every part of the planner that asks whether a stage fits calls here: the
stage tables (`tables.py`, numpy arrays over every block range at once), the mixed-cluster DP
(`hetero.py`, one stage on one run of devices, scalars) and the placement of a plan on mixed
devices (`placement.py`). A plan that fits must run only if they all agree, so the formula is
written once, and its inputs are explicit arguments (no profile or table objects), so a term
added here reaches all of them.

    memory = static                       parameters, gradients, optimizer state (ZeRO-1: a share)
                                          (the gradients twice under an accumulation on a
                                          schedule that runs backward inside forward(): the
                                          micro-step's own beside the accumulated `.grad`)
           + overhead                     what a rank holds beyond tensors (a CPU rank: host memory)
           + buckets                      the gradient reduction's one bucket beyond the gradients
           + in_flight * (inputs + outputs)   each microbatch alive: what it received and sends on
           + ahead * inputs               the next microbatch's inputs, whose receive is posted
                                          while the stage still computes (`posted_ahead`)
           + saved_inputs * inputs        eager schedules: stage inputs kept for the late pass
           + work                         the largest single task's live bytes
           + alive(f) * kept              activations kept for backward
           + split(stash, released)       a backward split into B and W (zero-bubble schedules)
           + held outputs                 batch outputs (logits) kept until the call returns

where `kept` is one microbatch's activations kept for backward (what autograd saves,
`rannc.profile.saved`) and f the fraction of them recomputed: recomputation drops f of every
microbatch's kept activations but one (the one being rebuilt), so alive(f) = in_flight - f *
(in_flight - 1) (a split backward: below). The stage's peak is the larger of that and its
memory when the call returns (`at_return_memory`: every microbatch's batch outputs and this
rank's rows of them assembled, which recomputation cannot free). All functions take numpy
arrays or floats alike (the tables call them on (k, k) arrays, the mixed-cluster DP on floats).

A split backward: B keeps for W the gradients into the nodes where a weight's path meets the
activations' (`stash`, `saved.wgrad_stash`), and once it has run the runtime releases the
activations only B reads (`released`, `saved.b_only`; none under selective recomputation), so
B changes a microbatch's bytes by d = stash - released (negative on a transformer layer:
GELU inputs, attention, masks outweigh the gradients). A stage's line has at most `in_flight`
microbatches live, at most A of them before their B and at most `pending` between B and W
(`actions.pending_w`), so any moment's activations, a * kept + p * (kept + d) with a <= A,
p <= pending, a + p <= in_flight, are at most in_flight * kept + pending * d where d > 0, and
in_flight * kept + past_b * d where it is not, past_b = in_flight - A (`actions.past_b`; 0,
the bound, where unknown). While B runs, its microbatch holds its stash before anything is
released: the moment after it plus min(stash, released) (with fewer than `pending` past B
then, where d <= 0). Recomputation drops f of the
kept activations of the microbatches before their B but the one being rebuilt; those past B
hold what W reads whatever f. On the zero-bubble lines a stage rebuilds a microbatch only
while fewer than `pending` are past B, so alive(f) = in_flight - f * (in_flight -
max(pending, 1)) bounds every moment (tested against each action of the lines: exact at f = 0
and 1 on ZB-H1 with M >= S, a bound between and elsewhere).

Index conventions: none; every argument is one stage's (or one array of stages').
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rannc.hostmem import is_host

MB = 2**20  # Config.bucket_mb's unit


@dataclass(frozen=True, slots=True)
class MemoryModel:
    """The settings the memory model reads from the Config and the device."""

    opt_param_factor: float  # optimizer state per parameter element (Adam: 2)
    limit: float  # bytes a stage may use (device memory after the margin)
    checkpointing: str  # auto / on / off / stage_aware
    zero_stage: int = 0  # 1: a stage's optimizer state is spread over its replicas (ZeRO-1)
    bucket_bytes: float = 0.0  # the gradient reduction's bucket (Config.bucket_mb)
    overhead: float = 0.0  # bytes each rank needs beyond its tensors (`rank_overhead`)
    selective: bool = False  # selective recomputation may be chosen (Config.selective_recompute)
    # the loop accumulates gradients under no_sync() (Config.grad_accumulation)
    accumulating: bool = False
    # a second copy of the gradients: this model's schedule runs backward inside forward(), and
    # under an accumulation that line's gradients exist beside the accumulated `.grad` until
    # backward() scales and adds them (`rannc.pipeline.runtime`, `_run_eager`)
    second_grads: bool = False

    def static(self, params: Any, grad_params: Any, ranks: Any, zero_stage: int) -> Any:
        """What one replica of a stage holds whatever the batch: `static_memory` and the
        rank's `overhead` (the gradient bucket apart: `bucket_memory`). Arrays or floats."""
        return static_memory(params, grad_params, self.opt_param_factor, ranks, zero_stage) + \
            self.overhead + (grad_params if self.second_grads else 0.0)

    def second_copy(self, eager: bool) -> bool:
        """Whether a schedule (`eager`: it runs backward inside forward()) holds the gradients
        twice: under an accumulation only."""
        return eager and self.accumulating

    def scheduled(self, eager: bool) -> MemoryModel:
        """The model for a schedule that runs backward inside forward() (`eager`) or not."""
        second = self.second_copy(eager)
        return self if second == self.second_grads else dataclasses.replace(self, second_grads=second)

    def sharing(self, stages: int, share: float | None = None) -> MemoryModel:
        """The model for one of `stages` stages that share each device (an interleaved
        schedule's chunks, `ScheduleSpec.chunks`): each planned within `share` of the limit
        (default 1/stages), the shares of a device's stages summing to at most 1, so they fit
        together. (Each also counts its own gradient bucket and the rank's overhead, where
        the rank holds one of each: an over-estimate by the other stages'.)"""
        if stages == 1:
            return self
        return dataclasses.replace(self, limit=self.limit * (1.0 / stages if share is None else share))


def static_memory(params: Any, grad_params: Any, opt_param_factor: float, ranks: Any,
                  zero_stage: int) -> Any:
    """Bytes a stage holds whatever the batch: its parameters, their gradients and the
    optimizer state, which ZeRO-1 spreads over the stage's `ranks` replicas (each keeps about
    1/ranks of it: `rannc.ownership.spread`). Arrays or floats alike."""
    opt = opt_param_factor / ranks if zero_stage else opt_param_factor
    return params + grad_params * (1 + opt)


# What a rank holds beyond its tensors on a CPU (`rannc.hostmem` says how it was measured): the
# captured graph, which every rank holds whole (its resident growth during `capture`: 20 to 23
# KiB per task, BERT and GPT-2 of 2 and 8 layers), and what a first training step leaves
# resident in any PyTorch process (the math libraries' buffers, the small-block heap: 11 to 16
# MiB besides the graph on every rank of `benchmarks/memory_forecast.py`).
RANK_BYTES = 16 * 2**20  # what a first training step leaves resident beyond tensors
TASK_BYTES = 24 * 2**10  # the captured graph, per task


def rank_overhead(device_names: Sequence[str], tasks: int) -> float:
    """Bytes every rank needs beyond its tensors, in the memory the planner budgets: on CPU
    devices the graph of `tasks` tasks and the per-process constant; on GPUs none (that memory
    is the host's, not the device's)."""
    return float(RANK_BYTES + TASK_BYTES * tasks) if any(map(is_host, device_names)) else 0.0


def bucket_memory(grad_params: Any, shared_grad: Any, shared_params: Any, replicated: Any,
                  bucket_bytes: float) -> Any:
    """Bytes the gradient reduction holds beyond the gradients (`rannc.pipeline.grads`): its one
    flat buffer, as long as its largest bucket of several parameters (a bucket of one parameter
    is reduced in that parameter's `.grad`, without a buffer), never more than `bucket_bytes`
    nor than the gradients it reduces. A stage with replicas (`replicated`) reduces every
    gradient; one without reduces only those of the `shared_params` trainable parameters
    another stage also reads (`shared_grad` bytes: a tied embedding and head), so none when that
    is one parameter (measured: the first of 4 BERT and GPT-2 stages, whose one tied embedding
    the forecast had given a 15.5 MiB buffer the runtime never allocates). An upper bound with
    replicas (buckets of one parameter are counted as if buffered). Arrays (with `replicated` an
    array of booleans) or floats alike."""
    several = np.where(np.asarray(shared_params) > 1, shared_grad, 0.0)
    return np.minimum(np.where(replicated, grad_params, several), bucket_bytes)


def posted_ahead(in_flight: int, saved_inputs: int, microbatches: int) -> int:
    """Microbatches whose stage inputs are received beyond the `in_flight` ones: the runtime
    posts each receive while the action before it runs (`Transport.expect`), so while the
    oldest microbatch's backward runs the next one's inputs arrive. None where every
    microbatch's inputs are counted already (all in flight, or all kept for a late pass)."""
    return 0 if in_flight >= microbatches or saved_inputs >= microbatches else 1


def memory_terms(static: Any, work: Any, inputs: Any, outputs: Any, kept: Any, *,
                 in_flight: int, saved_inputs: int, microbatches: int,
                 held_outputs: Any = 0.0, stash: Any = 0.0, released: Any = 0.0,
                 pending: int = 0, past_b: int = 0) -> tuple[Any, Any]:
    """(the stage's memory with nothing recomputed, the bytes one unit of recomputed fraction
    frees): memory(f) = full - f * per_fraction (`with_recompute`). `static` includes the
    gradient bucket (`bucket_memory`); inputs, outputs and kept are one microbatch's bytes;
    `held_outputs` the batch outputs kept to be returned while microbatches run
    (`Returned.held`); where the schedule splits the backward (`pending` > 0), `stash` one
    microbatch's gradients kept from B for W and `released` its activations only B reads,
    counted as the module docstring says (`actions.pending_w`, `actions.past_b`)."""
    ahead = posted_ahead(in_flight, saved_inputs, microbatches)
    base = static + (in_flight + ahead) * inputs + in_flight * outputs + saved_inputs * inputs \
        + work + held_outputs + split_backward_bytes(stash, released, pending, past_b)
    full = base + in_flight * kept
    return full, max(in_flight - max(pending, 1), 0) * kept


def split_backward_bytes(stash: Any, released: Any, pending: int, past_b: int) -> Any:
    """What a split backward adds to a stage's activations counted at `in_flight` x kept (the
    module docstring): B's change d = stash - released of a microbatch, `pending` times where
    positive and `past_b` times where not, and the stash of the microbatch inside its B before
    its release; 0 where the backward is not split (`pending` 0)."""
    if not pending:
        return 0.0
    d = stash - released
    return pending * np.maximum(d, 0.0) + past_b * np.minimum(d, 0.0) + np.minimum(stash, released)


def with_recompute(full: Any, per_fraction: Any, fraction: Any) -> Any:
    """The memory when `fraction` of the kept activations is recomputed."""
    return full - fraction * per_fraction


def stage_memory(static: Any, work: Any, inputs: Any, outputs: Any, kept: Any, *,
                 in_flight: int, saved_inputs: int, microbatches: int, recompute: Any = 0.0,
                 held_outputs: Any = 0.0, stash: Any = 0.0, released: Any = 0.0,
                 pending: int = 0, past_b: int = 0) -> Any:
    """The stage's memory while microbatches run, with `recompute` (a fraction in [0, 1]) of
    its kept activations recomputed."""
    full, per = memory_terms(static, work, inputs, outputs, kept, in_flight=in_flight,
                             saved_inputs=saved_inputs, microbatches=microbatches,
                             held_outputs=held_outputs, stash=stash, released=released,
                             pending=pending, past_b=past_b)
    return with_recompute(full, per, recompute)


@dataclass(frozen=True, slots=True)
class Returned:
    """What the model's batch outputs (logits) add to a stage's memory (arrays or floats)."""

    held: Any  # while microbatches run: the earlier microbatches' outputs, kept to return
    at_return: Any  # when the call returns: every microbatch's, and this rank's rows
    mine: Any  # of those, this rank's rows (assembled: received, then concatenated)


def local_rows(batch_size: int, copies: int, devices: int) -> int:
    """Rows of the global batch one rank feeds (and gets back as outputs)."""
    return math.ceil(batch_size / max(copies * devices, 1))


def held_outputs(per_microbatch: Any, microbatches: int, in_flight: int) -> Any:
    """The batch outputs a stage computing `per_microbatch` bytes of them per microbatch holds
    beyond its in-flight microbatches' (which are among its outputs already): the runtime keeps
    every microbatch's until the call returns."""
    return max(microbatches - in_flight, 0) * per_microbatch


def returned_memory(per_microbatch: Any, mine: float, microbatches: int, in_flight: int,
                    computes: Any = None) -> Returned:
    """The runtime sends each microbatch's rows of a batch output to the ranks that fed them
    and keeps the tensors until the call returns, so a stage computing `per_microbatch` bytes
    of them holds all `microbatches` (`held_outputs`). At the end every rank assembles its own
    rows (`mine` bytes): received pieces, then their concatenation (a computing stage holds its
    pieces already). `computes`: whether the stage computes any (default: per_microbatch > 0;
    given where per_microbatch is one part of an affine sum, as in the mixed-cluster DP)."""
    computes = np.asarray(per_microbatch) > 0 if computes is None else computes
    assembled = np.where(computes, mine, 2 * mine)
    return Returned(held_outputs(per_microbatch, microbatches, in_flight),
                    microbatches * per_microbatch + assembled, assembled)


def at_return_memory(static: Any, inputs: Any, outputs: Any, kept: Any, ret: Returned, *,
                     in_flight: int, saved_inputs: int, microbatches: int) -> Any:
    """The stage's memory when the call returns: the static part, the stage inputs kept for
    the late pass, every microbatch's batch outputs and this rank's rows assembled, with the
    activations freed (an eager schedule ran its backward inside the call) or all alive
    (fill-drain's forward() returns before its backward). Only fill-drain holds every
    microbatch without keeping stage inputs for the late pass: an eager schedule holding them
    all keeps them (saved_inputs = M) whenever the model returns a batch output, and without
    one nothing is assembled at return, so the two are not confused where it counts.
    Recomputation frees none of it."""
    fill_drain = in_flight >= microbatches and saved_inputs == 0
    out = static + saved_inputs * inputs + ret.at_return
    if fill_drain:  # the activations alive, the outputs already among them but this rank's rows
        out = out + in_flight * (inputs + outputs + kept) - ret.at_return + ret.mine
    return out


def stage_peak(static: Any, work: Any, inputs: Any, outputs: Any, kept: Any, ret: Returned, *,
               in_flight: int, saved_inputs: int, microbatches: int, recompute: Any = 0.0,
               stash: Any = 0.0, released: Any = 0.0, pending: int = 0,
               past_b: int = 0) -> Any:
    """The stage's peak: while microbatches run (`stage_memory`) or when the call returns
    (`at_return_memory`), whichever is larger. `static` includes the gradient bucket in both
    (an upper bound when the call returns: the bucket's buffer lives while gradients are
    reduced)."""
    running = stage_memory(static, work, inputs, outputs, kept, in_flight=in_flight,
                           saved_inputs=saved_inputs, microbatches=microbatches,
                           recompute=recompute, held_outputs=ret.held, stash=stash,
                           released=released, pending=pending, past_b=past_b)
    return np.maximum(running, at_return_memory(static, inputs, outputs, kept, ret,
                                                in_flight=in_flight, saved_inputs=saved_inputs,
                                                microbatches=microbatches))


def fraction_to_fit(full: Any, per_fraction: Any, limit: float) -> Any:
    """The smallest recomputed fraction that brings `full` within `limit` (0 when it fits;
    inf when recomputation frees nothing); may exceed 1 (it does not fit)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(full <= limit, 0.0,
                        np.where(per_fraction > 0, (full - limit) / per_fraction, math.inf))


def rows_scaled(memory: float, static: float, rows: float, new_rows: float) -> float:
    """A placed replica's memory when it computes `new_rows` of each microbatch instead of the
    `rows` it was planned for, taking everything but `static` to scale with the rows (the
    placement on mixed devices, `placement.py`); inverse: `rows_that_fit`."""
    return static + max(memory - static, 0.0) / rows * new_rows


def rows_that_fit(memory: float, static: float, rows: float, capacity: float) -> float:
    """How many rows of each microbatch fit in `capacity` bytes under `rows_scaled`."""
    per_row = max(memory - static, 0.0) / rows
    return (capacity - static) / per_row if per_row > 0 else math.inf


__all__ = ["MB", "RANK_BYTES", "TASK_BYTES", "MemoryModel", "Returned", "at_return_memory",
           "bucket_memory", "fraction_to_fit", "held_outputs", "local_rows", "memory_terms", "posted_ahead",
           "rank_overhead", "returned_memory", "rows_scaled", "rows_that_fit", "stage_memory",
           "split_backward_bytes", "stage_peak", "static_memory", "with_recompute"]
