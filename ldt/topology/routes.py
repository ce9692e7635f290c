"""Who talks to whom, and how: a rank plan, pure data computed once from a topology.

:func:`rank_plan` derives from a :class:`~ldt.topology.ranks.Topology` (and the cluster options it
carries: per-stage DP, expert parallelism, ``boundary_fanout``, device types, hence host
staging, link delays) a :class:`RankPlan`:

- ``groups``: every process group, as :class:`GroupSpec` (name, role, ranks, backend), in the
  one order every rank must create them (``torch.distributed.new_group`` is collective over the
  world and matches groups by creation order). :mod:`ldt.groups.parallel_state` creates exactly these.
  The groups that span stages (:mod:`ldt.groups.cross_stage`, written in Python over the native ones)
  close the list with the backend :data:`CROSS_STAGE`; their ranks are the ranks holding one;
- ``routes``: every message path across a stage boundary, as :class:`Route` (stages,
  replicas, the two leaders, the group it travels on, host staging, tag, and the transport
  policy :meth:`Route.transport`: whole, in pieces, or fanned out to every TP rank across,
  :meth:`Route.fanout_sources` saying which sending rank sends which copy; the policy itself
  is :mod:`ldt.topology.transport`'s). :mod:`ldt.boundary.communicator` only executes routes;
  :mod:`ldt.plan.cost` prices :func:`~ldt.topology.transport.carry`, the same policy.

:data:`MEGATRON_NAMES` is the one table from megatron-core's names (``parallel_state``
globals, ``ProcessGroupCollection`` fields) to the role of a plan group.

Learnt from megatron-core's ``bridge_communicator.build_comm_map`` (every rank's peers computed
before any transfer) and ``HyperCommGrid`` (groups asked for by name). No torch here: plans are
checked without processes (tests/test_routes.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence

from ldt.config import ConfigError
from ldt.schedule.routing import boundary_pairs
from ldt.topology.device import backend_for
from ldt.topology.ranks import Topology
from ldt.topology.transport import PIECE_UNIT_BYTES, Carry, carry, fanout_sources

FORWARD, BACKWARD = "F", "B"  # activations travel along a boundary's arrow, gradients against
# Wire tags, all of them. Data and shape tags are distinct per direction (a two-stage ring,
# where prev == next, has one group per directed boundary as well); relay and gather run inside
# a stage's TP group (gloo keeps p2p slots apart from collectives' slots).
DATA_TAGS = {FORWARD: 1, BACKWARD: 2}
SHAPE_TAGS = {FORWARD: 3, BACKWARD: 4}
RELAY_TAG, GATHER_TAG = 5, 6

CROSS_STAGE = "cross_stage"  # the backend of a group ldt.groups.cross_stage writes in Python

@dataclass(frozen=True)
class GroupSpec:
    """One process group: ``name`` unique in the plan, ``role`` what it is to its members
    (``tp``, ``dp``, ``boundary``...), ``local``: only its members create it (a group of
    one: no world-wide synchronization)."""

    name: str
    role: str
    ranks: tuple[int, ...]
    backend: str
    local: bool = False


@dataclass(frozen=True)
class Route:
    """One message path across a stage boundary for one replica pair."""

    boundary: tuple[int, int]  # the directed boundary (activation arrow a -> b)
    direction: str  # FORWARD along the arrow, BACKWARD against it
    src_stage: int  # the stage the message leaves
    dst_stage: int  # ... and reaches
    src_replica: int
    dst_replica: int
    src_rank: int  # the sending stage's leader
    dst_rank: int  # the receiving stage's leader
    group: str  # the plan group of the two leaders
    backend: str
    host_staged: bool  # copy to the host, gloo, copy back (different device types)
    delay_ms: float  # cluster.link_delay_ms (a measurement tool)
    receivers: tuple[int, ...]  # every TP rank of the receiving stage replica
    senders: tuple[int, ...]  # every TP rank of the sending stage replica (leader first)
    fanout_group: Optional[str] = None  # the group of both stages, where fan-out may happen
    fanout_mode: str = "never"  # cluster.boundary_fanout
    same_node: bool = True  # both stages' ranks share one node

    @property
    def tag(self) -> int:
        return DATA_TAGS[self.direction]

    @property
    def shape_tag(self) -> int:
        return SHAPE_TAGS[self.direction]

    def transport(self, nbytes: int, unit_bytes: int = PIECE_UNIT_BYTES,
                  mode: Optional[str] = None) -> Carry:
        """How a message of ``nbytes`` crosses (``mode``: overrides cluster.boundary_fanout;
        both ends decide alike from the same facts)."""
        return carry(nbytes, len(self.receivers), mode=mode or self.fanout_mode,
                     same_node=self.same_node, fanout_group=self.fanout_group is not None,
                     unit_bytes=unit_bytes)

    def fanout_sources(self, whole_on_every_sender: bool) -> tuple[int, ...]:
        """Per rank of ``receivers``, the rank that sends it its fan-out copy
        (:func:`fanout_sources`; both ends ask with the same facts)."""
        return fanout_sources(self.senders, len(self.receivers), whole_on_every_sender)


@dataclass(frozen=True)
class RankPlan:
    """Every group and every boundary route of a topology (module docstring)."""

    groups: tuple[GroupSpec, ...]
    routes: tuple[Route, ...]
    roles: tuple[tuple[tuple[str, str], ...], ...]  # per rank: (role, group name) pairs
    embedding_stages: tuple[int, ...] = (0,)  # the stages of megatron's embedding groups
    position_embedding_stages: tuple[int, ...] = (0,)

    @cached_property
    def _routes(self) -> dict:
        return {(r.src_stage, r.dst_stage, r.direction, r.src_replica, r.dst_replica): r
                for r in self.routes}

    @cached_property
    def _groups(self) -> dict[str, GroupSpec]:
        return {g.name: g for g in self.groups}

    def route(self, src_stage: int, dst_stage: int, direction: str, src_replica: int = 0,
              dst_replica: int = 0) -> Route:
        """The route of a message from ``src_stage`` to ``dst_stage`` (``direction``: F for
        an activation, B for a gradient) between the given replicas."""
        key = (src_stage, dst_stage, direction, src_replica, dst_replica)
        try:
            return self._routes[key]
        except KeyError:
            raise ConfigError(f"no boundary route from stage {src_stage} (replica "
                              f"{src_replica}) to stage {dst_stage} (replica {dst_replica}) "
                              f"for direction {direction!r}; the routes are "
                              f"{sorted(self._routes)[:8]}...") from None

    def group(self, name: str) -> GroupSpec:
        return self._groups[name]

    def roles_of(self, rank: int) -> dict[str, str]:
        """Role -> the name of ``rank``'s group of that role (a group for every role
        :data:`MEGATRON_NAMES` uses, plus the leader groups where ``rank`` is a leader)."""
        return dict(self.roles[rank])


def default_embedding_stages(topology: Topology) -> list[int]:
    """Stages holding a copy of the word embedding: megatron's first and last pipeline stage,
    or only stage 0 where it also holds the head (one stage, or the U-shape's edge)."""
    if topology.num_stages == 1 or topology.u_shape:
        return [0]
    return [0, topology.num_stages - 1]


def check_stages(topology: Topology, stages, default, what: str) -> list[int]:
    """``stages`` (or ``default``) as sorted stage indices of ``topology``, else refused."""
    stages = list(default if stages is None else stages)
    if not stages or any(not 0 <= s < topology.num_stages for s in stages):
        raise ConfigError(f"{what} stages {stages} must be stage indices of the "
                          f"{topology.num_stages}-stage cluster")
    return sorted(set(stages))


def rank_plan(topology: Topology, *, embedding_stages: Optional[Sequence[int]] = None,
              position_embedding_stages: Optional[Sequence[int]] = None,
              nodes: Optional[Sequence[str]] = None) -> RankPlan:
    """The plan of ``topology``. ``embedding_stages`` / ``position_embedding_stages``: the
    stages of megatron's embedding groups (default: :func:`default_embedding_stages`, and
    stage 0); ``nodes``: every rank's node, where fan-out depends on it (default: one node)."""
    emb = check_stages(topology, embedding_stages, default_embedding_stages(topology),
                       "embedding")
    pos = check_stages(topology, position_embedding_stages, [0], "position embedding")
    groups = _stage_groups(topology)
    groups += (_vdp_leader_groups(topology) if topology.is_vdp
               else _leader_groups(topology, emb, pos))
    groups += _cross_stage_groups(topology, emb, pos)
    roles = _roles(topology, groups)
    return RankPlan(tuple(groups), _routes(topology, nodes), roles, tuple(emb), tuple(pos))


def _boundary_name(a: int, b: int, ra: int, rb: int) -> str:
    return f"boundary:{a}->{b}:r{ra}-{rb}"


def _fanout_name(a: int, b: int, d: int) -> str:
    return f"fanout:{a}->{b}:r{d}"


def _stage_groups(topo: Topology) -> list[GroupSpec]:
    """Inside a stage: the group of one of every rank (context parallel size 1), TP groups,
    expert groups, data-parallel groups (+ a gloo twin where the native backend is not gloo,
    as megatron's distributed optimizer expects) and TP x DP groups."""
    out = [GroupSpec(f"cp:{r}", "cp", (r,), backend_for(topo.rank_info(r).device), local=True)
           for r in range(topo.world_size)]
    replicas = [(d, s) for d in range(topo.dp) for s in topo.stages if d < topo.dp_of(s.index)]
    out += [GroupSpec(f"tp:s{s.index}:r{d}", "tp", topo.stage_ranks(s.index, d),
                      backend_for(s.device)) for d, s in replicas]
    for d, s in replicas:  # experts where the stage has ep > 1 (Topology.expert_groups)
        if s.ep == 1:
            continue
        ep_groups, etp_groups = topo.expert_groups(s.index, d)
        out += [GroupSpec(f"ep:s{s.index}:r{d}:{j}", "ep", tuple(g), backend_for(s.device))
                for j, g in enumerate(ep_groups)]
        out += [GroupSpec(f"expt_tp:s{s.index}:r{d}:{k}", "expt_tp", tuple(g),
                          backend_for(s.device))
                for k, g in enumerate(etp_groups if s.etp > 1 else [])]
    for s in topo.stages:
        backend = backend_for(s.device)
        for t in range(s.tp):
            ranks = topo.dp_ranks(s.index, t)
            out.append(GroupSpec(f"dp:s{s.index}:t{t}", "dp", ranks, backend))
            if backend != "gloo":
                out.append(GroupSpec(f"dp_gloo:s{s.index}:t{t}", "dp_gloo", ranks, "gloo"))
        if topo.dp_of(s.index) > 1:
            ranks = tuple(r for d in range(topo.dp_of(s.index))
                          for r in topo.stage_ranks(s.index, d))
            out.append(GroupSpec(f"tp_dp:s{s.index}", "tp_dp", ranks, backend))
    return out


def _leader_groups(topo: Topology, emb: list[int], pos: list[int]) -> list[GroupSpec]:
    """Per replica: its leaders (gloo: scalars and the cross-stage groups' host leg), the
    embedding copies' leaders, a group per directed boundary holding the two leaders (one
    FIFO channel per direction even where prev == next, on NCCL too, which ignores tags), and
    where a leader may send to every TP rank across, one holding both stages."""
    out = []
    fanout = topo.fanout_boundaries()
    for d in range(topo.dp):
        out.append(GroupSpec(f"leaders:r{d}", "leaders", topo.leaders(d), "gloo"))
        for role, stages in (("emb_leaders", emb), ("pos_leaders", pos)):
            if len(stages) > 1:
                out.append(GroupSpec(f"{role}:r{d}", role,
                                     tuple(topo.leader(s, d) for s in stages), "gloo"))
        for b in topo.boundaries():
            pair = tuple(sorted({topo.leader(b.src_stage, d), topo.leader(b.dst_stage, d)}))
            out.append(GroupSpec(_boundary_name(b.src_stage, b.dst_stage, d, d), "boundary",
                                 pair, b.backend))
        for b in fanout:
            both = tuple(sorted({*topo.stage_ranks(b.src_stage, d),
                                 *topo.stage_ranks(b.dst_stage, d)}))
            out.append(GroupSpec(_fanout_name(b.src_stage, b.dst_stage, d), "fanout", both,
                                 b.backend))
    return out


def _vdp_leader_groups(topo: Topology) -> list[GroupSpec]:
    """Per-stage DP (ldt.boundary.lane_communicator): every replica's leaders, replica 0's leaders (the
    host leg of megatron's gradient statistics, each stage counted once), and one two-leader
    group per routed replica pair of a boundary, so each pair keeps its own FIFO channel."""
    every = sorted(topo.leader(s, r) for s in range(topo.num_stages) for r in range(topo.dp_of(s)))
    out = [GroupSpec("leaders:all", "leaders", tuple(every), "gloo"),
           GroupSpec("replica0_leaders", "replica0_leaders",
                     tuple(topo.leader(s, 0) for s in range(topo.num_stages)), "gloo")]
    for b in topo.boundaries():
        a, z = b.src_stage, b.dst_stage
        for ra, rz in boundary_pairs(topo.dp_of(a), topo.dp_of(z), topo.dp):
            pair = tuple(sorted({topo.leader(a, ra), topo.leader(z, rz)}))
            out.append(GroupSpec(_boundary_name(a, z, ra, rz), "boundary", pair, b.backend))
    return out


def _cross_stage_groups(topo: Topology, emb: list[int], pos: list[int]) -> list[GroupSpec]:
    """The groups megatron runs collectives on that span stages (ldt.groups.cross_stage); ranks:
    those holding one (replica ``d``'s ranks see replica ``d`` of the uniform run)."""
    out = []
    for d in range(topo.dp):
        def held(stages):
            return tuple(r for s in stages if d < topo.dp_of(s) for r in topo.stage_ranks(s, d))

        every = range(topo.num_stages)
        out += [GroupSpec(f"ldt_pp_{d}", "pp", held(every), CROSS_STAGE),
                GroupSpec(f"ldt_embd_{d}", "embd", held(emb), CROSS_STAGE),
                GroupSpec(f"ldt_pos_embd_{d}", "pos_embd", held(pos), CROSS_STAGE),
                GroupSpec(f"ldt_mp_{d}", "mp", held(every), CROSS_STAGE)]
    world = tuple(range(topo.world_size))
    if topo.dp > 1:  # every replica: the distributed optimizer's instance group
        out.append(GroupSpec("ldt_dist_opt", "dist_opt", world, CROSS_STAGE))
    if topo.is_vdp:  # the gradient statistics, every stage counted once
        out.append(GroupSpec("ldt_vdp_grad_stats", "grad_stats", world, CROSS_STAGE))
    return [g for g in out if g.ranks]


_SHARED_ROLES = ("boundary", "fanout")  # a rank can be in several of these


def _roles(topo: Topology, groups: list[GroupSpec]) -> tuple:
    """Per rank, role -> its group's name, with megatron's stand-ins where ldt builds no
    group: expert parallelism of one rank is the rank alone, expert TP is the rank alone or
    the TP group, the gloo twin is the group itself, TP x DP without DP is TP, and the
    distributed optimizer's instance with one replica is the replica."""
    roles: list[dict[str, str]] = [{} for _ in range(topo.world_size)]
    for g in groups:
        if g.role not in _SHARED_ROLES:
            for r in g.ranks:
                roles[r][g.role] = g.name
    for r, mine in enumerate(roles):
        etp = topo.stages[topo.rank_info(r).stage].etp
        mine.setdefault("ep", mine["cp"])
        mine.setdefault("expt_tp", mine["cp"] if etp == 1 else mine["tp"])
        mine.setdefault("dp_gloo", mine["dp"])
        mine.setdefault("tp_dp", mine["tp"])
        mine.setdefault("dist_opt", mine["mp"])
    return tuple(tuple(sorted(m.items())) for m in roles)


def _routes(topo: Topology, nodes: Optional[Sequence[str]]) -> tuple[Route, ...]:
    """Both directions of every directed boundary, for every replica pair it routes."""
    fan = {(b.src_stage, b.dst_stage) for b in topo.fanout_boundaries()}
    out = []
    for b in topo.boundaries():
        a, z = b.src_stage, b.dst_stage
        pairs = (boundary_pairs(topo.dp_of(a), topo.dp_of(z), topo.dp) if topo.is_vdp
                 else [(d, d) for d in range(topo.dp)])
        for ra, rz in pairs:
            both = topo.stage_ranks(a, ra) + topo.stage_ranks(z, rz)
            common = dict(boundary=(a, z), group=_boundary_name(a, z, ra, rz),
                          backend=b.backend, host_staged=b.host_staged, delay_ms=b.delay_ms,
                          fanout_group=_fanout_name(a, z, ra) if (a, z) in fan else None,
                          fanout_mode=topo.boundary_fanout,
                          same_node=nodes is None or len({nodes[r] for r in both}) == 1)
            for direction, (s, t, rs, rt) in ((FORWARD, (a, z, ra, rz)),
                                               (BACKWARD, (z, a, rz, ra))):
                out.append(Route(direction=direction, src_stage=s, dst_stage=t,
                                 src_replica=rs, dst_replica=rt, src_rank=topo.leader(s, rs),
                                 dst_rank=topo.leader(t, rt),
                                 receivers=topo.stage_ranks(t, rt),
                                 senders=topo.stage_ranks(s, rs), **common))
    return tuple(out)


# megatron-core name -> the role of the plan group it is (None: no such group in ldt). Names
# starting with "_" are megatron.core.parallel_state globals (those naming RANKS take the
# group's members as this rank sees them); the others are ProcessGroupCollection fields.
MEGATRON_NAMES: dict[str, Optional[str]] = {
    "_TENSOR_MODEL_PARALLEL_GROUP": "tp", "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": "tp",
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": "tp",  # context parallel size is 1
    "_PIPELINE_MODEL_PARALLEL_GROUP": "pp", "_PIPELINE_GLOBAL_RANKS": "pp",
    "_DATA_PARALLEL_GROUP": "dp", "_DATA_PARALLEL_GROUP_GLOO": "dp_gloo",
    "_DATA_PARALLEL_GLOBAL_RANKS": "dp", "_DATA_PARALLEL_GROUP_WITH_CP": "dp",
    "_DATA_PARALLEL_GROUP_WITH_CP_GLOO": "dp_gloo", "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": "dp",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": "dp",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": "dp_gloo",
    "_TENSOR_AND_DATA_PARALLEL_GROUP": "tp_dp", "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "tp_dp",
    "_MODEL_PARALLEL_GROUP": "mp", "_MODEL_PARALLEL_GLOBAL_RANKS": "mp",
    "_CONTEXT_PARALLEL_GROUP": "cp", "_CONTEXT_PARALLEL_GLOBAL_RANKS": "cp",
    # experts, per stage (Topology.expert_groups): expert-parallel and expert-TP ranks
    # together are the stage's TP group, the expert data-parallel group is the dense one, the
    # expert x tensor x pipeline group is the replica; one distributed optimizer instance
    "_EXPERT_MODEL_PARALLEL_GROUP": "ep", "_EXPERT_MODEL_PARALLEL_RANKS": "ep",
    "_EXPERT_TENSOR_PARALLEL_GROUP": "expt_tp", "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "tp",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": "mp",
    "_EXPERT_DATA_PARALLEL_GROUP": "dp", "_EXPERT_DATA_PARALLEL_GROUP_GLOO": "dp_gloo",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": "dp",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO": "dp_gloo",
    "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": None,
    "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": "dist_opt",
    # word embedding (tied with the head) and position embedding: no group where this rank
    # holds no copy, as megatron; the member lists are set on every rank of the replica
    "_EMBEDDING_GROUP": "embd", "_EMBEDDING_GLOBAL_RANKS": "embd",
    "_POSITION_EMBEDDING_GROUP": "pos_embd", "_POSITION_EMBEDDING_GLOBAL_RANKS": "pos_embd",
    # ProcessGroupCollection (schedules, models, DDP, finalize_model_grads, the optimizer)
    "tp": "tp", "pp": "pp", "cp": "cp", "tp_cp": "tp", "embd": "embd", "pos_embd": "pos_embd",
    "dp": "dp", "dp_cp": "dp", "intra_dp_cp": "dp", "tp_dp_cp": "tp_dp", "mp": "mp",
    "ep": "ep", "expt_tp": "expt_tp", "tp_ep": "tp", "tp_ep_pp": "mp", "expt_dp": "dp",
    "intra_expt_dp": "dp", "intra_dist_opt": "dist_opt",
}
