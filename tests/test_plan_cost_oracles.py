"""The cost model (ldt/plan/cost.py) held to figures it does not compute itself.

* Parameters per rank come from ``ldt.models.arch.full_shapes`` (the shape table every
  checkpoint is checked against, itself checked against megatron-core's built modules in
  test_hf.py / test_models.py) and ``ldt.models.sharding``'s split rules, for every family and
  TP size: biases, norms, GQA, gated MLPs, position tables, tied heads.
* Times come from hand arithmetic on a made-up inventory whose numbers make each term visible
  (1 TFLOP/s, MFU 0.5, TP efficiency 0.5 per doubling, links of round bandwidths).

The activation-memory model (``*_activation_bytes``) is checked against a measurement in its own
test (#24), not here.
"""

from __future__ import annotations

import math

import pytest

from ldt.config import ModelConfig
from ldt.plan.cost import GB, GIB, ChunkLoad, CostModel, ring_allreduce_time
from ldt.plan.inventory import DeviceKind, Inventory, Link

FAMILIES = {
    # GPT: LayerNorm (weight + bias), biases everywhere, a learned position table, 4h MLP
    "gpt": ModelConfig(name="gpt", num_layers=2, hidden_size=64, num_attention_heads=4,
                       vocab_size=256, seq_length=32, max_position_embeddings=48),
    # Llama: RMSNorm, no biases, GQA, SwiGLU (fc1 is 2f wide), RoPE (no position table)
    "llama": ModelConfig(name="llama", num_layers=2, hidden_size=64, num_attention_heads=8,
                         num_query_groups=2, ffn_hidden_size=96, vocab_size=300, seq_length=32,
                         position_embedding_type="rope", normalization="RMSNorm",
                         gated_linear_unit=True, activation="swiglu", add_bias_linear=False),
    # Qwen2: as Llama, plus a QKV bias only
    "qwen2": ModelConfig(name="qwen2", num_layers=2, hidden_size=64, num_attention_heads=8,
                         num_query_groups=4, ffn_hidden_size=160, vocab_size=300, seq_length=32,
                         position_embedding_type="rope", normalization="RMSNorm",
                         gated_linear_unit=True, activation="swiglu", add_bias_linear=False,
                         add_qkv_bias=True),
}


def _per_rank(model: ModelConfig, prefix: str, tp: int) -> float:
    """Elements per TP rank of every parameter named ``prefix...`` in the checkpoint table."""
    from ldt.models.arch import full_shapes
    from ldt.models.sharding import split_dim

    total = 0.0
    for name, shape in full_shapes(model).items():
        if name.startswith(prefix):
            total += math.prod(shape) / (tp if split_dim(name) is not None else 1)
    return total


def _inventory(**kind) -> Inventory:
    """Two kinds with round numbers: 'gpu' (cuda) and 'npu' (npu), and a cpu 'host'."""
    base = dict(count=8, tflops=1.0, memory_gib=10.0, intra_bw_gbps=4.0, mfu=0.5,
                tp_efficiency=0.5, host_bw_gbps=2.0, reserved_gib=1.5)
    kinds = [DeviceKind(name="gpu", device="cuda", **{**base, **kind}),
             DeviceKind(name="npu", device="npu", **base),
             DeviceKind(name="host", device="cpu", **base)]
    links = [Link("gpu", "gpu", 8.0, 10.0), Link("gpu", "npu", 1.0, 100.0),
             Link("npu", "npu", 8.0, 10.0), Link("gpu", "host", 0.5, 0.0)]
    return Inventory(name="round", kinds=kinds, links=links)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_parameters_per_rank_match_the_checkpoint_shapes(family, tp):
    model = FAMILIES[family]
    cost = CostModel(model, _inventory(), micro_batch_size=1)
    layer = _per_rank(model, "decoder.layers.0.", tp)
    embedding = _per_rank(model, "embedding.", tp)
    head = _per_rank(model, "output_layer.", tp) + _per_rank(model, "decoder.final_layernorm.", tp)
    assert cost.layer_params(tp) == layer
    assert cost.embedding_params(tp) == embedding
    assert cost.head_params(tp) == head
    assert cost.head_params(tp, shares_embedding=True) == head - _per_rank(model, "output_layer.",
                                                                           tp)
    whole = ChunkLoad(2, embedding=True, head=True)
    assert cost.chunk_params(tp, whole) == 2 * layer + embedding + head
    assert cost.chunk_params(tp, ChunkLoad(1)) == layer
    assert cost.chunk_params(tp, ChunkLoad(1, head=True), shares_embedding=True) == \
        layer + head - _per_rank(model, "output_layer.", tp)
    if tp == 1:  # the whole model, once
        assert cost.chunk_params(1, whole) == _per_rank(model, "", 1)


@pytest.mark.parametrize("dtype, optimizer_bytes", [("float32", 8), ("bfloat16", 12)])
def test_stage_memory_counts_weights_grads_and_adam_state(dtype, optimizer_bytes):
    """d bytes of weights per parameter, 4 of gradients (ldt's megatron DDP reduces into fp32
    buffers: grad_reduce_in_fp32 with fp32 main params, ldt/training/optim.py; measured by
    ldt-memory), plus Adam's state: fp32 m and v (8 bytes), and with 16-bit weights an fp32
    main copy too (12). A tied head on the embedding's stage is one parameter."""
    base = FAMILIES["gpt"]
    tied = ModelConfig(**{**base.__dict__, "tie_embeddings": True, "params_dtype": dtype})
    untied = ModelConfig(**{**base.__dict__, "params_dtype": dtype})
    d = 4 if dtype == "float32" else 2
    chunks = [ChunkLoad(1, embedding=True), ChunkLoad(1, head=True)]
    for model, output in ((untied, _per_rank(base, "output_layer.", 2)), (tied, 0)):
        params = (2 * _per_rank(base, "decoder.layers.0.", 2) + _per_rank(base, "embedding.", 2)
                  + _per_rank(base, "decoder.final_layernorm.", 2) + output)
        mem = CostModel(model, _inventory(), 1).stage_memory("gpu", 2, chunks)
        assert (mem.weights, mem.grads, mem.optimizer) == (params * d, params * 4,
                                                           params * optimizer_bytes)
    # tied, but the embedding lives elsewhere (a plain pipeline's last stage): the head's own
    head_only = CostModel(tied, _inventory(), 1).stage_memory("gpu", 2, [ChunkLoad(1, head=True)])
    assert head_only.weights == d * (_per_rank(base, "decoder.layers.0.", 2)
                                     + _per_rank(base, "decoder.final_layernorm.", 2)
                                     + _per_rank(base, "output_layer.", 2))


def test_flops_by_hand():
    """b=2, s=32, h=64, f=256 (4h), a=4, V=256: 24bsh^2 + 4bs^2h per layer, 2bshV the head."""
    cost = CostModel(FAMILIES["gpt"], _inventory(), micro_batch_size=2)
    assert cost.layer_flops() == 24 * 2 * 32 * 64 * 64 + 4 * 2 * 32 * 32 * 64 == 6_815_744
    assert cost.head_flops() == 2 * 2 * 32 * 64 * 256 == 2_097_152
    llama = CostModel(FAMILIES["llama"], _inventory(), micro_batch_size=1)
    qkv = 64 + 2 * 64 * 2 // 8  # 96: GQA, 2 groups of 8 heads
    assert llama.layer_flops() == (2 * 32 * 64 * qkv + 2 * 32 * 64 * 64 + 2 * 32 * 64 * 192
                                   + 2 * 32 * 96 * 64 + 4 * 32 * 32 * 64)


def test_times_by_hand():
    """gpu: 1 TFLOP/s peak, MFU 0.5, TP efficiency 0.5 per doubling, 4 GB/s inside a node."""
    cost = CostModel(FAMILIES["gpt"], _inventory(), micro_batch_size=2)  # fp32: d = 4
    flops, head = 6_815_744, 2_097_152
    speed1, speed4 = 0.5e12, 4 * 0.5e12 * 0.25  # TP 4: two doublings at 0.5 each
    ar4 = 2 * 3 / 4 * (2 * 32 * 64 * 4) / 4e9  # ring all-reduce of b*s*h fp32 over 4 ranks
    assert cost.layer_time("gpu", 1) == (flops / speed1, 2 * flops / speed1)
    assert cost.layer_time("gpu", 4) == pytest.approx((flops / speed4 + 2 * ar4,
                                                       2 * flops / speed4 + 2 * ar4), rel=1e-12)
    assert cost.embedding_time("gpu", 1) == (0.0, 0.0)
    assert cost.embedding_time("gpu", 4) == pytest.approx((ar4, 0.0), rel=1e-12)
    assert cost.head_time("gpu", 1) == (head / speed1, 2 * head / speed1)
    assert cost.head_time("gpu", 4) == pytest.approx((head / speed4, 2 * head / speed4 + ar4),
                                                     rel=1e-12)
    lf, lb = cost.layer_time("gpu", 4)
    hf, hb = cost.head_time("gpu", 4)
    ef, eb = cost.embedding_time("gpu", 4)
    assert cost.chunk_time("gpu", 4, ChunkLoad(3, embedding=True, head=True)) == pytest.approx(
        (3 * lf + ef + hf, 3 * lb + eb + hb), rel=1e-12)
    assert cost.chunk_time("gpu", 4, ChunkLoad(2)) == pytest.approx((2 * lf, 2 * lb), rel=1e-12)


def test_transfers_by_hand():
    cost = CostModel(FAMILIES["gpt"], _inventory(), micro_batch_size=2)
    nbytes = 2 * 32 * 64 * 4  # b*s*h fp32
    assert cost.boundary_bytes() == nbytes == 16384
    # same device type: the link (8 GB/s, 10 us); TP 2 on the receiving side: 16 KiB is at
    # most 64 KiB, so the sender sends a copy to each of its 2 ranks (no relay)
    assert cost.boundary_time("gpu", "gpu", 1) == pytest.approx(nbytes / 8e9 + 10e-6)
    assert cost.boundary_time("gpu", "gpu", 2) == pytest.approx(2 * nbytes / 8e9 + 10e-6)
    # from a TP 2 stage each sending rank sends one of the copies (TP rank i to TP rank i);
    # with the sequence sharded over them the leader gathers it and sends both
    assert cost.boundary_time("gpu", "gpu", 2, 2) == pytest.approx(nbytes / 8e9 + 10e-6)
    assert cost.boundary_time("gpu", "gpu", 3, 2) == pytest.approx(2 * nbytes / 8e9 + 10e-6)
    sp = CostModel(ModelConfig(**{**FAMILIES["gpt"].__dict__, "sequence_parallel": True}),
                   _inventory(), micro_batch_size=2)
    assert sp.boundary_time("gpu", "gpu", 2, 2) == pytest.approx(2 * nbytes / 8e9 + 10e-6)
    # per-stage DP: no group spans both stages, so even 16 KiB crosses once and the leader
    # relays it to its TP rank (4 GB/s inside the node)
    assert cost.boundary_time("gpu", "gpu", 2, 2, per_stage_dp=True) == pytest.approx(
        nbytes / 8e9 + 10e-6 + nbytes / 4e9)
    assert cost.boundary_time("gpu", "gpu", 1, 2, per_stage_dp=True) == pytest.approx(
        nbytes / 8e9 + 10e-6)
    # 8x the micro-batch: 128 KiB crosses once, whole (one piece), and the leader relays it
    big = CostModel(FAMILIES["gpt"], _inventory(), micro_batch_size=16)
    assert big.boundary_time("gpu", "gpu", 2) == pytest.approx(8 * nbytes / 8e9 + 10e-6
                                                               + 8 * nbytes / 4e9)
    # cuda -> npu: host-staged, a copy off the GPU and one onto the NPU at 2 GB/s each
    assert cost.boundary_time("gpu", "npu", 1) == pytest.approx(nbytes / 1e9 + 100e-6
                                                                + 2 * nbytes / 2e9)
    # cuda -> cpu: host-staged, but the CPU side needs no copy
    assert cost.boundary_time("gpu", "host", 1) == pytest.approx(nbytes / 0.5e9 + nbytes / 2e9)
    # the DP all-reduce of 1000 gradients (fp32) over 4 replicas on the gpu self-link, 8 GB/s
    assert cost.dp_allreduce_time("gpu", 1000, 4) == pytest.approx(2 * 3 / 4 * 4000 / 8e9)
    assert cost.dp_allreduce_time("gpu", 1000, 1) == 0.0
    # a bf16 run reduces its fp32 gradient buffer too (grad_reduce_in_fp32, fp32 main params)
    bf16 = CostModel(FAMILIES["gpt"], _inventory(), 1, dtype="bfloat16")
    assert bf16.dp_allreduce_time("gpu", 1000, 4) == pytest.approx(2 * 3 / 4 * 4000 / 8e9)


def test_ring_allreduce_and_memory_limit():
    assert ring_allreduce_time(8e9, 1, 1.0) == 0.0  # one rank: nothing moves
    assert ring_allreduce_time(8e9, 2, 1.0) == pytest.approx(8.0)  # 2(n-1)/n = 1 of 8 GB at 1
    assert ring_allreduce_time(8e9, 4, 2.0) == pytest.approx(6.0)  # 1.5 * 8 GB / 2 GB/s
    assert ring_allreduce_time(1.0, 0, 1.0) == 0.0
    cost = CostModel(FAMILIES["gpt"], _inventory(), 1)
    assert cost.memory_limit("gpu") == (10.0 - 1.5) * GIB
    assert GB == 1e9 and GIB == 2**30


def test_dtype_and_sequence_parallel_settings():
    """The dtype decides the bytes per element (fp32 4, bf16 2), the workload may override the
    model's; sequence parallelism splits over TP only when on and TP > 1."""
    gpt = FAMILIES["gpt"]
    assert CostModel(gpt, _inventory(), 1).boundary_bytes() == 32 * 64 * 4
    assert CostModel(gpt, _inventory(), 1, dtype="bfloat16").boundary_bytes() == 32 * 64 * 2
    plain = CostModel(gpt, _inventory(), 1)
    sp = CostModel(ModelConfig(**{**gpt.__dict__, "sequence_parallel": True}), _inventory(), 1)
    assert (plain.sequence_shards(4), sp.sequence_shards(4), sp.sequence_shards(1)) == (1, 4, 1)
    assert gpt.ffn_hidden_size is None and plain.f == 4 * 64  # the MLP's default width


# ---- recomputation (per stage) and activation memory, by hand --------------------------------
# gpt (fp32, h 64, a 4, s 32, f 256, V 256, LayerNorm, biases, learned positions), micro-batch
# 1, flash attention: per token and layer at TP 1, the norms' part keeps the two norm inputs
# and the QKV and fc1 inputs (4 h fp32 = 1024 bytes; torch's LayerNorm keeps only per-token
# statistics), QKV's output 3h (768), flash's log-sum-exp per head (4 a = 16), the
# projection's input h (256), the MLP's fc1 output and fc2 input (2 f = 2048): 4112 bytes.
GPT_TOKEN = {"norms": 1024.0, "qkv": 768.0, "core_attn": 16.0, "attn_out": 256.0,
             "mlp": 2048.0}
GPT_LAYER = 32 * sum(GPT_TOKEN.values())  # 131584 bytes per layer and micro-batch
GPT_BOUNDARY = 32 * 64 * 4  # an [s, b, h] fp32 tensor


def test_recompute_settings_read_write_and_describe():
    from ldt.config import RecomputeConfig
    from ldt.plan.memory_cost import Recompute

    assert Recompute.of(None) is None
    assert Recompute.of(RecomputeConfig()) is None  # the model's setting: none here
    assert Recompute.of(RecomputeConfig("none")) is None
    full = Recompute.of(RecomputeConfig("full", "block", 2))
    assert full == Recompute("full", "block", 2, ())
    assert full.config() == {"granularity": "full", "method": "block", "num_layers": 2}
    assert full.describe() == "full/block/2"
    sel = Recompute.of(RecomputeConfig("selective", modules=["layernorm", "mlp"]))
    assert sel == Recompute("selective", None, None, ("layernorm", "mlp"))
    assert sel.config() == {"granularity": "selective", "modules": ["layernorm", "mlp"]}
    assert sel.describe() == "selective(layernorm,mlp)"
    default = Recompute.of(RecomputeConfig("selective"))
    assert default == Recompute("selective") and default.modules == ()
    assert default.config() == {"granularity": "selective"} and default.describe() == "selective"


def test_layer_parts_and_selective_recomputation_by_hand():
    """The parts of a gpt layer (GPT_TOKEN); each recomputed module drops its own part
    (layernorm: the norm outputs, i.e. the QKV and fc1 inputs, 2 h); TP 2 halves the split
    parts; local attention keeps the fp32 softmax per score and the mask (4 a + 1) s."""
    from ldt.plan.memory_cost import Recompute

    cost = CostModel(FAMILIES["gpt"], _inventory(), 1)
    assert cost.layer_parts("gpu", 1) == GPT_TOKEN
    assert cost.layer_parts("gpu", 2) == {"norms": 1024.0, "qkv": 384.0, "core_attn": 8.0,
                                          "attn_out": 128.0, "mlp": 1024.0}
    assert cost.layer_activation_bytes("gpu", 1) == GPT_LAYER == 131584
    dropped = {"core_attn": 16, "mlp": 2048, "layernorm": 512}
    for module, less in dropped.items():
        rc = Recompute("selective", modules=(module,))
        assert cost.layer_activation_bytes("gpu", 1, rc) == 32 * (4112 - less), module
    both = Recompute("selective", modules=("layernorm", "mlp"))
    assert cost.layer_activation_bytes("gpu", 1, both) == 32 * (4112 - 512 - 2048)
    assert cost.layer_activation_bytes("gpu", 1, Recompute("selective")) == 32 * (4112 - 16)
    assert cost.layer_activation_bytes("gpu", 1, Recompute("full", "uniform", 1)) == GPT_LAYER
    local = CostModel(FAMILIES["gpt"], _inventory(), 1, flash_attention=False)
    assert local.layer_parts("gpu", 1)["core_attn"] == (4 * 4 + 1) * 32
    assert local.layer_parts("gpu", 2)["core_attn"] == (4 * 4 + 1) * 32 / 2


def test_attention_is_priced_per_stage_as_training_runs_it():
    """A cuda stage runs Transformer Engine's fused attention (the log-sum-exp, 4 a bytes per
    token), an npu or cpu stage megatron's local attention ((4 a + 1) s: fp32 scores and the
    mask), as the memory estimate builds them; ``transformer_impl: local`` makes cuda local
    too, and ``flash_attention`` forces one for every stage. The planner used to price flash
    everywhere: Ascend stages then did not fit when trained (llama_7b's edge_cloud plan:
    54.36 GiB planned, 100.81 GiB estimated)."""
    from ldt.memory.measure import attention_of

    flash, local = 4 * 4, (4 * 4 + 1) * 32
    auto = CostModel(FAMILIES["gpt"], _inventory(), 1)
    assert [auto.layer_parts(k, 1)["core_attn"] for k in ("gpu", "npu", "host")] == \
        [flash, local, local]
    no_te = CostModel(ModelConfig(**{**FAMILIES["gpt"].__dict__, "transformer_impl": "local"}),
                      _inventory(), 1)
    assert no_te.layer_parts("gpu", 1)["core_attn"] == local
    for forced, core in ((True, flash), (False, local)):
        cost = CostModel(FAMILIES["gpt"], _inventory(), 1, flash_attention=forced)
        assert {cost.layer_parts(k, 1)["core_attn"] for k in ("gpu", "npu", "host")} == {core}
    for model in (auto, no_te):  # the same rule as the estimate's (one function, asked twice)
        for kind in _inventory().kinds:
            want = "flash" if model.flash(kind.name) else "local"
            assert attention_of(model.model, kind.device) == want, (kind.device, want)
    chunks = [ChunkLoad(2, inflight=2)]
    assert auto.stage_memory("npu", 1, chunks).activations - \
        auto.stage_memory("gpu", 1, chunks).activations == 2 * 2 * 32 * (local - flash)
    assert auto.stage_memory("npu", 1, chunks) == auto.stage_memory("host", 1, chunks)


def test_full_recomputation_keeps_each_groups_input_by_hand():
    """uniform n: one [s, b, h] input per group of n layers (5 layers, n 2: 3 groups); block
    n: the first n layers keep their input, the rest everything; selective: every layer
    without the recomputed module."""
    from ldt.plan.memory_cost import Recompute

    cost = CostModel(FAMILIES["gpt"], _inventory(), 1)
    assert cost.decoder_activation_bytes("gpu", 1, 5) == 5 * GPT_LAYER
    assert cost.decoder_activation_bytes("gpu", 1, 5, Recompute("full", "uniform", 2)) == \
        3 * GPT_BOUNDARY
    assert cost.decoder_activation_bytes("gpu", 1, 4, Recompute("full", "uniform", 2)) == \
        2 * GPT_BOUNDARY
    assert cost.decoder_activation_bytes("gpu", 1, 5, Recompute("full", "block", 2)) == \
        2 * GPT_BOUNDARY + 3 * GPT_LAYER
    assert cost.decoder_activation_bytes("gpu", 1, 5, Recompute("full", "block", 7)) == \
        5 * GPT_BOUNDARY
    assert cost.decoder_activation_bytes("gpu", 1, 5, Recompute("selective", modules=("mlp",))) == \
        5 * 32 * (4112 - 2048)


def test_recomputation_repeats_the_forward_it_drops_by_hand():
    """gpu, TP 1: 0.5 TFLOP/s achieved. Full: every layer's forward again (uniform), or the
    first n layers' (block); selective: the attention core 4bs^2h (default) and the MLP
    2bsh f + 2bsf h; the norms cost nothing. At TP 4, full repeats the layer's forward with
    its all-reduces; selective runs at the TP group's speed."""
    from ldt.plan.memory_cost import Recompute

    cost = CostModel(FAMILIES["gpt"], _inventory(), micro_batch_size=2)
    fwd1, fwd4 = cost.layer_time("gpu", 1)[0], cost.layer_time("gpu", 4)[0]
    core, mlp = 4 * 2 * 32 * 32 * 64, 2 * (2 * 2 * 32 * 64 * 256)
    speed1, speed4 = 0.5e12, 4 * 0.5e12 * 0.25
    assert cost.recompute_time("gpu", 1, 3, None) == 0.0
    assert cost.recompute_time("gpu", 1, 3, Recompute("full", "uniform", 2)) == 3 * fwd1
    assert cost.recompute_time("gpu", 4, 3, Recompute("full", "uniform", 1)) == 3 * fwd4
    assert cost.recompute_time("gpu", 1, 3, Recompute("full", "block", 2)) == 2 * fwd1
    assert cost.recompute_time("gpu", 1, 3, Recompute("full", "block", 9)) == 3 * fwd1
    assert cost.recompute_time("gpu", 1, 3, Recompute("selective")) == 3 * core / speed1
    assert cost.recompute_time("gpu", 4, 3, Recompute("selective", modules=("mlp",))) == \
        pytest.approx(3 * mlp / speed4, rel=1e-12)
    assert cost.recompute_time("gpu", 1, 2, Recompute("selective", modules=(
        "core_attn", "layernorm", "mlp"))) == pytest.approx(2 * (core + mlp) / speed1, rel=1e-12)
    assert cost.recompute_time("gpu", 1, 2, Recompute("selective", modules=("layernorm",))) == 0
    # a MoE model (every layer, 4 experts of width 32, top 2, no gate): selective moe runs
    # the router (2bsh E) and two experts per token (2 x (2bsh 32 + 2bs 32 h)) again, with
    # its token dispatch (an all-gather and a reduce-scatter of bsh: one ring all-reduce's
    # time); mlp recomputes no MoE layer's MLP
    from dataclasses import replace

    moe = CostModel(replace(FAMILIES["gpt"], add_bias_linear=False, num_moe_experts=4,
                            moe_ffn_hidden_size=32), _inventory(), micro_batch_size=2)
    moe_flops = 2 * 2 * 32 * 64 * 4 + 2 * (2 * (2 * 2 * 32 * 64 * 32))
    dispatch = moe._tp_allreduce(_inventory().kind("gpu"), 4)
    assert moe.recompute_time("gpu", 4, 3, Recompute("selective", modules=("moe",))) == \
        pytest.approx(3 * (moe_flops / speed4 + dispatch), rel=1e-12)
    assert moe.recompute_time("gpu", 4, 3, Recompute("selective", modules=("mlp",))) == 0
    assert cost.recompute_time("gpu", 4, 3, Recompute("selective", modules=("moe",))) == 0
    lf, lb = cost.layer_time("gpu", 1)
    rc = Recompute("selective", modules=("mlp",))
    assert cost.chunk_time("gpu", 1, ChunkLoad(3, recompute=rc)) == pytest.approx(
        (3 * lf, 3 * lb + 3 * mlp / speed1), rel=1e-12)


def test_stage_memory_by_hand():
    """An edge-like stage at TP 1 (fp32, b 1): a start chunk (2 layers, the embedding, 3
    micro-batches in flight) and an end chunk (1 layer, the head, 1 in flight), 2 receive
    buffers. Activations: the layers, the embedding's output, the end chunk's received
    input, the head's final-norm input, its input and its fp32 logits (4 V); buffers: 2
    whole [s, b, h]; transient: 4 [s, b, h] (two gradients, two sends still held) and the
    logits' gradient s b V d. Asked again, the same answer (memoized by its arguments)."""
    cost = CostModel(FAMILIES["gpt"], _inventory(), 1)
    chunks = [ChunkLoad(2, embedding=True, inflight=3), ChunkLoad(1, head=True, inflight=1)]
    head = 32 * (4 * 64 + 4 * 64 + 4 * 256)
    mem = cost.stage_memory("gpu", 1, chunks, recv_buffers=2)
    assert mem.activations == 3 * (2 * GPT_LAYER + GPT_BOUNDARY) + (GPT_LAYER + GPT_BOUNDARY
                                                                     + head)
    assert mem.buffers == 2 * GPT_BOUNDARY
    assert mem.transient == 4 * GPT_BOUNDARY + 4 * 32 * 256
    assert mem.total == mem.weights + mem.grads + mem.optimizer + mem.activations + \
        mem.buffers + mem.transient
    assert cost.stage_memory("gpu", 1, chunks, recv_buffers=2) is mem
    other = cost.stage_memory("gpu", 1, chunks, recv_buffers=1)
    assert other.buffers == GPT_BOUNDARY and other.activations == mem.activations
    middle = cost.stage_memory("gpu", 1, [ChunkLoad(2, inflight=2)])
    assert (middle.buffers, middle.transient) == (0, 4 * GPT_BOUNDARY)
    assert middle.activations == 2 * (2 * GPT_LAYER + GPT_BOUNDARY)


def test_stage_memory_with_sequence_parallelism_at_tp2_by_hand():
    """gpt with sequence parallelism, TP 2, b 2 (fp32): a received tensor waits whole in the
    leader's buffer (s b h d, not the rank's slice), the transient holds 4 whole ones and the
    logits' gradient s b V d / 2; full block recomputation keeps each kept layer's input as
    the rank's sequence slice (s b h d / 2)."""
    from dataclasses import replace

    from ldt.plan.memory_cost import Recompute

    cost = CostModel(replace(FAMILIES["gpt"], sequence_parallel=True), _inventory(), 2)
    whole = 32 * 2 * 64 * 4
    mem = cost.stage_memory("gpu", 2, [ChunkLoad(1, head=True)], recv_buffers=1)
    assert mem.buffers == whole
    assert mem.transient == 4 * whole + 32 * 2 * 256 * 4 / 2
    block = Recompute("full", "block", 2)
    assert cost.decoder_activation_bytes("gpu", 2, 3, block) == \
        2 * whole / 2 + cost.layer_activation_bytes("gpu", 2)


def test_layer_parts_of_grouped_query_rope_and_moe_layers_by_hand():
    """A grouped-query layer without RoPE keeps a contiguous copy of q beside the fused QKV
    output (q 64 + k 32 + v 32 + the copy 64 = 192 wide, fp32); RoPE's cos / sin tables cover
    the rotated part of a head (rotary_percent 0.5 of llama's head of 8: 4 wide, 4 bytes x 4 x
    fp32 = 64 bytes a token, against 128 whole); a MoE layer (every layer, 4 experts of width
    32, top 2, no gate) keeps the router's fp32 probabilities (4 x 4 bytes) and, per routed
    copy, the token (h) and the expert's fc1 output and fc2 input ((32 + 32) / tp)."""
    from dataclasses import replace

    from ldt.plan.memory_cost import Recompute

    gqa = CostModel(replace(FAMILIES["gpt"], num_query_groups=2), _inventory(), 1)
    assert gqa.layer_parts("gpu", 1)["qkv"] == 4 * 192
    assert gqa.layer_parts("gpu", 2)["qkv"] == 4 * 192 / 2
    llama = FAMILIES["llama"]
    whole = CostModel(llama, _inventory(), 1).layer_parts("gpu", 1)["qkv"]
    half = CostModel(replace(llama, rotary_percent=0.5), _inventory(), 1).layer_parts("gpu", 1)["qkv"]
    assert whole - half == 4 * (8 - 4) * 4
    moe = CostModel(replace(FAMILIES["gpt"], add_bias_linear=False, num_moe_experts=4,
                            moe_ffn_hidden_size=32), _inventory(), 1)
    assert moe.layer_parts("gpu", 1)["mlp"] == 4 * 4 + 2 * 4 * (64 + 32 + 32)
    assert moe.layer_parts("gpu", 2)["mlp"] == 4 * 4 + 2 * 4 * (64 + (32 + 32) / 2)
    # gated experts (SwiGLU): fc1's output is 2 x 32 wide, and each copy keeps the gate's
    # two products as a gated dense MLP does (2 x 32), whatever the dense MLP's width
    swiglu = CostModel(replace(llama, num_moe_experts=4, moe_ffn_hidden_size=32), _inventory(),
                       1)
    assert swiglu.layer_parts("gpu", 1)["mlp"] == 4 * 4 + 2 * 4 * (64 + 64 + 32 + 64)
    assert swiglu.layer_parts("gpu", 2)["mlp"] == 4 * 4 + 2 * 4 * (64 + (64 + 32 + 64) / 2)
    # selective moe: the MoE layer's whole MLP part is dropped; mlp drops nothing there
    for model in (moe, swiglu):
        parts = model.layer_parts("gpu", 2)
        tokens = model.s * model.b
        assert model.layer_activation_bytes("gpu", 2, Recompute("selective", modules=(
            "moe",))) == pytest.approx(tokens * (sum(parts.values()) - parts["mlp"]), rel=1e-12)
        assert model.layer_activation_bytes("gpu", 2, Recompute("selective", modules=(
            "mlp",))) == pytest.approx(tokens * sum(parts.values()), rel=1e-12)


def test_recomputation_rebuilds_in_the_backward_what_it_dropped_by_hand():
    """One micro-batch's backward rebuilds a full uniform group (n layers at once), the last
    layer when block recomputes every layer of the chunk (with fewer, the recomputed layers
    run after the kept ones were freed: nothing more), a selective recomputation's modules
    of one layer; the stage's transient adds it (measured with the estimator on megatron's
    layers, h 16, two layers: +1 and +2 layers, +0.06 of one, +the norms' part)."""
    from ldt.plan.memory_cost import Recompute

    cost = CostModel(FAMILIES["gpt"], _inventory(), 1)
    rebuilt = {Recompute("full", "uniform", 1): GPT_LAYER,
               Recompute("full", "uniform", 2): 2 * GPT_LAYER,
               Recompute("full", "uniform", 5): 3 * GPT_LAYER,
               Recompute("full", "block", 2): 0.0, Recompute("full", "block", 3): GPT_LAYER,
               Recompute("selective", modules=("mlp",)): 32 * 2048.0,
               Recompute("selective", modules=("layernorm",)): 32 * 512.0}
    for rc, extra in rebuilt.items():
        assert cost.recompute_transient("gpu", 1, ChunkLoad(3, recompute=rc)) == extra, rc
        mem = cost.stage_memory("gpu", 1, [ChunkLoad(3, recompute=rc)])
        assert mem.transient == 4 * GPT_BOUNDARY + extra, rc
    assert cost.recompute_transient("gpu", 1, ChunkLoad(3)) == 0.0
    assert cost.recompute_transient("gpu", 1, ChunkLoad(0, head=True, recompute=Recompute(
        "full", "uniform", 1))) == 0.0
    assert cost.recompute_transient("gpu", 1, ChunkLoad(1, recompute=Recompute(
        "full", "uniform", 1))) == GPT_LAYER  # a one-layer chunk rebuilds its layer


def test_a_faster_kind_computes_proportionally_faster():
    """The achieved speed is tp x TFLOP/s x MFU x TP efficiency^log2(tp): at TP 1 a kind of 2
    TFLOP/s takes half the time of one of 1 (the other inventories state 1, where tp / tflops and
    tp x tflops agree)."""
    slow = CostModel(FAMILIES["gpt"], _inventory(), 1)
    fast = CostModel(FAMILIES["gpt"], _inventory(tflops=2.0), 1)
    # TP 1: no all-reduce in the layer's time, only its FLOPs
    assert fast.layer_time("gpu", 1) == pytest.approx(
        tuple(t / 2 for t in slow.layer_time("gpu", 1)), rel=1e-12)


def test_the_heads_logits_and_a_recomputed_layer_both_count():
    """The end chunk's backward runs the head (its logits' gradient, s b V d) and then the
    layers (what recomputation rebuilds); the transient counts both (the estimator measured
    more than the logits' gradient alone on llama3_8b's edge: 2.59 GiB against 1.96)."""
    from ldt.plan.memory_cost import Recompute

    cost = CostModel(FAMILIES["gpt"], _inventory(), 1)
    logits = 4 * 32 * 256
    for rc, rebuilt in ((Recompute("full", "uniform", 1), GPT_LAYER),
                        (Recompute("selective", modules=("layernorm",)), 32 * 512.0)):
        mem = cost.stage_memory("gpu", 1, [ChunkLoad(2, head=True, recompute=rc)])
        assert mem.transient == 4 * GPT_BOUNDARY + logits + rebuilt


def test_what_a_zero_bubble_w_needs_by_hand():
    """#42's W: its store per micro-batch (each split linear layer's input and output
    gradient, per token) and its FLOPs (the linear layers' share of a layer's forward, which
    their weight gradient costs again), for a Llama-like TP-2 stage and a half-MoE GPT."""
    from dataclasses import replace

    llama = CostModel(replace(FAMILIES["llama"], vocab_size=512, params_dtype="bfloat16"),
                      _inventory(), 2)
    h, s, b, d, t = 64, 32, 2, 2, 2
    qkv, hd, f = (8 + 2 * 2) * 8, 8 * 8, 96  # 8 heads of 8, 2 query groups; SwiGLU: fc1 2f
    layer = (h + qkv / t) + (hd / t + h) + (h + 2 * f / t) + (f / t + h)
    assert llama.wstore_bytes(t, ChunkLoad(2)) == s * b * d * 2 * layer
    assert llama.wstore_bytes(t, ChunkLoad(1, head=True)) == s * b * d * (layer + h + 512 / t)
    assert llama.layer_linear_flops() == 2 * b * s * (h * qkv + hd * h + h * 2 * f + f * h)

    moe = CostModel(replace(FAMILIES["gpt"], add_bias_linear=False, num_moe_experts=4,
                            moe_ffn_hidden_size=32, moe_layer_freq=[1, 0]), _inventory(), 1)
    h, s, b, d, t, topk, share = 64, 32, 1, 4, 2, 2, 0.5  # fp32; one layer of two is MoE
    qkv, hd, f, fe = 3 * 64, 64, 4 * 64, 32
    dense_mlp, expert = (h + f / t) + (f / t + h), (h + fe / t) + (fe / t + h)
    mlp = share * topk * expert + (1 - share) * dense_mlp
    assert moe.wstore_bytes(t, ChunkLoad(1)) == s * b * d * ((h + qkv / t) + (hd / t + h) + mlp)
    linear = share * topk * 2 * b * s * (h * fe + fe * h) + (1 - share) * 2 * b * s * 2 * h * f
    assert moe.layer_linear_flops() == 2 * b * s * (h * qkv + hd * h) + linear  # no router


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seq_length,dtype,tp", [(1024, "float32", 1), (1024, "bfloat16", 2)])
def test_a_local_attention_stage_is_bounded_from_above(seq_length, dtype, tp):
    """On a stage running megatron's local attention (npu, cpu) at a long sequence, the scores
    and their backward dominate: the planner's total must bound what the estimator measures on
    megatron's own layers (fake tensors, the stage's real chunk) from above, within 10%. It
    left out the attention's backward (llama_tiny at s 1024 fp32: 82 MiB planned, 202 MiB
    measured), so Ascend plans did not fit when trained."""
    import dataclasses

    from ldt import memory
    from ldt.config.load import config_dict
    from ldt.plan.inventory import load_model

    model = dataclasses.replace(load_model("llama_tiny"), seq_length=seq_length, num_layers=2,
                                params_dtype=dtype)
    cfg = {"cluster": {"stages": [{"name": "a", "device": "cpu", "tp": tp}]},
           "model": config_dict(model), "train": {"num_microbatches": 1, "micro_batch_size": 1}}
    (measured,) = memory.estimate(cfg)
    planned = CostModel(model, _inventory(), 1).stage_memory(
        "host", tp, [ChunkLoad(2, embedding=True, head=True)])
    assert measured.peak <= planned.total <= 1.10 * measured.peak, \
        (planned.total / 2**20, measured.peak / 2**20)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", [1, 2])
def test_a_zero_bubble_w_s_own_peak_is_what_the_estimator_measures(tp):
    """A W makes one weight's gradient at a time (autograd hands each to DDP's hook, which adds
    it to ``main_grad`` and drops it, before the next): its own peak is the chunk's largest
    weight gradient. On a head chunk whose head weight dominates, the W is the stage's peak,
    and the planner's ``wgrad_transient`` is the estimator's W transient (megatron's layers,
    the wgrad_split patch), up to W's graph's two scalars. The planner left it out once
    (llama_7b's edge on edge_cloud planned at 21.88 GiB, estimated at 22.41 over its 22),
    then counted every weight's gradient at once and one more copy (W handed autograd
    gradients it still referenced, so autograd copied each)."""
    import dataclasses

    from ldt import memory
    from ldt.config.load import config_dict
    from ldt.plan.inventory import load_model

    model = dataclasses.replace(load_model("llama_tiny"), hidden_size=256, ffn_hidden_size=512,
                                num_layers=4, seq_length=16, params_dtype="bfloat16",
                                vocab_size=4096)
    cfg = {"cluster": {"stages": [{"name": "a", "device": "cpu", "tp": 1},
                                  {"name": "b", "device": "cpu", "tp": tp}]},
           "model": config_dict(model),
           "train": {"num_microbatches": 2, "micro_batch_size": 1, "schedule": "zb"}}
    measured = memory.estimate(cfg)[1].transient
    cost = CostModel(model, _inventory(), 1)
    planned = cost.wgrad_transient(tp, ChunkLoad(2, head=True))
    assert planned <= measured <= planned + 4, (measured, planned)  # two bf16 scalars
    h, f1, f2 = 256, 2 * 512, 512  # by hand: QKV (GQA 8 heads, 4 groups), proj, fc1, fc2
    assert planned == 2 * 4096 * h / tp  # bf16; the head is the largest
    assert cost.wgrad_transient(tp, ChunkLoad(2)) == 2 * max(
        h * (h + 2 * h // 2), h * h, h * f1, f2 * h) / tp  # without it, fc1
