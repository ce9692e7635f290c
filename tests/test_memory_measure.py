"""What the estimate measures on a stage's real chunks, per kind of stage (issue #45): flash
attention's memory on a cuda stage, a sequence-parallel stage's slices and gloo's copy, a
16-bit MoE model with the distributed optimizer on a U-shape. Expected values are counted by
hand from shapes, or are differences the module docstrings name (a term present in one
config and absent from the other); the estimates run in this process, once per config.

The base model and its middle stage's terms are tests/test_memory_total.py's.
"""

from __future__ import annotations

from test_memory_total import (ACTIVATIONS, ADAM, GRADS, OVERRIDES, SCORES, TRANSIENT,
                               WEIGHTS, A, B, F, H, S, T)

FP32 = 4
STAGES = ("cluster.stages=[{name:s0,device:cpu,tp:1},{name:s1,device:cuda,tp:1},"
          "{name:s2,device:%s,tp:2},{name:s3,device:cpu,tp:1}]")
# four stages, one layer each in the middle: s1 a cuda stage, s2 a TP-2 stage with sequence
# parallelism (on cpu, or on cuda in the second config)
MIXED = [STAGES % "cpu", "cluster.layout=Et|t|t|tL", "model.num_layers=4",
         "model.sequence_parallel=true"]
MIXED_CUDA = [STAGES % "cuda", "cluster.layout=Et|t|t|tL", "model.num_layers=4",
              "model.sequence_parallel=true"]
# a U-shape of two stages, each with two replicas, qwen3_moe_tiny's family at h 16 (2 heads
# of 8, 2 query groups, 4 experts of FFN 8, every layer MoE), bf16, the distributed optimizer
MOE = ["model=qwen3_moe_tiny", "cluster.u_shape=true", "cluster.dp=2",
       "cluster.stages=[{name:e,device:cpu,tp:1},{name:c,device:cpu,tp:1}]",
       "cluster.layout=Et|t|tL", "model.num_layers=3", "model.moe_layer_freq=[1,1,1]",
       f"model.hidden_size={H}", f"model.num_attention_heads={A}", "model.kv_channels=8",
       "model.num_query_groups=2", f"model.ffn_hidden_size={F}", "model.moe_ffn_hidden_size=8",
       "model.num_moe_experts=4", "model.params_dtype=bfloat16",
       "train.distributed_optimizer=true"]


def estimated(over: tuple, attention: str = "auto", cluster: bool = True):
    """The estimate of the base config with ``over`` (``cluster=False``: its model and train
    settings only), in this process, in the test itself (mutation testing attributes a
    fixture's or a cache's work to no test)."""
    from omegaconf import OmegaConf

    from ldt.job.hydra import compose
    from ldt.memory.stages import estimate_here

    base = [o for o in OVERRIDES if cluster or not o.startswith("cluster")]
    cfg = OmegaConf.to_container(compose(base + list(over)), resolve=True)
    return estimate_here(cfg, attention)


def test_a_cuda_stage_and_a_sequence_parallel_stage():
    """s1 runs on cuda: Transformer Engine's fused attention there keeps no scores. Against
    the cpu middle stage: no softmax output ([b, heads, s, s] fp32) but the log-sum-exp per
    query and head ([b, heads, s] fp32) in each micro-batch, and no buffer for the scores in
    the transient; the optimizer step (foreach on a cuda stage) leaves the same transient
    here. Asked for local attention everywhere, it is the cpu stage's again.

    s2, TP 2 with sequence parallelism: each rank holds half of every parameter matrix
    (LayerNorms and the row-parallel biases whole), half of every tensor the layer keeps (the
    sequence or the heads split in two), its receive holds the whole [s, b, h] and the slice;
    on a cpu stage gloo's reduce-scatter keeps a whole [s, b, h] copy until its wait
    returns, which a cuda stage (NCCL) does not."""
    lse = B * A * S * FP32
    mixed, on_cuda = estimated(tuple(MIXED)), estimated(tuple(MIXED_CUDA), "local")
    flash = mixed[1]
    assert (flash.device, flash.attention) == ("cuda", "flash")
    assert flash.activations == [ACTIVATIONS - SCORES + lse]
    assert flash.transient == TRANSIENT - SCORES
    assert (flash.weights, flash.grads, flash.optimizer) == (WEIGHTS, GRADS, ADAM)
    local = on_cuda[1]
    assert (local.device, local.attention, local.activations, local.transient) == \
        ("cuda", "local", [ACTIVATIONS], TRANSIENT)
    params = (2 * 2 * H + (H * 3 * H + 3 * H) // 2 + (H * H // 2 + H) + (H * F + F) // 2
              + (F * H // 2 + H))
    sp = mixed[2]
    assert (sp.tp, sp.shards, sp.boundary_tensor) == (2, 2, T)
    assert (sp.weights, sp.grads) == (FP32 * params, FP32 * params)
    assert sp.optimizer == 2 * FP32 * params + FP32 * 12
    assert sp.activations == [ACTIVATIONS // 2]
    assert sp.recv_tensor == T + T // 2
    # the leader gathers what it sends: its last forward's output (a new, whole tensor) is
    # still held with its last backward's input gradient (a TP-1 stage: the gradient only)
    assert sp.sent == 2
    assert on_cuda[2].activations == sp.activations
    assert sp.transient - on_cuda[2].transient == S * B * H * FP32


def test_a_16_bit_moe_stage_with_the_distributed_optimizer():
    """The cloud stage (one MoE layer) of a U-shape with two replicas per stage, bf16, the
    distributed optimizer: megatron's bf16 parameter buffer and fp32 gradient buffer over the
    same (padded) elements, so the gradients are twice the weights; each replica keeps fp32
    main parameters and Adam's two moments for its half of them, a step counter for each
    parameter tensor it has a part of. The layer has QKV 16 -> (2 + 2 * 2) * 8, projection
    16 -> 16, q / k norms 8 each, two RMSNorms of 16, a router 16 -> 4 and 4 experts of fc1
    16 -> 2 * 8, fc2 8 -> 16 (15 tensors): the buffers hold at least its 2672 parameters."""
    layer = H * 6 * 8 + H * H + 2 * 8 + 2 * H + H * 4 + 4 * (H * 2 * 8 + 8 * H)
    assert layer == 2672
    edge, cloud = estimated(tuple(MOE))
    assert cloud.dp == 2 and cloud.distributed_optimizer
    # every rank of a stage, replica by replica: a replica's ranks follow the previous one's
    assert (edge.ranks, cloud.ranks, edge.name, cloud.recompute) == ([0, 2], [1, 3], "e", "-")
    assert cloud.grads == 2 * cloud.weights and cloud.weights >= 2 * layer
    assert cloud.main_params == cloud.weights  # half the elements, twice the bytes
    counters = cloud.optimizer - 2 * cloud.main_params
    assert counters % FP32 == 0 and 0 < counters // FP32 <= 15
    # the edge runs its start chunk (embedding, one layer) and its end chunk (one layer, the
    # head): the U-shape's warm-up holds 3 start chunks (stages + 1), one end chunk
    assert len(edge.activations) == 2 and edge.inflight == (3, 1)
    assert edge.grads == 2 * edge.weights


def test_per_stage_dp_stages_list_every_replicas_ranks_and_their_recomputation():
    """cpu_vdp at the base model's size (edge dp 1, cloud dp 2), the cloud recomputing its
    layernorms: the edge's lane holds 5 start-chunk micro-batches (read off its lane list in
    tests/test_memory_peak.py) and 1 end-chunk one, a cloud lane 2 (F0 F2 B0 F4 ...)."""
    edge, cloud = estimated(("cluster=cpu_vdp", "cluster.layout=Et|t|tL",
                             "cluster.stages.1.recompute.granularity=selective",
                             "cluster.stages.1.recompute.modules=[layernorm]"),
                            cluster=False)
    assert [(s.dp, s.ranks, s.recompute) for s in (edge, cloud)] == [
        (1, [0], "-"), (2, [1, 2], "selective(layernorm)")]
    assert (edge.inflight, cloud.inflight) == ((5, 1), (2,))
    assert cloud.activations[0] < ACTIVATIONS  # the layernorms' outputs are not kept


def test_a_tied_head_on_the_edge_is_one_parameter():
    """A U-shape whose edge holds the embedding and the head, tied: the edge (the embedding
    V x h, the learned positions s x h, two layers, the final LayerNorm) counts the shared
    matrix once in its weights, its gradient buffer and Adam's moments (a step counter for
    each of its 28 parameter tensors)."""
    from test_memory_total import LAYER_PARAMS, V

    edge, _ = estimated(("cluster.u_shape=true", "cluster.layout=Et|t|tL",
                         "cluster.stages=[{name:e,device:cpu,tp:1},{name:c,device:cpu,tp:1}]",
                         "model.tie_embeddings=true"))
    params = V * H + S * H + 2 * LAYER_PARAMS + 2 * H
    assert (edge.weights, edge.grads) == (FP32 * params, FP32 * params)
    assert edge.optimizer == 2 * FP32 * params + FP32 * (1 + 1 + 2 * 12 + 2)
