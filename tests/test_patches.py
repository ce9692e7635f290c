"""The patch registry, the version check and the initialize_model_parallel patch."""

import os
import re
import tomllib

import pytest
from packaging.version import Version

from ldt import patches
from ldt.config import ClusterConfig, ConfigError, StageConfig
from ldt.launch.local import WorldError, run_local_world
from ldt.patches import PatchError, check_megatron_version, versions
from ldt.topology.ranks import Topology

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_version_check_accepts_the_tested_releases_and_refuses_the_others():
    for good in versions.RELEASES + ("0.19.3", "0.17.0rc1"):
        assert check_megatron_version(good) == good
    for bad in ("0.15.3", "0.20.0", "0.20.0rc0", "1.0.0"):
        with pytest.raises(PatchError) as err:
            check_megatron_version(bad)
        message = str(err.value)
        assert "\n" not in message and f"megatron-core {bad} is installed" in message
        assert "megatron-core>=0.16.0,<0.20" in message  # the range, as pip takes it


def test_the_releases_named_tested_are_the_ones_ci_runs():
    """The refusal names ``TESTED`` as run: ``make test``'s release (0.16.1, the newest for
    Python 3.11) and ``.ci/mcore``'s default list."""
    with open(os.path.join(ROOT, ".ci", "mcore")) as f:
        default = re.search(r'MCORE_VERSIONS=\$\{MCORE_VERSIONS:-([0-9. ]+)\}', f.read())
    ci = ["0.16.1", *default.group(1).split()]
    assert sorted(versions.TESTED, key=Version) == sorted(ci, key=Version)
    assert set(versions.TESTED) <= set(versions.RELEASES)


def test_pyproject_pins_the_range_the_patches_check():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    assert f"megatron-core{versions.SUPPORTED}" in deps


def test_every_patch_states_the_releases_it_targets():
    """A patch's releases lie in the supported range and name at least one tested release;
    a patch for older releases only is skipped where megatron does the thing itself."""
    from ldt.patches.registry import REGISTRY, _load_all

    _load_all()
    for patch in REGISTRY.values():
        targeted = [v for v in versions.RELEASES if patch.targets(v)]
        assert targeted, patch.name
        assert all(versions.in_range(versions.SUPPORTED, v) for v in targeted)
    moe = REGISTRY["moe_without_te"]
    assert moe.targets("0.16.1") and not moe.targets("0.17.0")
    assert versions.holds("backward_step_model_type", "0.16.0")
    assert not versions.holds("backward_step_model_type", "0.17.1")
    assert [v for v in versions.RELEASES if versions.holds("gtp_remat_groups", v)] == [
        "0.19.0", "0.19.2"]


def test_a_patch_the_release_does_not_need_is_not_applied():
    from megatron.core.transformer.moe import moe_utils

    with patches.applied(["moe_without_te"]) as done:
        needed = patches.REGISTRY["moe_without_te"].targets()
        assert done == (["moe_without_te"] if needed else [])
        assert moe_utils.te_general_gemm is None  # megatron's own on 0.17+, the patch's on 0.16
    assert hasattr(moe_utils, "te_general_gemm") == (not needed)


def test_apply_and_revert_restore_megatron():
    from megatron.core.pipeline_parallel import schedules

    original = schedules.get_forward_backward_func
    from ldt.pipeline.forward_backward import MegatronHooks

    with pytest.raises(ConfigError, match="patch schedules needs ctx=MegatronHooks"):
        patches.apply(["schedules"])  # the adapter gets ldt's runtime from its caller
    assert schedules.get_forward_backward_func is original
    with patches.applied(["schedules"], ctx=MegatronHooks()) as done:
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

    from types import SimpleNamespace

    from ldt.groups.parallel_state import initialize_vtp

    ctx = SimpleNamespace(topology=topo, initialize_vtp=initialize_vtp)
    with patches.applied(["init_model_parallel"], ctx=ctx):
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

    import ldt.job.megatron

    ps.initialize_model_parallel(1, 1)
    try:
        ldt.job.megatron.activate({"stages": [{"name": "a", "device": "cpu", "tp": 1}]})
    finally:
        ps.destroy_model_parallel()


@pytest.mark.timeout(120)
def test_activate_after_initialize_model_parallel_says_where_it_goes():
    with pytest.raises(WorldError, match=r"activate\(\) before initialize_model_parallel"):
        run_local_world(1, _activate_too_late, (), timeout_s=90)


def test_activate_refuses_per_stage_dp_before_any_collective():
    """A Megatron script runs megatron's schedules and one-replica model-parallel group:
    per-stage dp is ldt-train's, and activate() says so (no process group is needed)."""
    import ldt.job.megatron
    from ldt.config import ConfigError

    cluster = {"stages": [{"name": "edge", "device": "cpu", "tp": 1, "dp": 1},
                          {"name": "cloud", "device": "cpu", "tp": 1, "dp": 2}],
               "u_shape": True}
    with pytest.raises(ConfigError, match=r"stages\[\*\]\.dp = \[1, 2\].*ldt-train"):
        ldt.job.megatron.activate(cluster, rank=0)
