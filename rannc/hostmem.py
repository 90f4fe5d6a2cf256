"""Host memory of a rank that trains on the CPU: glibc's allocator, and the memory a rank needs
beyond its tensors.

On a CPU the device memory the planner budgets is the process's resident memory, and glibc's
malloc keeps freed blocks resident: its mmap threshold starts at 128 KiB and rises to the size
of every mapped block freed (up to 32 MiB), so after the first step activations come from the
heap, and the heap's freed holes stay resident. Measured with `benchmarks/memory_forecast.py`
(BERT and GPT-2, 1 to 4 stages): the resident peak was 1.27x to 1.57x the peak of live tensors,
which is what the memory model forecasts. `Config.host_malloc="release"` fixes the threshold at
128 KiB (`mallopt(M_MMAP_THRESHOLD)`), which also turns the rise off: every block from 128 KiB up
is its own mapping, unmapped when freed, and the resident peak follows the live tensors. The
price is a fresh, zero-filled page for every such allocation: measured, 2 s more kernel time
per 12 microbatches of a 4-layer BERT in one process, and 1.8x the step time of BERT on 2 CPU
ranks of a loaded 2-core host (BENCHMARKS.md). So "auto" releases only where a rank's forecast
times glibc's retention (`KEEP_RETENTION`) would exceed the memory it may use; elsewhere the
resident peak may exceed the forecast but not the memory. It is process-wide and stays set; a
CUDA device, whose tensors the caching allocator holds, and a C library other than glibc are
left alone.

What a rank holds besides tensors on a CPU is a per-rank `overhead` in the memory model
(`rannc.stage_dp.memory.rank_overhead`, `MemoryModel.overhead`): the captured graph, which every
rank holds whole (counted per task), and what the first training step leaves resident in any
PyTorch process (the math libraries' buffers, the small-block heap; a constant). Both were
measured on this project's CPU host, not at start-up: the resident growth of `capture` is 20 to
23 KiB per task (BERT and GPT-2 of 2 and 8 layers), and resident memory after `malloc_trim`
exceeds the live tensors by 16 to 22 MiB on every rank of `benchmarks/memory_forecast.py`
(BERT and GPT-2, 1 to 4 stages; 11 to 16 MiB of it besides the graph). On a GPU this memory is
the host's, not the device's, and the overhead is 0.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
RELEASE_THRESHOLD = 128 * 1024  # bytes: blocks from this size up are mapped on their own
_set = False


def _mallopt_threshold() -> bool:
    """`mallopt(M_MMAP_THRESHOLD, RELEASE_THRESHOLD)`; False where the C library is not glibc
    or refuses."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, RELEASE_THRESHOLD) == 1)
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False


def release_freed_memory(why: str = "host_malloc 'release'") -> bool:
    """Fix glibc's mmap threshold at `RELEASE_THRESHOLD` (once per process, logged once at
    INFO with `why`: it changes an allocator setting of the whole process, the user's own
    code's included); False where the C library is not glibc or refuses."""
    global _set
    if _set:
        return True
    _set = _mallopt_threshold()
    if _set:
        log.info("rannc: glibc's mmap threshold fixed at %d KiB for this process (%s): freed "
                 "blocks of that size and more return to the system at once, so resident memory "
                 "follows the tensors; steps may be slower (set host_malloc='keep' to leave "
                 "glibc's defaults)", RELEASE_THRESHOLD // 1024, why)
    return _set


# The resident peak over the peak of live tensors under glibc's defaults: up to 1.57x on the
# ranks of benchmarks/memory_forecast.py (BERT and GPT-2, 1 to 4 stages); with some room.
KEEP_RETENTION = 1.75


def needs_release(forecast: float | None, memory: float) -> bool:
    """Whether a CPU rank whose stage is forecast `forecast` bytes could outgrow `memory` bytes
    under glibc's defaults (None: no forecast, as in one process, which plans nothing)."""
    return forecast is not None and forecast * KEEP_RETENTION > memory


def apply(choice: str, device_type: str, forecast: float | None = None,
          memory: float = float("inf")) -> bool:
    """Apply `Config.host_malloc` for a rank training on `device_type`, whose stage the plan
    forecasts `forecast` bytes of `memory`; whether it released. "auto" releases on a CPU only
    where the memory is tight enough for glibc's retention to matter (`needs_release`): the
    release costs step time (BENCHMARKS.md)."""
    if choice == "release":
        return release_freed_memory()
    if choice == "auto" and device_type == "cpu" and forecast is not None \
            and needs_release(forecast, memory):
        return release_freed_memory(
            f"host_malloc 'auto': this rank's stage is forecast {forecast / 2**20:.0f} MiB, and "
            f"{KEEP_RETENTION}x that, glibc's retention, exceeds the {memory / 2**20:.0f} MiB "
            "it may use")
    return False


def is_host(device_name: str) -> bool:
    """Whether a `DeviceSpec` name is a CPU's (`measure_local_device` names it "local-cpu")."""
    return device_name.endswith("cpu")


def resident_bytes() -> int:
    """This process's resident set (Linux; 0 elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


__all__ = ["KEEP_RETENTION", "RELEASE_THRESHOLD", "apply", "is_host", "needs_release",
           "release_freed_memory", "resident_bytes"]
