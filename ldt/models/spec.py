"""Which megatron-core layer implementation a stage uses, and one parameter naming for both.

``local`` is megatron-core's own modules (``get_gpt_layer_local_spec``: torch norms, megatron's
linear layers and attention), the only one that runs on CPU. ``transformer_engine`` is
``get_gpt_layer_with_transformer_engine_spec`` (fused kernels on NVIDIA GPUs). ``auto`` picks
Transformer Engine on cuda stages where it is installed, local elsewhere, so one cluster can
mix both. Transformer Engine fuses each pre-norm into the linear layer after it
(``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``);
:func:`canonical_name` maps those to the local names, so init, checkpoints and Hugging Face
conversion see one naming whatever each stage runs. The mapping is megatron-core's own (the
local spec's ``sharded_state_dict_keys_map``, which its distributed checkpoints use the other
way round).
"""

from __future__ import annotations

import functools
import importlib.util

from ldt.config import ConfigError

LOCAL, TE = "local", "transformer_engine"


def te_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def transformer_impl(model, device: str, *, te_available=None) -> str:
    """``local`` or ``transformer_engine`` for a stage on ``device`` (a ConfigError if forced
    where it cannot run)."""
    te = te_installed() if te_available is None else te_available
    choice = model.transformer_impl
    if choice == "auto":
        return TE if device == "cuda" and te else LOCAL
    if choice == TE and device != "cuda":
        raise ConfigError(f"model.transformer_impl=transformer_engine on a {device} stage: "
                          "Transformer Engine runs on cuda only; use model.transformer_impl="
                          "auto (Transformer Engine where it can run, local elsewhere)")
    if choice == TE and not te:
        raise ConfigError("model.transformer_impl=transformer_engine but transformer_engine is "
                          "not installed; install it or use model.transformer_impl=auto")
    return choice


def layer_spec(model, impl: str):
    """megatron-core's decoder layer spec for ``impl`` (norm type comes from the config)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if impl == TE:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=model.qk_layernorm)
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization=model.normalization,
                                                    qk_layernorm=model.qk_layernorm)


def decoder_spec(model, impl: str, config):
    """The spec a chunk's GPTModel is built from: one layer spec for a dense model; for a MoE
    model megatron's block spec, MoE and dense layers as the chunk config's
    ``moe_layer_freq`` says (experts on the sequential path: one megatron MLP per expert, no
    grouped GEMM, which runs on CPU and on any GPU/NPU)."""
    if not model.num_moe_experts:
        return layer_spec(model, impl)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(config, use_transformer_engine=impl == TE,
                                      normalization=model.normalization)


@functools.lru_cache(maxsize=1)
def _fused_norm_prefixes() -> tuple[tuple[str, str], ...]:
    """(Transformer Engine prefix, local prefix) pairs, from megatron-core's local spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    keys_map = get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map
    return tuple((te, local) for local, te in keys_map.items())


def canonical_name(name: str) -> str:
    """A parameter name in the local spec's form, whichever implementation holds it."""
    if "layer_norm_" not in name:
        return name
    for te, local in _fused_norm_prefixes():
        if te in name:
            return name.replace(te, local)
    return name
