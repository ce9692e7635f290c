"""``model``: the architecture (GPT, Llama, Qwen2/3, their MoE variants) as megatron-core
builds it, typed behind ``conf/model/*.yaml``; its single-group checks in ``__post_init__``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional

from omegaconf import MISSING, OmegaConf

from ldt.config.checks import at_least, check_recompute, given
from ldt.config.errors import ConfigError


@dataclass
class ModelConfig:
    name: str = "gpt"
    num_layers: int = MISSING
    hidden_size: int = MISSING
    num_attention_heads: int = MISSING
    ffn_hidden_size: Optional[int] = None
    """Defaults to 4 * hidden_size."""
    num_query_groups: Optional[int] = None
    """GQA groups; None means plain multi-head attention."""
    vocab_size: int = 256
    seq_length: int = 64
    max_position_embeddings: Optional[int] = None
    """Defaults to seq_length."""
    params_dtype: str = "float32"
    """``float32``, ``bfloat16`` or ``float16``; also the dtype of tensors at stage boundaries."""
    tie_embeddings: bool = False
    """Share input embedding and output head. On different stages (plain pipeline) the last
    stage keeps a copy that megatron's embedding group keeps equal, across TP sizes."""
    # ---- architecture (the family: GPT, Llama, Qwen2, ...), see ldt/models/build.py ----
    position_embedding_type: str = "learned_absolute"
    """``learned_absolute`` (a position table, GPT-2) or ``rope`` (rotary: Llama, Qwen2)."""
    rotary_base: float = 10000.0
    """RoPE base period (Hugging Face's ``rope_theta``); only with ``rope``."""
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions RoPE rotates; only with ``rope``."""
    rope_scaling: bool = False
    """Llama 3.1+ RoPE scaling (Hugging Face's ``rope_type: llama3``; megatron's GPTModel
    ``rope_scaling``): long wavelengths divided by ``rope_scaling_factor``, short ones kept,
    the band between the two frequency factors interpolated."""
    rope_scaling_factor: float = 8.0
    """Hugging Face's ``factor`` (Llama 3.1 / 3.3: 8, Llama 3.2: 32)."""
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    """The context length the model was pre-trained with before scaling (Llama 3: 8192)."""
    kv_channels: Optional[int] = None
    """Head size (megatron's ``kv_channels``, Hugging Face's ``head_dim``); None:
    hidden_size / num_attention_heads. Qwen3: 128 whatever the hidden size."""
    qk_layernorm: bool = False
    """Normalize queries and keys per head before RoPE (Qwen3's ``q_norm`` / ``k_norm``)."""
    # ---- mixture of experts (megatron's MoE layer; ldt/models/build.py) ----
    num_moe_experts: Optional[int] = None
    """Routed experts per MoE layer; None: a dense model."""
    moe_router_topk: int = 2
    """Experts each token is routed to (Hugging Face's ``num_experts_per_tok``)."""
    moe_ffn_hidden_size: Optional[int] = None
    """One expert's MLP width (``moe_intermediate_size``); None: ffn_hidden_size."""
    moe_layer_freq: Any = 1
    """Which layers are MoE layers (megatron's): an int k (layers 0, k, 2k, ...) or a list
    with one 0/1 per layer; the others are dense MLPs of ffn_hidden_size."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts, then top-k (the k weights are not renormalized: Hugging
    Face's ``norm_topk_prob: false``); false: softmax over the top-k logits (renormalized)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss (``router_aux_loss_coef``) added per MoE layer; its
    value is logged as ``moe_aux_loss`` (0: not computed)."""
    normalization: str = "LayerNorm"
    """``LayerNorm`` or ``RMSNorm``."""
    norm_epsilon: float = 1e-5
    """The norms' epsilon (Hugging Face's ``rms_norm_eps``)."""
    gated_linear_unit: bool = False
    """Gated MLP: fc1 computes gate and up projections, fc2 takes ``act(gate) * up``."""
    activation: str = "gelu"
    """``gelu``, ``silu``, or ``swiglu`` (SiLU with a gate: needs gated_linear_unit=true)."""
    add_bias_linear: bool = True
    """Biases in every linear layer (GPT); Llama and Qwen2 have none."""
    add_qkv_bias: bool = False
    """Biases in the QKV projection even without add_bias_linear (Qwen2)."""
    make_vocab_size_divisible_by: int = 128
    """Megatron's rule: the vocabulary is padded to a multiple of this times the TP size of
    every stage holding the embedding or the head (ldt.models.vocab)."""
    transformer_impl: str = "auto"
    """Megatron's layer implementation: ``local`` (megatron-core's own modules),
    ``transformer_engine``, or ``auto`` (Transformer Engine on cuda stages where it is
    installed, local elsewhere)."""
    mtp_num_layers: int = 0
    """Multi-token prediction (megatron-core's, as in DeepSeek-V3): this many MTP layers after
    the decoder, the k-th predicting the token k+1 places ahead with its own loss; they sit
    with the head (layout token ``m``, before ``L``), so on a U-shape's edge. 0: none."""
    mtp_loss_scaling_factor: float = 0.1
    """Weight of the MTP losses (their mean over the MTP layers) added to the training loss
    (megatron-core's ``mtp_loss_scaling_factor``)."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism on every stage of TP > 1 (TP 1 stages run without):
    activations outside attention and the MLP split along the sequence over the stage's TP
    ranks. Stage boundaries gather and scatter the sequence (docs/design.md). Needs
    seq_length to be a multiple of every such stage's TP size."""
    recompute_granularity: Optional[str] = None
    """Activation recomputation on every stage (megatron-core's): ``null`` / ``none`` (keep
    every activation), ``selective`` or ``full``; ``cluster.stages[i].recompute`` overrides it
    per stage (docs/memory.md)."""
    recompute_method: Optional[str] = None
    """``full`` only: ``uniform`` or ``block`` (megatron's; see RecomputeConfig)."""
    recompute_num_layers: Optional[int] = None
    """``full`` only: layers per uniform group, or layers recomputed per chunk with block."""
    recompute_modules: Optional[List[str]] = None
    """``selective`` only: from ``core_attn`` (the default), ``mlp``, ``layernorm``."""

    def __post_init__(self) -> None:
        if self.params_dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(
                f"model.params_dtype={self.params_dtype!r} is not supported; "
                "use float32, bfloat16 or float16"
            )
        for name, what in (("num_layers", "the number of decoder layers"),
                           ("hidden_size", "the model width"),
                           ("num_attention_heads", "the number of attention heads"),
                           ("vocab_size", "the vocabulary size"),
                           ("seq_length", "the tokens per sample"),
                           ("ffn_hidden_size", "the MLP width, or leave it unset (4 * hidden)"),
                           ("num_query_groups", "the GQA groups, or leave it unset (MHA)"),
                           ("max_position_embeddings", "a value >= seq_length, or leave it unset")):
            at_least("model", self, name, 1, f"set model.{name} to {what}")
        heads, hidden = self.num_attention_heads, self.hidden_size
        # Megatron-LM's rule (megatron-core would silently use hidden_size // heads): without
        # kv_channels, the head size is hidden_size / num_attention_heads and must be whole.
        if given(heads, hidden) and getattr(self, "kv_channels", None) is None and hidden % heads:
            near = sorted({hidden - hidden % heads, hidden - hidden % heads + heads} - {0})
            divisors = [d for d in range(1, 129) if hidden % d == 0 and hidden // d >= 8]
            raise ConfigError(
                f"model.hidden_size={hidden} is not a multiple of model.num_attention_heads="
                f"{heads}: megatron's head size is hidden_size / num_attention_heads "
                f"(kv_channels), which must be whole; use model.hidden_size="
                f"{' or '.join(map(str, near))}, "
                f"or model.num_attention_heads in {divisors[-6:]} (a divisor of {hidden})")
        groups = self.num_query_groups
        if given(heads, groups) and groups is not None and heads % groups:
            raise ConfigError(
                f"model.num_query_groups={groups} does not divide model.num_attention_heads="
                f"{heads} (each group serves heads / groups query heads); use a divisor of "
                f"{heads}, or leave num_query_groups unset for plain multi-head attention")
        seq, pos = self.seq_length, self.max_position_embeddings
        if given(seq, pos) and pos is not None and pos < seq:
            raise ConfigError(
                f"model.max_position_embeddings={pos} < model.seq_length={seq}: the position "
                f"embedding has no row for the later tokens; set max_position_embeddings >= "
                f"{seq} or leave it unset")
        for key, allowed in (("position_embedding_type", ("learned_absolute", "rope")),
                             ("normalization", ("LayerNorm", "RMSNorm")),
                             ("activation", ("gelu", "silu", "swiglu")),
                             ("transformer_impl", ("auto", "local", "transformer_engine"))):
            if getattr(self, key) not in allowed:
                raise ConfigError(f"model.{key}={getattr(self, key)!r} is not supported; use "
                                  f"one of {', '.join(allowed)}")
        if self.activation == "swiglu" and not self.gated_linear_unit:
            raise ConfigError("model.activation=swiglu is SiLU with a gate; set "
                              "model.gated_linear_unit=true, or use model.activation=silu")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ConfigError(f"model.rotary_percent={self.rotary_percent} must be in (0, 1]")
        check_recompute(lambda k: f"model.recompute_{k}", self.recompute_granularity,
                        self.recompute_method, self.recompute_num_layers, self.recompute_modules)
        self._check_rope_and_moe()
        at_least("model", self, "mtp_num_layers", 0, "0 builds no MTP layer")
        at_least("model", self, "mtp_loss_scaling_factor", 0, "megatron's default is 0.1")
        if self.make_vocab_size_divisible_by < 1:
            raise ConfigError(f"model.make_vocab_size_divisible_by="
                              f"{self.make_vocab_size_divisible_by} must be >= 1")

    def moe_layers(self) -> list[bool]:
        """Whether each decoder layer is a MoE layer (megatron's ``moe_layer_freq`` rule)."""
        if not self.num_moe_experts:
            return [False] * self.num_layers
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            return [i % freq == 0 for i in range(self.num_layers)]
        return [bool(x) for x in freq]

    def _check_rope_and_moe(self) -> None:
        if not given(self.num_layers, self.moe_layer_freq):
            return
        for name in ("kv_channels", "num_moe_experts", "moe_ffn_hidden_size",
                     "rope_original_max_position_embeddings"):
            at_least("model", self, name, 1, f"set model.{name} to a positive size, or leave "
                                              "it unset")
        if self.rope_scaling:
            if self.position_embedding_type != "rope":
                raise ConfigError("model.rope_scaling=true scales RoPE frequencies; it needs "
                                  "model.position_embedding_type=rope")
            at_least("model", self, "rope_scaling_factor", 1, "Llama 3.1 uses 8")
            low, high = self.rope_low_freq_factor, self.rope_high_freq_factor
            if not (math.isfinite(low) and math.isfinite(high) and 0 < low < high):
                raise ConfigError(
                    f"model.rope_low_freq_factor={low} and model.rope_high_freq_factor={high} "
                    "must satisfy 0 < low < high (Llama 3.1: 1 and 4)")
        if not self.num_moe_experts:
            return
        if self.add_bias_linear:
            raise ConfigError("model.num_moe_experts with model.add_bias_linear=true: ldt's MoE "
                              "families have no biases (megatron's experts take them only "
                              "unsplit); set model.add_bias_linear=false")
        at_least("model", self, "moe_router_topk", 1, "Qwen3-MoE routes each token to 8")
        if self.moe_router_topk > self.num_moe_experts:
            raise ConfigError(
                f"model.moe_router_topk={self.moe_router_topk} exceeds model.num_moe_experts="
                f"{self.num_moe_experts}; route each token to at most that many experts")
        at_least("model", self, "moe_aux_loss_coeff", 0, "0 turns the load-balancing loss off")
        freq = self.moe_layer_freq
        if OmegaConf.is_config(freq):
            freq = self.moe_layer_freq = list(OmegaConf.to_container(freq))
        if isinstance(freq, bool) or not (
                (isinstance(freq, int) and freq >= 1)
                or (isinstance(freq, (list, tuple)) and len(freq) == self.num_layers
                    and all(x in (0, 1) and not isinstance(x, float) for x in freq))):
            raise ConfigError(
                f"model.moe_layer_freq={freq!r}: give an int k >= 1 (layers 0, k, 2k, ... are "
                f"MoE layers) or a list of {self.num_layers} entries, 1 for a MoE layer and 0 "
                "for a dense one")
        if isinstance(freq, (list, tuple)):
            self.moe_layer_freq = [int(x) for x in freq]
        if not any(self.moe_layers()):
            raise ConfigError(f"model.moe_layer_freq={self.moe_layer_freq!r} makes no layer a "
                              "MoE layer; unset model.num_moe_experts for a dense model")


def fused_attention(model, device: str) -> bool:
    """Whether a stage on ``device`` runs fused (flash) attention, which keeps no ``s x s``
    scores: a cuda stage with Transformer Engine (``transformer_impl`` other than ``local``;
    assumed installed on cuda hosts). npu and cpu stages run megatron's local attention (ldt's
    layer spec there). The memory estimate and the planner both ask this."""
    return device == "cuda" and model.transformer_impl != "local"
