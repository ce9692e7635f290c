"""The planner: inventory + model + workload -> the fastest pipeline plan that fits in memory.

Search, coarse to fine (each step exists because the next one is too slow to run on everything):

1. :func:`ldt.plan.candidates.stage_sets` enumerates dp sizes and per-kind stage groups and ranks
   them by a continuous estimate (numpy, milliseconds even for 1024 devices);
2. for the best stage sets, every order of the kind blocks gets an exact layer split
   (:func:`ldt.plan.split.best_split`, bottleneck bisection with memory caps) and a closed-form
   1F1B time; sets whose split does not fit in memory are skipped and the next set is taken;
3. plans are simulated on the real schedule (``ldt.schedule``) in closed-form order, as many
   as a time budget allows (all of them on small instances);
4. the best few simulated plans are refined by moving single layers between segments, judged by the
   simulator, within a budget of simulations;
5. a U-shape gets the prefetch depth that hides its edge links' latency
   (:func:`ldt.plan.evaluate.choose_prefetch`): once on the best closed form before step 3 (the
   search compares plans at that depth), then for each start of step 4 and for the winner.

The simulated iteration time (pipeline + data-parallel all-reduce) is the number that is
minimised and reported.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Optional

from ldt.config import ConfigError, ModelConfig
from ldt.plan.candidates import orders, stage_sets
from ldt.plan.cost import CostModel
from ldt.plan.evaluate import (Evaluation, Plan, StageSpec, choose_prefetch, closed_form,
                               simulate_plan, with_layers)
from ldt.plan.inventory import Inventory, Workload
from ldt.plan.split import best_split


@dataclass
class PlannerOptions:
    split_sets: int = 64
    """Stage sets (after the quick estimate) that get an exact split, counting only ones that fit."""
    simulate_min: int = 6
    """Plans, best closed form first, that are always simulated."""
    simulate_max: int = 400
    """Most plans simulated before the local search."""
    simulate_seconds: float = 1.0
    """Past ``simulate_min`` plans, simulate more only while within this time (the closed form
    ranks heterogeneous and U-shape pipelines only roughly; the simulator decides)."""
    refine_top: int = 3
    """Simulated plans the local search starts from (best first)."""
    refine_sims: int = 80
    """Simulations the local search may spend per start."""
    refine_seconds: float = 1.5
    """Wall-clock cap of the local search."""
    max_stages: Optional[int] = None
    """Upper bound on pipeline stages (None: the layer count)."""


@dataclass
class PlanResult:
    best: Evaluation
    ranked: list[Evaluation]
    """Simulated candidates, best first (``best`` is refined from ``ranked[0]``)."""
    stage_sets_scored: int
    plans_split: int
    simulations: int
    seconds: float
    notes: list[str] = field(default_factory=list)


def make_cost(inventory: Inventory, model: ModelConfig, workload: Workload) -> CostModel:
    return CostModel(model, inventory, workload.micro_batch_size, workload.dtype,
                     workload.flash_attention, workload.recompute)


def wants_ushape(inventory: Inventory, workload: Workload) -> bool:
    return inventory.edge is not None if workload.u_shape is None else bool(workload.u_shape)


def plan(inventory: Inventory, model: ModelConfig, workload: Workload,
         options: Optional[PlannerOptions] = None) -> PlanResult:
    """Search stage formation, order, layer split and dp; return the best simulated plan."""
    opts = options or PlannerOptions()
    t0 = time.perf_counter()
    cost = make_cost(inventory, model, workload)
    ushape = wants_ushape(inventory, workload)
    sets = stage_sets(cost, ushape, workload.global_batch_size, model.num_layers, opts.max_stages)
    edge_min = workload.edge_min_layers
    plans, used = _split_best_sets(sets, cost, ushape, model.num_layers, opts.split_sets, edge_min)
    if not plans:
        raise ConfigError(_nothing_fits(inventory, model, workload, len(sets)))
    plans.sort(key=lambda pc: pc[1])
    if ushape:  # the depth that hides the edge links' latency, on the best closed form; the
        # search then compares plans at that depth (it depends on latency vs. per-micro-batch
        # compute, which plans of one inventory share) and step 5 revisits it for the winner
        depth = choose_prefetch(simulate_plan(plans[0][0], cost), cost).plan.prefetch
        plans = [(replace(p, prefetch=depth), c) for p, c in plans]
    ranked = _simulate_ranked([p for p, _ in plans], cost, opts)
    best, sims = ranked[0], len(ranked)
    for start in ranked[:opts.refine_top]:
        start = choose_prefetch(start, cost)  # U-shape: this plan's own depth
        ev, n = refine(start, cost, opts.refine_sims, opts.refine_seconds / opts.refine_top,
                       edge_min)
        sims += n
        if ev.fits and ev.iteration_time < best.iteration_time:
            best = ev
    best = choose_prefetch(best, cost)  # U-shape: hide the edge links' latency if it pays
    notes = []
    if ushape:  # per-stage DP: more cloud replicas behind the same edge, if devices allow
        best, n, note = _try_vdp(best, cost, inventory, workload, opts, edge_min)
        sims += n
        notes += [note] if note else []
    return PlanResult(best, ranked, len(sets), used, sims, time.perf_counter() - t0,
                      notes=notes)


def _try_vdp(best: Evaluation, cost: CostModel, inventory: Inventory, workload: Workload,
             opts: PlannerOptions, edge_min: int) -> tuple[Evaluation, int, str]:
    """Step 6 (U-shape): keep the edge's replicas, give the cloud stages k = 2, 4 times as many
    (docs/vdp.md), with the same TP (more devices) or TP / k (the same devices), same global
    batch; take it when it fits the inventory and the memory and the simulator (the lane
    schedule, refined) finds it faster."""
    plan, sims, note = best.plan, 0, ""
    edge_dp = plan.dp_of(0)
    heads = cost.model.num_query_groups or cost.model.num_attention_heads
    for k, shrink in ((2, False), (2, True), (4, False), (4, True)):
        dp = edge_dp * k
        if workload.global_batch_size % (dp * workload.micro_batch_size):
            continue
        m = workload.global_batch_size // (dp * workload.micro_batch_size)
        stage_dp = (edge_dp,) + (dp,) * (plan.num_stages - 1)
        stages = plan.stages
        if shrink:
            if any(st.tp % k or heads % (st.tp // k) for st in stages[1:]):
                continue
            stages = stages[:1] + tuple(replace(st, tp=st.tp // k) for st in stages[1:])
        used: dict[str, int] = {}
        for st, d in zip(stages, stage_dp):
            used[st.kind] = used.get(st.kind, 0) + st.tp * d
        if any(n > inventory.kind(kind).count for kind, n in used.items()):
            continue
        cand = replace(plan, stages=stages, dp=dp, num_microbatches=m, stage_dp=stage_dp)
        ev = simulate_plan(cand, cost)
        ev, n = refine(ev, cost, opts.refine_sims, opts.refine_seconds / 2, edge_min)
        ev = choose_prefetch(ev, cost)  # the depth for this plan's links and lanes
        sims += 1 + n
        if ev.fits and ev.iteration_time < best.iteration_time:
            note = (f"per-stage dp {list(stage_dp)}, TP {[st.tp for st in stages]} (the edge "
                    f"serves {k} cloud replicas) beats "
                    f"uniform dp {plan.dp}: {ev.iteration_time * 1e3:.2f} ms vs "
                    f"{best.iteration_time * 1e3:.2f} ms")
            best = ev
    return best, sims, note


def _split_best_sets(sets, cost: CostModel, ushape: bool, num_layers: int, wanted: int,
                     edge_min: int):
    """Exact split of every order of the best stage sets until ``wanted`` sets fit."""
    plans: list[tuple[Plan, float]] = []
    fitted = tried = 0
    for ss in sets:
        if fitted >= wanted:
            break
        ok = False
        for seq in orders(ss, ushape):
            tried += 1
            stages = tuple(StageSpec(k, t) for k, t in seq)
            layers = best_split(stages, ushape, ss.num_microbatches, cost, num_layers, edge_min)
            if layers is None:
                continue
            p = Plan(stages, layers, ushape, ss.dp, ss.num_microbatches)
            plans.append((p, closed_form(p, cost)))
            ok = True
        fitted += ok
    return plans, tried


def _simulate_ranked(plans: list[Plan], cost: CostModel, opts: PlannerOptions) -> list[Evaluation]:
    """Simulate plans in closed-form order: at least ``simulate_min``, more while time allows."""
    t0, out = time.perf_counter(), []
    for i, p in enumerate(plans[:opts.simulate_max]):
        if i >= opts.simulate_min and time.perf_counter() - t0 > opts.simulate_seconds:
            break
        out.append(simulate_plan(p, cost))
    return sorted((e for e in out if e.fits), key=lambda e: e.iteration_time) or out


def _nothing_fits(inventory: Inventory, model: ModelConfig, workload: Workload, n: int) -> str:
    mem = ", ".join(f"{k.name}: {k.count} x {k.memory_gib} GiB" for k in inventory.kinds)
    return (f"no plan fits: {n} stage sets of inventory {inventory.name!r} ({mem}) were tried for "
            f"model {model.name!r} ({model.num_layers} layers, hidden {model.hidden_size}) with "
            f"micro_batch_size={workload.micro_batch_size}, global_batch_size="
            f"{workload.global_batch_size}; lower micro_batch_size, use flash_attention, "
            + ("" if workload.recompute else "let stages recompute (drop --no-recompute), ")
            + "or add devices / memory")


def _neighbours(plan: Plan, edge_min: int) -> list[tuple[int, ...]]:
    """Splits one layer away from ``plan``: adjacent segments (any pair when P is small)."""
    n, lay = len(plan.layers), plan.layers
    pairs = ([(i, j) for i in range(n) for j in range(n) if i != j] if n <= 8 else
             [(i, i + 1) for i in range(n - 1)] + [(i + 1, i) for i in range(n - 1)])
    if plan.u_shape:
        pairs += [(0, n - 1), (n - 1, 0)]
    out = []
    for src, dst in dict.fromkeys(pairs):
        cloud_or_plain = not plan.u_shape or 0 < src < n - 1
        if lay[src] - 1 < (1 if cloud_or_plain else edge_min):
            continue
        new = list(lay)
        new[src] -= 1
        new[dst] += 1
        out.append(tuple(new))
    return out


def refine(start: Evaluation, cost: CostModel, max_sims: int, max_seconds: float,
           edge_min: int = 1) -> tuple[Evaluation, int]:
    """First-improvement hill climb over one-layer moves, judged by the simulator."""
    best, sims, t0 = start, 0, time.perf_counter()
    improved = True
    while improved and sims < max_sims and time.perf_counter() - t0 < max_seconds:
        improved = False
        for layers in _neighbours(best.plan, edge_min):
            if sims >= max_sims or time.perf_counter() - t0 >= max_seconds:
                break
            cand = with_layers(best.plan, layers)
            if closed_form(cand, cost) > 1.5 * best.iteration_time:
                continue  # clearly worse; not worth a simulation
            ev = simulate_plan(cand, cost)
            sims += 1
            if ev.fits and ev.iteration_time < best.iteration_time * (1 - 1e-12):
                best, improved = ev, True
                break
    return best, sims
