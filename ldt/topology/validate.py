"""Checks that need more than one config group, run on every rank before any collective.

A config that cannot work must fail here with one message naming the field, the value and the
fix, never later as a hang inside a collective. :func:`validate` returns the validated
:class:`~ldt.topology.ranks.Topology`, so callers cannot skip it.
"""

from __future__ import annotations

import os
from math import prod
from typing import Optional

from ldt.config import (ClusterConfig, ConfigError, DataConfig, ModelConfig, TrainConfig,
                        to_cluster, to_data, to_model, to_train)
from ldt.config.userfiles import not_a
from ldt.data.bytes import corpus_size, min_corpus_bytes, split_windows
from ldt.data.files import check_data
from ldt.models.arch import full_shapes
from ldt.models.recompute import check_stages
from ldt.models.spec import transformer_impl
from ldt.models.tensor_files import check_compatible
from ldt.schedule.size import available_bytes, gib, runs_on_ldt_runtime
from ldt.storage.checkpoint_files import preflight, read_info, skipped
from ldt.storage.snapshot_files import check_snapshot_dir
from ldt.topology.device import check_devices_present
from ldt.topology.ranks import Topology
from ldt.topology.schedule_checks import check_schedule


def validate(cluster: ClusterConfig, model: ModelConfig, world_size: Optional[int] = None, *,
             train: Optional[TrainConfig] = None, check_devices: bool = True,
             rank: Optional[int] = None) -> Topology:
    """Validate a (cluster, model[, train]) combination; return its topology. The configs are
    typed once here (a dict from a test, the API or a resolved Hydra config; a typed config
    passes as it is) and travel typed to every check. ``rank``: this process's rank under
    torchrun, whose host need have only its own stage's devices (and Transformer Engine); None
    (one launcher runs every rank here): this machine runs every stage."""
    cluster, model = to_cluster(cluster), to_model(model)
    train = None if train is None else to_train(train)
    topo = Topology.from_config(cluster, model)  # structure + layout vs model
    if world_size is not None and world_size != topo.world_size:
        raise ConfigError(
            f"world size is {world_size} but cluster needs {_world_formula(topo)}; "
            f"launch {topo.world_size} processes or change cluster.stages[*].tp / "
            "cluster.stages[*].dp / cluster.dp"
        )
    _check_model_vs_tp(topo, model)
    check_stages(model, cluster, topo)
    _check_experts(topo, model)
    _check_mtp(topo, model)
    here = range(topo.num_stages) if rank is None else [topo.rank_info(rank).stage]
    if check_devices:
        check_devices_present([topo.stages[i].device for i in here], stages=here)
    for i, s in enumerate(topo.stages):  # another host's stage: its own check runs there
        transformer_impl(model, s.device, te_available=None if i in here else True)
    if topo.is_vdp:
        _check_vdp(topo, model, train)
    if train is not None:
        _check_host_memory(topo, model)
        _check_train(topo, train)
        _check_precision(topo, model, train)
        _check_checkpoint(train, model)
    return topo


def _world_formula(topo: Topology) -> str:
    if topo.is_vdp:
        terms = " + ".join(f"{s.tp}*{d}" for s, d in zip(topo.stages, topo.dp_sizes))
        return f"sum(tp * dp) over stages = {terms} = {topo.world_size}"
    return (f"dp * sum(tp) = {topo.dp} * {topo.replica_size} = {topo.world_size} (tp per "
            f"stage {topo.tp_sizes})")


def check_files(data: DataConfig, model: ModelConfig, train: TrainConfig, topo: Topology,
                rank: Optional[int] = None) -> list[str]:
    """Refuse a data file or a resume folder that cannot work; return warnings to print.

    Checked where they are read: the data file on the ranks of data stages (the cloud stages
    of a U-shape may not have it; ``rank=None``: all ranks are local), the checkpoint on all
    (sizes in :func:`validate`; every sha256 here when ``rank=None``, else each rank checks
    the files it reads as it loads them). Relative paths are taken from the working
    directory, as the workers will. The configs are typed once here, as in :func:`validate`.
    """
    data, model, train = to_data(data), to_model(model), to_train(train)
    warnings = []
    stage = topo.rank_info(rank).stage if rank is not None and rank < topo.world_size else None
    # indexed data and tokenizers: the settings everywhere, the files on data ranks only
    check_data(data, model, train, topo, rank)
    check_snapshot_dir(train.snapshot_dir)  # on every rank: each host writes its own
    if data.blend is None and (stage is None or stage in topo.data_stages()):
        warnings += _check_data(data, model, train)  # bytes-as-tokens text
    if (train.resume or train.load) and rank in (None, 0):  # a skipped save is said once
        note = skipped(train.resume or train.load)
        if note:
            warnings.append(f"{'train.resume' if train.resume else 'train.load'}: {note}")
    if rank is None and (train.resume or train.load):  # every rank is here: hash it once
        preflight(train.resume or train.load, "train.resume" if train.resume else "train.load",
                  hashes=True)
    return warnings


def _check_data(data: DataConfig, model: ModelConfig, train: TrainConfig) -> list[str]:
    if model.vocab_size < 256:
        raise ConfigError(
            f"model.vocab_size={model.vocab_size} cannot hold byte tokens (0..255), which is "
            "what ldt's data is; set model.vocab_size >= 256")
    path, what = data.path, f"data.path={data.path!r}"
    if path and not os.path.isfile(path):
        raise ConfigError(not_a(path, what, "file", "give a text file, or leave data.path "
                                "unset for the built-in corpus"))
    head = b""
    if path:
        try:
            with open(path, "rb") as f:
                head = f.read(4096)
        except OSError as exc:
            raise ConfigError(f"{what} cannot be read ({exc.strerror}); check its permissions "
                              "or give another file") from None
    size = corpus_size(path, data.max_bytes)
    source = what if path else "the built-in corpus (data.path unset)"
    if size == 0:
        raise ConfigError(f"{source} is empty (0 bytes); give a text file with at least "
                          f"{min_corpus_bytes(model.seq_length, train.micro_batch_size)} bytes")
    if min(split_windows(size, model.seq_length)) < train.micro_batch_size:
        need = min_corpus_bytes(model.seq_length, train.micro_batch_size)
        capped = f" (data.max_bytes={data.max_bytes})" if size == data.max_bytes else ""
        raise ConfigError(
            f"{source} gives {size} bytes{capped}, too few for one micro-batch of "
            f"train.micro_batch_size={train.micro_batch_size} sequences of model.seq_length="
            f"{model.seq_length} in training and in the held-out 1/20: it needs >= {need} bytes; "
            "use a larger file (or data.max_bytes), or a smaller seq_length / micro_batch_size")
    if b"\0" in head:
        return [f"{what} looks binary (NUL bytes in its first 4 KiB); ldt trains on its raw "
                "bytes as tokens, which is only meaningful for text"]
    return []


def _check_checkpoint(train: TrainConfig, model: ModelConfig) -> None:
    """A checkpoint to resume or load from must exist, be complete and fit the model
    (metadata only, no collective)."""
    if train.resume and train.load:
        raise ConfigError(f"train.resume={train.resume!r} and train.load={train.load!r} are both "
                          "set; resume continues a run (weights, optimizer, step), load takes "
                          "weights only: set one of them")
    field, path = ("train.resume", train.resume) if train.resume else ("train.load", train.load)
    if not path:
        return
    # exists, complete, every file of the size its manifest says, a resume has steps left
    # (sha256 too: check_files on a launcher, or each rank on load)
    found = preflight(path, field, train.steps if train.resume else None, hashes=False)
    check_compatible(found, model)
    theirs = read_info(found, field).get("optimizer") if train.resume else None
    if theirs and theirs != train.optimizer.name:  # its state would be dropped without a word
        raise ConfigError(
            f"train.resume={path!r} was written by a train/optimizer={theirs} run, and this "
            f"run's is {train.optimizer.name}, which keeps other state: resume with "
            f"train/optimizer={theirs}, or start from its weights alone with train.load="
            f"{path!r}")


def _check_precision(topo: Topology, model: ModelConfig, train: TrainConfig) -> None:
    """Mixed precision and optimizer settings megatron-core's optimizer stack refuses (or
    would silently ignore), with its reason."""
    dtype, main = model.params_dtype, train.fp32_main_params
    if dtype == "float16" and main is False:
        raise ConfigError(
            "model.params_dtype=float16 with train.fp32_main_params=false: megatron-core scales "
            "the fp16 loss and unscales the gradients only in its mixed-precision optimizer, "
            "which steps fp32 main params; set train.fp32_main_params=true (or null), or use "
            "model.params_dtype=bfloat16")
    if dtype != "float32" and main is False and train.distributed_optimizer:
        raise ConfigError(
            f"train.distributed_optimizer=true with model.params_dtype={dtype} and "
            "train.fp32_main_params=false: megatron-core's distributed optimizer always shards "
            "fp32 main params for 16-bit weights; set train.fp32_main_params=true (or null), or "
            "train.distributed_optimizer=false")
    if dtype == "bfloat16" and main is False and train.clip_grad > 0:
        raise ConfigError(
            f"train.fp32_main_params=false with train.clip_grad={train.clip_grad}: megatron-core "
            "clips only fp32 gradients (clip_grad_by_total_norm_fp32 asserts it), and without "
            "main params the gradients are bf16; set train.clip_grad=0 or "
            "train.fp32_main_params=true (or null)")
    if train.distributed_optimizer and train.optimizer.name != "adam":
        raise ConfigError(
            f"train.distributed_optimizer=true with train/optimizer={train.optimizer.name}: "
            "megatron-core's distributed optimizer shards Adam only; use train/optimizer=adam "
            "or set train.distributed_optimizer=false")
    first, last = topo.stages[0].tp, topo.stages[-1].tp
    if train.distributed_optimizer and model.tie_embeddings and topo.dp > 1 \
            and not topo.u_shape and topo.num_stages > 1 and first != last:
        raise ConfigError(
            f"train.distributed_optimizer=true with model.tie_embeddings=true, cluster.dp="
            f"{topo.dp} and TP {first} on the first stage but {last} on the last: megatron-core "
            "sums the tied embedding's gradients between the two stages after the distributed "
            "optimizer's reduce-scatter, which is right only when both copies are sharded alike "
            "over the data-parallel ranks (the same TP size); give the first and last stage the "
            "same TP size, or set train.distributed_optimizer=false or model.tie_embeddings=false")
    if train.loss_scale is not None and dtype != "float16":
        raise ConfigError(
            f"train.loss_scale={train.loss_scale} with model.params_dtype={dtype}: megatron-core "
            "scales the loss only for float16 (bf16 and fp32 have the range without it); "
            "remove train.loss_scale or use model.params_dtype=float16")
    if train.initial_loss_scale is not None and (dtype != "float16" or train.loss_scale):
        raise ConfigError(
            f"train.initial_loss_scale={train.initial_loss_scale} with model.params_dtype={dtype}"
            + (f" and train.loss_scale={train.loss_scale}" if dtype == "float16" else "")
            + ": it is the first scale of float16's dynamic loss scaling; remove it"
            + (" or train.loss_scale" if dtype == "float16" else ""))


def _check_model_vs_tp(topo: Topology, model: ModelConfig) -> None:
    ffn = model.ffn_hidden_size or 4 * model.hidden_size
    dims = [
        ("model.num_attention_heads", model.num_attention_heads),
        ("model.hidden_size", model.hidden_size),
        ("model.ffn_hidden_size", ffn),
    ]  # the vocabulary is padded to fit every stage (ldt.models.vocab)
    if model.num_query_groups:
        dims.append(("model.num_query_groups", model.num_query_groups))
    for stage in topo.stages:
        if model.sequence_parallel and stage.tp > 1 and model.seq_length % stage.tp:
            raise ConfigError(
                f"model.sequence_parallel=true splits the sequence over the TP ranks of "
                f"cluster.stages[{stage.index}] ({stage.name}, tp={stage.tp}), but "
                f"model.seq_length={model.seq_length} is not a multiple of {stage.tp}; use a "
                f"seq_length that every TP size divides, or model.sequence_parallel=false")
        for name, value in dims:
            if value % stage.tp:
                ok = [t for t in range(1, value + 1) if value % t == 0 and t <= 64]
                raise ConfigError(
                    f"cluster.stages[{stage.index}].tp={stage.tp} ({stage.name}) does not divide "
                    f"{name}={value}; use a TP size that divides it, e.g. one of {ok[-6:]}"
                )


def _check_experts(topo: Topology, model: ModelConfig) -> None:
    """MoE layers and per-stage expert parallelism (``cluster.stages[i].ep``)."""
    moe = model.moe_layers()
    for stage in topo.stages:
        chunks = topo.split.stage_chunks(stage.index) if topo.split is not None else []
        holds = any(moe[ch.first_layer + i] for ch in chunks for i in range(ch.num_layers))
        where = f"cluster.stages[{stage.index}]"
        if stage.ep > 1 and not holds:
            what = "a dense model" if not model.num_moe_experts else "none of the MoE layers"
            raise ConfigError(
                f"{where}.ep={stage.ep} ({stage.name}) but the stage holds {what}; expert "
                f"parallelism spreads MoE experts, set {where}.ep=1")
        if not holds:
            continue
        if stage.tp > 1 and not model.sequence_parallel:
            raise ConfigError(
                f"{where}.tp={stage.tp} ({stage.name}) holds MoE layers, and megatron-core's "
                "MoE layer trains with TP > 1 only under sequence parallelism; set "
                "model.sequence_parallel=true, or tp=1 on the stages holding MoE layers")
        experts, ffn = model.num_moe_experts, model.moe_ffn_hidden_size or model.ffn_hidden_size \
            or 4 * model.hidden_size
        if experts % stage.ep:
            raise ConfigError(
                f"{where}.ep={stage.ep} ({stage.name}) does not divide model.num_moe_experts="
                f"{experts}: every rank holds the same number of experts; use an ep that "
                "divides both")
        if ffn % stage.etp:
            raise ConfigError(
                f"{where}: each expert is split over tp / ep = {stage.etp} ranks, which does "
                f"not divide model.moe_ffn_hidden_size={ffn}; raise {where}.ep to {stage.tp} "
                "(whole experts per rank) or change tp")
        if stage.ep > 1 and model.params_dtype == "float16":
            raise ConfigError(
                f"{where}.ep={stage.ep} with model.params_dtype=float16: megatron's fp16 loss "
                "scaling checks the expert gradients in an optimizer only that stage has, a "
                "collective the other stages would not join; use bfloat16 (or ep=1)")
def _check_mtp(topo: Topology, model: ModelConfig) -> None:
    """megatron-core runs the MTP layers inside the model chunk with the head, and they embed
    the next tokens with the input embedding: on a U-shape's edge (or one stage) both chunks
    are on the same ranks and share it; across stages it would need a tied copy (not built)."""
    # (the layout rules already keep every 'm' in the head's chunk: after the last 't', and
    # every chunk holds a 't')
    if not model.mtp_num_layers or topo.split is None:
        return
    if topo.num_stages > 1 and not topo.u_shape:
        raise ConfigError(
            f"model.mtp_num_layers={model.mtp_num_layers} on a plain pipeline of "
            f"{topo.num_stages} stages: the MTP layers (with the head, on the last stage) embed "
            "the next tokens with the input embedding, which sits on stage 0; ldt shares it "
            "only where both are on one stage: use cluster.u_shape=true (the head and the MTP "
            "layers on the edge), one stage, or model.mtp_num_layers=0")
    for untested, what in ((model.sequence_parallel and topo.stages[0].tp > 1,
                            f"model.sequence_parallel=true (stage 0 has TP {topo.stages[0].tp})"),
                           (topo.is_vdp, f"per-stage dp {topo.dp_sizes}"),
                           (model.num_moe_experts, f"model.num_moe_experts="
                                                   f"{model.num_moe_experts}")):
        if untested:
            raise ConfigError(f"model.mtp_num_layers={model.mtp_num_layers} with {what}: not "
                              "built and tested together yet; set model.mtp_num_layers=0 or "
                              "turn the other off")


def _check_vdp(topo: Topology, model: ModelConfig, train: Optional[TrainConfig]) -> None:
    """Per-stage DP runs on ldt's runtime over lane schedules (ldt.schedule.vdp)."""
    refusal = per_stage_dp_refusal(model, train, topo.u_shape, topo.num_stages)
    if refusal is not None:
        what, why = refusal
        raise ConfigError(f"{what} with per-stage dp (cluster.stages[*].dp = {topo.dp_sizes}): "
                          f"{why}")


def per_stage_dp_refusal(model: ModelConfig, train: Optional[TrainConfig], u_shape: bool,
                         num_stages: int = 2) -> Optional[tuple[str, str]]:
    """(the setting, why and the fix) that rules out stages with their own dp for this model
    and run; None where they may have it. The planner asks it too, so that it never writes
    (or an elastic world never trains) a plan that would be refused here."""
    if model.tie_embeddings and not u_shape and num_stages > 1:
        return ("model.tie_embeddings=true on a plain pipeline",
                "the embedding and the head sit on stages with their own replicas and ldt does "
                "not sum the tied gradient across them yet; set model.tie_embeddings=false, use "
                "cluster.u_shape=true (embedding and head both on the edge), or one dp for all")
    if train is not None and train.runtime == "megatron":
        return ("train.runtime=megatron",
                "megatron's schedules pair each stage with one neighbour; set train.runtime="
                "auto or ldt (ldt's runtime runs the fan-in / fan-out), or give every stage "
                "the same dp")
    if train is not None and train.schedule == "interleaved":
        return ("train.schedule=interleaved",
                "use train.schedule=auto or 1f1b, or give every stage the same dp")
    return None


def planner_mtp_refusal(mtp_num_layers: Optional[int]) -> Optional[str]:
    """Why the planner refuses a model with MTP layers (field, value and fix); None where it
    has none. The planner and an elastic run (which plans every world) both refuse with it."""
    if not mtp_num_layers:
        return None
    # a planned layout has no 'm', which validate() then refuses
    return (f"model.mtp_num_layers={mtp_num_layers}: the planner does not place MTP layers "
            "yet; set model.mtp_num_layers=0, or give cluster.stages (e.g. a plan's, written "
            "with it 0) and a cluster.layout with 'm' before its 'L' (e.g. 'Et|tt|tt|tmL'), "
            "without cluster.inventory")


def _check_host_memory(topo: Topology, model: ModelConfig) -> None:
    """A world of cpu stages that ldt-train starts on this host holds the whole model in its
    memory: refuse a model whose weights and fp32 gradients alone (a lower bound: no optimizer
    state, no activation, each parameter on the fewest replicas any stage has) exceed what the
    host has available, before any process starts. Without it a typo such as
    ``model.vocab_size=1e11`` fails inside megatron's allocation on one rank."""

    if any(s.device != "cpu" for s in topo.stages) or "LOCAL_WORLD_SIZE" in os.environ:
        # device memory is the estimate's (train.estimate_memory); a rank of a started world
        # leaves it to its launcher: its siblings' models already take what it would measure
        return
    shapes = full_shapes(model)
    if model.tie_embeddings:
        shapes.pop("output_layer.weight")
    params = sum(prod(shape) for shape in shapes.values())
    per_param = (4 if model.params_dtype == "float32" else 2) + 4  # weights + fp32 gradients
    need, have = params * per_param * min(topo.dp_sizes), available_bytes()
    if need <= have:
        return
    h = f"model.hidden_size={model.hidden_size}"
    words = prod(shapes["embedding.word_embeddings.weight"]) * (1 if model.tie_embeddings else 2)
    positions = prod(shapes.get("embedding.position_embeddings.weight", (0,)))
    length = ("model.max_position_embeddings" if model.max_position_embeddings
              else "model.seq_length")
    parts = sorted([
        (words, f"model.vocab_size={model.vocab_size} x {h} embedding"
                + ("" if model.tie_embeddings else " and output layer"), "model.vocab_size"),
        (positions, f"{length}={model.max_position_embeddings or model.seq_length} x {h} "
                    "learned position embeddings", length),
        (params - words - positions, f"model.num_layers={model.num_layers} layers",
         "model.num_layers / hidden_size")], key=lambda p: -p[0])
    shown = ", ".join(f"{n:.3g} in the {what}" for n, what, _ in parts if n)
    raise ConfigError(
        f"model {model.name!r} has {params:.3g} parameters ({shown}): their weights and fp32 "
        f"gradients alone take {gib(need)} in this world's cpu processes, and this machine has "
        f"{gib(have)} available; lower {parts[0][2]}, or give the stages to several hosts "
        "(docs/torchrun.md)")


def _check_train(topo: Topology, train: TrainConfig) -> None:
    if train.micro_batch_size < 1:
        raise ConfigError(f"train.micro_batch_size={train.micro_batch_size} must be >= 1")
    if train.num_microbatches < 1:
        raise ConfigError(f"train.num_microbatches={train.num_microbatches} must be >= 1")
    if train.eval_every < 0:
        raise ConfigError(f"train.eval_every={train.eval_every} must be >= 0 (0: no evaluation)")
    if train.boundary_noise > 0 and train.verify:
        raise ConfigError(
            f"train.verify=true with train.boundary_noise={train.boundary_noise}: the noise makes "
            "the run differ from the single-process reference on purpose; set one of them off")
    if train.boundary_noise > 0 and not runs_on_ldt_runtime(topo.u_shape, topo.is_vdp,
                                                            train.runtime, train.schedule):
        raise ConfigError(
            f"train.boundary_noise={train.boundary_noise} is applied by ldt's runtime; use "
            "cluster.u_shape=true or train.runtime=ldt (megatron's own 1F1B does not apply it)")
    check_schedule(topo, train)
