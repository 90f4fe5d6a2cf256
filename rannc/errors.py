"""rannc's exception types. Every message names the problem, the values involved and the fix."""

from __future__ import annotations

import re


class RaNNCError(RuntimeError):
    """Base class of every error rannc raises on purpose."""


class CaptureError(RaNNCError):
    """The model could not be captured as a task graph (torch.export failed)."""

    def __init__(self, message: str, module_path: str | None = None) -> None:
        super().__init__(message)
        self.module_path = module_path


class InputMismatchError(RaNNCError):
    """A call's inputs do not match what the model was captured or planned with."""


class ConfigError(RaNNCError, ValueError):
    """An invalid configuration value."""


class InputDeviceError(InputMismatchError):
    """A call's tensor input is not on the device its rank computes on."""


class OutputTypeError(CaptureError):
    """The model returns something that is not a tensor, a number or a pytree of them."""


class PlanMismatchError(RaNNCError):
    """A loaded plan was made for another model, input shapes or number of ranks."""


class PlanInfeasibleError(RaNNCError):
    """No plan fits device memory; `needed_bytes` is the smallest per-device memory that would."""

    def __init__(self, message: str, needed_bytes: float) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes


class CallOrderError(RaNNCError):
    """Ranks entered different rannc collectives at the same time (one in forward, another in
    state_dict(), say): every rank must make the same collective calls in the same order."""


class CheckpointError(RaNNCError):
    """A checkpoint directory is missing, damaged, does not match the model, or was asked for
    in a way that cannot work (a save on some ranks only, a path that names no directory)."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint's model entries differ from the model's (strict loading)."""


class RankFailure(RaNNCError):
    """A collective failed or timed out because another rank failed, died or diverged."""


class ScheduleError(RaNNCError):
    """An invalid schedule (a missing or misplaced action, or a deadlock)."""


class TraceError(RaNNCError):
    """A trace could not be written, read or drawn."""


_UNKNOWN_OUTPUT = re.compile(r"Found <class '([^']+)'> in output, which is not a known type")


def output_type_error(model_name: str, error: BaseException) -> OutputTypeError | None:
    """torch.export's complaint about an output type it cannot flatten, said in rannc's
    terms (None when `error` is something else)."""
    found = _UNKNOWN_OUTPUT.search(str(error))
    if found is None:
        return None
    kind = found.group(1)
    if "Cache" in kind:  # a Hugging Face model returning its key/value cache
        return OutputTypeError(
            f"{model_name}.forward returns (in its output) a {kind}, a key/value cache for "
            "generation, which is not a tensor, a number or a pytree of them. Fix: call it "
            "with use_cache=False, or without use_cache (rannc then passes use_cache=False "
            "where model.config.use_cache, or its language model's, asks for a cache). A "
            "cache the model was given (past_key_values: PEFT's prefix tuning passes its "
            "prefix as one) comes back whatever use_cache says: such a model is not supported "
            "(for PEFT, prompt tuning or LoRA train under rannc).")
    return OutputTypeError(
        f"{model_name}.forward returns (in its output) a {kind}, which is not a tensor, a number or a pytree "
        "(tuple, list, dict, dataclass registered with torch.utils._pytree, Hugging Face "
        "ModelOutput) of them; rannc must split and combine every output by rows. Fix: return "
        "the tensors in a tuple or dict, or register the class as a pytree node with "
        f"torch.utils._pytree.register_pytree_node({kind.rsplit('.', 1)[-1]}, ...).")
