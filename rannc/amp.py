"""Accelerate's mixed precision for a RaNNCModule that Accelerate prepared.

`accelerator.prepare(model)` wraps a model's forward in `torch.autocast` (its
`mixed_precision`, "bf16" or "fp16") and casts the outputs back to float32. A RaNNCModule
declares itself prepared (`RaNNCModule._is_accelerate_prepared`: Accelerate must not put DDP
around it), which skipped that wrap too: Hugging Face's Trainer with `bf16=True`, or
`Accelerator(mixed_precision="bf16")`, trained it in float32, silently. So the wrapper notes
when Accelerate's own code reads or sets that flag (`prepare`, `prepare_model`, Trainer's
evaluation) and, at each call after, runs the call as Accelerate runs a prepared model's
forward, from Accelerate's process-wide state: under `torch.autocast(device, dtype)` unless
the caller already enabled autocast there (`accelerator.autocast()`, the user's own), with
floating outputs cast to float32 (`accelerate.utils.convert_to_fp32`). Accelerate's
`AutocastKwargs` handler lives on the Accelerator, which the module never sees: its defaults
apply.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def prepared_autocast() -> tuple[str, torch.dtype] | None:
    """(device type, dtype) of the autocast Accelerate would run a prepared model's forward
    under now, or None: no Accelerator with mixed precision in this process, or autocast is
    already on for that device."""
    state = sys.modules.get("accelerate.state")
    if state is None:
        return None
    shared = state.AcceleratorState._shared_state
    dtype = _DTYPES.get(str(shared.get("_mixed_precision"))) if shared else None
    if dtype is None:
        return None
    device = state.AcceleratorState().device.type
    if torch.is_autocast_enabled(device):
        return None
    return device, dtype


def outputs_to_fp32(out: Any) -> Any:
    """The outputs with their half-precision floating tensors cast to float32, as Accelerate's
    prepared forward returns them."""
    from accelerate.utils import convert_to_fp32

    return convert_to_fp32(out)


__all__ = ["outputs_to_fp32", "prepared_autocast"]
