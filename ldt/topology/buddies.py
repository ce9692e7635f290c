"""Where a stage's snapshot survives its host: each stage's buddy, pure data beside the rank plan.

Every stage's state is snapshotted by its writer (the leader of its first replica,
:func:`ldt.training.checkpoint.writes`) into its own host's memory
(:mod:`ldt.training.snapshot`). To survive the loss of that host, the state must also be held
on another host. :func:`snapshot_buddies` says, per stage, by whom:

- ``replica``: another host runs a data-parallel replica of the stage; it holds the same
  weights and optimizer state already, so no copy travels (``holder``: that replica's leader);
- ``copy``: the writer's snapshot is copied to ``holder``, a rank on the next cloud host in a
  ring of the cloud hosts (sorted by name), as every rank's part is (:func:`copy_holders`),
  so every cloud host holds one neighbour's copies and a lost host's state is one host away;
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
    return _plan(topology, nodes, owner)[0]


def copy_holders(topology: Topology, nodes: Sequence[str], owner: Optional[str] = None,
                 sharded: bool = False) -> dict[int, int]:
    """Which rank keeps a copy of each rank's own snapshot part (``{writer: holder}``; a rank
    absent needs none): every rank of a ``copy`` stage sends its part to a rank of the next
    cloud host after its own in the ring (spread over that host's ranks), so every cloud host
    holds the parts of the host before it, one host's worth of copies however a stage's TP
    ranks are spread over hosts. With ``sharded`` (the distributed optimizer: each DP rank
    holds a span of the optimizer state of its own) a replica on another host holds the
    weights but not this rank's span, so ``replica`` stages copy to the replica's host too.
    ``edge`` and ``alone`` stages copy nowhere."""
    buddies, out = _plan(topology, nodes, owner)
    for buddy in buddies:
        if buddy.why != REPLICA or not sharded:
            continue
        holder_host = nodes[buddy.holder]
        for host, writers in ((holder_host, _ranks_of(topology, buddy.stage,
                                                      lambda r: nodes[r] != holder_host)),
                              (nodes[buddy.writer], _ranks_of(topology, buddy.stage,
                                                              lambda r: nodes[r] == holder_host))):
            on_host = [r for r in range(topology.world_size) if nodes[r] == host]
            for i, writer in enumerate(writers):  # the second: a replica's own spans
                out[writer] = on_host[i % len(on_host)]
    return out


def _plan(topology: Topology, nodes: Sequence[str],
          owner: Optional[str]) -> tuple[tuple[Buddy, ...], dict[int, int]]:
    """Every stage's :class:`Buddy`, and the holder of every rank of a ``copy`` stage."""
    if len(nodes) != topology.world_size:
        raise ConfigError(f"snapshot buddies: {len(nodes)} node names for a world of "
                          f"{topology.world_size} ranks; give one per rank")
    if owner is not None and owner not in nodes:
        raise ConfigError(f"snapshot buddies: the data owner's node {owner!r} holds no rank "
                          f"(nodes: {sorted(set(nodes))})")
    cloud = sorted({n for n in nodes if n != owner})
    kinds = []  # (why, holder) per stage; a copy stage's holder follows from the ring
    for stage in range(topology.num_stages):
        writer = topology.leader(stage, 0)
        replicas = [topology.leader(stage, d) for d in range(topology.dp_of(stage))]
        elsewhere = [r for r in replicas if nodes[r] != nodes[writer]]
        if owner is not None and _ranks_of(topology, stage, lambda r: nodes[r] == owner):
            kinds.append((EDGE, None))
        elif elsewhere:
            kinds.append((REPLICA, elsewhere[0]))
        else:
            kinds.append((COPY, None) if len(cloud) > 1 else (ALONE, None))
    senders = [r for stage, (why, _) in enumerate(kinds) if why == COPY
               for r in _ranks_of(topology, stage, lambda r: True)]
    ring = _ring(topology, nodes, cloud, sorted(senders))
    buddies = tuple(Buddy(stage, topology.leader(stage, 0),
                          ring[topology.leader(stage, 0)] if why == COPY else holder, why)
                    for stage, (why, holder) in enumerate(kinds))
    return buddies, ring


def _ring(topology: Topology, nodes: Sequence[str], cloud: Sequence[str],
          senders: Sequence[int]) -> dict[int, int]:
    """The holder of each of ``senders`` (ranks on cloud hosts; ``cloud``: the cloud hosts'
    names, sorted, at least two): a rank of the next cloud host after its own in the ring,
    the parts a host receives spread over its ranks in rank order."""
    placed: dict[str, int] = {}  # host -> parts given to its ranks so far
    out = {}
    for rank in senders:
        after = cloud[(cloud.index(nodes[rank]) + 1) % len(cloud)]
        on_host = [r for r in range(topology.world_size) if nodes[r] == after]
        out[rank] = on_host[placed.get(after, 0) % len(on_host)]
        placed[after] = placed.get(after, 0) + 1
    return out


def _ranks_of(topology: Topology, stage: int, where) -> list[int]:
    return [r for d in range(topology.dp_of(stage)) for r in topology.stage_ranks(stage, d)
            if where(r)]
