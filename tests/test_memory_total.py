"""The memory estimate's total, derived by hand from shapes (issue #45; docs/memory.md).

``ldt-train`` and the elastic job refuse on the estimate's peak, so the peak itself is pinned,
not only its parts: a small config whose middle stage's every term is counted here from the
model's shapes and the schedule, term by term, and refusals whose limit sits one byte below
and exactly at that peak. The estimate runs in this process (``ldt.memory.stages.estimate_here``: a
fake world entered and left).

The config: a plain pipeline of three TP-1 cpu stages on ldt's runtime (``Et|t|tL``), a GPT of
hidden 16, 2 heads of 8, FFN 64, vocabulary 256 (bytes), sequence 8, micro-batch 1, 4 micro-batches,
fp32, LayerNorm with biases, learned positions, local attention, dropout 0 (ldt's default).
Its middle stage holds one decoder layer and nothing else.
"""

from __future__ import annotations

import dataclasses

import pytest

from ldt.training.flat_state import ALIGN, META_ALLOWANCE

H, A, F, V, S, B, M = 16, 2, 64, 256, 8, 1, 4
FP32 = 4
OVERRIDES = ["cluster=cpu_vtp", "cluster.stages.0.tp=1", "cluster.stages.2.tp=1",
             "cluster.layout=Et|t|tL", "model=gpt_tiny", "model.num_layers=3",
             f"model.hidden_size={H}", f"model.num_attention_heads={A}",
             f"model.ffn_hidden_size={F}", f"model.vocab_size={V}", f"model.seq_length={S}",
             f"train.micro_batch_size={B}", f"train.num_microbatches={M}", "train.runtime=ldt"]

# ---- by hand -----------------------------------------------------------------------------
# one decoder layer's parameters: two LayerNorms (weight, bias), QKV (h -> 3h, bias),
# projection (h -> h, bias), fc1 (h -> f, bias), fc2 (f -> h, bias): 12 tensors
LAYER_PARAMS = 2 * 2 * H + (H * 3 * H + 3 * H) + (H * H + H) + (H * F + F) + (F * H + H)
LAYER_TENSORS = 12
WEIGHTS = FP32 * LAYER_PARAMS
GRADS = FP32 * LAYER_PARAMS  # DDP's fp32 gradient buffer
ADAM = 2 * FP32 * LAYER_PARAMS + FP32 * LAYER_TENSORS  # two moments, a step counter a tensor
T = S * B * H * FP32  # one [s, b, h] tensor: the boundary tensor
STATS = 2 * S * B * FP32  # a LayerNorm's saved mean and inverse deviation, [s, b] fp32 each
SCORES = B * A * S * S * FP32  # [b, heads, s, s] fp32
# what one micro-batch leaves alive after the forward: the received input, LayerNorm 1's
# statistics and output, the QKV output (q, k, v are views of it), the softmax's output (the
# attention scores before it are not kept), the context (made contiguous for the projection),
# the residual sum (LayerNorm 2's input), LayerNorm 2's statistics and output, fc1's output
# (GeLU's input), GeLU's output (fc2's input), the layer's output
ACTIVATIONS = (T + STATS + T + 3 * T + SCORES + T + T + STATS + T
               + 2 * S * B * F * FP32 + T)
# the schedule: 1F1B on the middle of three stages holds min(P - stage, m) = 2 micro-batches;
# at its fullest moment (F2, after B0) it has posted the receives of F3's input and B1's
# gradient, and B0's input gradient, sent just before, may still be crossing
IN_FLIGHT, RECEIVES, SENT = 2, 2, 1
# the highest point of a micro-batch's backward, at fc2's weight gradient: the output's
# gradient, fc2's input gradient [s, b, f], its weight gradient [h, f] (before DDP's hook adds
# it into the buffer), and what the process made once: megatron's buffer for the scores and
# the causal mask [s, s] (bool)
TRANSIENT = T + S * B * F * FP32 + H * F * FP32 + SCORES + S * S
PEAK = (WEIGHTS + GRADS + ADAM + IN_FLIGHT * ACTIVATIONS + (RECEIVES + SENT) * T
        + TRANSIENT)


def _limited(limit_bytes: int) -> dict:
    """The config with the middle stage's ``memory_gib`` at ``limit_bytes``."""
    from omegaconf import OmegaConf

    from ldt.job.hydra import compose

    return OmegaConf.to_container(compose(
        OVERRIDES + [f"cluster.stages.1.memory_gib={limit_bytes / 2**30!r}"]), resolve=True)


def _recorded(monkeypatch, stages) -> list:
    """What ``measure_stage`` returns for each stage of the next estimate, recorded (the
    measure itself runs unchanged)."""
    out, measure = [], stages.measure_stage
    monkeypatch.setattr(stages, "measure_stage", lambda *a: out.append(measure(*a)) or out[-1])
    return out


def test_the_middle_stages_peak_is_the_sum_of_its_terms_and_one_byte_less_is_refused(
        monkeypatch):
    """Every term of the middle stage as its shapes say; its peak, 79984 bytes, their sum
    (dropping any term of ``StageEstimate.peak`` changes it); a limit of PEAK - 1 bytes
    refuses that stage, naming it, its peak and the largest part. (The estimate runs in the
    test itself: mutation testing attributes a fixture's calls to no test.)"""
    from ldt.config import to_train
    from ldt.memory import stages
    from ldt.memory.stages import estimate_here
    from ldt.memory.report import refusal, snapshot_line
    from ldt.topology.validate import validate

    below = _limited(PEAK - 1)
    measured = _recorded(monkeypatch, stages)
    got = estimate_here(below)
    # no train.schedule=zb: no W runs apart, so no chunk has a W store entry or a W's transient
    assert [(ch.wstore, ch.wgrad_transient) for m in measured for ch in m.chunks] == [(0, 0)] * 3
    # what the process makes once is part of a chunk's transient
    assert all(0 <= ch.once <= ch.transient for m in measured for ch in m.chunks)
    mid = got[1]
    assert (mid.weights, mid.grads, mid.main_params, mid.optimizer) == (WEIGHTS, GRADS, 0, ADAM)
    assert mid.activations == [ACTIVATIONS] and mid.inflight == (IN_FLIGHT,)
    assert (mid.recv_buffers, mid.sent, mid.boundary_tensor) == (RECEIVES, SENT, T)
    assert mid.transient == TRANSIENT
    assert mid.step_transient < PEAK - mid.resident  # the pipeline's moment is the peak
    assert PEAK == 79984 and mid.peak == PEAK
    assert mid.components() == {
        "weights": WEIGHTS, "gradients": GRADS, "fp32 main params": 0,
        "optimizer states": ADAM, "activations": IN_FLIGHT * ACTIVATIONS,
        "receive buffers": (RECEIVES + SENT) * T, "transient": TRANSIENT}
    assert [s.fits for s in got] == [True, False, True]
    topo = validate(below["cluster"], below["model"], check_devices=False)
    line = refusal(mid, topo, to_train(below["train"]))
    assert line.startswith(f"stage 1 (s1, ranks 1) needs {PEAK / 2**20:.2f} MiB per rank "
                           f"(estimate) but cluster.stages[1].memory_gib={(PEAK - 1) / 2**30:g};"
                           " the largest part is optimizer states"), line
    # train.snapshot_dir: a rank keeps two snapshots of its state in files in host memory, the
    # next copied into the oldest's file (ldt.training.snapshot: weights and the optimizer's
    # tensors, no gradients), each
    # a part of files: its 49 tensors (12 parameters, their two moments and step counters, the
    # step) in one buffer, each rounded up to ALIGN bytes, an index entry of at most 128 bytes
    # each in meta.json, and META_ALLOWANCE each for the rest of meta.json and the manifest
    tensors = 4 * LAYER_TENSORS + 1
    files = mid.snapshot_bytes - (WEIGHTS + ADAM)
    assert tensors * META_ALLOWANCE < files <= tensors * (ALIGN + 128 + META_ALLOWANCE), files
    train = to_train(below["train"])
    assert snapshot_line(got, train) is None
    snap = snapshot_line(got, dataclasses.replace(train, snapshot_dir="/dev/shm"))
    assert snap.startswith("train.snapshot_dir=/dev/shm: host memory per rank for snapshots, 2 x "
                           "the rank's state (in files; the next is copied into the oldest's): "
                           "0:s0 "), snap
    assert f", 1:s1 {2 * mid.snapshot_bytes / 2**20:.2f} MiB, 2:s2 " in snap, snap


def test_a_limit_at_the_peak_fits():
    """(And the estimate leaves the caller's patches as they were: it reverts only those it
    applied, here a patch of its fake world the caller had applied already.)"""
    from ldt import patches
    from ldt.memory.stages import estimate_here

    done = patches.apply(["fake_tensors"])
    try:
        assert [s.fits for s in estimate_here(_limited(PEAK))] == [True, True, True]
        assert patches.is_applied("fake_tensors")
    finally:
        patches.revert(done)


@pytest.mark.timeout(120)
def test_ldt_train_refuses_a_stage_one_byte_short_before_anything_starts(tmp_path, monkeypatch):
    """``ldt-train`` with the middle stage's limit one byte below its peak: exit status 2, the
    one line naming the stage, no run folder, nothing trained."""
    from train_cli import run_train

    run = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    done = run_train(*OVERRIDES, f"cluster.stages.1.memory_gib={(PEAK - 1) / 2**30!r}",
                     f"run_dir={run}")
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"ldt: does not fit: stage 1 (s1, ranks 1) needs "
                               f"{PEAK / 2**20:.2f} MiB per rank (estimate) but "
                               f"cluster.stages[1].memory_gib={(PEAK - 1) / 2**30:g}; "), lines[0]
    assert "Traceback" not in done.stderr and not run.exists()
    assert "step" not in done.stdout  # nothing trained


# train.schedule=zb (each backward split into B and a later W, docs/zero_bubble.md): one
# micro-batch's W store entry, from its B to its W, is what the linear layers' weight
# gradients need: each layer's input and output gradient. The middle stage's layer: QKV
# [s, b, h] in, [s, b, 3h] out; the projection [s, b, h] and [s, b, h]; fc1 [s, b, h] and
# [s, b, f]; fc2 [s, b, f] and [s, b, h]. The last stage adds the head's input [s, b, h] and
# the logits' gradient [s, b, V] (fp32 here).
WSTORE_LAYER = (1 + 3 + 1 + 1 + 1 + 1) * T + 2 * S * B * F * FP32
WSTORE_HEAD = T + S * B * V * FP32
# a W makes the split layers' weight gradients (QKV h x 3h, projection h x h, fc1 h x f, fc2
# f x h; the head's V x h on the last stage) one at a time, each taken by DDP's hook before
# the next: its transient is the largest, and W's graph's two fp32 scalars
WGRAD_LAYER = FP32 * max(H * 3 * H, H * H, H * F, F * H)
WGRAD_HEAD = FP32 * V * H


# recomputation per stage (docs/memory.md) beside zb: whole layers on the first stage, the
# attention on the middle one, a block on the last. A recomputing B re-runs the forward inside
# the W store's capture, so the entry (the linear layers' inputs and output gradients) is
# the same; what shrinks is what the forward keeps
RECOMPUTE_PER_STAGE = ["cluster.stages.0.recompute.granularity=full",
                       "cluster.stages.0.recompute.method=uniform",
                       "cluster.stages.0.recompute.num_layers=1",
                       "cluster.stages.1.recompute.granularity=selective",
                       "cluster.stages.2.recompute.granularity=full",
                       "cluster.stages.2.recompute.method=block",
                       "cluster.stages.2.recompute.num_layers=1"]


@pytest.mark.parametrize("recompute", [[], RECOMPUTE_PER_STAGE], ids=["none", "per_stage"])
def test_a_zero_bubble_run_counts_its_w_store(monkeypatch, recompute):
    """Under train.schedule=zb each stage's W store entry is the hand count above (8192 and
    16896 bytes, measured on megatron's layers through the wgrad_split patch); the peak adds
    the entries the run's own order (generated from its prices) holds at that moment, never
    more than the simulator's ``peak_wstore``; the planner's cost model prices the same
    entry. With recomputation per stage the entry is the same and the middle stage keeps
    less than ``ACTIVATIONS`` (the estimate did recompute)."""
    from omegaconf import OmegaConf

    from ldt.config import typed_config
    from ldt.job.hydra import compose
    from ldt.memory import stages
    from ldt.memory.stages import estimate_here
    from ldt.plan.cost import ChunkLoad, CostModel
    from ldt.plan.zb_prices import nominal_inventory, run_prices
    from ldt.schedule import lower, simulate
    from ldt.schedule.zerobubble import zb_h1

    cfg = OmegaConf.to_container(compose(OVERRIDES + ["train.schedule=zb", *recompute]),
                                 resolve=True)
    measured = _recorded(monkeypatch, stages)
    got = estimate_here(cfg)
    assert (got[1].activations[0] < ACTIVATIONS) == bool(recompute), got[1].activations
    for m, largest in zip(measured, (WGRAD_LAYER, WGRAD_LAYER, max(WGRAD_LAYER, WGRAD_HEAD))):
        (chunk,) = m.chunks
        assert largest <= chunk.wgrad_transient <= largest + 2 * FP32, (m, chunk)
    assert [s.wstore for s in got] == [[WSTORE_LAYER], [WSTORE_LAYER],
                                       [WSTORE_LAYER + WSTORE_HEAD]]
    assert (WSTORE_LAYER, WSTORE_HEAD) == (8192, 8704)
    c = typed_config(cfg)
    costs, comm = run_prices(c.cluster, c.model, c.train).tables()
    sim = simulate(lower(zb_h1(3, M, costs, comm), "1f1b"), costs, comm)
    for s in got:
        assert 1 <= s.wstore_held[0] <= sim.peak_wstore[s.index], (s.index, s.wstore_held)
        assert s.components()["W store"] == s.wstore_bytes == s.wstore[0] * s.wstore_held[0]
        assert s.peak == (s.resident + s.activation_bytes + s.buffer_bytes + s.wstore_bytes
                          + s.transient)
    cost = CostModel(typed_config(cfg).model, nominal_inventory(["cpu"]), B)
    assert cost.wstore_bytes(1, ChunkLoad(1)) == WSTORE_LAYER
    assert cost.wstore_bytes(1, ChunkLoad(1, head=True)) == WSTORE_LAYER + WSTORE_HEAD
