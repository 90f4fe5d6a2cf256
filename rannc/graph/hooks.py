"""Hooks a capture cannot keep, said before they would silently not run.

rannc runs the graph torch.export recorded, not the modules, so a hook runs only where the
trace ran it: once, at capture, on fake tensors. The hooks are part of a capture's key
(`ModelState.hooks`), so one added or removed after a capture gets a capture of its own, and
the checks below run again for it.

- Module forward hooks and pre-hooks: what they compute from a module's input or output
  (weight norm's recomputed weight, an output rescaled) is recorded in the graph and stays
  exact; what they do beside it (storing an activation, logging) happens once, at capture, with
  fake tensors, and never for a real call. Warned once, naming the modules.
- Module backward hooks (`register_full_backward_hook`, `register_full_backward_pre_hook`,
  the global ones, `register_backward_hook`): they attach to the autograd nodes of a call,
  which a captured graph never makes: they would never run, and a hook that changes the
  gradient would be ignored. Refused with a `CaptureError` naming the modules.
- A tensor hook registered inside `forward` (`h.register_hook(fn)`): it is registered on the
  trace's fake tensor, so a gradient it rescales would silently not be. Refused by name,
  at the line that registers it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _module

from rannc.errors import CaptureError
from rannc.graph.model_state import RANNC_OWN_HOOK

TORCH_DIR = os.path.dirname(torch.__file__) + os.sep  # (code under it is torch's own)


def _named(model: nn.Module, attrs: tuple[str, ...]) -> list[str]:
    """The modules holding a hook in one of the tables `attrs`, other than rannc's own (its
    guard against direct calls of a deployed model, `checkpoint.refuse_direct_calls`: before,
    every capture after deployment, an eval call's, warned of a hook on the model itself)."""
    return [name or "(the model itself)" for name, m in model.named_modules()
            if any(not getattr(h, RANNC_OWN_HOOK, False) and not _inputs_require_grads(h)
                   and not _output_recorder(h) for a in attrs for h in (getattr(m, a, None) or {}).values())]


def _inputs_require_grads(hook: Any) -> bool:
    """Hugging Face's `make_inputs_require_grads` (`enable_input_require_grads()`, which
    `gradient_checkpointing_enable()` calls): it marks the embeddings' output as requiring
    grad, so that reentrant checkpointing of frozen layers passes gradients on. It computes
    nothing; rannc refuses reentrant checkpointing and differentiates its own graph, so it is
    nothing to warn about (every capture of a model with gradient checkpointing warned)."""
    return getattr(hook, "__name__", "") in ("make_inputs_require_grads", "make_inputs_require_grad") and \
        str(getattr(hook, "__module__", "")).startswith(("transformers.", "peft."))


def _output_recorder(hook: Any) -> bool:
    """Hugging Face's output-capturing hooks (`transformers.utils.output_capturing`), which it
    installs on a model's layers the first time a call asks for hidden states or attentions
    (Segformer's segmentation head asks in every call). Each appends its module's output to the
    collector of the call in progress, and forward returns what was collected: in a capture,
    the trace's values, so those outputs are the graph's and exact; outside such a call the
    hook does nothing. Every capture after the first call warned of them."""
    return getattr(hook, "__name__", "") == "output_capturing_hook" and \
        str(getattr(hook, "__module__", "")).startswith("transformers.")


def check_module_hooks(model: nn.Module) -> None:
    """Refuse backward hooks, warn about forward hooks (see the module doc)."""
    backward = _named(model, ("_backward_hooks", "_backward_pre_hooks"))
    if _module._global_backward_hooks or _module._global_backward_pre_hooks:
        backward.append("every module (a global hook: register_module_full_backward_hook)")
    if backward:
        raise CaptureError(
            f"rannc could not capture the model: backward hooks on {_listed(backward)} would "
            "never run (rannc runs the captured graph, not the modules, so no call makes the "
            "autograd nodes they attach to), and a hook that changes gradients would be "
            "ignored. Fix: remove them, and read what they read from each parameter's .grad "
            "after backward")
    forward = _named(model, ("_forward_hooks", "_forward_pre_hooks"))
    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        forward.append("every module (a global hook: register_module_forward_hook)")
    if forward:
        warnings.warn(
            f"rannc: forward hooks or pre-hooks on {_listed(forward)} ran once, while capturing "
            "the model, with fake tensors. What they compute into a module's input or output is "
            "part of the captured graph and runs exactly; anything else they do (storing an "
            "activation, logging, counting calls) does not happen for real calls. Compute such "
            "values in forward and return them, or read them from the model's outputs.",
            stacklevel=3)


def _listed(names: list[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


@contextlib.contextmanager
def reentrant_checkpoint_refused() -> Iterator[None]:
    """While capturing: `torch.utils.checkpoint.checkpoint(..., use_reentrant=True)` raises a
    CaptureError naming the fix. Why: torch.export traces through its autograd Function's
    forward, which runs without gradients, and records the rest of forward without them too:
    the captured graph computed no gradients for the checkpointed layers (and none at all
    where nothing else needed them)."""
    from torch.utils import checkpoint as ckpt

    def apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
        raise CaptureError(
            "rannc could not capture the model: it calls torch.utils.checkpoint.checkpoint("
            "..., use_reentrant=True) in forward, whose recomputation torch.export cannot "
            "trace (the captured graph would compute no gradients for the checkpointed "
            "layers). Fix: use_reentrant=False (torch's recommended form; Hugging Face: "
            "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"
            "'use_reentrant': False})), or leave recomputation to rannc (checkpointing='on')")

    with replaced_attribute(ckpt.CheckpointFunction, "apply", classmethod(apply)):
        yield


@contextlib.contextmanager
def replaced_attribute(owner: Any, name: str, value: Any) -> Iterator[None]:
    """While the block runs, `owner.name` (an instance's or a class's own attribute) is
    `value`; then what `owner` itself held again, or nothing where it held none (the
    attribute inherited, as a model's `forward` from its class or CheckpointFunction's `apply`
    from autograd's Function)."""
    own = owner.__dict__.get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if own is None:
            delattr(owner, name)
        else:
            setattr(owner, name, own)


@contextlib.contextmanager
def tensor_hooks_refused() -> Iterator[None]:
    """While capturing: `Tensor.register_hook` called from the model's code (not torch's own)
    raises a CaptureError naming the file and line."""
    real = torch.Tensor.register_hook

    def register_hook(self: torch.Tensor, hook: Any) -> Any:
        caller = sys._getframe(1)
        path = caller.f_code.co_filename
        if not path.startswith(TORCH_DIR):
            raise CaptureError(
                f"rannc could not capture the model: a gradient hook is registered inside "
                f"forward ({caller.f_code.co_qualname} at {path}:{caller.f_lineno}): it would "
                "be registered on the capture's fake tensor only and never run, so the "
                "gradient it changes or reads would silently not be. Fix: write the gradient "
                "change as a torch.autograd.Function (rannc runs its backward), or register "
                "the hook on the model's outputs after the call")
        return real(self, hook)

    torch.Tensor.register_hook = register_hook  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.register_hook = real  # type: ignore[method-assign]
