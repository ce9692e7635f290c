"""Model chunks: one megatron-core GPTModel per (stage, chunk) of the layer split.

Every chunk is built as a stand-alone GPTModel with exactly its own decoder layers
(``pipeline_model_parallel_size=1`` in its config, so megatron adds no offset of its own) and
``pre_process`` / ``post_process`` from the layout's ``E`` / ``L``. The global layer numbers
are then written onto the layers, so names and checkpoints refer to the model's real layers.
The settings that make megatron-core run on CPU (see DESIGN.md) are applied here, once.

The family (GPT, Llama, Qwen2, ...) is data in :class:`~ldt.config.ModelConfig`: positions
(learned or RoPE), norm, gated MLP and activation, GQA, biases. Each maps onto a
TransformerConfig field or a GPTModel argument; the modules are megatron-core's own, from the
layer spec :mod:`ldt.models.spec` picks per stage (local on CPU, Transformer Engine on cuda
where installed).
"""

from __future__ import annotations

from typing import Optional

import torch

from ldt.config import ModelConfig
from ldt.config.layout import Chunk
from ldt.models.arch import EXPERTS
from ldt.models.spec import TE, canonical_name, decoder_spec, layer_spec, transformer_impl
from ldt.patches.rope_scaling import set_llama3_frequencies

# megatron-core is imported inside the functions that build its modules: it takes seconds to
# import, and the name helpers below serve checkpoint code that builds nothing

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def transformer_config(model: ModelConfig, tp: int, num_layers: int, *, device: str = "cpu",
                       vpp: Optional[int] = None, num_stages: int = 1, first_layer: int = 0,
                       ep: int = 1, **overrides):
    """The TransformerConfig of one chunk (fp32/bf16/fp16, no dropout unless overridden):
    layers ``first_layer .. first_layer + num_layers - 1`` of the model, on a stage of TP
    ``tp`` whose experts are spread over ``ep`` of its TP ranks (each expert then split over
    ``tp / ep``)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    import torch.nn.functional as F

    dtype = DTYPES[model.params_dtype]
    kwargs = dict(
        num_layers=max(num_layers, 1),
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        ffn_hidden_size=model.ffn_hidden_size or 4 * model.hidden_size,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=model.gated_linear_unit,
        activation_func=F.gelu if model.activation == "gelu" else F.silu,
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        fp16=dtype is torch.float16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=device == "cpu",
        # megatron refuses sequence parallelism at TP 1; a TP 1 stage just runs without it
        sequence_parallel=bool(getattr(model, "sequence_parallel", False)) and tp > 1,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        deallocate_pipeline_outputs=False,
    )
    kwargs.update(_attention_and_experts(model, tp, num_layers, first_layer, ep))
    kwargs.update(overrides)
    config = TransformerConfig(**kwargs)
    # Set after construction: the chunk's own config has pp=1, which TransformerConfig would
    # reject together with a virtual size; the schedules read it from here.
    config.virtual_pipeline_model_parallel_size = vpp
    config.microbatch_group_size_per_vp_stage = num_stages  # megatron's default is the pp size
    return config


def _attention_and_experts(model: ModelConfig, tp: int, num_layers: int, first_layer: int,
                           ep: int) -> dict:
    """TransformerConfig fields of the head size, the QK norms and the MoE layers. A chunk's
    ``moe_layer_freq`` is its own slice of the model's pattern (the chunk is a model of its
    own layers: megatron's block spec reads the pattern from there)."""
    out = dict(kv_channels=model.kv_channels, qk_layernorm=model.qk_layernorm)
    if not model.num_moe_experts:
        return out
    pattern = model.moe_layers()[first_layer:first_layer + max(num_layers, 1)]
    return dict(
        out, num_moe_experts=model.num_moe_experts, moe_router_topk=model.moe_router_topk,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size or model.ffn_hidden_size
        or 4 * model.hidden_size,
        moe_layer_freq=[int(x) for x in pattern],
        moe_router_pre_softmax=model.moe_router_pre_softmax,
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=tp // ep)


def build_chunk(model: ModelConfig, chunk: Chunk, tp: int, *, device: str = "cpu",
                vpp: Optional[int] = None, num_stages: int = 1, pg_collection=None,
                vocab_size: Optional[int] = None, ep: int = 1, **config_overrides):
    """A GPTModel holding exactly ``chunk``'s layers, numbered globally. ``vocab_size``: the
    padded vocabulary (:func:`ldt.models.vocab.model_vocab_size`); default: the model's own.
    ``ep``: the stage's expert-parallel size (MoE models)."""
    from megatron.core.models.gpt import GPTModel

    if chunk.num_mtp:  # megatron-core computes the MTP losses in the head's chunk
        config_overrides = dict(mtp_num_layers=chunk.num_mtp,
                                mtp_loss_scaling_factor=model.mtp_loss_scaling_factor,
                                **config_overrides)
    config = transformer_config(model, tp, chunk.num_layers, device=device, vpp=vpp,
                                num_stages=num_stages, first_layer=chunk.first_layer, ep=ep,
                                **config_overrides)
    if chunk.num_layers == 0:
        raise NotImplementedError(
            f"stage {chunk.stage} chunk {chunk.index} has no decoder layer; ldt needs at least "
            "one decoder layer per chunk for now; move a layer into it in cluster.layout"
        )
    padded = chunk.has_head and vocab_size and vocab_size > model.vocab_size
    gpt = _gpt(_padded_vocab_gpt_class() if padded else GPTModel, model, chunk, config,
               device, vocab_size, pg_collection)
    if model.rope_scaling:
        set_llama3_frequencies(
            gpt.rotary_pos_emb, kv_channels=config.kv_channels,
            rotary_percent=model.rotary_percent, rotary_base=model.rotary_base,
            factor=model.rope_scaling_factor, low_freq_factor=model.rope_low_freq_factor,
            high_freq_factor=model.rope_high_freq_factor,
            original_max_position_embeddings=model.rope_original_max_position_embeddings)
    if padded:
        gpt.real_vocab_size = model.vocab_size
    _number_layers(gpt, model, chunk)
    if device != "cpu":
        gpt = gpt.to(device)
    return gpt


def _gpt(cls, model: ModelConfig, chunk: Chunk, config, device: str,
         vocab_size: Optional[int], pg_collection):
    """megatron-core's GPTModel (or ``cls``, a subclass) of the chunk's part of the model."""
    impl = transformer_impl(model, device)
    spec = layer_spec(model, impl)
    return cls(
        config=config,
        transformer_layer_spec=decoder_spec(model, impl, config),
        vocab_size=vocab_size or model.vocab_size,
        max_sequence_length=model.max_position_embeddings or model.seq_length,
        pre_process=chunk.has_embedding,
        post_process=chunk.has_head,
        share_embeddings_and_output_weights=False,
        position_embedding_type=model.position_embedding_type,
        rotary_base=model.rotary_base,
        rotary_percent=model.rotary_percent,
        rope_scaling=model.rope_scaling,
        rope_scaling_factor=model.rope_scaling_factor,
        pg_collection=pg_collection,
        mtp_block_spec=_mtp_block_spec(spec, chunk.num_mtp, impl) if chunk.num_mtp else None,
    )


def _number_layers(gpt, model: ModelConfig, chunk: Chunk) -> None:
    """Global layer numbers: the chunk's decoder layers from its first layer, its MTP layers
    after the model's decoder."""
    for i, layer in enumerate(gpt.decoder.layers):
        layer.layer_number = chunk.first_layer + i + 1
        if hasattr(layer.mlp, "router"):  # the aux-loss log is per global layer
            layer.mlp.set_layer_number(layer.layer_number)
    for i, layer in enumerate(gpt.mtp.layers if chunk.num_mtp else ()):
        layer.layer_number = i + 1  # megatron counts its transformer layer after the decoder's
        layer.transformer_layer.layer_number = model.num_layers + i + 1


def _mtp_block_spec(decoder_layer_spec, num_mtp: int, impl: str):
    """megatron-core's MTP block of ``num_mtp`` layers around the decoder's layer spec.

    megatron's ``get_gpt_mtp_block_spec`` asks ``parallel_state`` whether this is the last
    pipeline stage, which a chunk on a U-shape's edge is not; the spec it would build is this
    one (every MTP layer in the head's chunk, as megatron-core 0.16 requires)."""
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlockSubmodules, get_mtp_layer_spec)

    layer = get_mtp_layer_spec(decoder_layer_spec, use_transformer_engine=impl == TE)
    return MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * num_mtp)


_PADDED_VOCAB_GPT = None


def _padded_vocab_gpt_class():
    """GPTModel whose loss ignores the padding rows of the vocabulary.

    Padding depends on the layout (:mod:`ldt.models.vocab`: a multiple of every vocabulary
    stage's TP size), and in megatron the padded logits join the softmax, so the same model
    would give another loss on another layout, and a resume into it would not continue
    exactly. Masking the padded logits to -inf before megatron's own cross entropy makes the
    loss, and every real parameter's gradient, independent of the padding (padded rows get
    no gradient). One method overridden; the rest is megatron's GPTModel.
    """
    global _PADDED_VOCAB_GPT
    if _PADDED_VOCAB_GPT is None:
        from megatron.core.models.gpt import GPTModel

        class PaddedVocabGPTModel(GPTModel):
            real_vocab_size: int

            def compute_language_model_loss(self, labels, logits):
                local = logits.shape[-1]
                first = self.tp_group.rank() * local  # this TP rank's vocabulary slice
                if first + local > self.real_vocab_size:  # decided on ints: no device sync
                    padded = torch.arange(first, first + local, device=logits.device) \
                        >= self.real_vocab_size
                    logits = logits.masked_fill(padded, float("-inf"))
                return super().compute_language_model_loss(labels, logits)

        _PADDED_VOCAB_GPT = PaddedVocabGPTModel
    return _PADDED_VOCAB_GPT


def causal_mask(seq_length: int, device="cpu") -> torch.Tensor:
    """Megatron's boolean attention mask (True = masked); explicit so nothing builds it on cuda."""
    return torch.triu(torch.ones(1, 1, seq_length, seq_length, dtype=torch.bool, device=device),
                      diagonal=1)


def global_param_name(chunk: Chunk, local_name: str, expert_offset: int = 0) -> str:
    """``decoder.layers.<local>...`` -> ``decoder.layers.<global>...``, in the one canonical
    naming whatever the layer implementation (:func:`ldt.models.spec.canonical_name`);
    ``expert_offset``: the global number of this rank's first expert (expert parallelism)."""
    name = canonical_name(_shift_layer(local_name, chunk.first_layer))
    return shift_expert(name, expert_offset) if expert_offset else name


def param_names(chunk: Chunk, gpt) -> dict[str, str]:
    """Every parameter of a built chunk: local name -> global canonical name. A MoE layer's
    experts get the global numbers megatron gave this rank (``local_expert_indices``: with
    expert parallelism each rank holds a different block of experts)."""
    offsets = {i: layer.mlp.local_expert_indices[0]
               for i, layer in enumerate(gpt.decoder.layers)
               if getattr(layer.mlp, "local_expert_indices", None)}
    out = {}
    for name, _ in gpt.named_parameters():
        layer = _layer_of(name)
        out[name] = global_param_name(chunk, name, offsets.get(layer, 0))
    return out


def _layer_of(name: str) -> Optional[int]:
    prefix = "decoder.layers."
    return int(name[len(prefix):].split(".", 1)[0]) if name.startswith(prefix) else None


def shift_expert(name: str, offset: int) -> str:
    """A MoE expert parameter's name with its expert number moved by ``offset``."""
    head, sep, tail = name.partition(EXPERTS)
    if not sep:
        return name
    idx, rest = tail.split(".", 1)
    return f"{head}{EXPERTS}{int(idx) + offset}.{rest}"


def _shift_layer(name: str, offset: int) -> str:
    prefix = "decoder.layers."
    if not name.startswith(prefix):
        return name
    idx, rest = name[len(prefix):].split(".", 1)
    return f"{prefix}{int(idx) + offset}.{rest}"
