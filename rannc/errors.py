"""rannc's exception types. Every message names the problem, the values involved and the fix."""

from __future__ import annotations


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
