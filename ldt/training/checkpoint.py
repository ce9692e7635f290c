"""Checkpoints: what a run saves and loads, collectively (the folder format and the one-process
readers and writers are :mod:`ldt.storage`'s).

Each stage leader gathers its stage's TP shards (model, the optimizer's fp32 main params and
moments, first gathered over the DP ranks when the distributed optimizer shards them) into full
tensors under global names and writes them as part ``stage_<S>`` of ``step_<N>/`` (atomically, with
checksums: :func:`ldt.storage.checkpoint_files.write_part`). When every part is in place, rank
0 writes ``model.json`` (the ModelConfig, which :func:`ldt.models.tensor_files.check_compatible`
compares) and seals
the folder (``checkpoint.json`` with the step and the checksums of its top-level files, then
``COMPLETE``) and applies ``train.keep_last``. A save that fails (a full disk) on any writer
fails on every rank together: the partial folder is removed, the previous checkpoint is
untouched, and the caller learns why.

Because tensors are full and named globally, a checkpoint does not depend on the layout: a
run with other stages or TP sizes can resume from it (every rank reads the tensors its chunks
need from whichever stage folder holds them, and slices its TP shard).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from ldt.models.arch import MODEL_JSON, write_model_json
from ldt.models.build import param_names, shift_expert
from ldt.models.sharding import is_gated, shard_into, split_dim, tp_of, unshard
from ldt.models.tensor_files import write_tensors
from ldt.storage import checkpoint_files as files
from ldt.storage.checkpoint_files import (COMPLETE, CheckpointError, latest,  # noqa: F401
                                           step_dir)
from ldt.training.optim import (load_param_state, param_state, reload_main_params,
                                state_keys)


def named_params(models, chunks):
    for chunk, gpt in zip(chunks, models):
        names = param_names(chunk, gpt)
        for name, p in gpt.named_parameters():
            yield names[name], p


def _gather_full(name: str, local: torch.Tensor, state, gated: bool = False,
                 experts: int = 0) -> dict[str, torch.Tensor]:
    """The full tensor(s) on the stage leader, by global name ({} elsewhere); ``gated``: a
    gated MLP; ``experts``: the model's MoE experts per layer. With expert parallelism a
    position of a MoE layer's experts holds another expert on each expert-parallel rank: the
    leader (which holds the first block) gets every one of them, each joined from its
    expert-TP ranks (:meth:`ldt.topology.ranks.Topology.expert_groups`)."""
    tp, ep = len(state.stage_ranks), state.topology.stages[state.stage].ep
    size, _ = tp_of(name, tp, 0, ep)
    if tp == 1 or (size == tp and split_dim(name) is None):
        return {name: local.detach().cpu().clone()} if state.is_leader else {}
    parts = [torch.empty_like(local) for _ in range(tp)] if state.is_leader else None
    dist.gather(local.detach().contiguous(), parts, dst=state.stage_ranks[0], group=state.tp_group)
    if not state.is_leader:
        return {}
    parts = [p.cpu() for p in parts]
    if size == tp:
        return {name: unshard(name, parts, gated=gated)}
    out = {}
    for k in range(ep):  # expert-parallel rank k: experts k * (experts / ep) + j
        expert = shift_expert(name, k * experts // ep)
        out[expert] = unshard(expert, parts[k * size:(k + 1) * size], gated=gated)
    return out


def gather(models, chunks, optimizer, state) -> tuple[dict, dict]:
    """This stage's training state as full tensors under global names, on the stage leader
    (collective over the stage's TP and DP groups; ``({}, {})`` on the other ranks):
    ``(model, optimizer)``, the optimizer's as ``{name: {main_param, moments..., step}}``.
    Every tensor is a copy: training may go on while it is written (:mod:`.snapshot`)."""
    model_sd, optim_sd = {}, {}
    gated = is_gated(models[0])
    experts = models[0].config.num_moe_experts or 0
    states: dict = {}  # a tied head on the embedding's stage is the same parameter: once
    for name, p in named_params(models, chunks):
        full = _gather_full(name, p, state, gated, experts)
        if optimizer is not None and id(p) not in states:
            states[id(p)] = param_state(optimizer, p, state.dp_group)
        st = states.get(id(p))
        tensors = {k: _gather_full(name, v, state, gated, experts)
                   for k, v in (st or {}).items() if k != "step"}
        model_sd.update(full)  # empty except on the leader
        for each in full if st is not None else ():
            optim_sd[each] = {**{k: v[each] for k, v in tensors.items()}, "step": st["step"]}
    return model_sd, optim_sd


def writes(state) -> bool:
    """Does this rank write its stage's part (the leader of the stage's first replica)?"""
    return state.is_leader and state.info.dp_rank == 0


@dataclass
class Saved:
    """The outcome of :func:`save`, the same on every rank: the step folder, or why not."""

    path: Optional[str]
    error: Optional[str] = None


def save(root: str, step: int, models, chunks, optimizer, state, *, info: dict, model=None,
         keep_last: int = 0, group=None, origin: Optional[str] = None) -> Saved:
    """Write this stage's part of checkpoint ``step`` (collective over the whole world;
    ``group``: a gloo group of all ranks, None for the default group). ``info`` goes into
    ``checkpoint.json``; ``model``: the ModelConfig, recorded in ``model.json`` for the checks
    of later loads; ``origin``: the checkpoint the run started from (``train.load`` /
    ``train.resume``), whose companion files (an import's tokenizer, ``hf_config.json``) every
    save carries on. A full disk on any writer is a :class:`Saved` with an error on every
    rank, never a partial checkpoint."""
    model_sd, optim_sd = gather(models, chunks, optimizer, state)
    return write_and_seal(root, step, {state.stage: (model_sd, optim_sd)} if writes(state)
                          else {}, info=info, model=model, keep_last=keep_last, group=group,
                          origin=origin)


SAVE_WAIT_S = 1800.0
"""How long a save's agreement waits for its slowest writer (:func:`save_group`): what it waits
for is a disk (a large part written over a network file system), not a peer's message, so not
``train.comm_timeout_s``: a healthy save longer than that failed the run at its first save."""


def save_group():
    """A gloo group of every rank whose collectives wait :data:`SAVE_WAIT_S` (collective:
    every rank calls it, in one place)."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=SAVE_WAIT_S))


def write_and_seal(root: str, step: int, parts: dict, *, info: dict, model=None,
                   keep_last: int = 0, group=None, origin: Optional[str] = None) -> Saved:
    """Write this rank's ``parts`` of checkpoint ``step`` ({part number: (full model
    tensors, their optimizer state)}, {} on a rank that writes none), then seal it on rank 0
    when every writer succeeded (collective over the whole world, as :func:`save`)."""
    target = step_dir(root, step)
    error = None
    for number, (model_sd, optim_sd) in parts.items():
        try:
            write_tensors(target, number, model_sd, step, optim_sd)
        except files.DiskFullError as exc:
            error = str(exc)
            break
    errors = _all_errors(error, group)
    # Flags as float64 tensors, no pickled objects: these cross to the cloud stages too (the
    # comm audit lists them); the error text is "disk full at <folder>", known everywhere.
    ok = torch.zeros(1, dtype=torch.float64)
    if dist.get_rank() == 0:
        try:
            if errors:
                raise files.DiskFullError(target)
            if model is not None:
                with files.disk_full_at(target):
                    write_model_json(target, model)
            files.carry_companions(origin, target, own=(MODEL_JSON,))
            files.seal(target, {**info, "step": step})
            files.prune(root, keep_last)
            ok[0] = 1
        except files.DiskFullError:
            files.discard(target)
    dist.broadcast(ok, src=0, group=group)
    if int(ok.item()):
        return Saved(target)
    return Saved(None, errors[0] if errors else str(files.DiskFullError(target)))


def _all_errors(error: Optional[str], group) -> list[str]:
    """Every writer's error (usually none: one small all-reduce decides whether to gather;
    only a failed save sends the messages, "disk full at <folder>", as objects)."""
    flag = torch.tensor([0.0 if error is None else 1.0], dtype=torch.float64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not int(flag.item()):
        return []
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, error, group=group)
    return [e for e in gathered if e]


def load(path: str, models, chunks, optimizer, state, *, verified: bool = False,
         weights_only: bool = False, run_dir: Optional[str] = None) -> int:
    """Fill this rank's chunks and optimizer state (a :class:`~ldt.training.optim.StageOptimizer`:
    fp32 main params and moments, sliced to this rank's TP shard and, with the distributed
    optimizer, to its DP shard) from a checkpoint; returns the next step. ``weights_only``
    (``train.load``): the weights (the main params start from them), whatever optimizer state
    it holds; ``optimizer=None``: weights alone.
    Vocabulary rows are refitted to this run's padding (:func:`ldt.models.vocab.fit_rows`).
    The files this rank reads are checked against their checksums unless ``verified`` (the
    launcher checked the whole checkpoint already). ``run_dir``: the folder the run saves
    into; rank 0 sets aside its step folders the run starts before (a roll-back:
    :func:`ldt.storage.checkpoint_files.set_aside_later`) and says so in one line."""
    field = "train.load" if weights_only else "train.resume"  # what the user gave
    found = latest(path)
    if found is None:
        raise CheckpointError(
            f"{field}={path!r} holds no complete checkpoint (no {files.COMPLETE} marker); "
            "give a run folder with checkpoints/ or a checkpoints/step_N folder")
    next_step = load_step(found, models, chunks, optimizer, state, verified=verified,
                          weights_only=weights_only, field=field)
    if run_dir is not None and dist.get_rank() == 0:  # the one rank that seals and prunes
        said = files.set_aside_later(run_dir, 0 if weights_only else next_step, found, field)
        if said:
            print(f"ldt-train: {said}", flush=True)
    return next_step


def load_step(found: str, models, chunks, optimizer, state, *, verified: bool = False,
              weights_only: bool = False, field: str = "train.resume") -> int:
    """:func:`load` from the step folder ``found`` itself (a sealed checkpoint's, or a
    snapshot's whose parts the caller verified: :mod:`.snapshot`); returns the next step."""
    gated = is_gated(models[0])
    tp, tp_rank = len(state.stage_ranks), state.info.tp_rank
    ep = state.topology.stages[state.stage].ep
    wanted = dict(named_params(models, chunks))
    kinds = state_keys(optimizer) if optimizer is not None and not weights_only else ()
    states = {}
    step = None
    for stage_dir in files.parts(found):
        part = _read_part(found, stage_dir, wanted, kinds, verified, field)
        if part is None:
            continue
        step = part["step"]
        with torch.no_grad():
            for n, tensor in part["model"].items():
                p = wanted.pop(n)
                size, rank = tp_of(n, tp, tp_rank, ep)
                p.copy_(shard_into(n, tensor, p.shape, size, rank, gated=gated))
                if n in part["optim"]:
                    states[p] = {k: shard_into(n, v, p.shape, size, rank, gated=gated)
                                 if k != "step" else v for k, v in part["optim"][n].items()}
    if wanted:
        raise CheckpointError(
            f"checkpoint {found} lacks parameters {sorted(wanted)[:5]}...: it is for another "
            "model (check model.* against the run that saved it)")
    if optimizer is not None:
        reload_main_params(optimizer)  # main params from the weights, then the saved ones
        for p, tensors in states.items():
            load_param_state(optimizer, p, tensors)
    if optimizer is not None and not weights_only:  # the lr schedule and fp16's loss scale
        optimizer.resume_at(int(step) + 1, files.read_info(found, field).get("run_state"))
    return int(step) + 1


def _read_part(found: str, stage_dir: str, wanted: dict, kinds: tuple, verified: bool,
               field: str) -> Optional[dict]:
    """The full tensors one stage folder holds of the ``wanted`` parameters (with their
    optimizer state of ``kinds``): ``{"model", "optim", "step"}``, or None when it holds none
    of them. Its files are checked against their checksums unless ``verified``."""
    reader = FileSystemReader(os.path.join(found, stage_dir))
    try:
        keys = reader.read_metadata().state_dict_metadata
    except Exception:  # a damaged .metadata: name the file if its checksum says so
        files.verify(found, which=[stage_dir], field=field)
        raise
    names = [n for n in wanted if f"model.{n}" in keys]
    if not names:
        return None
    if not verified:
        files.verify(found, which=[stage_dir], field=field)
    sd = {"model": {n: torch.empty(keys[f"model.{n}"].size,
                                   dtype=keys[f"model.{n}"].properties.dtype)
                    for n in names},
          "optim": {n: {k: torch.empty(keys[f"optim.{n}.{k}"].size)
                        for k in (*kinds, "main_param") if f"optim.{n}.{k}" in keys}
                    | {"step": torch.zeros(())}
                    for n in names if kinds and f"optim.{n}.{kinds[0]}" in keys},
          "step": 0}
    with warnings.catch_warnings():  # "assuming ... a single process": yes, on purpose
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(sd, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True),
                 no_dist=True)
    return sd
