"""Brute-force reference planner for small instances (tests and the benchmark).

It enumerates everything the planner's model allows: every dp size, every multiset of stages per
kind (any mix of TP sizes, any number of devices left idle), every order of those stages (kinds
interleaved freely; the U-shape edge first), every contiguous layer split (a U-shape at the
prefetch depth the planner's rule gives it, :func:`ldt.plan.evaluate.choose_prefetch`, from
every depth simulated), and simulates each memory-feasible plan on the real schedule; the
objective (:mod:`ldt.plan.objective`) picks among them exactly as in the planner. The only
shortcut is exact: a plan is not simulated when a lower bound on its time (a stage must run all
its micro-batches after the stages before it have passed micro-batch 0 forward and back)
already rules it out: slower than the tolerance allows past the fastest time found (objective
``time``), or costlier than that past the cheapest cost found (``cost``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator, Optional

from ldt.config import ModelConfig
from ldt.plan.cost import CostModel
from ldt.plan.evaluate import (MAX_PREFETCH, Evaluation, Plan, StageSpec, choose_prefetch,
                               chunk_times, dp_allreduce, fit_recompute, simulate_plan)
from ldt.plan.inventory import Inventory, Workload, valid_tp_sizes
from ldt.plan.objective import Objective, choose, hourly_price, step_cost
from ldt.plan.planner import make_cost, wants_ushape


@dataclass
class ExhaustiveResult:
    best: Optional[Evaluation]
    """The objective's pick."""
    plans: int
    """Memory-feasible plans enumerated."""
    simulated: int
    fastest: Optional[Evaluation] = None
    """The fastest plan (with ``minimise="cost"``: of those not ruled out by their cost)."""


def _multisets(tps: list[int], devices: int, max_stages: int) -> Iterator[tuple[int, ...]]:
    """TP multisets (non-increasing tuples) using at most ``devices`` devices."""
    def rec(prefix: tuple[int, ...], left: int, top: int):
        yield prefix
        if len(prefix) >= max_stages:
            return
        for t in tps:
            if t <= top and t <= left:
                yield from rec(prefix + (t,), left - t, t)
    yield from rec((), devices, max(tps))


def _compositions(total: int, lows: list[int]) -> Iterator[tuple[int, ...]]:
    """Every way to write ``total`` as len(lows) parts, part i >= lows[i]."""
    if len(lows) == 1:
        if total >= lows[0]:
            yield (total,)
        return
    for first in range(lows[0], total - sum(lows[1:]) + 1):
        for rest in _compositions(total - first, lows[1:]):
            yield (first, *rest)


def _lower_bound(plan: Plan, cost: CostModel) -> float:
    w = [f + b for chunks in chunk_times(plan, cost) for f, b in chunks]
    m = plan.num_microbatches
    if plan.u_shape:  # logical chain: edge start, cloud stages, edge end
        edge = m * (w[0] + w[1])
        chain = [w[0]] + w[2:]
        return max([edge] + [m * chain[k] + sum(chain[:k]) for k in range(1, len(chain))])
    return max(m * w[k] + sum(w[:k]) for k in range(len(w)))


def stage_sequences(inventory: Inventory, model: ModelConfig, ushape: bool, dp: int,
                    max_stages: int) -> Iterator[tuple[StageSpec, ...]]:
    kinds = [k for k in inventory.kinds if not (ushape and k.name == inventory.edge)]
    per_kind = []
    for k in kinds:
        n = k.count // dp
        tps = [t for t in valid_tp_sizes(model, k.node_size) if t <= n]
        per_kind.append([tuple(StageSpec(k.name, t) for t in ms)
                         for ms in (_multisets(tps, n, max_stages) if tps else [()])])
    heads = [()]
    if ushape:
        e = inventory.kind(inventory.edge)
        heads = [(StageSpec(e.name, t),) for t in valid_tp_sizes(model, e.node_size)
                 if t <= e.count // dp]
    for combo in itertools.product(*per_kind):
        body = [s for group in combo for s in group]
        if not body or len(body) > max_stages:
            continue
        for order in set(itertools.permutations(body)):
            for head in heads:
                yield head + order


def exhaustive(inventory: Inventory, model: ModelConfig, workload: Workload,
               max_stages: Optional[int] = None,
               objective: Optional[Objective] = None) -> ExhaustiveResult:
    """The objective's pick over the whole (small) search space, and the fastest plan."""
    objective = objective or Objective()
    cost = make_cost(inventory, model, workload)
    ushape = wants_ushape(inventory, workload)
    L, b, g = model.num_layers, workload.micro_batch_size, workload.global_batch_size
    emin = workload.edge_min_layers
    kept: list[Evaluation] = []
    fastest: Optional[float] = None
    cheapest: Optional[float] = None
    plans = sims = 0
    for dp in range(1, inventory.total_devices + 1):
        if (g // b) % dp or (ushape and inventory.kind(inventory.edge).count < dp):
            continue
        m = g // (b * dp)
        for stages in stage_sequences(inventory, model, ushape, dp, max_stages or L):
            p = len(stages)
            lows = [emin] + [1] * (p - 1) + [emin] if ushape else [1] * p
            if ushape and p < 2:
                continue
            for layers in _compositions(L, lows):
                plan = Plan(stages, layers, ushape, dp, m)
                if not _fits(plan, cost):  # a deeper prefetch holds more, so it fails too
                    continue
                plans += 1
                bound = _lower_bound(plan, cost) + dp_allreduce(plan, cost)
                slack = 1 + objective.tolerance
                if objective.minimise == "time" and fastest is not None and bound > fastest * slack:
                    continue
                if (objective.minimise == "cost" and cheapest is not None
                        and bound * hourly_price(plan, inventory) / 3600 > cheapest * slack):
                    continue
                # the U-shape's depth by the planner's own rule (every depth 0-3 simulated)
                ev = choose_prefetch(simulate_plan(plan, cost), cost)
                sims += MAX_PREFETCH + 1 if ushape else 1
                if not ev.fits:
                    continue
                kept.append(ev)
                t, c = ev.iteration_time, step_cost(ev, inventory)
                fastest = t if fastest is None else min(fastest, t)
                cheapest = c if cheapest is None else min(cheapest, c)
    if not kept:
        return ExhaustiveResult(None, plans, sims)
    best, _ = choose(kept, inventory, objective)
    return ExhaustiveResult(best, plans, sims, min(kept, key=lambda e: e.iteration_time))


def _fits(plan: Plan, cost: CostModel) -> bool:
    plan = fit_recompute(plan, cost)  # with recomputation where the planner would use it
    return all(cost.stage_memory(st.tp, plan.stage_chunks(i)).total <= cost.memory_limit(st.kind)
               for i, st in enumerate(plan.stages))
