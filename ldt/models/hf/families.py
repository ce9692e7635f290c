"""Hugging Face <-> ldt mapping, one table per family (the shape of torchtitan's adapters).

Each :class:`Family` is data: a literal table from Hugging Face names to ldt's canonical
names (``{}`` is the layer number; ``None`` drops the tensor), the fused tensors (megatron's
``linear_qkv`` from q/k/v, ``linear_fc1`` from gate/up) with the named helper that fuses and
splits them, and the config fields. Only the helpers below transform values; everything else
is a rename.

Conventions, measured against ``transformers``' own forward (``tests/test_hf.py``):

- QKV: megatron's fused ``linear_qkv`` is grouped per query group (for each KV group g:
  its ``heads/groups`` query heads, then k_g, then v_g); Hugging Face keeps q, k, v apart.
- gate/up: a gated ``linear_fc1`` is ``[gate; up]`` in full (``act(gate) * up``).
- RoPE: Hugging Face's Llama/Qwen2 rotate halves (``rotate_half``), as megatron-core does with
  ``rotary_interleaved=False``; no permutation of q/k rows is needed (the permutation in
  Hugging Face's own Llama conversion script maps Meta's interleaved layout, not megatron's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ldt.config import ConfigError

# ---- the transformations ---------------------------------------------------------------------


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
             groups: int) -> torch.Tensor:
    """q [heads*d, ...], k/v [groups*d, ...] -> megatron's [groups*(heads/groups+2)*d, ...]."""
    d = k.shape[0] // groups
    rest = q.shape[1:]
    per = heads // groups
    fused = torch.cat([q.reshape(groups, per * d, *rest), k.reshape(groups, d, *rest),
                       v.reshape(groups, d, *rest)], dim=1)
    return fused.reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, heads: int, groups: int):
    """Inverse of :func:`fuse_qkv`: (q, k, v)."""
    per = heads // groups
    d = qkv.shape[0] // (groups * (per + 2))
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, (per + 2) * d, *rest)
    q, k, v = grouped.split([per * d, d, d], dim=1)
    return (q.reshape(heads * d, *rest).contiguous(), k.reshape(groups * d, *rest).contiguous(),
            v.reshape(groups * d, *rest).contiguous())


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([gate, up])


def split_gate_up(fc1: torch.Tensor):
    gate, up = fc1.chunk(2)
    return gate.contiguous(), up.contiguous()


# ---- the families ---------------------------------------------------------------------------

_L = "model.layers.{}."
_D = "decoder.layers.{}."

_LLAMA_WEIGHTS = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
    _L + "input_layernorm.weight": _D + "input_layernorm.weight",
    _L + "post_attention_layernorm.weight": _D + "pre_mlp_layernorm.weight",
    _L + "self_attn.o_proj.weight": _D + "self_attention.linear_proj.weight",
    _L + "mlp.down_proj.weight": _D + "mlp.linear_fc2.weight",
    _L + "self_attn.rotary_emb.inv_freq": None,  # recomputed from rope_theta
}
_QKV = {_D + "self_attention.linear_qkv.weight": (
    (_L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight",
     _L + "self_attn.v_proj.weight"), "qkv")}
_QKV_BIAS = {_D + "self_attention.linear_qkv.bias": (
    (_L + "self_attn.q_proj.bias", _L + "self_attn.k_proj.bias",
     _L + "self_attn.v_proj.bias"), "qkv")}
_GATE_UP = {_D + "mlp.linear_fc1.weight": (
    (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"), "gate_up")}


@dataclass(frozen=True)
class Family:
    """One Hugging Face architecture: names, fused tensors, config fields."""

    name: str
    architecture: str  # the ``architectures`` entry of config.json
    config_class: str  # transformers' config class
    weights: dict  # HF name -> ldt name (None: dropped)
    fused: dict  # ldt name -> ((HF names in order), "qkv" | "gate_up")
    extra_config: Callable = field(default=lambda hf: {})  # family-specific ModelConfig fields
    extra_hf: Callable = field(default=lambda model: {})  # family-specific HF config fields

    # ---- names ----
    def ldt_names(self, num_layers: int, tied: bool) -> list[str]:
        """Every ldt tensor this family produces, in checkpoint order."""
        names = []
        for ldt in [*self.weights.values(), *self.fused]:
            if ldt is None:
                continue
            names += [ldt.format(i) for i in range(num_layers)] if "{}" in ldt else [ldt]
        return names

    def sources(self, ldt_name: str):
        """(HF names, join kind or None) that make ``ldt_name``."""
        layer, pattern = _pattern(ldt_name)
        for hf, ldt in self.weights.items():
            if ldt == pattern:
                return (hf.format(layer),), None
        for ldt, (hfs, kind) in self.fused.items():
            if ldt == pattern:
                return tuple(h.format(layer) for h in hfs), kind
        raise KeyError(ldt_name)

    def dropped(self, hf_name: str) -> bool:
        _, pattern = _pattern(hf_name, "model.layers.")
        return pattern in self.weights and self.weights[pattern] is None

    # ---- values ----
    def join(self, kind: Optional[str], parts, model) -> torch.Tensor:
        if kind is None:
            return parts[0]
        if kind == "qkv":
            return fuse_qkv(*parts, model.num_attention_heads,
                            model.num_query_groups or model.num_attention_heads)
        return fuse_gate_up(*parts)

    def split(self, kind: Optional[str], tensor, model) -> tuple:
        if kind is None:
            return (tensor,)
        if kind == "qkv":
            return split_qkv(tensor, model.num_attention_heads,
                             model.num_query_groups or model.num_attention_heads)
        return split_gate_up(tensor)

    # ---- configs ----
    def model_fields(self, hf) -> dict:
        """ModelConfig fields (architecture) from a transformers config object."""
        head_dim = getattr(hf, "head_dim", None)
        if head_dim and head_dim != hf.hidden_size // hf.num_attention_heads:
            raise ConfigError(f"{self.architecture}: head_dim={head_dim} differs from "
                              f"hidden_size/num_attention_heads="
                              f"{hf.hidden_size // hf.num_attention_heads}; ldt does not "
                              "support a separate head dimension yet")
        if hf.hidden_act != "silu":
            raise ConfigError(f"{self.architecture}: hidden_act={hf.hidden_act!r}; the "
                              "family table knows the SiLU-gated MLP (silu) only")
        theta, partial = _rope(hf, self.architecture)
        return dict(
            name=f"{self.name}_imported", num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size, num_attention_heads=hf.num_attention_heads,
            num_query_groups=hf.num_key_value_heads or hf.num_attention_heads,
            ffn_hidden_size=hf.intermediate_size, vocab_size=hf.vocab_size,
            max_position_embeddings=hf.max_position_embeddings,
            position_embedding_type="rope", rotary_base=theta, rotary_percent=partial,
            normalization="RMSNorm", norm_epsilon=hf.rms_norm_eps, gated_linear_unit=True,
            activation="swiglu", add_bias_linear=False,
            tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            **self.extra_config(hf))

    def hf_config(self, model, dtype: torch.dtype, base: Optional[dict] = None):
        """A transformers config for ``model`` (non-architecture fields from ``base``)."""
        import transformers

        fields = dict(base or {})
        fields.update(
            architectures=[self.architecture], vocab_size=model.vocab_size,
            hidden_size=model.hidden_size, intermediate_size=model.ffn_hidden_size,
            num_hidden_layers=model.num_layers, num_attention_heads=model.num_attention_heads,
            num_key_value_heads=model.num_query_groups or model.num_attention_heads,
            hidden_act="silu", max_position_embeddings=(model.max_position_embeddings
                                                        or model.seq_length),
            rms_norm_eps=model.norm_epsilon, rope_theta=model.rotary_base,
            tie_word_embeddings=model.tie_embeddings,
            torch_dtype=str(dtype).replace("torch.", ""), **self.extra_hf(model))
        for key in ("rope_parameters", "rope_scaling", "model_type", "transformers_version",
                    "dtype", "quantization_config"):
            fields.pop(key, None)
        return getattr(transformers, self.config_class)(**fields)

    def check_model(self, model) -> None:
        """Refuse an ldt model this family cannot express (naming the field)."""
        want = dict(position_embedding_type="rope", normalization="RMSNorm",
                    gated_linear_unit=True, activation="swiglu", add_bias_linear=False,
                    rotary_percent=1.0, **self.extra_config(None))
        for key, value in want.items():
            if getattr(model, key) != value:
                raise ConfigError(f"model.{key}={getattr(model, key)!r}: a Hugging Face "
                                  f"{self.architecture} has {key}={value!r}; this model has no "
                                  "Hugging Face family (llama and qwen2 are known)")


def _llama_extra(hf) -> dict:
    if hf is None:
        return {"add_qkv_bias": False}
    for key in ("attention_bias", "mlp_bias"):
        if getattr(hf, key, False):
            raise ConfigError(f"LlamaForCausalLM with {key}=true is not supported (megatron's "
                              "add_bias_linear puts biases on every linear layer at once)")
    return {"add_qkv_bias": False}


def _qwen2_extra(hf) -> dict:
    if hf is not None and getattr(hf, "use_sliding_window", False):
        raise ConfigError("Qwen2ForCausalLM with use_sliding_window=true is not supported "
                          "(megatron's local attention spec is causal over the whole sequence)")
    return {"add_qkv_bias": True}


def _rope(hf, arch: str) -> tuple[float, float]:
    """(rope_theta, partial rotary factor); refuses RoPE scaling ldt does not implement."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    scaling = getattr(hf, "rope_scaling", None) or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ConfigError(f"{arch}: rope_type={kind!r} (RoPE scaling) is not supported; ldt "
                          "imports models with plain RoPE (rope_type 'default')")
    theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    return float(theta), float(partial or 1.0)


LLAMA = Family("llama", "LlamaForCausalLM", "LlamaConfig", _LLAMA_WEIGHTS,
               {**_QKV, **_GATE_UP}, extra_config=_llama_extra,
               extra_hf=lambda model: {"attention_bias": False, "mlp_bias": False})
QWEN2 = Family("qwen2", "Qwen2ForCausalLM", "Qwen2Config", _LLAMA_WEIGHTS,
               {**_QKV, **_QKV_BIAS, **_GATE_UP}, extra_config=_qwen2_extra,
               extra_hf=lambda model: {"use_sliding_window": False})
FAMILIES = {f.architecture: f for f in (LLAMA, QWEN2)}


def family_of_hf(hf) -> Family:
    """The family of a transformers config: its ``architectures``, else its ``model_type``."""
    archs = list(getattr(hf, "architectures", None) or [])
    for arch in archs:
        if arch in FAMILIES:
            return FAMILIES[arch]
    by_type = {f.name: f for f in FAMILIES.values()}
    if not archs and getattr(hf, "model_type", None) in by_type:
        return by_type[hf.model_type]
    raise ConfigError(f"architectures={archs} (model_type={getattr(hf, 'model_type', None)!r}): "
                      f"ldt converts {', '.join(FAMILIES)}; add a Family table to "
                      "ldt/models/hf/families.py for another architecture")


def family_of_model(model) -> Family:
    """The family an ldt model exports as: Qwen2 has QKV biases, Llama none."""
    family = QWEN2 if model.add_qkv_bias else LLAMA
    family.check_model(model)
    return family


def _pattern(name: str, layers: str = "decoder.layers."):
    """(layer number or None, name with ``{}`` for it)."""
    if not name.startswith(layers):
        return None, name
    idx, rest = name[len(layers):].split(".", 1)
    return int(idx), f"{layers}{{}}.{rest}"
