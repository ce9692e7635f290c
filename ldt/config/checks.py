"""Refusals shared by the config schemas: a value below its bound, and recompute settings
megatron-core refuses (model-wide in :class:`~ldt.config.model.ModelConfig`, per stage in
``cluster.stages[i].recompute``). Each names the field, the value and the fix in one line."""

from __future__ import annotations

import math
from typing import Any

from omegaconf import MISSING

from ldt.config.errors import ConfigError


def given(*values: Any) -> bool:
    """True when no value is still MISSING ('???'): a bare schema instance is not checked."""
    return all(v != MISSING for v in values)


def at_least(group: str, obj: Any, name: str, low: float, fix: str) -> None:
    """Refuse ``group.name`` below ``low`` (or not a finite number)."""
    value = getattr(obj, name)
    if not given(value) or value is None:
        return
    if not math.isfinite(value) or value < low:
        finite = "" if isinstance(value, int) else "a finite number "
        raise ConfigError(f"{group}.{name}={value} must be {finite}>= {low:g}; {fix}")


RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "moe")
"""Megatron's selective-recompute modules ldt's models have: ``mlp`` a dense layer's MLP,
``moe`` a MoE layer's whole MLP (router, dispatch, experts). Megatron's others need what ldt
does not build: ``moe_act`` grouped GEMM experts, ``mla_up_proj`` multi-latent attention,
``shared_experts`` shared experts."""


def check_recompute(field: Any, granularity, method, num_layers, modules) -> None:
    """Refuse recompute settings megatron-core refuses (or would silently ignore), before any
    process starts; ``field(name)`` spells a setting's key (``model.recompute_method``,
    ``cluster.stages[0].recompute.method``)."""
    if not given(granularity, method, num_layers, modules):
        return
    g = field("granularity")
    if granularity not in (None, *RECOMPUTE_GRANULARITIES):
        raise ConfigError(f"{g}={granularity!r} is not a recompute granularity; use none, "
                          "selective or full")
    if granularity == "full":
        if method not in RECOMPUTE_METHODS:
            raise ConfigError(
                f"{g}=full needs {field('method')} (got {method!r}; megatron-core refuses full "
                f"recompute without one): set it to uniform (each group of num_layers layers "
                "keeps only its input) or block (the first num_layers layers of each chunk are "
                "recomputed)")
        if num_layers is None or num_layers < 1:
            raise ConfigError(
                f"{g}=full needs {field('num_layers')} >= 1 (got {num_layers!r}): the layers "
                f"per uniform group, or recomputed per chunk with block; e.g. "
                f"{field('num_layers')}=1")
        if modules is not None:
            raise ConfigError(f"{field('modules')}={list(modules)} applies to selective "
                              f"recompute only; remove it, or set {g}=selective")
        return
    unused = [(k, v) for k, v in (("method", method), ("num_layers", num_layers)) if v is not None]
    if unused:
        key, value = unused[0]
        raise ConfigError(
            f"{field(key)}={value!r} with {g}={granularity!r}: it applies to full recompute "
            f"only (megatron-core refuses recompute_num_layers with selective); remove it, or "
            f"set {g}=full")
    if modules is not None and granularity in (None, "none"):
        raise ConfigError(f"{field('modules')}={list(modules)} without a granularity; set "
                          f"{g}=selective, or remove it")
    bad = [m for m in (modules or []) if m not in RECOMPUTE_MODULES]
    if bad or (modules is not None and not modules):
        raise ConfigError(
            f"{field('modules')}={list(modules)}: "
            + (f"{bad[0]!r} is not a module ldt recomputes (megatron's moe_act needs grouped "
               "GEMM experts, mla_up_proj and shared_experts models ldt does not build; on a "
               "MoE model moe recomputes the MoE layers' MLPs, mlp the dense layers'); "
               if bad else "empty; ") + f"use some of {', '.join(RECOMPUTE_MODULES)}")
