"""Checks that need more than one config group, run on every rank before any collective.

A config that cannot work must fail here with one message naming the field, the value and the
fix, never later as a hang inside a collective. :func:`validate` returns the validated
:class:`~ldt.topology.Topology`, so callers cannot skip it.
"""

from __future__ import annotations

from typing import Optional

from ldt.config import ConfigError, ModelConfig, TrainConfig, to_model
from ldt.device import check_devices_present
from ldt.topology import Topology


def validate(cluster, model, world_size: Optional[int] = None, *,
             train: Optional[TrainConfig] = None, check_devices: bool = True) -> Topology:
    """Validate a (cluster, model[, train]) combination; return its topology."""
    model = to_model(model)
    topo = Topology.from_config(cluster, model)  # structure + layout vs model
    if world_size is not None and world_size != topo.world_size:
        raise ConfigError(
            f"world size is {world_size} but cluster needs dp * sum(tp) = {topo.dp} * "
            f"{topo.replica_size} = {topo.world_size} (tp per stage {topo.tp_sizes}); "
            f"launch {topo.world_size} processes or change cluster.stages[*].tp / cluster.dp"
        )
    _check_model_vs_tp(topo, model)
    if check_devices:
        check_devices_present(s.device for s in topo.stages)
    if train is not None:
        _check_train(topo, train)
    return topo


def _check_model_vs_tp(topo: Topology, model: ModelConfig) -> None:
    ffn = model.ffn_hidden_size or 4 * model.hidden_size
    dims = [
        ("model.num_attention_heads", model.num_attention_heads),
        ("model.hidden_size", model.hidden_size),
        ("model.ffn_hidden_size", ffn),
        ("model.vocab_size", model.vocab_size),
    ]
    if model.num_query_groups:
        dims.append(("model.num_query_groups", model.num_query_groups))
    for stage in topo.stages:
        for name, value in dims:
            if value % stage.tp:
                ok = [t for t in range(1, value + 1) if value % t == 0 and t <= 64]
                raise ConfigError(
                    f"cluster.stages[{stage.index}].tp={stage.tp} ({stage.name}) does not divide "
                    f"{name}={value}; use a TP size that divides it, e.g. one of {ok[-6:]}"
                )


def _interleaved_example(topo: Topology) -> str:
    from ldt.layout import split_layers

    n = topo.split.num_layers if topo.split else 2 * topo.num_stages
    segs = 2 * topo.num_stages
    counts = [n // segs + (i < n % segs) for i in range(segs)]
    text = "|".join("t" * c for c in counts)
    text = "E" + text + "L"
    split_layers(n, topo.num_stages, layout=text)  # the example must itself be valid
    return text


def _check_train(topo: Topology, train: TrainConfig) -> None:
    if train.micro_batch_size < 1:
        raise ConfigError(f"train.micro_batch_size={train.micro_batch_size} must be >= 1")
    if train.num_microbatches < 1:
        raise ConfigError(f"train.num_microbatches={train.num_microbatches} must be >= 1")
    if train.eval_every < 0:
        raise ConfigError(f"train.eval_every={train.eval_every} must be >= 0 (0: no evaluation)")
    if train.schedule not in ("auto", "1f1b", "interleaved"):
        raise ConfigError(
            f"train.schedule={train.schedule!r}; use 'auto', '1f1b' or 'interleaved'"
        )
    if train.runtime not in ("auto", "megatron", "ldt"):
        raise ConfigError(f"train.runtime={train.runtime!r}; use 'auto', 'megatron' or 'ldt'")
    if train.runtime == "ldt" and train.schedule == "interleaved":
        raise ConfigError("train.runtime=ldt runs 1F1B action lists; use train.schedule=1f1b "
                          "or train.runtime=megatron for the interleaved schedule")
    if topo.u_shape and train.schedule == "interleaved":
        raise ConfigError(
            "train.schedule='interleaved' with cluster.u_shape=true: the U-shape has its own "
            "schedule; use train.schedule=auto"
        )
    vpp = topo.split.vpp_size if topo.split is not None and not topo.u_shape else 1
    if train.schedule == "interleaved" and vpp == 1:
        raise ConfigError(
            f"train.schedule=interleaved needs several chunks per stage, but cluster.layout="
            f"{topo.split.to_layout_string() if topo.split else None!r} has one segment per "
            f"stage; give a layout with k * {topo.num_stages} segments (k > 1), e.g. "
            f"{_interleaved_example(topo)!r}")
    if train.schedule == "1f1b" and vpp > 1:
        raise ConfigError(
            f"train.schedule=1f1b but cluster.layout has {vpp} chunks per stage; use "
            "train.schedule=interleaved (or auto), or one segment per stage")
    if vpp > 1:
        p, m = topo.num_stages, train.num_microbatches
        if m % p:
            raise ConfigError(
                f"train.num_microbatches={m} with the interleaved schedule over {p} stages must "
                f"be a multiple of the stage count; use {max(p, m + (p - m % p))}"
            )
