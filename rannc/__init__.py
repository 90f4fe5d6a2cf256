"""rannc: automatic hybrid (pipeline + data) parallelism for unmodified PyTorch models.

    model = rannc.RaNNCModule(model, optimizer)

The public names are listed in `__all__`; everything else is internal and may change.
"""

from rannc.checkpoint import latest_checkpoint
from rannc.config import Config
from rannc.dist import barrier, get_rank, get_world_size, init
from rannc.errors import (
    CaptureError,
    ConfigError,
    InputDeviceError,
    InputMismatchError,
    OutputTypeError,
    PlanMismatchError,
    RaNNCError,
)
from rannc.module import RaNNCModule
from rannc.planner import PlanInfeasibleError, plan
from rannc.plans import Plan, StagePlan, StagePrediction
from rannc.profile.device import KNOWN_DEVICES, Cluster, DeviceSpec

__all__ = [
    "KNOWN_DEVICES",
    "CaptureError",
    "Cluster",
    "Config",
    "ConfigError",
    "DeviceSpec",
    "InputDeviceError",
    "InputMismatchError",
    "OutputTypeError",
    "Plan",
    "PlanInfeasibleError",
    "PlanMismatchError",
    "RaNNCError",
    "RaNNCModule",
    "StagePlan",
    "StagePrediction",
    "barrier",
    "get_rank",
    "get_world_size",
    "init",
    "latest_checkpoint",
    "plan",
]
__version__ = "0.1.0"
