"""Pipeline schedules as data: generate -> lower -> check -> simulate -> draw (no torch here)."""

from ldt.schedule.check import ScheduleError, check_schedule
from ldt.schedule.generate import forwards_of, lower, one_f_one_b, u_shape
from ldt.schedule.ir import Action, Op, Schedule, format_grid, from_csv, parse_action, to_csv
from ldt.schedule.simulate import Event, Prepared, SimResult, prepare, simulate
from ldt.schedule.timeline import to_chrome_trace, to_png

__all__ = [
    "Action",
    "Event",
    "Op",
    "Prepared",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "check_schedule",
    "format_grid",
    "forwards_of",
    "from_csv",
    "lower",
    "one_f_one_b",
    "parse_action",
    "prepare",
    "simulate",
    "to_chrome_trace",
    "to_csv",
    "to_png",
    "u_shape",
]
