"""VTP parallel state on real gloo worlds: groups, ranks and megatron-core's view of them.

One world per topology; each rank records what megatron-core and ldt report, the parent
asserts against the topology's own arithmetic and against hand-written expectations.
"""

import pytest
import torch

from ldt.config import ClusterConfig, StageConfig
from ldt.launch import run_local_world
from ldt.topology import Topology


def cluster(tps, u_shape=False, dp=1):
    return ClusterConfig(stages=[StageConfig(name=f"s{i}", device="cpu", tp=t)
                                 for i, t in enumerate(tps)], u_shape=u_shape, dp=dp)


def _observe(rank, world, topo):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import ldt

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
    ldt.destroy_vtp()
    obs["reset"] = not ps.model_parallel_is_initialized()
    return obs


TOPOLOGIES = {
    "cpu_demo": cluster([1, 2, 1], u_shape=True),
    "cpu_vtp": cluster([2, 1, 2]),
    "ring2": cluster([2, 1], u_shape=True),
    "dp2": cluster([1, 2], dp=2),
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
        assert o["stage_ranks"] == list(topo.stage_ranks(info.stage, info.dp_rank))
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
