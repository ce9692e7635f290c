"""A snapshot of another layout, joined into a checkpoint: how a re-planned world starts from
the step before the failure instead of the last disk checkpoint.

A snapshot part is one rank's state as it holds it (:mod:`ldt.training.snapshot`), so only the
same rank of the same layout can load it. A world of another layout (a host lost, the run
re-planned for the hosts left) or with a host replaced by an empty one finds the old layout's
parts where they are (own hosts, buddies' copies), picks the newest step it can join
(:func:`ldt.storage.snapshot_parts.choose`, the same on every rank), sends each missing part
to the rank that joins its old stage, and that rank joins the stage's parts into full tensors
under global names (its TP shards side by side, its distributed-optimizer spans end to end) and
writes them as that stage's part of an ordinary checkpoint of the run folder
(:func:`ldt.training.checkpoint.write_and_seal`), which every rank of the new layout then
loads as any checkpoint. The data owner's stages are joined on the data owner's host, where
all their parts are: nothing of theirs crosses to a cloud host. Messages are integers and
bytes of the parts, no pickled objects (they cross between the cloud and the data owner).
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional

import torch
import torch.distributed as dist

from ldt.launch import progress
from ldt.models.sharding import unshard
from ldt.storage import checkpoint_files as files
from ldt.storage.snapshot_parts import (META_FILE, STATE_FILE, Choice, Held, check_optimizer,
                                        choose, held_here, layout_name, part_folder, unjoinable)
from ldt.training.checkpoint import load_step, write_and_seal
from ldt.training import flat_state
from ldt.training.optim import PARAM_STATE_KINDS, RUN_STATE_KEYS
from ldt.training.snapshot import load_newest, read_part, resumes_after, run_state_of
from ldt.training.snapshot_copies import isend_buffer, recv_buffer

FIELDS = len(Held.__dataclass_fields__)


def load_snapshot(root: str, train, run_dir: str, models, chunks, optimizer, state, model,
                  group=None) -> Optional[int]:
    """Start from the run's newest snapshot in host memory, newer than the checkpoint it would
    resume from: each rank's own part when every rank holds its own in this layout
    (:func:`ldt.training.snapshot.load_newest`), else the newest one the hosts can join
    (:func:`join_newest`); the next step, or None (collective)."""
    step = load_newest(root, train.resume, train.steps, models, chunks, optimizer, group)
    if step is not None:
        return step
    found = join_newest(train.snapshot_dir, run_dir, resumes_after(train.resume), train.steps,
                        model=model, info={"steps": train.steps,
                                           "optimizer": train.optimizer.name},
                        keep_last=train.keep_last,
                        origin=train.resume or train.load, group=group)
    return None if found is None else load_step(found, models, chunks, optimizer, state,
                                                verified=True)


def join_newest(snapshot_dir: str, run_dir: str, after: int, steps: int, *, model, info: dict,
                keep_last: int, origin: Optional[str], group=None) -> Optional[str]:
    """The step folder of a checkpoint in ``run_dir`` joined from the newest snapshot that
    the world's hosts hold between them and that is newer than step ``after``, or None
    (collective over ``group``, all ranks). ``info``: the checkpoint's (``checkpoint.json``),
    with ``optimizer`` this run's ``train.optimizer.name``: a snapshot of another optimizer is
    refused (on every rank alike), and the checkpoint names the optimizer whose state its
    parts hold."""
    held = _exchange(held_here(snapshot_dir, run_dir, dist.get_rank()), group)
    choice = choose(held, after, steps)
    if choice is None:
        why = unjoinable(held, after, steps)
        if why and dist.get_rank() == 0:  # its parts are removed once the run takes snapshots
            print(f"ldt-train: {why}; the run goes on "
                  + (f"after its checkpoint of step {after}" if after >= 0 else "from step 0")
                  + " and trains the steps up to that snapshot again", flush=True)
        return None
    if "optimizer" in info:
        check_optimizer(choice.optimizer, info["optimizer"],
                        f"the snapshot of step {choice.step} in host memory (layout "
                        f"{layout_name(choice.layout)}, under {snapshot_dir})")
    progress.current().begin(f"joining the snapshot of step {choice.step} of another layout")
    target = files.step_dir(run_dir, choice.step)
    if dist.get_rank() == 0 and os.path.isdir(target):
        files.discard(target)  # an earlier attempt's unsealed folder
    dist.barrier(group=group)
    parts = _collect(choice, snapshot_dir, run_dir, group)
    joined = {j.stage: join_stage(parts[j.stage]) for j in choice.joins if j.stage in parts}
    info = {**info, "run_state": _run_state(parts, group)}
    if choice.optimizer is not None:  # its parts' state is this optimizer's
        info["optimizer"] = choice.optimizer
    saved = write_and_seal(run_dir, choice.step, joined, info=info, model=model,
                           keep_last=keep_last, group=group, origin=origin)
    if saved.error:
        raise files.CheckpointError(f"the snapshot of step {choice.step} could not be joined "
                                    f"into {target}: {saved.error}")
    if dist.get_rank() == 0:
        print(f"ldt-train: resuming from the snapshot of step {choice.step} in host memory, "
              f"joined from layout {choice.layout:012x} into {saved.path}", flush=True)
    return saved.path


def _exchange(mine: list[Held], group) -> list[Held]:
    """Every rank's list, on every rank (two collectives of integers)."""
    count = torch.tensor([len(mine)], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    if not int(count.item()):
        return []
    rows = torch.full((int(count.item()), FIELDS), -1, dtype=torch.int64)
    for i, h in enumerate(mine):
        rows[i] = torch.tensor(h.row(), dtype=torch.int64)
    every = [torch.empty_like(rows) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, rows, group=group)
    return [Held(*r) for t in every for r in t.tolist() if r[0] >= 0]


def _run_state(parts: dict, group) -> dict:
    """The optimizer's run counters, the same in every part, on every rank (rank 0 seals the
    checkpoint and may join no stage): one all-reduce (MAX) of float64s, -inf where absent
    (fp16's hysteresis count goes below 0 after repeated overflows)."""
    vec = run_vector(parts)
    dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    return run_state_from(vec)


def run_vector(parts: dict) -> torch.Tensor:
    """:data:`RUN_STATE_KEYS`' values in the first of ``parts`` ({stage: [(meta, tensors)]}),
    -inf for a key it lacks or where there is no part."""
    got = next((run_state_of(each[0][1]) for each in parts.values()), {})
    return torch.tensor([float(got.get(k, -math.inf)) for k in RUN_STATE_KEYS],
                        dtype=torch.float64)


def run_state_from(vec: torch.Tensor) -> dict:
    """:func:`run_vector` back as the counters it holds."""
    return run_state_of({f"run.{k}": v for k, v in zip(RUN_STATE_KEYS, vec) if v > -math.inf})


def _collect(choice: Choice, snapshot_dir: str, run_dir: str, group) -> dict:
    """{old stage: [(meta, tensors) of each of its parts]} on the rank that joins it: its own
    host's parts read, the others received from their holders, in one order every rank
    walks (so no pair waits on another). Ranks are global ranks (``dist.send``'s)."""
    me, out = dist.get_rank(), {}
    for join in choice.joins:
        for rank, source in join.parts:
            folder = part_folder(snapshot_dir, run_dir, choice.layout, choice.step, rank)
            if source == join.joiner == me:
                out.setdefault(join.stage, []).append(read_part(folder))
            elif source == me:
                for name in (META_FILE, STATE_FILE):
                    with open(os.path.join(folder, name), "rb") as f:
                        for work in isend_buffer(f.read(), join.joiner, group):
                            work.wait()
            elif join.joiner == me:
                meta = json.loads(recv_buffer(source, group).numpy().tobytes())
                state = flat_state.unpack(meta["index"], recv_buffer(source, group))
                out.setdefault(join.stage, []).append((meta, state))
    return out


# ---- joining one stage's parts (no collective) ---------------------------------------------
def join_stage(parts: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """One old stage's full state from its parts (one per TP rank, and with the distributed
    optimizer one per TP rank and DP rank): ``(model, optimizer)`` as
    :func:`ldt.training.checkpoint.gather` gives them, under global names. A parameter is
    joined from the TP ranks whose parts hold it, in TP rank order: every rank's for most;
    with expert parallelism an expert's from its expert-TP block only (each part names its
    experts by their global numbers: :func:`ldt.models.build.param_names`)."""
    meta = parts[0][0]
    tp, gated, sharded = meta["tp"], bool(meta["gated"]), bool(meta["sharded"])
    by_tp = [[(m, s) for m, s in parts if m["tp_rank"] == t] for t in range(tp)]
    names = list(dict.fromkeys(k[len("model."):] for each in by_tp for k in each[0][1]
                               if k.startswith("model.")))
    model, optim = {}, {}
    for name in names:
        holders = [each for each in by_tp if f"model.{name}" in each[0][1]]
        shards = [each[0][1][f"model.{name}"] for each in holders]
        model[name] = unshard(name, shards, gated=gated)
        local = [_optimizer_state(name, each, shard.shape, sharded)
                 for each, shard in zip(holders, shards)]
        if local[0]:
            optim[name] = {k: unshard(name, [each[k] for each in local], gated=gated)
                           for k in local[0] if k != "step"} | {"step": local[0]["step"]}
    for name, same in meta.get("aliases", {}).items():  # the tied head: the embedding's
        model[name] = model[same]
        if same in optim:
            optim[name] = optim[same]
    return model, optim


def _optimizer_state(name: str, parts: list[tuple[dict, dict]], shape, sharded: bool) -> dict:
    """One TP rank's optimizer tensors of ``name`` in the parameter's (TP-local) shape, fp32:
    with the distributed optimizer each DP rank's span put in its place."""
    out = {}
    numel = int(torch.Size(shape).numel())
    for meta, state in parts if sharded else parts[:1]:
        span = meta["spans"].get(name) if sharded else [0, numel]
        for kind in () if span is None else PARAM_STATE_KINDS:
            tensor = state.get(f"optim.{name}.{kind}")
            if tensor is None:
                continue
            if kind == "step":
                out["step"] = tensor
                continue
            flat = out.setdefault(kind, torch.zeros(numel, dtype=torch.float32))
            flat[span[0]:span[1]] = tensor.detach().float().reshape(-1)
    return {k: v if k == "step" else v.view(shape) for k, v in out.items()}
