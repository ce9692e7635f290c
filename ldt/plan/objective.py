"""What the planner optimises: iteration time, cost per step, and the policy that trades them.

A plan holds its devices for the whole step, so one step costs the hourly price of the devices
it holds (each kind's ``price_per_hour``; without prices every device costs 1, so cost counts
device-hours) times the iteration time. Every plan of one workload trains the same tokens per
step (the global batch), so cost per step ranks plans exactly as cost per trained token does.

The planner keeps the plans it meets that no other plan beats on both time and cost (the
Pareto front) and picks one by an :class:`Objective`:

* ``time`` (default): the fastest plan, except that a plan at most ``tolerance`` slower costs
  less: the cheapest plan within ``(1 + tolerance)`` of the fastest iteration time (the default
  1% turns "ties" into savings; ``--max-slowdown 0.05`` accepts 5% for a cheaper plan);
* ``cost``: the cheapest plan per step, ties within ``tolerance`` of that cost going to the
  faster one.

Either way no devices are added that do not make the step faster by more than the tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from ldt.config import ConfigError
from ldt.plan.evaluate import Evaluation, Plan
from ldt.plan.inventory import Inventory

OBJECTIVES = ("time", "cost")


@dataclass(frozen=True)
class Objective:
    minimise: str = "time"
    """``time``: the fastest, ties within the tolerance to the cheaper; ``cost``: the cheapest
    per step (per trained token), ties within the tolerance to the faster."""
    tolerance: float = 0.01
    """Relative slack on the minimised quantity inside which the other one decides."""

    def __post_init__(self) -> None:
        if self.minimise not in OBJECTIVES:
            raise ConfigError(f"objective {self.minimise!r}; use one of {', '.join(OBJECTIVES)}")
        if not (self.tolerance >= 0 and math.isfinite(self.tolerance)):
            raise ConfigError(f"objective tolerance (--max-slowdown) {self.tolerance} must be a "
                              "finite fraction >= 0, e.g. 0.02 for 2%")

    def describe(self) -> str:
        if self.minimise == "time":
            return f"fastest, then cheapest within {self.tolerance:.1%} of it"
        return f"cheapest per step, then fastest within {self.tolerance:.1%} of that cost"


def devices(plan: Plan) -> int:
    """Devices the plan holds: every stage's TP times its replicas."""
    return sum(st.tp * plan.dp_of(i) for i, st in enumerate(plan.stages))


def hourly_price(plan: Plan, inventory: Inventory) -> float:
    """What the plan's devices cost per hour (device count without prices)."""
    return sum(st.tp * plan.dp_of(i) * inventory.price(st.kind)
               for i, st in enumerate(plan.stages))


def step_cost(ev: Evaluation, inventory: Inventory) -> float:
    """Cost of one training step: hourly price times the iteration time."""
    return hourly_price(ev.plan, inventory) * ev.iteration_time / 3600.0


def ms(seconds: float) -> str:
    """Milliseconds with 1 decimal, or 3 significant digits below 10 ms (tiny CPU models)."""
    value = seconds * 1e3
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def _key(ev: Evaluation, inventory: Inventory) -> tuple:
    """A total order for ties: time, cost, devices, then the plan's text (deterministic)."""
    return (ev.iteration_time, step_cost(ev, inventory), devices(ev.plan), ev.plan.describe())


def pareto_front(evaluations: Iterable[Evaluation], inventory: Inventory) -> list[Evaluation]:
    """Fitting plans that no other plan beats on both iteration time and cost per step, fastest
    first (each later one is slower and cheaper); one plan per (time, cost) point."""
    front: list[Evaluation] = []
    for ev in sorted((e for e in evaluations if e.fits), key=lambda e: _key(e, inventory)):
        if not front or step_cost(ev, inventory) < step_cost(front[-1], inventory):
            front.append(ev)
    return front


def spread(n: int) -> list[int]:
    """0..n-1 in an order whose every prefix is spread out: both ends, then the middle, then the
    quarters, ... (to take or show a few plans along a front)."""
    out, parts = [0, n - 1] if n > 1 else list(range(n)), [(0, n - 1)]
    while parts:
        nxt = []
        for a, b in parts:
            mid = (a + b) // 2
            if a < mid < b:
                out.append(mid)
                nxt += [(a, mid), (mid, b)]
        parts = nxt
    return out


def choose(evaluations: Sequence[Evaluation], inventory: Inventory,
           objective: Objective) -> tuple[Evaluation, str]:
    """The plan the objective picks among fitting ``evaluations``, and why, in one sentence."""
    fits = [e for e in evaluations if e.fits]
    if not fits:
        raise ValueError("choose() needs at least one plan that fits in memory")
    cost = {id(e): step_cost(e, inventory) for e in fits}
    fastest = min(fits, key=lambda e: _key(e, inventory))
    if objective.minimise == "time":
        limit = fastest.iteration_time * (1 + objective.tolerance)
        window = [e for e in fits if e.iteration_time <= limit]
        pick = min(window, key=lambda e: (cost[id(e)],) + _key(e, inventory))
    else:
        cheapest = min(fits, key=lambda e: (cost[id(e)],) + _key(e, inventory))
        limit = cost[id(cheapest)] * (1 + objective.tolerance)
        pick = min((e for e in fits if cost[id(e)] <= limit), key=lambda e: _key(e, inventory))
    return pick, _why(pick, fastest, fits, cost, inventory, objective)


def _why(pick: Evaluation, fastest: Evaluation, fits: list[Evaluation], cost: dict[int, float],
         inventory: Inventory, objective: Objective) -> str:
    def plan_text(ev: Evaluation) -> str:
        n, d = ev.plan.num_stages, devices(ev.plan)
        return (f"{n} stage{'s' * (n != 1)} on {d} device{'s' * (d != 1)}, "
                f"{ms(ev.iteration_time)} ms")

    rule = f"objective: {objective.describe()}"
    if pick is fastest:
        cheaper = [e for e in fits if cost[id(e)] < cost[id(pick)]]
        if not cheaper:
            return f"picked the fastest plan, also the cheapest met ({rule})"
        nearest = min(cheaper, key=lambda e: e.iteration_time)
        slower = nearest.iteration_time / pick.iteration_time - 1
        return (f"picked the fastest plan ({plan_text(pick)}): the fastest cheaper one "
                f"({plan_text(nearest)}) is {slower:.1%} slower ({rule})")
    slower = pick.iteration_time / fastest.iteration_time - 1
    saved = 1 - cost[id(pick)] / cost[id(fastest)] if cost[id(fastest)] else 0.0
    return (f"picked {plan_text(pick)}: {slower:.1%} slower than the fastest "
            f"({plan_text(fastest)}) for {saved:.0%} less cost per step ({rule})")
