"""VTP parallel state: every process group of a topology, created once, in one place.

:func:`initialize_vtp` creates exactly the groups of the topology's rank plan
(:func:`ldt.topology.routes.rank_plan`, which says who is in which group and in what order):

- a TP group per (replica, stage) with the stage's native backend;
- a data-parallel group per (stage, TP rank) across replicas (+ a gloo twin where the native
  backend is not gloo, as Megatron's distributed optimizer expects);
- one group per stage boundary holding the two leaders (native backend, or gloo when the
  boundary is host-staged). One group per *directed* boundary means a two-stage ring, where
  prev == next, still has one FIFO channel per (group, direction): a forward activation can
  never match a backward gradient, even on NCCL which ignores tags;
- where a leader may send straight to every TP rank across a boundary
  (:meth:`~ldt.topology.ranks.Topology.fanout_boundaries`), one group per directed boundary holding
  every rank of both stages, and whether those ranks share one node (gathered once);
- a gloo group of all leaders of a replica (the cross-stage channel for scalars, and for the
  cross-stage groups below);
- the groups megatron-core runs collectives on that span stages (:mod:`ldt.groups.cross_stage`): the
  pipeline group, the embedding and position-embedding groups, the model-parallel group and
  the distributed-optimizer instance group.

It then points megatron-core's ``parallel_state`` globals at them so Megatron code on each rank
sees its own stage, through one name table (:data:`ldt.topology.routes.MEGATRON_NAMES`, which
:meth:`VtpState.pg_collection` reads as well): TP size and rank of the stage, pipeline rank =
stage index, pipeline size = number of stages, next/prev pipeline rank = the neighbouring leaders (wrapping around), expert
groups per stage (a MoE model's experts spread over ``ep`` of the stage's TP ranks:
:meth:`~ldt.topology.ranks.Topology.expert_groups`). The private-name writes live in
:mod:`ldt.patches.megatron_state`, the only module that touches megatron's internals.

Module state: the reference API (``is_vtp_stage_rank0()`` and friends) is a set of free
functions, so the active :class:`VtpState` is kept here; new code should pass the state object.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional, Sequence

import torch.distributed as dist

from ldt.config import ConfigError
from ldt.groups.cross_stage import (EmbeddingGroup, OneReplicaPerStageGroup, StageHierarchyGroup,
                             StagePipelineGroup, register, unregister)
from ldt.patches import megatron_state
from ldt.topology.ranks import RankInfo, Topology
from ldt.topology.routes import (CROSS_STAGE, MEGATRON_NAMES, RankPlan, default_embedding_stages,
                        rank_plan)

DEFAULT_TIMEOUT_S = 600.0

__all__ = ["StagePipelineGroup", "VtpState", "initialize_vtp", "destroy_vtp", "get_vtp_state",
           "is_vtp_initialized", "default_embedding_stages", "is_vtp_enabled",
           "is_vtp_stage_rank0", "get_vtp_size_list", "get_vtp_stage_ranks",
           "get_vtp_my_stage_idx", "get_vtp_intra_stage_group", "vtp_allreduce",
           "vtp_hierarchical_barrier"]


@dataclass
class VtpState:
    """The groups this rank belongs to, plus the topology and the plan that explain them."""

    topology: Topology
    rank: int
    info: RankInfo
    plan: RankPlan
    # role (ldt.topology.routes: tp, dp, pp, mp, leaders...) -> this rank's group of that role (None
    # where it holds none, e.g. the embedding group off the embedding stages)
    groups: dict[str, Optional[dist.ProcessGroup]] = field(default_factory=dict)
    # plan group name -> group, for this rank's groups (the routes' boundary and fan-out groups)
    named_groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    # role -> the group's members as this rank sees them (megatron's *_RANKS globals)
    members: dict[str, list[int]] = field(default_factory=dict)
    owned_groups: list[dist.ProcessGroup] = field(default_factory=list, repr=False)
    python_groups: list[dist.ProcessGroup] = field(default_factory=list, repr=False)

    @property
    def stage(self) -> int:
        return self.info.stage

    @property
    def is_leader(self) -> bool:
        return self.info.is_leader

    @property
    def stage_ranks(self) -> tuple[int, ...]:
        return self.topology.stage_ranks(self.info.stage, self.info.dp_rank)

    # the groups by the names the rest of ldt reads them by
    tp_group = property(lambda self: self.groups["tp"])
    cp_group = property(lambda self: self.groups["cp"])
    dp_group = property(lambda self: self.groups["dp"])
    dp_group_gloo = property(lambda self: self.groups["dp_gloo"])
    tp_dp_group = property(lambda self: self.groups["tp_dp"])
    replica_group = property(lambda self: self.groups["mp"])  # model parallel: the replica
    leader_group = property(lambda self: self.groups.get("leaders"))  # None off the leaders
    pp_group = property(lambda self: self.groups["pp"])
    embd_group = property(lambda self: self.groups.get("embd"))
    pos_embd_group = property(lambda self: self.groups.get("pos_embd"))
    embedding_ranks = property(lambda self: self.members["embd"])
    position_embedding_ranks = property(lambda self: self.members["pos_embd"])
    dist_opt_group = property(lambda self: self.groups["dist_opt"])  # every replica
    # per-stage DP only: megatron's gradient-statistics group without the distributed
    # optimizer (every stage counted once; see ldt.groups.cross_stage.OneReplicaPerStageGroup)
    grad_stats_group = property(lambda self: self.groups.get("grad_stats"))
    ep_group = property(lambda self: self.groups["ep"])
    expt_tp_group = property(lambda self: self.groups["expt_tp"])

    def pg_collection(self):
        """megatron-core's ProcessGroupCollection for this rank's stage (schedules, models,
        DDP, ``finalize_model_grads`` and the optimizer take groups from it), filled from
        :data:`ldt.topology.routes.MEGATRON_NAMES` as megatron's globals are."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        pgs = ProcessGroupCollection()
        for name, role in MEGATRON_NAMES.items():
            if not name.startswith("_"):  # a ProcessGroupCollection field
                setattr(pgs, name, self.groups.get(role))
        megatron_state.complete_pg_collection(pgs, alone=self.cp_group)  # newer releases' fields
        return pgs


_STATE: Optional[VtpState] = None


def initialize_vtp(topology: Topology, timeout_s: Optional[float] = None, *,
                   embedding_stages: Optional[Sequence[int]] = None,
                   position_embedding_stages: Optional[Sequence[int]] = None) -> VtpState:
    """Create every group of ``topology``'s :func:`~ldt.topology.routes.rank_plan` (collective over
    the whole world) and activate it.

    The world must already be initialized (``torch.distributed.init_process_group``) with
    exactly ``topology.world_size`` ranks; that is checked before the first collective.
    ``embedding_stages`` / ``position_embedding_stages``: the stages of the embedding groups
    (default: :func:`default_embedding_stages` and stage 0, as megatron's defaults).
    """
    global _STATE
    _check_world(topology)
    world, rank = dist.get_world_size(), dist.get_rank()
    stages = dict(embedding_stages=embedding_stages,
                  position_embedding_stages=position_embedding_stages)
    plan = rank_plan(topology, **stages)  # refuses bad stages before the first collective
    if _STATE is not None:
        destroy_vtp()
    if topology.fanout_boundaries() and topology.boundary_fanout == "auto":
        plan = rank_plan(topology, nodes=_node_ids(world), **stages)
    timeout = timedelta(seconds=timeout_s or DEFAULT_TIMEOUT_S)
    named, owned = _create_groups(plan, rank, timeout)
    state = VtpState(topology=topology, rank=rank, info=topology.rank_info(rank), plan=plan,
                     named_groups=named, owned_groups=owned)
    for role, name in plan.roles_of(rank).items():
        if name in named:
            state.groups[role] = named[name]
            state.members[role] = list(plan.group(name).ranks)
    _cross_stage_groups(state)
    install_megatron(state)
    _STATE = state
    return state


def install_megatron(state: VtpState) -> None:
    """Point megatron-core's globals at ``state``'s groups (no new groups)."""
    megatron_state.install(state, MEGATRON_NAMES)


def _check_world(topology: Topology) -> None:
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized; call init_process_group first "
            "(ldt-train and `python -m ldt.job.megatron` do it for you)"
        )
    world = dist.get_world_size()
    if world != topology.world_size:
        raise ConfigError(
            f"world size is {world} but cluster needs sum over stages of tp * dp = "
            f"{topology.world_size} (tp per stage {topology.tp_sizes}, dp per stage "
            f"{topology.dp_sizes}); launch that many processes or change "
            "cluster.stages[*].tp / cluster.stages[*].dp / cluster.dp"
        )


def _create_groups(plan: RankPlan, rank: int, timeout: timedelta) -> tuple[dict, list]:
    """Every native group of ``plan``, in its order (torch requires every rank to call
    new_group for every group in the same order); a local group (of one rank) only by its
    member, with local synchronization: O(1) per rank, not one world barrier per rank.
    Returns (plan group name -> group, this rank's groups)."""
    named: dict[str, dist.ProcessGroup] = {}
    for spec in plan.groups:
        if spec.backend == CROSS_STAGE:
            continue  # written in Python over these (ldt.groups.cross_stage): _cross_stage_groups
        if spec.local:
            if rank in spec.ranks:
                named[spec.name] = dist.new_group(list(spec.ranks), backend=spec.backend,
                                                  timeout=timeout,
                                                  use_local_synchronization=True)
            continue
        group = dist.new_group(list(spec.ranks), backend=spec.backend, timeout=timeout)
        if rank in spec.ranks:
            named[spec.name] = group
    return named, list(named.values())


def _node_ids(world: int) -> list[str]:
    """Every rank's node: its host name and torchrun's node rank (network namespaces on one
    machine share a host name), gathered over the world; a launcher without torchrun's
    environment runs every rank on this host."""
    mine = f"{socket.gethostname()}/{os.environ.get('GROUP_RANK', '')}"
    out: list = [None] * world
    dist.all_gather_object(out, mine)
    return out


def _cross_stage_groups(state: VtpState) -> None:
    """The groups that span stages, as :mod:`ldt.groups.cross_stage` process groups, registered
    with torch.distributed under the members this rank sees (``state.members``)."""
    topology, info, groups = state.topology, state.info, state.groups
    rank, d, plan = info.rank, info.dp_rank, state.plan
    leaders = topology.leaders(d)

    def keep(role, group, members):
        register(group, members, group.group_name_)
        state.python_groups.append(group)
        groups[role], state.members[role] = group, list(members)

    # Per-stage DP: megatron's cross-stage groups see replica d of the uniform run (leaders(d))
    # and have no leaders' leg; the optimizer's statistics use dist_opt_group / grad_stats_group
    # (below), which span every rank and cross over replica 0's leaders (docs/vdp.md)
    leader_group = None if topology.is_vdp else groups.get("leaders")
    pp = StagePipelineGroup(info.stage, topology.num_stages, leaders, me=rank,
                            tp_group=groups["tp"], leader_group=leader_group, name=f"ldt_pp_{d}")
    keep("pp", pp, pp.members())
    for role, cls, stages, cross in (
            ("embd", EmbeddingGroup, plan.embedding_stages, "emb_leaders"),
            ("pos_embd", StagePipelineGroup, plan.position_embedding_stages, "pos_leaders")):
        view = [rank if s == info.stage else leaders[s] for s in stages]  # one per stage
        groups[role], state.members[role] = None, view
        if info.stage in stages:
            keep(role, cls(stages.index(info.stage), len(stages), [leaders[s] for s in stages],
                           me=rank, tp_group=groups["tp"], name=f"ldt_{role}_{d}",
                           leader_group=groups.get(cross)),
                 view)
    replica = [r for s in range(topology.num_stages)
               for r in topology.stage_ranks(s, d % topology.dp_of(s))]
    roots = {r: leaders[topology.rank_info(r).stage] for r in replica}
    keep("mp", StageHierarchyGroup(
        f"ldt_mp_{d}", replica, rank, stage_group=groups["tp"], stage_root=leaders[info.stage],
        leader_group=leader_group, stage_roots=roots), replica)
    if topology.dp == 1:
        groups["dist_opt"], state.members["dist_opt"] = groups["mp"], replica
        return
    _dist_opt_groups(state, keep)


def _dist_opt_groups(state: VtpState, keep) -> None:
    """Every replica: reduce over the stage's TP x DP ranks, replica 0's leaders cross; with
    per-stage DP also megatron's gradient statistics, where replica 0 counts (the replicas of
    a stage hold equal gradients)."""
    topology, groups, rank, d = state.topology, state.groups, state.rank, state.info.dp_rank
    world = list(range(topology.world_size))
    roots = {r: topology.leader(topology.rank_info(r).stage, 0) for r in world}
    cross0 = groups.get("replica0_leaders") if topology.is_vdp else (
        groups.get("leaders") if d == 0 else None)
    common = dict(stage_group=groups["tp_dp"], stage_root=roots[rank], leader_group=cross0,
                  stage_roots=roots)
    keep("dist_opt", StageHierarchyGroup("ldt_dist_opt", world, rank, **common), world)
    if topology.is_vdp:
        keep("grad_stats", OneReplicaPerStageGroup("ldt_vdp_grad_stats", world, rank,
                                                   counts=d == 0, **common), world)


def destroy_vtp() -> None:
    """Forget the VTP state, reset megatron-core's globals and destroy ldt's groups."""
    global _STATE
    if _STATE is None:
        return

    megatron_state.uninstall()
    for g in _STATE.python_groups:
        unregister(g)
    for g in _STATE.owned_groups:
        try:
            dist.destroy_process_group(g)
        except Exception:  # a group of a dead world, or one megatron already destroyed
            pass
    _STATE = None


def get_vtp_state() -> VtpState:
    if _STATE is None:
        raise RuntimeError("ldt's VTP state is not initialized; call ldt.initialize_vtp(topology)")
    return _STATE


def is_vtp_initialized() -> bool:
    return _STATE is not None


# ---- the reference implementation's names (MindSpeed LDT), kept for its users -------------
# Before initialization they answer as the reference does: this rank is its stage's rank 0,
# and the layout queries return None.
def is_vtp_enabled() -> bool:
    """True once the VTP state is built."""
    return _STATE is not None


def is_vtp_stage_rank0() -> bool:
    """True on the leader (TP rank 0) of this rank's stage; True before initialization."""
    return True if _STATE is None else _STATE.is_leader


def get_vtp_size_list() -> Optional[list[int]]:
    """TP size of every stage, in pipeline order (None before initialization)."""
    return None if _STATE is None else list(_STATE.topology.tp_sizes)


def get_vtp_stage_ranks() -> Optional[list[list[int]]]:
    """Every stage's global ranks in this rank's replica, in pipeline order: the reference
    idiom ``get_vtp_stage_ranks()[get_vtp_my_stage_idx()][0]`` is this stage's leader."""
    if _STATE is None:
        return None
    topo, d = _STATE.topology, _STATE.info.dp_rank
    return [list(topo.stage_ranks(s, d)) for s in range(topo.num_stages)]


def get_vtp_my_stage_idx() -> Optional[int]:
    """This rank's stage index (None before initialization)."""
    return None if _STATE is None else _STATE.stage


def get_vtp_intra_stage_group() -> Optional[dist.ProcessGroup]:
    """The group of this rank's stage (its TP group), None for a one-rank stage."""
    if _STATE is None or len(_STATE.stage_ranks) == 1:
        return None
    return _STATE.tp_group


def vtp_allreduce(tensor, op=dist.ReduceOp.SUM) -> None:
    """All-reduce over every rank of this replica: within the stage, across the stage leaders
    (host-staged), then back out in the stage (megatron's model-parallel group here)."""
    dist.all_reduce(tensor, op=op, group=get_vtp_state().replica_group)


def vtp_hierarchical_barrier() -> None:
    """A barrier over every rank of this replica, stage by stage."""
    dist.barrier(group=get_vtp_state().replica_group)
