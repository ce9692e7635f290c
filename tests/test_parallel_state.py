"""VTP parallel state on real gloo worlds: groups, ranks and megatron-core's view of them.

One world per topology; each rank records what megatron-core and ldt report, the parent
asserts against the topology's own arithmetic and against hand-written expectations. On a
uniform topology the same world first builds megatron's own ``initialize_model_parallel``,
and every getter of megatron-core's ``parallel_state`` must answer as it does there.
Collectives megatron issues on ldt's cross-stage groups (pipeline, embedding, model parallel,
distributed-optimizer instance) and the reference implementation's API, used the way its
own callers use it, run in the same worlds.
"""

import pytest
import torch

from ldt.config import ClusterConfig, StageConfig
from ldt.launch import run_local_world
from ldt.topology import Topology


def cluster(tps, u_shape=False, dp=1):
    return ClusterConfig(stages=[StageConfig(name=f"s{i}", device="cpu", tp=t)
                                 for i, t in enumerate(tps)], u_shape=u_shape, dp=dp)


# Every getter of megatron-core 0.16's parallel_state, with the argument variants that pick
# another group; each is called and its answer recorded (a group as its members, size, rank).
GETTERS = [(name, {}) for name in (
    "get_all_ranks", "get_amax_reduction_group", "get_context_parallel_global_ranks",
    "get_context_parallel_group", "get_context_parallel_rank", "get_context_parallel_world_size",
    "get_data_parallel_group", "get_data_parallel_group_gloo", "get_data_parallel_rank",
    "get_data_parallel_src_rank", "get_data_parallel_world_size", "get_embedding_group",
    "get_expert_data_parallel_group", "get_expert_data_parallel_group_gloo",
    "get_expert_data_parallel_rank", "get_expert_data_parallel_world_size",
    "get_expert_model_parallel_group", "get_expert_model_parallel_rank",
    "get_expert_model_parallel_src_rank", "get_expert_model_parallel_world_size",
    "get_expert_tensor_and_model_parallel_group", "get_expert_tensor_and_model_parallel_rank",
    "get_expert_tensor_and_model_parallel_world_size",
    "get_expert_tensor_model_pipeline_parallel_group", "get_expert_tensor_parallel_group",
    "get_expert_tensor_parallel_rank", "get_expert_tensor_parallel_world_size",
    "get_global_memory_buffer", "get_hierarchical_context_parallel_groups",
    "get_inter_distributed_optimizer_instance_group",
    "get_intra_distributed_optimizer_instance_group", "get_model_parallel_group",
    "get_model_parallel_src_rank", "get_pipeline_model_parallel_first_rank",
    "get_pipeline_model_parallel_group", "get_pipeline_model_parallel_last_rank",
    "get_pipeline_model_parallel_next_rank", "get_pipeline_model_parallel_prev_rank",
    "get_pipeline_model_parallel_rank", "get_pipeline_model_parallel_world_size",
    "get_position_embedding_group", "get_tensor_and_context_parallel_group",
    "get_tensor_and_context_parallel_rank", "get_tensor_and_context_parallel_world_size",
    "get_tensor_and_data_parallel_group", "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank", "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_world_size", "get_virtual_pipeline_model_parallel_rank",
    "get_virtual_pipeline_model_parallel_world_size", "is_initialized",
    "is_pipeline_first_stage", "is_pipeline_last_stage", "is_rank_in_embedding_group",
    "is_rank_in_position_embedding_group", "model_parallel_is_initialized")] + [
    ("get_data_parallel_group", {"with_context_parallel": True}),
    ("get_data_parallel_group", {"with_context_parallel": True, "partial_data_parallel": True}),
    ("get_data_parallel_group_gloo", {"with_context_parallel": True}),
    ("get_data_parallel_group_gloo", {"with_context_parallel": True, "partial_data_parallel": True}),
    ("get_data_parallel_rank", {"with_context_parallel": True}),
    ("get_data_parallel_world_size", {"with_context_parallel": True}),
    ("get_data_parallel_src_rank", {"with_context_parallel": True}),
    ("get_expert_data_parallel_group", {"partial_expert_data_parallel": True}),
    ("get_expert_data_parallel_group_gloo", {"partial_expert_data_parallel": True}),
    ("get_tensor_and_data_parallel_group", {"with_context_parallel": True}),
    ("get_amax_reduction_group", {"with_context_parallel": True}),
    ("get_amax_reduction_group", {"tp_only_amax_red": True}),
    ("get_embedding_group", {"check_initialized": False}),
    ("get_position_embedding_group", {"check_initialized": False}),
]
# Getters that name ranks of *other* stages: ldt names their leaders (only leaders cross
# stages), megatron the rank with the same TP rank; both must name a rank of the same stage.
OTHER_STAGE_RANKS = {"get_pipeline_model_parallel_group", "get_pipeline_model_parallel_first_rank",
                     "get_pipeline_model_parallel_last_rank", "get_pipeline_model_parallel_next_rank",
                     "get_pipeline_model_parallel_prev_rank", "get_embedding_group",
                     "get_position_embedding_group"}


def _answers():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    out = {}
    for name, kwargs in GETTERS:
        key = name + "".join(f",{k}={v}" for k, v in sorted(kwargs.items()))
        try:
            value = getattr(ps, name)(**kwargs)
        except Exception as exc:  # megatron asserts where a group does not exist
            out[key] = ["raises", type(exc).__name__]
            continue
        if isinstance(value, dist.ProcessGroup):
            value = ["group", dist.get_process_group_ranks(value), value.size(), value.rank()]
        elif not (value is None or isinstance(value, (bool, int, str, list, tuple))):
            value = ["object", type(value).__name__]
        out[key] = list(value) if isinstance(value, tuple) else value
    return out


def _collectives(state, topo):
    """What megatron-core does on ldt's groups, with values that show who contributed."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.utils import get_pp_last_rank

    info, out = state.info, {}
    pp = ps.get_pipeline_model_parallel_group()
    t = torch.tensor([10.0 * (info.stage + 1) + info.tp_rank])  # non-leaders differ: ignored
    dist.all_reduce(t, group=pp)
    out["pp_sum"] = t.item()
    t = torch.tensor([float(info.stage)])  # finalize_model_grads' token-count broadcast
    dist.broadcast(t, src=get_pp_last_rank(pp), group=pp)
    out["pp_bcast_last"] = t.item()
    gathered = [torch.zeros(1) for _ in range(pp.size())]
    dist.all_gather(gathered, torch.tensor([float(info.stage)]), group=pp)
    out["pp_gather"] = [g.item() for g in gathered]
    dist.barrier(group=pp)
    mp = ps.get_model_parallel_group()
    t = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(t, group=mp)
    out["mp_sum"] = t.item()
    t = torch.tensor([float(info.rank)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mp)
    out["mp_max"] = t.item()
    src = dist.get_process_group_ranks(mp)[-1]  # the last rank of the last stage
    t = torch.tensor([float(info.rank)])
    dist.broadcast(t, src=src, group=mp)
    out["mp_bcast"] = t.item()
    t = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(t, group=ps.get_intra_distributed_optimizer_instance_group())
    out["dist_opt_sum"] = t.item()
    embd = ps.get_embedding_group(check_initialized=False)
    if embd is not None and embd.size() > 1:  # vocabulary shards by each stage's TP size
        vocab, tp = 12, len(state.stage_ranks)
        full = torch.arange(vocab * 2, dtype=torch.float32).reshape(vocab, 2)
        mine = full * (1 if info.stage == 0 else 100)
        shard = mine.chunk(tp)[info.tp_rank].clone()
        dist.all_reduce(shard, group=embd)
        out["embd_shard"] = shard.tolist()
    return out


def _reference_api(state, topo):
    """The reference's idioms: stage leader lookup, handle lists, group= / *_rank= keywords."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import ldt
    from ldt import p2p

    out = {"leader_idiom": ldt.get_vtp_stage_ranks()[ldt.get_vtp_my_stage_idx()][0],
           "enabled": ldt.is_vtp_enabled() if hasattr(ldt, "is_vtp_enabled") else None}
    config = SimpleNamespace(pipeline_dtype=torch.float32, virtual_pipeline_model_parallel_size=None,
                             sequence_parallel=False, variable_seq_lengths=False)
    d = state.info.dp_rank
    user_group = None  # a group of the leaders that the caller built itself
    for dd in range(topo.dp):
        g = dist.new_group(list(topo.leaders(dd)), backend="gloo")
        if dd == d:
            user_group = g
    for label, kwargs in (("pp_group", {"group": ps.get_pipeline_model_parallel_group()}),
                          ("own_group", {"group": user_group})):
        handles = []
        h = p2p.vtp_send_forward(torch.full((2, 3), float(state.stage)),
                                 next_rank=ps.get_pipeline_model_parallel_next_rank(), **kwargs)
        if h is not None:
            handles.extend(h)
        x, reqs = p2p.vtp_recv_forward((2, 3), config, async_op=True,
                                       prev_rank=ps.get_pipeline_model_parallel_prev_rank(),
                                       **kwargs)
        reqs["recv_prev"].wait()
        h = p2p.vtp_send_backward(x.detach() + 0.5,
                                  prev_rank=ps.get_pipeline_model_parallel_prev_rank(), **kwargs)
        if h is not None:
            handles.extend(h)
        g = p2p.vtp_recv_backward((2, 3), config,
                                  next_rank=ps.get_pipeline_model_parallel_next_rank(), **kwargs)
        for h in handles:
            h.wait()
        out[label] = {"handles": len(handles), "fwd": x[0, 0].item(), "bwd": g[0, 0].item()}
    return out


def _observe(rank, world, topo):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import ldt

    megatron_answers = None
    if len(set(topo.tp_sizes)) == 1 and not topo.u_shape:  # megatron's own state first
        ps.initialize_model_parallel(topo.tp_sizes[0], topo.num_stages)
        megatron_answers = _answers()
        ps.destroy_model_parallel()
    state = ldt.initialize_vtp(topo, timeout_s=60)
    obs = {
        "tp_members": dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
        "tp_size": ps.get_tensor_model_parallel_world_size(),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "pp_size": ps.get_pipeline_model_parallel_world_size(),
        "next": ps.get_pipeline_model_parallel_next_rank(),
        "prev": ps.get_pipeline_model_parallel_prev_rank(),
        "first": ps.is_pipeline_first_stage(),
        "last": ps.is_pipeline_last_stage(),
        "dp_size": ps.get_data_parallel_world_size(),
        "dp_rank": ps.get_data_parallel_rank(),
        "is_rank0": ldt.is_vtp_stage_rank0(),
        "sizes": ldt.get_vtp_size_list(),
        "stage_ranks": ldt.get_vtp_stage_ranks(),
        "stage_idx": ldt.get_vtp_my_stage_idx(),
    }
    # all-reduce of the global rank inside the TP group and the DP group
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=ps.get_tensor_model_parallel_group())
    obs["tp_sum"] = t.item()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=ps.get_data_parallel_group())
    obs["dp_sum"] = t.item()
    # every boundary group carries one message from the sending leader
    got = {}
    for (src, dst), (plan, group) in sorted(state.boundary_groups.items()):
        src_rank, dst_rank = topo.leader(src, state.info.dp_rank), topo.leader(dst, state.info.dp_rank)
        if rank == src_rank:
            dist.send(torch.tensor([float(100 * src + dst)]), dst_rank, group=group)
        else:
            buf = torch.zeros(1)
            dist.recv(buf, src_rank, group=group)
            got[f"{src}->{dst}"] = buf.item()
    obs["boundary_msgs"] = got
    obs["getters"], obs["megatron_getters"] = _answers(), megatron_answers
    obs["collectives"] = _collectives(state, topo)
    obs["reference"] = _reference_api(state, topo)
    ldt.destroy_vtp()
    obs["reset"] = not ps.model_parallel_is_initialized()
    return obs


TOPOLOGIES = {
    "cpu_demo": cluster([1, 2, 1], u_shape=True),
    "cpu_vtp": cluster([2, 1, 2]),
    "ring2": cluster([2, 1], u_shape=True),
    "dp2": cluster([1, 2], dp=2),
    "uniform22": cluster([2, 2]),
}


@pytest.fixture(scope="module", params=sorted(TOPOLOGIES))
def world(request):
    topo = Topology.from_config(TOPOLOGIES[request.param])
    obs = run_local_world(topo.world_size, _observe, (topo,), timeout_s=120)
    return topo, obs


@pytest.mark.timeout(180)
def test_megatron_sees_own_stage(world):
    topo, obs = world
    for rank, o in enumerate(obs):
        info = topo.rank_info(rank)
        stage = topo.stages[info.stage]
        assert o["tp_members"] == list(topo.stage_ranks(info.stage, info.dp_rank))
        assert (o["tp_size"], o["tp_rank"]) == (stage.tp, info.tp_rank)
        assert (o["pp_rank"], o["pp_size"]) == (info.stage, topo.num_stages)
        nxt = (info.stage + 1) % topo.num_stages
        prv = (info.stage - 1) % topo.num_stages
        assert o["next"] == topo.leader(nxt, info.dp_rank)
        assert o["prev"] == topo.leader(prv, info.dp_rank)
        assert o["first"] == (info.stage == 0)
        assert o["last"] == (info.stage == topo.num_stages - 1)
        assert (o["dp_size"], o["dp_rank"]) == (topo.dp, info.dp_rank)
        assert o["is_rank0"] == (info.tp_rank == 0)
        assert o["sizes"] == topo.tp_sizes
        assert o["stage_ranks"] == [list(topo.stage_ranks(s, info.dp_rank))
                                    for s in range(topo.num_stages)]
        assert o["stage_idx"] == info.stage
        assert o["reset"]


@pytest.mark.timeout(180)
def test_collectives_in_tp_dp_and_boundary_groups(world):
    topo, obs = world
    for rank, o in enumerate(obs):
        info = topo.rank_info(rank)
        assert o["tp_sum"] == sum(topo.stage_ranks(info.stage, info.dp_rank))
        assert o["dp_sum"] == sum(topo.dp_ranks(info.stage, info.tp_rank))
        expected = {}
        if info.is_leader:
            for b in topo.boundaries():
                if b.dst_stage == info.stage:
                    expected[f"{b.src_stage}->{b.dst_stage}"] = float(100 * b.src_stage + b.dst_stage)
        assert o["boundary_msgs"] == expected


def test_hand_written_layout_of_cpu_demo():
    """Independent of the code under test: the rank map DESIGN.md describes for cpu_demo."""
    topo = Topology.from_config(TOPOLOGIES["cpu_demo"])
    assert [topo.stage_ranks(s) for s in range(3)] == [(0,), (1, 2), (3,)]
    assert topo.leaders() == (0, 1, 3)
    assert [(b.src_stage, b.dst_stage) for b in topo.boundaries()] == [(0, 1), (1, 2), (2, 0)]
    dp2 = Topology.from_config(TOPOLOGIES["dp2"])
    assert dp2.world_size == 6
    assert dp2.dp_ranks(1, 1) == (2, 5)
    assert dp2.rank_info(4) .stage == 1 and dp2.rank_info(4).tp_rank == 0 and dp2.rank_info(4).dp_rank == 1


def _stage_of(topo, value):
    """A getter's answer with every global rank replaced by its stage."""
    if isinstance(value, list) and value[:1] == ["group"]:
        return ["group", [topo.rank_info(r).stage for r in value[1]], value[2], value[3]]
    return topo.rank_info(value).stage if isinstance(value, int) and not isinstance(value, bool) \
        else value


@pytest.mark.timeout(180)
def test_every_getter_answers_as_megatron_on_a_uniform_cluster(world):
    topo, obs = world
    if obs[0]["megatron_getters"] is None:
        pytest.skip("megatron's own state exists only for uniform TP")
    for rank, o in enumerate(obs):
        mine, theirs = o["getters"], o["megatron_getters"]
        assert mine.keys() == theirs.keys()
        for key in mine:
            if key.split(",")[0] in OTHER_STAGE_RANKS and not topo.rank_info(rank).is_leader:
                assert _stage_of(topo, mine[key]) == _stage_of(topo, theirs[key]), (rank, key)
            else:
                assert mine[key] == theirs[key], (rank, key, mine[key], theirs[key])


@pytest.mark.timeout(180)
def test_every_getter_answers_for_its_stage(world):
    """Hand-derived expectations for any TP list (expert groups with EP 1 included)."""
    topo, obs = world
    for rank, o in enumerate(obs):
        info = topo.rank_info(rank)
        g = o["getters"]
        stage = list(topo.stage_ranks(info.stage, info.dp_rank))
        dp = list(topo.dp_ranks(info.stage, info.tp_rank))
        replica = [r for s in range(topo.num_stages) for r in topo.stage_ranks(s, info.dp_rank)]
        tp = len(stage)
        assert not any(v == ["raises", "AssertionError"] for k, v in g.items()
                       if k.startswith("get_data") or k.startswith("get_expert_data")), rank
        assert g["get_model_parallel_group"] == ["group", replica, len(replica), replica.index(rank)]
        assert g["get_expert_tensor_model_pipeline_parallel_group"] == g["get_model_parallel_group"]
        assert g["get_intra_distributed_optimizer_instance_group"][1] == list(range(topo.world_size))
        assert g["get_expert_model_parallel_group"] == ["group", [rank], 1, 0]
        assert g["get_expert_model_parallel_world_size"] == 1
        for name in ("get_expert_tensor_parallel_group", "get_expert_tensor_and_model_parallel_group"):
            assert g[name] == ["group", stage, tp, info.tp_rank], name
        assert (g["get_expert_tensor_parallel_world_size"], g["get_expert_tensor_parallel_rank"]) \
            == (tp, info.tp_rank)
        for key in ("get_expert_data_parallel_group", "get_data_parallel_group",
                    "get_expert_data_parallel_group,partial_expert_data_parallel=True",
                    "get_data_parallel_group,partial_data_parallel=True,with_context_parallel=True"):
            assert g[key] == ["group", dp, topo.dp, info.dp_rank], key
        assert g["get_inter_distributed_optimizer_instance_group"] == ["raises", "AssertionError"]
        emb_stages = [0] if topo.u_shape else [0, topo.num_stages - 1]
        if info.stage in emb_stages:
            members = g["get_embedding_group"][1]
            assert [topo.rank_info(r).stage for r in members] == emb_stages and rank in members
            assert g["is_rank_in_embedding_group"] is True
        else:
            assert g["get_embedding_group,check_initialized=False"] is None
            assert g["is_rank_in_embedding_group"] is False
        assert g["is_rank_in_position_embedding_group"] == (info.stage == 0)


@pytest.mark.timeout(180)
def test_collectives_megatron_issues_on_cross_stage_groups(world):
    topo, obs = world
    for rank, o in enumerate(obs):
        info, c = topo.rank_info(rank), o["collectives"]
        replica = [r for s in range(topo.num_stages) for r in topo.stage_ranks(s, info.dp_rank)]
        assert c["pp_sum"] == sum(10.0 * (s + 1) for s in range(topo.num_stages))  # leaders only
        assert c["pp_bcast_last"] == topo.num_stages - 1
        assert c["pp_gather"] == [float(s) for s in range(topo.num_stages)]
        assert c["mp_sum"] == sum(r + 1 for r in replica)
        assert c["mp_max"] == max(replica)
        assert c["mp_bcast"] == replica[-1]
        assert c["dist_opt_sum"] == sum(range(1, topo.world_size + 1))
        if "embd_shard" in c:  # stage 0 holds A, the last stage 100 * A: both end with 101 * A
            full = torch.arange(24, dtype=torch.float32).reshape(12, 2) * 101
            tp = topo.stages[info.stage].tp
            assert c["embd_shard"] == full.chunk(tp)[info.tp_rank].tolist()


@pytest.mark.timeout(180)
def test_reference_api_as_its_callers_use_it(world):
    topo, obs = world
    for rank, o in enumerate(obs):
        info, r = topo.rank_info(rank), o["reference"]
        assert r["leader_idiom"] == topo.leader(info.stage, info.dp_rank)
        assert r["enabled"] is True
        prev = (info.stage - 1) % topo.num_stages
        for label in ("pp_group", "own_group"):
            got = r[label]
            assert got["handles"] == (2 if info.is_leader else 0)  # one per send, leaders only
            assert got["fwd"] == float(prev)  # every TP rank got the leader's activation
            assert got["bwd"] == float(info.stage) + 0.5  # and the gradient back from next


def test_reference_api_before_initialization():
    """The reference answers before its state exists; so does ldt (no world here)."""
    import ldt
    from ldt import parallel_state

    assert not parallel_state.is_vtp_initialized()
    assert ldt.is_vtp_stage_rank0() is True
    assert ldt.get_vtp_size_list() is None
    assert ldt.get_vtp_stage_ranks() is None
    assert ldt.get_vtp_my_stage_idx() is None
    assert parallel_state.is_vtp_enabled() is False
    assert parallel_state.get_vtp_intra_stage_group() is None
