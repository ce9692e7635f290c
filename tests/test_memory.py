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
from ldt.validate import validate

MODEL = ModelConfig(name="m", num_layers=6, hidden_size=64, num_attention_heads=4,
                    ffn_hidden_size=128, vocab_size=256, seq_length=16)


def _cluster(*recompute, layout="Et|tt|tt|tL"):
    stages = [StageConfig(f"s{i}", "cpu", 1, recompute=r or RecomputeConfig())
              for i, r in enumerate(recompute)]
    return ClusterConfig(stages=stages, u_shape=True, layout=layout)


@pytest.mark.parametrize("model,stage,match", [
    ({"recompute_granularity": "full"}, None,
     r"model.recompute_granularity=full needs model.recompute_method"),
    ({"recompute_granularity": "full", "recompute_method": "uniform"}, None,
     r"model.recompute_num_layers >= 1"),
    ({"recompute_granularity": "selective", "recompute_num_layers": 2}, None,
     r"model.recompute_num_layers=2 with model.recompute_granularity='selective'"),
    ({"recompute_granularity": "partial"}, None, r"'partial' is not a recompute granularity"),
    ({"recompute_granularity": "selective", "recompute_modules": ["moe"]}, None,
     r"'moe' is not a recomputable module.*core_attn, mlp, layernorm"),
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
