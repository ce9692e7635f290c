"""VTP parallel state: every process group of a topology, created once, in one place.

:func:`initialize_vtp` builds, for the active :class:`~ldt.topology.Topology`:

- a TP group per (replica, stage) with the stage's native backend;
- a data-parallel group per (stage, TP rank) across replicas (+ a gloo twin where the native
  backend is not gloo, as Megatron's distributed optimizer expects);
- one group per stage boundary holding the two leaders (native backend, or gloo when the
  boundary is host-staged). One group per *directed* boundary means a two-stage ring, where
  prev == next, still has one FIFO channel per (group, direction): a forward activation can
  never match a backward gradient, even on NCCL which ignores tags;
- where a leader may send straight to every TP rank across a boundary
  (:meth:`~ldt.topology.Topology.fanout_boundaries`), one group per directed boundary holding
  every rank of both stages, and whether those ranks share one node (gathered once);
- a gloo group of all leaders of a replica (the cross-stage channel for scalars, and for the
  cross-stage groups below);
- the groups megatron-core runs collectives on that span stages (:mod:`ldt.cross_stage`): the
  pipeline group, the embedding and position-embedding groups, the model-parallel group and
  the distributed-optimizer instance group.

It then points megatron-core's ``parallel_state`` globals at them so Megatron code on each rank
sees its own stage: TP size and rank of the stage, pipeline rank = stage index, pipeline size =
number of stages, next/prev pipeline rank = the neighbouring leaders (wrapping around), expert
groups per stage (a MoE model's experts spread over ``ep`` of the stage's TP ranks:
:meth:`~ldt.topology.Topology.expert_groups`). The private-name writes live in
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
from ldt.cross_stage import (EmbeddingGroup, OneReplicaPerStageGroup, StageHierarchyGroup,
                             StagePipelineGroup, register, unregister)
from ldt.device import BoundaryPlan, backend_for
from ldt.schedule.routing import boundary_pairs
from ldt.topology import RankInfo, Topology

DEFAULT_TIMEOUT_S = 600.0

__all__ = ["StagePipelineGroup", "VtpState", "initialize_vtp", "destroy_vtp", "get_vtp_state",
           "is_vtp_initialized", "default_embedding_stages", "is_vtp_enabled",
           "is_vtp_stage_rank0", "get_vtp_size_list", "get_vtp_stage_ranks",
           "get_vtp_my_stage_idx", "get_vtp_intra_stage_group", "vtp_allreduce",
           "vtp_hierarchical_barrier"]


@dataclass
class VtpState:
    """The groups this rank belongs to, plus the topology that explains them."""

    topology: Topology
    rank: int
    info: RankInfo
    tp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    dp_group_gloo: dist.ProcessGroup
    tp_dp_group: dist.ProcessGroup
    replica_group: dist.ProcessGroup  # model parallel: every rank of this replica
    leader_group: Optional[dist.ProcessGroup]  # None on non-leaders
    pp_group: StagePipelineGroup
    # directed boundary (src_stage, dst_stage) -> (plan, group); only on the two leaders
    boundary_groups: dict[tuple[int, int], tuple[BoundaryPlan, dist.ProcessGroup]] = field(
        default_factory=dict)
    # directed boundary -> (plan, group of every rank of both stages, whether they share one
    # node), on those ranks, where a leader may send to every TP rank across
    # (Topology.fanout_boundaries)
    fanout_groups: dict[tuple[int, int], tuple[BoundaryPlan, dist.ProcessGroup, bool]] = field(
        default_factory=dict)
    # megatron's embedding / position-embedding groups (None where this rank has no copy) and
    # their members as this rank sees them (also set on ranks outside, as megatron does)
    embd_group: Optional[dist.ProcessGroup] = None
    embedding_ranks: list[int] = field(default_factory=list)
    pos_embd_group: Optional[dist.ProcessGroup] = None
    position_embedding_ranks: list[int] = field(default_factory=list)
    dist_opt_group: Optional[dist.ProcessGroup] = None  # every rank of every replica
    # per-stage DP only: megatron's gradient-statistics group without the distributed
    # optimizer (every stage counted once; see ldt.cross_stage.OneReplicaPerStageGroup)
    grad_stats_group: Optional[dist.ProcessGroup] = None
    # MoE experts (Topology.expert_groups): the stage's expert-parallel group and
    # expert-TP group (this rank alone / the TP group where the stage has ep 1)
    ep_group: Optional[dist.ProcessGroup] = None
    expt_tp_group: Optional[dist.ProcessGroup] = None
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

    def pg_collection(self):
        """megatron-core's ProcessGroupCollection for this rank's stage (schedules, models,
        DDP, ``finalize_model_grads`` and the optimizer take groups from it)."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        pgs = ProcessGroupCollection()
        pgs.tp, pgs.pp, pgs.cp = self.tp_group, self.pp_group, self.cp_group
        pgs.tp_cp = self.tp_group
        pgs.embd, pgs.pos_embd = self.embd_group, self.pos_embd_group
        pgs.dp = pgs.dp_cp = pgs.intra_dp_cp = self.dp_group
        pgs.tp_dp_cp = self.tp_dp_group
        pgs.mp = self.replica_group
        # experts: spread over the stage's expert-parallel ranks, split over its expert-TP
        # ranks; the two together are the stage's TP group (expert_groups), and the group
        # of the gradient norm is the dense one (one norm over every parameter)
        pgs.ep, pgs.expt_tp = self.ep_group, self.expt_tp_group
        pgs.tp_ep = self.tp_group
        pgs.tp_ep_pp = self.replica_group
        pgs.expt_dp = pgs.intra_expt_dp = self.dp_group
        pgs.intra_dist_opt = self.dist_opt_group
        from ldt.patches import megatron_state

        megatron_state.complete_pg_collection(pgs, alone=self.cp_group)  # newer releases' fields
        return pgs


_STATE: Optional[VtpState] = None


def default_embedding_stages(topology: Topology) -> list[int]:
    """Stages holding a copy of the word embedding: megatron's first and last pipeline stage,
    or only stage 0 where it also holds the head (one stage, or the U-shape's edge)."""
    if topology.num_stages == 1 or topology.u_shape:
        return [0]
    return [0, topology.num_stages - 1]


def initialize_vtp(topology: Topology, timeout_s: Optional[float] = None, *,
                   embedding_stages: Optional[Sequence[int]] = None,
                   position_embedding_stages: Optional[Sequence[int]] = None) -> VtpState:
    """Create every group of ``topology`` (collective over the whole world) and activate it.

    The world must already be initialized (``torch.distributed.init_process_group``) with
    exactly ``topology.world_size`` ranks; that is checked before the first collective.
    ``embedding_stages`` / ``position_embedding_stages``: the stages of the embedding groups
    (default: :func:`default_embedding_stages` and stage 0, as megatron's defaults).
    """
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized; call init_process_group first "
            "(ldt-train and `python -m ldt.run` do it for you)"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != topology.world_size:
        raise ConfigError(
            f"world size is {world} but cluster needs sum over stages of tp * dp = "
            f"{topology.world_size} (tp per stage {topology.tp_sizes}, dp per stage "
            f"{topology.dp_sizes}); launch that many processes or change "
            "cluster.stages[*].tp / cluster.stages[*].dp / cluster.dp"
        )
    emb_stages = _check_stages(topology, embedding_stages, default_embedding_stages(topology),
                               "embedding")
    pos_stages = _check_stages(topology, position_embedding_stages, [0], "position embedding")
    if _STATE is not None:
        destroy_vtp()
    timeout = timedelta(seconds=timeout_s or DEFAULT_TIMEOUT_S)
    info = topology.rank_info(rank)
    owned: list[dist.ProcessGroup] = []

    def new_group(ranks, backend):
        # Every rank calls new_group for every group, in the same order (torch requires it).
        group = dist.new_group(list(ranks), backend=backend, timeout=timeout)
        if rank in ranks:
            owned.append(group)
            return group
        return None

    mine: dict[str, dist.ProcessGroup] = {}

    # Context-parallel size is 1: a group of one. Only its member creates it (local
    # synchronization, hashed name), so this is O(1) per rank, not one world barrier per rank.
    mine["cp"] = dist.new_group([rank], backend=backend_for(info.device), timeout=timeout,
                                use_local_synchronization=True)
    owned.append(mine["cp"])
    for d in range(topology.dp):  # TP groups
        for s in topology.stages:
            if d >= topology.dp_of(s.index):  # per-stage DP: this stage has fewer replicas
                continue
            g = new_group(topology.stage_ranks(s.index, d), backend_for(s.device))
            if g is not None:
                mine["tp"] = g
    _expert_groups(topology, new_group, mine)
    for s in topology.stages:  # DP groups (+ gloo twins), TP x DP groups
        backend = backend_for(s.device)
        for t in range(s.tp):
            ranks = topology.dp_ranks(s.index, t)
            g = new_group(ranks, backend)
            g_gloo = g if backend == "gloo" else new_group(ranks, "gloo")
            if g is not None:
                mine["dp"], mine["dp_gloo"] = g, g_gloo
        stage_dp = topology.dp_of(s.index)
        tp_dp = [r for d in range(stage_dp) for r in topology.stage_ranks(s.index, d)]
        g = new_group(tp_dp, backend) if stage_dp > 1 else None
        if g is not None:
            mine["tp_dp"] = g
    boundary_groups: dict = {}
    fanout_groups: dict = {}
    fanout = topology.fanout_boundaries()
    nodes = _node_ids(world) if fanout and topology.boundary_fanout == "auto" else [""] * world
    if topology.is_vdp:  # per-stage DP: its own leader and boundary groups
        _vdp_leader_groups(topology, new_group, mine, boundary_groups)
    for d in range(0 if topology.is_vdp else topology.dp):  # leaders: all-leader gloo group,
        # one group per boundary
        g = new_group(topology.leaders(d), "gloo")
        if g is not None:
            mine["leaders"] = g
        if len(emb_stages) > 1:  # the embedding copies' leaders (tied embedding and head)
            g = new_group([topology.leader(s, d) for s in emb_stages], "gloo")
            if g is not None:
                mine["emb_leaders"] = g
        if len(pos_stages) > 1:
            g = new_group([topology.leader(s, d) for s in pos_stages], "gloo")
            if g is not None:
                mine["pos_leaders"] = g
        for plan in topology.boundaries():
            pair = sorted({topology.leader(plan.src_stage, d), topology.leader(plan.dst_stage, d)})
            g = new_group(pair, plan.backend)
            if g is not None:
                boundary_groups[(plan.src_stage, plan.dst_stage)] = (plan, g)
        for plan in fanout:
            both = sorted({*topology.stage_ranks(plan.src_stage, d),
                           *topology.stage_ranks(plan.dst_stage, d)})
            g = new_group(both, plan.backend)
            if g is not None:
                fanout_groups[(plan.src_stage, plan.dst_stage)] = (
                    plan, g, len({nodes[r] for r in both}) == 1)

    tp_dp_group = mine.get("tp_dp", mine["tp"])
    cross = _cross_stage_groups(topology, info, mine, tp_dp_group, emb_stages, pos_stages)
    state = VtpState(
        topology=topology, rank=rank, info=info,
        tp_group=mine["tp"], cp_group=mine["cp"], dp_group=mine["dp"], dp_group_gloo=mine["dp_gloo"],
        tp_dp_group=tp_dp_group, leader_group=mine.get("leaders"),
        boundary_groups=boundary_groups, fanout_groups=fanout_groups, owned_groups=owned,
        ep_group=mine.get("ep", mine["cp"]),
        expt_tp_group=mine.get("expt_tp", mine["cp"] if topology.stages[info.stage].etp == 1
                               else mine["tp"]),
        **cross,
    )
    from ldt.patches import megatron_state

    megatron_state.install(state)
    _STATE = state
    return state


def _node_ids(world: int) -> list[str]:
    """Every rank's node: its host name and torchrun's node rank (network namespaces on one
    machine share a host name), gathered over the world; a launcher without torchrun's
    environment runs every rank on this host."""
    mine = f"{socket.gethostname()}/{os.environ.get('GROUP_RANK', '')}"
    out: list = [None] * world
    dist.all_gather_object(out, mine)
    return out


def _expert_groups(topology: Topology, new_group, mine: dict) -> None:
    """The expert-parallel and expert-TP groups of every stage with ``ep > 1`` (elsewhere
    the experts are split like the dense layers: EP is this rank alone, expert TP the TP
    group). An expert-TP group of one rank is this rank's group of one (``mine['cp']``)."""
    for d in range(topology.dp):
        for s in topology.stages:
            if s.ep == 1 or d >= topology.dp_of(s.index):
                continue
            ep_groups, etp_groups = topology.expert_groups(s.index, d)
            for ranks in ep_groups:
                g = new_group(ranks, backend_for(s.device))
                if g is not None:
                    mine["ep"] = g
            for ranks in etp_groups if s.etp > 1 else []:
                g = new_group(ranks, backend_for(s.device))
                if g is not None:
                    mine["expt_tp"] = g


def _vdp_leader_groups(topology, new_group, mine: dict, boundary_groups: dict) -> None:
    """Create the per-stage-DP leader groups (ldt.boundary.lanes talks over them): one
    two-leader group per routed replica pair of a boundary, so each pair keeps its own FIFO
    channel as a uniform boundary does. Fill ``mine['leaders']`` (every replica's
    leaders, gloo) and ``boundary_groups[(a, b, ra, rb)] = (plan, group)`` on the members."""
    every_leader = [topology.leader(s, r) for s in range(topology.num_stages)
                    for r in range(topology.dp_of(s))]
    g = new_group(sorted(every_leader), "gloo")
    if g is not None:
        mine["leaders"] = g
    # replica 0's leaders: the host leg of megatron's gradient statistics (norm, found-inf),
    # where each stage is counted once (ldt.parallel_state: grad_stats_group, dist_opt_group)
    g = new_group([topology.leader(s, 0) for s in range(topology.num_stages)], "gloo")
    if g is not None:
        mine["replica0_leaders"] = g
    for plan in topology.boundaries():
        a, b = plan.src_stage, plan.dst_stage
        for ra, rb in boundary_pairs(topology.dp_of(a), topology.dp_of(b), topology.dp):
            pair = sorted({topology.leader(a, ra), topology.leader(b, rb)})
            g = new_group(pair, plan.backend)
            if g is not None:
                boundary_groups[(a, b, ra, rb)] = (plan, g)


def _check_stages(topology: Topology, stages, default, what: str) -> list[int]:
    stages = list(default if stages is None else stages)
    if not stages or any(not 0 <= s < topology.num_stages for s in stages):
        raise ConfigError(f"{what} stages {stages} must be stage indices of the "
                          f"{topology.num_stages}-stage cluster")
    return sorted(set(stages))


def _cross_stage_groups(topology: Topology, info: RankInfo, mine: dict, tp_dp_group,
                        emb_stages: list[int], pos_stages: list[int]) -> dict:
    """The groups that span stages, as :mod:`ldt.cross_stage` process groups, registered
    with torch.distributed under the members this rank sees."""
    rank, d = info.rank, info.dp_rank
    leaders = topology.leaders(d)
    out: dict = {"python_groups": []}

    def keep(group, members, name):
        register(group, members, name)
        out["python_groups"].append(group)
        return group

    # Per-stage DP: megatron's cross-stage groups see replica d of the uniform run (leaders(d))
    # and have no leaders' leg; the optimizer's statistics use dist_opt_group / grad_stats_group
    # (below), which span every rank and cross over replica 0's leaders (docs/vdp.md)
    leader_group = None if topology.is_vdp else mine.get("leaders")
    out["pp_group"] = pp = StagePipelineGroup(
        info.stage, topology.num_stages, leaders, me=rank, tp_group=mine["tp"],
        leader_group=leader_group, name=f"ldt_pp_{d}")
    keep(pp, pp.members(), pp.group_name_)

    def view(stages):  # one member per stage: this rank for its own stage, else the leader
        return [rank if s == info.stage else leaders[s] for s in stages]

    def stage_subset(cls, stages, leader_key, name):
        if info.stage not in stages:
            return None
        group = cls(stages.index(info.stage), len(stages), [leaders[s] for s in stages],
                    me=rank, tp_group=mine["tp"], leader_group=mine.get(leader_key), name=name)
        return keep(group, view(stages), name)

    out["embd_group"] = stage_subset(EmbeddingGroup, emb_stages, "emb_leaders", f"ldt_embd_{d}")
    out["embedding_ranks"] = view(emb_stages)
    out["pos_embd_group"] = stage_subset(StagePipelineGroup, pos_stages, "pos_leaders",
                                         f"ldt_pos_embd_{d}")
    out["position_embedding_ranks"] = view(pos_stages)

    replica = [r for s in range(topology.num_stages)
               for r in topology.stage_ranks(s, d % topology.dp_of(s))]
    roots = {r: leaders[topology.rank_info(r).stage] for r in replica}
    out["replica_group"] = keep(StageHierarchyGroup(
        f"ldt_mp_{d}", replica, rank, stage_group=mine["tp"], stage_root=leaders[info.stage],
        leader_group=leader_group, stage_roots=roots), replica, f"ldt_mp_{d}")
    if topology.dp == 1:
        out["dist_opt_group"] = out["replica_group"]
        return out
    # every replica: reduce over the stage's TP x DP ranks, replica 0's leaders cross
    world = list(range(topology.world_size))
    roots = {r: topology.leader(topology.rank_info(r).stage, 0) for r in world}
    cross0 = mine.get("replica0_leaders") if topology.is_vdp else (
        leader_group if d == 0 else None)
    out["dist_opt_group"] = keep(StageHierarchyGroup(
        "ldt_dist_opt", world, rank, stage_group=tp_dp_group, stage_root=roots[rank],
        leader_group=cross0, stage_roots=roots), world, "ldt_dist_opt")
    if topology.is_vdp:  # the replicas of a stage hold equal gradients: replica 0 counts
        out["grad_stats_group"] = keep(OneReplicaPerStageGroup(
            "ldt_vdp_grad_stats", world, rank, stage_group=tp_dp_group, stage_root=roots[rank],
            leader_group=cross0, stage_roots=roots, counts=d == 0),
            world, "ldt_vdp_grad_stats")
    return out


def destroy_vtp() -> None:
    """Forget the VTP state, reset megatron-core's globals and destroy ldt's groups."""
    global _STATE
    if _STATE is None:
        return
    from ldt.patches import megatron_state

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
