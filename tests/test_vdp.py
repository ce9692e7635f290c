"""Per-stage data parallelism (VDP): config, routing, lane schedules, and parity worlds.

The parity worlds run real gloo processes: every stage replica runs its lane of the schedule
(ldt's runtime, fan-in / fan-out through the leaders), then the DP all-reduce with the VDP
gradient factor. Every replica's gradient must equal the single-process reference's over the
same global batch (uniform DP with dp = the largest stage dp), within 1e-5; every micro-batch's
loss within 1e-6 relative. Shapes: plain 2-stage DP 1->2, plain 3-stage DP 2->1->2 with TP
1/2/1, U-shape edge DP 1 / cloud DP 2 (also with prefetch depth 1) and edge DP 2 / cloud DP 1;
the plain 3-stage and the prefetching U-shape on the zero-bubble schedule
(``train.schedule=zb``).
"""

import itertools

import pytest

from ldt.config import ConfigError
from ldt.schedule import simulate
from ldt.schedule.ir import Op
from ldt.schedule.routing import Lanes, boundary_pairs, grad_factor, microbatches_of
from ldt.schedule.vdp import lane_cost, vdp_schedule
from ldt.topology.ranks import Topology

M = 2  # micro-batches per uniform replica
LOSS_RTOL, GRAD_ATOL = 1e-6, 1e-5


def _cluster(dps, tps=None, u_shape=False, **extra):
    tps = tps or [1] * len(dps)
    return {"stages": [{"name": f"s{i}", "tp": t, "dp": d}
                       for i, (t, d) in enumerate(zip(tps, dps))], "u_shape": u_shape, **extra}


# ---- config, rank map, validation --------------------------------------------------------
def test_rank_map_shows_every_replica_and_world_is_sum_tp_dp():
    topo = Topology.from_config(_cluster([2, 1, 2], [1, 2, 1]))
    assert topo.is_vdp and topo.dp == 2 and topo.world_size == 2 + 2 + 2
    text = topo.rank_map()
    assert "dp per stage [2, 1, 2] (VDP)" in text
    rows = [line.split() for line in text.splitlines()[3:-1]]
    assert {(r[1], r[4]) for r in rows} == {("0:s0", "0/2"), ("0:s0", "1/2"), ("1:s1", "0/1"),
                                            ("2:s2", "0/2"), ("2:s2", "1/2")}
    seen = [(i.stage, i.tp_rank, i.dp_rank) for i in map(topo.rank_info, range(topo.world_size))]
    assert len(set(seen)) == topo.world_size  # every (stage, tp rank, dp rank) exactly once
    # a uniform cluster keeps the old layout: rank = dp_rank * replica_size + offset + tp_rank
    uni = Topology.from_config(_cluster([2, 2], [1, 2]))
    assert not uni.is_vdp and [uni.rank_info(r).dp_rank for r in range(6)] == [0, 0, 0, 1, 1, 1]


def test_refuses_boundary_where_neither_dp_divides_the_other():
    with pytest.raises(ConfigError, match=r"stages\[1\].dp=2 \(s1\) and cluster.stages\[2\]"
                                          r".dp=3 \(s2\) share the boundary 1->2"):
        Topology.from_config(_cluster([1, 2, 3]))
    with pytest.raises(ConfigError, match=r"does not divide the largest stage dp"):
        Topology.from_config(_cluster([2, 1, 3], u_shape=False))
    # U-shape: the return boundary P-1 -> 0 counts too
    with pytest.raises(ConfigError, match="boundary 2->0"):
        Topology.from_config(_cluster([4, 2, 6], u_shape=True))


def test_validate_names_world_formula_and_unsupported_combinations():
    from ldt.topology.validate import validate

    model = {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4}
    with pytest.raises(ConfigError, match=r"1\*1 \+ 2\*2 = 5"):
        validate(_cluster([1, 2], [1, 2]), model, world_size=4, check_devices=False)
    for train, what in (({"runtime": "megatron"}, "train.runtime=megatron"),
                        ({"schedule": "interleaved"}, "train.schedule=interleaved")):
        with pytest.raises(ConfigError, match=what):
            validate(_cluster([1, 2]), model, train=train, check_devices=False)
    with pytest.raises(ConfigError, match="tie_embeddings"):
        validate(_cluster([1, 2]), {**model, "tie_embeddings": True}, check_devices=False)
    validate(_cluster([1, 2], u_shape=True), {**model, "tie_embeddings": True},
             train={}, check_devices=False)  # embedding and head both on the edge: fine


# ---- routing and schedules -----------------------------------------------------------------
def test_routing_covers_every_microbatch_once_per_stage():
    for dps in ([1, 2], [2, 1, 2], [4, 1, 2]):
        d = max(dps)
        for dp in dps:
            got = sorted(g for r in range(dp) for g in microbatches_of(r, dp, 3, d))
            assert got == list(range(3 * d))
    assert boundary_pairs(1, 2, 2) == [(0, 0), (0, 1)]  # fan-out
    assert boundary_pairs(4, 2, 4) == [(0, 0), (1, 1), (2, 0), (3, 1)]  # fan-in
    assert grad_factor(1, 2) == 0.5 and grad_factor(2, 1) == 2 and grad_factor(2, 2) == 1


@pytest.mark.timeout(120)
def test_deadlock_checker_grid_per_stage_dp():
    """P <= 4, every stage dp in {1, 2, 4} (ratios 1, 2, 4), m around the warm-up's edges
    (1, 2, P-1, P, P+1) and beyond it (2P, 3P), plain and U-shape (also with prefetch depth 1):
    vdp_schedule's checker passes them, and, from the definition of a step and not from the
    generator, every stage runs each of its compute ops once for each of the D*m micro-batches
    of the global batch (D: the largest stage dp), micro-batch g on its replica g mod dp."""
    def ms(p):
        return sorted({m for m in (1, 2, p - 1, p, p + 1, 2 * p, 3 * p) if m >= 1})

    cases = [(dps, m, u_shape, 0) for p in range(1, 5)
             for dps in itertools.product((1, 2, 4), repeat=p)
             for u_shape in ((False, True) if p >= 2 else (False,))
             for m in ms(p)]
    cases += [(dps, m, True, 1) for p in range(2, 5)  # the U-shape with prefetch depth 1
              for dps in itertools.product((1, 2, 4), repeat=p) for m in ms(p)]
    for dps, m, u_shape, prefetch in cases:
        lanes = Lanes(dps)
        runs = {}  # (stage, op) -> micro-batches, over the stage's replicas
        for lane, actions in vdp_schedule(dps, m, u_shape, prefetch=prefetch).items():
            stage, replica = lanes.of(lane)
            for a in actions:
                if a.is_compute:
                    assert a.mb % dps[stage] == replica, (dps, m, u_shape, lane, a)
                    runs.setdefault((stage, a.op), []).append(a.mb)
        for stage in range(len(dps)):
            ops = (Op.FS, Op.FE, Op.BS, Op.BE) if u_shape and stage == 0 else (Op.F, Op.B)
            for op in ops:
                assert sorted(runs.pop((stage, op))) == list(range(max(dps) * m)), (dps, m, op)
        assert not runs, (dps, m, u_shape, runs)  # no other compute op anywhere


def test_one_replica_everywhere_gives_the_uniform_schedules():
    """The lane generator reduces to the stage generator: dp 1 on every stage gives exactly
    ldt.schedule's 1F1B and U-shape lists (with every prefetch depth)."""
    from ldt.schedule import lower, one_f_one_b, u_shape

    def text(schedule):
        return {k: [str(a) for a in v] for k, v in schedule.items()}

    for p in (2, 3, 4):
        for m in (1, 3, 7):
            assert text(vdp_schedule((1,) * p, m, False)) == text(lower(one_f_one_b(p, m), "1f1b"))
            for d in (0, 1, 2):
                want = lower(u_shape(p, m, prefetch=d), "ushape", prefetch=d)
                assert text(vdp_schedule((1,) * p, m, True, prefetch=d)) == text(want), (p, m, d)


def test_schedule_fans_out_and_in_along_the_routing():
    sched = vdp_schedule((1, 2), 2, u_shape=True)
    lanes = Lanes((1, 2))
    edge = sched[lanes.lane(0, 0)]
    sends = [(a.mb, a.peer) for a in edge if a.op is Op.SEND_F]
    assert sends == [(g, lanes.lane(1, g % 2)) for g in range(4)]  # each to its replica
    waits = [(a.mb, a.peer) for a in edge if a.op is Op.WAIT_F]
    assert sorted(waits) == [(g, lanes.lane(1, g % 2)) for g in range(4)]  # and back (FE)


def test_simulator_prices_the_edge_serving_two_cloud_replicas():
    """Edge dp 1 / cloud dp 2 against uniform dp 2, same global batch: the edge runs twice
    the micro-batches, so with an edge as fast as a cloud stage the step is longer."""
    edge = {Op.FS: 1, Op.FE: 1, Op.BS: 2, Op.BE: 2}
    cloud = {Op.F: 4, Op.B: 8}
    vdp = vdp_schedule((1, 2), 4, u_shape=True)
    uni = vdp_schedule((2, 2), 4, u_shape=True)  # uniform dp 2, as lanes: two independent rings
    t_vdp = simulate(vdp, lane_cost(Lanes((1, 2)), {0: edge, 1: cloud})).iteration_time
    t_uni = simulate(uni, lane_cost(Lanes((2, 2)), {0: edge, 1: cloud})).iteration_time
    assert t_uni < t_vdp < 2 * t_uni


# ---- parity worlds -------------------------------------------------------------------------
class _RefData:
    """The reference's micro-batch ``v * M + j`` is the uniform run's replica v's j-th."""

    def __init__(self, batches, dp_rank=0):
        self.batches, self.dp_rank = batches, dp_rank

    def batch(self, step, j):
        return self.batches[self.dp_rank * M + j]


def vdp_worker(rank, world, topo, full_state, prefetch=0, recompute=None, priced=None):
    """One replica's lane of a step; ``priced``: on the zero-bubble lists generated from these
    prices (``train.schedule=zb``: the ``wgrad_split`` patch applied, each W store run
    recorded in ``w_runs``)."""
    import ldt
    from gpt_worlds import (MBS, MODEL, AuditLog, RecomputeCount, Tripwire, _setup, forward_step,
                            make_batches, recompute_kwargs)
    from ldt import patches
    from ldt.models.build import build_chunk, global_param_name
    from ldt.models.sharding import load_full_state
    from ldt.p2p import VtpCommunicator
    from ldt.pipeline.forward_backward import run_step
    from ldt.schedule.routing import virtual_of
    from ldt.training.loop import _mean_loss
    from ldt.testing.grads import average_dp_grads
    from ldt.data.lane_data import LaneData

    audit = AuditLog()
    state = _setup(topo, observers=[audit])
    chunks = topo.split.stage_chunks(state.stage)
    tp = topo.stages[state.stage].tp
    models = []
    for chunk in chunks:
        gpt = build_chunk(MODEL, chunk, tp, num_stages=topo.num_stages,
                          **recompute_kwargs(recompute, state.stage))
        load_full_state(gpt, full_state, tp, state.info.tp_rank,
                        rename=lambda n, c=chunk: global_param_name(c, n))
        models.append(gpt)
    mbs = microbatches_of(state.info.dp_rank, topo.dp_of(state.stage), M, topo.dp)
    if state.stage in topo.data_stages():
        data = LaneData(_RefData(make_batches(topo.dp * M)), mbs, topo.dp).step_iterator(0)
    else:
        data = Tripwire()
    comm = VtpCommunicator(models[0].config, state, [audit])
    w_runs = []
    if priced is not None:
        from ldt.schedule.wgrad import WgradStore

        patches.apply(["wgrad_split"])
        default_run = WgradStore.run
        WgradStore.run = lambda store, key: (w_runs.append(key), default_run(store, key))
    try:
        with RecomputeCount() as recomputed:
            res = run_step(forward_step_func=forward_step, data_iterator=data, model=models,
                           num_microbatches=M, seq_length=MODEL.seq_length,
                           micro_batch_size=MBS, comm=comm, state=state,
                           config=models[0].config, prefetch=prefetch,
                           zero_bubble=priced is not None, priced=priced)
    finally:
        if priced is not None:
            WgradStore.run = default_run
    params = list({id(p): p for g in models for p in g.parameters()}.values())
    average_dp_grads(params, state)  # what DDP + the step's gradient factor do
    grads = {global_param_name(c, n): p.grad.detach().clone()
             for c, g in zip(chunks, models) for n, p in g.named_parameters() if p.grad is not None}
    out = {"stage": state.stage, "tp_rank": state.info.tp_rank, "dp_rank": state.info.dp_rank,
           "grads": grads, "sent": audit.sent, "touched_data": Tripwire.touched,
           "recomputed": recomputed.calls, "w_runs": w_runs, "mbs": mbs}
    if state.stage == topo.loss_stage():
        # losses come in the lane's order (ascending g): the reference's index v * M + j
        refs = [virtual_of(g, topo.dp)[0] * M + virtual_of(g, topo.dp)[1] for g in mbs]
        out["losses"] = dict(zip(refs, (float(x["lm loss"]) for x in res.losses)))
        out["mean_loss"] = _mean_loss(res.losses, state)
    patches.revert()
    ldt.destroy_vtp()
    return out


CASES = {  # name: (dp per stage, tp per stage, u_shape)
    "plain_dp1_2": ([1, 2], [1, 1], False),
    "plain_dp2_1_2_tp121": ([2, 1, 2], [1, 2, 1], False),
    "ushape_edge1_cloud2": ([1, 2], [1, 1], True),
    "ushape_edge2_cloud1": ([2, 1], [1, 1], True),
    "ushape_edge1_cloud2_prefetch1": ([1, 2], [1, 1], True),
    # train.schedule=zb: each backward split into B and a later W, the lists generated from
    # this world's prices (as ldt-train does)
    "plain_dp2_1_2_tp121_zb": ([2, 1, 2], [1, 2, 1], False),
    "ushape_edge1_cloud2_prefetch1_zb": ([1, 2], [1, 1], True),
}
# these cases run with activation recomputation (the same run; docs/memory.md): the edge
# recomputes whole layers, the cloud replicas their attention and norms
RECOMPUTE = {"ushape_edge2_cloud1": {0: {"granularity": "full", "method": "uniform",
                                        "num_layers": 1},
                                    1: {"granularity": "selective",
                                        "modules": ["core_attn", "layernorm"]}}}


@pytest.fixture(scope="module")
def ref():
    from gpt_worlds import reference
    from ldt.launch.local import run_local_world

    return run_local_world(1, reference, ([2 * M],), timeout_s=120)[0]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, ref):
    from gpt_worlds import MODEL, even_layout, zb_prices
    from ldt.launch.local import run_local_world
    from ldt.topology.validate import validate

    dps, tps, u_shape = CASES[request.param]
    cluster = _cluster(dps, tps, u_shape,
                       layout=None if u_shape else even_layout(MODEL.num_layers, len(dps)))
    topo = validate(cluster, MODEL, train={}, check_devices=False)
    prefetch = 1 if "prefetch1" in request.param else 0
    priced = zb_prices(topo, M) if request.param.endswith("_zb") else None
    out = run_local_world(topo.world_size, vdp_worker,
                          (topo, ref["full"], prefetch, RECOMPUTE.get(request.param), priced),
                          timeout_s=240)
    return request.param, topo, out


@pytest.mark.timeout(400)
def test_vdp_matches_uniform_dp_reference(case, ref):
    from ldt.models.sharding import unshard

    name, topo, out = case
    want = ref[2 * M]
    losses = {k: v for r in out if r["stage"] == topo.loss_stage() and r["tp_rank"] == 0
              for k, v in r["losses"].items()}
    assert sorted(losses) == list(range(2 * M)), name  # every micro-batch's loss, once
    for k, got in losses.items():
        assert abs(got - want["losses"][k]) <= LOSS_RTOL * abs(want["losses"][k]), (name, k)
    mean = sum(want["losses"]) / len(want["losses"])
    for r in out:
        if "mean_loss" in r:
            assert abs(r["mean_loss"] - mean) <= LOSS_RTOL * abs(mean), name
    shards = {}
    for r in out:  # every replica of every stage must hold the reference's gradient
        for pname, g in r["grads"].items():
            shards.setdefault((r["stage"], r["dp_rank"], pname), {})[r["tp_rank"]] = g
    covered = set()
    for (stage, dp_rank, pname), by_tp in shards.items():
        full = unshard(pname, [by_tp[i] for i in sorted(by_tp)])
        diff = (full - want["grads"][pname]).abs().max().item()
        assert diff <= GRAD_ATOL, (name, stage, dp_rank, pname, diff)
        covered.add(pname)
    assert covered == set(want["grads"]), name
    from test_p2p_parity import expected_recomputes

    for r in out:  # each replica ran its own micro-batches: D*M/dp of them, recomputing
        layers = [c.num_layers for c in topo.split.stage_chunks(r["stage"])]
        m = topo.dp * M // topo.dp_of(r["stage"])
        assert r["recomputed"] == expected_recomputes(RECOMPUTE.get(name), r["stage"], layers, m)
    # the logged grad norm with megatron's optimizer: tests/test_optimizer.py's vdp_* runs


@pytest.mark.timeout(400)
def test_data_stays_on_the_replicas_that_own_it(case):
    """Only activations / gradients cross (the audit); the U-shape's cloud reads no data."""
    from gpt_worlds import MBS, MODEL

    name, topo, out = case
    sent = [c for r in out for c in r["sent"]]
    assert sent
    for src, dst, direction, dtype, shape in sent:
        assert dtype == "torch.float32" and shape == (MODEL.seq_length, MBS, MODEL.hidden_size)
    if topo.u_shape:
        assert not any(r["touched_data"] for r in out if r["stage"] != 0), name
    # each of the D*M micro-batches crosses every activation boundary once each way
    assert len(sent) == 2 * len(topo.activation_boundaries()) * topo.dp * M, name


def test_zero_bubble_ran_every_w_after_its_backward(case):
    """The zb cases' gradients are checked above; here: their weight gradients really were
    deferred, one W store run per micro-batch of the replica's lane and chunk, in each chunk's
    backward order; no other case ran a W."""
    name, topo, out = case
    for r in out:
        if not name.endswith("_zb"):
            assert r["w_runs"] == [], name
            continue
        chunks = ["start", "end"] if topo.u_shape and r["stage"] == 0 else ["stage"]
        assert sorted(r["w_runs"]) == sorted((mb, c) for mb in r["mbs"] for c in chunks), name
        for c in chunks:  # the edge's end chunk backwards first (BS), its start chunk last
            runs = [mb for mb, chunk in r["w_runs"] if chunk == c]
            assert runs == sorted(runs), (name, r["stage"], c, runs)


# ---- ldt-train end to end ---------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_ldt_train_vdp_checkpoints_and_resumes_into_uniform_dp(tmp_path):
    """conf/cluster/cpu_vdp.yaml (edge dp 1, cloud dp 2) trains with checkpoints; its step-2
    checkpoint resumes into uniform dp 2 (another world size and rank map) and continues with
    the VDP run's losses: the same state, the same semantics."""
    import csv

    from train_cli import run_train

    def train(run_dir, *overrides):
        run_train(f"run_dir={run_dir}", "train.steps=4", *overrides).summary()
        with open(run_dir / "metrics.csv") as f:
            return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(f)}

    vdp = train(tmp_path / "vdp", "cluster=cpu_vdp", "train.save_every=2")
    assert sorted(vdp) == [0, 1, 2, 3] and vdp[3] < vdp[0]
    _ran_its_lane_lists(tmp_path / "vdp")
    uniform = train(tmp_path / "uniform", "cluster=cpu_vdp", "cluster.stages.0.dp=null",
                    "cluster.stages.1.dp=null", "cluster.dp=2",
                    f"train.resume={tmp_path / 'vdp' / 'checkpoints' / 'step_0000001'}")
    assert sorted(uniform) == [2, 3]
    for step, loss in uniform.items():
        assert abs(loss - vdp[step]) <= 1e-6 * abs(vdp[step]), (step, loss, vdp[step])


def _ran_its_lane_lists(run_dir) -> None:
    """A per-stage DP run's measured timeline (lane_times.csv, gathered from every lane's
    leader): each lane ran exactly its list's computations, in order, every step; each row
    names its lane's stage and replica."""
    import csv

    from omegaconf import OmegaConf

    from ldt.schedule.ir import COMPUTE_OPS
    from ldt.schedule.routing import Lanes
    from ldt.schedule.vdp import vdp_schedule

    cfg = OmegaConf.load(run_dir / "config.yaml")
    stage_dp = tuple(st.dp or cfg.cluster.dp for st in cfg.cluster.stages)
    lists = vdp_schedule(stage_dp, cfg.train.num_microbatches, cfg.cluster.u_shape)
    want = {lane: [str(a) for a in acts if a.op in COMPUTE_OPS] for lane, acts in lists.items()}
    ran: dict = {}
    with open(run_dir / "lane_times.csv") as f:
        for r in csv.DictReader(f):
            lane = int(r["lane"])
            assert Lanes(stage_dp).of(lane) == (int(r["stage"]), int(r["replica"])), r
            if r["action"][len(r["lane"]):].rstrip("0123456789") in {o.value for o in COMPUTE_OPS}:
                ran.setdefault((int(r["step"]), lane), []).append((float(r["start_s"]),
                                                                   r["action"]))
    steps = {step for step, _ in ran}
    assert steps == set(range(cfg.train.steps)), steps
    for (step, lane), acts in ran.items():
        assert [a for _, a in sorted(acts)] == want[lane], (step, lane)
    assert not (run_dir / "action_times.csv").exists()  # read as one lane per stage, it would lie


def test_ldt_sim_prices_per_stage_dp():
    """The planner's simulator runs the lane schedule: an edge serving two cloud replicas
    takes longer than two edges (same global batch); its all-reduce spans only the cloud."""
    from ldt.plan.clusters import cluster_to_plan
    from ldt.plan.evaluate import simulate_plan
    from ldt.plan.inventory import Workload, load_inventory, load_model
    from ldt.plan.planner import make_cost
    from ldt.config import to_cluster

    inv = load_inventory("edge_cloud")
    model = load_model("llama_7b")
    cost = make_cost(inv, model, Workload())
    stages = [{"name": "edge", "device": "cuda", "tp": 1}, {"name": "cloud", "device": "npu",
                                                            "tp": 8}]
    def to_plan(stages):
        return cluster_to_plan(to_cluster({"stages": stages, "u_shape": True, "dp": 2}), model,
                               inv, 8)

    uni = simulate_plan(to_plan(stages), cost)
    stages[0]["dp"] = 1
    vdp_plan = to_plan(stages)
    assert vdp_plan.stage_dp == (1, 2)
    vdp = simulate_plan(vdp_plan, cost)
    assert uni.pipeline_time < vdp.pipeline_time < 2.2 * uni.pipeline_time
    assert vdp.dp_allreduce_time < uni.dp_allreduce_time  # the edge has no DP peer


def test_planner_step_gives_the_cloud_more_replicas_when_it_pays(tmp_path):
    """ldt.plan.planner._try_vdp on a cloud-bound U-shape (one fast edge card, eight V100s of
    which the uniform plan uses four): the cloud gets dp 2 behind the edge's one replica, the
    step is priced on the lane schedule, and the inventory is respected."""
    from ldt.plan.evaluate import Plan, StageSpec, simulate_plan
    from ldt.plan.inventory import Workload, load_inventory, load_model
    from ldt.plan.planner import PlannerOptions, _try_vdp, make_cost

    path = tmp_path / "inv.yaml"
    path.write_text(
        "name: h100_8v100\nedge: h100\nkinds:\n"
        "  - {name: h100, device: cuda, count: 1, tflops: 989, memory_gib: 80, intra_bw_gbps: 450,"
        " node_size: 1, mfu: 0.45, tp_efficiency: 0.9, host_bw_gbps: 50, reserved_gib: 2}\n"
        "  - {name: v100, device: cuda, count: 8, tflops: 125, memory_gib: 32, intra_bw_gbps: 150,"
        " node_size: 4, mfu: 0.4, tp_efficiency: 0.9, host_bw_gbps: 16, reserved_gib: 2}\n"
        "links:\n  - {a: h100, b: v100, bandwidth_gbps: 12.5, latency_us: 100}\n"
        "  - {a: v100, b: v100, bandwidth_gbps: 150, latency_us: 5}\n")
    inv, work = load_inventory(str(path)), Workload()
    cost = make_cost(inv, load_model("llama_7b"), work)
    base = simulate_plan(Plan((StageSpec("h100", 1), StageSpec("v100", 2), StageSpec("v100", 2)),
                              (4, 12, 12, 4), True, 1, 64), cost)
    best, sims, note = _try_vdp(base, cost, inv, work, PlannerOptions(), 1)
    assert best.plan.stage_dp == (1, 2, 2) and best.plan.num_microbatches == 32, note
    assert sum(s.tp * d for s, d in zip(best.plan.stages[1:], best.plan.stage_dp[1:])) <= 8
    assert best.fits and best.iteration_time < base.iteration_time and sims > 1
    again = simulate_plan(best.plan, cost)
    assert again.iteration_time == pytest.approx(best.iteration_time)
