"""The zero-bubble schedule of a plan, generated from the planner's prices.

A zero-bubble schedule (:mod:`ldt.schedule.zerobubble`) is generated from each stage's F, B and
W times and each boundary's transfer time. Here they come from the cost model
(:mod:`ldt.plan.cost`), the prices the planner and ``ldt-sim`` time a plan with: F and the
whole backward per chunk as :func:`ldt.plan.evaluate.op_table` gives them, W the weight
gradient of the chunk's linear layers (:meth:`~ldt.plan.cost.CostModel.wgrad_time`), B the rest
of the backward (input gradients, TP collectives, recomputation); transfers as
:func:`ldt.plan.evaluate.comm_table`. No second cost model: the same tables, split.

:func:`run_prices` prices a run's own plan (its cluster, model, micro-batches): what
``train.schedule=zb`` generates its order from (priced where the config is checked,
``ldt.job.prepare.check``, and handed to the ranks). The device kinds come
from ``train.cost_inventory``, else an elastic run's ``cluster.inventory``, else
:func:`nominal_inventory`; with ``train.cost_run`` the times a run of the cluster measured
replace them (:func:`measured_prices`).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Optional, Sequence

from ldt.config import ClusterConfig, ConfigError, ModelConfig, TrainConfig, typed_config
from ldt.config.load import load_plain
from ldt.plan.calibrate import calibrate, read_action_times, steady
from ldt.plan.clusters import cluster_to_plan, planned_kinds
from ldt.plan.cost import CostModel
from ldt.plan.evaluate import (Evaluation, Plan, comm_table, evaluation, fit_recompute,
                               lane_groups, op_table, simulate_lanes)
from ldt.plan.inventory import Inventory, Link, load_inventory
from ldt.plan.objective import Objective, choose
from ldt.schedule import Op, Schedule, lower, simulate
from ldt.schedule.ir import WEIGHT_OPS
from ldt.schedule.vdp import vdp_schedule
from ldt.schedule.zerobubble import Priced, zb_h1, zb_u_shape

NOMINAL = "cpu_local"
"""The inventory whose one kind prices every device type of a run that names no inventory."""


def split_op_table(plan: Plan, cost: CostModel) -> dict[int, dict[Op, float]]:
    """:func:`~ldt.plan.evaluate.op_table` with every backward split into B and W (the edge:
    BE + WE for its start chunk, BS + WS for its end chunk)."""
    table = op_table(plan, cost)
    for i, st in enumerate(plan.stages):
        w = [cost.wgrad_time(st.kind, st.tp, c) for c in plan.stage_chunks(i, cost=cost)]
        pairs = ([(Op.BE, Op.WE, w[0]), (Op.BS, Op.WS, w[1])] if plan.u_shape and i == 0
                 else [(Op.B, Op.W, w[0])])
        for b, wgt, t in pairs:
            table[i][b] -= t
            table[i][wgt] = t
    return table


def prices(plan: Plan, cost: CostModel) -> Priced:
    """The tables a plan's zero-bubble schedule is generated from (and timed with)."""
    ops = split_op_table(plan, cost)
    return Priced.of({(s, op.value): t for s, times in ops.items() for op, t in times.items()},
                     comm_table(plan, cost))


def zb_compute(plan: Plan, priced: Priced) -> Schedule:
    """The plan's zero-bubble compute lists (ZB-H1, or the zero-bubble U-shape at the plan's
    prefetch depth) for ``priced``."""
    if plan.u_shape:
        return zb_u_shape(plan.num_stages, plan.num_microbatches, *priced.tables(),
                          prefetch=plan.prefetch)
    return zb_h1(plan.num_stages, plan.num_microbatches, *priced.tables())


def simulate_zb(plan: Plan, cost: CostModel, prefetch: int = 0) -> Evaluation:
    """``plan`` timed on its zero-bubble schedule, generated from its prices as a run
    generates it (ZB-H1, the zero-bubble U-shape, or with per-stage DP the lane lists with
    each backward split, :mod:`ldt.schedule.zerobubble_lanes`), at the U-shape's ``prefetch``
    depth (the planner prices each up to its pick's, :func:`choose_schedule`; ``ldt-sim
    --schedule zb --prefetch d`` prices d): the simulator's iteration, and per stage
    the memory of what that order holds, the micro-batches in flight and the W store at its
    peak (``SimResult.peak_wstore`` entries of the stage's largest,
    :meth:`~ldt.plan.cost.CostModel.wstore_bytes`)."""
    plan = fit_recompute(replace(plan, prefetch=prefetch if plan.u_shape else 0), cost)
    priced = prices(plan, cost)
    if plan.stage_dp:
        lists = vdp_schedule(lane_groups(plan), plan.num_microbatches, plan.u_shape,
                             prefetch=plan.prefetch, zero_bubble=True, priced=priced)
        sim, busy, inflight, bubble, entries = simulate_lanes(
            plan, lists, split_op_table(plan, cost), comm_table(plan, cost))
    else:
        kind = "ushape" if plan.u_shape else "1f1b"
        sim = simulate(lower(zb_compute(plan, priced), kind, prefetch=plan.prefetch),
                       *priced.tables())
        busy, bubble, entries = sim.busy, sim.bubble_fraction, sim.peak_wstore
        inflight = {i: (sim.peak_inflight[i], sim.peak_inflight_end[i])
                    if plan.u_shape and i == 0 else (sim.peak_inflight[i],)
                    for i in range(plan.num_stages)}
    wstore = {i: entries.get(i, 0) * max(cost.wstore_bytes(st.tp, c)
                                         for c in plan.stage_chunks(i, cost=cost))
              for i, st in enumerate(plan.stages)}
    return evaluation(plan, cost, sim.iteration_time, bubble, busy, inflight, sim, wstore, "zb")


def runs_zb(plan: Plan) -> bool:
    """Whether ``train.schedule=zb`` might gain on ``plan``: two stages at least (one has no
    bubble)."""
    return plan.num_stages >= 2


PLANNER_LIMIT = 128
"""The planner times a pick on its zero-bubble schedule up to this many stage-micro-batches
(``P x m``): generating a longer order takes seconds here (P 3, m 64: 1.0 s; P 6, m 64: 2.2 s
on the 2-core machine, load ~3), longer than the whole search. ``ldt-sim --schedule zb``
prices any length; a run generates its own order once."""


def too_long(plan: Plan) -> bool:
    return plan.num_stages * plan.num_microbatches > PLANNER_LIMIT


def choose_schedule(ev: Evaluation, cost: CostModel, inventory: Inventory,
                    objective: Objective) -> tuple[Evaluation, Evaluation | None]:
    """``ev`` (a plan timed on today's schedule) or the same plan on its zero-bubble one,
    whichever ``objective`` picks (both hold the same devices, so the faster that fits; ties
    to today's); and the zero-bubble evaluation (None where it cannot run, :func:`runs_zb`,
    or is longer than :data:`PLANNER_LIMIT`). A U-shape's zero-bubble order is timed at
    every prefetch depth up to ``ev``'s (chosen for today's schedule: the W's may fill the
    waits a prefetch would, a deeper one may not fit beside the W store, or it still pays
    where the links are slow), the objective's pick of those kept."""
    if not runs_zb(ev.plan) or too_long(ev.plan):
        return ev, None
    timed = [simulate_zb(ev.plan, cost, depth)
             for depth in range(ev.plan.prefetch + 1 if ev.plan.u_shape else 1)]
    fitting = [z for z in timed if z.fits]
    zb = choose(fitting, inventory, objective)[0] if fitting else timed[0]
    if not ev.fits:
        return (zb if zb.fits else ev), zb
    return choose([ev, zb], inventory, objective)[0], zb


def nominal_inventory(devices: Sequence[str]) -> Inventory:
    """One kind per device type, each with the figures of :data:`NOMINAL`'s kind and link: a
    run's stages then differ by what the plan gives them (layers, embedding, head, TP,
    recomputation, host-staged boundaries), not by their device's speed."""
    base = load_inventory(NOMINAL)
    kind, link = base.kinds[0], base.links[0]
    names = list(dict.fromkeys(devices))
    return Inventory(name=f"{NOMINAL} (every device type)",
                     kinds=[replace(kind, name=d, device=d) for d in names],
                     links=[Link(a, b, link.bandwidth_gbps, link.latency_us)
                            for i, a in enumerate(names) for b in names[i:]])


def run_inventory(cluster: ClusterConfig, train: TrainConfig) -> Inventory:
    """The inventory that prices a run: ``train.cost_inventory``, else ``cluster.inventory``
    (elastic), else :func:`nominal_inventory` of its device types."""
    name = train.cost_inventory or cluster.inventory
    if not name:
        return nominal_inventory([s.device for s in cluster.stages])
    try:
        return load_inventory(name)
    except ConfigError as exc:
        key = "train.cost_inventory" if train.cost_inventory else "cluster.inventory"
        raise ConfigError(f"{key}={name!r}: {exc}") from None


def run_prices(cluster: ClusterConfig, model: ModelConfig, train: TrainConfig) -> Priced:
    """The prices of this run's plan (its cluster, model, micro-batches and micro-batch size)
    that ``train.schedule=zb`` generates its order from: the launcher prices it once
    (:func:`ldt.job.prepare.check`) and hands it to every rank."""
    inventory = run_inventory(cluster, train)
    try:
        plan = cluster_to_plan(cluster, model, inventory, train.num_microbatches,
                               planned_kinds(cluster, inventory))
        priced = prices(plan, CostModel(model, inventory, train.micro_batch_size))
    except ConfigError as exc:
        raise ConfigError(
            f"train.schedule=zb prices each stage with inventory {inventory.name!r} "
            f"(train.cost_inventory): {exc.args[0].split('; pass --kinds')[0]}; name each "
            "stage KIND_n after its kind (as ldt-plan does), or give an inventory with one "
            "kind per device type") from None
    if not train.cost_run:
        return priced
    check_cost_run(train.cost_run, plan, model, train.micro_batch_size, inventory)
    return measured_prices(train.cost_run, priced)


# What sets the size of every op a run times, besides its plan's stages (kinds, TP, layers,
# recomputation): a run that differs in one of these timed other ops
OP_SIZE_FIELDS = ("hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                  "kv_channels", "seq_length", "vocab_size", "gated_linear_unit",
                  "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
                  "mtp_num_layers", "transformer_impl")


def check_cost_run(run_dir: str, plan: Plan, model: ModelConfig, micro_batch_size: int,
                   inventory: Inventory) -> None:
    """Refuse a ``train.cost_run`` that timed other ops than this run's (its ``config.yaml``
    says): another layout, TP, device kind or recomputation of a stage, another model size
    (:data:`OP_SIZE_FIELDS`) or micro-batch size. The micro-batch count, the schedule and
    settings that change no op's size (sequence parallelism, the optimizer, ...) may differ."""
    where = f"train.cost_run={run_dir!r}"
    fix = "give the folder of an ldt-train run of this cluster and model"
    try:
        theirs = typed_config(load_plain(os.path.join(run_dir, "config.yaml"), "run config"))
        their_plan = cluster_to_plan(theirs.cluster, theirs.model, inventory,
                                     plan.num_microbatches,
                                     planned_kinds(theirs.cluster, inventory))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}; {fix}") from None
    same = lambda p: (p.stages, p.layers, p.u_shape, p.recompute)  # noqa: E731
    differ = [f"its stages {their_plan.describe_stages()} (this run: {plan.describe_stages()})"
              ] if same(their_plan) != same(plan) else []
    differ += [f"model.{f}={getattr(theirs.model, f)!r} (this run: {getattr(model, f)!r})"
               for f in OP_SIZE_FIELDS if getattr(theirs.model, f) != getattr(model, f)]
    if theirs.train.micro_batch_size != micro_batch_size:
        differ.append(f"train.micro_batch_size={theirs.train.micro_batch_size} (this run: "
                      f"{micro_batch_size})")
    if differ:
        raise ConfigError(f"{where} timed other ops than this run's: {'; '.join(differ)}; "
                          f"{fix}")


def measured_prices(run_dir: str, nominal: Priced) -> Priced:
    """``nominal``'s tables with what a run of the same cluster measured (``run_dir``'s
    ``action_times.csv``, steps after the first; :func:`ldt.plan.calibrate.calibrate`): each
    (stage, op)'s mean time, and each boundary's transfer as its receiver's WAIT measured it
    (from when the message could first have arrived). A run of today's schedule has each
    backward whole: it is split into B and W as ``nominal`` splits it. The zero-bubble order
    is then generated from the run's own costs, not from an inventory's."""
    where = f"train.cost_run={run_dir!r}"
    try:
        cal = calibrate(steady(read_action_times(run_dir), 1))
    except (ConfigError, ValueError, OSError) as exc:
        raise ConfigError(f"{where}: {exc}; give the folder of an ldt-train run of this "
                          "cluster on ldt's runtime (it writes action_times.csv)") from None
    costs, comm = nominal.tables()
    measured = {(s, op.value): t for (s, op), t in cal.compute.items()}
    stages = 1 + max(s for s, _ in costs)
    if {s for s, _ in measured} != set(range(stages)):
        raise ConfigError(f"{where}: its action_times.csv times stages "
                          f"{sorted({s for s, _ in measured})}, this cluster has {stages}; give "
                          "a run of this cluster")
    weights = {w.value: b.value for w, b in WEIGHT_OPS.items()}  # W -> the backward it follows
    backwards = {b: w for w, b in weights.items()}
    split = any(op in weights for _, op in measured)  # a zero-bubble run: its W's timed
    out = {}
    for (s, op), t in costs.items():
        b_op = weights.get(op, op)
        if not split and b_op in backwards:  # B and W take nominal's shares of the whole
            key, share = (s, b_op), t / (costs[(s, b_op)] + costs[(s, backwards[b_op])])
        else:
            key, share = (s, op), 1.0
        if key not in measured:
            timed = sorted(o for stage, o in measured if stage == s)
            raise ConfigError(f"{where}: it measured no {key[1]} on stage {s} (it timed "
                              f"{', '.join(timed)} there); give a run of this cluster and "
                              "schedule kind (plain or U-shape)")
        out[(s, op)] = measured[key] * share
    measured_comm = cal.transfer_times()  # the receivers' WAITs
    comm.update({pair: t for pair, t in measured_comm.items() if pair in comm})
    return Priced.of(out, comm)
