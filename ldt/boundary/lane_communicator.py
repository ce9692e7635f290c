"""The hop between replicas of neighbouring stages with per-stage data parallelism (VDP).

Nothing new on the wire: a message still goes leader to leader over its boundary's own group
and is broadcast in the receiving stage's TP group (:mod:`ldt.boundary.communicator`). What
changes is *which* leader: micro-batch ``g`` runs on replica ``g mod dp_s`` of every stage
(:mod:`ldt.schedule.routing`), so a replica of a stage with fewer replicas sends to (fan-out)
and receives from (fan-in) several replicas of its neighbour, in turn, each pair on its own
two-leader group (so every pair keeps its own FIFO channel, as a uniform boundary does;
:func:`ldt.groups.parallel_state.initialize_vtp` creates those groups). A data stage's replica reads
its micro-batches through :class:`ldt.data.lane_data.LaneData`.

* :class:`LaneCommunicator` lets the runtime talk in lanes (the schedule's peers) and turns a
  peer lane into (stage, replica) for the VtpCommunicator.
"""

from __future__ import annotations

from typing import Optional

from ldt.schedule.routing import Lanes


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


def lane_of(state) -> Optional[int]:
    """This rank's lane id (None without per-stage DP)."""
    topo = state.topology
    if not topo.is_vdp:
        return None
    return Lanes(tuple(topo.dp_sizes)).lane(state.stage, state.info.dp_rank)
