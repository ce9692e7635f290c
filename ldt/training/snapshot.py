"""Every step's state in host memory, and a start from it (``train.snapshot_dir``).

After each optimizer step every rank takes part in gathering its stage's state, as a
checkpoint does (:func:`ldt.training.checkpoint.gather`: parameters, fp32 main parameters,
optimizer moments and step, as full tensors under global names, copies), and the stage's
writer (the leader of its first replica) hands the copies to a background thread that writes
them as its part of the step's snapshot (:mod:`ldt.storage.snapshot_files`), while training
goes on. A writer still busy with the previous step's snapshot skips this one and says so
once: snapshots never make a step wait. The lr schedule and the data position follow from the
step, as in a checkpoint.

At a start (a torchrun restart re-forming the world with the same layout, or ``ldt-train``
continuing its run folder), every rank says which of its stage's snapshots are there and
verify, and all take the newest step every rank has, when it is newer than the checkpoint
the run resumes from (:func:`newest`); :func:`ldt.training.checkpoint.load_step` loads it.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Optional

import torch
import torch.distributed as dist

from ldt.launch import progress
from ldt.storage import snapshot_files
from ldt.storage.checkpoint_files import latest, read_info, step_dir
from ldt.training import checkpoint


def root_of(cfg, run_dir: str, topo) -> Optional[str]:
    """This run's snapshot folder in this layout, or None when snapshots are off."""
    if not cfg.train.snapshot_dir:
        return None
    return snapshot_files.snapshot_root(cfg.train.snapshot_dir, run_dir, topo.rank_map())


class Snapshots:
    """One rank's snapshots (every rank has one: the gather is collective)."""

    def __init__(self, root: str, state):
        self.root, self.state = root, state
        self.writer = checkpoint.writes(state)
        self.part = snapshot_files.part_name(state.stage)
        self._thread: Optional[threading.Thread] = None
        self._said: set = set()
        if self.writer:
            snapshot_files.remove_other_layouts(root)

    def take(self, step: int, models, chunks, optimizer) -> None:
        """Snapshot the state after step ``step`` (collective over the stage's groups)."""
        model_sd, optim_sd = checkpoint.gather(models, chunks, optimizer, self.state)
        if not self.writer:
            return
        if self._thread is not None and self._thread.is_alive():
            self._say("busy", f"the snapshot of an earlier step was still being written when "
                      f"step {step} ended, so step {step} has none (a snapshot never makes a "
                      "step wait; the next one is taken when the writer is free)")
            return
        state_dict = {"model": model_sd, "optim": optim_sd, "step": step}
        self._thread = threading.Thread(target=self._write, args=(step, state_dict),
                                        daemon=True, name="ldt-snapshot")
        self._thread.start()

    def _write(self, step: int, state_dict: dict) -> None:
        try:
            snapshot_files.write(self.root, step, self.part, state_dict)
        except Exception as exc:  # a full /dev/shm: training goes on, on disk checkpoints
            self._say("failed", f"the snapshot of step {step} could not be written to "
                      f"{self.root} ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
                      "training goes on")

    def close(self, finished: bool) -> None:
        """Wait for the last write; a run that trained all its steps removes its snapshots
        (host memory), a stopped or failed one keeps them for its restart."""
        if self._thread is not None:
            self._thread.join()
        if finished and self.writer:
            snapshot_files.remove(self.root, self.part)

    def _say(self, what: str, text: str) -> None:
        if what not in self._said:  # once per kind per run
            self._said.add(what)
            print(f"ldt: warning: rank {dist.get_rank()} (stage {self.state.stage}): {text}",
                  file=sys.stderr, flush=True)


def newest(root: str, state, resume: Optional[str], steps: int, group=None) -> Optional[str]:
    """The step folder of the newest snapshot that every rank can read (its stage's part
    there, its checksums verified), when it is newer than ``resume``'s checkpoint (None: a
    fresh start) and leaves a step of the run's ``steps`` to train; else None. Collective
    over ``group`` (all ranks): a few all-reduces of one number, no pickled objects (these
    cross to every stage)."""
    after = -1 if resume is None else int(read_info(latest(resume))["step"])
    mine = [s for s in snapshot_files.steps(root) if after < s < steps - 1
            and snapshot_files.readable(root, s, [snapshot_files.part_name(state.stage)])]
    bound = float("inf")
    while True:  # the largest step every rank holds: lower the bound until all agree
        proposal = torch.tensor([max((s for s in mine if s <= bound), default=-1)],
                                dtype=torch.float64)
        dist.all_reduce(proposal, op=dist.ReduceOp.MIN, group=group)
        agreed = int(proposal.item())
        if agreed < 0:
            return None
        if agreed == bound:
            return step_dir(root, agreed)
        bound = agreed


def load_newest(root: str, resume: Optional[str], steps: int, models, chunks, optimizer,
                state, group=None) -> Optional[int]:
    """Load :func:`newest` into this rank's chunks and optimizer (collective); the next step,
    or None when there is no snapshot to start from. Rank 0 says which it loaded."""
    progress.current().begin("looking for snapshots", waiting=True)
    found = newest(root, state, resume, steps, group)
    if found is None:
        return None
    progress.current().begin("loading the snapshot")
    step = checkpoint.load_step(found, models, chunks, optimizer, state, verified=True)
    if dist.get_rank() == 0:
        print(f"ldt-train: resuming from the snapshot of step {step - 1} in host memory "
              f"({found}), newer than {resume and latest(resume) or 'any checkpoint'}",
              flush=True)
    return step


def continues(resume: Optional[str], run_dir: str) -> bool:
    """May a snapshot replace ``resume``? Only when the run continues its own folder (a
    fresh start, ``train.resume=auto``, or a checkpoint of the run folder): an explicit
    checkpoint of another run is what the user asked for."""
    if resume is None:
        return True
    here, there = os.path.abspath(run_dir), os.path.abspath(resume)
    return there == here or there.startswith(here + os.sep)
