"""train.schedule=zb generates its order from the run's own plan, priced by the cost model
(ldt/plan/zb_prices.py): each backward split into B and W by the linear layers' weight
gradient, figures derived here by hand from the shapes; the priced order differs from the
equal-cost one on a heterogeneous U-shape and the simulator times it faster with those prices.
Pure: no processes (the parity worlds that run the priced orders are test_ushape.py and
test_p2p_parity.py)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from ldt.config import ConfigError, typed_config
from ldt.config.load import config_dict
from ldt.plan.clusters import cluster_to_plan, load_cluster
from ldt.plan.cost import CostModel
from ldt.plan.evaluate import op_table
from ldt.plan.inventory import DeviceKind, Inventory, Link, load_inventory, load_model
from ldt.plan import Workload, make_cost, planned_cluster, simulate_plan, train_yaml
from ldt.plan.evaluate import Plan, StageSpec
from ldt.plan.objective import Objective, choose
from ldt.plan.zb_prices import (choose_schedule, nominal_inventory, planned_kinds, prices,
                                 run_prices, split_op_table)
from ldt.schedule import Op, lower, simulate
from ldt.schedule.zerobubble import zb_h1, zb_u_shape

# a made-up kind whose numbers make each term visible: 1 TFLOP/s, MFU 0.5, TP efficiency 0.5
KIND = DeviceKind(name="k", device="cpu", count=8, tflops=1.0, memory_gib=100,
                  intra_bw_gbps=1.0, mfu=0.5, tp_efficiency=0.5)
INVENTORY = Inventory(name="visible", kinds=[KIND], links=[Link("k", "k", 1.0, 0.0)])


def _run_cfg(cluster: str, m: int, **train):
    return typed_config({"cluster": config_dict(load_cluster(cluster)),
                         "model": config_dict(load_model("gpt_tiny")),
                         "train": {"num_microbatches": m, "schedule": "zb", **train}})


def test_the_verify_reference_of_a_priced_zb_run_is_a_run_ldt_accepts():
    """ldt-plan's train file for a zero-bubble pick names train.cost_inventory; with
    train.verify the single-process reference (schedule auto) must drop it too, else its own
    check refuses it after the whole run has trained."""
    from ldt.job.prepare import reference_config
    from ldt.topology.validate import validate

    cfg = _run_cfg("cpu_demo", 4, cost_inventory="cpu_local", verify=True)
    validate(cfg.cluster, cfg.model, world_size=4, train=cfg.train)  # the run itself
    ref = reference_config(cfg)
    assert ref.train.schedule == "auto" and ref.train.cost_inventory is None
    validate(ref.cluster, ref.model, world_size=1, train=ref.train)


def test_w_is_the_linear_layers_weight_gradient_by_hand():
    """gpt_tiny (h 64, 4 heads, f 4h, V 256, s 64), b 2: per layer the linear layers' forward
    is 24 b s h^2 FLOPs (QKV 6, projection 2, fc1 8, fc2 8), the head's 2 b s h V; W repeats
    them, at tp * 1e12 * 0.5 * 0.5^log2(tp) FLOP/s. B is the rest of the whole backward."""
    cfg = _run_cfg("cpu_demo", 4)  # Et|tt|tt|tL on TP 1 / 2 / 1
    plan = cluster_to_plan(cfg.cluster, cfg.model, INVENTORY, 4)
    cost = CostModel(cfg.model, INVENTORY, 2)
    b, s, h, v = 2, 64, 64, 256
    layer, head = 24 * b * s * h * h, 2 * b * s * h * v

    def speed(tp):
        return tp * 1e12 * 0.5 * 0.5 ** math.log2(tp)

    split, whole = split_op_table(plan, cost), op_table(plan, cost)
    want = {(0, Op.WE): 1 * layer / speed(1), (0, Op.WS): (1 * layer + head) / speed(1),
            (1, Op.W): 2 * layer / speed(2), (2, Op.W): 2 * layer / speed(1)}
    for (stage, op), t in want.items():
        assert split[stage][op] == pytest.approx(t, rel=1e-12), (stage, op)
    for stage, b_op, w_op in ((0, Op.BE, Op.WE), (0, Op.BS, Op.WS), (1, Op.B, Op.W),
                              (2, Op.B, Op.W)):
        assert split[stage][b_op] + split[stage][w_op] == pytest.approx(whole[stage][b_op])
        assert split[stage][b_op] > 0
    for stage, ops in whole.items():  # forwards unchanged
        for op in (Op.F, Op.FS, Op.FE):
            if op in ops:
                assert split[stage][op] == ops[op]


@pytest.mark.parametrize("cluster,m", [("cpu_demo", 5), ("cpu_demo", 3), ("cpu_vtp", 6)])
def test_the_run_s_order_comes_from_its_prices(cluster, m):
    """The run's prices (run_prices: its cluster, model, m, as ldt-train computes them)
    give an order other than the equal-cost one, and the simulator, timing both with those
    prices, finds the priced order faster: the costs were not ignored."""
    cfg = _run_cfg(cluster, m)
    costs, comm = run_prices(cfg.cluster, cfg.model, cfg.train).tables()
    p, u = len(cfg.cluster.stages), cfg.cluster.u_shape
    generate, kind = (zb_u_shape, "ushape") if u else (zb_h1, "1f1b")
    priced, equal = generate(p, m, costs, comm), generate(p, m)
    assert priced != equal
    t_priced = simulate(lower(priced, kind), costs, comm).iteration_time
    t_equal = simulate(lower(equal, kind), costs, comm).iteration_time
    assert t_priced < t_equal, (t_priced, t_equal)


def test_the_run_is_priced_with_its_inventory():
    """Without train.cost_inventory every device type gets cpu_local's figures (so stages
    differ by their plan only); with one, its kinds price the stages."""
    cfg = _run_cfg("cpu_demo", 4)
    plain = run_prices(cfg.cluster, cfg.model, cfg.train)
    nominal = nominal_inventory(["cpu"])
    want = prices(cluster_to_plan(cfg.cluster, cfg.model, nominal, 4),
                  CostModel(cfg.model, nominal, cfg.train.micro_batch_size))
    assert plain == want
    cfg = _run_cfg("cpu_demo", 4, cost_inventory="cpu_elastic")  # two cpu kinds
    with pytest.raises(ConfigError, match=r"cost_inventory.*matches kinds.*name each stage"):
        run_prices(cfg.cluster, cfg.model, cfg.train)
    for st, name in zip(cfg.cluster.stages, ("edge", "cloud_cpu_0", "cloud_cpu_1")):
        st.name = name  # as ldt-plan names them: the edge, then KIND_n
    named = run_prices(cfg.cluster, cfg.model, cfg.train)
    assert named != plain
    cfg.cluster.stages[2].name = "cloud_cpu.1_0"  # an elastic plan's second node group
    assert planned_kinds(cfg.cluster, load_inventory("cpu_elastic")) == [
        "edge_cpu", "cloud_cpu", "cloud_cpu"]


# ---- the planner's choice between today's schedule and the zero-bubble one -----------------
FUSED = Workload(1, 64, flash_attention=True)
"""Fused attention priced on the Ascend stages too: the edge-cloud scenario of the tests below.
Ascend stages run megatron's local attention, and priced so (the planner's default) llama_7b's
pick is an 8-stage plan, past what the planner times on the zero-bubble schedule."""

EDGE_CLOUD_PLAN = dict(  # what ldt-plan picks for llama_7b on edge_cloud with FUSED
    stages=(StageSpec("edge_gpu", 1), StageSpec("ascend910b", 4), StageSpec("ascend910b", 4)),
    layers=(1, 15, 15, 1), u_shape=True, dp=2, num_microbatches=32)


def test_the_planner_s_pick_is_the_objective_s_pick(monkeypatch):
    """ldt-plan times its pick on the zero-bubble schedule too and keeps what the objective
    picks between the two (here zb, faster); its train file then says ``schedule: zb`` and
    the inventory the run prices its order with."""
    from ldt.plan import planner

    seen = {}

    def spy(ev, cost, inventory, objective):
        seen["today"] = ev
        out = choose_schedule(ev, cost, inventory, objective)
        seen["zb"] = out[1]
        return out

    monkeypatch.setattr(planner, "choose_schedule", spy)
    inventory, model = load_inventory("edge_cloud"), load_model("llama_7b")
    objective = Objective()
    result = planner.plan(inventory, model, FUSED, objective=objective)
    today, zb = seen["today"], seen["zb"]
    assert zb.schedule == "zb" and today.schedule == "auto"
    assert zb.iteration_time < today.iteration_time and zb.fits  # so the objective: zb
    assert result.best is choose([today, zb], inventory, objective)[0] is zb
    assert zb in result.front
    text = train_yaml(result.best, "llama_7b", 1, "planned", "edge_cloud")
    assert "schedule: zb" in text and "cost_inventory: edge_cloud" in text
    # the run of the planned files generates its order from the prices the planner timed
    run = typed_config({"cluster": config_dict(planned_cluster(zb.plan, inventory)),
                        "model": config_dict(model),
                        "train": {"num_microbatches": zb.plan.num_microbatches,
                                  "micro_batch_size": 1, "schedule": "zb",
                                  "cost_inventory": "edge_cloud"}})
    assert run_prices(run.cluster, run.model, run.train) == prices(
        zb.plan, make_cost(inventory, model, FUSED))
    assert "schedule" not in train_yaml(today, "llama_7b", 1, "planned", "edge_cloud")


def test_the_zero_bubble_order_is_timed_at_every_prefetch_depth_up_to_the_pick_s():
    """The edge-cloud pick runs today's U-shape at prefetch 3. Its zero-bubble order, timed at
    depths 0-3 one by one here: 1 is the fastest that fits (2 and 3 pass the cloud's memory
    beside the W store, 0 is slower), and that is what the planner's choice keeps."""
    from ldt.plan.zb_prices import simulate_zb

    inventory, model = load_inventory("edge_cloud"), load_model("llama_7b")
    cost = make_cost(inventory, model, FUSED)
    today = simulate_plan(Plan(**EDGE_CLOUD_PLAN, prefetch=3), cost)
    by_depth = [simulate_zb(today.plan, cost, d) for d in range(4)]
    assert [z.fits for z in by_depth] == [True, True, False, False]
    assert by_depth[1].iteration_time < by_depth[0].iteration_time
    pick, zb = choose_schedule(today, cost, inventory, Objective())
    assert zb.plan.prefetch == 1 and zb.iteration_time == by_depth[1].iteration_time
    assert pick is zb and "prefetch: 1" in train_yaml(pick, "llama_7b", 1, "p", "edge_cloud")


def test_a_w_store_that_does_not_fit_keeps_today_s_schedule():
    """The same plan with the edge card's memory between today's need (17.0 GiB) and the
    zero-bubble schedule's (20.1 GiB: its W store on top): the faster zb does not fit, so
    today's schedule stays; with the card's real 24 GiB zb is picked."""
    inventory, model = load_inventory("edge_cloud"), load_model("llama_7b")
    plan = Plan(**EDGE_CLOUD_PLAN)
    for memory_gib, want in ((20.5, "auto"), (24, "zb")):
        kinds = [replace(k, memory_gib=memory_gib) if k.name == "edge_gpu" else k
                 for k in inventory.kinds]
        inv = replace(inventory, kinds=kinds)
        cost = make_cost(inv, model, FUSED)
        today = simulate_plan(plan, cost)
        pick, zb = choose_schedule(today, cost, inv, Objective())
        assert zb.iteration_time < today.iteration_time and today.fits
        assert zb.stages[0].memory.wstore > 0
        assert pick.schedule == want, (memory_gib, [s.memory.total / 2**30 for s in zb.stages])


def test_a_per_stage_dp_plan_is_priced_on_its_zero_bubble_lane_lists():
    """The edge-cloud plan with the cloud at twice the edge's replicas (per-stage DP, as the
    planner tries it): timed on zero-bubble lane lists it is faster than on today's, each
    stage's W store is counted in its memory, and the lists are exactly what a run with those
    prices generates (``ldt.schedule.vdp.vdp_schedule``, one group of lanes)."""
    from ldt.plan.evaluate import lane_groups, simulate_lanes
    from ldt.plan.zb_prices import simulate_zb
    from ldt.schedule.vdp import vdp_schedule

    inventory, model = load_inventory("edge_cloud"), load_model("llama_7b")
    plan = Plan(**{**EDGE_CLOUD_PLAN, "stage_dp": (1, 2, 2), "num_microbatches": 8})
    cost = make_cost(inventory, model, Workload(1, 32))
    today = simulate_plan(plan, cost)
    zb = simulate_zb(plan, cost)
    assert zb.schedule == "zb" and zb.iteration_time < today.iteration_time
    assert all(s.memory.wstore > 0 for s in zb.stages)
    assert choose_schedule(today, cost, inventory, Objective())[1] is not None  # priced, too
    lists = vdp_schedule(lane_groups(plan), 8, True, zero_bubble=True, priced=prices(plan, cost))
    sim = simulate_lanes(plan, lists, split_op_table(plan, cost), prices(plan, cost).tables()[1])[0]
    assert sim.iteration_time == zb.pipeline_time


# ---- train.cost_run: the order from a run's measured times -----------------------------------
# cpu_demo's U-shape: per (stage, op) the times a "run" takes (ms), chosen by hand as the hosts
# of bench_zb measure them (the edge's end chunk, head and loss, the longest; transfers of
# milliseconds), and each receiver's WAIT (its own time, from when the message could arrive)
RUN_COMPUTE = {(0, Op.FS): 3.0, (0, Op.FE): 12.0, (0, Op.BS): 10.0, (0, Op.BE): 4.0,
               (1, Op.F): 6.0, (1, Op.B): 9.0, (2, Op.F): 6.0, (2, Op.B): 9.0}
RUN_WAITS = {(1, Op.WAIT_F): 2.0, (2, Op.WAIT_F): 3.0, (0, Op.WAIT_F): 5.0,  # 0->1, 1->2, 2->0
             (0, Op.WAIT_B): 6.0, (1, Op.WAIT_B): 7.0, (2, Op.WAIT_B): 9.0}  # 1->0, 2->1, 0->2


def _a_run(folder, compute, waits, steps=3, cfg=None):
    """The folder of an ldt-train run of ``cfg`` (default: cpu_demo's) under today's
    U-shape (m 4): its config.yaml, and its action_times.csv as the simulator plays the
    schedule with these times (every stage's own timeline, one host, each step after the
    other)."""
    from ldt.job.prepare import save_config
    from ldt.schedule import u_shape

    schedule = lower(u_shape(3, 4), "ushape")
    ms = lambda a: (compute if a.is_compute else waits).get((a.stage, a.op), 0.0) / 1e3  # noqa
    events = simulate(schedule, ms, local_time=ms).events
    save_config(cfg or _run_cfg("cpu_demo", 4, schedule="auto"), str(folder))
    with open(folder / "action_times.csv", "w") as f:
        f.write("step,stage,action,start_s,end_s,host,step_start_s\n")
        for step in range(steps):
            for e in events:
                f.write(f"{step},{e.stage},{e.action},{e.start!r},{e.end!r},h,{step * 10.0}\n")
    return folder


def test_a_measured_run_prices_the_order(tmp_path):
    """train.cost_run: F and each boundary's transfer are what the run measured; the whole
    backward it measured splits into B and W at the cost model's shares; the order generated
    from them is another than the nominal one, and faster at the measured times."""
    cfg = _run_cfg("cpu_demo", 4)
    nominal_costs, nominal_comm = run_prices(cfg.cluster, cfg.model, cfg.train).tables()
    run = _a_run(tmp_path / "run", RUN_COMPUTE, RUN_WAITS)
    cfg.train.cost_run = str(run)
    costs, comm = run_prices(cfg.cluster, cfg.model, cfg.train).tables()
    assert set(costs) == set(nominal_costs) and set(comm) == set(nominal_comm)
    for (s, op), t in RUN_COMPUTE.items():
        w_op = {Op.B: "W", Op.BS: "WS", Op.BE: "WE"}.get(op)
        if w_op is None:
            assert costs[(s, op.value)] == pytest.approx(t / 1e3), (s, op)
            continue
        share = nominal_costs[(s, w_op)] / (nominal_costs[(s, op.value)]
                                            + nominal_costs[(s, w_op)])
        assert 0 < share < 1
        assert costs[(s, w_op)] == pytest.approx(t / 1e3 * share), (s, w_op)
        assert costs[(s, op.value)] == pytest.approx(t / 1e3 * (1 - share)), (s, op)
    assert comm == pytest.approx({(0, 1): 2e-3, (1, 2): 3e-3, (2, 0): 5e-3,
                                  (1, 0): 6e-3, (2, 1): 7e-3, (0, 2): 9e-3})
    measured = zb_u_shape(3, 4, costs, comm)
    nominal = zb_u_shape(3, 4, nominal_costs, nominal_comm)
    assert measured != nominal
    t = [simulate(lower(s, "ushape"), costs, comm).iteration_time for s in (measured, nominal)]
    assert t[0] < 0.95 * t[1], t  # 143.1 / 155.1 ms at the measured times


@pytest.mark.timeout(300)
def test_under_torchrun_rank_0_alone_reads_the_cost_run(tmp_path):
    """Under torchrun, rank 0 prices the order (it reads train.cost_run) and broadcasts the
    prices: the other ranks are given a folder that does not exist, and every stage runs the
    order generated from the measured prices, not the nominal one."""
    import csv
    import re
    import socket
    import subprocess
    import sys

    from ldt.schedule.ir import COMPUTE_OPS

    _a_run(tmp_path / "costs0", RUN_COMPUTE, RUN_WAITS)  # rank 0's; costs1..3 do not exist
    cfg = _run_cfg("cpu_demo", 4)
    nominal = run_prices(cfg.cluster, cfg.model, cfg.train)
    cfg.train.cost_run = str(tmp_path / "costs0")
    measured = run_prices(cfg.cluster, cfg.model, cfg.train)
    orders = [lower(zb_u_shape(3, 4, *p.tables()), "ushape") for p in (measured, nominal)]
    want = [{s: [str(a) for a in acts if a.op in COMPUTE_OPS] for s, acts in o.items()}
            for o in orders]
    assert want[0] != want[1]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
         "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "ldt.job.train",
         f"run_dir={tmp_path / 'run'}", "train.steps=2", "train.num_microbatches=4",
         "train.schedule=zb", f"train.cost_run={tmp_path}/costs${{oc.env:RANK}}",
         "train.estimate_memory=true"],  # which walks the order: rank 0's estimate alone
        cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warning" not in proc.stderr and "memory per rank, MiB (estimate" in proc.stdout, \
        proc.stderr
    ran: dict[int, list[tuple[float, str]]] = {}
    compute = r"\d+(%s)\d+" % "|".join(op.value for op in COMPUTE_OPS)
    with open(tmp_path / "run" / "action_times.csv") as f:
        for row in csv.DictReader(f):
            if row["step"] == "1" and re.fullmatch(compute, row["action"]):
                ran.setdefault(int(row["stage"]), []).append((float(row["start_s"]),
                                                             row["action"]))
    assert {s: [a for _, a in sorted(acts)] for s, acts in ran.items()} == want[0]


def test_a_run_of_other_ops_does_not_price_the_order(tmp_path):
    """train.cost_run from a run of another layout, model size or micro-batch size timed other
    ops: refused, naming what differs; another micro-batch count, schedule or sequence
    parallelism changes no op's size and is taken."""
    cfg = _run_cfg("cpu_demo", 4)
    other = _run_cfg("cpu_demo", 8, schedule="auto", micro_batch_size=4)
    other.cluster.layout = "Ett|t|tt|tL"
    other.model.hidden_size *= 2
    cfg.train.cost_run = str(_a_run(tmp_path / "other", RUN_COMPUTE, RUN_WAITS, cfg=other))
    with pytest.raises(ConfigError) as err:
        run_prices(cfg.cluster, cfg.model, cfg.train)
    msg = str(err.value)
    assert msg.startswith(f"train.cost_run={cfg.train.cost_run!r} timed other ops than this "
                          "run's: its stages ")
    assert ("its stages [cpu/tp1 cpu/tp2 cpu/tp1] layout=Et*2|t|t*2|tL (this run: [cpu/tp1 "
            "cpu/tp2 cpu/tp1] layout=Et|t*2|t*2|tL)") in msg
    assert "model.hidden_size=128 (this run: 64)" in msg
    assert "train.micro_batch_size=4 (this run: 2)" in msg
    assert msg.endswith("give the folder of an ldt-train run of this cluster and model")
    alike = _run_cfg("cpu_demo", 8, schedule="auto")
    alike.model.sequence_parallel = True
    cfg.train.cost_run = str(_a_run(tmp_path / "alike", RUN_COMPUTE, RUN_WAITS, cfg=alike))
    run_prices(cfg.cluster, cfg.model, cfg.train)
    (tmp_path / "alike" / "config.yaml").unlink()
    with pytest.raises(ConfigError, match=r"train.cost_run=.*config.yaml.*give the folder of "
                                          r"an ldt-train run of this cluster and model"):
        run_prices(cfg.cluster, cfg.model, cfg.train)


def test_a_measured_zero_bubble_run_gives_its_own_w(tmp_path):
    """A run of train.schedule=zb timed B and W apart: those are the prices, no shares."""
    from ldt.plan.zb_prices import measured_prices

    cfg = _run_cfg("cpu_demo", 4)
    nominal = run_prices(cfg.cluster, cfg.model, cfg.train)
    costs, comm = nominal.tables()
    schedule = lower(zb_u_shape(3, 4), "ushape")
    want = {(s, op): 1e-3 * (i + 1) for i, (s, op) in enumerate(sorted(costs))}
    events = simulate(schedule, lambda a: want.get((a.stage, a.op.value), 0.0) if a.is_compute
                      else 0.0).events
    (tmp_path / "zb").mkdir()
    with open(tmp_path / "zb" / "action_times.csv", "w") as f:
        f.write("step,stage,action,start_s,end_s,host,step_start_s\n")
        for step in range(3):
            f.writelines(f"{step},{e.stage},{e.action},{e.start!r},{e.end!r},h,{step * 10.0}\n"
                         for e in events)
    got, _ = measured_prices(str(tmp_path / "zb"), nominal).tables()
    assert got == pytest.approx(want)


def test_a_run_that_cannot_price_the_order_is_refused(tmp_path):
    from ldt.plan.zb_prices import measured_prices

    cfg = _run_cfg("cpu_demo", 4)
    nominal = run_prices(cfg.cluster, cfg.model, cfg.train)
    with pytest.raises(ConfigError, match=r"train.cost_run=.*nowhere.*ldt-train run of this "
                                          r"cluster"):
        measured_prices(str(tmp_path / "nowhere"), nominal)
    plain = _run_cfg("cpu_vtp", 4)  # 3 plain stages: no FS / FE / BS / BE on stage 0
    with pytest.raises(ConfigError,
                       match=r"train.cost_run=.*measured no B on stage 0 "
                             r"\(it timed BE, BS, FE, FS"):
        measured_prices(str(_a_run(tmp_path / "ushape", RUN_COMPUTE, RUN_WAITS)),
                        run_prices(plain.cluster, plain.model, plain.train))
