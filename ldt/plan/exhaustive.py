"""Brute-force reference for the planner on small instances (tests and the benchmark).

It shares none of the planner's search rules. What it shares, and only that, is the pricing
of a fully specified plan: the cost model (:mod:`ldt.plan.cost`) and the simulation of the
action lists the runtime runs (:func:`ldt.plan.evaluate.simulate_plan`, under a cost model
with ``recompute=False``, so the plan's recomputation is priced exactly as stated), and the
objective's definition of the pick (:func:`ldt.plan.objective.choose`) and, as the planner's
last step, the pick's schedule: today's or its zero-bubble one, whichever the objective picks
(:func:`ldt.plan.zb_prices.choose_schedule`; zero-bubble is priced for the pick only, on both
sides). It enumerates:

- every largest data-parallel size ``D`` that divides the step's micro-batches, and every
  per-stage dp vector whose sizes divide ``D`` with one equal to it (the lane schedules'
  rule, :mod:`ldt.schedule.vdp`): uniform dp and per-stage DP, plain pipelines and U-shapes;
- every sequence of stages (device kind, TP) the inventory's devices allow, ``tp * dp`` of a
  kind summed over its stages within its count; TP the sizes that divide the model's heads,
  hidden size, FFN and query groups and fit a node (:func:`ldt.plan.inventory.valid_tp_sizes`,
  the runtime's rule); a U-shape's stage 0 on the inventory's edge kind, its cloud stages on
  the others (what the inventory's ``edge`` means);
- every contiguous layer split (a segment >= 1 layer, the edge's two >= ``edge_min_layers``);
- every prefetch depth 0..:data:`MAX_PREFETCH` of a U-shape;
- every recomputation megatron-core accepts on each stage: none; selective over any
  non-empty subset of ``core_attn``, ``layernorm``, ``mlp`` (``mlp`` only without biases:
  megatron cannot recompute a biased MLP), ``moe`` (on a stage with MoE layers); full
  ``uniform`` with ``n`` dividing each of the stage's chunks; full ``block`` with ``n`` up to
  its largest chunk.

Two reductions keep it small; both are exact, neither is the planner's:

- recomputation: a stage's memory depends only on its own recomputation and on what its
  action lists hold in flight (fixed by the schedule, whatever the durations), and making one
  stage's backward longer never shortens a step on fixed action lists; so per stage only the
  fitting recomputation that adds the least time is simulated (the others tie or lose, on
  time and so on cost per step);
- plans are simulated in the order of a lower bound on their time (:func:`_lower_bound`;
  times their hourly price for objective ``cost``), and the search stops at the first whose
  bound exceeds ``1 + tolerance`` times the fastest time (cheapest cost) found: no plan after
  it can be the objective's pick.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Iterator, Optional

from ldt.config import ModelConfig
from ldt.plan.cost import CostModel
from ldt.plan.evaluate import MAX_PREFETCH, Evaluation, Plan, StageSpec, dp_allreduce, simulate_plan
from ldt.plan.inventory import Inventory, Workload, valid_tp_sizes
from ldt.plan.memory_cost import Recompute
from ldt.plan.objective import Objective, choose, hourly_price, step_cost
from ldt.plan.zb_prices import choose_schedule


@dataclass
class ExhaustiveResult:
    best: Optional[Evaluation]
    """The objective's pick."""
    plans: int
    """Plans simulated that fit in memory (with some recomputation where allowed)."""
    simulated: int
    fastest: Optional[Evaluation] = None
    """The fastest plan (with ``minimise="cost"``: of those not ruled out by their cost), the
    pick on its zero-bubble schedule among them, as in the planner's front."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _compositions(total: int, lows: list[int]) -> Iterator[tuple[int, ...]]:
    """Every way to write ``total`` as len(lows) parts, part i >= lows[i]."""
    if len(lows) == 1:
        if total >= lows[0]:
            yield (total,)
        return
    for first in range(lows[0], total - sum(lows[1:]) + 1):
        for rest in _compositions(total - first, lows[1:]):
            yield (first, *rest)


def stage_sequences(inventory: Inventory, model: ModelConfig, ushape: bool, top: int,
                    max_stages: int) -> Iterator[tuple[tuple[StageSpec, int], ...]]:
    """Every sequence of (stage, its replicas), the replicas dividing ``top`` and one of them
    equal to it, that the inventory's devices hold (see the module docstring)."""
    dps = _divisors(top)
    cloud = [(k.name, t) for k in inventory.kinds if not (ushape and k.name == inventory.edge)
             for t in valid_tp_sizes(model, k.node_size)]
    first = cloud
    if ushape:
        e = inventory.kind(inventory.edge)
        first = [(e.name, t) for t in valid_tp_sizes(model, e.node_size)]
    left0 = {k.name: k.count for k in inventory.kinds}

    def rec(prefix: tuple, left: dict) -> Iterator[tuple]:
        if prefix and (not ushape or len(prefix) >= 2) and max(d for _, d in prefix) == top:
            yield prefix
        if len(prefix) >= max_stages:
            return
        for kind, tp in (first if not prefix else cloud):
            for d in dps:
                if tp * d <= left[kind]:
                    yield from rec(prefix + ((StageSpec(kind, tp), d),),
                                   {**left, kind: left[kind] - tp * d})

    yield from rec((), left0)


def recompute_options(cost: CostModel, chunk_layers: list[int], holds_moe: bool = False
                      ) -> list[Optional[Recompute]]:
    """Every recomputation megatron accepts on a stage whose chunks have these layer counts
    (``holds_moe``: some of them MoE layers)."""
    modules = (["core_attn", "layernorm"] + ([] if cost.model.add_bias_linear else ["mlp"])
               + (["moe"] if holds_moe else []))
    out: list[Optional[Recompute]] = [None]
    for k in range(1, len(modules) + 1):
        out += [Recompute("selective", modules=c) for c in itertools.combinations(modules, k)]
    widest = max(chunk_layers)
    out += [Recompute("full", "uniform", n) for n in range(1, widest + 1)
            if all(c % n == 0 for c in chunk_layers)]
    out += [Recompute("full", "block", n) for n in range(1, widest + 1)]
    return out


def _recomputation(plan: Plan, ev: Evaluation, cost: CostModel
                   ) -> Optional[tuple[Optional[Recompute], ...]]:
    """Per stage, the fitting recomputation that adds the least time (None: a stage fits with
    none); None when some stage fits with none of them."""
    chosen = []
    for i, st in enumerate(plan.stages):
        chunks = plan.stage_chunks(i, ev.stages[i].inflight, cost)
        limit, buffers = cost.memory_limit(st.kind), plan.recv_buffers(i)
        best = None
        for rc in recompute_options(cost, [c.layers for c in chunks], cost.holds_moe(chunks)):
            stated = [replace(c, recompute=rc) for c in chunks]
            if cost.stage_memory(st.kind, st.tp, stated, buffers).total > limit:
                continue
            extra = sum(cost.recompute_time(st.kind, st.tp, c.layers, rc, cost.moe_share(c))
                        for c in chunks)
            if best is None or extra < best[0]:
                best = (extra, rc)
        if best is None:
            return None
        chosen.append(best[1])
    return tuple(chosen)


def _lower_bound(plan: Plan, cost: CostModel) -> float:
    """A time the plan cannot beat, without recomputation (which only adds time): a lane of
    stage k runs its ``m * D / d_k`` micro-batches after micro-batch 0 has passed the stages
    before it forward and before it returns through them backward (a U-shape: the chain of
    logical stages edge start, cloud stages, edge end; the edge's lane runs both of its
    chunks), plus the replicas' all-reduce."""
    m, top = plan.num_microbatches, plan.dp
    w, runs = [], []
    for i, st in enumerate(plan.stages):
        times = [sum(cost.chunk_time(st.kind, st.tp, c)) for c in plan.stage_chunks(i, cost=cost)]
        w.append(times)
        runs.append(m * top // plan.dp_of(i))
    if plan.u_shape:
        chain = [w[0][0]] + [t[0] for t in w[1:]]
        bound = max([runs[0] * sum(w[0])] + [runs[k] * chain[k] + sum(chain[:k])
                                              for k in range(1, len(chain))])
    else:
        flat = [t[0] for t in w]
        bound = max(runs[k] * flat[k] + sum(flat[:k]) for k in range(len(flat)))
    return bound + dp_allreduce(plan, cost)


def exhaustive(inventory: Inventory, model: ModelConfig, workload: Workload,
               max_stages: Optional[int] = None,
               objective: Optional[Objective] = None) -> ExhaustiveResult:
    """The objective's pick over the whole (small) search space, and the fastest plan. Plans
    are simulated in the order of their lower bound (times the hourly price with ``cost``),
    so the search stops at the first whose bound is past what the objective could pick."""
    objective = objective or Objective()
    cost = CostModel(model, inventory, workload.micro_batch_size, workload.dtype,
                     workload.flash_attention, recompute=False)
    ushape = inventory.edge is not None if workload.u_shape is None else bool(workload.u_shape)
    L, b, g = model.num_layers, workload.micro_batch_size, workload.global_batch_size
    emin = workload.edge_min_layers
    by_cost = objective.minimise == "cost"
    queue = []
    for top in range(1, inventory.total_devices + 1):
        if (g // b) % top:
            continue
        m = g // (b * top)
        for seq in stage_sequences(inventory, model, ushape, top, max_stages or L):
            stages = tuple(s for s, _ in seq)
            dps = tuple(d for _, d in seq)
            lows = [emin] + [1] * (len(stages) - 1) + [emin] if ushape else [1] * len(stages)
            stage_dp = () if len(set(dps)) == 1 else dps
            for layers in _compositions(L, lows):
                for prefetch in range(MAX_PREFETCH + 1 if ushape else 1):
                    plan = Plan(stages, layers, ushape, top, m, prefetch, stage_dp)
                    bound = _lower_bound(plan, cost)
                    key = bound * hourly_price(plan, inventory) / 3600 if by_cost else bound
                    queue.append((key, len(queue), plan))
    queue.sort(key=lambda x: x[:2])
    kept: list[Evaluation] = []
    best: Optional[float] = None  # the fastest time (time) or the cheapest cost (cost) found
    plans = sims = 0
    for key, _, plan in queue:
        if best is not None and key > best * (1 + objective.tolerance):
            break  # every later plan is at least this slow (costly): none can be picked
        ev = simulate_plan(plan, cost)
        sims += 1
        if not ev.fits:
            rc = _recomputation(plan, ev, cost) if workload.recompute else None
            if rc is None:
                continue
            ev = simulate_plan(replace(plan, recompute=rc), cost)
            sims += 1
        plans += 1
        kept.append(ev)
        value = step_cost(ev, inventory) if by_cost else ev.iteration_time
        best = value if best is None else min(best, value)
    if not kept:
        return ExhaustiveResult(None, plans, sims)
    pick, _ = choose(kept, inventory, objective)
    pick, _ = choose_schedule(pick, cost, inventory, objective)  # today's, or zero-bubble
    # the fastest as the planner's front has it: its pick on the zero-bubble schedule counts
    return ExhaustiveResult(pick, plans, sims,
                            min(kept + [pick], key=lambda e: e.iteration_time))
