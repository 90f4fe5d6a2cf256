"""Timeline rendering: Chrome trace round trip and fields, PNG charts of measured and predicted
timelines."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rannc.errors import RaNNCError
from rannc.schedule import (
    Event,
    StageCosts,
    Timeline,
    TraceError,
    chain,
    chrome_trace,
    load_chrome_trace,
    make_schedule,
    simulate,
    timeline_png,
)

pytestmark = pytest.mark.layer("pure")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CATEGORIES = {"forward", "backward", "recompute", "send", "recv"}


@pytest.fixture
def timeline() -> Timeline:
    return simulate(make_schedule("1f1b", 4, chain(3), [False] * 3), StageCosts.uniform(3))


def measured_of(tl: Timeline, offset: float = 0.0) -> dict[int, list[Event]]:
    # Ranks 10.. run stages 0..: keys need not be stage numbers, and a clock need not start at 0.
    return {10 + s: [Event(e.action, e.start + offset, e.end + offset) for e in evs]
            for s, evs in enumerate(tl.events)}


def test_chrome_trace_round_trip(tmp_path: Path, timeline: Timeline) -> None:
    events = measured_of(timeline, offset=1234.5)
    path = tmp_path / "trace.json"
    chrome_trace(events, path)
    back = load_chrome_trace(path)
    assert sorted(back) == sorted(events)
    for rank, evs in events.items():
        assert [e.action for e in back[rank]] == [e.action for e in evs]
        for got, want in zip(back[rank], evs, strict=True):
            assert got.start == pytest.approx(want.start, abs=1e-9)
            assert got.end == pytest.approx(want.end, abs=1e-9)


def test_chrome_trace_fields(tmp_path: Path, timeline: Timeline) -> None:
    path = tmp_path / "trace.json"
    chrome_trace(measured_of(timeline), path, names={11: "rank 11 (the middle)"})
    data = json.loads(path.read_text())
    assert data["displayTimeUnit"] == "ms"
    complete = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == sum(len(evs) for evs in timeline.events)
    for e in complete:
        assert set(e) >= {"name", "cat", "ts", "dur", "pid", "tid"}
        assert e["cat"] in CATEGORIES and e["tid"] == 0 and e["dur"] >= 0
    first = next(e for e in complete if e["name"] == "F1.0")
    f10 = next(e for e in timeline.events[1] if str(e.action) == "F1.0")
    assert (first["pid"], first["cat"]) == (11, "forward")
    assert first["ts"] == pytest.approx(f10.start * 1e6)
    assert first["dur"] == pytest.approx((f10.end - f10.start) * 1e6)
    assert {e["cat"] for e in complete} == CATEGORIES - {"recompute"}
    names = {e["pid"]: e["args"]["name"] for e in data["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {10: "rank 10 (stage 0)", 11: "rank 11 (the middle)", 12: "rank 12 (stage 2)"}
    assert not list(tmp_path.glob(".*.tmp")), "the temp file of the atomic write was left behind"


def test_chrome_trace_of_stages(tmp_path: Path, timeline: Timeline) -> None:
    path = tmp_path / "pred.json"
    chrome_trace(dict(enumerate(timeline.events)), path, label="stage")
    names = [e["args"]["name"] for e in json.loads(path.read_text())["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"]
    assert names == ["stage 0", "stage 1", "stage 2"]


def test_load_chrome_trace_names_a_foreign_event(tmp_path: Path) -> None:
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "name": "aten::mm", "ts": 0, "dur": 1, "pid": 0, "tid": 0}]}))
    with pytest.raises(TraceError, match="aten::mm"):
        load_chrome_trace(path)
    path.write_text("not json")
    with pytest.raises(TraceError, match="traceEvents"):
        load_chrome_trace(path)


@pytest.mark.parametrize("which", ["measured", "predicted", "both"])
def test_timeline_png(tmp_path: Path, timeline: Timeline, which: str) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / f"{which}.png"
    measured = measured_of(timeline, offset=7.0) if which != "predicted" else None
    predicted = timeline if which != "measured" else None
    timeline_png(path, measured=measured, predicted=predicted, title=f"1f1b {which}")
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_timeline_png_with_recompute_and_allreduce(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    sched = make_schedule("scp", 16, chain(4), [True] * 4)
    tl = simulate(sched, StageCosts.uniform(4, recompute=0.5, comm=0.1, allreduce=2.0))
    path = tmp_path / "scp.png"
    timeline_png(path, predicted=tl)
    assert path.read_bytes().startswith(PNG_MAGIC)


def test_timeline_png_needs_something_to_draw(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="measured=.*predicted="):
        timeline_png(tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_timeline_png_without_matplotlib(tmp_path: Path, timeline: Timeline,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(RaNNCError, match=r"pip install rannc\[trace\]"):
        timeline_png(tmp_path / "x.png", predicted=timeline)


def test_measured_panel_names_the_iteration_it_draws_to(timeline: Timeline) -> None:
    # Each rank's clock starts at its forward() call; the first action starts after the input
    # sends and the iteration ends after the gradient all-reduce: 20 ms of actions in 26 ms.
    from rannc.schedule.trace import _lane_end, measured_panel

    measured = {r: [Event(e.action, 0.002 + e.start * 0.001, 0.002 + e.end * 0.001) for e in evs]
                for r, evs in measured_of(timeline).items()}
    first = min(e.start for evs in measured.values() for e in evs)
    last = max(e.end for evs in measured.values() for e in evs)
    iteration = {r: max(e.end for e in evs) + 0.004 for r, evs in measured.items()}
    wall = max(iteration.values())
    assert wall > last - first + 0.005  # two different quantities

    title, lanes = measured_panel(measured, iteration)
    assert f"iteration {wall * 1e3:.3g} ms" in title and "gradients reduced" in title
    assert f"actions span {(last - first) * 1e3:.3g} ms" in title
    assert max(_lane_end(lane) for lane in lanes) == pytest.approx(wall)  # drawn to it
    assert all(lane[2] == pytest.approx(0.004) for lane in lanes)  # the tail after the actions

    title, lanes = measured_panel(measured)  # a loaded trace: no iteration times known
    assert title.startswith(f"measured: actions span {(last - first) * 1e3:.3g} ms")
    assert "iteration" not in title
    assert max(_lane_end(lane) for lane in lanes) == pytest.approx(last - first)


def test_timeline_png_draws_the_measured_iteration(tmp_path: Path, timeline: Timeline) -> None:
    pytest.importorskip("matplotlib")
    measured = measured_of(timeline)
    path = tmp_path / "both.png"
    timeline_png(path, measured=measured, predicted=timeline,
                 measured_iteration={r: max(e.end for e in evs) + 1.0 for r, evs in measured.items()})
    assert path.read_bytes().startswith(PNG_MAGIC)
