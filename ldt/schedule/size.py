"""How much memory a materialised schedule takes, known before it is built.

ldt's runtime, the simulator and the planner hold a step's action lists in memory (and the
runtime keeps every action's measured times for the run's timeline), so a micro-batch count
sizes a structure: a million micro-batches is hundreds of millions of Python objects. The
counts below are upper bounds of what :mod:`ldt.schedule.generate` and
:mod:`ldt.schedule.vdp` produce, exact for the U-shape (``tests/test_bounds.py`` checks them
against the generators); the bytes per action were measured with ``tracemalloc`` (CPython 3.11: a lowered,
checked U-shape or 1F1B peaks at 210-315 B per action, the simulator at ~310 B; one measured
timing row, an action name and two floats, ~200 B). Callers compare the estimate with the
host's available memory (:func:`available_bytes`) before building anything, and refuse a
count that cannot fit with what it would take.
"""

from __future__ import annotations

import math
from typing import Optional

from ldt.config import ConfigError

BYTES_PER_ACTION = 320
"""Peak bytes per action while a schedule is generated, lowered and checked (or simulated)."""
BYTES_PER_TIMING = 200
"""Bytes per measured action kept for the timeline (per step, per stage)."""
SHARE_OF_MEMORY = 0.5
"""The share of the host's available memory a schedule may take (the model needs the rest)."""


def actions_per_step(num_stages: int, num_microbatches: int, replicas: int = 1) -> int:
    """An upper bound of the actions of one step over every stage: per micro-batch a middle
    stage runs F, B and six communication actions, the U-shape's edge ten, a 1F1B end stage
    five, so ``8 P + 2`` (exact for the U-shape). With per-stage DP every stage runs the
    ``replicas`` (the largest stage dp) times ``num_microbatches`` micro-batches over its
    lanes, so the count is that times as large (exact too)."""
    return num_microbatches * replicas * (8 * max(num_stages, 1) + 2)


def runs_on_ldt_runtime(u_shape: bool, per_stage_dp: bool, runtime: str,
                        schedule: str = "auto") -> bool:
    """The U-shape, per-stage DP and the zero-bubble schedule always run on ldt's runtime
    (which materialises the step's action lists); a plain pipeline when
    ``train.runtime=ldt``."""
    return bool(u_shape or per_stage_dp or runtime == "ldt" or schedule == "zb")


def available_bytes() -> int:
    """Memory this host can still give (psutil's ``available``: free + reclaimable)."""
    import psutil

    return int(psutil.virtual_memory().available)


def gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB" if n >= 2**27 else f"{n / 2**20:.3g} MiB"


def check_schedule_size(flag: str, num_microbatches: int, num_stages: int, *,
                        replicas: int = 1, processes: int = 1,
                        steps: Optional[int] = None, steps_flag: str = "train.steps",
                        available: Optional[int] = None) -> None:
    """Refuse a micro-batch count whose action lists (built once in each of ``processes``)
    and, with ``steps``, measured times (every action of every step, kept on the reporting
    process for the timeline) do not fit in :data:`SHARE_OF_MEMORY` of the host's available
    memory. The message names the flag, what it would take and the largest value that fits."""
    per_mb = actions_per_step(num_stages, 1, replicas)
    actions = per_mb * num_microbatches
    build = actions * BYTES_PER_ACTION * processes
    kept = actions * BYTES_PER_TIMING * (steps or 0)
    have = available_bytes() if available is None else available
    budget = SHARE_OF_MEMORY * have
    if build + kept <= budget:
        return
    room = f"this machine has {gib(have)} available (half of it may go to schedules)"
    if build > budget:
        most = math.floor(budget / (per_mb * BYTES_PER_ACTION * processes))
        raise ConfigError(
            f"{flag}={num_microbatches}: the schedule's {actions:.3g} actions per step would "
            f"take ~{gib(build)} in {processes} process(es), and {room}; use at most "
            f"{flag}={most}")
    most = math.floor((budget - build) / (actions * BYTES_PER_TIMING))
    raise ConfigError(
        f"{steps_flag}={steps} with {flag}={num_microbatches}: ldt's runtime keeps every "
        f"action's measured times for the run's timeline, {actions:.3g} actions per step, "
        f"~{gib(kept)} in all, and {room}; use at most {steps_flag}={most}, or fewer "
        "micro-batches")


def check_fits(flag: str, value: int, need: float, what: str, *, unit_bytes: float,
               available: Optional[int] = None) -> None:
    """Refuse ``flag=value`` when ``need`` bytes (``what`` takes them) do not fit in
    :data:`SHARE_OF_MEMORY` of the host's available memory; ``unit_bytes``: bytes per unit of
    ``value`` (for the largest value that fits)."""
    have = available_bytes() if available is None else available
    budget = SHARE_OF_MEMORY * have
    if need <= budget:
        return
    raise ConfigError(f"{flag}={value}: {what} would take ~{gib(need)}, and this machine has "
                      f"{gib(have)} available (half of it may go there); use at most "
                      f"{flag}={math.floor(budget / unit_bytes)}")
