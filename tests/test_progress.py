"""Progress bars for the first call's slow phases: on rank 0, at a terminal, or when asked."""

from __future__ import annotations

import io
import sys

import pytest
import torch
from torch import nn

import rannc
from rannc.progress import NO_PROGRESS, progress_for

pytestmark = pytest.mark.layer("pure")

# The estimate oracle's profiling is array arithmetic and shows no bar (test_measure checks
# the measuring oracle's).
PHASES = ("rannc: capture", "rannc: atomic components", "rannc: coarsening into blocks",
          "rannc: stage DP search", "rannc: refining stage boundaries")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _model() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), (torch.randn(8, 8),)


def _plan(**options: object) -> None:
    model, args = _model()
    rannc.plan(model, args, config=rannc.Config(**options),  # type: ignore[arg-type]
               cluster=rannc.Cluster.homogeneous("V100-32GB", n=2, per_node=2))


def test_progress_for_shows_bars_on_rank_0_at_a_terminal_or_when_on() -> None:
    tty, pipe = _Terminal(), io.StringIO()
    assert progress_for("auto", 0, tty).enabled
    assert progress_for("auto", 0, pipe) is NO_PROGRESS  # a log file or CI output
    assert progress_for("on", 0, pipe).enabled and progress_for(True, 0, pipe).enabled
    assert progress_for("off", 0, tty) is NO_PROGRESS and progress_for(False, 0, tty) is NO_PROGRESS
    assert progress_for("on", 1, tty) is NO_PROGRESS  # every rank plans its part, one draws


def test_planning_phases_appear_on_stderr_when_on(capsys: pytest.CaptureFixture[str]) -> None:
    _plan(progress=True)
    err = capsys.readouterr().err
    for phase in PHASES:
        assert phase in err, (phase, err)
    assert "100%" in err  # counted phases run to their end


def test_a_terminal_gets_the_bars_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    tty = _Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    _plan()
    assert all(phase in tty.getvalue() for phase in PHASES), tty.getvalue()


def test_nothing_is_drawn_when_stderr_is_not_a_terminal(capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    _plan()  # pytest's captured stderr is not a terminal
    assert "rannc:" not in capsys.readouterr().err
    monkeypatch.setattr(sys, "stderr", _Terminal())
    _plan(progress="off")
    assert sys.stderr.getvalue() == ""  # type: ignore[attr-defined]


@pytest.mark.layer("single_process")
def test_the_first_call_shows_capture(capsys: pytest.CaptureFixture[str]) -> None:
    model, args = _model()
    wrapped = rannc.RaNNCModule(model, progress=True)
    wrapped(*args)
    err = capsys.readouterr().err
    assert "rannc: capture" in err and "rannc: atomic components" in err


def test_the_switch_reads_booleans_and_the_environment() -> None:
    assert rannc.Config().progress == "auto"
    assert rannc.Config(progress=True).progress == "on"
    assert rannc.Config(progress=False).progress == "off"
    assert rannc.Config.resolve(environ={"RANNC_PROGRESS": "1"}).progress == "on"
    assert rannc.Config.resolve(environ={"RANNC_PROGRESS": "off"}).progress == "off"
    with pytest.raises(rannc.errors.ConfigError, match="progress must be one of 'auto', 'on', 'off'"):
        rannc.Config(progress="sometimes")
    with pytest.raises(rannc.errors.ConfigError, match="RANNC_PROGRESS"):
        rannc.Config.resolve(environ={"RANNC_PROGRESS": "2"})
