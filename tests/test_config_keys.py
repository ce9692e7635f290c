"""Every model and optimizer key acts: changing it changes what megatron-core is given.

A key that is parsed, validated and then dropped is the silent failure #33 found (the layout's
``m``). These tests change one key at a time on the composed default config (Hydra's compose,
as ``ldt-train`` does) and check the value arrives where it acts: the chunk's TransformerConfig,
the GPTModel's arguments (recorded by a stand-in class), or megatron's OptimizerConfig.
Keys that act elsewhere are covered where they act (see docs/testing.md's audit).
"""

from __future__ import annotations

import pytest
import torch.nn.functional as F

from ldt.job.hydra import compose
from ldt.config import typed_config


_BASE = {}


def _cfg(*overrides):
    """The composed default config with ``overrides`` (dotted keys) applied; Hydra composes
    once (group choices like ``train/optimizer=sgd`` compose again)."""
    from omegaconf import OmegaConf

    groups = [o for o in overrides if "/" in o.split("=")[0]]
    key = tuple(groups)
    if key not in _BASE:
        _BASE[key] = OmegaConf.to_container(compose(groups), resolve=True)
    dotted = [o for o in overrides if o not in groups]
    merged = OmegaConf.merge(OmegaConf.create(_BASE[key]), OmegaConf.from_dotlist(dotted))
    return typed_config(OmegaConf.to_container(merged, resolve=True))


def _transformer_config(*overrides):
    from ldt.models.build import transformer_config

    c = _cfg(*overrides)
    return transformer_config(c.model, 1, c.model.num_layers)


@pytest.mark.parametrize("override, field, value", [
    ("model.hidden_size=96", "hidden_size", 96),
    ("model.num_attention_heads=8", "num_attention_heads", 8),
    ("model.num_query_groups=2", "num_query_groups", 2),
    ("model.ffn_hidden_size=100", "ffn_hidden_size", 100),
    ("model.normalization=RMSNorm", "normalization", "RMSNorm"),
    ("model.norm_epsilon=0.001", "layernorm_epsilon", 0.001),
    ("model.gated_linear_unit=true", "gated_linear_unit", True),
    ("model.activation=silu", "activation_func", F.silu),
    ("model.add_bias_linear=false", "add_bias_linear", False),
    ("model.add_qkv_bias=true", "add_qkv_bias", True),
    ("model.params_dtype=bfloat16", "bf16", True),
])
def test_model_keys_reach_the_transformer_config(override, field, value):
    default = _transformer_config()
    changed = _transformer_config(override)
    assert getattr(changed, field) == value
    assert getattr(default, field) != value  # the key changed something


class _Recorder:
    """Stands in for GPTModel: records the arguments a chunk is built with."""

    seen: dict = {}

    def __init__(self, **kwargs):
        _Recorder.seen = kwargs


@pytest.mark.parametrize("override, argument, value", [
    ("model.position_embedding_type=rope", "position_embedding_type", "rope"),
    ("model.rotary_base=500000", "rotary_base", 500000.0),
    ("model.rotary_percent=0.5", "rotary_percent", 0.5),
    ("model.vocab_size=300", "vocab_size", 300),
    ("model.max_position_embeddings=96", "max_sequence_length", 96),
    ("model.seq_length=80", "max_sequence_length", 80),
])
def test_model_keys_reach_the_gpt_model(override, argument, value, monkeypatch):
    import megatron.core.models.gpt as gpt

    from ldt.config.layout import Chunk
    from ldt.models import build, spec

    monkeypatch.setattr(gpt, "GPTModel", _Recorder)
    monkeypatch.setattr(spec, "layer_spec", lambda model, impl: f"{impl} spec")
    chunk = Chunk(stage=0, index=0, segment=0, first_layer=0, num_layers=1,
                  has_embedding=True, has_head=False)

    def built(*overrides):
        c = _cfg(*overrides)
        try:
            build.build_chunk(c.model, chunk, 1)
        except AttributeError:  # the stand-in has no layers to renumber
            pass
        return _Recorder.seen[argument]

    assert built(override) == value
    assert built() != value


@pytest.mark.parametrize("override, field, value", [
    ("train/optimizer=sgd", "optimizer", "sgd"),
    ("train.optimizer.adam_beta1=0.8", "adam_beta1", 0.8),
    ("train.optimizer.adam_beta2=0.999", "adam_beta2", 0.999),
    ("train.optimizer.adam_eps=1e-6", "adam_eps", 1e-6),
    ("train.optimizer.sgd_momentum=0.5", "sgd_momentum", 0.5),
    ("train.lr=0.02", "lr", 0.02),
    ("train.min_lr=0.0", "min_lr", 0.0),
    ("train.weight_decay=0.3", "weight_decay", 0.3),
    ("train.clip_grad=0.0", "clip_grad", 0.0),
    ("train.distributed_optimizer=true", "use_distributed_optimizer", True),
])
def test_train_keys_reach_megatrons_optimizer_config(override, field, value):
    from ldt.training.optim import optimizer_config

    assert getattr(optimizer_config(_cfg(override)), field) == value
    assert getattr(optimizer_config(_cfg()), field) != value


def test_loss_scale_and_main_params_follow_the_dtype():
    from ldt.training.optim import optimizer_config

    fp16 = optimizer_config(_cfg("model.params_dtype=float16", "train.loss_scale=128"))
    assert (fp16.fp16, fp16.bf16, fp16.loss_scale) == (True, False, 128.0)
    bf16 = optimizer_config(_cfg("model.params_dtype=bfloat16"))
    assert (bf16.fp16, bf16.bf16) == (False, True)  # fp32 main params by default
    plain = optimizer_config(_cfg("model.params_dtype=bfloat16", "train.fp32_main_params=false",
                                  "train.clip_grad=0"))
    assert plain.bf16 is False  # the optimizer updates the bf16 weights in place


def test_check_finite_and_audit_choose_the_boundary_observers(tmp_path):
    """train.check_finite adds the NaN check at every boundary (null: with train.verify);
    train.audit_comm the audit log (what they report: test_failures.py, test_train.py)."""
    from ldt.config import TrainConfig
    from ldt.training.loop import _observers
    from ldt.training.observe import CommAudit, FiniteCheck

    def kinds(**train):
        return [type(o) for o in _observers(TrainConfig(**train), str(tmp_path), 0)]

    assert kinds() == []
    assert kinds(verify=True) == [FiniteCheck]
    assert kinds(verify=True, check_finite=False) == []
    assert kinds(check_finite=True) == [FiniteCheck]
    assert kinds(audit_comm=True) == [CommAudit]
