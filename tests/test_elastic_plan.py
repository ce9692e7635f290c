"""An elastic world's plan, without processes: nodes -> the planner -> who runs what.

The multi-host runs are in tests/test_elastic.py; here the pure parts, each in milliseconds:
what a node says about itself, the plan for a set of nodes (the data owner's stage on the
data owner's node, every TP group inside one node, the global batch kept, the same plan
whatever the order the nodes are listed in), what cannot be planned, train.resume=auto, and
the launcher checks.
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import timedelta

import pytest

from ldt.config import to_cluster
from ldt.elastic.nodes import ElasticError, Node, node_from_env
from ldt.elastic.replan import plan_world
from ldt.elastic.world import check_launcher
from ldt.plan import load_inventory, load_model
from ldt.topology.ranks import Topology

CLUSTER = {"inventory": "cpu_elastic", "stages": [], "u_shape": True, "dp": 1,
           "host_staging": "auto", "link_delay_ms": 0.0}
CONFIGURED = to_cluster(CLUSTER)  # as plan_world takes it
TRAIN = {"micro_batch_size": 2, "num_microbatches": 8}  # global batch 16


@pytest.fixture(scope="module")
def inventory():
    return load_inventory("cpu_elastic")


@pytest.fixture(scope="module")
def model():
    return load_model("gpt_tiny")


def nodes(*spec):
    """Node i of (kind, devices) or (kind, devices, memory)."""
    return [Node(i, f"host{i}", *s) for i, s in enumerate(spec)]


WORLDS = {
    "three hosts": nodes(("edge_cpu", 1), ("cloud_cpu", 2), ("cloud_cpu", 1)),
    "one host lost": nodes(("edge_cpu", 1), ("cloud_cpu", 2)),
    "edge not first": nodes(("cloud_cpu", 2), ("cloud_cpu", 1), ("edge_cpu", 1)),
    "replicas": nodes(("edge_cpu", 2), ("cloud_cpu", 4), ("cloud_cpu", 4)),
    "idle devices": nodes(("edge_cpu", 3), ("cloud_cpu", 2)),
}


@pytest.mark.parametrize("name", sorted(WORLDS))
def test_a_planned_world_prices_its_zero_bubble_order_by_its_nodes_kinds(name, inventory,
                                                                         model):
    """train.schedule=zb in an elastic run: the planned cluster's stages name their nodes'
    kinds, so the order is priced by each one's (the edge by edge_cpu's figures)."""
    from ldt.config import typed_config
    from ldt.config.load import config_dict
    from ldt.plan.zb_prices import planned_kinds, run_prices

    plan = plan_world(WORLDS[name], inventory, model, CONFIGURED, TRAIN)
    cfg = typed_config({"cluster": plan.cluster, "model": config_dict(model),
                        "train": {**TRAIN, "num_microbatches": plan.num_microbatches,
                                  "schedule": "zb"}})
    stages = len(cfg.cluster.stages)
    assert planned_kinds(cfg.cluster, inventory) == ["edge_cpu"] + ["cloud_cpu"] * (stages - 1)
    costs, _ = run_prices(cfg.cluster, cfg.model, cfg.train).tables()
    assert {s for s, _ in costs} == set(range(stages))


def test_a_world_is_priced_on_the_schedule_it_will_run(inventory, model):
    """A world trains train.schedule as configured. Without zb its plan (prefetch, predicted
    step) is today's schedule's, although the zero-bubble one would be faster here (a world
    told prefetch 1 and 30.9 ms would run today's U-shape at that depth); with zb, the
    zero-bubble one's."""
    world = WORLDS["one host lost"]
    today = plan_world(world, inventory, model, CONFIGURED, TRAIN)
    zb = plan_world(world, inventory, model, CONFIGURED, {**TRAIN, "schedule": "zb"})
    assert zb.iteration_s < today.iteration_s
    assert (today.prefetch, zb.prefetch) == (3, 1)


@pytest.mark.timeout(120)
def test_a_world_whose_zero_bubble_store_does_not_fit_trains_todays_schedule(inventory, tmp_path):
    """train.schedule=zb lets each world's planner choose between today's schedule and the
    zero-bubble one, as ldt-plan does. On nodes with 6 MiB usable, llama_tiny's W store does
    not fit: the world runs today's schedule at today's prefetch and the job's config says so.
    (It trained zb at today's prefetch, so its memory check stopped the run with exit 2.)"""
    from omegaconf import OmegaConf

    from ldt.job.elastic import _planned
    from ldt.job.hydra import compose

    model = load_model("llama_tiny")
    zb = {**TRAIN, "schedule": "zb"}
    roomy = plan_world(WORLDS["one host lost"], inventory, model, CONFIGURED, zb)
    assert roomy.schedule == "zb" and "the zero-bubble schedule" in roomy.describe()
    tight = [Node(n.index, n.host, n.kind, n.devices, 1.006) for n in WORLDS["one host lost"]]
    plan = plan_world(tight, inventory, model, CONFIGURED, zb)
    assert plan.schedule == "auto" and "zero-bubble" not in plan.describe()
    assert plan.digest() != dataclasses.replace(plan, schedule="zb").digest()
    plain = OmegaConf.to_container(compose(["cluster=cpu_demo", "model=llama_tiny",
                                            "train.schedule=zb"]), resolve=True)
    world = _World(0, plan)
    world.run = {"run_dir": str(tmp_path), "resume": None, "load": None}
    checked = _planned(plain, world)
    assert checked.cfg.train.schedule == "auto" and checked.priced is None
    assert checked.cfg.train.prefetch == plan.prefetch


@pytest.mark.parametrize("name", sorted(WORLDS))
def test_a_plan_runs_on_the_nodes_there_are(name, inventory, model):
    world = WORLDS[name]
    plan = plan_world(world, inventory, model, CONFIGURED, TRAIN)
    topo = Topology.from_config(plan.cluster, model)  # a valid cluster for this model
    assert plan.world_size == topo.world_size == len(plan.placement)
    # the global batch stays 16 sequences, whatever dp and micro-batches the plan picked
    assert topo.dp * plan.num_microbatches * TRAIN["micro_batch_size"] == 16
    edge = next(n.index for n in world if n.kind == "edge_cpu")
    by_node = {n.index: n for n in world}
    used = set()
    for rank, (node, local) in enumerate(plan.placement):
        info = topo.rank_info(rank)
        assert 0 <= local < by_node[node].devices and (node, local) not in used
        used.add((node, local))
        # the data owner's stage runs on the data owner's node, and nothing else runs there
        assert (info.stage == 0) == (node == edge), (rank, info, node)
        # a stage replica's TP group is on one node (its TP rank 0's)
        leader = rank - info.tp_rank
        assert plan.placement[leader][0] == node
    assert plan.rank_of(edge, 0) == 0  # ldt rank 0 is the edge's leader, whatever the order
    idle = [(n.index, k) for n in world for k in range(n.devices) if (n.index, k) not in used]
    assert all(plan.rank_of(*p) is None for p in idle)
    assert sum(n.devices for n in world) == plan.world_size + len(idle)


def test_the_plan_is_the_same_whatever_order_the_nodes_come_in(inventory, model):
    world = WORLDS["replicas"]
    one = plan_world(world, inventory, model, CONFIGURED, TRAIN)
    other = plan_world(list(reversed(world)), inventory, model, CONFIGURED, TRAIN)
    assert one == other and one.digest() == other.digest()
    assert one.digest() != plan_world(WORLDS["three hosts"], inventory, model, CONFIGURED,
                                      TRAIN).digest()
    assert "idle" in plan_world(WORLDS["idle devices"], inventory, model, CONFIGURED,
                                TRAIN).describe()


def test_the_planned_cluster_keeps_what_was_configured(inventory, model):
    """The plan replaces the stages, layout, dp and U-shape of the configured cluster
    (dataclasses.replace): every other configured field reaches the world's cluster."""
    configured = to_cluster({**CLUSTER, "host_staging": "always", "boundary_fanout": "never",
                             "link_delay_ms": 0.5})
    plan = plan_world(WORLDS["three hosts"], inventory, model, configured, TRAIN)
    planned = to_cluster(plan.cluster)
    assert (planned.inventory, planned.host_staging, planned.boundary_fanout,
            planned.link_delay_ms) == ("cpu_elastic", "always", "never", 0.5)
    assert planned.u_shape and planned.stages and planned.layout
    assert [s.name for s in planned.stages][0] == "edge"


@pytest.mark.parametrize("run", ["megatron's runtime", "tied embeddings"])
def test_a_world_plans_only_what_its_run_can_train(run, inventory, model):
    """A plain pipeline on megatron's runtime, or with the embedding tied to a head on another
    stage, cannot give stages their own dp (validate refuses it): the planner must not pick
    such a plan for any set of nodes, else the run dies at the start after a host is lost or
    comes back, instead of training on."""
    from ldt.topology.validate import validate

    cluster = to_cluster({**CLUSTER, "u_shape": False})
    train = {**TRAIN, "runtime": "megatron"} if run == "megatron's runtime" else TRAIN
    tied = dataclasses.replace(model, tie_embeddings=run == "tied embeddings")
    for name, world in sorted(WORLDS.items()):
        plan = plan_world(world, inventory, tied, cluster, train)
        validate(plan.cluster, tied, world_size=plan.world_size, check_devices=False,
                 train={**train, "num_microbatches": plan.num_microbatches})


def test_a_world_without_the_data_owner_is_refused(inventory, model):
    with pytest.raises(ElasticError) as err:
        plan_world(nodes(("cloud_cpu", 2), ("cloud_cpu", 1)), inventory, model, CONFIGURED, TRAIN)
    text = str(err.value)
    assert text.startswith("the data owner is gone: no node of the edge kind 'edge_cpu'")
    assert "node 0 (host0: 2 x cloud_cpu)" in text and "LDT_NODE_KIND=edge_cpu" in text
    assert "\n" not in text
    with pytest.raises(ElasticError, match="2 nodes say they are the data owner"):
        plan_world(nodes(("edge_cpu", 1), ("edge_cpu", 1), ("cloud_cpu", 2)), inventory, model,
                   CONFIGURED, TRAIN)


def test_too_few_devices_stop_with_the_planners_reason(inventory, model):
    # the edge alone: a U-shape needs a cloud stage
    with pytest.raises(ElasticError, match=r"no plan fits the nodes there are \(node 0 "
                                           r"\(host0: 1 x edge_cpu\)\): no plan fits"):
        plan_world(nodes(("edge_cpu", 1)), inventory, model, CONFIGURED, TRAIN)
    # too little memory per device (1.001 GiB, of which the kind reserves 1)
    with pytest.raises(ElasticError, match="no plan fits the nodes there are.*GiB"):
        plan_world(nodes(("edge_cpu", 1, 1.001), ("cloud_cpu", 2, 1.001)), inventory, model,
                   CONFIGURED, TRAIN)


def test_a_node_describes_itself_from_its_environment():
    kinds = ["edge_cpu", "cloud_cpu"]
    env = {"GROUP_RANK": "2", "LOCAL_WORLD_SIZE": "4", "LDT_NODE_KIND": "cloud_cpu"}
    node = node_from_env(env, kinds)
    assert (node.index, node.kind, node.devices, node.memory_gib) == (2, "cloud_cpu", 4, None)
    assert Node.from_json(node.to_json()) == node
    assert node_from_env({**env, "LDT_NODE_MEMORY_GIB": "32"}, kinds).memory_gib == 32.0
    for extra, text in (({"LDT_NODE_KIND": ""}, "LDT_NODE_KIND is not set on node 2"),
                        ({"LDT_NODE_KIND": "gpu"}, "LDT_NODE_KIND='gpu' on node 2"),
                        ({"LDT_NODE_MEMORY_GIB": "lots"}, "LDT_NODE_MEMORY_GIB='lots'"),
                        ({"LDT_NODE_MEMORY_GIB": "-1"}, "must be a number of GiB > 0")):
        with pytest.raises(ElasticError, match=text):
            node_from_env({**env, **extra}, kinds)


def test_the_launcher_must_be_torchrun_without_its_shared_store():
    env = {v: "0" for v in ("RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                            "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    check_launcher(env)
    check_launcher({**env, "TORCHELASTIC_USE_AGENT_STORE": "True",
                    "TORCHELASTIC_MAX_RESTARTS": "0"})  # no restarts: the shared store is fine
    with pytest.raises(ElasticError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        check_launcher({**env, "TORCHELASTIC_USE_AGENT_STORE": "True",
                        "TORCHELASTIC_MAX_RESTARTS": "3"})
    with pytest.raises(ElasticError, match="GROUP_RANK is not set"):
        check_launcher({k: v for k, v in env.items() if k != "GROUP_RANK"})


def _checkpoint(run_dir, step):
    folder = run_dir / "checkpoints" / f"step_{step:07d}"
    folder.mkdir(parents=True)
    (folder / "checkpoint.json").write_text(json.dumps({"step": step}))
    (folder / "COMPLETE").write_text(f"{step}\n")
    return str(folder)


def test_resume_auto_continues_the_newest_checkpoint(tmp_path):
    from ldt.storage.checkpoint_files import resume_auto

    def resolved(resume, elastic=False, steps=10, load=None):
        train = {"resume": resume, "load": load, "steps": steps}
        return resume_auto(train, str(tmp_path), elastic), train

    assert resolved("auto") == (None, {"resume": None, "load": None, "steps": 10})
    assert resolved(None, elastic=True)[1]["resume"] is None  # elastic: auto by default
    _checkpoint(tmp_path, 3)
    (tmp_path / "checkpoints" / "step_0000005").mkdir()  # a save that never completed
    newest = _checkpoint(tmp_path, 4)
    assert resolved("auto", load="/weights")[1] == {"resume": newest, "load": None, "steps": 10}
    assert resolved(None, elastic=True)[1]["resume"] == newest
    assert resolved("/earlier/run", elastic=True)[1]["resume"] == newest  # the run's own first
    assert resolved("/earlier/run")[1]["resume"] == "/earlier/run"  # not auto, not elastic
    done, train = resolved("auto", steps=5)
    assert "is step 4, the last of train.steps=5: the run is complete" in done
    done, _ = resolved("auto", steps=3)  # a shorter train.steps than the run went
    assert "is step 4, past the end of train.steps=3: the run is complete" in done
    assert train["resume"] is None
    assert os.path.isdir(newest)


def _torchrun_env(rank, node, local, nodes_n, local_n, world, kind):
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "GROUP_RANK": str(node),
            "GROUP_WORLD_SIZE": str(nodes_n), "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(local_n), "MASTER_ADDR": "-", "MASTER_PORT": "0",
            **({"LDT_NODE_KIND": kind} if kind else {})}


def _form_worlds(kinds, run):
    """form_world on threads, one per torchrun process, over one in-process store."""
    import threading

    import torch.distributed as dist

    from ldt.elastic.world import form_world

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=20))
    model = load_model("gpt_tiny")
    plain = {"cluster": dict(CLUSTER), "train": dict(TRAIN)}
    procs = [(node, local, len(kinds), kind, devices) for node, (kind, devices) in
             enumerate(kinds) for local in range(devices)]
    out: dict[int, object] = {}

    def one(rank, node, local, nodes_n, kind, devices):
        env = _torchrun_env(rank, node, local, nodes_n, devices, len(procs), kind)
        try:
            out[rank] = form_world(plain, model, run if rank == 0 else None, env, 20, store)
        except Exception as exc:  # noqa: BLE001  (what each rank raised is the result)
            out[rank] = exc
    threads = [threading.Thread(target=one, args=(r, *p)) for r, p in enumerate(procs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return [out[r] for r in range(len(procs))]


def test_the_ranks_exchange_nodes_and_agree_through_the_store(tmp_path):
    """torchrun's order puts two cloud processes first; the edge's process is ldt rank 0."""
    run = {"run_dir": str(tmp_path), "resume": None, "load": None, "complete": None}
    worlds = _form_worlds([("cloud_cpu", 2), ("edge_cpu", 1)], run)
    assert all(w.plan.digest() == worlds[0].plan.digest() and w.run == run for w in worlds)
    assert worlds[2].rank == 0  # torchrun rank 2 (node 1, the edge) leads ldt's world
    assert sorted(w.rank for w in worlds) == [0, 1, 2]


def test_one_nodes_or_rank_zeros_error_stops_every_rank(tmp_path):
    run = {"run_dir": str(tmp_path), "resume": None, "load": None, "complete": None}
    worlds = _form_worlds([("edge_cpu", 1), ("", 2)], run)  # node 1 names no kind
    assert all(isinstance(w, ElasticError) and "LDT_NODE_KIND is not set on node 1" in str(w)
               for w in worlds), worlds
    worlds = _form_worlds([("edge_cpu", 1), ("cloud_cpu", 1)], {"error": "damaged"})
    assert all(isinstance(w, ElasticError) and str(w) == "damaged" for w in worlds), worlds


def test_a_ranks_failed_check_stops_all_and_only_a_finished_run_frees_the_idle(tmp_path):
    import threading

    import torch.distributed as dist

    from ldt.elastic.world import ElasticWorld

    plan = plan_world(WORLDS["three hosts"], load_inventory("cpu_elastic"),
                      load_model("gpt_tiny"), CONFIGURED, TRAIN)
    store = dist.HashStore()
    got: dict[int, object] = {}

    def check(rank):
        world = ElasticWorld(rank, plan, {}, store)
        try:
            world.settle("data.path='x' is not a file" if rank == 2 else None)
            got[rank] = None
        except ElasticError as exc:
            got[rank] = str(exc)
    threads = [threading.Thread(target=check, args=(r,)) for r in range(plan.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == {r: "rank 2: data.path='x' is not a file" for r in range(plan.world_size)}
    ElasticWorld(0, plan, {}, store).finish(1)  # a failed run: the idle ones wait on
    assert not store.check(["done"])
    ElasticWorld(0, plan, {}, store).finish(0)
    assert store.check(["done"])


class _World:
    """What the elastic job's memory check needs of ldt.elastic.world.World: the rank, and
    settle (the first rank's error stops every rank)."""

    def __init__(self, rank, plan=None):
        self.rank, self.settled, self.plan = rank, [], plan

    def settle(self, error):
        self.settled.append(error)
        if error:
            raise ElasticError(f"rank 0: {error}")


@pytest.mark.timeout(120)
def test_the_elastic_job_checks_the_planned_worlds_memory(inventory, model, monkeypatch):
    """The plan states each stage's memory_gib (the planner's limit for its kind), so the
    elastic job's rank 0 estimates the planned world as ldt-train estimates a configured one
    (in its own process) and a stage over its limit stops every rank before any group forms;
    the other ranks do not estimate (the same plan everywhere), they take rank 0's verdict."""
    from omegaconf import OmegaConf

    from ldt.job.elastic import check_memory
    from ldt.job.hydra import compose

    plan = plan_world(WORLDS["three hosts"], inventory, model, CONFIGURED, TRAIN)
    assert all(st["memory_gib"] for st in plan.cluster["stages"])
    plain = OmegaConf.to_container(compose(["cluster=cpu_demo"]), resolve=True)
    plain["cluster"] = plan.cluster
    plain["train"].update(num_microbatches=plan.num_microbatches, prefetch=plan.prefetch)
    topo = Topology.from_config(plan.cluster, model)
    other = _World(1)
    assert check_memory(plain, topo, other) == "" and other.settled == [None]
    plain["cluster"]["stages"][0]["memory_gib"] = 0.001  # as if the planner had mispriced it
    import ldt.memory  # a helper process would be a second start of torch and megatron-core

    monkeypatch.setattr(ldt.memory.local, "run_local_world", lambda *a, **k: 1 / 0)
    with pytest.raises(ElasticError, match=r"rank 0: does not fit: stage 0 \(\w+, ranks 0\) "
                                           r"needs [\d.]+ MiB per rank \(estimate\) but "
                                           r"cluster.stages\[0\].memory_gib=0.001"):
        check_memory(plain, topo, _World(0, plan))


@pytest.mark.timeout(120)
def test_a_host_without_room_for_its_snapshots_and_copies_is_refused(inventory, model):
    """train.snapshot_dir in an elastic world: each node's host memory holds its ranks' own
    snapshots and the copies it keeps for the other cloud host's ranks (3 generations each);
    the edge keeps none of the cloud's. A node whose MemAvailable (LDT_NODE_HOST_MEMORY_GIB)
    is below that stops every rank with one line before any group forms."""
    import dataclasses

    from omegaconf import OmegaConf

    from ldt import memory
    from ldt.job.elastic import _hosts, check_memory
    from ldt.job.hydra import compose
    from ldt.memory.report import SNAPSHOTS_HELD, host_snapshots

    plan = plan_world(WORLDS["three hosts"], inventory, model, CONFIGURED, TRAIN)
    plain = OmegaConf.to_container(compose(["cluster=cpu_demo", "train.snapshot_dir=/dev/shm"]),
                                   resolve=True)
    plain["cluster"] = plan.cluster
    plain["train"].update(num_microbatches=plan.num_microbatches, prefetch=plan.prefetch)
    topo = Topology.from_config(plan.cluster, model)
    stages = memory.estimate(plain)
    stage_of = {r: s.index for s in stages for r in s.ranks}
    held = {s.index: SNAPSHOTS_HELD * s.snapshot_bytes for s in stages}
    hosts = _hosts(plan, topo, "cpu_elastic")
    per_host = host_snapshots(stages, topo, hosts, sharded=False)
    node_of = dict(enumerate(hosts.nodes))
    edge = node_of[0]
    assert per_host[edge] == (held[0], 0)  # the data owner keeps no cloud part
    cloud = sorted(set(hosts.nodes) - {edge})
    for node, other in ((cloud[0], cloud[1]), (cloud[1], cloud[0])):  # each keeps the other's
        own = sum(held[stage_of[r]] for r, n in node_of.items() if n == node)
        kept = sum(held[stage_of[r]] for r, n in node_of.items() if n == other)
        assert per_host[node] == (own, kept)
    text = check_memory(plain, topo, _World(0, plan))  # hosts' memory unknown: no refusal
    assert "host memory per node for snapshots (own + copies kept for other hosts)" in text
    # the copies' traffic, priced on the inventory's cloud-cloud link (1 GB/s, 200 us)
    for a, b in ((cloud[0], cloud[1]), (cloud[1], cloud[0])):
        nbytes = sum(held[stage_of[r]] for r, n in node_of.items() if n == a) // SNAPSHOTS_HELD
        assert f"node {a} -> {b} " in text and \
            f" {(nbytes / 1e9 + 200e-6) * 1e3:.1f} ms" in text.split(f"node {a} -> {b} ")[1][:40]
    assert f"against a planned step of {plan.iteration_s * 1e3:.1f} ms" in text
    # a snapshot every 3 steps: its copies have 3 planned steps to travel, and one that takes
    # longer than a step but less than 3 is not named as too slow
    from ldt.memory.report import copy_line
    every = copy_line(stages, topo, hosts, False, every=3)
    assert every.startswith("snapshot copies every 3 steps (the inventory's links): ")
    assert f"against 3 planned steps of {plan.iteration_s * 1e3:.1f} ms" in every
    pair = (cloud[0], cloud[1])
    slowish = dataclasses.replace(hosts, send_s=lambda a, b, n: plan.iteration_s * (
        2 if (a, b) == pair else 0.5))
    assert f"slower than a step ({pair[0]} -> {pair[1]})" in copy_line(stages, topo, slowish,
                                                                        False)
    assert "slower" not in copy_line(stages, topo, slowish, False, every=3)
    small = dataclasses.replace(plan, nodes=tuple(
        dataclasses.replace(n, host_memory_gib=1e-6 if str(n.index) == cloud[0] else 64.0)
        for n in plan.nodes))
    with pytest.raises(ElasticError, match=rf"rank 0: does not fit: node {cloud[0]} would keep "
                                           r"[\d.]+ [KM]iB of snapshots in host memory .* but had "
                                           r"0.00 GiB available .*train.snapshot_dir=null"):
        check_memory(plain, topo, _World(0, small))
