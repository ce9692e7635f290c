"""Checkpoints: what a run saves, gathered collectively; the files are :mod:`checkpoint_files`'s.

Each stage leader gathers its stage's TP shards (model and AdamW state) into full tensors under
global names and writes them as part ``stage_<S>`` of ``step_<N>/`` (atomically, with
checksums: :func:`ldt.training.checkpoint_files.write_part`). When every part is in place, rank
0 seals the folder (``checkpoint.json`` with the step and the model, then ``COMPLETE``) and
applies ``train.keep_last``. A save that fails (a full disk) on any writer fails on every rank
together: the partial folder is removed, the previous checkpoint is untouched, and the caller
learns why.

Because tensors are full and named globally, a checkpoint does not depend on the layout: a
run with other stages or TP sizes can resume from it (every rank reads the tensors its chunks
need from whichever stage folder holds them, and slices its TP shard). :func:`write_model`
writes such a checkpoint from full tensors alone (a model imported from elsewhere).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ldt.training import checkpoint_files as files
from ldt.training.checkpoint_files import CheckpointError, latest, step_dir  # noqa: F401


def _named_params(models, chunks):
    from ldt.models.build import global_param_name

    for chunk, gpt in zip(chunks, models):
        for name, p in gpt.named_parameters():
            yield global_param_name(chunk, name), p


def _gather_full(name: str, local: torch.Tensor, state) -> Optional[torch.Tensor]:
    """The full tensor on the stage leader (None elsewhere)."""
    from ldt.models.sharding import split_dim, unshard

    tp = len(state.stage_ranks)
    if tp == 1 or split_dim(name) is None:
        return local.detach().cpu().clone() if state.is_leader else None
    parts = [torch.empty_like(local) for _ in range(tp)] if state.is_leader else None
    dist.gather(local.detach().contiguous(), parts, dst=state.stage_ranks[0], group=state.tp_group)
    return unshard(name, [p.cpu() for p in parts]) if state.is_leader else None


@dataclass
class Saved:
    """The outcome of :func:`save`, the same on every rank: the step folder, or why not."""

    path: Optional[str]
    error: Optional[str] = None


def save(root: str, step: int, models, chunks, optimizer, state, *, info: dict,
         keep_last: int = 0, group=None) -> Saved:
    """Write this stage's part of checkpoint ``step`` (collective over the whole world;
    ``group``: a gloo group of all ranks, None for the default group). ``info`` goes into
    ``checkpoint.json``. A full disk on any writer is a :class:`Saved` with an error on every
    rank, never a partial checkpoint."""
    target = step_dir(root, step)
    model_sd, optim_sd = {}, {}
    for name, p in _named_params(models, chunks):
        full = _gather_full(name, p, state)
        st = optimizer.state.get(p, {})
        moments = {k: _gather_full(name, st[k], state) for k in ("exp_avg", "exp_avg_sq") if k in st}
        if state.is_leader:
            model_sd[name] = full
            if moments:
                optim_sd[name] = {**moments, "step": torch.as_tensor(st["step"]).clone()}
    error = None
    if state.is_leader and state.info.dp_rank == 0:
        try:
            files.write_part(target, f"stage_{state.stage}",
                             {"model": model_sd, "optim": optim_sd, "step": step})
        except files.DiskFullError as exc:
            error = str(exc)
    errors = _all_errors(error, group)
    outcome = [None]
    if dist.get_rank() == 0:
        try:
            if errors:
                raise files.DiskFullError(target)  # reported in the first writer's words
            files.seal(target, {**info, "step": step})
            files.prune(root, keep_last)
            outcome[0] = Saved(target)
        except files.DiskFullError as exc:
            files.discard(target)
            outcome[0] = Saved(None, errors[0] if errors else str(exc))
    dist.broadcast_object_list(outcome, src=0, group=group)
    return outcome[0]


def _all_errors(error: Optional[str], group) -> list[str]:
    """Every rank's error (usually none: one small all-reduce decides whether to gather)."""
    flag = torch.tensor([0 if error is None else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not int(flag):
        return []
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, error, group=group)
    return [e for e in gathered if e]


def write_model(folder: str, tensors: dict, *, step: int, model: dict) -> str:
    """A checkpoint from full (TP=1) tensors under ldt's global names, no optimizer state
    (e.g. a model imported from Hugging Face); ``model``: its config as a plain dict.
    A run resumes from it at ``step + 1`` (AdamW starts fresh)."""
    files.write_part(folder, "stage_0", {"model": dict(tensors), "optim": {}, "step": step})
    files.seal(folder, {"step": step, "model": files.model_info(model)})
    return folder


def load(path: str, models, chunks, optimizer, state, *, verified: bool = False) -> int:
    """Fill this rank's chunks and AdamW state from a checkpoint; returns the next step.
    The files this rank reads are checked against their checksums unless ``verified`` (the
    launcher checked the whole checkpoint already)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from ldt.models.sharding import shard, split_dim

    found = latest(path)
    if found is None:
        raise CheckpointError(
            f"train.resume={path!r} holds no complete checkpoint (no {files.COMPLETE} marker); "
            "give a run folder with checkpoints/ or a checkpoints/step_N folder")
    tp, tp_rank = len(state.stage_ranks), state.info.tp_rank
    wanted = dict(_named_params(models, chunks))
    step = None
    for stage_dir in files.parts(found):
        reader = FileSystemReader(os.path.join(found, stage_dir))
        keys = reader.read_metadata().state_dict_metadata
        names = [n for n in wanted if f"model.{n}" in keys]
        if not names:
            continue
        if not verified:
            files.verify(found, which=[stage_dir])
        for n in names:  # a checkpoint of another model size: name the tensor, not a raw copy_
            local = wanted[n].shape
            dim = split_dim(n)
            full = tuple(s * (tp if i == dim else 1) for i, s in enumerate(local))
            if tuple(keys[f"model.{n}"].size) != full:
                raise CheckpointError(
                    f"checkpoint {found} holds {n} of shape {tuple(keys[f'model.{n}'].size)}, "
                    f"this model needs {full}: it was saved for another model; resume with "
                    "the model it was saved with")
        sd = {"model": {n: torch.empty(keys[f"model.{n}"].size) for n in names},
              "optim": {n: {k: torch.empty(keys[f"model.{n}"].size)
                            for k in ("exp_avg", "exp_avg_sq")} | {"step": torch.zeros(())}
                        for n in names if f"optim.{n}.exp_avg" in keys},
              "step": 0}
        dcp.load(sd, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True),
                 no_dist=True)
        step = sd["step"]
        with torch.no_grad():
            for n in names:
                p = wanted.pop(n)
                p.copy_(shard(n, sd["model"][n], tp, tp_rank))
                if n in sd["optim"]:
                    o = sd["optim"][n]
                    optimizer.state[p] = {
                        "step": o["step"].clone(),
                        "exp_avg": shard(n, o["exp_avg"], tp, tp_rank).clone(),
                        "exp_avg_sq": shard(n, o["exp_avg_sq"], tp, tp_rank).clone()}
    if wanted:
        raise CheckpointError(
            f"checkpoint {found} lacks parameters {sorted(wanted)[:5]}...: it is for another "
            "model (check model.* against the run that saved it)")
    return int(step) + 1
