"""Semantics of the VTP receive handles, with the process-group calls recorded.

No processes: torch.distributed's isend/irecv/broadcast are replaced by recorders, so the
order of calls on a leader and a non-leader can be checked exactly.
"""

from types import SimpleNamespace

import pytest
import torch

from ldt.boundary import communicator as p2p
from ldt.config import ClusterConfig, ConfigError, StageConfig
from ldt.parallel_state import StagePipelineGroup
from ldt.topology import Topology


class Recorder:
    def __init__(self):
        self.calls = []
        self.tensors = []  # what isend / irecv were handed, in call order

    def isend(self, tensor, dst, group=None, tag=0):
        self.calls.append(("isend", dst, tag))
        self.tensors.append(tensor)
        return SimpleNamespace(wait=lambda: self.calls.append(("isend.wait", dst)),
                               is_completed=lambda: True)

    def irecv(self, tensor, src, group=None, tag=0):
        def wait():
            tensor.fill_(7.0)
            self.calls.append(("irecv.wait", src))

        self.calls.append(("irecv", src, tag))
        self.tensors.append(tensor)
        return SimpleNamespace(wait=wait, is_completed=lambda: True)

    def broadcast(self, tensor, src, group=None):
        self.calls.append(("broadcast", src, float(tensor.flatten()[0])))


def _state(rank, tps=(1, 2, 1), host_staging=False):
    topo = Topology.from_config(ClusterConfig(
        stages=[StageConfig(f"s{i}", "cpu", t) for i, t in enumerate(tps)], u_shape=True,
        host_staging="always" if host_staging else "auto"))
    info = topo.rank_info(rank)
    groups = {(b.src_stage, b.dst_stage): (b, object()) for b in topo.boundaries()}
    return SimpleNamespace(topology=topo, info=info, stage=info.stage, is_leader=info.is_leader,
                           stage_ranks=topo.stage_ranks(info.stage), tp_group=object(),
                           pp_group=StagePipelineGroup(info.stage, topo.num_stages, topo.leaders()),
                           boundary_groups=groups)


CONFIG = SimpleNamespace(pipeline_dtype=torch.float32, virtual_pipeline_model_parallel_size=None,
                         sequence_parallel=False, variable_seq_lengths=False)


@pytest.fixture
def rec(monkeypatch):
    r = Recorder()
    for name in ("isend", "irecv", "broadcast"):
        monkeypatch.setattr(p2p.dist, name, getattr(r, name))
    return r


def test_leader_waits_irecv_before_broadcast(rec):
    comm = p2p.VtpCommunicator(CONFIG, _state(rank=1))  # leader of the TP-2 stage
    tensor, work = comm.recv((2, 1, 4), comm.prev_stage, p2p.FORWARD)
    assert rec.calls == [("irecv", 0, 1)]  # posted, not waited
    work.wait()
    assert rec.calls[1:] == [("irecv.wait", 0), ("broadcast", 1, 7.0)]
    assert tensor.requires_grad and torch.all(tensor == 7.0)
    work.wait()  # idempotent: no second broadcast
    assert len(rec.calls) == 3


def test_non_leader_only_broadcasts(rec):
    comm = p2p.VtpCommunicator(CONFIG, _state(rank=2))  # TP rank 1 of stage 1
    _, work = comm.recv((2, 1, 4), comm.next_stage, p2p.BACKWARD)
    assert comm.send(torch.ones(3), comm.next_stage, p2p.FORWARD) is None
    work.wait()
    assert [c[0] for c in rec.calls] == ["broadcast"]
    assert rec.calls[0][1] == 1  # from the stage leader's global rank


def test_one_rank_stage_skips_broadcast(rec):
    comm = p2p.VtpCommunicator(CONFIG, _state(rank=3))
    _, work = comm.recv((2, 1, 4), comm.prev_stage, p2p.FORWARD)
    work.wait()
    assert [c[0] for c in rec.calls] == ["irecv", "irecv.wait"]


def test_two_stage_ring_separates_directions(rec):
    """prev == next in a 2-stage ring: forward and backward use different boundary groups."""
    state = _state(rank=0, tps=(1, 1))
    comm = p2p.VtpCommunicator(CONFIG, state)
    assert comm.prev_stage == comm.next_stage == 1
    fwd = comm._boundary(1, 0, p2p.FORWARD)  # activation 1 -> 0 (wraparound)
    bwd = comm._boundary(1, 0, p2p.BACKWARD)  # gradient 1 -> 0 (of 0's output)
    assert fwd is state.boundary_groups[(1, 0)] and bwd is state.boundary_groups[(0, 1)]
    assert fwd[1] is not bwd[1]


def test_overlap_mode_returns_megatron_handle_keys(rec):
    comm = p2p.VtpCommunicator(CONFIG, _state(rank=0))
    _, _, handles = comm._communicate(tensor_send_next=torch.ones(2), tensor_send_prev=None,
                                      recv_prev=True, recv_next=True, tensor_shape=(2,),
                                      wait_on_reqs=False)
    assert set(handles) == {"send_next", "recv_prev", "recv_next"}


@pytest.mark.parametrize("staged", [True, False])
def test_host_staging_copies_through_cpu(rec, staged):
    """On CPU the device tensor already is a host tensor, so what shows staging is the copy:
    a staged send hands gloo its own host copy (the tensor may change after the send), a
    staged receive lands in a host buffer that wait() copies into the tensor it returned.
    Unstaged, gloo gets the tensors themselves."""
    comm = p2p.VtpCommunicator(CONFIG, _state(rank=0, host_staging=staged))
    t = torch.full((3,), 2.0)
    comm.send(t, comm.next_stage, p2p.FORWARD)
    sent = rec.tensors[0]
    assert rec.calls[0][0] == "isend" and sent.device.type == "cpu"
    assert (sent.data_ptr() != t.data_ptr()) == staged
    t.fill_(5.0)  # the caller reuses its tensor once the send is posted
    assert torch.all(sent == (2.0 if staged else 5.0))
    tensor, work = comm.recv((3,), comm.prev_stage, p2p.FORWARD)
    target = rec.tensors[1]
    assert (target.data_ptr() != tensor.data_ptr()) == staged
    work.wait()
    assert torch.all(tensor == 7.0)  # staged buffer copied into the device tensor


def test_functional_api_async_keys(rec, monkeypatch):
    monkeypatch.setattr(p2p, "get_vtp_state", lambda: _state(rank=1))
    t, handles = p2p.vtp_recv_forward((2,), CONFIG, async_op=True)
    assert set(handles) == {"recv_prev"}
    t, handles = p2p.vtp_recv_backward((2,), CONFIG, async_op=True)
    assert set(handles) == {"recv_next"}
    assert p2p.vtp_send_forward(torch.ones(2)) is not None  # leader
    monkeypatch.setattr(p2p, "get_vtp_state", lambda: _state(rank=2))
    assert p2p.vtp_send_backward(torch.ones(2)) is None  # non-leader


def test_sequence_parallel_on_a_tp1_stage_is_refused():
    """Sequence parallelism splits over TP ranks (tests/test_seqpar.py runs it for TP > 1)."""
    cfg = SimpleNamespace(**{**vars(CONFIG), "sequence_parallel": True})
    with pytest.raises(ConfigError, match="sequence_parallel=True on a stage of TP 1"):
        p2p.VtpCommunicator(cfg, _state(rank=0))
