"""Render pipeline timelines: a Chrome/Perfetto trace file and a PNG Gantt chart.

Pure rendering: the input is per-lane lists of `Event`s, either measured on the ranks (keyed
by rank, times in any common clock) or predicted by `simulate` (a `Timeline`, one lane per
stage). Nothing here talks to other processes; gathering the ranks' events is the caller's job.

`chrome_trace` writes JSON that chrome://tracing and ui.perfetto.dev open, one process per
rank; `load_chrome_trace` reads it back into `Event`s, so a measured run can be re-plotted or
compared with the simulator later. `timeline_png` draws measured and predicted timelines one
above the other on the same time scale, which is how a wrong cost model shows itself.

matplotlib is optional (`pip install rannc[trace]`) and imported only inside `timeline_png`.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rannc.errors import RaNNCError, TraceError
from rannc.schedule.actions import Action, Op
from rannc.schedule.simulate import Event, Timeline

if TYPE_CHECKING:
    from matplotlib.axes import Axes

_US = 1e6  # trace files count microseconds
_MS = 1e3  # the chart counts milliseconds

_CATEGORY = {Op.F: "forward", Op.B: "backward", Op.R: "recompute", Op.W: "weight gradients",
             Op.SF: "send", Op.SB: "send", Op.RF: "recv", Op.RB: "recv"}


# --- Chrome / Perfetto trace -------------------------------------------------------------------


def chrome_trace(events: Mapping[int, Sequence[Event]], path: str | os.PathLike[str], *,
                 label: str = "rank", names: Mapping[int, str] | None = None) -> None:
    """Write `events` (lane key -> its events, e.g. rank -> what that rank ran) as a Chrome trace.

    Each event becomes a complete event ("ph": "X") named like "F1.3", in category forward,
    backward, recompute, send or recv, on process `key`. A lane is called "<label> <key>",
    with "(stage s)" added when all its actions belong to one stage s and the label is not
    "stage" itself; `names[key]` replaces that. For a simulated `Timeline` pass
    `dict(enumerate(timeline.events))` and `label="stage"`. The file is replaced atomically,
    so a reader never sees half of it.
    """
    out: list[dict[str, Any]] = []
    for key in sorted(events):
        evs = events[key]
        name = (names or {}).get(key) or _lane_name(label, key, evs)
        out.append({"ph": "M", "name": "process_name", "pid": key, "tid": 0,
                    "args": {"name": name}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": key, "tid": 0,
                    "args": {"sort_index": key}})
        for e in evs:
            a = e.action
            out.append({"ph": "X", "name": str(a), "cat": _CATEGORY[a.op], "pid": key, "tid": 0,
                        "ts": e.start * _US, "dur": (e.end - e.start) * _US,
                        "args": {"stage": a.stage, "microbatch": a.micro}})
    _write_atomic(Path(path), json.dumps({"traceEvents": out, "displayTimeUnit": "ms"}))


def load_chrome_trace(path: str | os.PathLike[str]) -> dict[int, list[Event]]:
    """Read a trace written by `chrome_trace` back: process id -> its events, in file order.

    Times come back in seconds, equal to what was written up to float rounding of the
    microsecond conversion. Metadata and events of other phases are skipped.
    """
    p = Path(path)
    try:
        data = json.loads(p.read_text())
        trace = data["traceEvents"] if isinstance(data, dict) else data
    except (OSError, ValueError, KeyError) as e:
        raise TraceError(f"cannot read {p} as a Chrome trace ({e}); expected JSON with a "
                         "'traceEvents' list, as `chrome_trace` writes") from e
    out: dict[int, list[Event]] = {}
    for i, ev in enumerate(trace):
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        try:
            action = Action.parse(ev["name"])
            start = float(ev["ts"]) / _US
            end = start + float(ev["dur"]) / _US
            pid = int(ev["pid"])
        except (KeyError, TypeError, ValueError, RaNNCError) as e:
            raise TraceError(f"{p}: trace event {i} ({ev!r:.120}) is not a rannc action "
                             f"event ({e}); this loader reads files that `chrome_trace` "
                             "wrote") from e
        out.setdefault(pid, []).append(Event(action, start, end))
    return out


def _lane_name(label: str, key: int, evs: Sequence[Event]) -> str:
    stages = {e.action.stage for e in evs}
    if label != "stage" and len(stages) == 1:
        return f"{label} {key} (stage {stages.pop()})"
    return f"{label} {key}"


def _write_atomic(path: Path, text: str) -> None:
    # Temp file in the same directory, so os.replace is a rename on one file system.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; a trace is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


# --- PNG Gantt chart ---------------------------------------------------------------------------

# Colour per drawn kind (Okabe-Ito, readable by colour-blind readers and in grey print).
_STYLE: dict[str, dict[str, Any]] = {
    "forward": {"facecolor": "#0072B2"},
    "backward": {"facecolor": "#E69F00"},
    "recompute": {"facecolor": "#009E73"},
    "weight gradients": {"facecolor": "#D55E00"},  # W: split off B (zero-bubble schedules)
    "send": {"facecolor": "#56B4E9"},  # measured isend calls (queueing the transfer)
    "recv wait": {"facecolor": "#DDDDDD", "hatch": "////", "edgecolor": "#999999"},
    "all-reduce": {"facecolor": "#CC79A7"},
    # measured: from a rank's last action to the end of its iteration: returning the outputs,
    # the script's own code up to backward(), the gradient all-reduce, the last sends' waits
    "after last action": {"facecolor": "#CC79A7", "hatch": "....", "edgecolor": "#FFFFFF"},
}
# A chart lane: its name, its events (times from the chart's origin), the seconds after its
# last event drawn as the tail kind.
_Lane = tuple[str, Sequence[Event], float, str]
_BAR_H = 0.8  # of a lane's height
_WAIT_H = 0.3  # waits are drawn thin, so the compute bars stand out
_FIG_W = 14.0  # inches
_DPI = 110


def timeline_png(path: str | os.PathLike[str], *, measured: Mapping[int, Sequence[Event]] | None = None,
                 predicted: Timeline | None = None, title: str = "",
                 measured_iteration: Mapping[int, float] | None = None) -> None:
    """Draw a Gantt chart of a pipeline iteration to a PNG file at `path`.

    `measured` maps rank -> the events it ran, in seconds on one clock. `measured_iteration`
    (rank -> seconds, optional) says that clock starts at each rank's forward() call and when
    its iteration ended (gradients reduced, sends done): the chart then starts at 0, every lane
    runs to its iteration's end, and the panel's iteration time is the slowest rank's, the
    wall time a training step spends in rannc. Without it the chart starts at the earliest
    event and the panel gives the span of the actions, named as such (it leaves out what
    runs before the first and after the last action, e.g. the gradient all-reduce).
    `predicted` is `simulate`'s result, one lane per stage. With both,
    they are drawn one above the other on the same time axis. Forward, backward and
    recompute are coloured bars (numbered by microbatch where wide enough), receive waits
    thin hatched grey bars, a predicted all-reduce a bar after the stage's last action. Where
    a lane runs several stages (interleaved schedules), the bars of its later stages are
    hatched, so each chunk's microbatches read apart.
    """
    if measured is None and predicted is None:
        raise TraceError("timeline_png needs something to draw: pass measured=<rank -> events> "
                         "and/or predicted=<simulate(...) result>")
    Figure, Rectangle, FigureCanvasAgg = _import_matplotlib()

    panels: list[tuple[str, list[_Lane]]] = []
    if measured is not None:
        panels.append(measured_panel(measured, measured_iteration))
    if predicted is not None:
        sched = predicted.schedule
        lanes: list[_Lane] = [(_predicted_lane_name(sched.stages_on(d)), evs,
                               predicted.allreduce[d], "all-reduce")
                              for d, evs in enumerate(predicted.events)]
        panels.append((f"predicted (simulator): iteration {_fmt_ms(predicted.iteration_time)}",
                       lanes))

    heights = [max(len(lanes), 1) for _, lanes in panels]
    fig_h = 1.2 + sum(0.45 * h + 0.8 for h in heights)
    fig = Figure(figsize=(_FIG_W, fig_h), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False, height_ratios=heights)
    all_lanes = [lane for _, lanes in panels for lane in lanes]
    end = max((_lane_end(lane) for lane in all_lanes), default=0.0)
    end_ms = end * _MS or 1.0
    # A microbatch number goes in bars at least this wide, the same width for every bar, so
    # that either all bars of a kind are numbered or none (no stray numbers in a dense chart).
    digits = len(str(max((e.action.micro for _, evs, _, _ in all_lanes for e in evs), default=0)))
    min_label_ms = (7 * digits + 4) * end_ms / (0.9 * _FIG_W * _DPI)
    kinds: set[str] = set()
    for ax, (panel_title, lanes) in zip(axes[:, 0], panels, strict=True):
        kinds |= _draw_panel(ax, lanes, min_label_ms)
        ax.set_title(panel_title, loc="left", fontsize=10)
        ax.set_xlim(0.0, end_ms * 1.01)
    axes[-1, 0].set_xlabel("time (ms)")
    handles = [Rectangle((0, 0), 1, 1, label=k, **_STYLE[k]) for k in _STYLE if k in kinds]
    fig.legend(handles=handles, loc="outside upper right", ncol=len(handles), fontsize=9,
               frameon=False)
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=12)
    fig.savefig(os.fspath(path), format="png")


def measured_panel(measured: Mapping[int, Sequence[Event]],
                   iteration: Mapping[int, float] | None = None) -> tuple[str, list[_Lane]]:
    """The measured panel's title and lanes (see `timeline_png`). Two quantities are easily
    confused here: the span of the actions (first start to last end, across ranks) and the
    iteration's wall time (forward() call to gradients reduced, the slowest rank), which adds
    the input sends before the first action and what follows the last: the script's code up
    to backward() and the all-reduce (tests/scripts/pipeline_check.py, GPT-2 on 2 CPU ranks,
    1F1B: 111 ms of actions in a 133 ms iteration). The title names the one the lanes are
    drawn to."""
    starts = [e.start for evs in measured.values() for e in evs]
    ends = [e.end for evs in measured.values() for e in evs]
    span = max(ends, default=0.0) - min(starts, default=0.0)
    if iteration is None:
        t0 = min(starts, default=0.0)
        lanes: list[_Lane] = [(_lane_name("rank", r, measured[r]), _shift(measured[r], t0), 0.0,
                               "after last action") for r in sorted(measured)]
        return f"measured: actions span {_fmt_ms(span)} (first action start to last end)", lanes
    lanes = []
    for r in sorted(measured):
        evs = list(measured[r])
        last = max((e.end for e in evs), default=0.0)
        lanes.append((_lane_name("rank", r, evs), evs, max(iteration.get(r, 0.0) - last, 0.0),
                      "after last action"))
    wall = max((_lane_end(lane) for lane in lanes), default=0.0)
    return (f"measured: iteration {_fmt_ms(wall)} (forward() call to gradients reduced, slowest "
            f"rank); actions span {_fmt_ms(span)}", lanes)


def _lane_end(lane: _Lane) -> float:
    _, evs, tail, _ = lane
    return max((e.end for e in evs), default=0.0) + tail if evs else tail


def _draw_panel(ax: Axes, lanes: Sequence[_Lane], min_label_ms: float) -> set[str]:
    """Draw one lane per entry (top to bottom) into ax; return the kinds drawn."""
    kinds: set[str] = set()
    n = len(lanes)
    for i, (_, evs, tail, tail_kind) in enumerate(lanes):
        y = n - 1 - i  # first lane on top
        bars: dict[tuple[str, bool], list[tuple[float, float]]] = {}
        first = min((e.action.stage for e in evs), default=0)
        for e in evs:
            width = (e.end - e.start) * _MS
            if width <= 0:
                continue  # sends and receives that did not wait take no time
            kind = "recv wait" if e.action.op in (Op.RF, Op.RB) else _CATEGORY[e.action.op]
            bars.setdefault((kind, e.action.stage != first), []).append((e.start * _MS, width))
            if kind not in ("recv wait", "send") and width >= min_label_ms:
                ax.text(e.start * _MS + width / 2, y, str(e.action.micro), ha="center",
                        va="center", fontsize=7, color="white", clip_on=True)
        if tail > 0:
            last = max((e.end for e in evs), default=0.0)
            bars[(tail_kind, False)] = [(last * _MS, tail * _MS)]
        for (kind, later), spans in bars.items():
            h = _WAIT_H if kind == "recv wait" else _BAR_H
            style = {"edgecolor": "white", "linewidth": 0.5, **_STYLE[kind]}
            if later and kind != "recv wait":
                style["hatch"] = "///"
            ax.broken_barh(spans, (y - h / 2, h), **style)
            kinds.add(kind)
    ax.set_yticks(range(n), [lane[0] for lane in reversed(lanes)], fontsize=9)
    ax.set_ylim(-0.6, n - 0.4)
    ax.grid(axis="x", color="#EEEEEE", linewidth=0.8)
    ax.set_axisbelow(True)
    ax.tick_params(axis="x", labelbottom=True)  # sharex hides it on the upper panel
    return kinds


def _predicted_lane_name(stages: Sequence[int]) -> str:
    if len(stages) == 1:
        return f"stage {stages[0]}"
    return "stages " + ", ".join(map(str, stages))


def _fmt_ms(seconds: float) -> str:
    ms = seconds * _MS
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.3g} ms"


def _shift(evs: Sequence[Event], t0: float) -> list[Event]:
    return [Event(e.action, e.start - t0, e.end - t0) for e in evs]


def _import_matplotlib() -> tuple[Any, Any, Any]:
    # A bare Figure on its own Agg canvas: no pyplot, so no global backend switch, no figure
    # registry to leak into, and no display needed.
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle
    except ImportError as e:
        raise TraceError("drawing a timeline needs matplotlib, which is not installed; install "
                         "it with `pip install matplotlib` (or `pip install rannc[trace]`)") from e
    return Figure, Rectangle, FigureCanvasAgg


__all__ = ["TraceError", "chrome_trace", "load_chrome_trace", "measured_panel", "timeline_png"]
