"""The rank plan (ldt.topology.routes) and its transport policy (ldt.topology.transport) without
processes: small plans written out by hand, and the invariants every plan of 2..8 stages
keeps (VTP, per-stage DP, expert groups, U-shape, fan-out modes, host staging). Ranks are
computed here from the layout's formula (rank = dp rank * replica size + the TP sizes of the
stages before + TP rank), not asked of the topology."""

from __future__ import annotations

import itertools

import pytest

from ldt.config import ClusterConfig, ConfigError, StageConfig
from ldt.topology.ranks import Topology
from ldt.topology.routes import (BACKWARD, CROSS_STAGE, FORWARD, MEGATRON_NAMES, GroupSpec,
                                 check_stages, default_embedding_stages, rank_plan)
from ldt.topology.transport import FANOUT, MAX_PIECES, PIECES, WHOLE, Carry, carry

KIB, MIB = 1024, 1024 * 1024


def topo(tps, *, u_shape=False, dp=1, dps=None, devices=None, fanout="auto", eps=None,
         host_staging="auto"):
    devices = devices or ["cpu"] * len(tps)
    stages = [StageConfig(f"s{i}", devices[i], t, None if dps is None else dps[i],
                          ep=1 if eps is None else eps[i]) for i, t in enumerate(tps)]
    return Topology.from_config(ClusterConfig(stages=stages, u_shape=u_shape, dp=dp,
                                              boundary_fanout=fanout,
                                              host_staging=host_staging))


def first_rank(tps, d, s):
    """The layout's formula for uniform DP (topology module docstring)."""
    return d * sum(tps) + sum(tps[:s])


def by_role(plan, role):
    return [g.ranks for g in plan.groups if g.role == role]


# ---- small plans, by hand ---------------------------------------------------------------------

def test_a_u_shape_of_three_stages():
    """TP 1, 2, 1 with the return path: world 4 = [0] [1 2] [3]."""
    plan = rank_plan(topo((1, 2, 1), u_shape=True))
    assert [g.role for g in plan.groups] == (  # the order every rank creates them in
        ["cp"] * 4 + ["tp"] * 3 + ["dp"] * 4 + ["leaders"] + ["boundary"] * 3 + ["fanout"] * 2
        + ["pp", "embd", "pos_embd", "mp"])
    assert by_role(plan, "cp") == [(0,), (1,), (2,), (3,)]
    assert by_role(plan, "tp") == [(0,), (1, 2), (3,)]
    assert by_role(plan, "dp") == [(0,), (1,), (2,), (3,)]
    assert by_role(plan, "leaders") == [(0, 1, 3)]
    assert by_role(plan, "boundary") == [(0, 1), (1, 3), (0, 3)]  # 0->1, 1->2, 2->0
    assert by_role(plan, "fanout") == [(0, 1, 2), (1, 2, 3)]  # next to the TP 2 stage
    peers = {(r.src_stage, r.dst_stage, r.direction): (r.src_rank, r.dst_rank, r.receivers)
             for r in plan.routes}
    assert peers == {
        (0, 1, FORWARD): (0, 1, (1, 2)), (1, 0, BACKWARD): (1, 0, (0,)),
        (1, 2, FORWARD): (1, 3, (3,)), (2, 1, BACKWARD): (3, 1, (1, 2)),
        (2, 0, FORWARD): (3, 0, (0,)), (0, 2, BACKWARD): (0, 3, (3,)),
    }
    fwd, bwd = plan.route(0, 1, FORWARD), plan.route(1, 0, BACKWARD)
    assert fwd.group == bwd.group and (fwd.tag, bwd.tag) == (1, 2)
    assert plan.route(2, 0, FORWARD).group != plan.route(1, 0, BACKWARD).group
    assert [g.ranks for g in plan.groups if g.role == "pp"] == [(0, 1, 2, 3)]
    assert plan.embedding_stages == (0,)  # the edge holds embedding and head


def test_two_replicas_keep_their_own_groups():
    """TP 2, 1 and dp 2: world 6 = [0 1] [2] | [3 4] [5]."""
    plan = rank_plan(topo((2, 1), dp=2))
    assert by_role(plan, "tp") == [(0, 1), (2,), (3, 4), (5,)]
    assert by_role(plan, "dp") == [(0, 3), (1, 4), (2, 5)]
    assert by_role(plan, "tp_dp") == [(0, 1, 3, 4), (2, 5)]
    assert by_role(plan, "leaders") == [(0, 2), (3, 5)]
    assert by_role(plan, "boundary") == [(0, 2), (0, 2), (3, 5), (3, 5)]
    assert by_role(plan, "fanout") == [(0, 1, 2), (0, 1, 2), (3, 4, 5), (3, 4, 5)]
    route = plan.route(1, 0, BACKWARD, 1, 1)
    assert (route.src_rank, route.dst_rank, route.receivers) == (5, 3, (3, 4))
    assert plan.roles_of(4)["dist_opt"] == "ldt_dist_opt"
    with pytest.raises(ConfigError, match="no boundary route"):
        plan.route(1, 0, BACKWARD, 0, 1)  # replicas do not cross


def test_per_stage_dp_routes_every_replica_pair():
    """dp 1 then dp 2 (TP 1 each): world 3 = [0] [1] | [2]; replica 0 of stage 0 serves
    both replicas of stage 1, each pair on its own group; no fan-out."""
    plan = rank_plan(topo((1, 1), dps=(1, 2)))
    assert by_role(plan, "tp") == [(0,), (1,), (2,)]
    assert by_role(plan, "leaders") == [(0, 1, 2)]
    assert by_role(plan, "replica0_leaders") == [(0, 1)]
    assert by_role(plan, "boundary") == [(0, 1), (0, 2), (0, 1), (0, 2)]
    assert by_role(plan, "fanout") == []
    assert plan.route(0, 1, FORWARD, 0, 1).dst_rank == 2
    assert plan.route(1, 0, BACKWARD, 1, 0).src_rank == 2
    assert plan.route(1, 0, FORWARD, 1, 0).group != plan.route(0, 1, FORWARD, 0, 1).group
    assert {g.name for g in plan.groups if g.role == "grad_stats"} == {"ldt_vdp_grad_stats"}


def test_mixed_devices_stage_through_the_host():
    """A CUDA stage of TP 2 before a CPU stage: native groups inside a stage (a gloo twin of
    the DP groups), gloo and host staging across."""
    plan = rank_plan(topo((2, 1), devices=["cuda", "cpu"]))
    assert [(g.ranks, g.backend) for g in plan.groups if g.role in ("tp", "dp", "dp_gloo")] == [
        ((0, 1), "nccl"), ((2,), "gloo"), ((0,), "nccl"), ((0,), "gloo"), ((1,), "nccl"),
        ((1,), "gloo"), ((2,), "gloo")]
    assert all(r.host_staged and r.backend == "gloo" for r in plan.routes)
    assert plan.roles_of(2)["dp_gloo"] == plan.roles_of(2)["dp"]  # gloo is its own twin
    assert not any(r.host_staged for r in rank_plan(topo((2, 1))).routes)


def test_experts_fold_onto_the_tp_ranks():
    """TP 4 with ep 2 (expert TP 2) on stage 1: [0] [1 2 3 4]."""
    plan = rank_plan(topo((1, 4), eps=(1, 2)))
    assert by_role(plan, "ep") == [(1, 3), (2, 4)]
    assert by_role(plan, "expt_tp") == [(1, 2), (3, 4)]
    assert plan.roles_of(0)["ep"] == plan.roles_of(0)["cp"] == "cp:0"  # ep 1: the rank alone
    assert plan.roles_of(0)["expt_tp"] == "cp:0"  # and expert TP = TP = 1


# ---- every group by name, role, ranks, backend: written out by hand -------------------------

def _spec(name, role, ranks, backend, local=False):
    return GroupSpec(name, role, tuple(ranks), backend, local)


def test_a_mixed_device_u_shape_names_every_group_and_its_backend():
    """TP 1 (cpu), 2 (cuda), 1 (cpu), U-shape: [0] [1 2] [3]. The cuda stage's own groups
    are NCCL (its DP groups get a gloo twin, as megatron's distributed optimizer wants);
    boundaries that touch a CPU stage and the fan-out groups are gloo; megatron's groups
    that span stages are ldt's cross-stage groups; a rank's context-parallel group of one
    is made locally, without a collective."""
    plan = rank_plan(topo((1, 2, 1), u_shape=True, devices=["cpu", "cuda", "cpu"]))
    assert list(plan.groups) == [
        _spec("cp:0", "cp", [0], "gloo", True), _spec("cp:1", "cp", [1], "nccl", True),
        _spec("cp:2", "cp", [2], "nccl", True), _spec("cp:3", "cp", [3], "gloo", True),
        _spec("tp:s0:r0", "tp", [0], "gloo"), _spec("tp:s1:r0", "tp", [1, 2], "nccl"),
        _spec("tp:s2:r0", "tp", [3], "gloo"),
        _spec("dp:s0:t0", "dp", [0], "gloo"),
        _spec("dp:s1:t0", "dp", [1], "nccl"), _spec("dp_gloo:s1:t0", "dp_gloo", [1], "gloo"),
        _spec("dp:s1:t1", "dp", [2], "nccl"), _spec("dp_gloo:s1:t1", "dp_gloo", [2], "gloo"),
        _spec("dp:s2:t0", "dp", [3], "gloo"),
        _spec("leaders:r0", "leaders", [0, 1, 3], "gloo"),
        _spec("boundary:0->1:r0-0", "boundary", [0, 1], "gloo"),
        _spec("boundary:1->2:r0-0", "boundary", [1, 3], "gloo"),
        _spec("boundary:2->0:r0-0", "boundary", [0, 3], "gloo"),
        _spec("fanout:0->1:r0", "fanout", [0, 1, 2], "gloo"),
        _spec("fanout:1->2:r0", "fanout", [1, 2, 3], "gloo"),
        _spec("ldt_pp_0", "pp", [0, 1, 2, 3], CROSS_STAGE),
        _spec("ldt_embd_0", "embd", [0], CROSS_STAGE),  # the U-shape's edge holds both ends
        _spec("ldt_pos_embd_0", "pos_embd", [0], CROSS_STAGE),
        _spec("ldt_mp_0", "mp", [0, 1, 2, 3], CROSS_STAGE)]
    assert (plan.embedding_stages, plan.position_embedding_stages) == ((0,), (0,))


def test_per_stage_dp_names_every_group_of_both_replicas():
    """Stage 0 TP 1 at DP 2 (ranks 0 and 3), stage 1 TP 2 at DP 1 (ranks 1 2): one leader
    group of every stage's leaders and one of replica 0's; a boundary group per replica pair
    and direction; replica 1's chain of megatron groups holds only its own rank; the
    distributed optimizer's and the gradient statistics' groups span the world."""
    plan = rank_plan(topo((1, 2), dps=(2, 1)))
    assert list(plan.groups) == [
        _spec("cp:0", "cp", [0], "gloo", True), _spec("cp:1", "cp", [1], "gloo", True),
        _spec("cp:2", "cp", [2], "gloo", True), _spec("cp:3", "cp", [3], "gloo", True),
        _spec("tp:s0:r0", "tp", [0], "gloo"), _spec("tp:s1:r0", "tp", [1, 2], "gloo"),
        _spec("tp:s0:r1", "tp", [3], "gloo"),
        _spec("dp:s0:t0", "dp", [0, 3], "gloo"), _spec("tp_dp:s0", "tp_dp", [0, 3], "gloo"),
        _spec("dp:s1:t0", "dp", [1], "gloo"), _spec("dp:s1:t1", "dp", [2], "gloo"),
        _spec("leaders:all", "leaders", [0, 1, 3], "gloo"),
        _spec("replica0_leaders", "replica0_leaders", [0, 1], "gloo"),
        _spec("boundary:0->1:r0-0", "boundary", [0, 1], "gloo"),
        _spec("boundary:0->1:r1-0", "boundary", [1, 3], "gloo"),
        _spec("boundary:1->0:r0-0", "boundary", [0, 1], "gloo"),
        _spec("boundary:1->0:r0-1", "boundary", [1, 3], "gloo"),
        _spec("ldt_pp_0", "pp", [0, 1, 2], CROSS_STAGE),
        _spec("ldt_embd_0", "embd", [0, 1, 2], CROSS_STAGE),  # first and last stage
        _spec("ldt_pos_embd_0", "pos_embd", [0], CROSS_STAGE),
        _spec("ldt_mp_0", "mp", [0, 1, 2], CROSS_STAGE),
        _spec("ldt_pp_1", "pp", [3], CROSS_STAGE), _spec("ldt_embd_1", "embd", [3], CROSS_STAGE),
        _spec("ldt_pos_embd_1", "pos_embd", [3], CROSS_STAGE),
        _spec("ldt_mp_1", "mp", [3], CROSS_STAGE),
        _spec("ldt_dist_opt", "dist_opt", [0, 1, 2, 3], CROSS_STAGE),
        _spec("ldt_vdp_grad_stats", "grad_stats", [0, 1, 2, 3], CROSS_STAGE)]


def test_two_replicas_have_an_embedding_leader_group_each():
    """Uniform DP 2 over a plain pipeline TP 1, 1, 1 (ranks 0-2, 3-5): per replica, the
    leaders, and the leaders of the embedding's stages (first and last) beside them; the
    position embedding lives on one stage, so it has no leader group of its own."""
    plan = rank_plan(topo((1, 1, 1), dp=2))
    leaders = [(g.name, g.ranks, g.backend) for g in plan.groups if "leaders" in g.role]
    assert leaders == [("leaders:r0", (0, 1, 2), "gloo"), ("emb_leaders:r0", (0, 2), "gloo"),
                       ("leaders:r1", (3, 4, 5), "gloo"), ("emb_leaders:r1", (3, 5), "gloo")]


@pytest.mark.parametrize("tps,u_shape,expected", [
    ((1,), False, [0]), ((1, 1), False, [0, 1]), ((1, 1, 1), False, [0, 2]),
    ((1, 1, 1), True, [0])])
def test_the_embedding_lives_on_the_first_and_last_stage_or_on_the_edge(tps, u_shape, expected):
    assert default_embedding_stages(topo(tps, u_shape=u_shape)) == expected


def test_embedding_stages_given_are_checked_and_kept():
    t = topo((1, 1, 1))
    plan = rank_plan(t, embedding_stages=[2, 0, 2], position_embedding_stages=[1])
    assert (plan.embedding_stages, plan.position_embedding_stages) == ((0, 2), (1,))
    with pytest.raises(ConfigError, match=r"^embedding stages \[0, 3\] must be stage indices "
                       r"of the 3-stage cluster$"):
        rank_plan(t, embedding_stages=[0, 3])
    with pytest.raises(ConfigError, match=r"^position embedding stages \[\] must be stage "):
        rank_plan(t, position_embedding_stages=[])
    with pytest.raises(ConfigError, match=r"^embedding stages \[-1\]"):
        check_stages(t, [-1], [0], "embedding")


def test_the_piece_unit_is_the_callers():
    """A smaller unit cuts the same message into more pieces: round(sqrt(2 MiB / 32 KiB)) = 8
    where 128 KiB gives 4, through carry and a route alike."""
    assert carry(2 * MIB, 2, mode="never", same_node=True, unit_bytes=32 * KIB).pieces == 8
    route = rank_plan(topo((1, 2))).route(0, 1, FORWARD)
    assert route.transport(2 * MIB, unit_bytes=32 * KIB, mode="never").pieces == 8


# ---- the transport policy -------------------------------------------------------------------

@pytest.mark.parametrize("nbytes,expected", [
    (1 * KIB, (WHOLE, 1)), (128 * KIB, (WHOLE, 1)), (2 * MIB, (PIECES, 4)),
    (5 * MIB // 2, (PIECES, 4)), (8 * MIB, (PIECES, 8)), (1024 * MIB, (PIECES, MAX_PIECES))])
def test_a_relayed_message_goes_whole_or_in_sqrt_pieces(nbytes, expected):
    """round(sqrt(bytes / 128 KiB)) pieces, at most 16: 2 MiB -> 4, 2.5 MiB -> sqrt(20) ->
    4, 8 MiB -> 8."""
    how = carry(nbytes, 2, mode="never", same_node=True)
    assert (how.kind, how.pieces) == expected


def test_fan_out_by_mode_node_and_size():
    route = rank_plan(topo((1, 2))).route(0, 1, FORWARD)
    assert route.transport(64 * MIB).kind == FANOUT  # auto, one node: at every size
    assert route.transport(64 * MIB, mode="never").kind == PIECES
    apart = rank_plan(topo((1, 2)), nodes=["a", "b", "b"]).route(0, 1, FORWARD)
    assert not apart.same_node
    assert apart.transport(64 * KIB).kind == FANOUT  # between nodes only a small message
    assert apart.transport(64 * KIB + 1).kind == WHOLE
    assert apart.transport(64 * KIB + 1, mode="always").kind == FANOUT
    back = rank_plan(topo((1, 2))).route(1, 0, BACKWARD)
    assert back.transport(1 * KIB).kind == WHOLE  # into a TP 1 stage: nothing to fan out to
    never = rank_plan(topo((1, 2), fanout="never")).route(0, 1, FORWARD)
    assert never.fanout_group is None and never.transport(1 * KIB, mode="always").kind == WHOLE


def test_the_sending_ranks_share_a_fan_out():
    """TP 2 -> TP 2 (world [0 1] [2 3]): TP rank i sends to TP rank i, as megatron's p2p pairs
    them; TP 2 -> TP 3 ([0 1] [2 3 4]): in turn; TP 1 -> TP 2 and a sequence-parallel sender:
    the leader sends every copy. What a sender posts back to back prices the link."""
    two = rank_plan(topo((2, 2)))
    assert two.route(0, 1, FORWARD).fanout_sources(True) == (0, 1)
    assert two.route(1, 0, BACKWARD).fanout_sources(True) == (2, 3)
    assert two.route(0, 1, FORWARD).fanout_sources(False) == (0, 0)
    assert rank_plan(topo((2, 3))).route(0, 1, FORWARD).fanout_sources(True) == (0, 1, 0)
    assert rank_plan(topo((2, 3))).route(1, 0, BACKWARD).fanout_sources(True) == (2, 3)
    assert rank_plan(topo((1, 2))).route(0, 1, FORWARD).fanout_sources(True) == (0, 0)
    assert [carry(KIB, 3, mode="always", same_node=True, senders=k).copies
            for k in (1, 2, 3, 4)] == [3, 2, 1, 1]


# ---- invariants of every plan, P = 2..8 -----------------------------------------------------

def _clusters():
    for p in range(2, 9):
        tps = tuple((i * 5 + 1) % 4 + 1 for i in range(p))  # 2, 3, 4, 1, ... TP per stage
        yield dict(tps=tps, u_shape=p % 2 == 0, dp=1 + (p % 3 == 0), fanout="auto")
        yield dict(tps=tps[::-1], u_shape=p % 2 == 1, dp=1, fanout=("never", "always")[p % 2])


@pytest.mark.parametrize("kw", list(_clusters()), ids=lambda kw: f"tp{kw['tps']}")
def test_every_plan_keeps_the_invariants(kw):
    t = topo(kw["tps"], u_shape=kw["u_shape"], dp=kw["dp"], fanout=kw["fanout"])
    plan, tps, dp, p = rank_plan(t), kw["tps"], kw["dp"], len(kw["tps"])
    world = dp * sum(tps)
    assert rank_plan(t) == plan  # one deterministic order
    assert len({g.name for g in plan.groups}) == len(plan.groups)
    stage_ranks = {(d, s): tuple(range(first_rank(tps, d, s), first_rank(tps, d, s) + tps[s]))
                   for d in range(dp) for s in range(p)}
    # each rank in exactly one TP group, which is its stage replica
    tp_groups = by_role(plan, "tp")
    assert sorted(tp_groups) == sorted(stage_ranks.values())
    assert sorted(r for g in tp_groups for r in g) == list(range(world))
    # every directed boundary, both directions, every replica: the two stages' leaders
    pairs = [(s, (s + 1) % p) for s in range(p)]
    assert len(plan.routes) == 2 * dp * p
    for (a, b), d in itertools.product(pairs, range(dp)):
        fwd, bwd = plan.route(a, b, FORWARD, d, d), plan.route(b, a, BACKWARD, d, d)
        assert (fwd.src_rank, fwd.dst_rank) == (first_rank(tps, d, a), first_rank(tps, d, b))
        assert (bwd.src_rank, bwd.dst_rank) == (fwd.dst_rank, fwd.src_rank)
        assert fwd.group == bwd.group and (fwd.tag, bwd.tag) == (1, 2)
        assert plan.group(fwd.group).ranks == tuple(sorted({fwd.src_rank, fwd.dst_rank}))
        assert (fwd.receivers, bwd.receivers) == (stage_ranks[d, b], stage_ranks[d, a])
        assert (fwd.senders, bwd.senders) == (stage_ranks[d, a], stage_ranks[d, b])
        # a fan-out copy for every rank across, each from a rank of the sending stage, no
        # sending rank posting more than its share; the leader alone with the sequence sharded
        for route in (fwd, bwd):
            spread = route.fanout_sources(whole_on_every_sender=True)
            assert len(spread) == len(route.receivers) and set(spread) <= set(route.senders)
            assert max(spread.count(r) for r in spread) == -(-len(spread) // len(route.senders))
            assert route.fanout_sources(False) == (route.src_rank,) * len(route.receivers)
        fans = kw["fanout"] != "never" and max(tps[a], tps[b]) > 1
        assert (fwd.fanout_group is not None) == fans
        if fans:
            assert plan.group(fwd.fanout_group).ranks == tuple(sorted(
                set(stage_ranks[d, a]) | set(stage_ranks[d, b])))
    # every megatron name maps to a listed group every rank has (embedding: its stages)
    for rank in range(world):
        roles = plan.roles_of(rank)
        for name, role in MEGATRON_NAMES.items():
            stage = next(s for (_, s), ranks in stage_ranks.items() if rank in ranks)
            if role in ("embd", "pos_embd"):
                held = plan.embedding_stages if role == "embd" else (0,)
                assert (role in roles) == (stage in held), (rank, name)
            elif role is not None:
                assert rank in plan.group(roles[role]).ranks, (rank, name, role)


def test_expert_groups_by_name_and_backend():
    """TP 4 with ep 2 on a cuda stage 1: [0] [1 2 3 4]; its expert groups are NCCL."""
    plan = rank_plan(topo((1, 4), eps=(1, 2), devices=["cpu", "cuda"]))
    assert [g for g in plan.groups if g.role in ("ep", "expt_tp")] == [
        _spec("ep:s1:r0:0", "ep", [1, 3], "nccl"), _spec("ep:s1:r0:1", "ep", [2, 4], "nccl"),
        _spec("expt_tp:s1:r0:0", "expt_tp", [1, 2], "nccl"),
        _spec("expt_tp:s1:r0:1", "expt_tp", [3, 4], "nccl")]


def test_a_position_embedding_on_two_stages_has_a_leader_group():
    plan = rank_plan(topo((1, 1, 1)), position_embedding_stages=[0, 2])
    assert [g for g in plan.groups if g.role == "pos_leaders"] == [
        _spec("pos_leaders:r0", "pos_leaders", [0, 2], "gloo")]


def test_a_boundary_is_on_one_node_per_replica():
    """DP 2 over TP 1, 2 (replica 0: [0] [1 2], replica 1: [3] [4 5]) with replica 0 on
    node a and replica 1 split over b and c: each replica's routes look at its own ranks."""
    plan = rank_plan(topo((1, 2), dp=2), nodes=["a", "a", "a", "b", "b", "c"])
    assert plan.route(0, 1, FORWARD, 0, 0).same_node
    assert not plan.route(0, 1, FORWARD, 1, 1).same_node
    plan = rank_plan(topo((1, 2), dp=2), nodes=["a", "a", "a", "b", "b", "b"])
    assert plan.route(0, 1, FORWARD, 1, 1).same_node  # all of replica 1 on b


def test_expert_tp_of_one_and_the_second_replica_s_experts():
    """ep = TP = 2 on stage 1 (expert TP 1): the experts' groups, no expert-TP group of its
    own (megatron's expert-TP group is the rank alone); a stage without experts at TP 2 uses
    its TP group; replica 1 of TP 1, 4 at ep 2 ([5] [6 7 8 9]) has groups of its own ranks."""
    plan = rank_plan(topo((1, 2), eps=(1, 2)))
    assert by_role(plan, "ep") == [(1, 2)] and by_role(plan, "expt_tp") == []
    assert plan.roles_of(1)["expt_tp"] == "cp:1"
    assert rank_plan(topo((1, 2))).roles_of(1)["expt_tp"] == "tp:s1:r0"
    plan = rank_plan(topo((1, 4), dp=2, eps=(1, 2)))
    assert [g.ranks for g in plan.groups if g.name.startswith("ep:s1:r1")] == [(6, 8), (7, 9)]


def test_one_sender_posts_every_fan_out_copy_unless_told_otherwise():
    """carry's ``senders`` (the sending ranks that share the copies) defaults to one: a
    leader alone sends all of them; two senders into three ranks post two and one."""
    assert carry(1024, 3, mode="always", same_node=True) == Carry(FANOUT, copies=3)
    assert carry(1024, 3, mode="always", same_node=True, senders=2).copies == 2
