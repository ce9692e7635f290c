"""Fan-in / fan-out at stage boundaries with per-stage data parallelism (VDP).

Nothing new on the wire: a message still goes leader to leader over its boundary's own group
and is broadcast in the receiving stage's TP group (:class:`ldt.p2p.VtpCommunicator`). What
changes is *which* leader: micro-batch ``g`` runs on replica ``g mod dp_s`` of every stage
(:mod:`ldt.schedule.routing`), so a replica of a stage with fewer replicas sends to (fan-out)
and receives from (fan-in) several replicas of its neighbour, in turn, each pair on its own
two-leader group (so every pair keeps its own FIFO channel, as a uniform boundary does).

* :func:`vdp_leader_groups` creates those groups (called by
  :func:`ldt.parallel_state.initialize_vtp`, collectively, in the same order on every rank),
  plus one gloo group of every replica's leaders for the cross-stage scalars (grad norm).
* :class:`LaneCommunicator` lets the runtime talk in lanes (the schedule's peers) and turns a
  peer lane into (stage, replica) for the VtpCommunicator.
* :class:`LaneData` feeds a data stage's replica the micro-batches routing gives it: micro-batch
  ``g`` is read as the uniform run's replica ``g mod D`` reads its micro-batch ``g // D``, on
  the data stage's own replica (data and labels never cross a boundary).
"""

from __future__ import annotations

import copy
from typing import Iterator, Optional

from ldt.schedule.routing import Lanes, boundary_pairs, virtual_of


def vdp_leader_groups(topology, new_group, mine: dict, boundary_groups: dict) -> None:
    """Create the per-stage-DP leader groups; fill ``mine['leaders']`` (every replica's
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


def counts_in_norm(state) -> bool:
    """Whether this rank's stage total enters the cross-stage grad norm: with per-stage DP the
    norm is summed over every replica's leaders (one group), and after the DP all-reduce all
    replicas of a stage hold the same gradient, so replica 0 alone counts."""
    return not state.topology.is_vdp or state.info.dp_rank == 0


class LaneCommunicator:
    """The runtime's ``comm`` for a lane schedule: peers are lanes, not stages."""

    def __init__(self, comm, stage_dp: tuple[int, ...]):
        self.comm, self.lanes = comm, Lanes(tuple(stage_dp))
        self.layout = comm.layout  # the stage's boundary layout (sequence-parallel shards)

    def send(self, tensor, peer_lane: int, direction: str):
        stage, replica = self.lanes.of(peer_lane)
        return self.comm.send(tensor, stage, direction, peer_replica=replica)

    def recv(self, shape, peer_lane: int, direction: str):
        stage, replica = self.lanes.of(peer_lane)
        return self.comm.recv(shape, stage, direction, peer_replica=replica)


class LaneData:
    """A data stage replica's micro-batches under per-stage DP, in the order it runs them.

    ``data`` is the stage's uniform-DP data object (``dp`` = the largest stage dp); a shallow
    copy per uniform replica ``v`` (``dp_rank = v``) reads what that replica would read.
    """

    def __init__(self, data, microbatches: list[int], dp_max: int):
        self.microbatches, self.dp_max = list(microbatches), dp_max
        self._replicas = {}
        for g in self.microbatches:
            v, _ = virtual_of(g, dp_max)
            if v not in self._replicas:
                self._replicas[v] = copy.copy(data)
                self._replicas[v].dp_rank = v

    def _of(self, g: int):
        v, j = virtual_of(g, self.dp_max)
        return self._replicas[v], j

    def step_iterator(self, step: int) -> Iterator[dict]:
        return (rep.batch(step, j) for rep, j in map(self._of, self.microbatches))

    def eval_iterator(self) -> Iterator[dict]:
        return (rep.eval_batch(j) for rep, j in map(self._of, self.microbatches))


def lane_of(state) -> Optional[int]:
    """This rank's lane id (None without per-stage DP)."""
    topo = state.topology
    if not topo.is_vdp:
        return None
    return Lanes(tuple(topo.dp_sizes)).lane(state.stage, state.info.dp_rank)
