"""VTP parallel state on real gloo worlds: groups, ranks and megatron-core's view of them.

One world per topology; each rank records what megatron-core and ldt report, the parent
asserts against each topology's rank map written out by hand (RANK_MAPS), never against
ldt.topology.ranks's own arithmetic (which is checked against the same maps). On a
uniform topology the same world first builds megatron's own ``initialize_model_parallel``,
and every getter of megatron-core's ``parallel_state`` must answer as it does there.
Collectives megatron issues on ldt's cross-stage groups (pipeline, embedding, model parallel,
distributed-optimizer instance) and the reference implementation's API, used the way its
own callers use it, run in the same worlds.
"""

import os

import pytest
import torch

from ldt.config import ClusterConfig, StageConfig
from ldt.launch.local import run_local_world
from ldt.topology.ranks import Topology


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
    # the last stage's ranks play another node (torchrun's node rank), the others one node
    os.environ["GROUP_RANK"] = "1" if topo.rank_info(rank).stage == topo.num_stages - 1 else "0"
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
    mine = [(r.boundary, r) for r in state.plan.routes  # this rank's boundaries
            if r.direction == "F" and rank in (r.src_rank, r.dst_rank)]
    for (src, dst), route in sorted(mine, key=lambda m: m[0]):
        group, src_rank, dst_rank = state.named_groups[route.group], route.src_rank, route.dst_rank
        if rank == src_rank:
            dist.send(torch.tensor([float(100 * src + dst)]), dst_rank, group=group)
        else:
            buf = torch.zeros(1)
            dist.recv(buf, src_rank, group=group)
            got[f"{src}->{dst}"] = buf.item()
    obs["boundary_msgs"] = got
    obs["fanout"] = {f"{a}->{b}": [dist.get_process_group_ranks(
                         state.named_groups[r.fanout_group]), r.same_node]
                     for r in state.plan.routes if r.direction == "F"
                     and r.fanout_group in state.named_groups for a, b in [r.boundary]}
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
# The expected rank map of each topology, written by hand from DESIGN.md's rule (ranks
# contiguous per stage, TP innermost, the data-parallel replica outermost), not computed by
# ldt.topology.ranks: per replica, per stage, its global ranks (the first is the stage's leader).
RANK_MAPS = {
    "cpu_demo": [[[0], [1, 2], [3]]],
    "cpu_vtp": [[[0, 1], [2], [3, 4]]],
    "ring2": [[[0, 1], [2]]],
    "dp2": [[[0], [1, 2]], [[3], [4, 5]]],
    "uniform22": [[[0, 1], [2, 3]]],
}


class Hand:
    """Questions about one topology answered from its hand-written rank map."""

    def __init__(self, name):
        self.replicas = RANK_MAPS[name]
        self.u_shape = TOPOLOGIES[name].u_shape
        self.num_stages, self.dp = len(self.replicas[0]), len(self.replicas)
        self.world_size = sum(len(r) for rep in self.replicas for r in rep)
        self.tp_sizes = [len(r) for r in self.replicas[0]]

    def info(self, rank):
        """(stage, tp rank, replica) of a global rank."""
        return next((s, ranks.index(rank), d) for d, rep in enumerate(self.replicas)
                    for s, ranks in enumerate(rep) if rank in ranks)

    def stage_ranks(self, stage, d):
        return list(self.replicas[d][stage])

    def leader(self, stage, d):
        return self.replicas[d][stage][0]

    def dp_ranks(self, stage, tp_rank):
        return [rep[stage][tp_rank] for rep in self.replicas]

    def replica(self, d):
        return [r for ranks in self.replicas[d] for r in ranks]


@pytest.fixture(scope="module", params=sorted(TOPOLOGIES))
def world(request):
    topo = Topology.from_config(TOPOLOGIES[request.param])
    obs = run_local_world(topo.world_size, _observe, (topo,), timeout_s=120)
    return Hand(request.param), obs


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
def test_topology_matches_the_hand_written_rank_map(name):
    topo, hand = Topology.from_config(TOPOLOGIES[name]), Hand(name)
    assert (topo.world_size, topo.dp, topo.tp_sizes) == (hand.world_size, hand.dp, hand.tp_sizes)
    for rank in range(hand.world_size):
        info = topo.rank_info(rank)
        assert (info.stage, info.tp_rank, info.dp_rank) == hand.info(rank), rank
        assert info.is_leader == (info.tp_rank == 0)
    for d in range(hand.dp):
        assert list(topo.leaders(d)) == [hand.leader(s, d) for s in range(hand.num_stages)]
    ring = [(s, (s + 1) % hand.num_stages) for s in range(hand.num_stages)]
    assert [(b.src_stage, b.dst_stage) for b in topo.boundaries()] == ring


@pytest.mark.timeout(180)
def test_megatron_sees_own_stage(world):
    hand, obs = world
    for rank, o in enumerate(obs):
        stage, tp_rank, d = hand.info(rank)
        assert o["tp_members"] == hand.stage_ranks(stage, d)
        assert (o["tp_size"], o["tp_rank"]) == (hand.tp_sizes[stage], tp_rank)
        assert (o["pp_rank"], o["pp_size"]) == (stage, hand.num_stages)
        nxt = (stage + 1) % hand.num_stages
        prv = (stage - 1) % hand.num_stages
        assert o["next"] == hand.leader(nxt, d)
        assert o["prev"] == hand.leader(prv, d)
        assert o["first"] == (stage == 0)
        assert o["last"] == (stage == hand.num_stages - 1)
        assert (o["dp_size"], o["dp_rank"]) == (hand.dp, d)
        assert o["is_rank0"] == (tp_rank == 0)
        assert o["sizes"] == hand.tp_sizes
        assert o["stage_ranks"] == [hand.stage_ranks(s, d) for s in range(hand.num_stages)]
        assert o["stage_idx"] == stage
        assert o["reset"]


@pytest.mark.timeout(180)
def test_collectives_in_tp_dp_and_boundary_groups(world):
    hand, obs = world
    for rank, o in enumerate(obs):
        stage, tp_rank, d = hand.info(rank)
        assert o["tp_sum"] == sum(hand.stage_ranks(stage, d))
        assert o["dp_sum"] == sum(hand.dp_ranks(stage, tp_rank))
        expected = {}
        if tp_rank == 0:  # a leader receives on its one incoming boundary of the ring
            src = (stage - 1) % hand.num_stages
            expected[f"{src}->{stage}"] = float(100 * src + stage)
        assert o["boundary_msgs"] == expected


@pytest.mark.timeout(180)
def test_fanout_groups_hold_both_stages_and_know_their_nodes(world):
    """Every boundary next to a TP > 1 stage has a group of both stages' ranks (the sending
    leader may send to every TP rank across); it knows whether those ranks share a node
    (here the last stage plays another node); per replica."""
    hand, obs = world
    last = hand.num_stages - 1
    for rank, o in enumerate(obs):
        stage, _, d = hand.info(rank)
        expected = {}
        for a in range(hand.num_stages):
            b = (a + 1) % hand.num_stages
            if stage in (a, b) and max(hand.tp_sizes[a], hand.tp_sizes[b]) > 1:
                expected[f"{a}->{b}"] = [sorted(hand.stage_ranks(a, d) + hand.stage_ranks(b, d)),
                                         last not in (a, b)]
        assert o["fanout"] == expected, rank


def _stage_of(hand, value):
    """A getter's answer with every global rank replaced by its stage."""
    if isinstance(value, list) and value[:1] == ["group"]:
        return ["group", [hand.info(r)[0] for r in value[1]], value[2], value[3]]
    return hand.info(value)[0] if isinstance(value, int) and not isinstance(value, bool) \
        else value


@pytest.mark.timeout(180)
def test_every_getter_answers_as_megatron_on_a_uniform_cluster(world):
    hand, obs = world
    if obs[0]["megatron_getters"] is None:
        pytest.skip("megatron's own state exists only for uniform TP")
    for rank, o in enumerate(obs):
        mine, theirs = o["getters"], o["megatron_getters"]
        assert mine.keys() == theirs.keys()
        for key in mine:
            if key.split(",")[0] in OTHER_STAGE_RANKS and hand.info(rank)[1] != 0:
                assert _stage_of(hand, mine[key]) == _stage_of(hand, theirs[key]), (rank, key)
            else:
                assert mine[key] == theirs[key], (rank, key, mine[key], theirs[key])


@pytest.mark.timeout(180)
def test_every_getter_answers_for_its_stage(world):
    """Hand-derived expectations for any TP list (expert groups with EP 1 included)."""
    hand, obs = world
    for rank, o in enumerate(obs):
        stage_idx, tp_rank, d = hand.info(rank)
        g = o["getters"]
        stage = hand.stage_ranks(stage_idx, d)
        dp = hand.dp_ranks(stage_idx, tp_rank)
        replica = hand.replica(d)
        tp = len(stage)
        assert not any(v == ["raises", "AssertionError"] for k, v in g.items()
                       if k.startswith("get_data") or k.startswith("get_expert_data")), rank
        assert g["get_model_parallel_group"] == ["group", replica, len(replica), replica.index(rank)]
        assert g["get_expert_tensor_model_pipeline_parallel_group"] == g["get_model_parallel_group"]
        assert g["get_intra_distributed_optimizer_instance_group"][1] == list(range(hand.world_size))
        assert g["get_expert_model_parallel_group"] == ["group", [rank], 1, 0]
        assert g["get_expert_model_parallel_world_size"] == 1
        for name in ("get_expert_tensor_parallel_group", "get_expert_tensor_and_model_parallel_group"):
            assert g[name] == ["group", stage, tp, tp_rank], name
        assert (g["get_expert_tensor_parallel_world_size"], g["get_expert_tensor_parallel_rank"]) \
            == (tp, tp_rank)
        for key in ("get_expert_data_parallel_group", "get_data_parallel_group",
                    "get_expert_data_parallel_group,partial_expert_data_parallel=True",
                    "get_data_parallel_group,partial_data_parallel=True,with_context_parallel=True"):
            assert g[key] == ["group", dp, hand.dp, d], key
        assert g["get_inter_distributed_optimizer_instance_group"] == ["raises", "AssertionError"]
        emb_stages = [0] if hand.u_shape else [0, hand.num_stages - 1]
        if stage_idx in emb_stages:
            members = g["get_embedding_group"][1]
            assert [hand.info(r)[0] for r in members] == emb_stages and rank in members
            assert g["is_rank_in_embedding_group"] is True
        else:
            assert g["get_embedding_group,check_initialized=False"] is None
            assert g["is_rank_in_embedding_group"] is False
        assert g["is_rank_in_position_embedding_group"] == (stage_idx == 0)


@pytest.mark.timeout(180)
def test_collectives_megatron_issues_on_cross_stage_groups(world):
    hand, obs = world
    for rank, o in enumerate(obs):
        (stage, tp_rank, d), c = hand.info(rank), o["collectives"]
        replica = hand.replica(d)
        assert c["pp_sum"] == sum(10.0 * (s + 1) for s in range(hand.num_stages))  # leaders only
        assert c["pp_bcast_last"] == hand.num_stages - 1
        assert c["pp_gather"] == [float(s) for s in range(hand.num_stages)]
        assert c["mp_sum"] == sum(r + 1 for r in replica)
        assert c["mp_max"] == max(replica)
        assert c["mp_bcast"] == replica[-1]
        assert c["dist_opt_sum"] == sum(range(1, hand.world_size + 1))
        if "embd_shard" in c:  # stage 0 holds A, the last stage 100 * A: both end with 101 * A
            full = torch.arange(24, dtype=torch.float32).reshape(12, 2) * 101
            assert c["embd_shard"] == full.chunk(hand.tp_sizes[stage])[tp_rank].tolist()


@pytest.mark.timeout(180)
def test_reference_api_as_its_callers_use_it(world):
    hand, obs = world
    for rank, o in enumerate(obs):
        (stage, tp_rank, d), r = hand.info(rank), o["reference"]
        assert r["leader_idiom"] == hand.leader(stage, d)
        assert r["enabled"] is True
        prev, nxt = (stage - 1) % hand.num_stages, (stage + 1) % hand.num_stages
        # beside a leader, a send into a TP > 1 stage is a share of a fan-out (on one machine
        # every message into a TP > 1 stage fans out), TP rank i to TP rank i
        shares = sum(hand.tp_sizes[peer] > 1 for peer in (nxt, prev))
        for label in ("pp_group", "own_group"):
            got = r[label]
            want = 2 if tp_rank == 0 else shares if label == "pp_group" else 0
            assert got["handles"] == want, (rank, label)  # one per send it posted
            assert got["fwd"] == float(prev)  # every TP rank got the leader's activation
            assert got["bwd"] == float(stage) + 0.5  # and the gradient back from next


def test_reference_api_before_initialization():
    """The reference answers before its state exists; so does ldt (no world here)."""
    import ldt
    from ldt.groups import parallel_state

    assert not parallel_state.is_vtp_initialized()
    assert ldt.is_vtp_stage_rank0() is True
    assert ldt.get_vtp_size_list() is None
    assert ldt.get_vtp_stage_ranks() is None
    assert ldt.get_vtp_my_stage_idx() is None
    assert parallel_state.is_vtp_enabled() is False
    assert parallel_state.get_vtp_intra_stage_group() is None
