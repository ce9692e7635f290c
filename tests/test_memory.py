"""Activation recomputation per stage, the memory estimate and the refusal before an
out-of-memory (issue #24; docs/memory.md).

Recomputation's parity (the same losses and gradients as without it, on every topology the
suite checks) runs in the existing worlds: test_p2p_parity, test_ushape, test_seqpar, test_vdp,
test_optimizer and test_train each have a recompute variant. This file holds what needs no
world of its own: megatron's rules refused before any process starts.
"""

from __future__ import annotations

import pytest

from ldt.config import ClusterConfig, ConfigError, ModelConfig, RecomputeConfig, StageConfig
from ldt.topology.validate import validate

MODEL = ModelConfig(name="m", num_layers=6, hidden_size=64, num_attention_heads=4,
                    ffn_hidden_size=128, vocab_size=256, seq_length=16)


def _cluster(*recompute, layout="Et|tt|tt|tL"):
    stages = [StageConfig(f"s{i}", "cpu", 1, recompute=r or RecomputeConfig())
              for i, r in enumerate(recompute)]
    return ClusterConfig(stages=stages, u_shape=True, layout=layout)


# layers 1 and 2 (stage 1 of Et|tt|tt|tL) dense, the others MoE
MOE = {"num_moe_experts": 4, "moe_ffn_hidden_size": 32, "moe_router_topk": 2,
       "add_bias_linear": False, "moe_layer_freq": [1, 0, 0, 1, 1, 1]}


@pytest.mark.parametrize("model,stage,match", [
    ({"recompute_granularity": "full"}, None,
     r"model.recompute_granularity=full needs model.recompute_method"),
    ({"recompute_granularity": "full", "recompute_method": "uniform"}, None,
     r"model.recompute_num_layers >= 1"),
    ({"recompute_granularity": "selective", "recompute_num_layers": 2}, None,
     r"model.recompute_num_layers=2 with model.recompute_granularity='selective'"),
    ({"recompute_granularity": "partial"}, None, r"'partial' is not a recompute granularity"),
    ({"recompute_granularity": "selective", "recompute_modules": ["moe_act"]}, None,
     r"'moe_act' is not a module ldt recomputes \(megatron's moe_act needs grouped GEMM "
     r"experts.*core_attn, mlp, layernorm, moe"),
    ({"recompute_granularity": "selective", "recompute_modules": ["moe"]}, None,
     r"model.recompute_modules=\['moe'\]: moe recomputes MoE layers and the model has none"),
    (MOE, RecomputeConfig("selective", modules=["moe"]),
     r"cluster.stages\[1\].recompute.modules=\['moe'\]: stage 1 \(s1\) holds none of the "
     r"model's MoE layers"),
    ({"recompute_granularity": "selective", "recompute_modules": ["mlp"]}, None,
     r"stage 0 \(s0\) with model.add_bias_linear=true.*drop mlp"),
    ({}, RecomputeConfig("full", "block"),
     r"cluster.stages\[1\].recompute.granularity=full needs.*num_layers >= 1"),
    ({}, RecomputeConfig(None, "block", 1),
     r"cluster.stages\[1\].recompute sets method / num_layers / modules without a granularity"),
    ({}, RecomputeConfig("full", "uniform", 2, None),
     r"cluster.stages\[1\].recompute.num_layers=2 with method uniform does not divide the 1 "
     r"decoder layers of stage 1 \(s1\)"),
])
def test_recompute_megatron_refuses_is_refused_before_anything_starts(model, stage, match):
    import dataclasses

    cluster = _cluster(None, stage, None,
                       layout="Et|t|tt|ttL" if stage and stage.method == "uniform" else
                       "Et|tt|tt|tL")
    with pytest.raises(ConfigError, match=match):
        validate(cluster, dataclasses.replace(MODEL, **model) if model else MODEL,
                 check_devices=False)


def test_stage_recompute_overrides_the_model_and_none_turns_it_off():
    import dataclasses

    from ldt.models.recompute import stage_recompute, transformer_kwargs

    model = dataclasses.replace(MODEL, recompute_granularity="selective")
    cluster = _cluster(RecomputeConfig("full", "block", 1), None, RecomputeConfig("none"))
    validate(cluster, model, check_devices=False)
    got = [transformer_kwargs(stage_recompute(model, s)) for s in cluster.stages]
    assert got == [{"recompute_granularity": "full", "recompute_method": "block",
                    "recompute_num_layers": 1},
                   {"recompute_granularity": "selective", "recompute_method": None,
                    "recompute_num_layers": None},
                   {}]


def test_balanced_routing_gives_each_expert_its_even_share():
    """Under fake tensors megatron's dispatch cannot know which tokens go where: the estimate
    routes 16 tokens with top-2 of 8 experts as 16 * 2 / 8 = 4 per expert, through megatron's
    own permute and the experts' tolist(), 32 in all."""
    import torch
    from megatron.core.transformer.moe.moe_utils import permute
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ldt.memory.fake import BalancedRouting

    with FakeTensorMode(), BalancedRouting(topk=2, experts=8):
        tokens = torch.empty(16, 64)
        routing = torch.zeros(16, 8, dtype=torch.bool)  # the router's top-2 map
        counts = routing.sum(dim=0).long()
        # (megatron-core 0.16 returns 3 values, 0.17+ 5: the first two are these)
        permuted, probs = permute(tokens, routing, probs=torch.empty(16, 8),
                                  num_out_tokens=32)[:2]
        assert tuple(permuted.shape) == (32, 64) and tuple(probs.shape) == (32,)
        assert counts.tolist() == [4] * 8
        assert counts.sum().item() == 32  # megatron-core 0.17+ asks the total first
    assert torch.tensor([3, 5]).tolist() == [3, 5]  # outside the estimate nothing changes
    with FakeTensorMode(), BalancedRouting(topk=2, experts=8):  # before any selection an
        with pytest.raises(Exception, match="_local_scalar_dense"):  # integer item is fake's
            torch.tensor([3, 5]).tolist()


def test_balanced_routing_counts_from_the_routing_map_alone():
    """megatron-core 0.17+ asks ``tokens_per_expert.sum().item()`` before any token is
    selected: the counts then come from the routing map's ``sum(dim=0)`` alone ([tokens,
    experts], summed over the tokens). 16 tokens, top-2 of 8 experts: 16 * 2 // 8 = 4 each,
    32 in all; 10 tokens: 10 * 2 // 8 = 2 each (a whole count, rounded down), 16 in all; a
    sum over the other dimension (or of a map that is not boolean, or not 2-D) is no count
    and leaves the share unknown, so an integer item is fake's again."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ldt.memory.fake import BalancedRouting

    for tokens, share in ((16, 4), (10, 2)):
        with FakeTensorMode(), BalancedRouting(topk=2, experts=8):
            counts = torch.zeros(tokens, 8, dtype=torch.bool).sum(dim=0)
            total = counts.sum().item()
            each = counts.tolist()
        assert (total, each) == (share * 8, [share] * 8)
        assert type(total) is int and all(type(n) is int for n in each)
    for other in (lambda: torch.zeros(16, 8, dtype=torch.bool).sum(dim=1),
                  lambda: torch.zeros(16, 8, dtype=torch.int64).sum(dim=0),
                  lambda: torch.zeros(16, 8, 2, dtype=torch.bool).sum(dim=0)):
        with FakeTensorMode(), BalancedRouting(topk=2, experts=8):
            counts = other()
            with pytest.raises(Exception, match="_local_scalar_dense"):
                counts.sum().item()


@pytest.mark.timeout(120)
def test_a_moe_model_is_estimated():
    """qwen3_moe_tiny on cpu_demo: its last cloud stage holds two MoE layers (8 experts of
    fc1 64 -> 2 x 32 and fc2 32 -> 64, a router 64 -> 8, no biases) and two Qwen3 attention
    blocks (QKV 64 -> (4 + 2 * 2) * 16, projection 64 -> 64, q/k norms 16, two RMSNorms 64):
    fp32 weights counted by hand."""
    from omegaconf import OmegaConf

    from ldt.job.hydra import compose
    from ldt.memory.stages import estimate_here

    cfg = OmegaConf.to_container(compose(["cluster=cpu_demo", "model=qwen3_moe_tiny"]),
                                 resolve=True)
    stages = estimate_here(cfg)  # in this process: no helper to start
    h, fm, experts, d = 64, 32, 8, 16
    attention = h * (4 + 2 * 2) * d + h * h + 2 * d + 2 * h
    moe = experts * (h * 2 * fm + fm * h) + experts * h
    last = stages[2]
    assert last.weights == 4 * 2 * (attention + moe)
    assert all(s.peak > s.weights + s.grads + s.optimizer for s in stages)  # it ran through


# gpt_tiny's edge on cpu_demo (h 64, f 256, V 256, s 64, learned positions, biases, untied
# head), counted by hand: embedding V*h + positions s*h, two layers of 2 LayerNorms (2h each),
# QKV h*3h + 3h, projection h*h + h, fc1 h*f + f, fc2 f*h + h, the final LayerNorm 2h, head V*h
H, F, V, S = 64, 256, 256, 64
LAYER = 2 * 2 * H + H * 3 * H + 3 * H + H * H + H + H * F + F + F * H + H
EDGE_PARAMS = V * H + S * H + 2 * LAYER + 2 * H + V * H


@pytest.mark.timeout(120)
def test_ldt_memory_counts_the_edge_and_the_schedules_micro_batches(tmp_path, capsys,
                                                                     monkeypatch):
    """ldt-memory on cpu_demo: fp32 weights, gradients and Adam's two moments of the edge's
    parameters counted by hand, and the U-shape edge holding its start chunk for all 4
    micro-batches and its end chunk for one; a stated limit above the estimate fits."""
    import ldt.memory
    import ldt.memory.stages
    from ldt.tools.memory import main

    got = []
    real = ldt.memory.stages.estimate_here  # in this process: no helper to start
    monkeypatch.setattr(ldt.memory, "estimate", lambda cfg: got.append(real(cfg)) or got[-1])
    assert main(["cluster=cpu_demo", "cluster.stages.0.memory_gib=0.5",
                 f"hydra.run.dir={tmp_path}"]) == 0
    edge = next(line for line in capsys.readouterr().out.splitlines()
                if line.startswith("0:edge"))
    assert edge.split()[-1] == "512.00" and "!" not in edge  # the limit, MiB; fits
    st = got[0][0]
    assert st.weights == 4 * EDGE_PARAMS
    # Adam: two fp32 moments and torch's fp32 step counter per parameter tensor (embedding 2,
    # 12 per layer, final norm 2, head 1)
    assert st.grads == st.weights and st.optimizer == 2 * st.weights + 4 * (2 + 2 * 12 + 2 + 1)
    assert st.main_params == 0  # fp32 training: the parameters are the main parameters
    assert st.inflight == (4, 1)
    cloud0 = got[0][1]  # TP 2 without sequence parallelism: one whole tensor per receive
    assert (cloud0.tp, cloud0.shards, cloud0.recv_tensor) == (2, 1, cloud0.boundary_tensor)
    # and its two layers keep, per rank and micro-batch (t = s b h fp32, heads split in two):
    # LayerNorm statistics 2 x 2 s b fp32, LayerNorm outputs 2 t, QKV 3t/2, softmax b a/2 s s,
    # context t/2, residual t, fc1 and GeLU outputs 2 s b f/2, the output t; and the input t
    t = S * 2 * H * 4
    layer = (2 * 2 * S * 2 * 4 + 2 * t + 3 * t // 2 + 2 * 2 * S * S * 4 + t // 2 + t
             + 2 * S * 2 * F // 2 * 4 + t)
    assert cloud0.activations == [2 * layer + t] == [823296]
