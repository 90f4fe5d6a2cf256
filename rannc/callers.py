"""Who called rannc: the few places where the right behaviour depends on which library's code
is on the stack (Accelerate preparing the module, Hugging Face Trainer's rank-0 save,
safetensors' loader, torch.compile around the module). Each is a test of one caller frame over
one walk of the stack (`frames`), so none keeps its own loop.
"""

from __future__ import annotations

import itertools
import os
import sys
import traceback
from collections.abc import Iterator
from types import FrameType
from typing import Any

_ACCELERATE_DIR = f"{os.sep}accelerate{os.sep}"


def frames(first: FrameType | None, limit: int | None = None) -> Iterator[FrameType]:
    """`first` and the frames that called it, outwards: at most `limit` of them."""
    return itertools.islice((f for f, _ in traceback.walk_stack(first)), limit)


def called_from_accelerate() -> bool:
    """Whether the caller was called from Accelerate's code, directly or through up to two
    frames between (a property setter runs under nn.Module.__setattr__)."""
    return any(_ACCELERATE_DIR in f.f_code.co_filename for f in frames(sys._getframe(2), 3))


def in_plain_hf_trainer_save() -> bool:
    """Whether the caller is Hugging Face Trainer's rank-0 save (not rannc.hf.RaNNCTrainer's)."""
    for f in frames(sys._getframe(2)):
        me = f.f_locals.get("self")
        if (f.f_code.co_name == "_save" and "transformers" in f.f_code.co_filename
                and me is not None and not getattr(me, "_rannc_trainer", False)):
            return True
    return False


def in_safetensors_load() -> bool:
    """Whether the caller is safetensors' `load_model` (every rank runs it: Accelerate's
    `load_state` of a safetensors checkpoint)."""
    return any(f.f_code.co_name == "load_model" and "safetensors" in f.f_code.co_filename
               for f in frames(sys._getframe(2)))


def called_through_compile(module: Any) -> bool:
    """Whether the caller is `module` called through `torch.compile(module)`: its OptimizedModule
    is a few frames up (OptimizedModule.__call__ .. _call_impl .. forward .. the caller: ~8)."""
    from torch._dynamo.eval_frame import OptimizedModule

    for f in frames(sys._getframe(2), 12):
        me = f.f_locals.get("self")
        if isinstance(me, OptimizedModule) and me._orig_mod is module:
            return True
    return False


__all__ = ["called_from_accelerate", "called_through_compile", "frames", "in_plain_hf_trainer_save",
           "in_safetensors_load"]
