"""The stage-boundary transport (ldt/boundary/communicator.py, lanes.py) call by call.

No processes: torch.distributed's point-to-point and collective calls are replaced by a
recorder (``Wire``), so each test can say exactly which call a transfer makes: to which global
rank, on which group, with which tag and which values, and in which order the waits run. The
expected ranks, groups and tags are written out by hand from the rank map (cpu_demo: stage 0 =
rank 0, stage 1 = ranks 1-2, stage 2 = rank 3) and the rules in docs/design.md: only leaders
cross a boundary, activations travel along the boundary's arrow and gradients against it, tag
1 for activations and 2 for gradients.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from ldt.boundary import communicator as comm_mod
from ldt.boundary import functional
from ldt.boundary import sequence as layout_mod
from ldt.boundary import work as work_mod
from ldt.boundary.communicator import BACKWARD, FORWARD, SendTransform, VtpCommunicator
from ldt.boundary.lane_communicator import LaneCommunicator, lane_of
from ldt.config import ClusterConfig, ConfigError, StageConfig
from ldt.groups.parallel_state import StagePipelineGroup
from ldt.topology.routes import rank_plan
from ldt.topology.ranks import Topology


class Wire:
    """Records torch.distributed calls; a receive delivers ``100 * src + tag`` (so the test sees
    which sender and channel a tensor came from), a shape receive delivers ``shape_in``."""

    def __init__(self):
        self.calls, self.shape_in, self.fail, self.fail_wait = [], None, None, None
        self.sent, self.targets = [], []  # the tensors isend / irecv were handed

    def _handle(self, label):
        def wait():
            if self.fail_wait:
                raise self.fail_wait
            self.calls.append(label)

        return SimpleNamespace(wait=wait, is_completed=lambda: True)

    def isend(self, tensor, dst, group=None, tag=0):
        if self.fail:
            raise self.fail
        self.calls.append(("isend", dst, group, tag, tensor.detach().clone()))
        self.sent.append(tensor)
        return self._handle(("isend.wait", dst, tag))

    def irecv(self, tensor, src, group=None, tag=0):
        if self.fail:
            raise self.fail
        self.calls.append(("irecv", src, group, tag, tuple(tensor.shape)))
        self.targets.append(tensor)

        def wait():
            if self.fail_wait:
                raise self.fail_wait
            tensor.fill_(100.0 * src + tag)
            self.calls.append(("irecv.wait", src, tag))

        return SimpleNamespace(wait=wait, is_completed=lambda: True)

    def recv(self, tensor, src, group=None, tag=0):  # a shape message
        if self.fail:
            raise self.fail
        tensor.copy_(torch.tensor(self.shape_in, dtype=tensor.dtype, device=tensor.device))
        self.calls.append(("recv", src, group, tag, tensor.device.type))

    def gather(self, tensor, gather_list=None, dst=0, group=None):
        self.calls.append(("gather", dst, group, tuple(tensor.shape)))
        for i, part in enumerate(gather_list or []):
            part.fill_(float(i + 1))  # TP rank i's slice holds i + 1

    def scatter(self, tensor, scatter_list=None, src=0, group=None):
        self.calls.append(("scatter", src, group, [tuple(p.shape) for p in scatter_list or []]))
        if scatter_list:
            tensor.detach().copy_(scatter_list[0])

    def broadcast(self, tensor, src, group=None):
        self.calls.append(("broadcast", src, group, tuple(tensor.shape)))

    def get_backend(self, group):
        return "gloo"

    def ops(self):
        return [c[0] for c in self.calls]


@pytest.fixture
def wire(monkeypatch):
    w = Wire()
    for module in (comm_mod, layout_mod, work_mod):
        for name in ("isend", "irecv", "recv", "broadcast", "get_backend", "gather", "scatter"):
            if hasattr(module.dist, name):
                monkeypatch.setattr(module.dist, name, getattr(w, name))
    return w


class Group:
    """A process group stand-in, readable in assertion messages."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"<group {self.name}>"


_GROUPS: dict = {}


def G(*key):
    """The group object of boundary ``key`` (one per key, as ldt.groups.parallel_state builds them)."""
    return _GROUPS.setdefault(key, Group(f"boundary {key}"))


TP_GROUP = Group("tp")


def state(rank, tps=(1, 2, 1), u_shape=True, dps=None, devices=None):
    """A rank's VTP state as ldt.groups.parallel_state builds it, with named groups (no world);
    ``devices``: the stages' device types (default: every stage on the CPU)."""
    devices = devices or ["cpu"] * len(tps)
    stages = [StageConfig(f"s{i}", devices[i], t, None if dps is None else dps[i])
              for i, t in enumerate(tps)]
    topo = Topology.from_config(ClusterConfig(stages=stages, u_shape=u_shape))
    info = topo.rank_info(rank)
    return SimpleNamespace(topology=topo, info=info, stage=info.stage, is_leader=info.is_leader,
                           stage_ranks=topo.stage_ranks(info.stage, info.dp_rank),
                           tp_group=TP_GROUP,
                           pp_group=StagePipelineGroup(info.stage, topo.num_stages,
                                                       topo.leaders()),
                           plan=plan_of(topo, dps),  # fan-out: tests/test_p2p_handles.py
                           named_groups=named_groups(topo, dps))


def plan_of(topo, dps=None):
    """The topology's rank plan, with fan-out off (the relay; fan-out is test_p2p_handles')."""
    plan = rank_plan(topo)
    return dataclasses.replace(plan, routes=tuple(dataclasses.replace(r, fanout_group=None)
                                                  for r in plan.routes))


def named_groups(topo, dps=None):
    """Each boundary's leader group as ``G(src, dst)`` (``G(src, dst, ra, rb)`` per replica
    pair with per-stage DP), by its name in the plan."""
    return {r.group: G(*r.boundary, *((r.src_replica, r.dst_replica) if dps else ()))
            for r in rank_plan(topo).routes if r.direction == FORWARD}


def config(**kw):
    base = dict(pipeline_dtype=torch.float32, virtual_pipeline_model_parallel_size=None,
                sequence_parallel=False, variable_seq_lengths=False, timers=None)
    return SimpleNamespace(**{**base, **kw})


# ---- who talks to whom ----------------------------------------------------------------------

def test_a_leader_sends_to_the_peer_leader_on_the_boundary_group(wire):
    comm = VtpCommunicator(config(), state(0))  # the edge, stage 0
    t = torch.full((2, 1, 4), 3.0)
    comm.send(t, 1, FORWARD)  # its output, to stage 1 (leader: rank 1), boundary 0->1
    comm.send(t * 2, 2, BACKWARD)  # its input's gradient, back along the wraparound 2->0
    assert [c[:4] for c in wire.calls] == [("isend", 1, G(0, 1), 1), ("isend", 3, G(2, 0), 2)]
    assert torch.equal(wire.calls[0][4], t) and torch.equal(wire.calls[1][4], t * 2)
    assert wire.sent[0].is_contiguous()


def test_a_leader_receives_then_broadcasts_in_its_stage(wire):
    comm = VtpCommunicator(config(), state(1))  # stage 1's leader, TP 2
    act, work = comm.recv((2, 1, 4), 0, FORWARD)
    grad, work2 = comm.recv((2, 1, 4), 2, BACKWARD)
    assert wire.calls == [("irecv", 0, G(0, 1), 1, (2, 1, 4)), ("irecv", 3, G(1, 2), 2, (2, 1, 4))]
    work.wait()
    work2.wait()
    assert wire.calls[2:] == [("irecv.wait", 0, 1), ("broadcast", 1, TP_GROUP, (2, 1, 4)),
                              ("irecv.wait", 3, 2), ("broadcast", 1, TP_GROUP, (2, 1, 4))]
    assert torch.all(act == 1.0) and torch.all(grad == 302.0)  # from rank 0 tag 1, rank 3 tag 2


def test_megatrons_methods_wait_in_order_and_return_the_tensors(wire):
    comm = VtpCommunicator(config(), state(0))
    out = torch.ones(2, 1, 4)
    assert comm.send_forward(out, is_last_stage=False) is None
    assert wire.ops() == ["isend", "isend.wait"]
    wire.calls.clear()
    grad = comm.send_forward_recv_backward(out, (2, 1, 4), is_last_stage=False)
    # the receive is waited before the send: recv_prev, recv_next, send_next, send_prev
    assert [c[:2] for c in wire.calls] == [("isend", 1), ("irecv", 1), ("irecv.wait", 1),
                                           ("isend.wait", 1)]
    assert torch.all(grad == 102.0)
    wire.calls.clear()
    act = comm.send_backward_recv_forward(out, (2, 1, 4), is_first_stage=False)
    assert [c[:2] for c in wire.calls] == [("isend", 3), ("irecv", 3), ("irecv.wait", 3),
                                           ("isend.wait", 3)]
    assert wire.calls[0][3] == 2 and torch.all(act == 301.0)
    wire.calls.clear()
    assert comm.send_backward(out, is_first_stage=False) is None
    assert wire.ops() == ["isend", "isend.wait"] and wire.calls[0][:4] == ("isend", 3, G(2, 0), 2)


def test_overlap_mode_hands_back_every_handle_unwaited(wire):
    comm = VtpCommunicator(config(), state(0))
    prev, nxt, handles = comm._communicate(tensor_send_next=torch.ones(2),
                                           tensor_send_prev=torch.ones(2), recv_prev=True,
                                           recv_next=True, tensor_shape=(2,), wait_on_reqs=False)
    assert sorted(handles) == ["recv_next", "recv_prev", "send_next", "send_prev"]
    assert "isend.wait" not in wire.ops() and "irecv.wait" not in wire.ops()
    handles["recv_prev"].wait()
    handles["send_prev"].wait()
    assert torch.all(prev == 301.0)  # from stage 2 (rank 3), an activation
    assert wire.calls[-1] == ("isend.wait", 3, 2)
    none = comm._communicate(tensor_send_next=None, tensor_send_prev=None, recv_prev=False,
                             recv_next=False, tensor_shape=None, wait_on_reqs=False)
    assert none == (None, None, {})


def test_a_non_leader_sends_nothing_and_receives_through_the_broadcast(wire):
    comm = VtpCommunicator(config(), state(2))  # TP rank 1 of stage 1
    assert comm.send(torch.ones(2), 2, FORWARD) is None
    comm.send_forward_recv_backward(torch.ones(2), (2,), False)
    assert wire.ops() == ["broadcast"] and wire.calls[0][1] == 1  # from its leader, rank 1


def test_the_attributes_megatrons_schedules_read(wire):
    comm = VtpCommunicator(config(virtual_pipeline_model_parallel_size=3), state(3))
    assert (comm.next_stage, comm.prev_stage, comm.next_rank, comm.prev_rank) == (0, 1, 0, 1)
    assert comm.virtual_pipeline_model_parallel_size == 3
    assert comm.pp_group.rank() == 2 and comm.pp_group.size() == 3
    assert comm.device == torch.device("cpu") and comm.config.pipeline_dtype is torch.float32


# ---- what crosses ---------------------------------------------------------------------------

def test_transforms_change_what_crosses_and_observers_see_it(wire):
    seen = []

    class Observer:
        def on_send(self, src, dst, direction, tensor):
            seen.append(("send", src, dst, direction, tensor.clone()))

        def on_recv(self, src, dst, direction, tensor):
            seen.append(("recv", src, dst, direction, tensor.clone()))

    noise = []

    class Shift(SendTransform):
        def __call__(self, tensor, src, dst, direction):
            noise.append((src, dst, direction))
            return tensor + 0.5

    comm = VtpCommunicator(config(), state(0), observers=[Observer()], send_transforms=[Shift()])
    comm.send(torch.zeros(3), 1, FORWARD)
    assert noise == [(0, 1, FORWARD)]
    assert torch.all(wire.calls[0][4] == 0.5)  # the peer gets the transformed tensor
    assert seen[0][:4] == ("send", 0, 1, FORWARD) and torch.all(seen[0][4] == 0.5)
    tensor, work = comm.recv((3,), 2, FORWARD)
    assert len(seen) == 1  # nothing is seen before the receive completes
    work.wait()
    assert seen[1][:4] == ("recv", 2, 0, FORWARD) and torch.all(seen[1][4] == 301.0)


def test_a_transform_without_skip_is_refused_when_the_communicator_is_made(wire):
    """Not later, on only the ranks that skip a message (those beside a stage's leader)."""
    with pytest.raises(TypeError, match=r"send_transforms: .*has no skip.*subclass of "
                                        r"ldt.boundary.communicator.SendTransform"):
        VtpCommunicator(config(), state(0), send_transforms=[lambda t, src, dst, d: t])


def test_variable_sequence_lengths_send_the_shape_first(wire):
    cfg = config(variable_seq_lengths=True)
    comm = VtpCommunicator(cfg, state(0))
    comm.send(torch.ones(5, 1, 4), 1, FORWARD)
    (op, dst, group, tag, shape_msg), payload = wire.calls[0], wire.calls[1]
    assert (op, dst, group, tag) == ("isend", 1, G(0, 1), layout_mod.SHAPE_TAGS[FORWARD])
    assert shape_msg.tolist() == [5, 1, 4] and payload[:4] == ("isend", 1, G(0, 1), 1)
    wire.calls.clear()
    wire.shape_in = [7, 1, 4]
    receiver = VtpCommunicator(cfg, state(1))  # stage 1, TP 2: the leader shares the shape
    tensor, work = receiver.recv((2, 1, 4), 0, FORWARD)
    assert wire.calls[0] == ("recv", 0, G(0, 1), layout_mod.SHAPE_TAGS[FORWARD], "cpu")
    assert wire.calls[1] == ("broadcast", 1, TP_GROUP, (3,))
    assert wire.calls[2] == ("irecv", 0, G(0, 1), 1, (7, 1, 4)) and tensor.shape == (7, 1, 4)


# ---- per-stage DP (VDP): which replica ------------------------------------------------------

def test_vdp_messages_go_to_the_peer_replica_on_that_pairs_group(wire):
    # plain pipeline, stage 0 with dp 1 (rank 0), stage 1 with dp 2 (ranks 1 and 2)
    comm = VtpCommunicator(config(), state(0, tps=(1, 1), u_shape=False, dps=(1, 2)))
    comm.send(torch.ones(2), 1, FORWARD, peer_replica=1)
    comm.send(torch.ones(2), 1, FORWARD)  # default: this rank's replica (0)
    comm.recv((2,), 1, BACKWARD, peer_replica=1)
    assert [c[:4] for c in wire.calls] == [("isend", 2, G(0, 1, 0, 1), 1),
                                           ("isend", 1, G(0, 1, 0, 0), 1),
                                           ("irecv", 2, G(0, 1, 0, 1), 2)]
    wire.calls.clear()
    far = VtpCommunicator(config(), state(2, tps=(1, 1), u_shape=False, dps=(1, 2)))
    far.recv((2,), 0, FORWARD, peer_replica=0)  # replica 1 of stage 1 hears from replica 0
    far.send(torch.ones(2), 0, BACKWARD, peer_replica=0)
    assert [c[:4] for c in wire.calls] == [("irecv", 0, G(0, 1, 0, 1), 1),
                                           ("isend", 0, G(0, 1, 0, 1), 2)]


def test_lanes_turn_a_peer_lane_into_stage_and_replica():
    """Lanes are numbered stage-major: with stage dp (1, 2), lane 0 = stage 0, lanes 1 and 2 =
    stage 1's replicas 0 and 1."""
    calls = []
    fake = SimpleNamespace(layout="the layout",
                           send=lambda *a, **k: calls.append(("send", a, k)) or "sent",
                           recv=lambda *a, **k: calls.append(("recv", a, k)) or "received")
    lanes = LaneCommunicator(fake, [1, 2])
    assert lanes.layout == "the layout"
    assert lanes.send("t", 2, FORWARD) == "sent"
    assert lanes.recv((3,), 1, BACKWARD) == "received"
    assert lanes.send("g", 0, BACKWARD) == "sent"
    assert calls == [("send", ("t", 1, FORWARD), {"peer_replica": 1}),
                     ("recv", ((3,), 1, BACKWARD), {"peer_replica": 0}),
                     ("send", ("g", 0, BACKWARD), {"peer_replica": 0})]
    assert lane_of(state(0)) is None  # no per-stage DP
    assert lane_of(state(2, tps=(1, 1), u_shape=False, dps=(1, 2))) == 2
    assert lane_of(state(1, tps=(1, 1), u_shape=False, dps=(1, 2))) == 1
    # stage dp (2, 1): ranks replica-major (0 = stage 0 replica 0, 1 = stage 1, 2 = stage 0
    # replica 1); lanes stage-major (0, 1 = stage 0's replicas, 2 = stage 1)
    assert [lane_of(state(r, tps=(1, 1), u_shape=False, dps=(2, 1))) for r in range(3)] == \
        [0, 2, 1]


# ---- what a failure says ------------------------------------------------------------------

def test_failures_name_the_boundary_the_ranks_and_the_direction(wire):
    wire.fail = RuntimeError("connection reset")
    with pytest.raises(comm_mod.BoundaryError) as err:
        VtpCommunicator(config(), state(0)).send(torch.ones(2), 1, FORWARD)
    assert str(err.value).startswith("boundary 0->1: rank 0 (stage 0 's0') send of an "
                                     "activation to stage 1 's1' (rank 1)")
    assert "connection reset" in str(err.value)
    with pytest.raises(comm_mod.BoundaryError) as err:
        VtpCommunicator(config(), state(3)).recv((2,), 0, BACKWARD)
    assert str(err.value).startswith("boundary 2->0: rank 3 (stage 2 's2') receive of a "
                                     "gradient from stage 0 's0' (rank 0)")
    what = VtpCommunicator(config(), state(2))._describe("receive", 0, 1, FORWARD, 0)
    assert what == ("boundary 0->1: rank 2 (stage 1 's1') receive (through its stage leader, "
                    "rank 1) of an activation from stage 0 's0' (rank 0)")


def test_what_cannot_be_received_is_refused(wire):
    comm = VtpCommunicator(config(), state(0))
    with pytest.raises(RuntimeError, match="^tensor_shape must be given to receive at a VTP "
                                           "boundary$"):
        comm.recv(None, 2, FORWARD)
    no_dtype = VtpCommunicator(config(pipeline_dtype=None), state(0))
    with pytest.raises(ConfigError, match="^config.pipeline_dtype is None; set it to the "
                                          "model's params dtype$"):
        no_dtype.recv((2,), 2, FORWARD)
    with pytest.raises(ConfigError, match=r"^sequence_parallel=True with context_parallel_size "
                                          r"> 1: ldt's boundaries reshard the sequence over TP "
                                          r"only; set context_parallel_size=1$"):
        VtpCommunicator(config(sequence_parallel=True, context_parallel_size=2), state(1))
    # a config without sequence_parallel (the functional API's sends) has none
    bare = SimpleNamespace(pipeline_dtype=None, virtual_pipeline_model_parallel_size=None,
                           context_parallel_size=2)
    VtpCommunicator(bare, state(0))
    assert wire.calls == []


# ---- the reference implementation's functional API ----------------------------------------

def test_functional_sends_use_the_stage_boundary_by_default(wire, monkeypatch):
    monkeypatch.setattr(comm_mod, "get_vtp_state", lambda: state(1))
    handles = functional.vtp_send_forward(torch.ones(2))
    assert len(handles) == 1 and wire.calls[0][:4] == ("isend", 3, G(1, 2), 1)
    handles = functional.vtp_send_backward(torch.ones(2))
    assert len(handles) == 1 and wire.calls[1][:4] == ("isend", 0, G(0, 1), 2)
    t = functional.vtp_recv_forward((2,), config())
    assert torch.all(t == 1.0)  # waited: from rank 0, an activation
    t, handles = functional.vtp_recv_backward((2,), config(), async_op=True)
    assert list(handles) == ["recv_next"] and wire.calls[-1][:4] == ("irecv", 3, G(1, 2), 2)
    monkeypatch.setattr(comm_mod, "get_vtp_state", lambda: state(2))
    assert functional.vtp_send_forward(torch.ones(2)) is None  # not a leader


def test_functional_calls_over_groups_the_caller_built(wire, monkeypatch):
    monkeypatch.setattr(comm_mod, "get_vtp_state", lambda: state(1))
    g_a, g_b = Group("user a"), Group("user b")
    handles = functional.vtp_send_forward(torch.full((2,), 4.0), group=[g_a, g_b],
                                        next_rank=[3, 0])
    assert [c[:4] for c in wire.calls] == [("isend", 3, g_a, 1), ("isend", 0, g_b, 1)]
    assert len(handles) == 2 and all(torch.all(c[4] == 4.0) for c in wire.calls)
    wire.calls.clear()
    functional.vtp_send_backward(torch.ones(2), group=g_a, prev_rank=[0, 3])  # one group, twice
    assert [c[:4] for c in wire.calls] == [("isend", 0, g_a, 2), ("isend", 3, g_a, 2)]
    wire.calls.clear()
    t, handles = functional.vtp_recv_forward((2,), config(), async_op=True, group=[g_a, g_b],
                                           prev_rank=[0, 3])
    assert [c[:4] for c in wire.calls] == [("irecv", 0, g_a, 1), ("irecv", 3, g_b, 1)]
    handles["recv_prev"].wait()
    assert wire.calls[-1] == ("broadcast", 1, TP_GROUP, (2,))
    wire.calls.clear()
    pp = state(1).pp_group  # megatron's pipeline group means "ldt's own boundary"
    functional.vtp_send_forward(torch.ones(2), group=pp, next_rank=3)
    assert wire.calls[0][:4] == ("isend", 3, G(1, 2), 1)


def test_functional_calls_that_cannot_work_are_refused(wire, monkeypatch):
    monkeypatch.setattr(comm_mod, "get_vtp_state", lambda: state(1))
    with pytest.raises(ConfigError, match=r"^group= has 2 groups but the peer ranks are "
                                          r"\[3, 0, 3\]; give one rank per group$"):
        functional.vtp_send_forward(torch.ones(2), group=[Group("a"), Group("b")],
                                  next_rank=[3, 0, 3])
    with pytest.raises(ConfigError, match=r"^rank 2 is not a stage leader; stage boundaries run "
                                          r"between leaders \(get_vtp_stage_ranks\(\)\[stage\]"
                                          r"\[0\]\)$"):
        functional.vtp_send_forward(torch.ones(2), next_rank=2)
    with pytest.raises(ConfigError, match="^mix of ldt's pipeline group and other groups in "
                                          "group=; give only groups you built, or none$"):
        functional.vtp_recv_forward((2,), config(), group=[None, Group("a")], prev_rank=[0, 0])
    sp = config(sequence_parallel=True)
    with pytest.raises(ConfigError, match="^sequence_parallel=True with group=: ldt gathers the "
                                          "sequence only on its own stage boundaries; leave "
                                          "group= out$"):
        functional.vtp_send_forward(torch.ones(2, 1, 4), sp, group=[Group("a")], next_rank=[3])
    with pytest.raises(ConfigError, match=r"^sequence_parallel / variable_seq_lengths with "
                                          r"group=: ldt reshards and exchanges shapes only on its "
                                          r"own stage boundaries; leave group= out$"):
        functional.vtp_recv_forward((2,), config(variable_seq_lengths=True), group=[Group("a")],
                                  prev_rank=[0])
    assert wire.calls == []


# ---- buffers: dtype, device, sequence slices, link delay ------------------------------------

def test_receive_buffers_have_the_pipeline_dtype_and_the_stages_device(wire):
    """Made under a meta default device, so a buffer that forgot its device would show it."""
    cfg = config(pipeline_dtype=torch.bfloat16)
    with torch.device("meta"):
        tensor, work = VtpCommunicator(cfg, state(1)).recv((2, 1, 4), 0, FORWARD)
        staged, _ = VtpCommunicator(cfg, state(0, tps=(1, 1), u_shape=False)).recv(
            (2, 1, 4), 1, BACKWARD)
    assert (tensor.dtype, tensor.device.type, tensor.requires_grad) == (torch.bfloat16, "cpu",
                                                                        True)
    assert [(t.dtype, t.device.type) for t in wire.targets] == [(torch.bfloat16, "cpu")] * 2
    work.wait()
    assert torch.all(tensor == 1.0)


def test_host_staged_receives_land_in_a_host_buffer_of_the_pipeline_dtype(wire):
    staged_state = state(0)
    cfg = config(pipeline_dtype=torch.bfloat16, variable_seq_lengths=True)
    staged_state.plan = dataclasses.replace(staged_state.plan, routes=tuple(
        dataclasses.replace(r, host_staged=r.boundary == (2, 0))
        for r in staged_state.plan.routes))
    wire.shape_in = [6, 1, 4]
    with torch.device("meta"):
        tensor, work = VtpCommunicator(cfg, staged_state).recv((2, 1, 4), 2, FORWARD)
    assert wire.calls[0] == ("recv", 3, G(2, 0), layout_mod.SHAPE_TAGS[FORWARD], "cpu")
    target = wire.targets[0]
    assert (target.dtype, target.device.type, tuple(target.shape)) == (torch.bfloat16, "cpu",
                                                                       (6, 1, 4))
    assert target.data_ptr() != tensor.data_ptr()
    work.wait()
    assert torch.all(tensor == 301.0)  # copied from the host buffer


def test_the_shape_message_and_its_buffer_follow_the_payload(wire):
    with torch.device("meta"):
        work = VtpCommunicator(config(variable_seq_lengths=True), state(0)).send(
            torch.ones(5, 1, 4, device="cpu"), 1, FORWARD)
    shape_buf, payload = wire.sent
    assert shape_buf.device.type == "cpu" and shape_buf.tolist() == [5, 1, 4]
    assert work._keep_alive[0] is payload and work._keep_alive[1] is shape_buf
    work.wait()
    assert wire.ops()[-2:] == ["isend.wait", "isend.wait"]  # the shape's and the tensor's
    wire.calls.clear()
    wire.shape_in = [7, 1, 4]
    with torch.device("meta"):
        tensor, _ = VtpCommunicator(config(variable_seq_lengths=True), state(2)).recv(
            (2, 1, 4), 0, FORWARD)  # a non-leader: only the leader's shared shape
    assert wire.calls == [("broadcast", 1, TP_GROUP, (3,))] and tensor.device.type == "cpu"


def test_a_sequence_parallel_stage_gathers_before_sending_and_scatters_after_receiving(wire):
    cfg = config(sequence_parallel=True, pipeline_dtype=torch.bfloat16)
    sender = VtpCommunicator(cfg, state(1))  # stage 1's leader, TP 2: its slice is [2, 1, 4]
    sender.send(torch.zeros(2, 1, 4), 2, FORWARD)
    assert wire.calls[0] == ("gather", 1, TP_GROUP, (2, 1, 4))
    assert wire.calls[1][:4] == ("isend", 3, G(1, 2), 1)
    assert wire.calls[1][4].shape == (4, 1, 4)  # the whole sequence: rank 0's, then rank 1's
    assert wire.calls[1][4][:, 0, 0].tolist() == [1.0, 1.0, 2.0, 2.0]
    wire.calls.clear()
    with torch.device("meta"):
        tensor, work = VtpCommunicator(cfg, state(1)).recv((2, 1, 4), 0, FORWARD)
    full = wire.targets[-1]
    assert wire.calls == [("irecv", 0, G(0, 1), 1, (4, 1, 4))] and full.device.type == "cpu"
    assert full.dtype == tensor.dtype == torch.bfloat16
    assert tensor.shape == (2, 1, 4) and tensor.data_ptr() != full.data_ptr()
    work.wait()
    assert wire.calls[-1] == ("scatter", 1, TP_GROUP, [(2, 1, 4), (2, 1, 4)])
    assert torch.all(tensor == 1.0)
    wire.calls.clear()
    assert VtpCommunicator(cfg, state(2)).send(torch.zeros(2, 1, 4), 2, FORWARD) is None
    assert wire.calls == [("gather", 1, TP_GROUP, (2, 1, 4))]  # a non-leader gives its slice


def test_a_delayed_link_delivers_late_on_the_leader_only(wire):
    stages = [StageConfig("s0", "cpu", 1), StageConfig("s1", "cpu", 2)]
    topo = Topology.from_config(ClusterConfig(stages=stages, link_delay_ms=[20.0, 0.0]))
    leader, other = state(1, tps=(1, 2), u_shape=False), state(2, tps=(1, 2), u_shape=False)
    for st in (leader, other):
        st.plan = plan_of(topo)
    _, work = VtpCommunicator(config(), leader).recv((2,), 0, FORWARD)
    assert work._delay.delay_s == pytest.approx(0.020)
    _, work = VtpCommunicator(config(), other).recv((2,), 0, FORWARD)
    assert work._delay is None


@pytest.mark.parametrize("devices,tps,rank,local_rank,index", [
    # one GPU under ldt's launcher (LOCAL_RANK = rank): a CPU edge and cloud feed a CUDA
    # stage, rank 3, whose GPU is the node's first
    (("cpu", "cpu", "cuda"), (1, 2, 1), 3, "3", 0),
    # a CUDA edge (rank 0) and a CUDA stage after two CPU ranks: the node's second GPU
    (("cuda", "cpu", "cuda"), (1, 2, 1), 3, "3", 1),
    # torchrun, a node of 4 GPUs running ranks 4-7 of two TP-4 CUDA stages
    (("cuda", "cuda"), (4, 4), 6, "2", 2),
    # no LOCAL_RANK: every rank on this machine
    (("cpu", "cuda"), (1, 1), 1, None, 0)])
def test_a_stage_on_a_gpu_uses_its_nodes_accelerator(monkeypatch, devices, tps, rank,
                                                     local_rank, index):
    """The accelerator index is the rank's place among its node's ranks of its device type
    (CPU ranks take no GPU), worked out by hand from the rank map."""
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    stages = [StageConfig(f"s{i}", d, t) for i, (d, t) in enumerate(zip(devices, tps))]
    st = state(rank, tps=tps, u_shape=False)
    st.topology = Topology.from_config(ClusterConfig(stages=stages))
    assert VtpCommunicator(config(), st).device == torch.device("cuda", index)


def test_waits_that_fail_name_the_transfer(wire):
    comm = VtpCommunicator(config(), state(0))
    send = comm.send(torch.ones(2), 1, FORWARD)
    _, recv = comm.recv((2,), 2, FORWARD)
    wire.fail_wait = ConnectionError("peer gone")
    for work, what in ((send, "send of an activation to stage 1"),
                       (recv, "receive of an activation from stage 2")):
        with pytest.raises(comm_mod.BoundaryError) as err:
            work.wait()
        assert what in str(err.value) and "ConnectionError: peer gone" in str(err.value)


def test_receives_that_fail_say_so_and_why(wire):
    wire.fail = ConnectionError("refused")
    with pytest.raises(comm_mod.BoundaryError) as err:
        VtpCommunicator(config(), state(1)).recv((2,), 0, FORWARD)
    assert str(err.value).startswith("boundary 0->1: rank 1 (stage 1 's1') receive of an "
                                     "activation from stage 0 's0' (rank 0) failed")
    assert "ConnectionError: refused" in str(err.value)
    with pytest.raises(comm_mod.BoundaryError) as err:
        VtpCommunicator(config(variable_seq_lengths=True), state(1)).recv((2,), 0, FORWARD)
    assert str(err.value).startswith("boundary 0->1: rank 1 (stage 1 's1') receive of an "
                                     "activation from stage 0 's0' (rank 0) (its shape) failed")
    assert "ConnectionError: refused" in str(err.value)


def test_functional_details(wire, monkeypatch):
    """``state=`` reaches the communicator; a blocking receive returns the tensor alone; a
    non-leader never sends, over any group; a sequence-parallel send needs the config."""
    t = functional.vtp_recv_backward((2,), config(), state=state(0))
    assert isinstance(t, torch.Tensor) and torch.all(t == 102.0)
    wire.calls.clear()
    assert functional.vtp_send_forward(torch.ones(2), state=state(2), group=[Group("u")],
                                     next_rank=[3]) is None
    assert wire.calls == []
    assert functional.vtp_send_backward(torch.ones(2, 1, 4), config(sequence_parallel=True),
                                      state=state(2)) is None
    assert wire.calls == [("gather", 1, TP_GROUP, (2, 1, 4))]  # its slice, to the leader
    handles = functional.vtp_send_forward(torch.ones(2), state=state(0), group=[Group("u")],
                                        next_rank=[1])
    assert handles[0]._keep_alive is wire.sent[-1]


def test_functional_receive_over_groups_fills_the_stages_own_tensor(wire):
    """Over groups the caller built, on a CPU stage: one buffer, the returned tensor itself, of
    the pipeline dtype, ready for autograd (nothing staged: the host is the device)."""
    cfg = config(pipeline_dtype=torch.bfloat16)
    with torch.device("meta"):
        t, handles = functional.vtp_recv_forward((2, 3), cfg, async_op=True, state=state(1),
                                               group=[Group("u"), Group("v")], prev_rank=[0, 0])
    assert (t.dtype, t.device.type, t.requires_grad) == (torch.bfloat16, "cpu", True)
    assert all(target.data_ptr() == t.data_ptr() for target in wire.targets)
    handles["recv_prev"].wait()
    assert torch.all(t == 1.0) and wire.calls[-1] == ("broadcast", 1, TP_GROUP, (2, 3))


# ---- on a GPU: the host staging a CPU-only machine cannot show (`pytest -m gpu`) ------------
# A stage on cuda next to a CPU stage crosses a host-staged boundary: gloo takes host tensors
# only, so a send hands it a host copy of the device tensor and a receive lands in a host
# buffer that wait() copies to the device (docs/testing.md: the mutants only a device kills).
# Each test also checks the copy is a copy (values after the source changed), which holds on
# any device.

GPU = torch.device("cuda", 0)
EDGE_ON_GPU = ("cuda", "cpu", "cpu")  # ranks: 0 edge (cuda), 1-2 cloud0 (TP 2), 3 cloud1


@pytest.mark.gpu
def test_a_gpu_stage_sends_host_copies_across_a_host_staged_boundary(wire):
    comm = VtpCommunicator(config(variable_seq_lengths=True), state(0, devices=EDGE_ON_GPU))
    assert comm.device == GPU
    t = torch.full((5, 1, 4), 3.0, device=GPU)
    work = comm.send(t, 1, FORWARD)  # the activation to cloud0 (rank 1), boundary 0->1
    shape_buf, payload = wire.sent
    assert [c[:4] for c in wire.calls] == [("isend", 1, G(0, 1), layout_mod.SHAPE_TAGS[FORWARD]),
                                           ("isend", 1, G(0, 1), 1)]
    assert shape_buf.device.type == "cpu" and shape_buf.tolist() == [5, 1, 4]
    assert payload.device.type == "cpu" and payload.is_contiguous()
    t.fill_(5.0)  # the caller reuses its device tensor once the send is posted
    assert torch.all(payload == 3.0)
    assert work._keep_alive[0] is payload  # the host copy lives until the send is waited
    comm.send(t, 2, BACKWARD)  # the gradient back along the wraparound 2->0
    assert wire.sent[-1].device.type == "cpu" and torch.all(wire.sent[-1] == 5.0)


@pytest.mark.gpu
def test_a_gpu_stage_receives_into_a_host_buffer_copied_to_the_device(wire):
    cfg = config(pipeline_dtype=torch.bfloat16, variable_seq_lengths=True)
    wire.shape_in = [6, 1, 4]
    tensor, work = VtpCommunicator(cfg, state(0, devices=EDGE_ON_GPU)).recv((2, 1, 4), 2,
                                                                            FORWARD)
    assert wire.calls[0] == ("recv", 3, G(2, 0), layout_mod.SHAPE_TAGS[FORWARD], "cpu")
    target = wire.targets[0]
    assert (target.device.type, target.dtype, tuple(target.shape)) == ("cpu", torch.bfloat16,
                                                                       (6, 1, 4))
    assert (tensor.device, tensor.dtype, tensor.requires_grad) == (GPU, torch.bfloat16, True)
    assert target.data_ptr() != tensor.data_ptr()
    work.wait()
    assert torch.all(tensor == 301.0)  # rank 3's activation, copied from the host buffer


@pytest.mark.gpu
def test_a_gpu_stage_relays_and_gathers_in_pieces_across_a_host_staged_boundary(wire,
                                                                                monkeypatch):
    """Stage 1 on cuda (TP 2, ranks 1-2) between CPU stages, a message in 4 pieces: each
    piece arrives in the leader's host buffer and is copied to the device before the leader
    relays it inside the stage; with sequence parallelism the leader gathers its stage's
    slices on the device and puts each piece on the link as a host copy."""
    monkeypatch.setattr(VtpCommunicator, "piece_unit_bytes", 16)  # 256 bytes: 4 pieces
    devices = ("cpu", "cuda", "cpu")
    tensor, work = VtpCommunicator(config(), state(1, devices=devices)).recv((16, 1, 4), 0,
                                                                             FORWARD)
    arrivals = [c for c in wire.calls if c[0] == "irecv"]
    assert len(arrivals) == 4 and all(t.device.type == "cpu" for t in wire.targets)
    assert tensor.device == GPU
    work.wait()
    relayed = wire.sent  # to TP rank 1 (rank 2), inside the stage: device tensors
    assert len(relayed) == 4 and all(t.device == GPU for t in relayed)
    assert torch.all(tensor == 1.0)  # from rank 0, an activation
    wire.calls.clear()
    wire.sent.clear()
    sp = config(sequence_parallel=True)
    local = torch.full((8, 1, 4), 2.0, device=GPU)  # the leader's slice; rank 2's arrives
    VtpCommunicator(sp, state(1, devices=devices)).send(local, 2, FORWARD)
    on_link = list(wire.sent)
    assert len(on_link) == 4 and all(t.device.type == "cpu" for t in on_link)
    local.fill_(9.0)  # the pieces on the link are copies
    whole = torch.cat(on_link).view(16, 1, 4)
    assert whole[:8].eq(2.0).all() and whole[8:].eq(206.0).all()  # rank 2's: 100*2 + tag 6


@pytest.mark.gpu
def test_the_functional_api_stages_a_gpu_tensor_through_the_host_over_a_gloo_group(
        wire, monkeypatch):
    """Groups the caller built: over a gloo group a cuda stage sends a host copy and receives
    into a host buffer copied to the device after the wait; over an nccl group the device
    tensors themselves cross."""
    backends = {"gloo": "gloo", "nccl": "nccl"}
    monkeypatch.setattr(comm_mod.dist, "get_backend", lambda g: backends[g.name])
    gloo, nccl = Group("gloo"), Group("nccl")
    st = state(0, devices=EDGE_ON_GPU)
    t = torch.full((2, 3), 4.0, device=GPU)
    functional.vtp_send_forward(t, state=st, group=[gloo], next_rank=[1])
    t.fill_(6.0)
    assert wire.sent[-1].device.type == "cpu" and torch.all(wire.sent[-1] == 4.0)
    functional.vtp_send_forward(t, state=st, group=[nccl], next_rank=[1])
    assert wire.sent[-1].device == GPU
    got, handles = functional.vtp_recv_backward((2, 3), config(), async_op=True, state=st,
                                                group=[gloo], next_rank=[1])
    assert wire.targets[-1].device.type == "cpu" and got.device == GPU
    assert wire.targets[-1].data_ptr() != got.data_ptr()
    handles["recv_next"].wait()
    assert torch.all(got == 102.0)  # rank 1's gradient, copied from the host buffer
    got, handles = functional.vtp_recv_backward((2, 3), config(), async_op=True, state=st,
                                                group=[nccl], next_rank=[1])
    assert wire.targets[-1].data_ptr() == got.data_ptr()  # straight into the device tensor
