"""Pipeline schedules: the actions each stage runs (`actions`) and their simulation."""

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

__all__ = ["SCHEDULES", "Action", "Event", "Op", "Schedule", "ScheduleError", "StageCosts",
           "Timeline", "chain", "in_flight", "make_schedule", "simulate", "validate"]
