"""cluster.link_delay_ms and boundary errors in ldt.boundary, without processes.

torch.distributed's isend/irecv/broadcast are replaced by fakes whose irecv "arrives" at a
chosen time, so the delivery rule is checked on the clock: a message is delivered no earlier
than ``max(arrival + delay, post + 2 * delay)`` (one-way delay; gloo's rendezvous for a
receive posted after the sender was ready), the sender never waits, and a receiver that
computes meanwhile does not wait again. (tests/test_hosts.py runs it for real across hosts.)
"""

from __future__ import annotations

import dataclasses
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from ldt.boundary import communicator as p2p
from ldt.config import ConfigError
from ldt.groups.parallel_state import StagePipelineGroup
from ldt.topology.routes import rank_plan
from ldt.topology.ranks import Topology

DELAY = 0.15  # seconds
SLACK = DELAY / 2  # a pause of pytest's process (its GC) is no delay of the link's
CONFIG = SimpleNamespace(pipeline_dtype=torch.float32, virtual_pipeline_model_parallel_size=None,
                         sequence_parallel=False, variable_seq_lengths=False)


def _state(rank, delay_ms, tps=(1, 2, 1)):
    topo = Topology.from_config({"stages": [{"name": n, "tp": t} for n, t in
                                            zip(("edge", "cloud0", "cloud1"), tps)],
                                 "u_shape": True, "link_delay_ms": delay_ms})
    info = topo.rank_info(rank)
    plan = rank_plan(topo)  # without fan-out: the relay through the receiving leader
    plan = dataclasses.replace(plan, routes=tuple(dataclasses.replace(r, fanout_group=None)
                                                  for r in plan.routes))
    return SimpleNamespace(topology=topo, info=info, stage=info.stage, is_leader=info.is_leader,
                           stage_ranks=topo.stage_ranks(info.stage), tp_group=object(),
                           pp_group=StagePipelineGroup(info.stage, topo.num_stages,
                                                       topo.leaders()),
                           plan=plan, named_groups={g.name: object() for g in plan.groups})


class FakeNet:
    """irecv completes ``arrive_after`` s after it is posted (or raises ``fail``)."""

    def __init__(self):
        self.arrive_after, self.fail, self.waits = 0.0, None, 0

    def irecv(self, tensor, src, group=None, tag=0):
        due = time.monotonic() + self.arrive_after

        def wait():
            self.waits += 1
            time.sleep(max(0.0, due - time.monotonic()))
            if self.fail:
                raise RuntimeError(self.fail)
            tensor.fill_(3.0)

        return SimpleNamespace(wait=wait)

    def isend(self, tensor, dst, group=None, tag=0):
        return SimpleNamespace(wait=lambda: None)

    def broadcast(self, tensor, src, group=None):
        pass


@pytest.fixture
def net(monkeypatch):
    fake = FakeNet()
    for name in ("isend", "irecv", "broadcast"):
        monkeypatch.setattr(p2p.dist, name, getattr(fake, name))
    return fake


def _receive(comm, peer, direction=p2p.FORWARD):
    posted = time.monotonic()
    tensor, work = comm.recv((2, 1, 4), peer, direction)
    return posted, tensor, work


@pytest.mark.parametrize("arrive_after,expected", [
    (0.02, 2 * DELAY),            # the sender was ready first: a round trip from the post
    (3 * DELAY, 4 * DELAY),       # the sender was late: one-way delay after its message
])
def test_delivered_no_earlier_than_the_link_allows(net, arrive_after, expected):
    comm = p2p.VtpCommunicator(CONFIG, _state(0, [DELAY * 1e3, 0, DELAY * 1e3]))
    net.arrive_after = arrive_after
    posted, tensor, work = _receive(comm, 2)  # edge <- cloud1: a delayed boundary
    work.wait()
    took = time.monotonic() - posted
    assert expected <= took < expected + SLACK, took
    assert torch.all(tensor == 3.0) and net.waits == 1  # a gloo work is waited exactly once


def test_receiver_work_overlaps_the_delay_and_the_sender_never_waits(net):
    comm = p2p.VtpCommunicator(CONFIG, _state(0, DELAY * 1e3))
    t0 = time.monotonic()
    work = comm.send(torch.ones(2, 1, 4), 1, p2p.FORWARD)
    work.wait()
    assert time.monotonic() - t0 < SLACK  # sending is never delayed
    net.arrive_after = 0.01
    posted, _, work = _receive(comm, 2)
    time.sleep(3 * DELAY)  # the receiver computes meanwhile; the message is long due
    t1 = time.monotonic()
    work.wait()
    assert time.monotonic() - t1 < SLACK


def test_undelayed_boundaries_start_no_thread(net):
    comm = p2p.VtpCommunicator(CONFIG, _state(1, [0, 0, 50]))  # cloud0: its links are 0 ms
    before = threading.active_count()
    _, _, work = _receive(comm, 0)
    assert work._delay is None and threading.active_count() == before
    t0 = time.monotonic()
    work.wait()
    assert time.monotonic() - t0 < SLACK


@pytest.mark.parametrize("delay_ms", [0, 20])
def test_a_failed_receive_names_the_boundary_stages_and_peer(net, delay_ms):
    net.fail = "Timed out waiting 5000ms for recv operation to complete"
    comm = p2p.VtpCommunicator(CONFIG, _state(0, delay_ms))
    _, _, work = _receive(comm, 1, p2p.BACKWARD)
    with pytest.raises(p2p.BoundaryError) as err:
        work.wait()
    text = str(err.value)
    assert text.startswith("boundary 0->1: rank 0 (stage 0 'edge') receive of a gradient from "
                           "stage 1 'cloud0' (rank 1) failed"), text
    assert net.fail in text


def test_a_non_leader_names_its_leader(net, monkeypatch):
    def broken(tensor, src, group=None):
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(p2p.dist, "broadcast", broken)
    comm = p2p.VtpCommunicator(CONFIG, _state(2, 0))  # TP rank 1 of cloud0
    _, _, work = _receive(comm, 0)
    with pytest.raises(p2p.BoundaryError, match=r"boundary 0->1: rank 2 \(stage 1 'cloud0'\) "
                       r"receive \(through its stage leader, rank 1\) of an activation from "
                       r"stage 0 'edge' \(rank 0\)"):
        work.wait()


def test_link_delay_config():
    stages = [{"name": "edge"}, {"name": "cloud0", "tp": 2}, {"name": "cloud1"}]
    topo = Topology.from_config({"stages": stages, "u_shape": True, "link_delay_ms": [4, 0, 4]})
    assert [b.delay_ms for b in topo.boundaries()] == [4.0, 0.0, 4.0]
    assert "0->1:native+4ms delay, 1->2:native, 2->0:native+4ms delay" in topo.rank_map()
    assert Topology.from_config({"stages": stages, "link_delay_ms": 0}).link_delay_ms == ()
    plain = Topology.from_config({"stages": stages, "link_delay_ms": [1, 2]})  # no return path
    assert plain.link_delay_ms == (1.0, 2.0, 0.0)
    for bad, match in [([1, 2], "has 2 entries"), ([1, -1, 0], "entry 1"),
                       ("5", "give a number"), (True, "not a boolean")]:
        with pytest.raises(ConfigError, match=match):
            Topology.from_config({"stages": stages, "u_shape": True, "link_delay_ms": bad})
