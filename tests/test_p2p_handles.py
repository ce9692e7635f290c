"""Semantics of the VTP receive handles, with the process-group calls recorded.

No processes: torch.distributed's isend/irecv/broadcast are replaced by recorders, so the
order of calls on a leader and a non-leader can be checked exactly.
"""

from types import SimpleNamespace

import pytest
import torch

from ldt.boundary import communicator as p2p
from ldt.boundary import functional
from ldt.config import ClusterConfig, ConfigError, StageConfig
from ldt.groups.parallel_state import StagePipelineGroup
from ldt.topology.routes import rank_plan
from ldt.topology.ranks import Topology


class Recorder:
    def __init__(self):
        self.calls = []
        self.tensors = []  # what isend / irecv were handed, in call order
        self.groups = []  # the group each isend / irecv was posted on, in call order

    def isend(self, tensor, dst, group=None, tag=0):
        self.calls.append(("isend", dst, tag))
        self.tensors.append(tensor)
        self.groups.append(group)
        return SimpleNamespace(wait=lambda: self.calls.append(("isend.wait", dst)),
                               is_completed=lambda: True)

    def irecv(self, tensor, src, group=None, tag=0):
        def wait():
            tensor.fill_(7.0)
            self.calls.append(("irecv.wait", src))

        self.calls.append(("irecv", src, tag))
        self.tensors.append(tensor)
        self.groups.append(group)
        return SimpleNamespace(wait=wait, is_completed=lambda: True)

    def broadcast(self, tensor, src, group=None):
        self.calls.append(("broadcast", src, float(tensor.flatten()[0])))


def _state(rank, tps=(1, 2, 1), host_staging=False, fanout="never", same_node=True,
           devices=None):
    """One rank's VtpState as the communicator reads it; ``fanout``: cluster.boundary_fanout
    (``never``: the relay through the receiving leader, which most tests here pin down);
    ``devices``: the stages' device types (default: the CPU)."""
    devices = devices or ["cpu"] * len(tps)
    topo = Topology.from_config(ClusterConfig(
        stages=[StageConfig(f"s{i}", d, t) for i, (d, t) in enumerate(zip(devices, tps))],
        u_shape=True,
        host_staging="always" if host_staging else "auto", boundary_fanout=fanout))
    info = topo.rank_info(rank)
    plan = rank_plan(topo, nodes=None if same_node else [str(r) for r in range(topo.world_size)])
    return SimpleNamespace(topology=topo, info=info, stage=info.stage, is_leader=info.is_leader,
                           stage_ranks=topo.stage_ranks(info.stage), tp_group=object(),
                           pp_group=StagePipelineGroup(info.stage, topo.num_stages, topo.leaders()),
                           plan=plan, named_groups={g.name: object() for g in plan.groups})


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


@pytest.mark.parametrize("mode,same_node,numel,fans", [
    ("auto", True, 2**22, True),  # one node: straight to every TP rank at any size
    ("auto", False, 2**14, True),  # between nodes, 64 KiB: latency-bound, copies pay
    ("auto", False, 2**14 + 1, False),  # one element more: one copy and the relay
    ("never", True, 4, False), ("always", False, 2**22, True)])
def test_fanout_sends_to_every_tp_rank_and_skips_the_relay(rec, mode, same_node, numel, fans):
    """Stage 0 (TP 1) -> stage 1 (TP 2, ranks 1-2): with fan-out the sending leader sends its
    one payload to both ranks of stage 1 and each receives it itself (no broadcast); without,
    one copy goes to the leader, which broadcasts it."""
    sender = p2p.VtpCommunicator(CONFIG, _state(0, fanout=mode, same_node=same_node))
    sender.send(torch.ones(numel), 1, p2p.FORWARD)
    sent = [c for c in rec.calls if c[0] == "isend"]
    assert [c[1] for c in sent] == ([1, 2] if fans else [1])
    assert len({t.data_ptr() for t in rec.tensors}) == 1  # one payload, the same bytes
    rec.calls.clear()
    receiver = p2p.VtpCommunicator(CONFIG, _state(2, fanout=mode, same_node=same_node))
    tensor, work = receiver.recv((numel,), 0, p2p.FORWARD)
    work.wait()
    ops = [c[0] for c in rec.calls]
    assert ops == (["irecv", "irecv.wait"] if fans else ["broadcast"])
    assert rec.calls[0][1] == (0 if fans else 1)  # from stage 0's leader / its own leader
    if fans:
        assert torch.all(tensor == 7.0)


def test_fanout_into_a_sequence_parallel_stage_keeps_the_slice(rec, monkeypatch):
    """The sender cannot know the receiving stage splits the sequence (its own config says
    TP 1): it sends the whole tensor, and each rank of the receiving stage keeps its slice."""
    sp = SimpleNamespace(**{**vars(CONFIG), "sequence_parallel": True})
    comm = p2p.VtpCommunicator(sp, _state(2, fanout="always"))  # TP rank 1 of stage 1
    seen = []
    comm.observers = [SimpleNamespace(on_recv=lambda *a: seen.append(a[-1].shape))]

    def irecv(tensor, src, group=None, tag=0):
        rec.tensors.append(tensor)
        return SimpleNamespace(wait=lambda: tensor.copy_(torch.arange(8.0).view(4, 1, 2)))

    monkeypatch.setattr(p2p.dist, "irecv", irecv)
    tensor, work = comm.recv((2, 1, 2), 0, p2p.FORWARD)
    assert rec.tensors[0].shape == (4, 1, 2)  # the whole tensor arrives
    work.wait()
    assert tensor.flatten().tolist() == [4.0, 5.0, 6.0, 7.0]  # the second half of the sequence
    assert seen == [(4, 1, 2)]  # observers see what crossed


def test_two_stage_ring_separates_directions(rec):
    """prev == next in a 2-stage ring: forward and backward use different boundary groups."""
    state = _state(rank=0, tps=(1, 1))
    comm = p2p.VtpCommunicator(CONFIG, state)
    assert comm.prev_stage == comm.next_stage == 1
    fwd = comm._route(1, 0, p2p.FORWARD, None, sending=True)  # activation 1 -> 0 (wraparound)
    bwd = comm._route(1, 0, p2p.BACKWARD, None, sending=True)  # gradient 1 -> 0 (of 0's output)
    assert (fwd.boundary, bwd.boundary) == ((1, 0), (0, 1))
    assert state.named_groups[fwd.group] is not state.named_groups[bwd.group]


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


@pytest.mark.gpu
def test_a_gpu_stage_receives_a_fanned_out_message_through_a_host_buffer(rec):
    """Fan-out into a TP-2 stage on cuda from a CPU edge: each rank of the stage receives the
    sender's copy itself, into a host buffer (gloo), which its wait() copies to the device;
    no broadcast. (The CPU twin, test_fanout_sends_to_every_tp_rank_and_skips_the_relay,
    cannot tell a host buffer from the device tensor.)"""
    gpu = torch.device("cuda", 0)  # rank 1: the stage's first cuda rank (one GPU is enough)
    comm = p2p.VtpCommunicator(CONFIG, _state(1, fanout="always",
                                              devices=("cpu", "cuda", "cpu")))
    tensor, work = comm.recv((64,), 0, p2p.FORWARD)
    target = rec.tensors[0]
    assert target.device.type == "cpu" and tensor.device == gpu
    assert target.data_ptr() != tensor.data_ptr()
    work.wait()
    assert [c[0] for c in rec.calls] == ["irecv", "irecv.wait"] and rec.calls[0][1] == 0
    assert torch.all(tensor == 7.0)


def test_functional_api_async_keys(rec, monkeypatch):
    monkeypatch.setattr(p2p, "get_vtp_state", lambda: _state(rank=1))
    t, handles = functional.vtp_recv_forward((2,), CONFIG, async_op=True)
    assert set(handles) == {"recv_prev"}
    t, handles = functional.vtp_recv_backward((2,), CONFIG, async_op=True)
    assert set(handles) == {"recv_next"}
    assert functional.vtp_send_forward(torch.ones(2)) is not None  # leader
    monkeypatch.setattr(p2p, "get_vtp_state", lambda: _state(rank=2))
    assert functional.vtp_send_backward(torch.ones(2)) is None  # non-leader


def test_sequence_parallel_on_a_tp1_stage_is_refused():
    """Sequence parallelism splits over TP ranks (tests/test_seqpar.py runs it for TP > 1)."""
    cfg = SimpleNamespace(**{**vars(CONFIG), "sequence_parallel": True})
    with pytest.raises(ConfigError, match="sequence_parallel=True on a stage of TP 1"):
        p2p.VtpCommunicator(cfg, _state(rank=0))


def test_the_runtime_lets_a_completed_send_go_before_its_next_action():
    """ldt's runtime holds a sent tensor only while its send is in flight (held to the step's
    end, the edge of llama3_8b's U-shape plan kept 7.6 GiB of sent tensors): a completed
    send is waited, and its tensor freed, before the next action; one in flight stays."""
    import gc
    import weakref

    from ldt.boundary.work import SendWork
    from ldt.pipeline.runtime import PendingSends

    done = {"a": False, "b": False}
    waited = []

    def work(name):
        return SimpleNamespace(is_completed=lambda: done[name],
                               wait=lambda: waited.append(name))

    a, b = torch.ones(4), torch.ones(4)
    alive = [weakref.ref(a), weakref.ref(b)]
    sends = PendingSends()
    sends.add(SendWork([work("a")], a))
    sends.add(SendWork([work("b")], b))
    del a, b
    sends.let_go_completed()
    assert waited == [] and len(sends.works) == 2  # both in flight: both held
    done["a"] = True
    sends.let_go_completed()
    gc.collect()
    assert waited == ["a"] and alive[0]() is None and alive[1]() is not None
    sends.wait_all()  # the step's end: the rest
    gc.collect()
    assert waited == ["a", "b"] and alive[1]() is None and sends.works == []


# ---- the transports as the routes say: pieces, fan-out, the sequence-parallel gather ----------
# A 4 MiB fp32 message crosses in round(sqrt(4 MiB / 128 KiB)) = round(5.66) = 6 pieces.
BIG, PIECES = 2**20, 6
FORWARD_TAG, RELAY_TAG, GATHER_TAG = 1, 5, 6  # ldt.topology.routes' wire tags, written out


def _ranks_of(state, group) -> set:
    """The ranks of a group object the communicator posted on (looked up by identity)."""
    name = next(n for n, g in state.named_groups.items() if g is group)
    return set(state.plan.group(name).ranks)


def _pieces_of(tensors) -> list:
    """Consecutive views of one buffer: their element counts (and that they tile it)."""
    sizes = [t.numel() for t in tensors]
    starts = [t.data_ptr() for t in tensors]
    assert starts == [starts[0] + 4 * sum(sizes[:i]) for i in range(len(sizes))]
    return sizes


@pytest.mark.parametrize("numel,count", [(BIG, PIECES), (2**17, 2)])  # 512 KiB: sqrt(4) = 2
def test_a_large_message_crosses_in_pieces_on_its_boundary_group(rec, numel, count):
    """Stage 0 (TP 1) -> stage 1 (TP 2, ranks 1-2), relay (`never`): the sender's pieces go
    to stage 1's leader on the boundary's group with the data tag; the leader receives them
    into one tensor and relays each piece to its TP peer; the peer receives them from it."""
    sender = _state(0)
    payload = torch.arange(float(numel))
    work = p2p.VtpCommunicator(CONFIG, sender).send(payload, 1, p2p.FORWARD)
    assert rec.calls == [("isend", 1, FORWARD_TAG)] * count
    assert torch.equal(torch.cat(rec.tensors), payload)
    step = -(-numel // count)
    assert _pieces_of(rec.tensors) == [step] * (count - 1) + [numel - (count - 1) * step]
    assert all(_ranks_of(sender, g) == {0, 1} for g in rec.groups)
    work.wait()
    assert [c[0] for c in rec.calls[count:]] == ["isend.wait"] * count

    rec.calls.clear(), rec.tensors.clear(), rec.groups.clear()
    leader = _state(1)
    tensor, work = p2p.VtpCommunicator(CONFIG, leader).recv((numel,), 0, p2p.FORWARD)
    assert rec.calls == [("irecv", 0, FORWARD_TAG)] * count
    assert sum(_pieces_of(rec.tensors)) == numel and rec.tensors[0].data_ptr() == tensor.data_ptr()
    assert all(_ranks_of(leader, g) == {0, 1} for g in rec.groups)
    work.wait()
    relayed = [c for c in rec.calls if c[0] == "isend"]
    assert relayed == [("isend", 2, RELAY_TAG)] * count  # each piece on to TP rank 1
    assert torch.all(tensor == 7.0) and tensor.requires_grad

    rec.calls.clear(), rec.tensors.clear()
    tensor, work = p2p.VtpCommunicator(CONFIG, _state(2)).recv((numel,), 0, p2p.FORWARD)
    assert rec.calls == []  # nothing crosses to it before its leader has the pieces
    work.wait()
    posted = [c for c in rec.calls if c[0] == "irecv"]
    assert posted == [("irecv", 1, RELAY_TAG)] * count  # from its leader, piece by piece
    assert torch.all(tensor == 7.0)


def test_fanout_posts_on_the_fanout_group_with_the_data_tag(rec):
    sender = _state(0, fanout="always")
    p2p.VtpCommunicator(CONFIG, sender).send(torch.ones(BIG), 1, p2p.FORWARD)
    assert rec.calls == [("isend", 1, FORWARD_TAG), ("isend", 2, FORWARD_TAG)]
    assert all(_ranks_of(sender, g) == {0, 1, 2} for g in rec.groups)
    rec.calls.clear(), rec.groups.clear()
    receiver = _state(2, fanout="always")
    tensor, _ = p2p.VtpCommunicator(CONFIG, receiver).recv((BIG,), 0, p2p.FORWARD)
    assert rec.calls == [("irecv", 0, FORWARD_TAG)]
    assert _ranks_of(receiver, rec.groups[0]) == {0, 1, 2}
    assert tensor.dtype == torch.float32 and tensor.requires_grad


def test_between_two_tp2_stages_each_rank_sends_its_own_copy_with_the_same_noise(rec):
    """U-shape TP 2 -> TP 2 (ranks [0 1] [2 3]), fan-out: TP rank i sends to TP rank i, as
    megatron's p2p pairs them, and receives from it. Each rank of the data stage draws the
    noise of ``train.boundary_noise`` from its own transform, seeded alike: the two copies are
    equal bit for bit (else the TP ranks across would train on different inputs). With the
    sequence sharded, the leader (which gathers it) sends both."""
    from ldt.boundary.noise import send_transforms

    train = SimpleNamespace(boundary_noise=1.0, seed=3)
    x = torch.arange(12.0).view(3, 1, 4)
    for rank, peer in ((0, 2), (1, 3)):
        state = _state(rank, tps=(2, 2), fanout="always")
        transforms = send_transforms(train, state.topology, state.stage)
        for t in transforms:
            t.start(step=5)
        work = p2p.VtpCommunicator(CONFIG, state, send_transforms=transforms).send(
            x, 1, p2p.FORWARD)
        assert work is not None and rec.calls[-1] == ("isend", peer, FORWARD_TAG)
    assert [c[1] for c in rec.calls] == [2, 3]  # one copy each
    assert torch.equal(rec.tensors[0], rec.tensors[1]) and not torch.equal(rec.tensors[0], x)
    rec.calls.clear()
    for rank, peer in ((2, 0), (3, 1)):
        p2p.VtpCommunicator(CONFIG, _state(rank, tps=(2, 2), fanout="always")).recv(
            (3, 1, 4), 0, p2p.FORWARD)
        assert rec.calls[-1] == ("irecv", peer, FORWARD_TAG)
    rec.calls.clear()
    sp = SimpleNamespace(**{**vars(CONFIG), "sequence_parallel": True})
    p2p.VtpCommunicator(sp, _state(3, tps=(2, 2), fanout="always")).recv((2, 1, 4), 0,
                                                                          p2p.FORWARD)
    assert rec.calls == [("irecv", 0, FORWARD_TAG)]  # from the leader


def test_a_tp2_edge_draws_the_same_noise_after_messages_only_its_leader_sent(rec):
    """U-shape TP [2, 2, 1], every rank on a node of its own, fan-out ``auto``: the edge's two
    ranks each send a copy of a small activation to cloud0's two ranks, but only its leader
    sends the gradient back to the TP 1 stage, and a large activation goes to cloud0's
    leader alone (relayed there). The rank beside the leader must draw each later copy's noise
    as the leader does: else cloud0's TP ranks train on different inputs, without an error."""
    from ldt.boundary.noise import send_transforms

    train = SimpleNamespace(boundary_noise=1.0, seed=3)
    small, large = torch.arange(12.0).view(3, 1, 4), torch.ones(64, 1, 512)  # 128 KiB
    messages = ((small, 1, p2p.FORWARD), (small, 2, p2p.BACKWARD), (large, 1, p2p.FORWARD),
                (small, 1, p2p.FORWARD))
    copies = {}
    for rank in (0, 1):
        state = _state(rank, tps=(2, 2, 1), fanout="auto", same_node=False)
        (noise,) = send_transforms(train, state.topology, state.stage)
        noise.start(step=0)
        comm = p2p.VtpCommunicator(CONFIG, state, send_transforms=[noise])
        sent = []
        for tensor, peer, direction in messages:
            before = len(rec.calls)
            comm.send(tensor, peer, direction)
            sent.append([(call[1], payload) for call, payload
                         in zip(rec.calls[before:], rec.tensors[before:]) if call[0] == "isend"])
        copies[rank] = sent
    assert [[dst for dst, _ in m] for m in copies[0]] == [[2], [4], [2], [2]]
    assert [[dst for dst, _ in m] for m in copies[1]] == [[3], [], [], [3]]
    for message in (0, 3):
        (_, leader), (_, beside) = copies[0][message][0], copies[1][message][0]
        assert torch.equal(leader, beside) and not torch.equal(leader, small)
    assert not torch.equal(copies[0][0][0][1], copies[0][3][0][1])  # a fresh draw per message


def test_a_message_whose_shape_crosses_first_never_fans_out(rec):
    """With variable sequence lengths the receiver learns the shape from the sender's first
    message, so the sender cannot fan out: `always` is overruled by one copy and the relay."""
    config = SimpleNamespace(**{**vars(CONFIG), "variable_seq_lengths": True})
    p2p.VtpCommunicator(config, _state(0, fanout="always")).send(torch.ones(8), 1, p2p.FORWARD)
    assert [c[:2] for c in rec.calls] == [("isend", 1), ("isend", 1)]  # the shape, the data


def test_a_failed_fanout_receive_names_the_boundary(rec, monkeypatch):
    def irecv(*args, **kwargs):
        raise RuntimeError("connection reset")

    monkeypatch.setattr(p2p.dist, "irecv", irecv)
    comm = p2p.VtpCommunicator(CONFIG, _state(2, fanout="always"))
    with pytest.raises(p2p.BoundaryError, match=r"^boundary 0->1: rank 2 \(stage 1 's1'\) "
                       r"receive of an activation from stage 0 's0' \(rank 0\) failed "
                       r"[0-9.]+ s after it was posted \(RuntimeError: connection reset\)"):
        comm.recv((4,), 0, p2p.FORWARD)


@pytest.mark.parametrize("staged", [False, True])
def test_a_sequence_parallel_leader_sends_each_piece_as_soon_as_it_is_gathered(rec, staged):
    """Stage 1 (TP 2, sequence-parallel) -> stage 2 (TP 1): the leader (rank 1) holds the
    first half of the sequence, receives the second from rank 2 piece by piece, and sends
    every piece of the whole to rank 3 once its parts are there. Host-staged, each piece
    sent is a copy (the gathered buffer is reused)."""
    sp = SimpleNamespace(**{**vars(CONFIG), "sequence_parallel": True})
    state = _state(1, host_staging=staged)
    comm = p2p.VtpCommunicator(sp, state)
    mine = torch.arange(float(BIG)).view(BIG // 2, 1, 2)  # (s / tp, b, h)
    work = comm.send(mine, 2, p2p.FORWARD)
    gathered = [c for c in rec.calls if c[0] == "irecv"]
    sent = [(c, t) for c, t in zip(rec.calls, rec.tensors) if c[0] == "isend"]
    assert gathered and all(c[1:] == (2, GATHER_TAG) for c in gathered)  # from TP rank 1
    assert [c for c, _ in sent] == [("isend", 3, FORWARD_TAG)] * PIECES
    whole = torch.cat([t for _, t in sent])
    assert torch.equal(whole[:BIG], mine.flatten())  # the leader's own half, then the peer's
    assert torch.all(whole[BIG:] == 7.0)
    assert len({t.data_ptr() for _, t in sent}) == PIECES
    buffer = rec.tensors[0]  # the first irecv's target: a view of the gathered whole
    inside = [buffer.data_ptr() - 4 * BIG <= t.data_ptr() < buffer.data_ptr() + 4 * BIG
              for _, t in sent]
    assert not any(inside) if staged else all(inside)
    work.wait()


def test_relayed_pieces_travel_on_the_stage_s_tp_group(rec):
    leader = _state(1)
    _, work = p2p.VtpCommunicator(CONFIG, leader).recv((BIG,), 0, p2p.FORWARD)
    rec.groups.clear()
    work.wait()
    relays = rec.groups  # posted while waited: the relay's isends, one a piece
    assert [c[0] for c in rec.calls].count("isend") == len(relays) == PIECES
    assert all(g is leader.tp_group for g in relays)


def test_a_fanout_receive_that_fails_while_waited_names_the_boundary(rec, monkeypatch):
    def irecv(tensor, src, group=None, tag=0):
        def wait():
            raise RuntimeError("peer gone")
        return SimpleNamespace(wait=wait, is_completed=lambda: False)

    monkeypatch.setattr(p2p.dist, "irecv", irecv)
    _, work = p2p.VtpCommunicator(CONFIG, _state(2, fanout="always")).recv((4,), 0, p2p.FORWARD)
    with pytest.raises(p2p.BoundaryError, match=r"^boundary 0->1: rank 2 \(stage 1 's1'\) "
                       r"receive of an activation from stage 0 's0' \(rank 0\) failed"):
        work.wait()


def test_a_sequence_parallel_peer_sends_its_parts_to_its_leader(rec):
    """Rank 2 (TP rank 1 of the sequence-parallel stage 1) holds the second half of the
    sequence: it sends the parts of each piece it owns to its leader (rank 1) on the TP
    group with the gather tag, and nothing across the boundary."""
    sp = SimpleNamespace(**{**vars(CONFIG), "sequence_parallel": True})
    state = _state(2)
    mine = torch.arange(float(BIG)).view(BIG // 2, 1, 2)
    assert p2p.VtpCommunicator(sp, state).send(mine, 2, p2p.FORWARD) is None
    sent = [c for c in rec.calls if c[0] == "isend"]
    assert sent and all(c == ("isend", 1, GATHER_TAG) for c in sent)
    assert all(g is state.tp_group for g in rec.groups)
    assert torch.equal(torch.cat(rec.tensors), mine.flatten())  # its half, in order


def test_observers_see_the_whole_of_a_gathered_message(rec):
    sp = SimpleNamespace(**{**vars(CONFIG), "sequence_parallel": True})
    comm = p2p.VtpCommunicator(sp, _state(1))
    seen = []
    comm.observers = [SimpleNamespace(on_send=lambda *a: seen.append(a))]
    mine = torch.arange(float(BIG)).view(BIG // 2, 1, 2)
    comm.send(mine, 2, p2p.FORWARD)
    (src, dst, direction, payload), = seen
    assert (src, dst, direction, payload.shape) == (1, 2, p2p.FORWARD, (BIG, 1, 2))
    assert torch.equal(payload.flatten()[:BIG], mine.flatten())


def test_a_fanned_out_message_lands_in_the_pipeline_s_dtype(rec):
    """bf16 activations into a sequence-parallel stage: the whole tensor received and the
    slice kept are both bf16 (the pipeline's dtype, not torch's default)."""
    cfg = SimpleNamespace(**{**vars(CONFIG), "sequence_parallel": True,
                             "pipeline_dtype": torch.bfloat16})
    tensor, _ = p2p.VtpCommunicator(cfg, _state(2, fanout="always")).recv((2, 1, 2), 0,
                                                                          p2p.FORWARD)
    assert rec.tensors[0].shape == (4, 1, 2) and rec.tensors[0].dtype == torch.bfloat16
    assert tensor.dtype == torch.bfloat16 and tensor.requires_grad
