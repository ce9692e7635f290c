"""What the memory estimate counts at a stage's peak (issue #24; docs/memory.md): the moments
of the schedule a run really walks (micro-batches held, posted receives, sent tensors a
runtime still holds, each at the same computation), and a transient that does not count the
gradient buffer twice. No world: the action lists, and one estimate in a helper process."""

from __future__ import annotations

import pytest

from ldt.memory.inflight import Moment, stage_inflight


def _topo(*over):
    from omegaconf import OmegaConf

    from ldt.hydra_app import compose
    from ldt.training.loop import parse
    from ldt.validate import validate

    c = parse(OmegaConf.to_container(compose(list(over)), resolve=True))
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

    from ldt.hydra_app import compose
    from ldt.memory import estimate

    cfg = OmegaConf.to_container(compose(["cluster=cpu_vtp", "model.seq_length=8",
                                          "train.micro_batch_size=1"]), resolve=True)
    s1 = estimate(cfg)[1]
    assert s1.grads == s1.weights > 300_000
    assert s1.transient < s1.grads / 4, (s1.transient, s1.grads)
