"""Which snapshot a world starts from when its parts are not all its own: chosen as data.

A rank's snapshot part (:mod:`ldt.storage.snapshot_files`) is its state as it holds it in its
layout. When the world that starts is another (a host lost and the run re-planned for the
hosts left, or a host replaced by a fresh one), its ranks cannot load their own parts; but the
parts of the old layout may all still be somewhere: on the hosts that survived, and the lost
host's as copies on its buddy's (:mod:`ldt.topology.buddies`). Each part carries
:data:`META_FILE` (:class:`Held`'s fields: who wrote it and where that rank sat in its
layout), so every rank of the new world lists what its host holds (:func:`held_here`), the
lists are exchanged (as integers, :mod:`ldt.training.snapshot_join`), and every rank computes
the same :func:`choose`: the newest step of one layout for which every stage can be joined
back into full tensors, which rank joins each old stage (one that holds most of its parts:
the data owner's stages are joined on the data owner's host, where all their parts are), and
where each other part comes from. No torch and no collectives here (tests/test_snapshot_join.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import astuple, dataclass
from typing import Optional, Sequence

from ldt.config.schema import OPTIMIZER_NAMES
from ldt.storage import snapshot_files
from ldt.storage.checkpoint_files import CheckpointError, step_dir, verify_part

META_FILE = "meta.json"  # in each part: Held's fields (optimizer by name) but holder, layout, step
STATE_FILE = "state.bin"  # in each part: the flat buffer (ldt.training.flat_state)

OPTIMIZERS = OPTIMIZER_NAMES
"""``train.optimizer.name``'s values, numbered: a part's optimizer crosses between ranks as
its index here (:attr:`Held.optimizer`)."""


@dataclass(frozen=True)
class Held:
    """A verified part of a snapshot, held on the host of rank ``holder`` (of the world that
    starts); the rest is the rank ``rank`` of the old layout that wrote it."""

    holder: int
    layout: int      # the layout folder's name (hex) as a number
    step: int
    rank: int
    world: int       # the old layout's world size and stage count
    stages: int
    stage: int
    tp: int
    tp_rank: int
    dp: int
    dp_rank: int
    ep: int
    sharded: int     # 1: its optimizer state is a span of the stage's (distributed optimizer)
    optimizer: int = -1  # the index of the optimizer that wrote it in OPTIMIZERS; -1: unknown

    def row(self) -> list[int]:
        return list(astuple(self))


@dataclass(frozen=True)
class StageJoin:
    """Old stage ``stage``'s parts, joined on rank ``joiner``: (old rank, the rank that holds
    it and sends it to the joiner, or the joiner itself)."""

    stage: int
    joiner: int
    parts: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Choice:
    layout: int
    step: int
    joins: tuple[StageJoin, ...]
    optimizer: Optional[str] = None  # the parts' train.optimizer.name; None: not recorded


def layout_name(layout: int) -> str:
    return f"{layout:012x}"


def part_folder(snapshot_dir: str, run_dir: str, layout: int, step: int, rank: int) -> str:
    """Where this host holds rank ``rank``'s part of a step whole: its own, else a copy (one
    of them verified, :func:`held_here`; an own part that does not is passed over, as there)."""
    root = os.path.join(snapshot_dir, snapshot_files.PREFIX + snapshot_files.run_key(run_dir),
                        layout_name(layout))
    own = os.path.join(step_dir(root, step), snapshot_files.part_name(rank))
    if _meta(own) is not None:
        return own
    return os.path.join(step_dir(snapshot_files.copies_root(root), step),
                        snapshot_files.part_name(rank))


def held_here(snapshot_dir: Optional[str], run_dir: str, holder: int) -> list[Held]:
    """Every part of the run's snapshots on this host (any layout) whose checksums verify."""
    if not snapshot_dir:
        return []
    run = os.path.join(snapshot_dir, snapshot_files.PREFIX + snapshot_files.run_key(run_dir))
    out = []
    for layout in sorted(os.listdir(run)) if os.path.isdir(run) else ():
        try:
            number = int(layout, 16)
        except ValueError:
            continue
        own = os.path.join(run, layout)
        for root in (own, snapshot_files.copies_root(own)):
            for step in snapshot_files.steps(root):
                folder = step_dir(root, step)
                for part in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
                    meta = _meta(os.path.join(folder, part))
                    if meta is not None:
                        out.append(Held(holder, number, step, **meta))
    return out


def _meta(part: str) -> Optional[dict]:
    """A whole part's meta, or None (a part being written, damaged, or of an older ldt)."""
    if part.endswith(".tmp") or not os.path.isfile(os.path.join(part, META_FILE)):
        return None
    try:
        verify_part(part)
        with open(os.path.join(part, META_FILE)) as f:
            meta = json.load(f)
        if not isinstance(meta.get("index"), list):  # an older ldt's part (torch.save)
            return None
        fields = {k: int(meta[k]) for k in ("rank", "world", "stages", "stage", "tp",
                                            "tp_rank", "dp", "dp_rank", "ep", "sharded")}
        name = meta.get("optimizer")  # absent in a part of an earlier ldt: unknown, accepted
        return {**fields, "optimizer": OPTIMIZERS.index(name) if name in OPTIMIZERS else -1}
    except (CheckpointError, OSError, ValueError, KeyError, TypeError):
        return None


def choose(held: Sequence[Held], after: int, steps: int) -> Optional[Choice]:
    """The newest (step, layout) after step ``after`` (the checkpoint the run would resume
    from; -1: none) that leaves a step of the run's ``steps`` to train and whose every stage
    can be joined from the parts ``held``; None when there is none. Every rank computes it
    from the same list, so all agree without another message."""
    for step, layout in _candidates(held, after, steps):
        here = [h for h in held if (h.step, h.layout) == (step, layout)]
        joins = _joins(here)
        if not isinstance(joins, str):
            name = next((OPTIMIZERS[h.optimizer] for h in here if h.optimizer >= 0), None)
            return Choice(layout, step, joins, name)
    return None


def check_optimizer(theirs: Optional[str], ours: str, snapshot: str) -> None:
    """Refuse to resume from ``snapshot`` (what to call it in the message) written by a run
    of optimizer ``theirs`` into one of ``ours`` (``train.optimizer.name``): its state (Adam's
    moments, SGD's momentum) would be dropped without a word, as a checkpoint's would
    (``ldt.topology.validate`` refuses that resume). ``theirs`` None: a part written before
    ldt recorded its optimizer, unknown, accepted."""
    if theirs is not None and theirs != ours:
        raise CheckpointError(
            f"{snapshot} was written by a train/optimizer={theirs} run, and this run's "
            f"train.optimizer is {ours}, which keeps other state: resume with "
            f"train/optimizer={theirs}, or remove the run's snapshots (or set "
            "train.snapshot_dir=null) and start from a checkpoint's weights alone with "
            "train.load")


def unjoinable(held: Sequence[Held], after: int, steps: int) -> Optional[str]:
    """Why the newest snapshot :func:`choose` passed over cannot be joined (one line), None
    when there is none newer than step ``after``: what a run that starts from an older
    checkpoint, or from the start, says it leaves behind."""
    candidates = _candidates(held, after, steps)
    if not candidates:
        return None
    step, layout = candidates[0]
    return (f"the snapshot of step {step} in host memory (layout {layout_name(layout)}) "
            f"cannot be joined: {_joins([h for h in held if (h.step, h.layout) == (step, layout)])}")


def _candidates(held: Sequence[Held], after: int, steps: int) -> list[tuple[int, int]]:
    """(step, layout) of the snapshots after step ``after`` that leave a step to train, newest
    first."""
    return sorted({(h.step, h.layout) for h in held if after < h.step < steps - 1},
                  reverse=True)


def _joins(here: list[Held]) -> tuple[StageJoin, ...] | str:
    """How each stage of one snapshot is joined, or why some stage cannot be: a TP rank with
    no part (its optimizer span of every DP rank, with the distributed optimizer; else any
    replica's). Expert parallelism needs nothing more: every TP rank's part is needed either
    way, an expert's joined from the block of TP ranks that holds it."""
    stages = here[0].stages
    out = []
    for stage in range(stages):
        mine = [h for h in here if h.stage == stage]
        if not mine:
            return f"no host holds a part of its stage {stage} (its host is gone, no copy)"
        tp, dp, sharded = mine[0].tp, mine[0].dp, mine[0].sharded
        need = []  # sets of old ranks, one of each needed
        for tp_rank in range(tp):
            replicas = sorted({h.rank for h in mine if h.tp_rank == tp_rank})
            dp_ranks = {h.dp_rank for h in mine if h.tp_rank == tp_rank}
            if not replicas or (sharded and len(dp_ranks) < dp):
                return (f"no host holds {'every DP rank' if replicas else 'any'} part of its "
                        f"stage {stage}'s TP rank {tp_rank}"
                        + (f" (the distributed optimizer shards it over {dp})" if replicas
                           else "") + " (its host is gone, no copy)")
            need += [[r] for r in replicas] if sharded else [replicas]
        holders = sorted({h.holder for h in mine})  # joined where most of its parts are
        joiner = max(holders, key=lambda k: (sum(any(h.holder == k and h.rank in ranks
                                                     for h in mine) for ranks in need), -k))
        parts = []
        for ranks in need:
            at_joiner = [r for r in ranks if any(h.holder == joiner and h.rank == r for h in mine)]
            rank = at_joiner[0] if at_joiner else ranks[0]
            source = joiner if at_joiner else min(h.holder for h in mine if h.rank == rank)
            parts.append((rank, source))
        out.append(StageJoin(stage, joiner, tuple(parts)))
    return tuple(out)
