"""Host memory on a CPU rank (`rannc.hostmem`): glibc's threshold settings return freed tensor
memory at once ("release") or keep it for the next allocation without page faults ("reuse"),
and the per-rank overhead the memory model adds on CPU devices only."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

import rannc
from rannc import hostmem
from rannc.errors import ConfigError
from rannc.plans import StagePrediction
from rannc.stage_dp import memory

pytestmark = pytest.mark.layer("pure")

# Allocate 64 tensors of 1 MiB, free every other one (holes in glibc's heap), report how much
# of the freed 32 MiB left the resident set; then allocate and free a 48 MiB tensor 8 times
# (a step's activations, each page written) and report the minor page faults of the last 4
# (the heap settles in the first few).
# A fresh process: the setting is process-wide.
_HOLES = textwrap.dedent("""
    import resource, sys, torch
    from rannc import hostmem
    assert hostmem.apply(sys.argv[1], "cpu") == (None if sys.argv[1] == "keep" else sys.argv[1])
    warm = [torch.ones(2**18) for _ in range(8)]  # (glibc's threshold rises on the first free)
    del warm
    xs = [torch.ones(2**18) for _ in range(64)]  # 1 MiB each, every page touched
    before = hostmem.resident_bytes()
    del xs[::2]
    returned = (before - hostmem.resident_bytes()) / 2**20
    del xs
    faults = 0
    for i in range(8):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        y = torch.ones(12 * 2**20)
        del y
        faults += (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) if i >= 4 else 0
    print(returned, faults)
""")


def _freed(mode: str) -> tuple[float, int]:
    """(MiB of the freed holes returned to the system, page faults of 4 reallocations)."""
    out = subprocess.run([sys.executable, "-c", _HOLES, mode], capture_output=True, text=True,
                         check=True, timeout=120)
    returned, faults = out.stdout.split()[-2:]
    return float(returned), int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
def test_release_returns_freed_tensors_and_reuse_keeps_them_without_page_faults() -> None:
    """glibc's defaults keep the freed small blocks resident (holes in its heap) but map a
    48 MiB block afresh every time (a fault per 4 KiB page: 12,288 per allocation); "release"
    returns both; "reuse" keeps both, and the big block's pages come back without a fault."""
    returned, faults = _freed("release")
    assert returned >= 30 and faults >= 4 * 12_000
    returned, faults = _freed("keep")
    assert returned <= 4 and faults >= 4 * 12_000
    returned, faults = _freed("reuse")
    assert returned <= 4 and faults <= 4 * 100


def test_auto_releases_on_a_cpu_rank_whose_memory_is_tight_and_reuses_elsewhere(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """"auto" releases on a CPU where the forecast times the heap's retention exceeds the
    memory (the release costs step time), and reuses freed blocks on any other CPU rank (one
    process included); "release" and "reuse" always, "keep" never; a GPU's tensors are not
    the heap's."""
    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(hostmem, "_mode", None)

    def set_mode(mode: str, why: str) -> bool:
        calls.append((mode, why))
        return True

    monkeypatch.setattr(hostmem, "_set_mode", set_mode)
    tight, roomy = 0.7e9, 0.5e9  # forecasts of a 1 GB rank: 1.75x is over, and under
    hostmem.apply("auto", "cuda", tight, 1e9)
    hostmem.apply("keep", "cpu", tight, 1e9)
    assert calls == []
    hostmem.apply("auto", "cpu", roomy, 1e9)
    hostmem.apply("auto", "cpu", None, 1e9)  # one process: no forecast
    hostmem.apply("auto", "cpu", tight, 1e9)
    hostmem.apply("release", "cuda")
    hostmem.apply("reuse", "cuda")
    assert [m for m, _ in calls] == ["reuse", "reuse", "release", "release", "reuse"]
    assert "forecast 668 MiB" in calls[2][1] and "954 MiB" in calls[2][1]


def test_a_tighter_deployment_turns_reuse_into_release_never_back(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A process-wide allocator setting is not changed silently: one INFO line per setting,
    naming the reason and the way back ("keep"), however many deployments apply it; a
    deployment whose memory is tight turns an earlier one's "reuse" into "release", and no
    later one turns it back."""
    set_calls: list[tuple[int, int]] = []
    monkeypatch.setattr(hostmem, "_mode", None)
    monkeypatch.setattr(hostmem, "_mallopt", lambda mmap, trim: set_calls.append((mmap, trim)) or True)
    with caplog.at_level(logging.INFO, logger="rannc.hostmem"):
        assert hostmem.apply("auto", "cpu", 0.5e9, 1e9) == "reuse"
        assert hostmem.apply("auto", "cpu", None) == "reuse"
        assert hostmem.apply("auto", "cpu", 0.7e9, 1e9) == "release"
        assert hostmem.apply("release", "cpu") == "release"
        assert hostmem.apply("auto", "cpu", 0.5e9, 1e9) == "release"
        assert hostmem.apply("keep", "cpu") == "release"  # (stays set: process-wide)
    assert set_calls == [(hostmem.REUSE_THRESHOLD,) * 2, (hostmem.RELEASE_THRESHOLD,) * 2]
    reuse, release = [r.getMessage() for r in caplog.records if r.name == "rannc.hostmem"]
    assert "host_malloc 'auto'" in reuse and "host_malloc='keep'" in reuse and "1024 MiB" in reuse
    assert "forecast 668 MiB" in release and "host_malloc='keep'" in release


def test_a_c_library_that_refuses_leaves_the_setting_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostmem, "_mode", None)
    monkeypatch.setattr(hostmem, "_mallopt", lambda mmap, trim: False)
    assert hostmem.apply("auto", "cpu") is None and hostmem.apply("release", "cpu") is None


def test_deployment_applies_host_malloc_against_the_rank_s_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`RaNNCModule` passes the forecast of the rank's stages together (two under ZB-V) and the
    memory it may use (mem_limit_gb less mem_margin) to "auto"; one process (no plan) releases
    only when told to."""
    from rannc import deploy

    got: list[tuple[str, str, float | None, float]] = []
    monkeypatch.setattr(hostmem, "apply", lambda *a: got.append(a) or None)

    def stage(gb: float) -> SimpleNamespace:
        return SimpleNamespace(predicted=StagePrediction(forward_s=0.0, backward_s=0.0,
                                                         memory_bytes=gb * 1e9))

    cfg = rannc.Config(mem_limit_gb=1.0, mem_margin=0.1)
    deploy.host_malloc(cfg, torch.device("cpu"), [stage(0.6)])  # type: ignore[list-item]
    deploy.host_malloc(cfg, torch.device("cpu"), [stage(0.4), stage(0.2)])  # type: ignore[list-item]
    deploy.host_malloc(rannc.Config(host_malloc="release"), torch.device("cpu"), [])
    assert got[0] == ("auto", "cpu", 0.6e9, pytest.approx(0.9e9))
    assert got[1] == ("auto", "cpu", pytest.approx(0.6e9), pytest.approx(0.9e9))
    assert got[2][:3] == ("release", "cpu", None)


def test_the_rank_overhead_counts_on_cpu_devices_only() -> None:
    assert memory.rank_overhead(["local-cpu", "local-cpu"], 100) == \
        memory.RANK_BYTES + 100 * memory.TASK_BYTES
    assert memory.rank_overhead(["H100", "H100"], 100) == 0.0


def test_host_malloc_is_validated() -> None:
    assert rannc.Config(host_malloc="keep").host_malloc == "keep"
    with pytest.raises(ConfigError, match="host_malloc"):
        rannc.Config(host_malloc="never")
