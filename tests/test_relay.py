"""A boundary tensor in pieces (ldt.boundary.relay): the piece plan, the relay and the gather
played rank by rank in one process, and one real world.

The relay and the gather run on :class:`Wires`, a stand-in for torch.distributed's isend /
irecv that carries the bytes between the simulated ranks of a stage (a message is what was
sent when it was sent; a receive waited before its message was sent is a deadlock in a real
world and fails here). The expected bytes are slices of one random tensor, cut by hand.

The world (tests/relay_worlds.py, 4 gloo processes) sends tensors of one piece and of five
across a TP 1 -> TP 3 boundary both ways, with and without sequence parallelism, host staging
and a send transform, and every rank checks the bytes it holds and what the observers saw.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from ldt.boundary import relay
from ldt.boundary.sequence import SequenceLayout
from ldt.boundary.relay import PieceGather, PieceRelay, owners, pieces
from ldt.topology.transport import MAX_PIECES
from ldt.launch.local import run_local_world
from relay_worlds import SHAPES, relay_cases


def test_small_messages_go_whole_and_large_ones_in_more_pieces():
    assert pieces(6 * 4, 4) == [(0, 24)]
    assert pieces(32 * 1024, 4) == [(0, 32 * 1024)]  # 128 KiB
    counts = [len(pieces(n // 4, 4)) for n in (2**20, 8 * 2**20, 32 * 2**20, 2**30)]
    assert counts == [3, 8, MAX_PIECES, MAX_PIECES]


@pytest.mark.parametrize("numel", [7, 1000, 2**20 + 3, 3 * 2**21])
def test_pieces_cover_the_message_once_in_order(numel):
    bounds = pieces(numel, 4)
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a < b for a, b in bounds)
    assert all(bounds[k][1] == bounds[k + 1][0] for k in range(len(bounds) - 1))


def test_owners_split_a_piece_at_the_slice_edges():
    # slices of 10 elements: piece [8, 25) is rank 0's [8, 10), rank 1's all, rank 2's [20, 25)
    assert owners(10, 8, 25) == [(0, 8, 10), (1, 10, 20), (2, 20, 25)]
    assert owners(10, 10, 20) == [(1, 10, 20)]


def test_an_empty_message_is_one_empty_piece():
    assert pieces(0, 4) == [(0, 0)]
    assert pieces(10, 4, unit_bytes=4) == [(0, 4), (4, 8), (8, 10)]  # sqrt(40 / 4) -> 3


def test_the_world_sends_in_pieces():
    counts = [len(pieces(s * b * h, 4)) for s, b, h in SHAPES]
    assert counts == [1, 5]  # else the world below does not exercise the relay


@pytest.mark.timeout(180)
def test_relayed_pieces_arrive_whole_on_every_rank():
    results = run_local_world(4, relay_cases, timeout_s=150)
    assert results == [[]] * 4, [w for r in results for w in r]


# ---- the relay and the gather, rank by rank on simulated wires ------------------------------
class Wires:
    """isend / irecv between simulated ranks: ``me`` is the rank making the calls. Messages
    of one (src, dst, tag) match receives in posting order, as gloo's do. Every call must name
    the stage's TP group (``GROUP``: a stage's own group has its device's backend, the world
    group need not), and every send must be waited (a send's buffer is in use until then)."""

    def __init__(self):
        self.me = None
        self.sent = defaultdict(list)  # (src, dst, tag) -> tensors, as they were when sent
        self.posted = defaultdict(int)  # receives posted per (src, dst, tag)
        self.taken = defaultdict(int)
        self.unwaited = set()  # sends not waited yet
        self.log = []  # ("isend" | "irecv" | "wait", src, dst, tag, numel) in call order

    def isend(self, tensor, dst, group=None, tag=0):
        assert group is GROUP, f"isend to {dst} over {group!r}, not the stage's TP group"
        key = (self.me, dst, tag)
        self.sent[key].append(tensor.detach().clone())
        self.log.append(("isend", *key, tensor.numel()))
        ticket = (key, len(self.sent[key]))
        self.unwaited.add(ticket)
        return SimpleNamespace(wait=lambda: self.unwaited.discard(ticket))

    def irecv(self, tensor, src, group=None, tag=0):
        assert group is GROUP, f"irecv from {src} over {group!r}, not the stage's TP group"
        key = (src, self.me, tag)
        slot = self.posted[key]
        self.posted[key] += 1
        self.log.append(("irecv", *key, tensor.numel()))

        def wait():
            if slot >= len(self.sent[key]):
                raise AssertionError(f"receive {key} #{slot} waited before it was sent")
            msg = self.sent[key][slot]
            assert msg.shape == tensor.shape, (key, msg.shape, tensor.shape)
            tensor.copy_(msg)
            self.taken[key] += 1
            self.log.append(("wait", *key, tensor.numel()))

        return SimpleNamespace(wait=wait)

    def all_taken(self) -> bool:
        """Every message received, every send waited."""
        return not self.unwaited and all(self.taken[k] == len(v) for k, v in self.sent.items())


GROUP = object()  # the stage's TP group


@pytest.fixture
def wires(monkeypatch):
    w = Wires()
    monkeypatch.setattr(relay.dist, "isend", w.isend)
    monkeypatch.setattr(relay.dist, "irecv", w.irecv)
    return w


class Arrival:
    """A piece's irecv on the receiving leader: waiting it lands the piece in ``buf``."""

    def __init__(self, buf, src, a, b, log):
        self.buf, self.src, self.a, self.b, self.log = buf, src, a, b, log

    def wait(self):
        self.buf.view(-1)[self.a:self.b].copy_(self.src.view(-1)[self.a:self.b])
        self.log.append(("arrived", self.a, self.b))


RANKS = [10, 11, 12]  # the stage's global ranks, leader first
SHAPE = (12, 1, 5)  # 60 elements: a sequence of 12 in thirds of 4 (20 elements a slice)
BOUNDS = [(0, 13), (13, 26), (26, 39), (39, 52), (52, 60)]  # pieces cutting through slices


def _relay(wires, layout, whole, staged=False, delayed=()):
    """Every rank of a TP 3 stage relays ``whole`` from its leader, in pieces ``BOUNDS``; the
    leader's pieces land as its arrivals are waited (``delayed``: pieces the link delay's
    helper already waited, given as None). Returns each rank's tensor; ``wires.log`` has the
    arrivals ("arrived", start, stop) among the calls."""
    sharded = layout.sharded
    out = {r: torch.full(whole.shape if not sharded else (4, 1, 5), -1.0) for r in RANKS}
    full = torch.full(whole.shape, -1.0) if sharded else None
    host = torch.full(whole.shape, -1.0) if staged else None
    land = host if staged else full if sharded else out[RANKS[0]]
    arrivals = []
    for k, (a, b) in enumerate(BOUNDS):
        arrival = Arrival(land, whole, a, b, wires.log)
        if k in delayed:
            arrival.wait()
            arrival = None
        arrivals.append(arrival)
    for tp_rank, rank in enumerate(RANKS):  # the leader first: its sends are on the wires
        wires.me = rank
        r = PieceRelay(BOUNDS, layout, out[rank], full if tp_rank == 0 else None,
                       host if tp_rank == 0 else None, GROUP, RANKS, tp_rank)
        r.run(arrivals if tp_rank == 0 else [None] * len(BOUNDS))
    assert wires.all_taken(), "a relayed message nobody received"
    return out


@pytest.mark.parametrize("staged", [False, True])
def test_relay_broadcasts_every_piece_to_every_rank(wires, staged):
    whole = torch.randn(SHAPE)
    out = _relay(wires, SequenceLayout(3), whole, staged=staged, delayed={1})
    for rank in RANKS:
        assert torch.equal(out[rank], whole), rank
    # the leader sends piece k to each other rank, in piece order, once it arrived
    sends = [(e[2], e[4]) for e in wires.log if e[0] == "isend"]
    assert sends == [(r, b - a) for a, b in BOUNDS for r in RANKS[1:]]
    arrived = [e for e in wires.log if e[0] == "arrived"]
    assert [(a, b) for _, a, b in arrived] == [BOUNDS[1], BOUNDS[0], *BOUNDS[2:]]


def test_relay_sends_each_piece_after_it_arrived(wires):
    whole = torch.randn(SHAPE)
    _relay(wires, SequenceLayout(3), whole)
    order = [("arrived", e[1]) if e[0] == "arrived" else ("sent", e[2]) for e in wires.log
             if e[0] in ("arrived", "isend")]
    # arrival of piece k precedes its two sends, which precede the next arrival
    expect = [x for a, _ in BOUNDS for x in (("arrived", a), ("sent", 11), ("sent", 12))]
    assert order[:len(expect)] == expect


@pytest.mark.parametrize("staged", [False, True])
def test_relay_scatters_the_sequence_slices(wires, staged):
    """Sequence parallelism: each rank ends with its third of the sequence, the pieces' edges
    (13, 26, ...) not on the slices' (20, 40)."""
    whole = torch.randn(SHAPE)
    out = _relay(wires, SequenceLayout(3, sequence_parallel=True), whole, staged=staged)
    for tp_rank, rank in enumerate(RANKS):
        assert torch.equal(out[rank], whole[4 * tp_rank:4 * (tp_rank + 1)]), rank
    # only the parts inside a rank's slice travel to it: 40 of the 60 elements leave the leader
    assert sum(e[4] for e in wires.log if e[0] == "isend") == 40


def test_gather_assembles_the_slices_piece_by_piece(wires):
    whole = torch.randn(SHAPE, dtype=torch.float64)  # not the default dtype
    layout = SequenceLayout(3, sequence_parallel=True)
    for tp_rank in (1, 2):  # the others send their parts first (and wait them)
        wires.me = RANKS[tp_rank]
        g = PieceGather(BOUNDS, layout, whole[4 * tp_rank:4 * (tp_rank + 1)], GROUP, RANKS,
                        tp_rank)
        assert g.whole is None
        assert not wires.unwaited, "a rank's gather returned before its sends completed"
    wires.me = RANKS[0]
    g = PieceGather(BOUNDS, layout, whole[:4], GROUP, RANKS, 0)
    assert g.whole.shape == SHAPE and g.whole.dtype == torch.float64
    flat = g.whole.view(-1)
    assert torch.equal(flat[:20], whole.view(-1)[:20])  # the leader's own slice, at once
    waited = 0
    for k, (a, b) in enumerate(BOUNDS):
        g.wait_piece(k)
        assert torch.equal(flat[:b], whole.view(-1)[:b]), k  # piece k complete now
        now = sum(1 for e in wires.log if e[0] == "wait")
        assert now > waited or b <= 20, k  # a piece beyond the leader's slice waited parts
        waited = now
        g.wait_piece(k)  # twice: nothing left to wait
        assert sum(1 for e in wires.log if e[0] == "wait") == waited
    assert wires.all_taken()
    # each part crossed once: 40 elements from ranks 1 and 2, none from the leader to itself
    assert sum(e[4] for e in wires.log if e[0] == "isend") == 40
    assert {e[1] for e in wires.log if e[0] == "isend"} == {11, 12}


def test_gather_builds_the_whole_tensor_on_the_slices_device(wires):
    """The leader's whole tensor is where its slices are (an accelerator's on a GPU stage);
    torch's meta device stands in for one here."""
    wires.me = RANKS[0]
    local = torch.empty((4, 1, 5), device="meta")
    g = PieceGather(BOUNDS, SequenceLayout(3, sequence_parallel=True), local, GROUP, RANKS, 0)
    assert g.whole.device.type == "meta" and g.whole.shape == SHAPE
