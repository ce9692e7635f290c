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
from ldt.layout import Chunk

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def transformer_config(model: ModelConfig, tp: int, num_layers: int, *, device: str = "cpu",
                       vpp: Optional[int] = None, num_stages: int = 1, **overrides):
    """The TransformerConfig of one chunk (fp32/bf16/fp16, no dropout unless overridden)."""
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
    kwargs.update(overrides)
    config = TransformerConfig(**kwargs)
    # Set after construction: the chunk's own config has pp=1, which TransformerConfig would
    # reject together with a virtual size; the schedules read it from here.
    config.virtual_pipeline_model_parallel_size = vpp
    config.microbatch_group_size_per_vp_stage = num_stages  # megatron's default is the pp size
    return config


def build_chunk(model: ModelConfig, chunk: Chunk, tp: int, *, device: str = "cpu",
                vpp: Optional[int] = None, num_stages: int = 1, pg_collection=None,
                vocab_size: Optional[int] = None, **config_overrides):
    """A GPTModel holding exactly ``chunk``'s layers, numbered globally. ``vocab_size``: the
    padded vocabulary (:func:`ldt.models.vocab.model_vocab_size`); default: the model's own."""
    from megatron.core.models.gpt import GPTModel

    from ldt.models.spec import layer_spec, transformer_impl

    if chunk.num_mtp:  # megatron-core computes the MTP losses in the head's chunk
        config_overrides = dict(mtp_num_layers=chunk.num_mtp,
                                mtp_loss_scaling_factor=model.mtp_loss_scaling_factor,
                                **config_overrides)
    config = transformer_config(model, tp, chunk.num_layers, device=device, vpp=vpp,
                                num_stages=num_stages, **config_overrides)
    if chunk.num_layers == 0:
        raise NotImplementedError(
            f"stage {chunk.stage} chunk {chunk.index} has no decoder layer; ldt needs at least "
            "one decoder layer per chunk for now; move a layer into it in cluster.layout"
        )
    cls = GPTModel
    if chunk.has_head and vocab_size and vocab_size > model.vocab_size:
        cls = _padded_vocab_gpt_class()
    impl = transformer_impl(model, device)
    spec = layer_spec(model, impl)
    gpt = cls(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size or model.vocab_size,
        max_sequence_length=model.max_position_embeddings or model.seq_length,
        pre_process=chunk.has_embedding,
        post_process=chunk.has_head,
        share_embeddings_and_output_weights=False,
        position_embedding_type=model.position_embedding_type,
        rotary_base=model.rotary_base,
        rotary_percent=model.rotary_percent,
        pg_collection=pg_collection,
        mtp_block_spec=_mtp_block_spec(spec, chunk.num_mtp, impl) if chunk.num_mtp else None,
    )
    if cls is not GPTModel:
        gpt.real_vocab_size = model.vocab_size
    for i, layer in enumerate(gpt.decoder.layers):
        layer.layer_number = chunk.first_layer + i + 1
    for i, layer in enumerate(gpt.mtp.layers if chunk.num_mtp else ()):
        layer.layer_number = i + 1  # megatron counts its transformer layer after the decoder's
        layer.transformer_layer.layer_number = model.num_layers + i + 1
    if device != "cpu":
        gpt = gpt.to(device)
    return gpt


def _mtp_block_spec(decoder_layer_spec, num_mtp: int, impl: str):
    """megatron-core's MTP block of ``num_mtp`` layers around the decoder's layer spec.

    megatron's ``get_gpt_mtp_block_spec`` asks ``parallel_state`` whether this is the last
    pipeline stage, which a chunk on a U-shape's edge is not; the spec it would build is this
    one (every MTP layer in the head's chunk, as megatron-core 0.16 requires)."""
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlockSubmodules, get_mtp_layer_spec)

    from ldt.models.spec import TE

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
                padded = torch.arange(first, first + local, device=logits.device) \
                    >= self.real_vocab_size
                if bool(padded.any()):
                    logits = logits.masked_fill(padded, float("-inf"))
                return super().compute_language_model_loss(labels, logits)

        _PADDED_VOCAB_GPT = PaddedVocabGPTModel
    return _PADDED_VOCAB_GPT


def causal_mask(seq_length: int, device="cpu") -> torch.Tensor:
    """Megatron's boolean attention mask (True = masked); explicit so nothing builds it on cuda."""
    return torch.triu(torch.ones(1, 1, seq_length, seq_length, dtype=torch.bool, device=device),
                      diagonal=1)


def global_param_name(chunk: Chunk, local_name: str) -> str:
    """``decoder.layers.<local>...`` -> ``decoder.layers.<global>...``, in the one canonical
    naming whatever the layer implementation (:func:`ldt.models.spec.canonical_name`)."""
    from ldt.models.spec import canonical_name

    return canonical_name(_shift_layer(local_name, chunk.first_layer))


def _shift_layer(name: str, offset: int) -> str:
    prefix = "decoder.layers."
    if not name.startswith(prefix):
        return name
    idx, rest = name[len(prefix):].split(".", 1)
    return f"{prefix}{int(idx) + offset}.{rest}"
