"""The second hop of a boundary transfer: none where it costs more than a copy per TP rank
(fan-out), else pipelined with the first (a large tensor in pieces).

A transfer into a stage of TP > 1 has two hops: the leader link (one copy, leader to leader)
and the receiving stage's relay (the leader's broadcast or, with sequence parallelism, its
scatter); a sequence-parallel sender also gathers on its leader before the link. One after the
other, a stage pays both hops in full where megatron's uniform pipeline pays one (every TP
rank's own copy crosses in parallel). So a large message crosses as pieces: the receiving
leader relays piece k while piece k+1 is still arriving, and a gathering leader puts piece k
on the link while piece k+1 is still being gathered. Inside the stage the pieces go point to
point (the leader's isend to each TP rank: what gloo's broadcast from it does, without a trip
through the process group's worker thread per piece), posted at ``wait()`` by every rank in
the same order, as the broadcast was.

Pieces are contiguous element ranges of the whole tensor in its row-major order, so the link
carries the same bytes in the same order as one message would; both leaders (and every rank
of a stage) compute the same pieces from the element count alone. A small message stays one
piece: there latency dominates and every piece costs a message's overhead, and a one-piece
transfer makes the same calls as a whole message.

Fan-out (``cluster.boundary_fanout``, :meth:`ldt.topology.routes.Route.transport`): the sending
stage sends a copy straight to every TP rank of the receiving stage (its TP ranks in turn, each
holding the whole tensor, whose send transforms draw alike: the same bytes; a sequence-parallel
stage's leader), which then needs no relay, at the price of a copy per TP rank on the link.
Where the two stages share a node the link is memory (or the node's accelerator fabric) as the
relay is, so one hop wins at every size (bench/RESULTS.md, p2p_boundary); between nodes only a
small message, whose time is latency rather than bytes, is worth the copies. The sender does not
know whether the receiving stage splits the sequence (a TP 1 stage's config says no), so it
sends the whole tensor; a sequence-parallel rank keeps its slice
(:class:`ldt.boundary.work.RecvWork`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ldt.boundary.sequence import SequenceLayout
from ldt.topology.routes import GATHER_TAG, RELAY_TAG
from ldt.topology.transport import PIECE_UNIT_BYTES, piece_count


def pieces(numel: int, element_size: int, unit_bytes: int = PIECE_UNIT_BYTES
           ) -> list[tuple[int, int]]:
    """The element ranges ``[(start, stop)]`` a message of ``numel`` elements crosses in."""
    return split(numel, piece_count(numel * element_size, unit_bytes))


def split(numel: int, count: int) -> list[tuple[int, int]]:
    """``numel`` elements as ``count`` contiguous ranges (the last may be shorter)."""
    step = -(-numel // count) if numel else 1
    return [(a, min(a + step, numel)) for a in range(0, max(numel, 1), step)]


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """The one-dimensional view pieces index (the tensors here are made contiguous)."""
    return tensor.detach().view(-1)


def owners(shard: int, start: int, stop: int) -> list[tuple[int, int, int]]:
    """``[(tp_rank, lo, hi)]``: the parts of piece ``[start, stop)`` held by each TP rank of a
    sequence-parallel stage whose ranks hold ``shard`` consecutive elements each."""
    return [(i, max(start, i * shard), min(stop, (i + 1) * shard))
            for i in range(start // shard, -(-stop // shard))]


class PieceRelay:
    """A receiving stage's relay, piece by piece (:meth:`run` on every rank of the stage).

    ``out``: this rank's tensor (its sequence slice if ``layout.sharded``); ``full``: the
    leader's whole tensor where the stage is sharded; ``staged``: the leader's host buffer of a
    host-staged link; ``ranks``: the stage's global ranks in TP order (the leader, TP rank 0,
    first); ``tp_rank``: this rank's place in them.
    """

    def __init__(self, bounds, layout: SequenceLayout, out: torch.Tensor,
                 full: Optional[torch.Tensor], staged: Optional[torch.Tensor], group, ranks,
                 tp_rank: int):
        self.bounds, self.layout, self.group, self.ranks = bounds, layout, group, list(ranks)
        self.tp_rank, self.is_leader, self.staged = tp_rank, tp_rank == 0, staged
        self.out = flat(out)
        self.whole = flat(full) if full is not None else self.out
        self.shard = self.out.numel()  # a sharded stage: the elements of one slice

    def run(self, arrivals: list) -> None:
        """The leader waits piece k's ``arrivals[k]`` (None: already waited) and relays it;
        every other rank receives its share of every piece."""
        if not self.is_leader:
            works = [w for a, b in self.bounds for w in self._take(a, b)]
        else:
            works = []
            for (a, b), arrival in zip(self.bounds, arrivals):
                if arrival is not None:
                    arrival.wait()
                if self.staged is not None:
                    self.whole[a:b].copy_(flat(self.staged)[a:b])
                works += self._give(a, b)
        for w in works:
            w.wait()

    def _parts(self, a: int, b: int) -> list[tuple[int, int, int]]:
        """``[(tp_rank, lo, hi)]``: what of piece ``[a, b)`` each rank gets (all of it, or
        with sequence parallelism the part inside its slice; offsets in the whole tensor)."""
        if not self.layout.sharded:
            return [(i, a, b) for i in range(self.layout.tp)]
        return owners(self.shard, a, b)

    def _give(self, a: int, b: int) -> list:
        works = []
        for i, lo, hi in self._parts(a, b):
            if i == 0:
                if self.whole is not self.out:  # the leader's own slice
                    self.out[lo:hi].copy_(self.whole[lo:hi])
            else:
                works.append(dist.isend(self.whole[lo:hi], dst=self.ranks[i], group=self.group,
                                        tag=RELAY_TAG))
        return works

    def _take(self, a: int, b: int) -> list:
        base = self.tp_rank * self.shard if self.layout.sharded else 0
        return [dist.irecv(self.out[lo - base:hi - base], src=self.ranks[0], group=self.group,
                           tag=RELAY_TAG)
                for i, lo, hi in self._parts(a, b) if i == self.tp_rank]


class PieceGather:
    """A sequence-parallel sending stage's gather, piece by piece: on the leader, the whole
    tensor fills as its ranks' parts arrive (:meth:`wait_piece` before a piece goes on the
    link); another rank sends its parts and waits for them (as ``dist.gather`` would)."""

    def __init__(self, bounds, layout: SequenceLayout, local: torch.Tensor, group, ranks,
                 tp_rank: int):
        self.bounds, self.whole = bounds, None
        local = local.detach().contiguous()
        part, shard = flat(local), local.numel()
        ranks = list(ranks)
        self._arrivals: list[list] = [[] for _ in bounds]
        if tp_rank:
            me = tp_rank
            works = [dist.isend(part[lo - me * shard:hi - me * shard], dst=ranks[0],
                                group=group, tag=GATHER_TAG)
                     for a, b in bounds for i, lo, hi in owners(shard, a, b) if i == me]
            for w in works:
                w.wait()
            return
        self.whole = torch.empty(layout.full_shape(local.shape), dtype=local.dtype,
                                 device=local.device)
        whole = flat(self.whole)
        whole[:shard].copy_(part)  # the leader's own slice (TP rank 0: the first)
        for k, (a, b) in enumerate(bounds):
            for i, lo, hi in owners(shard, a, b):
                if i:
                    self._arrivals[k].append(dist.irecv(whole[lo:hi], src=ranks[i],
                                                        group=group, tag=GATHER_TAG))

    def wait_piece(self, k: int) -> None:
        for w in self._arrivals[k]:
            w.wait()
        self._arrivals[k] = []
