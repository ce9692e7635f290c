"""Llama 3.1+ RoPE scaling with every Hugging Face parameter.

megatron-core's ``RotaryEmbedding._apply_scaling`` is transformers' ``llama3`` formula (the
same code: long wavelengths divided by ``factor``, short ones kept, the band in between
interpolated; ``tests/test_hf.py`` compares the frequencies), but ``GPTModel`` forwards only
``rope_scaling_factor``: the low / high frequency factors and the original context length stay
at megatron's defaults (1, 4, 8192, which are Llama 3.1-3.3's). :func:`set_llama3_frequencies`
recomputes a built model's frequencies with megatron's own method and the model's values; it
is a no-op for the defaults. Not a registered patch: it changes one module instance, not
megatron-core.
"""

from __future__ import annotations

from ldt.patches.registry import check_megatron_version

MEGATRON_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}


def set_llama3_frequencies(rotary_emb, *, kv_channels: int, rotary_percent: float,
                           rotary_base: float, factor: float, low_freq_factor: float,
                           high_freq_factor: float, original_max_position_embeddings: int) -> None:
    """Give ``rotary_emb`` (a megatron ``RotaryEmbedding`` built with ``rope_scaling=True``)
    the ``llama3`` frequencies of these parameters."""
    wanted = {"low_freq_factor": low_freq_factor, "high_freq_factor": high_freq_factor,
              "original_max_position_embeddings": original_max_position_embeddings}
    if wanted == MEGATRON_DEFAULTS:
        return  # GPTModel already applied exactly these
    check_megatron_version()
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    plain = RotaryEmbedding(kv_channels, rotary_percent, rotary_base=rotary_base,
                            use_cpu_initialization=True).inv_freq  # unscaled
    scaled = rotary_emb._apply_scaling(plain, factor=factor, **wanted)
    rotary_emb.inv_freq = scaled.to(rotary_emb.inv_freq.device)
