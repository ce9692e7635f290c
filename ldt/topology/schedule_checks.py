"""The schedule a run asks for (``train.schedule``, ``train.runtime``, the U-shape's prefetch,
the zero-bubble prices' keys, chunks per stage) against its cluster and layout, before any
process starts: part of :func:`ldt.topology.validate.validate`."""

from __future__ import annotations

import os

from ldt.config import ConfigError, TrainConfig
from ldt.config.layout import split_of_counts
from ldt.schedule.size import check_fits, check_schedule_size, runs_on_ldt_runtime
from ldt.topology.ranks import Topology


def check_schedule(topo: Topology, train: TrainConfig) -> None:
    """The schedule, its runtime and prefetch depth for this cluster and layout."""
    if train.schedule not in ("auto", "1f1b", "interleaved", "zb"):
        raise ConfigError(
            f"train.schedule={train.schedule!r}; use 'auto', '1f1b', 'interleaved' or 'zb'"
        )
    if train.schedule == "zb" and train.runtime == "megatron":
        raise ConfigError(
            "train.schedule=zb (zero-bubble) runs on ldt's runtime (megatron's schedules do not "
            "split the backward); got train.runtime=megatron: give train.runtime=auto or ldt, "
            "or another schedule")
    for key in ("cost_run", "cost_inventory"):  # set for nothing, they would be ignored
        if getattr(train, key) and train.schedule != "zb":
            raise ConfigError(f"train.{key}={getattr(train, key)!r} prices the zero-bubble "
                              f"order, and train.schedule={train.schedule!r}: give "
                              f"train.schedule=zb, or leave train.{key} out")
    if train.prefetch < 0 or (train.prefetch and not topo.u_shape):
        raise ConfigError(f"train.prefetch={train.prefetch}: the prefetch depth of the U-shape "
                          "schedule must be >= 0, and 0 without cluster.u_shape=true")
    if train.prefetch > train.num_microbatches:
        raise ConfigError(f"train.prefetch={train.prefetch} exceeds train.num_microbatches="
                          f"{train.num_microbatches}: no more micro-batches than there are can "
                          f"be in flight; give at most {train.num_microbatches}")
    if train.runtime not in ("auto", "megatron", "ldt"):
        raise ConfigError(f"train.runtime={train.runtime!r}; use 'auto', 'megatron' or 'ldt'")
    if train.runtime == "ldt" and train.schedule == "interleaved":
        raise ConfigError("train.runtime=ldt runs 1F1B action lists; use train.schedule=1f1b "
                          "or train.runtime=megatron for the interleaved schedule")
    if topo.u_shape and train.schedule in ("interleaved", "1f1b"):
        raise ConfigError(
            f"train.schedule={train.schedule!r} with cluster.u_shape=true: the U-shape has its "
            "own schedule; use train.schedule=auto (or zb)"
        )
    if topo.u_shape and train.runtime == "megatron":
        raise ConfigError(
            "train.runtime=megatron with cluster.u_shape=true: the U-shape runs its own "
            "schedule on ldt's runtime (megatron's schedules never return to the edge); give "
            "train.runtime=auto or ldt")
    _check_schedule_size(topo, train)
    _check_chunks_per_stage(topo, train)


def _check_chunks_per_stage(topo: Topology, train: TrainConfig) -> None:
    """A layout of several segments per stage: megatron's interleaved schedule, which alone
    runs it, and its micro-batch count."""
    vpp = topo.split.vpp_size if topo.split is not None and not topo.u_shape else 1
    if train.schedule == "interleaved" and vpp == 1:
        raise ConfigError(
            f"train.schedule=interleaved needs several chunks per stage, but cluster.layout="
            f"{topo.split.to_layout_string() if topo.split else None!r} has one segment per "
            f"stage; give a layout with k * {topo.num_stages} segments (k > 1), e.g. "
            f"{_interleaved_example(topo)!r}")
    if train.schedule == "zb" and vpp > 1:
        raise ConfigError(
            f"train.schedule=zb but cluster.layout has {vpp} chunks per stage; the zero-bubble "
            "schedules (ZB-H1, the zero-bubble U-shape) run one chunk per stage: give one "
            "segment per stage, or train.schedule=interleaved")
    if train.overlap_p2p_comm and vpp == 1:
        raise ConfigError("train.overlap_p2p_comm=true overlaps the sends of megatron's "
                          "interleaved schedule, and cluster.layout has one segment per stage; "
                          "give a layout with several chunks per stage, or leave it false")
    if train.schedule == "1f1b" and vpp > 1:
        raise ConfigError(
            f"train.schedule=1f1b but cluster.layout has {vpp} chunks per stage; use "
            "train.schedule=interleaved (or auto), or one segment per stage")
    if vpp > 1 and (train.runtime == "ldt" or topo.is_vdp or topo.num_stages == 1):
        why = ("train.runtime=ldt runs one chunk per stage" if train.runtime == "ldt" else
               "per-stage DP runs on ldt's runtime, one chunk per stage" if topo.is_vdp else
               "one stage has no pipeline to interleave")
        raise ConfigError(
            f"cluster.layout has {vpp} chunks per stage, which only megatron's interleaved "
            f"schedule runs, and {why}: give one segment per stage"
            + (", or train.runtime=auto" if train.runtime == "ldt" else ""))
    if vpp > 1:
        p, m = topo.num_stages, train.num_microbatches
        if m % p:
            raise ConfigError(
                f"train.num_microbatches={m} with the interleaved schedule over {p} stages must "
                f"be a multiple of the stage count; use {max(p, m + (p - m % p))}"
            )


def _check_schedule_size(topo: Topology, train: TrainConfig) -> None:
    """ldt's runtime materialises each step's action lists (in every process of this host)
    and keeps every action's measured times: bounded by the host's memory before it starts."""
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", topo.world_size))
    m = train.num_microbatches
    if runs_on_ldt_runtime(topo.u_shape, topo.is_vdp, train.runtime, train.schedule):
        check_schedule_size("train.num_microbatches", m, topo.num_stages,
                            replicas=max(topo.dp_sizes) if topo.is_vdp else 1,
                            processes=processes, steps=train.steps)
    # byte-token data draws one step's sample order (dp * m * mbs int64) for each micro-batch
    per_sample = 8 * max(topo.dp_sizes) * processes
    samples = m * train.micro_batch_size
    check_fits("train.num_microbatches x train.micro_batch_size", samples, samples * per_sample,
               "each micro-batch's draw of the step's sample order (dp x that many indices, in "
               f"{processes} processes)", unit_bytes=per_sample)


def _interleaved_example(topo: Topology) -> str:
    n = topo.split.num_layers if topo.split else 2 * topo.num_stages
    segs = 2 * topo.num_stages
    counts = [n // segs + (i < n % segs) for i in range(segs)]
    return split_of_counts(counts, topo.num_stages).to_layout_string()
