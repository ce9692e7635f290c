"""What the memory estimate counts at a stage's peak (issue #24; docs/memory.md): the moments
of the schedule a run really walks (micro-batches held, posted receives, sent tensors a
runtime still holds, each at the same computation), and a transient that does not count the
gradient buffer twice. No world: the action lists, and one estimate in a helper process."""

from __future__ import annotations

import pytest

from ldt.memory.inflight import Moment, StageInflight, stage_inflight


def _topo(*over):
    from omegaconf import OmegaConf

    from ldt.job.hydra import compose
    from ldt.config import typed_config
    from ldt.topology.validate import validate

    c = typed_config(OmegaConf.to_container(compose(list(over)), resolve=True))
    return validate(c.cluster, c.model, train=c.train, check_devices=False), c


def test_ldt_runtime_holds_a_sent_tensor_through_two_computations_only():
    """cpu_demo's cloud1 (U-shape, m 4; computations F0 F1 B0 F2 B1 F3 B2 B3): at F2 it holds
    2 micro-batches (1, 2), two posted receives (F3's activation, B1's gradient) and B0's
    input gradient, sent before it and perhaps still crossing; B1's gradient, sent before
    F3, still counts at B2 (two computations) and no longer at B3 (ldt's runtime waits a
    completed send at its next action), where B2's does. A forward's output never counts as
    sent: its backward comes long after its send. A sequence-parallel TP-2 stage's leader
    sends a whole it gathered, a new tensor: counted at the computation after the send."""
    topo, c = _topo("cluster=cpu_demo")
    cloud1 = stage_inflight(topo, c.train)[2]
    assert cloud1.moments[3] == Moment((2,), 2, 1, 0)  # F2
    assert cloud1.moments[6] == Moment((2,), 1, 1, 0)  # B2
    assert cloud1.moments[7] == Moment((1,), 0, 1, 0)  # B3
    assert cloud1.peak([1000], [0], 10, 10) == Moment((2,), 2, 1, 0)
    assert cloud1.chunks == (2,)
    edge = stage_inflight(topo, c.train)[0]
    assert edge.chunks == (4, 1)
    assert edge.peak([1000, 0], [0, 0], 0, 0).chunks == (4, 0)  # a BE of the start chunk
    assert edge.peak([0, 1000], [0, 0], 0, 0).chunks[1] == 1
    plain = stage_inflight(topo, c.train)[1]  # cloud0, TP 2: F0 F1 ...
    sp = stage_inflight(topo, c.train, sequence_parallel=True)[1]
    assert (plain.moments[1].sent, sp.moments[1].sent) == (0, 1)  # F0's output, at F1


def test_megatrons_1f1b_keeps_no_buffers_and_one_stale_tensor():
    """cpu_vtp on megatron's own 1F1B: it receives right before the computation and waits
    for each send, so no posted receive outlives an exchange; its loop still names the last
    output it backwarded (during a forward) or the last input gradient it sent (during a
    backward): one tensor, only after the step's first backward, none on a stage that never
    sends it (stage 0 sends no gradient, the last stage no output)."""
    topo, c = _topo("cluster=cpu_vtp")
    got = stage_inflight(topo, c.train)
    for stage, mine in got.items():
        assert all(mo.recv_buffers == 0 for mo in mine.moments)
        assert mine.chunks == (3 - stage,)
        assert mine.moments[0].sent == 0  # the first forward: no backward yet
        assert max(mo.sent for mo in mine.moments) == 1
    assert {mo.sent for mo in got[0].moments if mo.chunks == (3,)} == {0, 1}
    topo, c = _topo("cluster=cpu_vtp", "train.runtime=ldt")
    assert max(mo.recv_buffers for mo in stage_inflight(topo, c.train)[1].moments) == 2


@pytest.mark.timeout(120)
def test_the_transient_does_not_count_the_gradient_buffer_again():
    """A middle stage whose parameters outweigh its activations (s 8, b 1): its transient is
    one micro-batch's backward, far below its fp32 gradient buffer. The grad buffer was
    counted again when DDP's hooks first touched it in backward (the tracker had not been
    told about it): the transient was then above the whole buffer (cpu_vtp s1: +399872
    bytes, 10% of its peak)."""
    from omegaconf import OmegaConf

    from ldt.job.hydra import compose
    from ldt.memory.stages import estimate_here

    cfg = OmegaConf.to_container(compose(["cluster=cpu_vtp", "model.seq_length=8",
                                          "train.micro_batch_size=1"]), resolve=True)
    s1 = estimate_here(cfg)[1]  # in this process: no helper to start
    assert s1.grads == s1.weights > 300_000
    assert s1.transient < s1.grads / 4, (s1.transient, s1.grads)


def test_megatrons_interleaved_schedule_holds_its_warm_up_in_chunk_order():
    """Three stages, two chunks each, m 6: stage s's warm-up is (P - s - 1) * 2 + (vpp - 1) *
    P forwards, plus the one in steady state: 8, 6, 4; forward k runs chunk (k // P) % vpp,
    so stage 0 holds chunks 0, 0, 0, 1, 1, 1, 0, 0 -> (5, 3), stage 1 (3, 3), stage 2 (3, 1);
    two receives posted. With m 3 a stage runs at most m * vpp = 6 forwards: (3, 3)."""
    topo, c = _topo("cluster=cpu_vtp", "cluster.layout=Et|t|t|t|t|tL",
                    "train.num_microbatches=6")
    got = stage_inflight(topo, c.train)
    assert got == {0: StageInflight((Moment((5, 3), 2),)), 1: StageInflight((Moment((3, 3), 2),)),
                   2: StageInflight((Moment((3, 1), 2),))}
    topo, c = _topo("cluster=cpu_vtp", "cluster.layout=Et|t|t|t|t|tL",
                    "train.num_microbatches=3")
    assert stage_inflight(topo, c.train)[0].moments == (Moment((3, 3), 2),)


def test_the_u_shapes_prefetch_posts_receives_ahead_and_holds_more():
    """cpu_demo at m 8: prefetch d keeps 1 + 2d receives posted on each link to or from the
    edge, so 2 (3) on the edge, 1 + 3 on each cloud stage at d 1; the edge's start chunk holds
    P + 1 + 2d micro-batches (4, then 6), its end chunk one."""
    topo, c = _topo("cluster=cpu_demo", "train.num_microbatches=8")
    plain = stage_inflight(topo, c.train)
    topo, c = _topo("cluster=cpu_demo", "train.num_microbatches=8", "train.prefetch=1")
    deep = stage_inflight(topo, c.train)
    assert (plain[0].chunks, deep[0].chunks) == ((4, 1), (6, 1))
    assert [max(mo.recv_buffers for mo in s.moments) for s in plain.values()] == [2, 2, 2]
    assert [max(mo.recv_buffers for mo in s.moments) for s in deep.values()] == [6, 4, 4]


# cpu_vdp's edge lane (U-shape, edge dp 1, cloud dp 2, m 4 per uniform replica: 8 micro-
# batches), its computations as ldt.schedule.vdp lists them, and after which ones it sends an
# input gradient back (BS k): FS0 FS1 FS2 FE0 BS0* FS3 FS4 FE1 BS1* BE0 FE2 BS2* FS5 BE1 FE3
# BS3* FS6 BE2 FE4 BS4* FS7 BE3 FE5 BS5* BE4 FE6 BS6* BE5 FE7 BS7* BE6 BE7. The cloud has twice
# the replicas, so each of them runs half the computations: a send to it waits twice as many
# of the edge's for its receive, and is counted through the next 4 computations, not 2.
VDP_EDGE_SENDS_AFTER = [5, 9, 12, 16, 20, 24, 27, 30]  # 1-based computation numbers


def test_per_stage_dp_counts_a_send_through_as_many_more_computations_as_the_peer_is_faster():
    topo, c = _topo("cluster=cpu_vdp")
    got = stage_inflight(topo, c.train)
    edge = got[0].moments
    assert len(edge) == 32
    want = [sum(k - 4 <= j < k for j in VDP_EDGE_SENDS_AFTER) for k in range(1, 33)]
    assert [mo.sent for mo in edge] == want
    assert want[:14] == [0] * 5 + [1] * 7 + [2, 1]  # read by hand off the list above
    # the edge's end chunk computes at FE and BS (chunk 1): FE0 holds (3 start, 1 end)
    assert (edge[3].chunks, edge[3].chunk, edge[4].chunk, edge[5].chunk) == ((3, 1), 1, 1, 0)
    assert got[0].chunks == (5, 1) and edge[0].recv_buffers == 4 and edge[-1].recv_buffers == 0
    # a cloud lane (F0 F2 B0* F4 B2* F6 B4* B6*) sends to a stage with fewer replicas: 2
    cloud = [mo.sent for mo in got[1].moments[:8]]
    assert cloud == [0, 0, 0, 1, 1, 1, 1, 1]


def test_a_per_stage_dp_u_shapes_prefetch_posts_receives_ahead_on_every_lane():
    """cpu_vdp (the edge at dp 1, the cloud at dp 2): as on cpu_demo, prefetch d keeps
    1 + 2d receives posted where 1 was: the edge's lane 4 -> 12, a cloud lane's 2 -> 6 at
    d 1."""
    receives = []
    for d in (0, 1):
        topo, c = _topo("cluster=cpu_vdp", f"train.prefetch={d}")
        got = stage_inflight(topo, c.train)
        receives.append([max(mo.recv_buffers for mo in got[s].moments) for s in (0, 1)])
    assert receives == [[4, 2], [4 * 3, 2 * 3]]


def _ops(*names):
    from types import SimpleNamespace

    from ldt.schedule import Op

    return [SimpleNamespace(op=getattr(Op, n)) for n in names]


def test_the_walk_of_hand_written_lists():
    """``_walk`` on short lists, every moment counted by hand. Two chunks with split
    backwards (ldt's runtime, sends held through 2 computations): each B of the end chunk
    (BS) adds a W store entry to chunk 1 and each WS frees one, BE / WE the same for chunk 0;
    two input gradients sent before WS are both still held there and at the BE after it.
    Megatron's runtime keeps one stale tensor at a computation after the first backward,
    when the list sends what that computation's kind sends (FE a forward output, BS a
    gradient). A sequence-parallel leader (``gathers``) holds each forward send it gathered."""
    from ldt.memory.inflight import _walk

    got = _walk(_ops("FS", "SEND_F", "FS", "FE", "FE", "BS", "BS", "SEND_B", "SEND_B", "WS",
                     "BE", "WS", "WE"), True)  # a forward output sent is not held as sent
    assert got == [Moment((1, 0), 0, 0, 0, (0, 0)), Moment((2, 0), 0, 0, 0, (0, 0)),
                   Moment((2, 1), 0, 0, 1, (0, 0)), Moment((2, 2), 0, 0, 1, (0, 0)),
                   Moment((2, 2), 0, 0, 1, (0, 0)), Moment((2, 1), 0, 0, 1, (0, 1)),
                   Moment((2, 0), 0, 2, 1, (0, 2), True), Moment((2, 0), 0, 2, 0, (0, 1)),
                   Moment((1, 0), 0, 0, 1, (1, 1), True), Moment((1, 0), 0, 0, 0, (1, 0), True)]
    got = _walk(_ops("FS", "SEND_F", "BE", "SEND_B", "FE", "BS"), True, False)
    assert got == [Moment((1, 0), 0, 0, 0), Moment((1, 0), 0, 0, 0), Moment((0, 1), 0, 1, 1),
                   Moment((0, 1), 0, 1, 1)]
    got = _walk(_ops("F", "SEND_F", "SEND_F", "F", "B", "W"), False, True, True)
    assert got == [Moment((1,), 0, 0, 0, (0,)), Moment((2,), 0, 2, 0, (0,)),
                   Moment((2,), 0, 2, 0, (0,)), Moment((1,), 0, 0, 0, (1,), True)]


def test_a_stages_peers_are_the_stages_it_exchanges_activations_with():
    """Three stages in a row (boundaries 0 -> 1 -> 2): the middle stage's peers are both
    neighbours, an end's its one neighbour; a U-shape's two stages (0 -> 1 -> 0) are each
    other's; a stage without boundaries is its own."""
    from types import SimpleNamespace

    from ldt.memory.inflight import _peers

    row = SimpleNamespace(activation_boundaries=lambda: [(0, 1), (1, 2)])
    assert [_peers(row, s) for s in range(3)] == [{1}, {0, 2}, {1}]
    ring = SimpleNamespace(activation_boundaries=lambda: [(0, 1), (1, 0)])
    assert [_peers(ring, s) for s in range(2)] == [{1}, {0}]
    assert _peers(SimpleNamespace(activation_boundaries=lambda: []), 0) == {0}


def test_a_plain_pipeline_with_per_stage_dp_runs_on_ldts_runtime():
    """cpu_vtp with the middle stage at dp 2 (megatron's 1F1B cannot pair its fan-in / out):
    receives are posted ahead, and stage 0's lane holds (P - s - 1) * D / dp_s + 1 = 5."""
    topo, c = _topo("cluster=cpu_vtp", "cluster.stages.0.dp=1", "cluster.stages.1.dp=2",
                    "cluster.stages.2.dp=1")
    got = stage_inflight(topo, c.train)
    assert got[0].chunks == (5,) and max(mo.recv_buffers for mo in got[0].moments) == 2


def test_only_a_sequence_parallel_stage_of_tp_above_1_sends_a_gathered_whole():
    """cpu_demo with sequence parallelism: the TP-1 stages (edge, cloud1) send their own
    outputs, counted as before; the TP-2 leader (cloud0) gathers what it sends."""
    topo, c = _topo("cluster=cpu_demo")
    plain = stage_inflight(topo, c.train)
    sp = stage_inflight(topo, c.train, sequence_parallel=True)
    assert sp[0] == plain[0] and sp[2] == plain[2] and sp[1] != plain[1]


def test_the_peak_moment_takes_the_computing_chunks_transient():
    """The edge of cpu_demo with no activations, buffers or sends: the peak is the moment
    whose chunk has the larger transient (an end-chunk computation when that one is)."""
    topo, c = _topo("cluster=cpu_demo")
    edge = stage_inflight(topo, c.train)[0]
    assert edge.peak([0, 0], [0, 1000], 0, 0).chunk == 1
    assert edge.peak([0, 0], [1000, 0], 0, 0).chunk == 0
    assert edge.peak([0, 0], [0, 0], 10, 0).recv_buffers == 2
    assert edge.peak([0, 0], [0, 0], 0, 10).sent == max(mo.sent for mo in edge.moments)
