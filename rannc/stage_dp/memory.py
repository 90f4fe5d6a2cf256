"""THE memory model of a stage (DESIGN.md section 4): what one device holding one replica of a
stage needs, in bytes. Every part of the planner that asks whether a stage fits calls here: the
stage tables (`tables.py`, numpy arrays over every block range at once), the mixed-cluster DP
(`hetero.py`, one stage on one run of devices, scalars) and the placement of a plan on mixed
devices (`placement.py`). A plan that fits must run only if they all agree, so the formula is
written once, and its inputs are explicit arguments (no profile or table objects), so a term
added here reaches all of them.

    memory = static                       parameters, gradients, optimizer state (ZeRO-1: a share)
           + buckets                      the gradient reduction's one bucket beyond the gradients
           + in_flight * (inputs + outputs)   each microbatch alive: what it received and sends on
           + saved_inputs * inputs        eager schedules: stage inputs kept for the late pass
           + work                         the largest single task's live bytes
           + alive(f) * kept              activations kept for backward

where `kept` is one microbatch's activations kept for backward and f the fraction of them
recomputed: recomputation drops f of every microbatch's kept activations but one (the one
being rebuilt), so alive(f) = in_flight - f * (in_flight - 1). All functions take numpy arrays
or floats alike (the tables call them on (k, k) arrays, the mixed-cluster DP on floats).

Index conventions: none; every argument is one stage's (or one array of stages').
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

MB = 2**20  # Config.bucket_mb's unit


@dataclass(frozen=True, slots=True)
class MemoryModel:
    """The settings the memory model reads from the Config and the device."""

    opt_param_factor: float  # optimizer state per parameter element (Adam: 2)
    limit: float  # bytes a stage may use (device memory after the margin)
    checkpointing: str  # auto / on / off / stage_aware
    zero_stage: int = 0  # 1: a stage's optimizer state is spread over its replicas (ZeRO-1)
    bucket_bytes: float = 0.0  # the gradient reduction's bucket (Config.bucket_mb)

    def sharing(self, stages: int) -> MemoryModel:
        """The model for one of `stages` stages that share each device (an interleaved
        schedule's chunks, `ScheduleSpec.chunks`): each planned within 1/stages of the limit,
        so the device's stages fit together. (Each also counts its own gradient bucket, where
        the rank's reducer holds one at a time: an over-estimate by the other stages' buckets.)"""
        return self if stages == 1 else dataclasses.replace(self, limit=self.limit / stages)


def static_memory(params: Any, grad_params: Any, opt_param_factor: float, ranks: int,
                  zero_stage: int) -> Any:
    """Bytes a stage holds whatever the batch: its parameters, their gradients and the
    optimizer state, which ZeRO-1 spreads over the stage's `ranks` replicas (each keeps about
    1/ranks of it: `rannc.ownership.spread`). Arrays or floats alike."""
    opt = opt_param_factor / ranks if zero_stage else opt_param_factor
    return params + grad_params * (1 + opt)


def bucket_memory(grad_params: Any, reduced: Any, bucket_bytes: float) -> Any:
    """Bytes the gradient reduction holds beyond the gradients (`rannc.pipeline.grads`): one
    bucket's flat buffer at a time, never more than the gradients it reduces, on a stage whose
    gradients are reduced at all (`reduced`: it has replicas, or holds a parameter another stage
    also reads). An upper bound: a bucket of one parameter is reduced in place. Arrays (with
    `reduced` an array of booleans) or floats alike."""
    return np.minimum(grad_params, bucket_bytes) * reduced


def memory_terms(static: Any, work: Any, inputs: Any, outputs: Any, kept: Any, *,
                 in_flight: int, saved_inputs: int) -> tuple[Any, Any]:
    """(the stage's memory with nothing recomputed, the bytes one unit of recomputed fraction
    frees): memory(f) = full - f * per_fraction (`with_recompute`). `static` includes the
    gradient bucket (`bucket_memory`); inputs, outputs and kept are one microbatch's bytes."""
    base = static + in_flight * (inputs + outputs) + saved_inputs * inputs + work
    full = base + in_flight * kept
    return full, (in_flight - 1) * kept


def with_recompute(full: Any, per_fraction: Any, fraction: Any) -> Any:
    """The memory when `fraction` of the kept activations is recomputed."""
    return full - fraction * per_fraction


def stage_memory(static: Any, work: Any, inputs: Any, outputs: Any, kept: Any, *,
                 in_flight: int, saved_inputs: int, recompute: Any = 0.0) -> Any:
    """The stage's memory with `recompute` (a fraction in [0, 1]) of its kept activations
    recomputed."""
    full, per = memory_terms(static, work, inputs, outputs, kept, in_flight=in_flight,
                             saved_inputs=saved_inputs)
    return with_recompute(full, per, recompute)


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


__all__ = ["MB", "MemoryModel", "bucket_memory", "fraction_to_fit", "memory_terms",
           "rows_scaled", "rows_that_fit", "stage_memory", "static_memory", "with_recompute"]
