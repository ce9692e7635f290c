"""How one message crosses a stage boundary into a stage of several TP ranks: whole, in pieces
the receiving leader relays as they arrive, or fanned out, a copy straight to every TP rank
across, shared by the sending stage's ranks. Pure policy, decided alike at both ends from the
same facts: :class:`ldt.topology.routes.Route` asks it for its messages,
:mod:`ldt.boundary.communicator` carries out what it says and :mod:`ldt.plan.cost` prices it.
No torch here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

# How a message reaches every TP rank of the stage across (ldt.boundary.relay carries it out,
# ldt.plan.cost prices it). Relayed in k pieces it costs about link(n) + relay(n) / k + k *
# (one message's overhead); the best k grows as sqrt(n). PIECE_UNIT_BYTES is where a second
# piece starts to pay on loopback gloo (bench/RESULTS.md, p2p_boundary); MAX_PIECES bounds the
# messages.
PIECE_UNIT_BYTES = 128 * 1024
MAX_PIECES = 16
# Between nodes a message this small costs about a message's latency on a datacenter link
# (64 KiB: ~50 us at 10 Gbit/s), so a copy per TP rank beats a relay hop there.
CROSS_NODE_FANOUT_BYTES = 64 * 1024

WHOLE, PIECES, FANOUT = "whole", "pieces", "fanout"


def piece_count(nbytes: int, unit_bytes: int = PIECE_UNIT_BYTES) -> int:
    """The pieces a relayed message of ``nbytes`` crosses in (1: whole)."""
    return max(1, min(MAX_PIECES, round(math.sqrt(nbytes / unit_bytes))))


def fanout_boundary(mode: str, src_tp: int, dst_tp: int, per_stage_dp: bool) -> bool:
    """Whether a boundary gets a group spanning both stages, so that its messages may fan out
    (:func:`fans_out` then decides per message): ``cluster.boundary_fanout`` not ``never``,
    a stage with TP > 1, and not per-stage DP, whose replicas meet through their leaders."""
    return mode != "never" and not per_stage_dp and max(src_tp, dst_tp) > 1


def fans_out(mode: str, same_node: bool, nbytes: int) -> bool:
    """Whether a message of ``nbytes`` goes from the sending stage straight to every TP rank
    across a boundary whose stages do (``same_node``) or do not share a node, under
    ``cluster.boundary_fanout``; else one copy crosses and the receiving leader relays it."""
    if mode == "always":
        return True
    return mode == "auto" and (same_node or nbytes <= CROSS_NODE_FANOUT_BYTES)


@dataclass(frozen=True)
class Carry:
    """How one message crosses: ``kind`` is WHOLE, PIECES (``pieces`` of them, relayed as
    they arrive) or FANOUT (a copy to every TP rank across, no relay; ``copies``: the most
    one sending rank posts, back to back)."""

    kind: str
    pieces: int = 1
    copies: int = 1


def carry(nbytes: int, receivers: int, *, mode: str, same_node: bool,
          fanout_group: bool = True, unit_bytes: int = PIECE_UNIT_BYTES,
          senders: int = 1) -> Carry:
    """The transport of a message of ``nbytes`` into a stage of ``receivers`` TP ranks
    (``fanout_group``: a group spanning both stages exists, so fan-out is possible;
    ``senders``: the sending stage's ranks that each hold the whole message and share the
    fan-out's copies, :func:`fanout_sources`)."""
    if fanout_group and receivers > 1 and fans_out(mode, same_node, nbytes):
        return Carry(FANOUT, copies=math.ceil(receivers / max(1, senders)))
    k = piece_count(nbytes, unit_bytes)
    return Carry(WHOLE if k == 1 else PIECES, k)


def fanout_sources(senders: Sequence[int], receivers: int, whole_on_every_sender: bool
                   ) -> tuple[int, ...]:
    """Per TP rank across (in order), the rank that sends it its fan-out copy. Where every
    sending rank holds the whole message (no sequence parallelism: a stage's boundary tensor
    is replicated over its TP ranks, which megatron's own p2p relies on too), the sending
    ranks take the copies in turn, TP rank i to TP rank i as megatron pairs them: one copy each
    between two stages of equal TP, instead of all of them from the leader. Else the leader,
    which gathered the sequence, sends every copy."""
    if not whole_on_every_sender:
        senders = senders[:1]
    return tuple(senders[j % len(senders)] for j in range(receivers))
