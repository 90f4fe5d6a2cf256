"""rannc: automatic hybrid (pipeline + data) parallelism for unmodified PyTorch models.

    model = rannc.RaNNCModule(model, optimizer)

The public names are listed in `__all__`; everything else is internal and may change.
"""

from rannc.config import Config
from rannc.dist import barrier, get_rank, get_world_size
from rannc.errors import CaptureError, ConfigError, InputMismatchError, RaNNCError
from rannc.module import RaNNCModule

__all__ = [
    "CaptureError",
    "Config",
    "ConfigError",
    "InputMismatchError",
    "RaNNCError",
    "RaNNCModule",
    "barrier",
    "get_rank",
    "get_world_size",
]
__version__ = "0.1.0"
