"""Process identity: rank and world size under mpirun, torchrun or plain python.

The multi-process bootstrap (mpi4py rendezvous, process groups) builds on these;
before a process group exists they read the launcher's environment.
"""

from __future__ import annotations

import os

import torch.distributed as dist

# Launchers and the variables they set for the rank and the world size.
_RANK_VARS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
_SIZE_VARS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")


def _from_env(names: tuple[str, ...], default: int) -> int:
    for n in names:
        if n in os.environ:
            return int(os.environ[n])
    return default


def get_rank() -> int:
    """This process's rank (0 in a plain `python` run)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return _from_env(_RANK_VARS, 0)


def get_world_size() -> int:
    """The number of ranks (1 in a plain `python` run)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return _from_env(_SIZE_VARS, 1)


def barrier() -> None:
    """Wait for every rank (a no-op with one process)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
