"""Planning on time and cost: the objective, the front, and instances whose answer is known.

Each instance is small enough for exhaustive search, which picks with the same objective: the
planner's pick must cost what exhaustive search's costs, and the cases are built so that the
pick differs between the policies (a test that any plan passes guards nothing).
"""

import dataclasses

import pytest

from ldt.config import ConfigError
from ldt.plan import (Evaluation, Objective, Plan, StageSpec, Workload, choose, devices,
                      exhaustive, load_model, make_cost, pareto_front, plan, simulate_plan,
                      step_cost)
from ldt.plan.inventory import DeviceKind, Inventory
from ldt.plan.pricing import Simulator, schedule_actions
from ldt.plan.synthetic import small_model, synthetic_inventory


def _cloud_devices(ev: Evaluation, edge: str) -> int:
    return sum(st.tp * ev.plan.dp_of(i) for i, st in enumerate(ev.plan.stages)
               if st.kind != edge)


def _same_pick_as_exhaustive(result, inventory, model, workload, objective):
    brute = exhaustive(inventory, model, workload, objective=objective)
    assert step_cost(result.best, inventory) == pytest.approx(step_cost(brute.best, inventory),
                                                              rel=1e-9), (
        result.best.plan.describe(), brute.best.plan.describe())
    return brute


# ---- the policy on hand-made evaluations ------------------------------------------------------
def _ev(kind: str, tp: int, dp: int, ms: float) -> Evaluation:
    plan = Plan((StageSpec(kind, tp),), (4,), False, dp, 8)
    return Evaluation(plan, ms / 1e3, ms / 1e3, 0.0, 0.0, stages=[])


def test_choose_and_front_follow_the_objective():
    inv = synthetic_inventory({"h100": 8, "v100": 8})
    fast = _ev("h100", 8, 1, 100.0)          # 8 devices
    near = _ev("h100", 4, 1, 100.9)          # 4 devices, 0.9% slower: a tie at 1%
    slow = _ev("h100", 2, 1, 180.0)          # 2 devices, 80% slower, cheapest per step
    dominated = _ev("h100", 8, 1, 150.0)     # slower and no cheaper than `fast`
    pool = [dominated, slow, fast, near]
    assert pareto_front(pool, inv) == [fast, near, slow]
    pick, why = choose(pool, inv, Objective())
    assert pick is near and "0.9% slower than the fastest" in why and "50% less" in why
    assert choose(pool, inv, Objective(tolerance=0.005))[0] is fast
    assert choose(pool, inv, Objective(tolerance=0.9))[0] is slow   # --max-slowdown 0.9
    assert choose(pool, inv, Objective("cost"))[0] is slow
    # cost ties within the tolerance go to the faster plan
    twin = _ev("h100", 4, 1, 90.0 * 1.005)  # costs 0.5% more than `slow`, twice as fast
    assert choose(pool + [twin], inv, Objective("cost"))[0] is twin
    assert devices(_ev("h100", 2, 3, 1.0).plan) == 6


def test_objective_and_price_errors_name_the_field():
    with pytest.raises(ConfigError, match="objective 'speed'"):
        Objective("speed")
    with pytest.raises(ConfigError, match="--max-slowdown.*-0.1"):
        Objective("time", -0.1)
    kinds = [DeviceKind(name="a", device="cuda", count=1, tflops=1, memory_gib=8,
                        intra_bw_gbps=1, price_per_hour=2.0),
             DeviceKind(name="b", device="npu", count=1, tflops=1, memory_gib=8,
                        intra_bw_gbps=1)]
    with pytest.raises(ConfigError, match=r"\['b'\]: price_per_hour missing"):
        Inventory(name="x", kinds=kinds)
    kinds[1].price_per_hour = -1.0
    with pytest.raises(ConfigError, match=r"kinds\[1\] \(b\)\.price_per_hour=-1.0 must be >= 0"):
        Inventory(name="x", kinds=kinds)


# ---- instances with a known answer ------------------------------------------------------------
def test_edge_bound_ushape_picks_the_fewest_cloud_devices_within_tolerance():
    """The edge (one workstation GPU, a 128k-vocabulary head) bounds the step: four V100s in the
    cloud finish the fill 0.9% sooner than one, which is all they buy. The default objective
    takes the one-V100 plan; the fastest plan met uses all four."""
    inventory = synthetic_inventory({"edge_gpu": 1, "v100": 4}, edge="edge_gpu", node_size=4)
    model = dataclasses.replace(small_model(6), vocab_size=128000)
    workload = Workload(1, 64)
    result = plan(inventory, model, workload)
    fastest = result.front[0]
    assert _cloud_devices(result.best, "edge_gpu") == 1
    assert _cloud_devices(fastest, "edge_gpu") == 4
    assert fastest.iteration_time < result.best.iteration_time <= fastest.iteration_time * 1.01
    assert "within 1.0% of it" in result.reason and "less cost per step" in result.reason
    _same_pick_as_exhaustive(result, inventory, model, workload, Objective())


def test_compute_bound_pipeline_uses_more_devices_when_they_are_faster():
    """Four H100s as one TP 4 stage are 40% faster than two: more than the tolerance, so the
    time objective takes all four even though fewer cost less per step."""
    inventory = synthetic_inventory({"h100": 4}, node_size=4)
    model, workload = small_model(6), Workload(1, 8)
    result = plan(inventory, model, workload)
    assert devices(result.best.plan) == 4 and result.best is result.front[0]
    cheaper = result.front[1]
    assert devices(cheaper.plan) < 4
    assert cheaper.iteration_time > 1.01 * result.best.iteration_time
    assert step_cost(cheaper, inventory) < step_cost(result.best, inventory)
    _same_pick_as_exhaustive(result, inventory, model, workload, Objective())
    relaxed = plan(inventory, model, workload, objective=Objective("time", 1.0))
    assert devices(relaxed.best.plan) < 4  # 100% slower is accepted: the cheaper plan wins


def test_priced_inventory_a_slower_cheaper_kind_wins_on_cost():
    """H100 at 10 per hour, V100 at 1: a V100 is 8x slower but 10x cheaper, so the cheapest
    step runs on V100s only, while the fastest runs on H100s."""
    inventory = synthetic_inventory({"h100": 4, "v100": 4}, node_size=4)
    for kind in inventory.kinds:
        kind.price_per_hour = {"h100": 10.0, "v100": 1.0}[kind.name]
    model, workload = small_model(6), Workload(1, 8)
    by_time = plan(inventory, model, workload)
    by_cost = plan(inventory, model, workload, objective=Objective("cost"))
    assert {st.kind for st in by_time.best.plan.stages} == {"h100"}
    assert {st.kind for st in by_cost.best.plan.stages} == {"v100"}
    assert by_cost.best.iteration_time > 5 * by_time.best.iteration_time
    assert step_cost(by_cost.best, inventory) < step_cost(by_time.best, inventory)
    _same_pick_as_exhaustive(by_cost, inventory, model, workload, Objective("cost"))


# ---- the search's own machinery -----------------------------------------------------------------
def test_long_plans_are_timed_from_short_ones():
    """A plan of many micro-batches is priced from 3 short simulations (1F1B is linear in m
    past its fill: exact; the U-shape's merged edge within 0.2%)."""
    inventory = synthetic_inventory({"edge_gpu": 1, "a100": 4}, edge="edge_gpu", node_size=4)
    cost = make_cost(inventory, load_model("llama_7b"), Workload(1, 64))
    plain = Plan((StageSpec("a100", 2), StageSpec("a100", 1), StageSpec("a100", 1)),
                 (12, 10, 10), False, 1, 512)
    ushape = Plan((StageSpec("edge_gpu", 1), StageSpec("a100", 4)), (1, 30, 1), True, 1, 640,
                  prefetch=1)
    for p, rel in ((plain, 1e-9), (ushape, 2e-3)):
        sim = Simulator(cost)
        quick, full = sim(p), simulate_plan(p, cost)
        assert quick.sim is None and sim.runs == 1 and len(sim.schedules) == 3  # timed short
        assert quick.iteration_time == pytest.approx(full.iteration_time, rel=rel)
        assert quick.bubble_fraction == pytest.approx(full.bubble_fraction, abs=rel)
        assert [s.inflight for s in quick.stages] == [s.inflight for s in full.stages]
        assert sim.work < (1 + sim.GENERATE) * schedule_actions(p)[1]  # less than in full


def test_effort_counts_the_actions_the_simulator_plays():
    from ldt.plan.evaluate import lane_schedule, lowered_schedule

    for p, m, ushape, depth in ((1, 3, False, 0), (2, 5, False, 0), (4, 6, False, 0),
                                (2, 4, True, 0), (5, 7, True, 2)):
        plan_ = Plan(tuple(StageSpec("a", 1) for _ in range(p)), (1,) * (p + ushape), ushape,
                     1, m, prefetch=depth)
        real = sum(map(len, lowered_schedule(p, m, ushape, depth).schedule.values()))
        assert schedule_actions(plan_)[1] == real
    vdp = Plan((StageSpec("a", 1),) * 3, (1, 1, 1, 1), True, 4, 3, stage_dp=(2, 4, 4))
    real = sum(map(len, lane_schedule((1, 2, 2), 3, True).schedule.values()))
    assert schedule_actions(vdp) == (((1, 2, 2), 3, True, 0), real)


def test_per_stage_dp_is_priced_on_one_group_of_replicas():
    """dp (2, 4, 4) prices as two copies of (1, 2, 2): the same numbers as simulating every
    lane of the (2, 4, 4) schedule."""
    from ldt.plan.evaluate import comm_table, op_table
    from ldt.schedule import simulate
    from ldt.schedule.routing import Lanes
    from ldt.schedule.vdp import vdp_schedule

    inventory = synthetic_inventory({"edge_gpu": 2, "a100": 16}, edge="edge_gpu", node_size=4)
    cost = make_cost(inventory, load_model("llama_7b"), Workload(1, 64))
    p = Plan((StageSpec("edge_gpu", 1), StageSpec("a100", 2), StageSpec("a100", 2)),
             (1, 15, 15, 1), True, 4, 16, prefetch=1, stage_dp=(2, 4, 4))
    lanes = Lanes(p.stage_dp)
    ops, comm = op_table(p, cost), comm_table(p, cost)
    stage = [lanes.of(lane)[0] for lane in range(len(lanes))]
    every_lane = simulate(vdp_schedule(p.stage_dp, 16, True, prefetch=1),
                          duration=lambda a: ops[stage[a.stage]][a.op],
                          comm_time=lambda a: comm[(stage[a.stage], stage[a.peer])])
    ev = simulate_plan(p, cost)
    assert ev.pipeline_time == pytest.approx(every_lane.iteration_time, rel=1e-12)
    busiest = max(every_lane.busy.values())
    assert max(s.busy for s in ev.stages) == pytest.approx(busiest, rel=1e-12)


def test_planning_does_not_depend_on_the_clock(monkeypatch):
    """The search's effort is counted in simulated actions: a machine where every clock read
    is 100 s later (a very loaded one) plans the same plan with the same simulations."""
    import itertools
    import time

    inventory = synthetic_inventory({"edge_gpu": 2, "ascend910b": 6}, edge="edge_gpu",
                                    node_size=4)
    model, workload = small_model(6), Workload(1, 16)
    calm = plan(inventory, model, workload)
    ticks = itertools.count(0.0, 100.0)
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks))
    busy = plan(inventory, model, workload)
    assert busy.best.plan == calm.best.plan and busy.simulations == calm.simulations
    assert [e.plan for e in busy.front] == [e.plan for e in calm.front]
