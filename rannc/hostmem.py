"""Host memory of a rank that trains on the CPU: glibc's allocator, and the memory a rank needs
beyond its tensors.

On a CPU the device memory the planner budgets is the process's resident memory, and glibc's
malloc decides how freed tensor memory comes back. Its defaults are a compromise that suits a
training step badly both ways: the mmap threshold starts at 128 KiB and rises to the size of
every mapped block freed (up to 32 MiB), and the top of the heap is returned to the system
whenever more than twice that is free there. So freed activation blocks partly stay resident
(the resident peak was 1.27x to 1.57x the peak of live tensors, which is what the memory model
forecasts: `benchmarks/memory_forecast.py`, BERT and GPT-2, 1 to 4 stages), and partly go back
to the system and come again as fresh zero-filled pages, one minor page fault per 4 KiB: 12,000
faults and 30 ms of kernel time per step on the last stage of a 2-rank ResNet, a third of its
step time (`benchmarks/runtime_peers.py`, BENCHMARKS.md). `Config.host_malloc` picks one side:

- "reuse" raises both thresholds to `REUSE_THRESHOLD` (`mallopt`), which also turns their rise
  off: freed blocks stay in the heap and the next microbatch's and the next step's tensors
  reuse them, without page faults. The resident memory stays at its peak.
- "release" fixes the mmap threshold at `RELEASE_THRESHOLD` (128 KiB) and the trim threshold
  with it: every block from 128 KiB up is its own mapping, unmapped when freed, and the resident
  peak follows the live tensors. The price is a fresh, zero-filled page for every such
  allocation: measured, 1.8x the step time of BERT on 2 CPU ranks of a loaded 2-core host.
- "auto" releases only where a rank's forecast times the heap's retention (`KEEP_RETENTION`)
  would exceed the memory it may use, and reuses elsewhere. "keep" leaves glibc's defaults.

The setting is process-wide and stays set (a later deployment of the same process may tighten
"reuse" to "release", never the other way); a CUDA device, whose tensors the caching allocator
holds, and a C library other than glibc are left alone.

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

M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
RELEASE_THRESHOLD = 128 * 1024  # bytes: blocks from this size up are mapped on their own
REUSE_THRESHOLD = 1 << 30  # bytes: blocks below this come from the heap, which keeps them
_mode: str | None = None  # the setting this process runs under ("release", "reuse"), once set


def _mallopt(mmap: int, trim: int) -> bool:
    """`mallopt` of both thresholds; False where the C library is not glibc or refuses."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, mmap) == 1 and libc.mallopt(M_TRIM_THRESHOLD, trim) == 1)
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False


def _set_mode(mode: str, why: str) -> bool:
    """Put glibc's thresholds in `mode` for this process (logged once at INFO with `why`: it
    changes an allocator setting of the whole process, the user's own code's included).
    Whether the process runs under `mode` after the call: "release" outranks "reuse" (a
    deployment whose memory is tight asked for it), and a refusing C library sets nothing."""
    global _mode
    if _mode == mode:
        return True
    if _mode == "release":
        return False
    threshold = RELEASE_THRESHOLD if mode == "release" else REUSE_THRESHOLD
    if not _mallopt(threshold, threshold):
        return False
    _mode = mode
    if mode == "release":
        log.info("rannc: glibc's mmap threshold fixed at %d KiB for this process (%s): freed "
                 "blocks of that size and more return to the system at once, so resident memory "
                 "follows the tensors; steps may be slower (set host_malloc='keep' to leave "
                 "glibc's defaults)", RELEASE_THRESHOLD // 1024, why)
    else:
        log.info("rannc: glibc's mmap and trim thresholds raised to %d MiB for this process "
                 "(%s): freed tensor memory stays in the heap for the next microbatch and step, "
                 "without a page fault per 4 KiB; resident memory stays at its peak (set "
                 "host_malloc='keep' to leave glibc's defaults)", REUSE_THRESHOLD >> 20, why)
    return True


def release_freed_memory(why: str = "host_malloc 'release'") -> bool:
    """Fix glibc's mmap and trim thresholds at `RELEASE_THRESHOLD` (see `_set_mode`); False
    where the C library is not glibc or refuses."""
    return _set_mode("release", why)


def reuse_freed_memory(why: str = "host_malloc 'reuse'") -> bool:
    """Raise glibc's mmap and trim thresholds to `REUSE_THRESHOLD` (see `_set_mode`); False
    where the C library is not glibc, refuses, or the process already releases."""
    return _set_mode("reuse", why)


# The resident peak over the peak of live tensors under glibc's defaults: up to 1.57x on the
# ranks of benchmarks/memory_forecast.py (BERT and GPT-2, 1 to 4 stages); with some room.
KEEP_RETENTION = 1.75


def needs_release(forecast: float | None, memory: float) -> bool:
    """Whether a CPU rank whose stage is forecast `forecast` bytes could outgrow `memory` bytes
    when the heap keeps freed blocks (None: no forecast, as in one process, which plans
    nothing)."""
    return forecast is not None and forecast * KEEP_RETENTION > memory


def apply(choice: str, device_type: str, forecast: float | None = None,
          memory: float = float("inf")) -> str | None:
    """Apply `Config.host_malloc` for a rank training on `device_type`, whose stage the plan
    forecasts `forecast` bytes of `memory`; the setting the process runs under afterwards
    ("release", "reuse"), or None where it keeps glibc's defaults. "auto" releases on a CPU
    only where the memory is tight enough for the heap's retention to matter
    (`needs_release`), and reuses elsewhere; a CUDA rank's tensors are not the heap's."""
    if choice == "release":
        release_freed_memory()
    elif choice == "reuse":
        reuse_freed_memory()
    elif choice == "auto" and device_type == "cpu":
        if needs_release(forecast, memory):
            assert forecast is not None
            release_freed_memory(
                f"host_malloc 'auto': this rank's stage is forecast {forecast / 2**20:.0f} MiB, "
                f"and {KEEP_RETENTION}x that, the heap's retention, exceeds the "
                f"{memory / 2**20:.0f} MiB it may use")
        else:
            reuse_freed_memory("host_malloc 'auto': a CPU rank")
    return _mode


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


__all__ = ["KEEP_RETENTION", "RELEASE_THRESHOLD", "REUSE_THRESHOLD", "apply", "is_host",
           "needs_release", "release_freed_memory", "resident_bytes", "reuse_freed_memory"]
