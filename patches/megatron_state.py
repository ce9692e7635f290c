"""Point megatron-core's ``parallel_state`` globals at ldt's VTP groups (and back).

``initialize_model_parallel`` cannot build a VTP world (it asserts world % (tp*pp) == 0 and
gives every stage the same TP size), so the state is written directly: every global that
megatron-core's ``initialize_model_parallel`` sets, so every getter answers for this rank's
stage. These are private names of megatron-core; the registry's version check guards them
(a name missing from the installed release fails loudly in :func:`_set`), and
:func:`uninstall` resets exactly the names :func:`install` wrote. The names only some
releases have are in the tables below, with the change (``ldt.patches.versions``) that
brought them.
"""

from __future__ import annotations

from megatron.core import parallel_state as ps

from ldt.patches import versions
from ldt.patches.registry import check_megatron_version

# megatron-core 0.19's generalized-TP weight rematerialization (versions: gtp_remat_groups).
# ldt runs without it, where megatron builds weight-shard groups of one rank and makes each
# "with GTP" group the plain one: name -> the global it equals.
GTP_OFF_ALIASES = {
    "_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": "_DATA_PARALLEL_GROUP",
    "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": "_DATA_PARALLEL_GROUP_WITH_CP",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT":
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
    "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": "_EXPERT_DATA_PARALLEL_GROUP",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT":
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP":
        "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP",
}
# ... and the weight-shard groups themselves (this rank alone): name -> its ranks' name
GTP_OFF_SINGLETONS = {"_GTP_WEIGHT_REMAT_GROUP": "_GTP_WEIGHT_REMAT_GLOBAL_RANKS",
                      "_EXPERT_GTP_WEIGHT_REMAT_GROUP": "_EXPERT_GTP_WEIGHT_REMAT_GLOBAL_RANKS"}
# the same in ProcessGroupCollection's fields (0.19): field -> the field it equals, and the
# fields holding the weight-shard groups
PG_GTP_OFF_ALIASES = {"dp_cp_gtp_remat": "dp_cp", "expt_dp_gtp_remat": "expt_dp",
                      "tp_ep_pp_with_egtp_remat": "tp_ep_pp"}
PG_GTP_OFF_SINGLETONS = ("gtp_remat", "expt_gtp_remat")

_WRITTEN: list[str] = []


def _set(name: str, value) -> None:
    if not hasattr(ps, name):  # a renamed global: fail loudly, not silently set a new name
        raise AttributeError(f"megatron.core.parallel_state has no {name}; "
                             "ldt.patches.megatron_state needs updating for this release")
    setattr(ps, name, value)
    _WRITTEN.append(name)


def install(state, names) -> None:
    """Make Megatron code on this rank see its own stage. ``state``: an ldt VtpState (its
    ``groups`` and ``members`` by role, ``stage``, ``rank``, ``cp_group``, ``topology``);
    ``names``: megatron name -> role (``ldt.topology.routes.MEGATRON_NAMES``; the names starting with
    "_" are this module's globals, those naming RANKS take the role's members)."""
    check_megatron_version()
    ps.destroy_model_parallel()
    for name, role in names.items():
        if not name.startswith("_"):  # a ProcessGroupCollection field
            continue
        if "_RANKS" in name:  # a member list (_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP too)
            _set(name, list(state.members[role]))
        else:
            _set(name, None if role is None else state.groups.get(role))
    # Pipeline: rank = stage, size = stages; the group's members (above) as this rank sees
    # them: the leader of every other stage, itself for its own, so next/prev are the
    # neighbouring leaders (wrapping around) and first/last name ranks of the first/last stage
    topo = state.topology
    _set("_MPU_PIPELINE_MODEL_PARALLEL_RANK", state.stage)
    _set("_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", topo.num_stages)
    split = topo.split
    if split is not None and not topo.u_shape and split.vpp_size > 1:
        # get_forward_backward_func() picks the interleaved schedule from this
        _set("_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", split.vpp_size)
    if versions.holds("gtp_remat_groups"):
        for name, same in GTP_OFF_ALIASES.items():
            _set(name, getattr(ps, same))
        for name, ranks in GTP_OFF_SINGLETONS.items():
            _set(name, state.cp_group)  # the group of this rank alone
            _set(ranks, [state.rank])
    ps._set_global_memory_buffer()


def complete_pg_collection(pgs, alone) -> None:
    """Fill the fields of megatron's ProcessGroupCollection ``pgs`` that only some releases
    have from the ones every release has (``alone``: the group of this rank alone)."""
    if versions.holds("gtp_remat_groups"):
        for name, same in PG_GTP_OFF_ALIASES.items():
            setattr(pgs, name, getattr(pgs, same))
        for name in PG_GTP_OFF_SINGLETONS:
            setattr(pgs, name, alone)


def uninstall() -> None:
    """Reset every global :func:`install` wrote (``destroy_model_parallel`` leaves some)."""
    ps.destroy_model_parallel()
    while _WRITTEN:
        setattr(ps, _WRITTEN.pop(), None)
