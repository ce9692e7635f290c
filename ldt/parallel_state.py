"""VTP parallel state: every process group of a topology, created once, in one place.

:func:`initialize_vtp` builds, for the active :class:`~ldt.topology.Topology`:

- a TP group per (replica, stage) with the stage's native backend;
- a data-parallel group per (stage, TP rank) across replicas (+ a gloo twin where the native
  backend is not gloo, as Megatron's distributed optimizer expects);
- one group per stage boundary holding the two leaders (native backend, or gloo when the
  boundary is host-staged). One group per *directed* boundary means a two-stage ring, where
  prev == next, still has one FIFO channel per (group, direction): a forward activation can
  never match a backward gradient, even on NCCL which ignores tags;
- a gloo group of all leaders of a replica (cross-stage scalars: loss, grad norm) and a
  replica-wide model-parallel group.

It then points megatron-core's ``parallel_state`` globals at them so Megatron code on each rank
sees its own stage's TP size and rank, pipeline rank = stage index, pipeline size = number of
stages and next/prev pipeline rank = the neighbouring leaders (wrapping around). The
private-name writes live in :mod:`ldt.patches.megatron_state`, the only module that touches
megatron's internals.

Module state: the reference API (``is_vtp_stage_rank0()`` and friends) is a set of free
functions, so the active :class:`VtpState` is kept here; new code should pass the state object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from ldt.config import ConfigError
from ldt.device import BoundaryPlan, backend_for
from ldt.topology import RankInfo, Topology

DEFAULT_TIMEOUT_S = 600.0


class StagePipelineGroup:
    """What Megatron's schedules call the pipeline group: rank = stage index, size = stages.

    In a VTP world there is no real group whose members are "one rank per stage" for every rank
    (non-leaders never talk across stages), and the schedules only ask ``.rank()`` and
    ``.size()`` of it. Cross-stage traffic goes through :class:`ldt.p2p.VtpCommunicator`.
    """

    def __init__(self, stage: int, num_stages: int, leaders: tuple[int, ...]):
        self._stage, self._size, self.leaders = stage, num_stages, leaders

    def rank(self) -> int:
        return self._stage

    def size(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"StagePipelineGroup(stage={self._stage}, stages={self._size})"


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
    replica_group: dist.ProcessGroup
    leader_group: Optional[dist.ProcessGroup]  # None on non-leaders
    pp_group: StagePipelineGroup
    # directed boundary (src_stage, dst_stage) -> (plan, group); only on the two leaders
    boundary_groups: dict[tuple[int, int], tuple[BoundaryPlan, dist.ProcessGroup]] = field(
        default_factory=dict)
    owned_groups: list[dist.ProcessGroup] = field(default_factory=list, repr=False)

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
        """megatron-core's ProcessGroupCollection for this rank's stage (passed to schedules)."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        pgs = ProcessGroupCollection()
        pgs.tp, pgs.pp, pgs.cp = self.tp_group, self.pp_group, self.cp_group
        pgs.tp_cp = self.tp_group
        pgs.embd = pgs.pos_embd = None  # embedding and head never tie across stages in ldt
        pgs.dp = pgs.dp_cp = pgs.intra_dp_cp = self.dp_group
        pgs.mp = self.replica_group
        return pgs


_STATE: Optional[VtpState] = None


def initialize_vtp(topology: Topology, timeout_s: Optional[float] = None) -> VtpState:
    """Create every group of ``topology`` (collective over the whole world) and activate it.

    The world must already be initialized (``torch.distributed.init_process_group``) with
    exactly ``topology.world_size`` ranks; that is checked before the first collective.
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
            f"world size is {world} but cluster needs dp * sum(tp) = {topology.dp} * "
            f"{topology.replica_size} = {topology.world_size} (tp per stage {topology.tp_sizes}); "
            "launch that many processes or change cluster.stages[*].tp / cluster.dp"
        )
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
    devices = {s.device for s in topology.stages}
    mixed_backend = "gloo" if len(devices) > 1 else backend_for(next(iter(devices)))

    # Context-parallel size is 1: a group of one. Only its member creates it (local
    # synchronization, hashed name), so this is O(1) per rank, not one world barrier per rank.
    mine["cp"] = dist.new_group([rank], backend=backend_for(info.device), timeout=timeout,
                                use_local_synchronization=True)
    owned.append(mine["cp"])
    for d in range(topology.dp):  # TP groups
        for s in topology.stages:
            g = new_group(topology.stage_ranks(s.index, d), backend_for(s.device))
            if g is not None:
                mine["tp"] = g
    for s in topology.stages:  # DP groups (+ gloo twins), TP x DP groups
        backend = backend_for(s.device)
        for t in range(s.tp):
            ranks = topology.dp_ranks(s.index, t)
            g = new_group(ranks, backend)
            g_gloo = g if backend == "gloo" else new_group(ranks, "gloo")
            if g is not None:
                mine["dp"], mine["dp_gloo"] = g, g_gloo
        tp_dp = [r for d in range(topology.dp) for r in topology.stage_ranks(s.index, d)]
        g = new_group(tp_dp, backend) if topology.dp > 1 else None
        if g is not None:
            mine["tp_dp"] = g
    boundary_groups: dict = {}
    for d in range(topology.dp):  # leaders: all-leader gloo group, one group per boundary
        g = new_group(topology.leaders(d), "gloo")
        if g is not None:
            mine["leaders"] = g
        g = new_group([r for s in range(topology.num_stages)
                       for r in topology.stage_ranks(s, d)], mixed_backend)
        if g is not None:
            mine["replica"] = g
        for plan in topology.boundaries():
            pair = sorted({topology.leader(plan.src_stage, d), topology.leader(plan.dst_stage, d)})
            g = new_group(pair, plan.backend)
            if g is not None:
                boundary_groups[(plan.src_stage, plan.dst_stage)] = (plan, g)

    state = VtpState(
        topology=topology, rank=rank, info=info,
        tp_group=mine["tp"], cp_group=mine["cp"], dp_group=mine["dp"], dp_group_gloo=mine["dp_gloo"],
        tp_dp_group=mine.get("tp_dp", mine["tp"]), replica_group=mine["replica"],
        leader_group=mine.get("leaders"),
        pp_group=StagePipelineGroup(info.stage, topology.num_stages, topology.leaders(info.dp_rank)),
        boundary_groups=boundary_groups, owned_groups=owned,
    )
    from ldt.patches import megatron_state

    megatron_state.install(state)
    _STATE = state
    return state


def destroy_vtp() -> None:
    """Forget the VTP state, reset megatron-core's globals and destroy ldt's groups."""
    global _STATE
    if _STATE is None:
        return
    from ldt.patches import megatron_state

    megatron_state.uninstall()
    for g in _STATE.owned_groups:
        try:
            dist.destroy_process_group(g)
        except Exception:  # a group of a dead world: nothing left to free
            pass
    _STATE = None


def get_vtp_state() -> VtpState:
    if _STATE is None:
        raise RuntimeError("ldt's VTP state is not initialized; call ldt.initialize_vtp(topology)")
    return _STATE


def is_vtp_initialized() -> bool:
    return _STATE is not None


# ---- the reference implementation's names (MindSpeed LDT), kept for its users -------------
def is_vtp_stage_rank0() -> bool:
    """True on the leader (TP rank 0) of this rank's stage."""
    return get_vtp_state().is_leader


def get_vtp_size_list() -> list[int]:
    """TP size of every stage, in pipeline order."""
    return get_vtp_state().topology.tp_sizes


def get_vtp_stage_ranks(stage: Optional[int] = None) -> list[int]:
    """Global ranks of a stage (default: this rank's) in this rank's replica."""
    st = get_vtp_state()
    return list(st.topology.stage_ranks(st.stage if stage is None else stage, st.info.dp_rank))


def get_vtp_my_stage_idx() -> int:
    return get_vtp_state().stage
