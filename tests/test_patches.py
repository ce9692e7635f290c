"""The patch registry, the version check and the initialize_model_parallel patch."""

import pytest

from ldt import patches
from ldt.config import ClusterConfig, StageConfig
from ldt.launch import WorldError, run_local_world
from ldt.patches import PatchError, check_megatron_version
from ldt.topology import Topology


def test_version_check_refuses_other_releases():
    assert check_megatron_version("0.16.1") == "0.16.1"
    for bad in ("0.15.3", "0.17.0", "1.0.0"):
        with pytest.raises(PatchError, match=r"megatron-core>=0.16.0,<0.17"):
            check_megatron_version(bad)


def test_apply_and_revert_restore_megatron():
    from megatron.core.pipeline_parallel import schedules

    original = schedules.get_forward_backward_func
    with patches.applied(["schedules"]) as done:
        assert done == ["schedules"] and patches.is_applied("schedules")
        assert schedules.get_forward_backward_func is not original
    assert schedules.get_forward_backward_func is original
    assert not patches.is_applied("schedules")


def _topo():
    return Topology.from_config(ClusterConfig(
        stages=[StageConfig("a", "cpu", 1), StageConfig("b", "cpu", 2)]))


def _script_like(rank, world, topo, pp):
    """What an existing Megatron-core script does, with the patch applied."""
    from megatron.core import parallel_state as ps

    with patches.applied(["init_model_parallel"], ctx=topo):
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=pp)
        out = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank())
    return out


@pytest.mark.timeout(120)
def test_initialize_model_parallel_builds_vtp_state():
    out = run_local_world(3, _script_like, (_topo(), 2), timeout_s=90)
    assert out == [(1, 0), (2, 1), (2, 1)]  # stage TP from the cluster, not the script's 1


@pytest.mark.timeout(120)
def test_initialize_model_parallel_pp_mismatch_is_explained():
    with pytest.raises(WorldError, match=r"pipeline_model_parallel_size=4.*2 stages"):
        run_local_world(3, _script_like, (_topo(), 4), timeout_s=90)


def _activate_too_late(rank, world):
    from megatron.core import parallel_state as ps

    import ldt.run

    ps.initialize_model_parallel(1, 1)
    try:
        ldt.run.activate({"stages": [{"name": "a", "device": "cpu", "tp": 1}]})
    finally:
        ps.destroy_model_parallel()


@pytest.mark.timeout(120)
def test_activate_after_initialize_model_parallel_says_where_it_goes():
    with pytest.raises(WorldError, match=r"activate\(\) before initialize_model_parallel"):
        run_local_world(1, _activate_too_late, (), timeout_s=90)


def test_activate_refuses_per_stage_dp_before_any_collective():
    """A Megatron script runs megatron's schedules and one-replica model-parallel group:
    per-stage dp is ldt-train's, and activate() says so (no process group is needed)."""
    import ldt.run
    from ldt.config import ConfigError

    cluster = {"stages": [{"name": "edge", "device": "cpu", "tp": 1, "dp": 1},
                          {"name": "cloud", "device": "cpu", "tp": 1, "dp": 2}],
               "u_shape": True}
    with pytest.raises(ConfigError, match=r"stages\[\*\]\.dp = \[1, 2\].*ldt-train"):
        ldt.run.activate(cluster, rank=0)
