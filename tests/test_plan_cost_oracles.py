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
        mem = CostModel(model, _inventory(), 1).stage_memory(2, chunks)
        assert (mem.weights, mem.grads, mem.optimizer) == (params * d, params * 4,
                                                           params * optimizer_bytes)
    # tied, but the embedding lives elsewhere (a plain pipeline's last stage): the head's own
    head_only = CostModel(tied, _inventory(), 1).stage_memory(2, [ChunkLoad(1, head=True)])
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
