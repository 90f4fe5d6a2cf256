"""Pipeline schedules: the actions each stage runs (`actions`), their simulation, and
rendering of timelines as Chrome traces and PNG charts (`trace`)."""

from rannc.schedule.actions import (
    SCHEDULES,
    Action,
    Op,
    Schedule,
    ScheduleError,
    chain,
    make_schedule,
    validate,
)
from rannc.schedule.simulate import Event, StageCosts, Timeline, in_flight, simulate
from rannc.schedule.trace import TraceError, chrome_trace, load_chrome_trace, timeline_png

__all__ = ["SCHEDULES", "Action", "Event", "Op", "Schedule", "ScheduleError", "StageCosts",
           "Timeline", "TraceError", "chain", "chrome_trace", "in_flight", "load_chrome_trace",
           "make_schedule", "simulate", "timeline_png", "validate"]
