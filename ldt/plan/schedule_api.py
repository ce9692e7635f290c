"""The one door from the planner to :mod:`ldt.schedule` (generators, lowering, simulator, timeline).

The planner must time the same action lists the runtime runs, so it imports them rather than
modelling the schedule itself. Everything goes through this module so a rename in
``ldt.schedule`` is fixed in one place.
"""

from __future__ import annotations

from ldt.schedule import (Op, SimResult, lower, one_f_one_b, prepare, simulate, to_chrome_trace,
                          to_png, u_shape)

__all__ = ["Op", "SimResult", "lower", "one_f_one_b", "prepare", "simulate", "to_chrome_trace",
           "to_png", "u_shape"]
