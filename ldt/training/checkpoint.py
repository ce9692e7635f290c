"""Checkpoints: one folder per stage, full (TP=1) tensors under global names, written atomically.

Each stage leader gathers its stage's TP shards (model and AdamW state) into full tensors and
writes them with ``torch.distributed.checkpoint`` (single-writer mode) into
``step_<N>/stage_<S>.tmp``, then renames it to ``stage_<S>``. After every stage is in place,
rank 0 writes ``step_<N>/COMPLETE`` (again write-then-rename). A checkpoint without COMPLETE
is ignored on resume, so a kill during a save never leaves one that loads half-written.

Because tensors are full and named globally, a checkpoint does not depend on the layout: a
run with other stages or TP sizes can resume from it (every rank reads the tensors its chunks
need from whichever stage folder holds them, and slices its TP shard).
"""

from __future__ import annotations

import os
import shutil
from typing import Optional

import torch
import torch.distributed as dist

COMPLETE = "COMPLETE"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, "checkpoints", f"step_{step:07d}")


def _named_params(models, chunks):
    from ldt.models.build import global_param_name

    for chunk, gpt in zip(chunks, models):
        for name, p in gpt.named_parameters():
            yield global_param_name(chunk, name), p


def _gather_full(name: str, local: torch.Tensor, state,
                 gated: bool = False) -> Optional[torch.Tensor]:
    """The full tensor on the stage leader (None elsewhere); ``gated``: a gated MLP."""
    from ldt.models.sharding import split_dim, unshard

    tp = len(state.stage_ranks)
    if tp == 1 or split_dim(name) is None:
        return local.detach().cpu().clone() if state.is_leader else None
    parts = [torch.empty_like(local) for _ in range(tp)] if state.is_leader else None
    dist.gather(local.detach().contiguous(), parts, dst=state.stage_ranks[0], group=state.tp_group)
    return unshard(name, [p.cpu() for p in parts], gated=gated) if state.is_leader else None


def save(root: str, step: int, models, chunks, optimizer, state, model=None) -> str:
    """Write this stage's part of checkpoint ``step`` (collective over the whole world);
    ``model``: the ModelConfig, recorded in ``model.json`` for the checks of later loads."""
    target = step_dir(root, step)
    from ldt.models.sharding import is_gated

    model_sd, optim_sd = {}, {}
    gated = is_gated(models[0])
    for name, p in _named_params(models, chunks):
        full = _gather_full(name, p, state, gated)
        st = optimizer.state.get(p, {})
        moments = {k: _gather_full(name, st[k], state, gated)
                   for k in ("exp_avg", "exp_avg_sq") if k in st}
        if state.is_leader:
            model_sd[name] = full
            if moments:
                optim_sd[name] = {**moments, "step": torch.as_tensor(st["step"]).clone()}
    write = state.is_leader and state.info.dp_rank == 0
    if write:
        write_tensors(target, state.stage, model_sd, step, optim_sd)
    dist.barrier()
    if dist.get_rank() == 0:
        if model is not None:
            from ldt.models.arch import write_model_json

            write_model_json(target, model)
        _write_marker(target, step)
    dist.barrier()
    return target


def write_tensors(target: str, part: int, tensors: dict, step: int,
                  optim: Optional[dict] = None) -> str:
    """Write ``target/stage_<part>``: full tensors under global names (and their AdamW state)
    with torch.distributed.checkpoint, atomically (written as ``.tmp``, then renamed). Loads
    read every ``stage_*`` folder, so a writer may split a model into any number of parts."""
    import torch.distributed.checkpoint as dcp

    os.makedirs(target, exist_ok=True)
    final = os.path.join(target, f"stage_{part}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    dcp.save({"model": tensors, "optim": optim or {}, "step": step}, checkpoint_id=tmp,
             no_dist=True)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    return final


def mark_complete(target: str, step: int) -> None:
    """The COMPLETE marker, written last: from now on the checkpoint may be loaded."""
    _write_marker(target, step)


def _write_marker(target: str, step: int) -> None:
    tmp = os.path.join(target, COMPLETE + ".tmp")
    with open(tmp, "w") as f:
        f.write(f"{step}\n")
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, os.path.join(target, COMPLETE))


def latest(path: str) -> Optional[str]:
    """A complete step folder: ``path`` itself, or the newest complete one under a run folder."""
    if os.path.exists(os.path.join(path, COMPLETE)):
        return path
    root = os.path.join(path, "checkpoints")
    if not os.path.isdir(root):
        return None
    done = sorted(d for d in os.listdir(root)
                  if os.path.exists(os.path.join(root, d, COMPLETE)))
    return os.path.join(root, done[-1]) if done else None


def load(path: str, models, chunks, optimizer, state) -> int:
    """Fill this rank's chunks and AdamW state from a checkpoint; returns the next step.
    ``optimizer=None`` (``train.load``): weights only, whatever optimizer state it holds.
    Vocabulary rows are refitted to this run's padding (:func:`ldt.models.vocab.fit_rows`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from ldt.models.sharding import is_gated, shard_into

    gated = is_gated(models[0])

    found = latest(path)
    if found is None:
        raise FileNotFoundError(
            f"train.resume={path!r} holds no complete checkpoint (no {COMPLETE} marker); give a "
            "run folder with checkpoints/ or a checkpoints/step_N folder")
    tp, tp_rank = len(state.stage_ranks), state.info.tp_rank
    wanted = dict(_named_params(models, chunks))
    step = None
    for stage_dir in sorted(d for d in os.listdir(found) if d.startswith("stage_")
                            and not d.endswith(".tmp")):
        reader = FileSystemReader(os.path.join(found, stage_dir))
        keys = reader.read_metadata().state_dict_metadata
        names = [n for n in wanted if f"model.{n}" in keys]
        if not names:
            continue
        sd = {"model": {n: torch.empty(keys[f"model.{n}"].size,
                                       dtype=keys[f"model.{n}"].properties.dtype)
                        for n in names},
              "optim": {n: {k: torch.empty(keys[f"model.{n}"].size)
                            for k in ("exp_avg", "exp_avg_sq")} | {"step": torch.zeros(())}
                        for n in names if optimizer is not None and f"optim.{n}.exp_avg" in keys},
              "step": 0}
        dcp.load(sd, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True),
                 no_dist=True)
        step = sd["step"]
        with torch.no_grad():
            for n in names:
                p = wanted.pop(n)
                p.copy_(shard_into(n, sd["model"][n], p.shape, tp, tp_rank, gated=gated))
                if n in sd["optim"]:
                    o = sd["optim"][n]
                    optimizer.state[p] = {
                        "step": o["step"].clone(),
                        "exp_avg": shard_into(n, o["exp_avg"], p.shape, tp, tp_rank,
                                              gated=gated).clone(),
                        "exp_avg_sq": shard_into(n, o["exp_avg_sq"], p.shape, tp, tp_rank,
                                                 gated=gated).clone()}
    if wanted:
        raise KeyError(f"checkpoint {found} lacks parameters {sorted(wanted)[:5]}...: it is "
                       "for another model (check model.* against the run that saved it)")
    return int(step) + 1


def tensor_index(path: str) -> dict:
    """Name -> (stage folder, storage metadata: size, dtype) of every model tensor of a
    complete checkpoint, from the metadata files alone (no tensor is read)."""
    from torch.distributed.checkpoint import FileSystemReader

    found = latest(path)
    if found is None:
        raise FileNotFoundError(f"{path!r} holds no complete checkpoint (no {COMPLETE} marker)")
    out = {}
    for stage_dir in sorted(d for d in os.listdir(found) if d.startswith("stage_")
                            and not d.endswith(".tmp")):
        folder = os.path.join(found, stage_dir)
        for key, meta in FileSystemReader(folder).read_metadata().state_dict_metadata.items():
            if key.startswith("model."):
                out.setdefault(key[len("model."):], (folder, meta))
    return out


def read_tensors(index: dict, names) -> dict:
    """Full tensors ``names`` (stored dtype) from a :func:`tensor_index`, one folder at a time."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    by_folder: dict = {}
    for n in names:
        by_folder.setdefault(index[n][0], []).append(n)
    out = {}
    for folder, group in by_folder.items():
        sd = {"model": {n: torch.empty(index[n][1].size, dtype=index[n][1].properties.dtype)
                        for n in group}}
        dcp.load(sd, storage_reader=FileSystemReader(folder),
                 planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
        out.update(sd["model"])
    return out


def check_compatible(path: str, model) -> None:
    """Refuse a checkpoint whose architecture or tensor shapes do not fit ``model`` (a
    ConfigError naming the field or the parameter); reads metadata only, no collective."""
    from ldt.config import ConfigError
    from ldt.models.arch import check_arch, check_shapes, read_model_json

    found = latest(path)
    if found is None:
        raise ConfigError(f"{path!r} holds no complete checkpoint (no {COMPLETE} marker); give "
                          "a run folder with checkpoints/, a checkpoints/step_N folder or an "
                          "ldt-convert output folder")
    saved = read_model_json(found)
    if saved is not None:
        check_arch(saved, model, found)
    check_shapes({n: tuple(meta.size) for n, (_, meta) in tensor_index(found).items()}, model,
                 found)
