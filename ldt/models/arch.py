"""A model's architecture as data: the fields that define its weights, its full tensor shapes,
and the check that a checkpoint fits a model config (run before any collective).

Every ldt checkpoint carries ``model.json`` (the architecture fields of the ModelConfig it was
written for) next to its stage folders. :func:`check_checkpoint` compares it, and every
tensor's full shape, with the run's model config and names the first field or parameter that
disagrees, so a wrong checkpoint is refused on every rank before the first collective instead
of failing half-loaded (or, worse, loading into a model that computes something else).

:func:`full_shapes` is the canonical name -> full (TP=1) shape table of a model; the tests
check it against megatron-core's modules for every family.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Mapping, Optional

from ldt.config import ConfigError, ModelConfig, to_model
from ldt.config.userfiles import load_json_object
from ldt.models.vocab import is_vocab_param
from ldt.storage.atomic import replace_file

MODEL_JSON = "model.json"

# Fields that change what the weights mean or their shapes. Training-only fields (seq_length,
# params_dtype, transformer_impl, the padding multiple) may differ between runs.
_ROPE_SCALING = ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                 "rope_original_max_position_embeddings")  # meaningful with rope_scaling only
_MOE = ("moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
        "moe_router_pre_softmax")  # meaningful with num_moe_experts only
ARCH_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
               "ffn_hidden_size", "vocab_size", "position_embedding_type", "rotary_base",
               "rotary_percent", "normalization", "norm_epsilon", "gated_linear_unit",
               "activation", "add_bias_linear", "add_qkv_bias", "tie_embeddings",
               "rope_scaling", *_ROPE_SCALING, "kv_channels", "qk_layernorm", "num_moe_experts",
               *_MOE, "mtp_num_layers")


def arch_of(model: ModelConfig) -> dict:
    """The architecture fields, defaults resolved (ffn 4h, groups = heads, head size h/a,
    one 0/1 per layer for the MoE layers); fields a disabled feature ignores are None."""
    out = {k: getattr(model, k) for k in ARCH_FIELDS}
    out["ffn_hidden_size"] = model.ffn_hidden_size or 4 * model.hidden_size
    out["num_query_groups"] = model.num_query_groups or model.num_attention_heads
    out["kv_channels"] = head_size(model)
    if not model.rope_scaling:
        out.update(dict.fromkeys(_ROPE_SCALING))
    if model.num_moe_experts:
        out["moe_ffn_hidden_size"] = model.moe_ffn_hidden_size or out["ffn_hidden_size"]
        out["moe_layer_freq"] = [int(x) for x in model.moe_layers()]
    else:
        out.update(dict.fromkeys(_MOE))
    return out


def head_size(model: ModelConfig) -> int:
    """Megatron's kv_channels: the explicit head size, else hidden / heads."""
    return model.kv_channels or model.hidden_size // model.num_attention_heads


EXPERTS = ".mlp.experts.local_experts."  # megatron's SequentialMLP: one MLP per expert


def expert_names(layer_prefix: str, model: ModelConfig) -> list[str]:
    """Canonical names of one MoE layer's expert weights (expert numbers are global)."""
    return [f"{layer_prefix.rstrip('.')}{EXPERTS}{e}.{w}"
            for e in range(model.num_moe_experts) for w in ("linear_fc1.weight",
                                                            "linear_fc2.weight")]


def write_model_json(folder: str, model: ModelConfig) -> None:
    """``folder/model.json``: the whole ModelConfig (its architecture is what loads check)."""
    os.makedirs(folder, exist_ok=True)
    replace_file(os.path.join(folder, MODEL_JSON), json.dumps(dataclasses.asdict(model),
                                                              indent=1))


def read_model_json(folder: str) -> Optional[ModelConfig]:
    """The ModelConfig a checkpoint was written for (None for a checkpoint without one)."""
    path = os.path.join(folder, MODEL_JSON)
    if not os.path.exists(path):
        return None
    return to_model(load_json_object(path, "checkpoint model file"))


def full_shapes(model: ModelConfig, vocab_rows: Optional[int] = None) -> dict[str, tuple]:
    """Canonical global name -> full (TP=1) shape of every parameter of ``model``."""
    h, a = model.hidden_size, model.num_attention_heads
    g = model.num_query_groups or a
    d = head_size(model)
    f = model.ffn_hidden_size or 4 * h
    moe = model.moe_layers()
    v = vocab_rows or model.vocab_size
    norm = ("weight", "bias") if model.normalization == "LayerNorm" else ("weight",)
    out: dict[str, tuple] = {"embedding.word_embeddings.weight": (v, h)}
    if model.position_embedding_type == "learned_absolute":
        out["embedding.position_embeddings.weight"] = (
            model.max_position_embeddings or model.seq_length, h)
    bias = model.add_bias_linear
    layers = [(f"decoder.layers.{i}.", moe[i]) for i in range(model.num_layers)]
    for k in range(getattr(model, "mtp_num_layers", 0)):  # megatron-core's MTP layers
        p = f"mtp.layers.{k}."
        for part in ("enorm", "hnorm", "final_layernorm"):
            out.update({f"{p}{part}.{w}": (h,) for w in norm})
        out[p + "eh_proj.weight"] = (h, 2 * h)
        layers.append((p + "transformer_layer.", False))  # dense (MTP with MoE is refused)
    for p, is_moe in layers:
        out.update({f"{p}input_layernorm.{w}": (h,) for w in norm})
        out[p + "self_attention.linear_qkv.weight"] = ((a + 2 * g) * d, h)
        if bias or model.add_qkv_bias:
            out[p + "self_attention.linear_qkv.bias"] = ((a + 2 * g) * d,)
        out[p + "self_attention.linear_proj.weight"] = (h, a * d)
        if model.qk_layernorm:  # one norm over the head size, shared by every head
            out.update({f"{p}self_attention.{qk}_layernorm.{w}": (d,)
                        for qk in ("q", "k") for w in norm})
        out.update({f"{p}pre_mlp_layernorm.{w}": (h,) for w in norm})
        if is_moe:
            fm = model.moe_ffn_hidden_size or f
            out[p + "mlp.router.weight"] = (model.num_moe_experts, h)
            for name in expert_names(p, model):
                fc1 = 2 * fm if model.gated_linear_unit else fm
                out[name] = (fc1, h) if name.endswith("fc1.weight") else (h, fm)
        else:
            fc1 = 2 * f if model.gated_linear_unit else f
            out[p + "mlp.linear_fc1.weight"] = (fc1, h)
            out[p + "mlp.linear_fc2.weight"] = (h, f)
        if bias:
            out[p + "self_attention.linear_proj.bias"] = (h,)
            out[p + "mlp.linear_fc1.bias"] = (fc1,)
            out[p + "mlp.linear_fc2.bias"] = (h,)
    out.update({f"decoder.final_layernorm.{w}": (h,) for w in norm})
    out["output_layer.weight"] = (v, h)  # also when tied: checkpoints hold both names
    return out


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), rel_tol=1e-6)  # eps stored as float32
    return a == b


def check_arch(saved: ModelConfig, model: ModelConfig, where: str) -> None:
    """Refuse ``model`` if its architecture differs from the checkpoint's (naming the field).
    A tied checkpoint loads into an untied model (the head starts as a copy of the embedding);
    the reverse would drop a trained head and is refused."""
    have, want = arch_of(saved), arch_of(model)
    for key in ARCH_FIELDS:
        if key == "tie_embeddings" and have[key] and not want[key]:
            continue
        if not _same(have[key], want[key]):
            raise ConfigError(
                f"checkpoint {where} was written for model.{key}={have[key]!r} but this run has "
                f"model.{key}={want[key]!r}; set model.{key}={have[key]} (or use the model "
                "config the checkpoint came with), or give a checkpoint of this model")


def check_shapes(shapes: Mapping[str, tuple], model: ModelConfig, where: str) -> None:
    """Every parameter of ``model`` is in the checkpoint with its full shape (vocabulary rows:
    at least the vocabulary; padding is refitted on load), and nothing else is."""
    want = full_shapes(model)
    for name, shape in want.items():
        if name not in shapes:
            raise ConfigError(f"checkpoint {where} has no parameter {name} (shape {shape}) that "
                              "this model config needs: it is for another architecture; check "
                              "model.* against the checkpoint's model.json")
        got = tuple(shapes[name])
        if is_vocab_param(name):
            ok = len(got) == 2 and got[1] == shape[1] and got[0] >= model.vocab_size
        else:
            ok = got == shape
        if not ok:
            raise ConfigError(f"checkpoint {where}: parameter {name} has shape {got} but this "
                              f"model config needs {shape}; check model.* (hidden size, heads, "
                              "query groups, FFN size, vocabulary) against the checkpoint")
    extra = sorted(set(shapes) - set(want))
    if extra:
        raise ConfigError(f"checkpoint {where} holds parameter {extra[0]} (and {len(extra) - 1} "
                          "more) that this model config does not have: it is for another "
                          "architecture; check model.* against the checkpoint's model.json")
