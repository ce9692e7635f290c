"""Cost model and simulator plumbing of the planner (ldt.plan): exact numbers, hand arithmetic."""

from fractions import Fraction

import pytest

from ldt.config import ConfigError
from ldt.plan import (ChunkLoad, CostModel, Plan, StageSpec, Workload, load_inventory,
                      load_model, simulate_plan, simulate_times)
from ldt.plan.evaluate import comm_table, op_table
from ldt.schedule import Op
from ldt.plan.synthetic import synthetic_inventory


@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 12])
def test_1f1b_bubble_is_exact_for_uniform_stages(p, m):
    ops = {s: {Op.F: Fraction(3), Op.B: Fraction(6)} for s in range(p)}
    comm = {(a, b): Fraction(0) for a in range(p) for b in range(p)}
    sim = simulate_times(ops, comm, m, ushape=False)
    assert sim.bubble_fraction == Fraction(p - 1, m + p - 1)
    assert sim.iteration_time == (m + p - 1) * 9


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 3), (6, 16)])
def test_bubble_through_cost_model(p, m, monkeypatch):
    """Uniform stages priced by the cost model (head and links made free so every stage costs
    the same): the simulated bubble is (P-1)/(m+P-1)."""
    inv = synthetic_inventory({"a100": 8})
    cost = CostModel(load_model("llama_7b"), inv, micro_batch_size=1)
    monkeypatch.setattr(cost, "head_time", lambda kind, tp: (0.0, 0.0))
    monkeypatch.setattr(cost, "boundary_time", lambda *args: 0.0)
    plan = Plan(tuple(StageSpec("a100", 1) for _ in range(p)), (2,) * p, False, 1, m)
    ev = simulate_plan(plan, cost)
    assert ev.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=1e-12)
    f, b = cost.layer_time("a100", 1)
    assert ev.iteration_time == pytest.approx((m + p - 1) * 2 * (f + b), rel=1e-12)


def test_layer_flops_match_textbook_formula():
    inv = synthetic_inventory({"a100": 1})
    model = load_model("gpt_tiny")  # ffn = 4h, no GQA
    cost = CostModel(model, inv, micro_batch_size=3)
    b, s, h = 3, model.seq_length, model.hidden_size
    assert cost.layer_flops() == 24 * b * s * h * h + 4 * b * s * s * h


def test_llama_7b_tp8_stage_memory_by_hand():
    """4 layers of llama_7b (Llama-2: SwiGLU, RMSNorm, no biases) on a TP-8 middle stage,
    3 micro-batches in flight, bf16, flash."""
    cost = CostModel(load_model("llama_7b"), synthetic_inventory({"a100": 8}), 1)
    mem = cost.stage_memory("a100", 8, [ChunkLoad(4, inflight=3)])
    # QKV, output projection, fc1 (gate and up: 2f), fc2, split over TP 8; no biases:
    split = 4096 * 12288 + 4096 * 4096 + 4096 * 2 * 11008 + 11008 * 4096
    assert split == 202_375_168
    per_layer = split / 8 + 2 * 4096  # + two RMSNorm weights (replicated)
    assert per_layer == 25_305_088
    params = 4 * per_layer  # 101_220_352
    assert mem.weights == params * 2  # bf16
    assert mem.grads == params * 4  # megatron's DDP accumulates and reduces in fp32
    assert mem.optimizer == params * 12  # fp32 main params + Adam m, v
    # activations: one layer at TP 8, s 4096, b 1 keeps 421_363_712 bytes for backward, as
    # the estimator measured megatron-core's own layers (ldt.memory, fake tensors, flash
    # attention; tests/test_memory.py re-measures it); each chunk also keeps its received
    # input, s*b*h bf16. The model is within 0.01% of that measurement.
    layer = cost.layer_activation_bytes("a100", 8)
    assert layer == pytest.approx(421_363_712, rel=1e-3)
    assert mem.activations == pytest.approx(3 * (4 * 421_363_712 + 4096 * 4096 * 2), rel=1e-3)


# Bytes one decoder layer keeps for backward, measured by the estimator (ldt.memory: megatron-core
# 0.16.1's local layers on fake tensors, one micro-batch; a 2-layer minus a 1-layer chunk) for
# the two families below at h 1024, s 512, b 1. Keys: (family, dtype, tp, sequence parallel,
# attention, recompute). Written here by hand from `python -m bench.bench_memory layers`;
# tests/test_memory.py re-measures some of them so they cannot go stale.
FAMILIES = {
    "gpt": dict(name="g", num_layers=4, hidden_size=1024, num_attention_heads=16,
                ffn_hidden_size=4096, vocab_size=4096, seq_length=512),
    "llama": dict(name="l", num_layers=4, hidden_size=1024, num_attention_heads=16,
                  num_query_groups=4, ffn_hidden_size=2816, vocab_size=4096, seq_length=512,
                  position_embedding_type="rope", normalization="RMSNorm",
                  gated_linear_unit=True, activation="swiglu", add_bias_linear=False),
    # Qwen3's attention: q and k RMS-normalized per head (qk_layernorm), head size 128 apart
    # from hidden / heads
    "qwen3": dict(name="q", num_layers=4, hidden_size=1024, num_attention_heads=16,
                  num_query_groups=4, kv_channels=128, qk_layernorm=True,
                  ffn_hidden_size=2816, vocab_size=4096, seq_length=512,
                  position_embedding_type="rope", normalization="RMSNorm",
                  gated_linear_unit=True, activation="swiglu", add_bias_linear=False),
}
MEASURED_LAYER_BYTES = {
    ("gpt", "bfloat16", 1, False, "local", None): 41947136,
    ("gpt", "bfloat16", 1, False, "flash", None): 16814080,
    ("gpt", "bfloat16", 2, False, "local", None): 23072768,
    ("gpt", "bfloat16", 2, False, "flash", None): 10506240,
    ("gpt", "bfloat16", 2, True, "local", None): 20973568,
    ("gpt", "bfloat16", 2, True, "flash", None): 8407040,
    ("gpt", "float32", 1, False, "local", None): 50339840,
    ("gpt", "float32", 1, False, "flash", None): 33595392,
    ("gpt", "float32", 2, True, "flash", None): 16797696,
    ("llama", "bfloat16", 1, False, "local", None): 54530048,
    ("llama", "bfloat16", 1, False, "flash", None): 29134848,
    ("llama", "bfloat16", 2, False, "local", None): 32641024,
    ("llama", "bfloat16", 2, False, "flash", None): 19943424,
    ("llama", "bfloat16", 2, True, "local", None): 27396096,
    ("llama", "bfloat16", 2, True, "flash", None): 14698496,
    ("llama", "float32", 1, False, "local", None): 67112960,
    ("llama", "float32", 1, False, "flash", None): 49844224,
    ("llama", "float32", 2, True, "flash", None): 25184256,
    ("llama", "bfloat16", 1, False, "local", ("core_attn",)): 29102084,
    ("llama", "bfloat16", 1, False, "flash", ("layernorm",)): 20742144,
    ("llama", "bfloat16", 1, False, "flash", ("mlp",)): 14716928,
    ("llama", "bfloat16", 2, True, "local", ("core_attn", "layernorm", "mlp")): 3276804,
    ("llama", "bfloat16", 2, True, "flash", ("layernorm",)): 10502144,
    ("llama", "bfloat16", 2, True, "local", "full"): 524288,
    ("qwen3", "bfloat16", 1, False, "flash", None): 43855872,
    ("qwen3", "bfloat16", 1, False, "local", None): 69513216,
    ("qwen3", "float32", 1, False, "flash", None): 67710976,
    ("qwen3", "bfloat16", 2, True, "flash", None): 22190080,
    ("qwen3", "bfloat16", 2, False, "local", None): 40263680,
}


@pytest.mark.parametrize("key", list(MEASURED_LAYER_BYTES), ids=str)
def test_activation_model_matches_megatrons_measured_layers(key):
    """The planner's activation model against what megatron-core's code keeps (within 1%)."""
    from ldt.config import to_model
    from ldt.plan.memory_cost import Recompute

    family, dtype, tp, sp, attention, recompute = key
    model = to_model(dict(FAMILIES[family], params_dtype=dtype, sequence_parallel=sp))
    cost = CostModel(model, synthetic_inventory({"a100": 8}), 1,
                     flash_attention=attention == "flash")
    rc = (None if recompute is None else Recompute("full", "uniform", 1) if recompute == "full"
          else Recompute("selective", modules=recompute))
    got = cost.decoder_activation_bytes("a100", tp, 2, rc) - cost.decoder_activation_bytes("a100", tp, 1, rc)
    assert got == pytest.approx(MEASURED_LAYER_BYTES[key], rel=0.01)


def test_gqa_and_gated_mlp_change_flops_and_params():
    """llama3_8b: 8 KV groups shrink QKV to h + 2h/4; SwiGLU's fc1 is 2f wide."""
    cost = CostModel(load_model("llama3_8b"), synthetic_inventory({"a100": 8}), 1)
    b, s, h, f = 1, 8192, 4096, 14336
    qkv = h + 2 * h * 8 // 32
    assert cost.layer_flops() == (2 * b * s * h * qkv + 2 * b * s * h * h + 2 * b * s * h * 2 * f
                                  + 2 * b * s * f * h + 4 * b * s * s * h)
    assert cost.layer_params(1) == h * qkv + h * h + 3 * h * f + 2 * h  # 218_112_000
    assert cost.layer_params(1) == 218_112_000  # Llama-3-8B's layer, as published
    assert cost.embedding_params(1) == 128256 * h  # RoPE: no position table


def test_full_attention_adds_score_matrices():
    """Without flash attention megatron's local softmax keeps fp32 scores and a bf16 copy
    (and the mask): llama_7b at TP 8 measured 823_951_360 bytes per layer (the estimator,
    s 4096, b 1) against 421_363_712 with flash."""
    model = load_model("llama_7b")
    inv = synthetic_inventory({"a100": 8})
    flash = CostModel(model, inv, 1).layer_activation_bytes("a100", 8)
    full = CostModel(model, inv, 1, flash_attention=False).layer_activation_bytes("a100", 8)
    assert full == pytest.approx(823_951_360, rel=0.01)
    assert full - flash == pytest.approx(823_951_360 - 421_363_712, rel=0.01)


def test_boundary_time_host_staging_and_broadcast():
    inv = load_inventory("a100_910b")
    cost = CostModel(load_model("llama_7b"), inv, 1)
    nbytes = 1 * 4096 * 4096 * 2
    link = nbytes / 12.5e9 + 30e-6
    host = 2 * nbytes / 25e9  # device->host on the GPU side, host->device on the NPU side
    assert cost.boundary_time("a100", "ascend910b", 1) == pytest.approx(link + host)
    # TP 8 across: 32 MiB crosses once in sqrt(32 MiB / 128 KiB) = 16 pieces, and the
    # receiving leader's relay of the last piece is what the link does not hide
    assert cost.boundary_time("a100", "ascend910b", 8) == pytest.approx(
        link + host + nbytes / 16 / 196e9)
    same = nbytes / 25e9 + 10e-6
    assert cost.boundary_time("ascend910b", "ascend910b", 1) == pytest.approx(same)


def test_tp_time_includes_allreduce():
    inv = synthetic_inventory({"a100": 8})
    cost = CostModel(load_model("llama_7b"), inv, 1)
    f1, b1 = cost.layer_time("a100", 1)
    f8, b8 = cost.layer_time("a100", 8)
    ar = 2 * (2 * 7 / 8 * 4096 * 4096 * 2 / 300e9)  # 2 ring all-reduces of b*s*h bf16
    compute8 = f1 / (8 * 0.95**3)
    assert f8 == pytest.approx(compute8 + ar)
    assert b8 == pytest.approx(2 * compute8 + ar)


@pytest.mark.parametrize("ushape", [False, True])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 5), (3, 2), (4, 8), (5, 3)])
def test_closed_form_inflight_matches_simulator(ushape, p, m):
    inv = synthetic_inventory({"a100": 8})
    cost = CostModel(load_model("gpt_tiny"), inv, 1)
    layers = (1,) * (p + 1 if ushape else p)
    plan = Plan(tuple(StageSpec("a100", 1) for _ in range(p)), layers, ushape, 1, m)
    ev = simulate_plan(plan, cost)
    for s in range(p):
        closed = tuple(c.inflight for c in plan.stage_chunks(s))
        assert ev.stages[s].inflight == closed, (s, ev.stages[s].inflight, closed)


def test_ushape_op_table_uses_both_edge_chunks():
    inv = synthetic_inventory({"edge_gpu": 1, "a100": 2}, edge="edge_gpu")
    cost = CostModel(load_model("gpt_tiny"), inv, 1)
    plan = Plan((StageSpec("edge_gpu", 1), StageSpec("a100", 1), StageSpec("a100", 1)),
                (1, 2, 2, 1), True, 1, 4)
    ops = op_table(plan, cost)
    assert set(ops[0]) == {Op.FS, Op.FE, Op.BS, Op.BE}
    assert ops[0][Op.FE] > ops[0][Op.FS]  # the end chunk carries the head
    assert (2, 0) in comm_table(plan, cost)  # the wraparound boundary is priced
    assert plan.layout() == "Et|t*2|t*2|tL"


def test_inventory_errors_name_field_and_fix(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nkinds:\n  - {name: x, device: tpu, count: 1, tflops: 1, "
                   "memory_gib: 8, intra_bw_gbps: 1}\n")
    with pytest.raises(ConfigError, match=r"kinds\[0\] \(x\)\.device='tpu'.*cuda, npu, cpu"):
        load_inventory(str(bad))
    inv = synthetic_inventory({"a100": 1})
    with pytest.raises(ConfigError, match="no link between kinds 'a100' and 'zz'|no device kind"):
        inv.link("a100", "zz")
    with pytest.raises(ConfigError, match="global_batch_size=10 is not a multiple"):
        Workload(micro_batch_size=4, global_batch_size=10)


def test_shipped_inventories_load():
    for name in ("a100_910b", "edge_cloud", "cpu_local"):
        inv = load_inventory(name)
        assert inv.total_devices > 0
    assert load_inventory("a100_910b").total_devices == 24
    assert load_inventory("edge_cloud").edge == "edge_gpu"


@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("p,m", [(2, 3), (3, 12), (4, 6)])
def test_prefetch_inflight_closed_form_matches_simulator(p, m, prefetch):
    """A prefetching U-shape holds 2d more micro-batches in the edge's start chunk and d more on
    every cloud stage (clipped by m): the planner's memory model and the schedule agree."""
    inv = synthetic_inventory({"a100": 8})
    cost = CostModel(load_model("gpt_tiny"), inv, 1)
    plan = Plan(tuple(StageSpec("a100", 1) for _ in range(p)), (1,) * (p + 1), True, 1, m,
                prefetch)
    ev = simulate_plan(plan, cost)
    for s in range(p):
        assert ev.stages[s].inflight == tuple(c.inflight for c in plan.stage_chunks(s)), s


def test_moe_layers_priced_by_active_parameters_and_dispatch():
    """qwen3_30b_a3b: every parameter counted (30.5B, as published; the same as the model's
    tensors), FLOPs of the active ones (router + 8 of 128 experts: 3.35B per token with the
    embedding and the head; "3.3B activated" published), the token dispatch priced as the
    dense MLP's TP collectives, the experts split over the TP ranks."""
    import math

    from ldt.models.arch import full_shapes

    model = load_model("qwen3_30b_a3b")
    cost = CostModel(model, synthetic_inventory({"a100": 8}), 1)
    h, a, d, g, s, experts, fm = 2048, 32, 128, 4, model.seq_length, 128, 768
    params = 48 * cost.layer_params(1) + cost.embedding_params(1) + cost.head_params(1)
    assert params == sum(math.prod(x) for x in full_shapes(model).values()) == 30_532_122_624
    attention = h * (a + 2 * g) * d + a * d * h  # QKV and the output projection (4096 wide)
    active = attention + experts * h + 8 * 3 * h * fm  # + router + 8 SwiGLU experts
    assert cost.layer_flops() == 2 * s * active + 4 * s * s * a * d
    assert 3.3e9 < 48 * active + 2 * model.vocab_size * h < 3.4e9
    expert_weights = experts * 3 * h * fm
    assert cost.layer_params(8) == pytest.approx(cost.layer_params(1) - expert_weights * 7 / 8
                                                 - attention * 7 / 8)
    dense = CostModel(load_model("llama3_8b"), synthetic_inventory({"a100": 8}), 1)
    assert cost.layer_time("a100", 8)[0] - cost.layer_flops() / cost._speed(
        cost.inventory.kind("a100"), 8) == pytest.approx(2 * cost._tp_allreduce(
            cost.inventory.kind("a100"), 8))
    assert dense.moe is None and cost.moe.share == 1.0


def test_planner_recomputes_only_the_stage_that_does_not_fit_otherwise():
    """docs/memory.md's worked example: llama3_8b on edge_one_card fits only with the edge
    recomputing; every stage that recomputes would not fit without (at the plan's prefetch
    depth); the cluster file carries each stage's recomputation."""
    import yaml

    import dataclasses

    from ldt.plan import (Workload, cluster_yaml, load_inventory, load_model, make_cost, plan,
                          simulate_plan)

    inventory, model = load_inventory("edge_one_card"), load_model("llama3_8b")
    assert not plan(inventory, model, Workload(1, 64, recompute=False)).best.fits
    best = plan(inventory, model, Workload(1, 64)).best
    assert best.fits and best.plan.u_shape
    rc = [best.plan.recompute_of(i) for i in range(best.plan.num_stages)]
    assert rc[0] is not None, rc
    cost = make_cost(inventory, model, Workload(1, 64, recompute=False))  # prices as given
    assert simulate_plan(best.plan, cost).fits
    for i, r in enumerate(rc):  # a stage recomputes only where it would not fit without
        if r is not None:
            without = dataclasses.replace(best.plan, recompute=tuple(
                None if j == i else x for j, x in enumerate(rc)))
            assert not simulate_plan(without, cost).stages[i].fits, i
    stages = yaml.safe_load(cluster_yaml(best, inventory, model.name, 1))["stages"]
    for st, r in zip(stages, rc):
        # none said explicitly: unset, the stage would take the model's recompute setting
        assert st.get("recompute") == (r.config() if r is not None else {"granularity": "none"})
    assert all(s["memory_gib"] == (37.0 if i == 0 else 77.0) for i, s in enumerate(stages))


def test_a_plan_with_per_stage_dp_is_priced_without_fan_out():
    """ldt builds no fan-out group where stages have different replica counts
    (Topology.fanout_boundaries), so a small message into TP 2 crosses once and the leader
    relays it: dearer than the two copies the same stages exchange without per-stage DP."""
    inv = synthetic_inventory({"a100": 8})
    cost = CostModel(load_model("gpt_tiny"), inv, micro_batch_size=1)
    assert cost.boundary_bytes() <= 64 * 1024  # small enough to fan out between nodes
    stages = (StageSpec("a100", 1), StageSpec("a100", 2))
    uniform = comm_table(Plan(stages, (2, 2), False, 2, 4), cost)
    vdp = comm_table(Plan(stages, (2, 2), False, 2, 4, stage_dp=(2, 1)), cost)
    link = inv.link("a100", "a100")
    one = cost.boundary_bytes() / (link.bandwidth_gbps * 1e9) + link.latency_us * 1e-6
    relay = cost.boundary_bytes() / (inv.kind("a100").intra_bw_gbps * 1e9)
    assert uniform[(0, 1)] == pytest.approx(one + cost.boundary_bytes()
                                            / (link.bandwidth_gbps * 1e9))  # two copies
    assert vdp[(0, 1)] == pytest.approx(one + relay)
    assert vdp[(1, 0)] == uniform[(1, 0)] == pytest.approx(one)  # into TP 1: one copy


def test_selective_mlp_recompute_spares_only_the_dense_layers_of_a_moe_model():
    """megatron recomputes a dense layer's MLP under selective ``mlp``, never a MoE layer's
    experts (its ``recompute_mlp`` is off there). qwen3_moe_tiny, 2 of whose 6 layers are
    dense: the planner saved the whole averaged MLP on every layer, so it priced a MoE stage
    smaller than megatron keeps it. Now it saves a dense MLP's bytes on 2 of 6 layers (fp32,
    s 64, b 1: fc1's gated output 2f, fc2's input f, SwiGLU's activation and product 2f, with
    f 128), and repeats 2 / 6 of a dense MLP's FLOPs."""
    from ldt.config import to_model
    from ldt.job.hydra import compose
    from ldt.plan.memory_cost import Recompute

    moe = to_model(compose(["model=qwen3_moe_tiny"]).model)
    dense = to_model({**moe.__dict__, "num_moe_experts": None, "moe_layer_freq": 1})
    rc = Recompute("selective", modules=("mlp",))
    inv = synthetic_inventory({"a100": 8})
    cost, plain = CostModel(moe, inv, 1), CostModel(dense, inv, 1)
    saved = cost.layer_activation_bytes("a100", 1) - cost.layer_activation_bytes("a100", 1, rc)
    assert saved == pytest.approx(64 * 4 * (2 * 128 + 128 + 2 * 128) * 2 / 6)
    assert plain.layer_activation_bytes("a100", 1) - plain.layer_activation_bytes("a100", 1, rc) == \
        pytest.approx(64 * 4 * (2 * 128 + 128 + 2 * 128))
    assert cost.recompute_time("a100", 1, 6, rc) == \
        pytest.approx(plain.recompute_time("a100", 1, 6, rc) * 2 / 6)
