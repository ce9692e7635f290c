"""The planner's search: valid output, better than naive, equal to brute force on tiny cases."""

import dataclasses
from collections import Counter

import pytest

from ldt.config import ConfigError, load_cluster_yaml
from ldt.config.layout import split_layers
from ldt.plan import (Workload, cluster_yaml, exhaustive, load_inventory, load_model, make_cost,
                      plan, simulate_plan)
from ldt.plan.evaluate import with_layers
from ldt.plan.synthetic import small_model, synthetic_inventory
from ldt.topology.validate import validate


def _assert_uses_inventory(result, inventory):
    used = Counter()
    for i, st in enumerate(result.best.plan.stages):  # its replicas: per-stage dp, or dp
        used[st.kind] += st.tp * result.best.plan.dp_of(i)
    for kind, n in used.items():
        assert n <= inventory.kind(kind).count, (kind, n)


@pytest.mark.parametrize("inv_name,model_name,wl", [
    ("a100_910b", "llama_7b", Workload(1, 64)),
    ("edge_cloud", "llama_7b", Workload(1, 64)),
    ("cpu_local", "gpt_tiny", Workload(2, 16)),
])
def test_planned_yaml_loads_and_validates(tmp_path, inv_name, model_name, wl):
    inventory, model = load_inventory(inv_name), load_model(model_name)
    result = plan(inventory, model, wl)
    path = tmp_path / "planned.yaml"
    path.write_text(cluster_yaml(result.best, inventory, model.name, wl.micro_batch_size))
    cluster = load_cluster_yaml(str(path))
    topo = validate(cluster, model, check_devices=False)
    best = result.best
    assert topo.world_size == sum(s.tp * best.plan.dp_of(i)  # per-stage dp, or dp each
                                  for i, s in enumerate(best.plan.stages))
    assert cluster.u_shape == (inventory.edge is not None)
    assert best.plan.dp * best.plan.num_microbatches * wl.micro_batch_size == wl.global_batch_size
    assert best.fits
    _assert_uses_inventory(result, inventory)
    if cluster.u_shape:  # the edge keeps >= 1 layer on each side (privacy default)
        assert best.plan.layers[0] >= 1 and best.plan.layers[-1] >= 1
        assert best.plan.stages[0].kind == inventory.edge


def test_planner_beats_naive_even_split():
    inventory = synthetic_inventory({"h100": 8, "a100": 8, "v100": 8})
    model = load_model("llama_7b")
    wl = Workload(1, 32)
    result = plan(inventory, model, wl)
    cost = make_cost(inventory, model, wl)
    p = result.best.plan
    even = split_layers(model.num_layers, p.num_stages, u_shape=p.u_shape)
    naive = with_layers(p, tuple(c.num_layers for c in even.model_order))
    naive_ev = simulate_plan(naive, cost)
    assert result.best.iteration_time <= naive_ev.iteration_time
    # and strictly better here: an H100 stage and a V100 stage should not get equal layers
    assert result.best.iteration_time < 0.95 * naive_ev.iteration_time or not naive_ev.fits


def test_memory_pressure_forces_more_tp_or_stages():
    """llama_7b cannot sit on one 24 GiB device: the planner spreads it and every stage fits."""
    inventory = synthetic_inventory({"v100": 16}, memory_gib={"v100": 24})
    model = load_model("llama_7b")
    result = plan(inventory, model, Workload(1, 16))
    assert result.best.fits
    assert result.best.plan.num_stages * max(s.tp for s in result.best.plan.stages) > 1


def test_nothing_fits_is_a_clear_error():
    inventory = synthetic_inventory({"edge_gpu": 1}, memory_gib={"edge_gpu": 4})
    with pytest.raises(ConfigError, match="no plan fits.*micro_batch_size"):
        plan(inventory, load_model("llama_7b"), Workload(1, 8))


def test_ushape_without_edge_is_refused():
    with pytest.raises(ConfigError, match="inventory.edge"):
        plan(synthetic_inventory({"a100": 4}), small_model(), Workload(1, 8, u_shape=True))


def test_a_model_with_mtp_layers_is_refused_not_planned_without_them():
    """The planner's layouts have no 'm': ldt-train would refuse every plan it wrote."""
    mtp = dataclasses.replace(small_model(), mtp_num_layers=1)
    with pytest.raises(ConfigError, match=r"model.mtp_num_layers=1: the planner does not place"):
        plan(synthetic_inventory({"a100": 4}), mtp, Workload(1, 8))


def test_plans_256_devices():
    """Planning time is a benchmark figure (bench/bench_planner.py), not asserted here."""
    inventory = synthetic_inventory({"a100": 128, "ascend910b": 96, "h100": 32})
    result = plan(inventory, load_model("llama_7b"), Workload(1, 1024))
    assert result.best.fits
    _assert_uses_inventory(result, inventory)


def _edge_link(latency_ms: float):
    """edge_cloud with its edge <-> cloud link given this latency and a bandwidth so high that
    only the latency matters."""
    inventory = load_inventory("edge_cloud")
    for link in inventory.links:
        if {link.a, link.b} == {"edge_gpu", "ascend910b"}:
            link.latency_us, link.bandwidth_gbps = latency_ms * 1e3, 1e6
    return inventory


def test_planner_picks_prefetch_from_the_edge_link_latency():
    """A one-way latency of ~2 edge forwards on the edge's links (the edge's forward is ~67 ms
    for llama_7b on edge_cloud): the planner picks a prefetch depth, the simulator prices it
    well below the plain U-shape, the latency costs only the pipeline's fill and drain (4 slow
    crossings), and the YAML tells ldt-train the depth. (Without latency the fastest depth
    wins by a hair, and the objective takes it: the depth alone tells nothing there.)"""
    from dataclasses import replace

    from ldt.plan import choose_prefetch

    # fused attention on the Ascend stages too: the scenario this was built on (see
    # tests/test_zb_prices.py's FUSED)
    model, wl, latency = load_model("llama_7b"), Workload(1, 64, flash_attention=True), 0.120
    fast = plan(_edge_link(0.0), model, wl)
    slow_inventory = _edge_link(latency * 1e3)
    slow = plan(slow_inventory, model, wl)
    cost = make_cost(slow_inventory, model, wl)
    depth = slow.best.plan.prefetch
    plain = simulate_plan(replace(slow.best.plan, prefetch=0), cost)
    assert depth >= 1 and slow.best.fits
    assert slow.best.plan.num_stages == fast.best.plan.num_stages
    assert slow.best.iteration_time < 0.95 * plain.iteration_time
    # against the fast link's pick on today's schedule (there, the zero-bubble schedule,
    # which runs without prefetch, wins and is picked: its time is not the point here)
    fast_cost = make_cost(_edge_link(0.0), model, wl)
    fast_today = choose_prefetch(simulate_plan(replace(fast.best.plan, prefetch=0), fast_cost),
                                 fast_cost)
    assert fast.best.schedule == "zb" and fast.best.iteration_time < fast_today.iteration_time
    assert slow.best.iteration_time <= fast_today.iteration_time + 4 * latency
    assert choose_prefetch(plain, cost).plan.prefetch == depth
    header = cluster_yaml(slow.best, slow_inventory, model.name, 1).splitlines()[1]
    assert f"train.prefetch={depth}" in header
    from omegaconf import OmegaConf

    from ldt.plan import train_yaml
    assert OmegaConf.create(train_yaml(slow.best, model.name, 1, "slow")).prefetch == depth


def test_edge_min_layers_keeps_that_many_layers_on_each_edge_chunk():
    """``ldt-plan --edge-min-layers`` (Workload.edge_min_layers): the edge's start and end
    chunks each keep at least that many decoder layers, whatever would be fastest."""
    inventory, model = load_inventory("edge_cloud"), load_model("llama_7b")
    layers = {}
    for k in (1, 3):  # 5 + 5 layers do not fit the 24 GiB edge (fp32 gradients: #24)
        best = plan(inventory, model, Workload(1, 64, edge_min_layers=k)).best.plan
        assert best.layers[0] >= k and best.layers[-1] >= k, (k, best.layers)
        layers[k] = best.layers
    assert layers[1][0] + layers[1][-1] < 6  # the fastest plan keeps fewer than 3 + 3 there


# Small instances where the whole space (ldt.plan.exhaustive: every stage sequence, TP, per-
# stage dp, split, prefetch depth and recomputation) is enumerated: (kinds, edge, layers,
# micro-batch, global batch, memory per kind in GiB or None, what the reference's pick must
# show so the instance exercises it)
WHOLE_SPACE = [
    ({"a100": 2, "ascend910b": 4}, None, 8, 1, 32, None, "per-stage dp"),
    ({"edge_gpu": 2, "ascend910b": 6}, "edge_gpu", 6, 1, 16, None, "per-stage dp"),
    ({"v100": 4, "a100": 2}, None, 6, 4, 16, {"v100": 6, "a100": 7}, "recompute"),
    ({"edge_gpu": 1, "v100": 4}, "edge_gpu", 6, 4, 16, {"edge_gpu": 8, "v100": 6},
     "recompute"),
]


@pytest.mark.parametrize("case", WHOLE_SPACE, ids=lambda c: "+".join(c[0]) + "/" + c[-1])
@pytest.mark.parametrize("minimise", ["time", "cost"])
def test_the_planners_pick_is_the_objectives_pick_over_the_whole_space(case, minimise):
    """Signed gaps, planner / reference - 1, on the pick's iteration time and cost per step:
    a positive one is a plan the planner's search misses, a negative one a plan outside the
    reference's space (it would not be exhaustive); both must be 0. Memory binds in two
    instances (the reference's pick recomputes), per-stage dp wins in two under ``time``."""
    from ldt.plan import Objective, step_cost

    counts, edge, layers, mbs, gbs, memory, shows = case
    inventory = synthetic_inventory(counts, edge=edge, node_size=4, memory_gib=memory)
    model, wl, objective = small_model(layers), Workload(mbs, gbs), Objective(minimise)
    planned = plan(inventory, model, wl, objective=objective).best
    brute = exhaustive(inventory, model, wl, objective=objective).best
    time_gap = planned.iteration_time / brute.iteration_time - 1
    cost_gap = step_cost(planned, inventory) / step_cost(brute, inventory) - 1
    assert abs(time_gap) < 1e-9 and abs(cost_gap) < 1e-9, (
        f"time {time_gap:+.4%}, cost {cost_gap:+.4%}", planned.plan.describe(),
        brute.plan.describe())
    if shows == "recompute":
        assert any(brute.plan.recompute), brute.plan.describe()
    elif minimise == "time":
        assert brute.plan.stage_dp, brute.plan.describe()


@pytest.mark.parametrize("plan_of", ["u_shape_vdp_recompute", "plain"])
def test_a_plan_written_as_a_cluster_reads_back_as_the_plan(tmp_path, plan_of):
    """plan -> planned_cluster (a ClusterConfig) -> the YAML ldt-plan writes -> the cluster file
    read back -> cluster_to_plan: the same plan; and the chunks the planner prices are the
    chunks the trainer's topology builds from that file."""
    from dataclasses import replace

    from ldt.plan import Plan, StageSpec, cluster_to_plan, planned_cluster
    from ldt.plan.memory_cost import Recompute
    from ldt.topology.ranks import Topology

    inventory, model = load_inventory("edge_cloud"), load_model("llama_7b")
    if plan_of == "plain":
        npu = [k.name for k in inventory.kinds if k.device == "npu"][0]
        planned = Plan((StageSpec(npu, 4), StageSpec(npu, 2), StageSpec(npu, 8)), (10, 12, 10),
                       False, 2, 16)
    else:
        edge = inventory.edge
        cloud = [k.name for k in inventory.kinds if k.name != edge][0]
        planned = Plan((StageSpec(edge, 1), StageSpec(cloud, 4), StageSpec(cloud, 8)),
                       (2, 14, 15, 1), True, 2, 16, prefetch=3, stage_dp=(1, 2, 2),
                       recompute=(Recompute("selective", modules=("layernorm",)), None,
                                  Recompute("full", "uniform", 2)))
    best = simulate_plan(planned, make_cost(inventory, model, Workload(1, 64)))
    planned = best.plan  # as priced (recomputation fitted where a stage would not fit)
    cluster = planned_cluster(planned, inventory)
    assert plan_of == "plain" or (planned.stage_dp and any(planned.recompute))
    path = tmp_path / "planned.yaml"
    path.write_text(cluster_yaml(best, inventory, model.name, 1))
    read = load_cluster_yaml(str(path))
    assert read == cluster
    kinds = [s.kind for s in planned.stages]
    assert cluster_to_plan(read, model, inventory, 16, kinds) == replace(planned, prefetch=0)
    topo = Topology.from_config(read, model)
    for i in range(planned.num_stages):
        assert [(c.layers, c.embedding, c.head) for c in planned.stage_chunks(i)] == [
            (c.num_layers, c.has_embedding, c.has_head) for c in topo.split.stage_chunks(i)]


def test_the_table_s_memory_columns_add_up_to_the_total():
    """ldt-plan's per-stage table shows every term of a stage's memory (buffers, the backward's
    transient and a zero-bubble W store too): the columns add up to ``mem GiB``, within the
    rounding of the printed figures. (It showed four of seven terms.)"""
    from ldt.plan.results import table

    inventory, model = load_inventory("a100_910b"), load_model("llama_7b")
    for sp in (False, True):  # today's schedule, then a zero-bubble pick with its W store
        m = dataclasses.replace(model, sequence_parallel=sp)
        best = plan(inventory, m, Workload(1, 64)).best
        assert (best.schedule == "zb") == sp
        lines = table(best).splitlines()
        head = lines[0].split("  ")
        head = [h.strip() for h in head if h.strip()]
        first, last = head.index("weights"), head.index("mem GiB")
        assert ("W store" in head) == sp
        for row, stage in zip(lines[2:], best.stages):
            cells = row.split()[-(len(head) - first):]
            terms = [float(c) for c in cells[:last - first]]
            assert abs(sum(terms) - float(cells[last - first])) <= 0.005 * len(terms), row
            assert float(cells[last - first]) == round(stage.memory.total / 2**30, 2)


def test_the_train_settings_run_the_plan_on_the_runtime_it_was_priced_on():
    """A plain pipeline of uniform dp is priced on ldt's runtime's action lists, and
    ``train.runtime=auto`` would train it on megatron's 1F1B (which blocks on each exchange):
    the train settings say ``runtime: ldt``. The U-shape, per-stage dp and zb run there anyway."""
    from ldt.plan.results import train_settings, train_yaml

    inventory, model = synthetic_inventory({"a100": 4}), small_model(8)
    best = plan(inventory, model, Workload(1, 16, u_shape=False)).best
    plain = dataclasses.replace(best, schedule="auto", plan=dataclasses.replace(
        best.plan, stage_dp=(), u_shape=False))
    assert train_settings(plain, 1)["runtime"] == "ldt"
    assert "runtime: ldt" in train_yaml(plain, model.name, 1, "c")
    for other in (dataclasses.replace(plain, schedule="zb"),
                  dataclasses.replace(plain, plan=dataclasses.replace(plain.plan, u_shape=True))):
        assert "runtime" not in train_settings(other, 1)
