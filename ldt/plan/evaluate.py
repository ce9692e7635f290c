"""Price a pipeline plan: closed-form estimate, and a timed run of the real schedule.

A :class:`Plan` is one pipeline replica (ordered stages of one device kind and TP size each, a
contiguous layer split) repeated ``dp`` times. :func:`simulate_plan` turns the cost model into
per-action durations and runs :func:`ldt.schedule.simulate` on the very action lists the runtime
executes (``one_f_one_b`` / ``u_shape`` lowered with communication), so the planner ranks plans
by the schedule that will run, not by a second model of it. :func:`closed_form` is the cheap
estimate used to prune before simulating.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Callable, Optional

from ldt.config.layout import LayerSplit, split_of_counts
from ldt.plan.cost import ChunkLoad, CostModel
from ldt.plan.memory_cost import Memory, Recompute
from ldt.schedule import Op, SimResult, lower, one_f_one_b, prepare, simulate, u_shape
from ldt.schedule.routing import Lanes
from ldt.schedule.vdp import vdp_schedule

_split = lru_cache(maxsize=4096)(split_of_counts)
"""The planner asks for the same few splits of many plans."""


@dataclass(frozen=True)
class StageSpec:
    kind: str
    tp: int

@dataclass(frozen=True)
class Plan:
    """One replica's pipeline, replicated ``dp`` times (every replica identical)."""

    stages: tuple[StageSpec, ...]
    layers: tuple[int, ...]
    """Decoder layers per layout segment: P (plain) or P+1 (U-shape; the last is the edge's end
    chunk). E goes on segment 0, L on the last segment."""
    u_shape: bool
    dp: int
    num_microbatches: int
    prefetch: int = 0
    """U-shape only: the schedule's prefetch depth (``train.prefetch``)."""
    stage_dp: tuple[int, ...] = ()
    """Per-stage DP (VDP, docs/vdp.md): replicas of each stage, ``dp`` = the largest; empty:
    every stage has ``dp``. ``num_microbatches`` stays per uniform replica."""
    recompute: tuple[Optional[Recompute], ...] = ()
    """Per stage, its activation recomputation (None: none); empty: none anywhere
    (:func:`fit_recompute` chooses it where a stage would not fit otherwise)."""

    def recompute_of(self, stage: int) -> Optional[Recompute]:
        return self.recompute[stage] if self.recompute else None

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def dp_of(self, stage: int) -> int:
        return self.stage_dp[stage] if self.stage_dp else self.dp

    @property
    def split(self) -> LayerSplit:
        """Which segments (chunks) each stage holds: :func:`ldt.config.layout.split_of_counts`, the
        placement rule of every layout (a U-shape's stage 0: its first and last segment)."""
        return _split(self.layers, self.num_stages, self.u_shape)

    def stage_chunks(self, stage: int, inflight: Optional[tuple[int, int]] = None,
                     cost: Optional[CostModel] = None) -> list[ChunkLoad]:
        """The loads of a stage's chunks (``self.split``'s, with the micro-batches each holds in
        flight); ``inflight`` overrides the closed-form in-flight counts (edge: (start chunk,
        end chunk)), e.g. with the simulator's peaks. With ``cost``, each says how many of its
        layers are MoE layers (:meth:`CostModel.moe_count`), to be priced by them."""
        p, m = self.num_stages, self.num_microbatches
        d = self.prefetch if self.u_shape else 0
        # per-stage DP: a stage with 1/k of the replicas runs k micro-batches per uniform one
        # and holds k times the warm-up (ldt.schedule.vdp)
        k = self.dp // self.dp_of(stage)
        if self.u_shape and stage == 0:
            held = inflight or (min((p + 2 * d) * k + 1, m * k), 1)
        else:
            held = inflight or (min((p + (1 if self.u_shape else 0) - stage + d - 1) * k + 1,
                                    m * k),)
        return [ChunkLoad(c.num_layers, embedding=c.has_embedding, head=c.has_head,
                          inflight=n, recompute=self.recompute_of(stage),
                          moe_layers=cost.moe_count(c.first_layer, c.num_layers) if cost else None)
                for c, n in zip(self.split.stage_chunks(stage), held)]

    def recv_buffers(self, stage: int) -> int:
        """Receives a stage keeps posted at once (``ldt.schedule.lower``): one per incoming
        channel, ``1 + 2 * prefetch`` on the U-shape's links to and from the edge."""
        p = self.num_stages
        if p == 1:
            return 0
        deep = 1 + 2 * self.prefetch if self.u_shape else 1
        if self.u_shape:
            if stage == 0:
                return 2 * deep
            return (deep if stage == 1 else 1) + (deep if stage == p - 1 else 1)
        return 1 if stage in (0, p - 1) else 2

    def layout(self) -> str:
        """The cluster.layout string of this split (written by :mod:`ldt.config.layout`)."""
        return self.split.to_layout_string()

    def stage_names(self) -> list[str]:
        seen: dict[str, int] = {}
        names = []
        for i, st in enumerate(self.stages):
            if self.u_shape and i == 0:
                names.append("edge")
                continue
            names.append(f"{st.kind}_{seen.get(st.kind, 0)}")
            seen[st.kind] = seen.get(st.kind, 0) + 1
        return names

    def describe(self) -> str:
        extra = f" prefetch={self.prefetch}" if self.prefetch else ""
        dp = f"dp={list(self.stage_dp)}" if self.stage_dp else f"dp={self.dp}"
        return f"{dp} m={self.num_microbatches}{extra} {self.describe_stages()}"

    def describe_stages(self) -> str:
        """Each stage's kind, TP and recomputation, and the layout."""
        st = " ".join(f"{s.kind}/tp{s.tp}" + (f"/{self.recompute_of(i).describe()}"
                                               if self.recompute_of(i) else "")
                      for i, s in enumerate(self.stages))
        return f"[{st}] layout={self.layout()}"

@dataclass
class StageReport:
    index: int
    name: str
    kind: str
    device: str
    tp: int
    layers: str
    fwd: float
    """Forward seconds per micro-batch (all chunks)."""
    bwd: float
    busy: float
    """Seconds of compute in one iteration (simulated when available)."""
    memory: Memory
    memory_limit: float
    inflight: tuple[int, ...]

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.memory_limit

@dataclass
class Evaluation:
    plan: Plan
    iteration_time: float
    """Pipeline time plus the data-parallel gradient all-reduce, seconds."""
    pipeline_time: float
    dp_allreduce_time: float
    bubble_fraction: float
    stages: list[StageReport]
    sim: Optional[SimResult] = field(default=None, repr=False)
    schedule: str = "auto"
    """The schedule it was timed on, as ``train.schedule``: ``auto`` (1F1B / the U-shape) or
    ``zb`` (zero-bubble, :mod:`ldt.plan.zb_prices`)."""

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)

@lru_cache(maxsize=64)
def lowered_schedule(num_stages: int, num_microbatches: int, ushape: bool, prefetch: int = 0):
    """The lowered action lists the runtime runs, checked once for timing many plans (cached:
    they depend on P, m, kind, depth)."""
    if ushape:
        return prepare(lower(u_shape(num_stages, num_microbatches, prefetch=prefetch), "ushape",
                             prefetch=prefetch))
    return prepare(lower(one_f_one_b(num_stages, num_microbatches), "1f1b"))

def chunk_times(plan: Plan, cost: CostModel) -> list[list[tuple[float, float]]]:
    """(fwd, bwd) per chunk per stage, one micro-batch."""
    return [[cost.chunk_time(st.kind, st.tp, c) for c in plan.stage_chunks(i, cost=cost)]
            for i, st in enumerate(plan.stages)]

def op_table(plan: Plan, cost: CostModel) -> dict[int, dict[Op, float]]:
    """Duration of every compute op on every stage (edge: FS/FE/BS/BE from its two chunks)."""
    table = {}
    for i, chunks in enumerate(chunk_times(plan, cost)):
        if plan.u_shape and i == 0:
            (sf, sb), (ef, eb) = chunks
            table[i] = {Op.FS: sf, Op.BE: sb, Op.FE: ef, Op.BS: eb}
        else:
            table[i] = {Op.F: chunks[0][0], Op.B: chunks[0][1]}
    return table

def comm_table(plan: Plan, cost: CostModel) -> dict[tuple[int, int], float]:
    """Transfer time of one boundary tensor from stage a to stage b, for every adjacent pair."""
    p, out = plan.num_stages, {}
    pairs = [(i, i + 1) for i in range(p - 1)] + ([(p - 1, 0)] if plan.u_shape else [])
    vdp = bool(plan.stage_dp)
    for a, b in pairs:
        sa, sb = plan.stages[a], plan.stages[b]
        out[(a, b)] = cost.boundary_time(sa.kind, sb.kind, sb.tp, sa.tp, vdp)
        out[(b, a)] = cost.boundary_time(sb.kind, sa.kind, sa.tp, sb.tp, vdp)
    return out

def simulate_times(ops: dict[int, dict[Op, float]], comm: dict[tuple[int, int], float],
                   num_microbatches: int, ushape: bool, prefetch: int = 0) -> SimResult:
    """Run the real lowered schedule with these per-op and per-boundary times (a boundary's
    time includes its link latency, see :meth:`CostModel.boundary_time`)."""
    schedule = lowered_schedule(len(ops), num_microbatches, ushape, prefetch)
    return simulate(schedule, duration={(stage, op.value): t for stage, times in ops.items()
                                        for op, t in times.items()}, comm_time=comm)

def dp_allreduce(plan: Plan, cost: CostModel) -> float:
    if plan.dp <= 1:
        return 0.0
    return max((_stage_terms(plan, i, cost).allreduce for i in range(plan.num_stages)
                if plan.dp_of(i) > 1), default=0.0)

def closed_form(plan: Plan, cost: CostModel) -> float:
    """1F1B estimate: fill + drain through every (logical) stage, then (m-1) bottleneck cycles."""
    terms = [_stage_terms(plan, i, cost) for i in range(plan.num_stages)]  # recompute fitted
    logical = [f + b for t in terms for f, b in t.times]
    # per-stage DP: a stage with d of the D replicas runs D / d micro-batches per uniform one
    per_stage = [sum(f + b for f, b in t.times) * plan.dp / plan.dp_of(i)
                 for i, t in enumerate(terms)]
    return (sum(logical) + sum(comm_table(plan, cost).values())
            + (plan.num_microbatches - 1) * max(per_stage) + dp_allreduce(plan, cost))


@dataclass(frozen=True)
class _StageTerms:
    """What one stage of a plan adds to the closed form, with its recomputation fitted."""

    recompute: Optional[Recompute]
    """:func:`fit_recompute`'s choice for this stage."""
    times: tuple[tuple[float, float], ...]
    """(fwd, bwd) per chunk, one micro-batch, with that recomputation."""
    allreduce: float
    """Its gradient all-reduce across its replicas (0.0 without replicas)."""


def _stage_terms(plan: Plan, i: int, cost: CostModel) -> _StageTerms:
    """Stage ``i``'s terms, kept in ``cost.memo``: the planner prices ~1000 layer splits of
    ~20 stages at 1024 devices, and 7 of 8 of those stages repeat one already priced (the
    orders of a stage set share stages, the splits share layer counts; where the model mixes
    dense and MoE layers, the stage's first layer too: which of them it holds)."""
    u, lay = plan.u_shape, plan.layers
    key = ("stage", plan.stages[i], i, len(plan.stages), plan.num_microbatches, u,
           plan.prefetch if u else 0, (lay[0], lay[-1]) if u and i == 0 else lay[i],
           None if cost.recompute else plan.recompute_of(i), plan.dp_of(i),
           sum(lay[:i]) if cost.moe_at else None)
    terms = cost.memo.get(key)
    if terms is None:
        terms = cost.memo[key] = _price_stage(plan, i, cost)
    return terms


def _price_stage(plan: Plan, i: int, cost: CostModel) -> _StageTerms:
    """With ``cost.recompute`` (the planner) the stage's recomputation is chosen afresh,
    whatever ``plan`` carries (a plan with other layers or another prefetch depth, derived
    from one priced before, carries that one's choice); without, it is priced as stated."""
    st = plan.stages[i]
    rc = plan.recompute_of(i)
    if cost.recompute:
        rc = None
        plan = replace(plan, recompute=_with(plan, i, None))
        limit, buffers = cost.memory_limit(st.kind), plan.recv_buffers(i)
        chunks = plan.stage_chunks(i, cost=cost)
        if cost.stage_memory(st.kind, st.tp, chunks, buffers).total > limit:
            for rc in recompute_levels(cost, st.kind, st.tp, chunks):  # the first that fits
                trial = [replace(c, recompute=rc) for c in chunks]
                if cost.stage_memory(st.kind, st.tp, trial, buffers).total <= limit:
                    break
    chunks = replace(plan, recompute=_with(plan, i, rc)).stage_chunks(i, cost=cost)
    times = tuple(cost.chunk_time(st.kind, st.tp, c) for c in chunks)
    allreduce = 0.0
    if plan.dp_of(i) > 1:
        shares = cost.model.tie_embeddings and i == 0
        params = sum(cost.chunk_params(st.tp, c, shares) for c in chunks)
        allreduce = cost.dp_allreduce_time(st.kind, params, plan.dp_of(i))
    return _StageTerms(rc, times, allreduce)


def _with(plan: Plan, i: int, rc: Optional[Recompute]) -> tuple[Optional[Recompute], ...]:
    chosen = list(plan.recompute) or [None] * plan.num_stages
    chosen[i] = rc
    return tuple(chosen)

KEEPS_LEAST = Recompute("full", "uniform", 1)
"""Full recomputation of every layer: the last of :func:`recompute_levels`, the one that keeps
the least (the split's and the stage sets' memory caps take it)."""


def recompute_levels(cost: CostModel, kind: str, tp: int, chunks: list[ChunkLoad]
                     ) -> list[Recompute]:
    """What the planner tries on a stage that does not fit: megatron's selective
    recomputation of what is cheap to redo and worth keeping out (the norms' outputs and
    internals; the attention scores without flash attention), then also the MLP (a model
    without biases: megatron cannot recompute a biased MLP) and on a stage with MoE layers
    their MLPs (``moe``), full ``block`` recomputation of
    the first n layers of each chunk, n < its layers, and full recomputation of every layer
    (``uniform``, 1 layer per group) last, the one that keeps the least (:data:`KEEPS_LEAST`).
    Ordered by the time they add on a stage of ``kind`` and ``tp`` with these ``chunks``: the
    first that fits adds the least."""
    cheap = ("layernorm",) if cost.flash(kind) else ("core_attn", "layernorm")
    levels = [Recompute("selective", modules=cheap)]
    if not cost.model.add_bias_linear:
        levels.append(Recompute("selective", modules=(*cheap, "mlp")))
    if cost.holds_moe(chunks):  # the MoE layers' MLPs: router, dispatch and experts again
        levels.append(Recompute("selective", modules=(*cheap, "moe")))
        if not cost.model.add_bias_linear:
            levels.append(Recompute("selective", modules=(*cheap, "mlp", "moe")))
    levels += [Recompute("full", "block", n) for n in range(1, max(c.layers for c in chunks))]
    added = {rc: sum(cost.recompute_time(kind, tp, c.layers, rc, cost.moe_share(c))
                     for c in chunks) for rc in levels}
    return sorted(levels, key=added.__getitem__) + [KEEPS_LEAST]


def fit_recompute(plan: Plan, cost: CostModel) -> Plan:
    """``plan`` with recomputation on each stage that does not fit without it: of
    :func:`recompute_levels`, the first that fits (the last, if none does). Stages that fit keep what
    they have; with ``cost.recompute`` off, the plan is returned as it is."""
    if not cost.recompute:
        return plan
    chosen = tuple(_stage_terms(plan, i, cost).recompute for i in range(plan.num_stages))
    return replace(plan, recompute=chosen if any(chosen) else ())


def simulate_plan(plan: Plan, cost: CostModel) -> Evaluation:
    """Simulate one iteration; memory uses the simulator's peak in-flight micro-batches."""
    plan = fit_recompute(plan, cost)
    if plan.stage_dp:
        return _simulate_vdp(plan, cost)
    sim = simulate_times(op_table(plan, cost), comm_table(plan, cost), plan.num_microbatches,
                         plan.u_shape, plan.prefetch if plan.u_shape else 0)
    inflight = {i: (sim.peak_inflight[i], sim.peak_inflight_end[i]) if plan.u_shape and i == 0
                else (sim.peak_inflight[i],) for i in range(plan.num_stages)}
    return evaluation(plan, cost, sim.iteration_time, sim.bubble_fraction, sim.busy, inflight, sim)

@lru_cache(maxsize=64)
def lane_schedule(stage_dp: tuple[int, ...], num_microbatches: int, ushape: bool,
                  prefetch: int = 0):
    """Per-stage DP's lowered lane lists (ldt.schedule.vdp), checked once (cached)."""
    return prepare(vdp_schedule(stage_dp, num_microbatches, ushape, prefetch=prefetch))

def _simulate_vdp(plan: Plan, cost: CostModel) -> Evaluation:
    """Per-stage DP: the lane schedule the runtime runs (ldt.schedule.vdp), every lane priced
    as its stage; a stage's busy time and in-flight peak are its busiest lane's."""
    stage_dp = lane_groups(plan)
    schedule = lane_schedule(stage_dp, plan.num_microbatches, plan.u_shape,
                             plan.prefetch if plan.u_shape else 0)
    sim, busy, inflight, bubble, _ = simulate_lanes(plan, schedule, op_table(plan, cost),
                                                    comm_table(plan, cost))
    return evaluation(plan, cost, sim.iteration_time, bubble, busy, inflight, sim)


def lane_groups(plan: Plan) -> tuple[int, ...]:
    """The stage dp of one group of lanes: replicas repeat in groups of gcd(stage dp), so one
    group is priced, e.g. dp (32, 64) as (1, 2)."""
    shared = math.gcd(*plan.stage_dp)
    return tuple(d // shared for d in plan.stage_dp)


def simulate_lanes(plan: Plan, schedule, ops: dict, comm: dict):
    """``(SimResult, busy, inflight, bubble, wstore)`` of lane lists (of :func:`lane_groups`),
    every lane priced as its stage (``ops``: per stage, op -> time; ``comm``: per stage pair);
    a stage's busy time, in-flight peak and W store entries (zero-bubble lists) are its
    busiest lane's."""
    lanes = Lanes(lane_groups(plan))
    stage = [lanes.of(lane)[0] for lane in range(len(lanes))]
    sim = simulate(schedule, duration=lambda a: ops[stage[a.stage]][a.op],
                   comm_time=lambda a: comm[(stage[a.stage], stage[a.peer])])
    busy = {i: max(sim.busy[ln] for ln in range(len(lanes)) if stage[ln] == i)
            for i in range(plan.num_stages)}
    inflight, wstore = {}, {}
    for i in range(plan.num_stages):
        mine = [ln for ln in range(len(lanes)) if stage[ln] == i]
        peak = max(sim.peak_inflight[ln] for ln in mine)
        inflight[i] = ((peak, max(sim.peak_inflight_end[ln] for ln in mine))
                       if plan.u_shape and i == 0 else (peak,))
        wstore[i] = max(sim.peak_wstore.get(ln, 0) for ln in mine)
    work = sum(sim.busy.values())
    bubble = 1 - work / (len(lanes) * sim.iteration_time) if sim.iteration_time else 0
    return sim, busy, inflight, bubble, wstore


def estimate_plan(plan: Plan, cost: CostModel) -> Evaluation:
    """Closed-form evaluation (no simulation); busy = m * (fwd + bwd)."""
    plan = fit_recompute(plan, cost)
    t = closed_form(plan, cost) - dp_allreduce(plan, cost)
    m = plan.num_microbatches
    busy = {i: m * sum(f + b for f, b in ch) for i, ch in enumerate(chunk_times(plan, cost))}
    bubble = 1 - sum(busy.values()) / (plan.num_stages * t)
    inflight = {i: tuple(c.inflight for c in plan.stage_chunks(i)) for i in range(plan.num_stages)}
    return evaluation(plan, cost, t, bubble, busy, inflight, None)

def evaluation(plan: Plan, cost: CostModel, pipe: float, bubble: float, busy: dict[int, float],
                inflight: dict[int, tuple[int, ...]], sim: Optional[SimResult],
                wstore: Optional[dict[int, float]] = None, schedule: str = "auto") -> Evaluation:
    """An :class:`Evaluation` of ``plan`` from its simulated (or estimated) figures; ``wstore``:
    per stage, a zero-bubble schedule's W store bytes at its peak (:mod:`ldt.plan.zb_prices`)."""
    split = plan.split
    names, reports = plan.stage_names(), []
    for i, st in enumerate(plan.stages):
        chunks = plan.stage_chunks(i, inflight[i], cost)
        fb = [cost.chunk_time(st.kind, st.tp, c) for c in chunks]
        memory = cost.stage_memory(st.kind, st.tp, chunks, plan.recv_buffers(i))
        if wstore:  # a zero-bubble schedule: its W store, and a W's own peak where larger
            memory = replace(memory, wstore=wstore[i], transient=max(
                memory.transient, max(cost.wgrad_transient(st.tp, c) for c in chunks)))
        reports.append(StageReport(
            i, names[i], st.kind, cost.inventory.kind(st.kind).device, st.tp, split.describe(i),
            sum(f for f, _ in fb), sum(b for _, b in fb), busy[i],
            memory, cost.memory_limit(st.kind), inflight[i]))
    ar = dp_allreduce(plan, cost)
    return Evaluation(plan, pipe + ar, pipe, ar, bubble, reports, sim, schedule)


def with_layers(plan: Plan, layers: tuple[int, ...]) -> Plan:
    return replace(plan, layers=tuple(layers))


MAX_PREFETCH = 3


def choose_prefetch(ev: Evaluation, cost: CostModel, max_depth: int = MAX_PREFETCH,
                    tolerance: float = 0.0,
                    simulate: Optional[Callable[[Plan], Evaluation]] = None) -> Evaluation:
    """The U-shape's prefetch depth for a plan: the smallest depth whose simulated iteration is
    within ``tolerance`` of the fastest depth that fits in memory (each depth keeps more
    micro-batches in flight: 2 more in the edge's start chunk, 1 more on every cloud stage).
    The link latency enters through the boundary times, so a fast link keeps depth 0.
    ``simulate``: how to price a plan (the planner's memo; default :func:`simulate_plan`)."""
    if not ev.plan.u_shape:
        return ev
    run = simulate or (lambda plan: simulate_plan(plan, cost))
    tried = [ev if d == ev.plan.prefetch else run(replace(ev.plan, prefetch=d))
             for d in range(max_depth + 1)]
    fits = [e for e in tried if e.fits] or [ev]
    fastest = min(e.iteration_time for e in fits)
    return next(e for e in fits if e.iteration_time <= fastest * (1 + tolerance))
