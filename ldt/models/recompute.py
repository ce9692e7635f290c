"""Activation recomputation per stage: megatron-core's own, chosen per stage.

Each stage has its own device and memory, so recomputation is a stage's setting: the model's
``model.recompute_*`` apply everywhere, a stage's ``cluster.stages[i].recompute`` with a
granularity replaces them on that stage (``none``: no recomputation there), and :func:`transformer_kwargs` hands the result to the TransformerConfig
of that stage's chunks (both of the U-shape edge's). Megatron's rules are checked before any
process starts (:func:`check_stages`; the single-field ones in :func:`ldt.config.check_recompute`):
full recompute needs a method and a layer count; ``uniform`` walks a chunk in groups of
``num_layers`` layers, so the count must divide every chunk's layer count (megatron would index
past the chunk's last layer); ``block`` recomputes the first ``num_layers`` layers of each
chunk (all of a shorter one). Pure data: no torch.
"""

from __future__ import annotations

from typing import Any, Optional

from ldt.config import ConfigError, ModelConfig, RecomputeConfig, check_recompute


def _setting(granularity, method, num_layers, modules) -> Optional[RecomputeConfig]:
    if granularity in (None, "none"):
        return None
    return RecomputeConfig(granularity, method, num_layers,
                           list(modules) if modules is not None else None)


def model_recompute(model: ModelConfig) -> Optional[RecomputeConfig]:
    """The model-wide setting (None: keep every activation)."""
    return _setting(model.recompute_granularity, model.recompute_method,
                    model.recompute_num_layers, model.recompute_modules)


def stage_recompute(model: ModelConfig, stage: Any) -> Optional[RecomputeConfig]:
    """The recomputation a cluster stage (StageConfig or its dict) runs; None: none."""
    own = stage.get("recompute") if isinstance(stage, dict) else getattr(stage, "recompute", None)
    if isinstance(own, dict):
        own = RecomputeConfig(**own)
    if own is None or own.granularity is None:
        return model_recompute(model)
    return _setting(own.granularity, own.method, own.num_layers, own.modules)


def overrides(stage: Any) -> bool:
    """Whether a cluster stage sets its own recomputation."""
    own = stage.get("recompute") if isinstance(stage, dict) else getattr(stage, "recompute", None)
    granularity = own.get("granularity") if isinstance(own, dict) else getattr(own, "granularity",
                                                                               None)
    return granularity is not None


def transformer_kwargs(rc: Optional[RecomputeConfig]) -> dict:
    """TransformerConfig fields for ``rc`` (megatron's names)."""
    if rc is None:
        return {}
    out = {"recompute_granularity": rc.granularity, "recompute_method": rc.method,
           "recompute_num_layers": rc.num_layers}
    if rc.modules is not None:
        out["recompute_modules"] = list(rc.modules)
    return out


def describe(rc: Optional[RecomputeConfig]) -> str:
    """``-``, ``selective``, ``selective(core_attn,mlp)``, ``full/uniform/1``."""
    if rc is None:
        return "-"
    if rc.granularity == "full":
        return f"full/{rc.method}/{rc.num_layers}"
    return "selective" + (f"({','.join(rc.modules)})" if rc.modules else "")


def check_stages(model: ModelConfig, cluster, topo) -> None:
    """Every stage's recompute setting against megatron's rules and the stage's chunks."""
    for i, stage in enumerate(cluster.stages):
        own = stage.recompute
        if own.granularity is not None:
            check_recompute(lambda k, i=i: f"cluster.stages[{i}].recompute.{k}", own.granularity,
                            own.method, own.num_layers, own.modules)
        elif (own.method, own.num_layers, own.modules) != (None, None, None):
            raise ConfigError(
                f"cluster.stages[{i}].recompute sets method / num_layers / modules without a "
                f"granularity (which would take the model's); set cluster.stages[{i}].recompute."
                "granularity=selective or full, or remove them")
        rc = stage_recompute(model, stage)
        prefix = f"cluster.stages[{i}].recompute." if overrides(stage) else "model.recompute_"
        if rc is not None and "mlp" in (rc.modules or []) and model.add_bias_linear:
            raise ConfigError(
                f"{prefix}modules={rc.modules} on stage {i} ({stage.name}) with "
                "model.add_bias_linear=true: megatron-core 0.16's MLP returns its fc2 bias "
                "parameter out of the recompute checkpoint, whose backward then recomputes "
                "itself until memory runs out; drop mlp (core_attn, layernorm work), or use "
                "full recompute")
        _check_moe_module(model, rc, prefix, i, stage.name, topo)
        if rc is None or rc.method != "uniform" or topo.split is None:
            continue
        field = prefix + "num_layers"
        for chunk in topo.split.stage_chunks(i):
            if chunk.num_layers % rc.num_layers:
                raise ConfigError(
                    f"{field}={rc.num_layers} with method uniform does not divide the "
                    f"{chunk.num_layers} decoder layers of stage {i} ({stage.name}) chunk "
                    f"{chunk.index}: megatron's uniform recompute walks each chunk in groups of "
                    f"that many layers; use a divisor of {chunk.num_layers} (1 always works), "
                    "or method block")


def _check_moe_module(model: ModelConfig, rc, prefix: str, i: int, name: str, topo) -> None:
    """``moe`` recomputes MoE layers only (megatron ignores it elsewhere): refused on a model
    without MoE layers, and in a stage's own setting when the stage holds none of them."""
    if rc is None or "moe" not in (rc.modules or []):
        return
    moe = model.moe_layers()
    if not any(moe):
        raise ConfigError(f"{prefix}modules={rc.modules}: moe recomputes MoE layers and "
                          "the model has none; use mlp for its MLPs")
    if prefix.startswith("cluster.") and topo.split is not None and not any(
            moe[layer] for chunk in topo.split.stage_chunks(i) for layer in chunk.layers):
        raise ConfigError(f"{prefix}modules={rc.modules}: stage {i} ({name}) holds none of "
                          "the model's MoE layers; remove moe there (mlp recomputes its dense "
                          "layers' MLPs)")
