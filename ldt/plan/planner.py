"""The planner: inventory + model + workload -> a pipeline plan that fits in memory, chosen on
iteration time and cost per step by an :class:`ldt.plan.objective.Objective`.

Search, coarse to fine (each step exists because the next one is too slow to run on everything);
at every step the candidates are taken from a few lists: by time (the fastest), the cheapest
within reach of the fastest (what the default objective picks), by cost per step, and points
of the front between time and cost (what ``ldt-plan`` shows); with ``minimise="cost"`` the
cost list leads:

1. :func:`ldt.plan.candidates.stage_sets` enumerates dp sizes and per-kind stage groups (also
   ones using fewer devices than there are) with an estimated time and an hourly price (numpy,
   milliseconds even for 1024 devices);
2. the best ``split_sets`` stage sets by the leading list, and ``objective_sets`` more from the
   others, get an exact layer split for every order of their kind blocks
   (:func:`ldt.plan.split.best_split`, bottleneck search with memory caps) and a closed-form
   1F1B time; sets whose split does not fit in memory are skipped and the next set is taken;
3. plans are simulated on the real schedule (``ldt.schedule``), the leading list's closed-form
   order taking every other turn: at least ``simulate_min``, more while the simulated actions
   stay within ``simulate_work`` (all of them on small instances). Effort is counted in
   simulated actions, not seconds, so a busy machine plans exactly what an idle one does;
4. the fastest few simulated plans and as many of the objective's candidates are refined by
   moving single layers between segments, judged by the simulator (``refine_work``);
5. a U-shape gets the prefetch depth that hides its edge links' latency
   (:func:`ldt.plan.evaluate.choose_prefetch`): once on the best closed form before step 3 (the
   search compares plans at that depth), then for each start of step 4 and for the pick;
6. a U-shape's fastest plan may give its cloud stages more replicas than the edge (VDP; not
   tried when the edge's busy time already bounds the step);
7. every simulated plan joins the time/cost front, and the objective picks from them;
8. the pick is timed on its zero-bubble schedule too (ZB-H1 or the zero-bubble U-shape,
   generated from the plan's prices, its W store in memory: :mod:`ldt.plan.zb_prices`), and
   the objective picks between the two (``Evaluation.schedule``; ``ldt-plan`` writes
   ``schedule: zb`` into the plan's train file when that one wins); up to
   :data:`ldt.plan.zb_prices.PLANNER_LIMIT` stage-micro-batches.

Simulated iteration time (pipeline + data-parallel all-reduce) and cost per step (its devices'
hourly price times that time) are the numbers that are compared and reported.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Iterator, Optional, TypeVar

from ldt.config import ConfigError, ModelConfig
from ldt.plan.candidates import SHARED_UP_TO, orders, stage_sets
from ldt.plan.cost import CostModel
from ldt.plan.evaluate import (Evaluation, Plan, StageSpec, choose_prefetch, closed_form,
                               with_layers)
from ldt.plan.inventory import Inventory, Workload
from ldt.plan.objective import (Objective, choose, hourly_price, ms, pareto_front, spread,
                                step_cost)
from ldt.plan.pricing import Simulator
from ldt.plan.split import best_split
from ldt.plan.zb_prices import PLANNER_LIMIT, choose_schedule, runs_zb, too_long
from ldt.topology.validate import per_stage_dp_refusal, planner_mtp_refusal

T = TypeVar("T")
_END = object()

REACH = {"estimate": 0.10, "closed_form": 0.05, "simulated": 0.03}
"""How much slower than the fastest a candidate may look, beyond the objective's tolerance, and
still be taken as one the objective may pick: the estimate, the closed form and an unrefined
simulation are that much less exact than the final simulated time."""


@dataclass
class PlannerOptions:
    split_sets: int = 64
    """Stage sets of the leading list (by estimated time; by estimated cost with
    ``minimise="cost"``) that get an exact split, counting only ones that fit."""
    objective_sets: int = 24
    """Stage sets from the other lists that get an exact split besides (only ones that fit)."""
    simulate_min: int = 6
    """Plans of the leading list, best closed form first, that are always simulated."""
    simulate_max: int = 400
    """Most plans simulated before the local search."""
    simulate_work: int = 300_000
    """Past the plans always simulated, simulate more only while the effort so far (simulated
    actions, see :class:`Simulator`) stays within this: ~0.5 s on a 2-core machine, and
    deterministic, unlike a time budget."""
    refine_top: int = 3
    """Plans of each list the local search starts from (best first)."""
    refine_sims: int = 80
    """Simulations the local search may spend per start."""
    refine_work: int = 200_000
    """Effort (simulated actions) the local search may spend, over all its starts."""
    max_stages: Optional[int] = None
    """Upper bound on pipeline stages (None: the layer count)."""
    zero_bubble: bool = True
    """Step 8: time the pick on its zero-bubble schedule too and keep the objective's choice
    (False: today's schedule only, for a world that will not run ``train.schedule=zb``)."""
    per_stage_dp: bool = True
    """Plans whose stages have their own dp (docs/vdp.md) are candidates where the model allows
    them (False: one dp for all, for a run that cannot train them:
    :func:`ldt.topology.validate.per_stage_dp_refusal`)."""


@dataclass
class PlanResult:
    best: Evaluation
    """The plan the objective picks (``reason`` says why)."""
    ranked: list[Evaluation]
    """Simulated candidates before the local search, fastest first."""
    stage_sets_scored: int
    plans_split: int
    simulations: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    front: list[Evaluation] = field(default_factory=list)
    """The plans met that no other beats on both time and cost per step, fastest first."""
    reason: str = ""
    objective: Objective = field(default_factory=Objective)


def make_cost(inventory: Inventory, model: ModelConfig, workload: Workload) -> CostModel:
    return CostModel(model, inventory, workload.micro_batch_size, workload.dtype,
                     workload.flash_attention, workload.recompute)


def wants_ushape(inventory: Inventory, workload: Workload) -> bool:
    return inventory.edge is not None if workload.u_shape is None else bool(workload.u_shape)


def plan(inventory: Inventory, model: ModelConfig, workload: Workload,
         options: Optional[PlannerOptions] = None,
         objective: Optional[Objective] = None) -> PlanResult:
    """Search stage formation, order, layer split and dp; return the plan the objective picks
    among the simulated ones, with the time/cost front they form."""
    opts, objective = options or PlannerOptions(), objective or Objective()
    mtp_refusal = planner_mtp_refusal(model.mtp_num_layers)
    if mtp_refusal is not None:
        raise ConfigError(mtp_refusal)
    t0 = time.perf_counter()
    cost = make_cost(inventory, model, workload)
    ushape = wants_ushape(inventory, workload)
    edge_min = workload.edge_min_layers
    # only plans ldt-train accepts for this model (e.g. no tied embeddings across replicas)
    per_stage_dp = opts.per_stage_dp and per_stage_dp_refusal(model, None, ushape) is None
    sets, scored = stage_sets(cost, ushape, workload.global_batch_size, model.num_layers,
                              opts.max_stages, edge_min, per_stage_dp)
    plans, used = _split_sets(sets, cost, ushape, model.num_layers, opts, objective, edge_min)
    if not plans:
        raise ConfigError(_nothing_fits(inventory, model, workload, scored))
    plans.sort(key=lambda pc: pc[1])
    sim = Simulator(cost)
    if ushape:  # the depth that hides the edge links' latency, on the best closed form; the
        # search then compares plans at that depth (it depends on latency vs. per-micro-batch
        # compute, which plans of one inventory share) and step 5 revisits it for each start
        depth = choose_prefetch(sim(plans[0][0]), cost, simulate=sim).plan.prefetch
        plans = [(replace(p, prefetch=depth), c) for p, c in plans]
    ranked = _simulate_ranked(plans, sim, opts, objective, inventory)
    pool = list(ranked)
    starts = _refine_starts(ranked, inventory, objective, opts.refine_top)
    end = sim.work + opts.refine_work
    for i, start in enumerate(starts):
        if i >= 2 and sim.work >= end:  # the first start of each list always runs
            break
        start = choose_prefetch(start, cost, simulate=sim)  # U-shape: this plan's own depth
        share = max(0, end - sim.work) // (len(starts) - i)
        pool += [start, refine(start, sim, opts.refine_sims, share, edge_min)]
    notes: list[str] = []
    fits = [e for e in pool if e.fits]
    fastest = min(fits, key=lambda e: e.iteration_time) if fits else None
    # per-stage DP: more cloud replicas behind the same edge, if devices allow; the edge keeps
    # its work, so no such plan beats the edge's busy time: skip when that is within tolerance
    if ushape and per_stage_dp and fastest and (fastest.iteration_time
                               > fastest.stages[0].busy * (1 + objective.tolerance)):
        vdp, _, note = _try_vdp(fastest, cost, inventory, workload, opts, edge_min, sim)
        pool.append(vdp)
        notes += [note] if note else []
    best, reason = _pick(pool, inventory, objective, cost, sim)
    if opts.zero_bubble:
        best, reason = _schedule(best, reason, pool, cost, inventory, objective, notes)
    return PlanResult(best, ranked, scored, used, sim.runs, time.perf_counter() - t0,
                      notes=notes, front=pareto_front(pool, inventory), reason=reason,
                      objective=objective)


def _pick(pool: list[Evaluation], inventory: Inventory, objective: Objective, cost: CostModel,
          sim: Simulator) -> tuple[Evaluation, str]:
    """The objective's pick, simulated in full and at its own prefetch depth (U-shape): when
    that changes the pick's numbers, its other variants leave ``pool`` and the objective picks
    again. Nothing fits: the fastest plan, which the report marks as not fitting."""
    if not any(e.fits for e in pool):
        return min(pool, key=lambda e: e.iteration_time), "no plan fits in memory"
    for _ in range(4):
        best, reason = choose(pool, inventory, objective)
        final = best if best.sim is not None else sim.exact(best.plan)
        final = choose_prefetch(final, cost, simulate=sim)
        if final is best:
            return best, reason
        if final.sim is None:  # its depth's variant was extrapolated too
            final = sim.exact(final.plan)
        same = replace(best.plan, prefetch=0)
        pool[:] = [e for e in pool if replace(e.plan, prefetch=0) != same] + [final]
    return choose(pool, inventory, objective)


def _schedule(best: Evaluation, reason: str, pool: list[Evaluation], cost: CostModel,
              inventory: Inventory, objective: Objective, notes: list[str]
              ) -> tuple[Evaluation, str]:
    """Step 8: the pick on today's schedule or its zero-bubble one (``train.schedule=zb``,
    :func:`ldt.plan.zb_prices.choose_schedule`), as the objective picks between them; the
    zero-bubble evaluation joins ``pool`` (the front)."""
    today = best
    best, zb = choose_schedule(today, cost, inventory, objective)
    if zb is None:
        if runs_zb(today.plan) and too_long(today.plan):
            p = today.plan
            notes.append(f"not timed on the zero-bubble schedule: {p.num_stages} stages x "
                         f"{p.num_microbatches} micro-batches is past {PLANNER_LIMIT} (ldt-sim "
                         "--schedule zb prices it)")
        return best, reason
    pool.append(zb)
    verdict = (f"the zero-bubble schedule (train.schedule=zb): {ms(zb.iteration_time)} ms "
               f"against {ms(today.iteration_time)} ms on today's"
               + ("" if zb.fits else ", but its W store does not fit"))
    if best is zb:
        return best, reason + f"; on {verdict}"
    notes.append(f"kept today's schedule over {verdict}")
    return best, reason


def _round_robin(lists: list[Iterable[T]]) -> Iterator[T]:
    """One item of each list in turn, each item (by identity) once."""
    iters, seen = [iter(x) for x in lists], set()
    while iters:
        for it in list(iters):
            item = next(it, _END)
            if item is _END:
                iters.remove(it)
            elif id(item) not in seen:
                seen.add(id(item))
                yield item


def _lists(items: list[T], time_of: Callable[[T], float], cost_of: Callable[[T], float],
           objective: Objective, reach: float) -> list[list[T]]:
    """The candidate lists, the objective's leading one first: by time; the cheapest within
    ``tolerance + reach`` of the fastest; by cost; the time/cost front (spread: its ends, then
    its middle, ...)."""
    if not items:
        return [[]]
    by_time = sorted(items, key=time_of)
    by_cost = sorted(items, key=lambda x: (cost_of(x), time_of(x)))
    limit = time_of(by_time[0]) * (1 + objective.tolerance + reach)
    within = [x for x in by_cost if time_of(x) <= limit]
    front: list[T] = []
    for x in by_time:
        if not front or cost_of(x) < cost_of(front[-1]):
            front.append(x)
    front = [front[i] for i in spread(len(front))]
    if objective.minimise == "cost":
        return [by_cost, front, by_time]
    return [by_time, within, by_cost, front]


def _split_sets(sets, cost: CostModel, ushape: bool, num_layers: int, opts: PlannerOptions,
                objective: Objective, edge_min: int) -> tuple[list[tuple[Plan, float]], int]:
    """Exact split of every order of the shortlisted stage sets: ``split_sets`` that fit from
    the leading list, then ``objective_sets`` more from the others in turn."""
    lists = _lists(sets, lambda s: s.estimate, lambda s: s.estimated_cost, objective,
                   REACH["estimate"])
    plans: list[tuple[Plan, float]] = []
    seen: set = set()
    memo: dict = {}
    tried = 0

    def take(source: Iterable, wanted: int) -> None:
        nonlocal tried
        fitted = 0
        for ss in source:
            if fitted >= wanted:
                break
            if ss in seen:
                continue
            seen.add(ss)
            ok = False
            for seq in orders(ss, ushape):
                tried += 1
                stages = tuple(StageSpec(k, t) for k, t in seq)
                stage_dp = tuple(ss.dp_of_kind(k) for k, _ in seq) if ss.kind_dp else ()
                layers = best_split(stages, ushape, ss.num_microbatches, cost, num_layers,
                                    edge_min, memo, stage_dp)
                if layers is None:
                    continue
                p = Plan(stages, layers, ushape, ss.dp, ss.num_microbatches,
                         stage_dp=stage_dp)
                plans.append((p, closed_form(p, cost)))
                ok = True
            fitted += ok

    # the best set of each replica structure (dp, per-stage dp, the kinds used) first: the
    # estimate's error differs between them (a set of many replicas has little fill and
    # drain, one of a few layers per stage rounds them), and a structure must not lose on
    # that error alone
    firsts: dict = {}
    if cost.inventory.total_devices <= SHARED_UP_TO:  # past it the sets are many, and the
        for ss in lists[0]:  # plain lists serve (their errors matter less at scale)
            firsts.setdefault((ss.dp, ss.kind_dp, tuple(name for name, _ in ss.groups)), ss)
    take(firsts.values(), len(firsts))
    take(lists[0], opts.split_sets)
    take(_round_robin(lists[1:]), opts.objective_sets)
    return plans, tried


def _simulate_ranked(plans: list[tuple[Plan, float]], sim: Simulator, opts: PlannerOptions,
                     objective: Objective, inventory: Inventory) -> list[Evaluation]:
    """Simulate plans from the closed-form lists, the leading one and the others in turn: at
    least ``simulate_min`` of the leading one (and 2 of the cheapest within reach of the
    fastest), more while each side's share of ``simulate_work`` lasts (the leading list 2/3:
    the others' plans, long ones of few replicas among them, must not crowd it out); fitting
    ones, fastest first."""
    price = {id(p): hourly_price(p, inventory) for p, _ in plans}
    lists = _lists(plans, lambda pc: pc[1], lambda pc: pc[1] * price[id(pc[0])], objective,
                   REACH["closed_form"])
    must = {id(pc) for pc in lists[0][:opts.simulate_min]}
    if objective.minimise == "time":  # the plans the default objective picks from
        must |= {id(pc) for pc in lists[1][:2]}
    sides = [[iter(lists[0]), 2 * opts.simulate_work // 3, 0],
             [_round_robin(lists[1:]), opts.simulate_work // 3, 0]]
    out: list[Evaluation] = []
    seen: set[int] = set()
    while sides and len(out) < opts.simulate_max:
        for side in list(sides):
            source, share, spent = side
            pc = next((x for x in source if id(x) not in seen), None)
            if pc is None or (spent >= share and id(pc) not in must):
                sides.remove(side)
                continue
            seen.add(id(pc))
            if id(pc) not in must and spent + sim.effort(pc[0]) > share:
                continue  # too long for what is left; a shorter one may fit
            before = sim.work
            out.append(_shallower_if_needed(sim(pc[0]), sim))
            side[2] += sim.work - before
    return sorted((e for e in out if e.fits), key=lambda e: e.iteration_time) or out


def _shallower_if_needed(ev: Evaluation, sim: Simulator) -> Evaluation:
    """A U-shape that does not fit at the search's prefetch depth (step 5 chose it on the best
    closed form) at the deepest shallower one where it fits: a plan on fewer devices may fit
    only with fewer micro-batches in flight."""
    for depth in range(ev.plan.prefetch - 1, -1, -1):
        if ev.fits:
            break
        shallower = sim(replace(ev.plan, prefetch=depth))
        ev = shallower if shallower.fits else ev
    return ev


def _refine_starts(ranked: list[Evaluation], inventory: Inventory, objective: Objective,
                   k: int) -> list[Evaluation]:
    """The first ``k`` simulated plans of the leading list and of the next one, in turn (the
    cheapest within reach of the fastest; under ``minimise="cost"`` the front's ends)."""
    fits = [e for e in ranked if e.fits] or ranked[:1]
    lists = _lists(fits, lambda e: e.iteration_time, lambda e: step_cost(e, inventory),
                   objective, REACH["simulated"])
    return list(_round_robin([lists[0][:k]] + [x[:k] for x in lists[1:2]]))


def _try_vdp(best: Evaluation, cost: CostModel, inventory: Inventory, workload: Workload,
             opts: PlannerOptions, edge_min: int, sim: Optional[Simulator] = None
             ) -> tuple[Evaluation, int, str]:
    """Step 6 (U-shape): keep the edge's replicas, give the cloud stages k = 2, 4 times as many
    (docs/vdp.md), with the same TP (more devices) or TP / k (the same devices), same global
    batch; take it when it fits the inventory and the memory and the simulator (the lane
    schedule, refined) finds it faster. Returns the faster plan, the simulations spent, a note."""
    sim = sim or Simulator(cost)
    plan, runs, note = best.plan, sim.runs, ""
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
        ev = refine(sim(cand), sim, opts.refine_sims, opts.refine_work // 8, edge_min)
        ev = choose_prefetch(ev, cost, simulate=sim)  # the depth for this plan's links and lanes
        if ev.fits and ev.iteration_time < best.iteration_time:
            note = (f"per-stage dp {list(stage_dp)}, TP {[st.tp for st in stages]} (the edge "
                    f"serves {k} cloud replicas) beats "
                    f"uniform dp {plan.dp}: {ev.iteration_time * 1e3:.2f} ms vs "
                    f"{best.iteration_time * 1e3:.2f} ms")
            best = ev
    return best, sim.runs - runs, note


def _nothing_fits(inventory: Inventory, model: ModelConfig, workload: Workload, n: int) -> str:
    mem = ", ".join(f"{k.name}: {k.count} x {k.memory_gib} GiB" for k in inventory.kinds)
    return (f"no plan fits: {n} stage sets of inventory {inventory.name!r} ({mem}) were tried for "
            f"model {model.name!r} ({model.num_layers} layers, hidden {model.hidden_size}) with "
            f"micro_batch_size={workload.micro_batch_size}, global_batch_size="
            f"{workload.global_batch_size}; lower micro_batch_size, "
            + ("price fused attention on cuda stages (drop --no-flash), "
               if workload.flash_attention is False else "")
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


def refine(start: Evaluation, sim: Simulator, max_sims: int, max_work: int,
           edge_min: int = 1) -> Evaluation:
    """First-improvement hill climb over one-layer moves, judged by the simulator, until no move
    helps or ``max_sims`` new simulations or ``max_work`` simulated actions are spent."""
    best, runs, work = start, sim.runs, sim.work
    improved = True
    while improved and sim.runs - runs < max_sims and sim.work - work < max_work:
        improved = False
        for layers in _neighbours(best.plan, edge_min):
            if sim.runs - runs >= max_sims or sim.work - work >= max_work:
                break
            cand = with_layers(best.plan, layers)
            if closed_form(cand, sim.cost) > 1.5 * best.iteration_time:
                continue  # clearly worse; not worth a simulation
            ev = sim(cand)
            if ev.fits and ev.iteration_time < best.iteration_time * (1 - 1e-12):
                best, improved = ev, True
                break
    return best
