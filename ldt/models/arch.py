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

from ldt.config import ConfigError, ModelConfig

MODEL_JSON = "model.json"

# Fields that change what the weights mean or their shapes. Training-only fields (seq_length,
# params_dtype, transformer_impl, the padding multiple) may differ between runs.
ARCH_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
               "ffn_hidden_size", "vocab_size", "position_embedding_type", "rotary_base",
               "rotary_percent", "normalization", "norm_epsilon", "gated_linear_unit",
               "activation", "add_bias_linear", "add_qkv_bias", "tie_embeddings")


def arch_of(model: ModelConfig) -> dict:
    """The architecture fields, defaults resolved (ffn 4h, groups = heads)."""
    out = {k: getattr(model, k) for k in ARCH_FIELDS}
    out["ffn_hidden_size"] = model.ffn_hidden_size or 4 * model.hidden_size
    out["num_query_groups"] = model.num_query_groups or model.num_attention_heads
    return out


def write_model_json(folder: str, model: ModelConfig) -> None:
    """``folder/model.json``: the whole ModelConfig (its architecture is what loads check)."""
    from ldt.storage.atomic import replace_file

    os.makedirs(folder, exist_ok=True)
    replace_file(os.path.join(folder, MODEL_JSON), json.dumps(dataclasses.asdict(model),
                                                              indent=1))


def read_model_json(folder: str) -> Optional[ModelConfig]:
    """The ModelConfig a checkpoint was written for (None for a checkpoint without one)."""
    from ldt.config import to_model

    from ldt.userfiles import load_json_object

    path = os.path.join(folder, MODEL_JSON)
    if not os.path.exists(path):
        return None
    return to_model(load_json_object(path, "checkpoint model file"))


def full_shapes(model: ModelConfig, vocab_rows: Optional[int] = None) -> dict[str, tuple]:
    """Canonical global name -> full (TP=1) shape of every parameter of ``model``."""
    h, a = model.hidden_size, model.num_attention_heads
    g = model.num_query_groups or a
    d = h // a
    f = model.ffn_hidden_size or 4 * h
    v = vocab_rows or model.vocab_size
    norm = ("weight", "bias") if model.normalization == "LayerNorm" else ("weight",)
    out: dict[str, tuple] = {"embedding.word_embeddings.weight": (v, h)}
    if model.position_embedding_type == "learned_absolute":
        out["embedding.position_embeddings.weight"] = (
            model.max_position_embeddings or model.seq_length, h)
    bias = model.add_bias_linear
    for i in range(model.num_layers):
        p = f"decoder.layers.{i}."
        out.update({f"{p}input_layernorm.{w}": (h,) for w in norm})
        out[p + "self_attention.linear_qkv.weight"] = ((a + 2 * g) * d, h)
        if bias or model.add_qkv_bias:
            out[p + "self_attention.linear_qkv.bias"] = ((a + 2 * g) * d,)
        out[p + "self_attention.linear_proj.weight"] = (h, a * d)
        out.update({f"{p}pre_mlp_layernorm.{w}": (h,) for w in norm})
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
    from ldt.models.vocab import is_vocab_param

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
