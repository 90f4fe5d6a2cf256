"""Pipeline schedules: one `ScheduleSpec` per schedule (`spec`), the actions each stage runs
(`actions`), their simulation, and rendering of timelines as Chrome traces and PNG charts (`trace`)."""

from rannc.schedule.actions import Action, Op, Schedule, ScheduleError, chain, validate
from rannc.schedule.simulate import Event, StageCosts, Timeline, in_flight, simulate
from rannc.schedule.spec import (
    FILL_DRAIN,
    SCHEDULES,
    ScheduleSpec,
    StageLine,
    default_placement,
    get_spec,
    make_schedule,
    register,
    registered,
    splits_backward,
)
from rannc.schedule.trace import TraceError, chrome_trace, load_chrome_trace, timeline_png

__all__ = ["FILL_DRAIN", "SCHEDULES", "Action", "Event", "Op", "Schedule", "ScheduleError",
           "ScheduleSpec", "StageCosts", "StageLine", "Timeline", "TraceError", "chain",
           "chrome_trace", "default_placement", "get_spec", "in_flight", "load_chrome_trace", "make_schedule",
           "register", "registered", "simulate", "splits_backward", "timeline_png", "validate"]
