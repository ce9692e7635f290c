"""How the planner prices plans: :func:`ldt.plan.evaluate.simulate_plan` with a memo, a count
of the effort spent (its budgets) and a shortcut for plans of many micro-batches.

Effort is counted in simulated actions, not seconds: the search then does the same on a busy
machine as on an idle one, so a plan does not depend on the load (about 1 us per action on
this 2-core machine).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

from ldt.plan.cost import CostModel
from ldt.plan.evaluate import Evaluation, Plan, simulate_plan


class Simulator:
    """:func:`simulate_plan` for one cost model, remembering every plan it priced (the search
    meets a plan from several sides) and the effort spent, in simulated actions (the budgets).

    A long plan (many micro-batches: few replicas of a large inventory, the cheap end of the
    front) is timed at 3 short lengths instead: past its fill, a schedule's iteration grows by
    a steady time per micro-batch (1F1B: exactly; the U-shape's merged edge list within ~0.1%),
    so the long time follows from the last difference when the two differences agree within
    1%; otherwise, and for the plan finally picked, it is simulated in full. Such an evaluation
    has no timeline (``sim`` is None)."""

    GENERATE = 5
    """A schedule's first use costs this many plays of it: generating, lowering and checking
    the action lists takes ~5x as long as timing them once (U-shape, m=64)."""
    GENERATE_LANES = 15
    """The same for per-stage dp's lane schedules (:mod:`ldt.schedule.vdp`): ~15x (88 ms to
    generate, lower and check a 3-stage U-shape's lanes at dp 2, m 32; 6 ms a play)."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.memo: dict[Plan, Evaluation] = {}
        self.schedules: set[tuple] = set()
        self.work = 0

    def __call__(self, plan: Plan) -> Evaluation:
        ev = self.memo.get(plan)
        if ev is None:
            ev = self.memo[plan] = self._long(plan) or self.exact(plan)
        return ev

    def exact(self, plan: Plan) -> Evaluation:
        """A full simulation (and its timeline), counted in the effort."""
        ev = simulate_plan(plan, self.cost)
        self.work += self._effort(plan)
        self.schedules.add(schedule_actions(plan)[0])
        return ev

    def effort(self, plan: Plan) -> int:
        """What pricing ``plan`` would add to :attr:`work` (0 if it is priced already)."""
        if plan in self.memo:
            return 0
        short = self._short(plan)
        return sum(self._effort(p) for p in short) if short else self._effort(plan)

    def _effort(self, plan: Plan) -> int:
        key, actions = schedule_actions(plan)
        if key in self.schedules:
            return actions
        return actions * (1 + (self.GENERATE_LANES if plan.stage_dp else self.GENERATE))

    @staticmethod
    def _short(plan: Plan) -> list[Plan]:
        """The 3 short plans a long plan is timed by ([] for a plan simulated as it is)."""
        step = 4 * (plan.num_stages + 1 + 2 * plan.prefetch)  # well past the fill
        if plan.stage_dp or plan.num_microbatches <= 24 * step:  # 6x the micro-batches at least
            return []
        return [replace(plan, num_microbatches=k * step) for k in (1, 2, 3)]

    def _long(self, plan: Plan) -> Optional[Evaluation]:
        short = self._short(plan)
        if not short:
            return None
        m, step = plan.num_microbatches, short[0].num_microbatches
        t = [self.exact(p) for p in short]
        rise = [t[1].pipeline_time - t[0].pipeline_time, t[2].pipeline_time - t[1].pipeline_time]
        if abs(rise[1] - rise[0]) > 0.01 * abs(rise[1]):
            return None  # not steady yet: simulate it in full
        pipe = t[2].pipeline_time + (m - 3 * step) * rise[1] / step
        stages = [replace(s, busy=s.busy * m / (3 * step)) for s in t[2].stages]
        bubble = 1 - sum(s.busy for s in stages) / (plan.num_stages * pipe)
        return replace(t[2], plan=plan, iteration_time=pipe + t[2].dp_allreduce_time,
                       pipeline_time=pipe, bubble_fraction=bubble, stages=stages, sim=None)

    @property
    def runs(self) -> int:
        return len(self.memo)


def schedule_actions(plan: Plan) -> tuple[tuple, int]:
    """The schedule a plan is timed on (its cache key) and how many actions it has, counted
    without generating it: per micro-batch a plain stage has F, B and a send, receive and wait
    on each side it has a neighbour (8, or 5 at an end), the U-shape's edge 10 (its two chunks);
    per-stage dp runs every stage's share of ``dp * m`` micro-batches (one replica group)."""
    p, m = plan.num_stages, plan.num_microbatches
    depth = plan.prefetch if plan.u_shape else 0
    per_mb = 10 + 8 * (p - 1) if plan.u_shape else 2 if p == 1 else 10 + 8 * (p - 2)
    if not plan.stage_dp:
        return (p, m, plan.u_shape, depth), m * per_mb
    shared = math.gcd(*plan.stage_dp)  # as evaluate prices it: one group of replicas
    stage_dp = tuple(d // shared for d in plan.stage_dp)
    return (stage_dp, m, plan.u_shape, depth), max(stage_dp) * m * per_mb
