"""Where a stage's snapshot survives its host: each stage's buddy, pure data beside the rank plan.

Every stage's state is snapshotted by its writer (the leader of its first replica,
:func:`ldt.training.checkpoint.writes`) into its own host's memory
(:mod:`ldt.training.snapshot`). To survive the loss of that host, the state must also be held
on another host. :func:`snapshot_buddies` says, per stage, by whom:

- ``replica``: another host runs a data-parallel replica of the stage; it holds the same
  weights and optimizer state already, so no copy travels (``holder``: that replica's leader);
- ``copy``: the writer's snapshot is copied to ``holder``, a rank on the next cloud host in a
  ring of the cloud hosts (sorted by name), so every cloud host holds one neighbour's copies
  and a lost host's state is one host away;
- ``edge``: the stage lives (also) on the data owner's host: its layers, embedding and head
  are what a curious cloud would need to invert the activations (``ldt-audit``), so its
  snapshots stay on that host and no cloud host is ever a holder (``holder`` None);
- ``alone``: no other cloud host to hold a copy (``holder`` None).

No cloud stage's copy goes to the data owner's host either: it is the host whose loss ends
the run anyway, and a holder there would make it the cloud's store. Like the rank plan it
needs no torch and no process (tests/test_buddies.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ldt.config import ConfigError
from ldt.topology.ranks import Topology

REPLICA, COPY, EDGE, ALONE = "replica", "copy", "edge", "alone"


@dataclass(frozen=True)
class Buddy:
    """Who keeps stage ``stage``'s state when the host of its ``writer`` is lost."""

    stage: int
    writer: int
    holder: Optional[int]
    why: str  # REPLICA | COPY | EDGE | ALONE


def snapshot_buddies(topology: Topology, nodes: Sequence[str],
                     owner: Optional[str] = None) -> tuple[Buddy, ...]:
    """One :class:`Buddy` per stage. ``nodes``: every rank's node (host) name, by rank;
    ``owner``: the data owner's node (the U-shape's edge; None: no data owner, every host is
    a cloud host)."""
    if len(nodes) != topology.world_size:
        raise ConfigError(f"snapshot buddies: {len(nodes)} node names for a world of "
                          f"{topology.world_size} ranks; give one per rank")
    if owner is not None and owner not in nodes:
        raise ConfigError(f"snapshot buddies: the data owner's node {owner!r} holds no rank "
                          f"(nodes: {sorted(set(nodes))})")
    cloud = sorted({n for n in nodes if n != owner})
    out = []
    for stage in range(topology.num_stages):
        writer = topology.leader(stage, 0)
        replicas = [topology.leader(stage, d) for d in range(topology.dp_of(stage))]
        ranks = [r for d in range(topology.dp_of(stage)) for r in topology.stage_ranks(stage, d)]
        if owner is not None and any(nodes[r] == owner for r in ranks):
            out.append(Buddy(stage, writer, None, EDGE))
            continue
        elsewhere = [r for r in replicas if nodes[r] != nodes[writer]]
        if elsewhere:
            out.append(Buddy(stage, writer, elsewhere[0], REPLICA))
            continue
        others = [n for n in cloud if n != nodes[writer]]
        if not others:
            out.append(Buddy(stage, writer, None, ALONE))
            continue
        after = [n for n in others if n > nodes[writer]]  # the next host in the ring
        host = (after or others)[0]
        on_host = [r for r in range(topology.world_size) if nodes[r] == host]
        out.append(Buddy(stage, writer, on_host[stage % len(on_host)], COPY))
    return tuple(out)


def copy_holders(topology: Topology, nodes: Sequence[str], owner: Optional[str] = None,
                 sharded: bool = False) -> dict[int, int]:
    """Which rank keeps a copy of each rank's own snapshot part (``{writer: holder}``; a rank
    absent needs none): every rank of a ``copy`` stage sends its part to a rank of its
    stage's buddy host (spread over that host's ranks). With ``sharded`` (the distributed
    optimizer: each DP rank holds a span of the optimizer state of its own) a replica on
    another host holds the weights but not this rank's span, so ``replica`` stages copy to
    the replica's host too. ``edge`` and ``alone`` stages copy nowhere."""
    out = {}
    for buddy in snapshot_buddies(topology, nodes, owner):
        if buddy.why not in (COPY, REPLICA) or (buddy.why == REPLICA and not sharded):
            continue
        for host, writers in ((nodes[buddy.holder], _ranks_of(topology, buddy.stage, nodes,
                                                              lambda n: n != nodes[buddy.holder])),
                              (nodes[buddy.writer], _ranks_of(topology, buddy.stage, nodes,
                                                              lambda n: n == nodes[buddy.holder]))):
            on_host = [r for r in range(topology.world_size) if nodes[r] == host]
            for i, writer in enumerate(writers):  # the second: a sharded replica's own spans
                out[writer] = on_host[i % len(on_host)]
    return out


def _ranks_of(topology: Topology, stage: int, nodes: Sequence[str], where) -> list[int]:
    return [r for d in range(topology.dp_of(stage)) for r in topology.stage_ranks(stage, d)
            if where(nodes[r])]
