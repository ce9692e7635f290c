"""A boundary tensor in pieces (ldt.boundary.relay): the piece plan, and one real world.

The world (tests/relay_worlds.py, 4 gloo processes) sends tensors of one piece and of five
across a TP 1 -> TP 3 boundary both ways, with and without sequence parallelism, host staging
and a send transform, and every rank checks the bytes it holds and what the observers saw.
"""

from __future__ import annotations

import pytest

from ldt.boundary.relay import owners, pieces
from ldt.device import MAX_PIECES
from ldt.launch import run_local_world
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


def test_the_world_sends_in_pieces():
    counts = [len(pieces(s * b * h, 4)) for s, b, h in SHAPES]
    assert counts == [1, 5]  # else the world below does not exercise the relay


@pytest.mark.timeout(180)
def test_relayed_pieces_arrive_whole_on_every_rank():
    results = run_local_world(4, relay_cases, timeout_s=150)
    assert results == [[]] * 4, [w for r in results for w in r]
