"""Host memory on a CPU rank (`rannc.hostmem`): glibc's threshold setting returns freed tensor
memory at once, and the per-rank overhead the memory model adds on CPU devices only."""

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
# of the freed 32 MiB left the resident set. A fresh process: the setting is process-wide.
_HOLES = textwrap.dedent("""
    import sys, torch
    from rannc import hostmem
    if sys.argv[1] == "release":
        assert hostmem.release_freed_memory()
    warm = [torch.ones(2**18) for _ in range(8)]  # (glibc's threshold rises on the first free)
    del warm
    xs = [torch.ones(2**18) for _ in range(64)]  # 1 MiB each, every page touched
    before = hostmem.resident_bytes()
    del xs[::2]
    print((before - hostmem.resident_bytes()) / 2**20)
""")


def _returned_mib(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", _HOLES, mode], capture_output=True, text=True,
                         check=True, timeout=120)
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
def test_release_returns_freed_tensors_to_the_system() -> None:
    """glibc's defaults keep the freed blocks resident (holes in its heap); with the threshold
    fixed every block is its own mapping and leaves with its tensor."""
    assert _returned_mib("release") >= 30
    assert _returned_mib("keep") <= 4


def test_auto_releases_on_a_cpu_rank_whose_memory_is_tight(monkeypatch: pytest.MonkeyPatch) -> None:
    """"auto" releases on a CPU where the forecast times glibc's retention exceeds the memory
    (the release costs step time); "release" always, "keep" never."""
    calls: list[str] = []
    monkeypatch.setattr(hostmem, "release_freed_memory",
                        lambda why="": calls.append(why) or True)
    tight, roomy = 0.7e9, 0.5e9  # forecasts of a 1 GB rank: 1.75x is over, and under
    assert not hostmem.apply("auto", "cuda", tight, 1e9)
    assert not hostmem.apply("keep", "cpu", tight, 1e9)
    assert not hostmem.apply("auto", "cpu", roomy, 1e9)
    assert not hostmem.apply("auto", "cpu", None, 1e9)  # one process: no forecast
    assert calls == []
    assert hostmem.apply("auto", "cpu", tight, 1e9) and hostmem.apply("release", "cuda")
    assert len(calls) == 2 and "forecast 668 MiB" in calls[0] and "954 MiB" in calls[0]


def test_the_release_is_logged_once_with_its_reason(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A process-wide allocator setting is not changed silently: one INFO line naming the
    reason and the way back ("keep"), however many deployments apply it."""
    set_calls: list[int] = []
    monkeypatch.setattr(hostmem, "_set", False)
    monkeypatch.setattr(hostmem, "_mallopt_threshold", lambda: set_calls.append(1) or True)
    with caplog.at_level(logging.INFO, logger="rannc.hostmem"):
        assert hostmem.apply("auto", "cpu", 0.7e9, 1e9)
        assert hostmem.apply("auto", "cpu", 0.7e9, 1e9)
        assert hostmem.apply("release", "cpu")
    assert set_calls == [1]
    (rec,) = [r for r in caplog.records if r.name == "rannc.hostmem"]
    assert "host_malloc 'auto'" in rec.getMessage() and "host_malloc='keep'" in rec.getMessage()


def test_deployment_applies_host_malloc_against_the_rank_s_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`RaNNCModule` passes the forecast of the rank's stages together (two under ZB-V) and the
    memory it may use (mem_limit_gb less mem_margin) to "auto"; one process (no plan) releases
    only when told to."""
    from rannc import deploy

    got: list[tuple[str, str, float | None, float]] = []
    monkeypatch.setattr(hostmem, "apply", lambda *a: got.append(a) or False)

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
