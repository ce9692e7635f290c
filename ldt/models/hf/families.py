"""Hugging Face <-> ldt mapping, one table per family (the shape of torchtitan's adapters).

Each :class:`Family` is data: a literal table from Hugging Face names to ldt's canonical
names (``{}`` is the layer number; ``None`` drops the tensor), the fused tensors (megatron's
``linear_qkv`` from q/k/v, ``linear_fc1`` from gate/up) with the named helper that fuses and
splits them, and the config fields. Only the helpers below transform values; everything else
is a rename.

Conventions, measured against ``transformers``' own forward (``tests/test_hf.py``):

- QKV: megatron's fused ``linear_qkv`` is grouped per query group (for each KV group g:
  its ``heads/groups`` query heads, then k_g, then v_g); Hugging Face keeps q, k, v apart.
- gate/up: a gated ``linear_fc1`` is ``[gate; up]`` in full (``act(gate) * up``), for the
  dense MLP and for every MoE expert (megatron's ``mlp.experts.local_experts.<e>``, ``e`` the
  global expert number; Hugging Face's ``mlp.experts.<e>.{gate,up,down}_proj``).
- Qwen3's ``q_norm`` / ``k_norm`` are megatron's ``q_layernorm`` / ``k_layernorm`` (RMSNorm over
  the head size, before RoPE); Qwen3-MoE's router ``mlp.gate`` is ``mlp.router``.
- Names carry up to two numbers (the layer, an expert); a table writes ``{}`` for each, in
  that order.
- RoPE: Hugging Face's Llama/Qwen2 rotate halves (``rotate_half``), as megatron-core does with
  ``rotary_interleaved=False``; no permutation of q/k rows is needed (the permutation in
  Hugging Face's own Llama conversion script maps Meta's interleaved layout, not megatron's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ldt.config import ConfigError, ModelConfig
from ldt.models.arch import head_size

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
_QK_NORM = {_L + "self_attn.q_norm.weight": _D + "self_attention.q_layernorm.weight",
            _L + "self_attn.k_norm.weight": _D + "self_attention.k_layernorm.weight"}
_E = _D + "mlp.experts.local_experts.{}."
_MOE_WEIGHTS = {_L + "mlp.gate.weight": _D + "mlp.router.weight",
                _L + "mlp.experts.{}.down_proj.weight": _E + "linear_fc2.weight"}
_EXPERT_GATE_UP = {_E + "linear_fc1.weight": (
    (_L + "mlp.experts.{}.gate_proj.weight", _L + "mlp.experts.{}.up_proj.weight"), "gate_up")}


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
    def sources(self, ldt_name: str):
        """(HF names, join kind or None) that make ``ldt_name``."""
        numbers, pattern = _pattern(ldt_name)
        for hf, ldt in self.weights.items():
            if ldt == pattern:
                return (hf.format(*numbers),), None
        for ldt, (hfs, kind) in self.fused.items():
            if ldt == pattern:
                return tuple(h.format(*numbers) for h in hfs), kind
        raise KeyError(ldt_name)

    def dropped(self, hf_name: str) -> bool:
        _, pattern = _pattern(hf_name)
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
        if hf.hidden_act != "silu":
            raise ConfigError(f"{self.architecture}: hidden_act={hf.hidden_act!r}; the "
                              "family table knows the SiLU-gated MLP (silu) only")
        kv, heads = getattr(hf, "num_key_value_heads", None), hf.num_attention_heads
        if kv is not None and (not isinstance(heads, int) or heads < 1 or kv < 1 or heads % kv):
            raise ConfigError(f"{self.architecture}: num_key_value_heads={kv} with "
                              f"num_attention_heads={heads}; the KV heads must be >= 1 and "
                              "divide the attention heads: fix config.json")
        head_dim = getattr(hf, "head_dim", None)
        return dict(
            name=f"{self.name}_imported", num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size, num_attention_heads=hf.num_attention_heads,
            num_query_groups=hf.num_key_value_heads or hf.num_attention_heads,
            kv_channels=head_dim if head_dim and head_dim * hf.num_attention_heads
            != hf.hidden_size else None,
            ffn_hidden_size=hf.intermediate_size, vocab_size=hf.vocab_size,
            max_position_embeddings=hf.max_position_embeddings,
            position_embedding_type="rope", **_rope(hf, self.architecture),
            normalization="RMSNorm", norm_epsilon=hf.rms_norm_eps, gated_linear_unit=True,
            activation="swiglu", add_bias_linear=False,
            tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            **self.extra_config(hf))

    def hf_config(self, model, dtype: torch.dtype, base: Optional[dict] = None):
        """A transformers config for ``model`` (non-architecture fields from ``base``)."""
        import transformers

        fields = dict(base or {})
        for key in ("rope_parameters", "rope_scaling", "rope_theta", "model_type",
                    "transformers_version", "dtype", "quantization_config", "layer_types",
                    "head_dim", "num_experts", "num_local_experts"):
            fields.pop(key, None)
        fields.update(
            architectures=[self.architecture], vocab_size=model.vocab_size,
            hidden_size=model.hidden_size, intermediate_size=model.ffn_hidden_size,
            num_hidden_layers=model.num_layers, num_attention_heads=model.num_attention_heads,
            num_key_value_heads=model.num_query_groups or model.num_attention_heads,
            **({"head_dim": head_size(model)} if model.kv_channels or model.qk_layernorm
               else {}),
            hidden_act="silu", max_position_embeddings=(model.max_position_embeddings
                                                        or model.seq_length),
            rms_norm_eps=model.norm_epsilon, rope_parameters=_rope_parameters(model),
            tie_word_embeddings=model.tie_embeddings,
            torch_dtype=str(dtype).replace("torch.", ""), **self.extra_hf(model))
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
                                  f"Hugging Face family ({', '.join(FAMILY_NAMES)} are known)")


def _no_bias(arch: str, hf, *keys) -> None:
    for key in keys:
        if getattr(hf, key, False):
            raise ConfigError(f"{arch} with {key}=true is not supported (megatron's "
                              "add_bias_linear puts biases on every linear layer at once)")


def _no_sliding_window(arch: str, hf) -> None:
    sliding = [i for i, kind in enumerate(getattr(hf, "layer_types", None) or [])
               if kind != "full_attention"]
    if getattr(hf, "use_sliding_window", False) or sliding:
        raise ConfigError(f"{arch} with use_sliding_window=true (layer_types: sliding attention "
                          f"in layers {sliding}) is not supported: megatron's local attention "
                          "spec is causal over the whole sequence")


def _llama_extra(hf) -> dict:
    if hf is not None:
        _no_bias(LLAMA_ARCHITECTURE, hf, "attention_bias", "mlp_bias")
    return {"add_qkv_bias": False, "qk_layernorm": False, "num_moe_experts": None}


def _qwen2_extra(hf) -> dict:
    if hf is not None:
        _no_sliding_window("Qwen2ForCausalLM", hf)
    return {"add_qkv_bias": True, "qk_layernorm": False, "num_moe_experts": None}


def _qwen3_extra(hf) -> dict:
    if hf is not None:
        _no_bias("Qwen3ForCausalLM", hf, "attention_bias")
        _no_sliding_window("Qwen3ForCausalLM", hf)
    return {"add_qkv_bias": False, "qk_layernorm": True, "num_moe_experts": None}


def _qwen3_moe_extra(hf) -> dict:
    """Qwen3-MoE: the router and experts in megatron's MoE fields. Qwen3-MoE's
    ``norm_topk_prob: true`` renormalizes the top-k softmax weights, which is megatron's
    softmax over the top-k logits (``moe_router_pre_softmax: false``)."""
    out = {"add_qkv_bias": False, "qk_layernorm": True}
    if hf is None:
        return out
    arch = "Qwen3MoeForCausalLM"
    _no_bias(arch, hf, "attention_bias")
    _no_sliding_window(arch, hf)
    step, dense = getattr(hf, "decoder_sparse_step", 1) or 1, set(hf.mlp_only_layers or [])
    pattern = [int(i not in dense and (i + 1) % step == 0)
               for i in range(hf.num_hidden_layers)]
    if not any(pattern):
        raise ConfigError(f"{arch}: mlp_only_layers={sorted(dense)} and decoder_sparse_step="
                          f"{step} leave no MoE layer; import it as a dense model instead")
    # sequence parallelism is a training choice, but megatron's MoE layer needs it on any
    # stage of TP > 1: the imported config has it on (TP 1 stages run without)
    return dict(out, sequence_parallel=True,
                num_moe_experts=hf.num_experts, moe_router_topk=hf.num_experts_per_tok,
                moe_ffn_hidden_size=hf.moe_intermediate_size,
                moe_layer_freq=1 if all(pattern) else pattern,
                moe_router_pre_softmax=not hf.norm_topk_prob,
                moe_aux_loss_coeff=float(getattr(hf, "router_aux_loss_coef", 0.0) or 0.0))


def _qwen3_moe_hf(model) -> dict:
    return {"num_experts": model.num_moe_experts, "num_experts_per_tok": model.moe_router_topk,
            "moe_intermediate_size": model.moe_ffn_hidden_size or model.ffn_hidden_size,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, moe in enumerate(model.moe_layers()) if not moe],
            "norm_topk_prob": not model.moe_router_pre_softmax,
            "router_aux_loss_coef": model.moe_aux_loss_coeff,
            "attention_bias": False, "use_sliding_window": False}


_LLAMA3_KEYS = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_low_freq_factor",
                "high_freq_factor": "rope_high_freq_factor",
                "original_max_position_embeddings": "rope_original_max_position_embeddings"}


LLAMA_ARCHITECTURE = "LlamaForCausalLM"


def _rope(hf, arch: str) -> dict:
    """The RoPE fields: base, rotated fraction and Llama 3.1's scaling (``rope_type: llama3``,
    megatron's ``rope_scaling``); other RoPE scalings are refused, naming the type."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    scaling = getattr(hf, "rope_scaling", None) or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    out = dict(rotary_base=float(theta), rotary_percent=float(partial or 1.0))
    if kind == "llama3" and arch != LLAMA_ARCHITECTURE:  # as docs/models.md says: export
        # could not write it back (ldt's model families carry it for Llama only)
        raise ConfigError(f"{arch}: rope_type 'llama3' (Llama 3.1's RoPE scaling) is "
                          f"imported for {LLAMA_ARCHITECTURE} only; ldt imports plain RoPE "
                          f"(rope_type 'default') for {arch}")
    if kind == "llama3":
        values = {**scaling, **params}
        missing = [k for k in _LLAMA3_KEYS if values.get(k) is None]
        if missing:
            raise ConfigError(f"{arch}: rope_parameters of rope_type 'llama3' lack {missing}; "
                              "a Llama 3.1 config.json gives factor, low_freq_factor, "
                              "high_freq_factor and original_max_position_embeddings")
        return dict(out, rope_scaling=True,
                    **{ours: type(getattr(_DEFAULT_MODEL, ours))(values[theirs])
                       for theirs, ours in _LLAMA3_KEYS.items()})
    if kind != "default":
        raise ConfigError(f"{arch}: rope_type={kind!r} (RoPE scaling) is not supported; ldt "
                          "imports plain RoPE (rope_type 'default') and Llama 3.1's 'llama3'")
    return out


def _rope_parameters(model) -> dict:
    """transformers' ``rope_parameters`` of ``model`` (the inverse of :func:`_rope`)."""
    out = {"rope_type": "default", "rope_theta": model.rotary_base}
    if model.rotary_percent != 1.0:
        out["partial_rotary_factor"] = model.rotary_percent
    if model.rope_scaling:
        out.update(rope_type="llama3", **{theirs: getattr(model, ours)
                                           for theirs, ours in _LLAMA3_KEYS.items()})
    return out


_DEFAULT_MODEL = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
_DENSE = {**_LLAMA_WEIGHTS, **_QK_NORM}
LLAMA = Family("llama", LLAMA_ARCHITECTURE, "LlamaConfig", _LLAMA_WEIGHTS,
               {**_QKV, **_GATE_UP}, extra_config=_llama_extra,
               extra_hf=lambda model: {"attention_bias": False, "mlp_bias": False})
QWEN2 = Family("qwen2", "Qwen2ForCausalLM", "Qwen2Config", _LLAMA_WEIGHTS,
               {**_QKV, **_QKV_BIAS, **_GATE_UP}, extra_config=_qwen2_extra,
               extra_hf=lambda model: {"use_sliding_window": False})
QWEN3 = Family("qwen3", "Qwen3ForCausalLM", "Qwen3Config", _DENSE, {**_QKV, **_GATE_UP},
               extra_config=_qwen3_extra,
               extra_hf=lambda model: {"attention_bias": False, "use_sliding_window": False})
QWEN3_MOE = Family("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                   {**_DENSE, **_MOE_WEIGHTS}, {**_QKV, **_GATE_UP, **_EXPERT_GATE_UP},
                   extra_config=_qwen3_moe_extra, extra_hf=_qwen3_moe_hf)
FAMILIES = {f.architecture: f for f in (LLAMA, QWEN2, QWEN3, QWEN3_MOE)}
FAMILY_NAMES = [f.name for f in FAMILIES.values()]


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
    """The family an ldt model exports as: Qwen3-MoE has experts, Qwen3 QK norms, Qwen2 QKV
    biases, Llama none of these (its RoPE may be Llama 3.1's scaled one)."""
    if model.num_moe_experts:
        family = QWEN3_MOE
    elif model.qk_layernorm:
        family = QWEN3
    else:
        family = QWEN2 if model.add_qkv_bias else LLAMA
    family.check_model(model)
    if model.rope_scaling and family is not LLAMA:
        raise ConfigError(f"model.rope_scaling=true: the Hugging Face {family.architecture} "
                          "has no Llama 3.1 RoPE scaling; set model.rope_scaling=false")
    return family


def _pattern(name: str):
    """(numbers in the name, the name with ``{}`` for each): ``decoder.layers.3.mlp.experts.
    local_experts.5.linear_fc2.weight`` -> ((3, 5), ``decoder.layers.{}....local_experts.{}...``)."""
    parts = name.split(".")
    numbers = tuple(int(p) for p in parts if p.isdigit())
    return numbers, ".".join("{}" if p.isdigit() else p for p in parts)
