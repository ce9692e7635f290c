"""Point megatron-core's ``parallel_state`` globals at ldt's VTP groups (and back).

``initialize_model_parallel`` cannot build a VTP world (it asserts world % (tp*pp) == 0 and
gives every stage the same TP size), so the state is written directly. These are private
names of megatron-core 0.16; the registry's version check guards them.
"""

from __future__ import annotations

from megatron.core import parallel_state as ps

from ldt.patches.registry import check_megatron_version


def install(state) -> None:
    """Make Megatron code on this rank see its own stage (``state`` is an ldt VtpState)."""
    check_megatron_version()
    ps.destroy_model_parallel()
    topo, info = state.topology, state.info
    tp_ranks = list(state.stage_ranks)
    dp_ranks = list(topo.dp_ranks(info.stage, info.tp_rank))
    replica = [r for s in range(topo.num_stages) for r in topo.stage_ranks(s, info.dp_rank)]

    ps._TENSOR_MODEL_PARALLEL_GROUP = state.tp_group
    ps._TENSOR_MODEL_PARALLEL_GLOBAL_RANKS = tp_ranks
    ps._TENSOR_AND_CONTEXT_PARALLEL_GROUP = state.tp_group  # context parallel size is 1

    # Pipeline: rank = stage, size = stages; next/prev = neighbouring leaders (wraps around).
    ps._PIPELINE_MODEL_PARALLEL_GROUP = state.pp_group
    ps._PIPELINE_GLOBAL_RANKS = list(topo.leaders(info.dp_rank))
    ps._MPU_PIPELINE_MODEL_PARALLEL_RANK = info.stage
    ps._MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = topo.num_stages

    ps._DATA_PARALLEL_GROUP = state.dp_group
    ps._DATA_PARALLEL_GROUP_GLOO = state.dp_group_gloo
    ps._DATA_PARALLEL_GLOBAL_RANKS = dp_ranks
    ps._DATA_PARALLEL_GROUP_WITH_CP = state.dp_group
    ps._DATA_PARALLEL_GROUP_WITH_CP_GLOO = state.dp_group_gloo
    ps._DATA_PARALLEL_GLOBAL_RANKS_WITH_CP = dp_ranks
    ps._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP = state.dp_group
    ps._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO = state.dp_group_gloo
    ps._TENSOR_AND_DATA_PARALLEL_GROUP = state.tp_dp_group
    ps._TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP = state.tp_dp_group

    ps._MODEL_PARALLEL_GROUP = state.replica_group
    ps._MODEL_PARALLEL_GLOBAL_RANKS = replica
    ps._CONTEXT_PARALLEL_GROUP = state.cp_group
    ps._CONTEXT_PARALLEL_GLOBAL_RANKS = [state.rank]

    # No expert parallelism in ldt yet: EP = 1 (a group of one), expert TP = the stage's TP.
    ps._EXPERT_MODEL_PARALLEL_GROUP = state.cp_group
    ps._MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE = 1
    ps._MPU_EXPERT_MODEL_PARALLEL_RANK = 0
    ps._EXPERT_TENSOR_PARALLEL_GROUP = state.tp_group
    ps._EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP = state.tp_group
    ps._EXPERT_DATA_PARALLEL_GROUP = state.dp_group
    ps._EXPERT_DATA_PARALLEL_GROUP_GLOO = state.dp_group_gloo

    # Embedding and head share a stage in a U-shape; in a plain pipeline ldt does not tie them
    # across stages (no cross-device-type embedding group), so no embedding group exists.
    ps._EMBEDDING_GLOBAL_RANKS = []
    ps._POSITION_EMBEDDING_GLOBAL_RANKS = []
    split = topo.split
    if split is not None and not topo.u_shape and split.vpp_size > 1:
        # get_forward_backward_func() picks the interleaved schedule from this
        ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = split.vpp_size
    ps._set_global_memory_buffer()


def uninstall() -> None:
    ps.destroy_model_parallel()
