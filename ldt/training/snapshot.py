"""Every step's state in host memory, and a start from it (``train.snapshot_dir``).

After each optimizer step every rank copies its own state to host memory as it is: its
parameters (its TP shard), and the optimizer's fp32 main parameters, moments and step as this
rank keeps them (with the distributed optimizer, its DP span). No collective and no gather: a
background thread copies the state, laid out flat (:mod:`ldt.training.flat_state`), straight
into the state file of the rank's oldest snapshot, mapped into memory
(:class:`ldt.storage.snapshot_files.MappedFiles`), while the next step's forward and backward
run (the next optimizer step waits for the copy); then it takes the file's checksums and puts
it in place as the rank's part of the step's snapshot (:mod:`ldt.storage.snapshot_files`) while
training goes on. A
step's snapshot is whole with every rank's part, so the ranks skip a step together: when any rank's writer is still busy with an earlier step (agreed at the step
boundary, :class:`ldt.training.guard.StepGuard`), no rank takes this one, and each says so once:
snapshots never make a step wait. The lr schedule and the data position follow from the step,
as in a checkpoint.

A part is the state of one rank of one layout, so it is loaded back by the same rank of the
same layout (the snapshot folder is named after the rank map, :func:`root_of`); a world with
another layout starts from the disk checkpoint. At a start (a torchrun restart re-forming the
world, or ``ldt-train`` continuing its run folder), every rank says which of its own snapshots
are there and verify, and all take the newest step every rank has, when it is newer than the
checkpoint the run resumes from (:func:`newest`).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Optional

import torch
import torch.distributed as dist

from ldt.launch import progress
from ldt.models.sharding import is_gated
from ldt.storage import snapshot_files
from ldt.storage.checkpoint_files import CheckpointError, latest, read_info, step_dir
from ldt.storage.snapshot_parts import META_FILE, STATE_FILE, check_optimizer
from ldt.training import flat_state, snapshot_copies
from ldt.training.checkpoint import named_params
from ldt.training.flat_state import FlatState
from ldt.training.optim import local_param_state, local_span, set_local_param_state


def root_of(snapshot_dir: Optional[str], run_dir: str, topo) -> Optional[str]:
    """This run's snapshot folder in this layout (``train.snapshot_dir``), or None when
    snapshots are off."""
    if not snapshot_dir:
        return None
    return snapshot_files.snapshot_root(snapshot_dir, run_dir, topo.rank_map())


class Snapshots:
    """One rank's snapshots (every rank writes its own part)."""

    def __init__(self, root: str, state,
                 copies: Optional[snapshot_copies.Copies] = None, first_step: int = 0):
        self.root, self.state, self.copies = root, state, copies
        self.part = snapshot_files.part_name(dist.get_rank())
        self._thread: Optional[threading.Thread] = None
        self._copy_done: Optional[threading.Event] = None  # set once a take's copy is made
        self._copy_error: Optional[BaseException] = None
        self._mapped = snapshot_files.MappedFiles()  # the generations' state files, mapped
        self._held = snapshot_files.MappedFiles(  # and those of the copies kept here
            snapshot_files.GENERATIONS * (0 if copies is None else len(copies.writers)))
        self._flat: Optional[FlatState] = None  # the newest generation's, the one sent
        self._shapes: list = []  # (name, shape, dtype) of the state the meta was made for
        self._size = 0  # bytes of the state file
        self._meta = b""  # META_FILE: where this rank sits in its layout and the buffer's index
        self._params: Optional[list] = None  # (name, parameter), found at the first take
        self._said: set = set()
        snapshot_files.remove_other_layouts(root)
        snapshot_files.remove_from(root, first_step)

    def busy(self) -> bool:
        """Is this rank's writer still writing an earlier step (told at the step boundary)?"""
        return self._thread is not None and self._thread.is_alive()

    def take(self, step: int, models, chunks, optimizer, busy: bool = False) -> None:
        """Snapshot the state after step ``step``, unless ``busy``: some rank's writer was
        still busy when the ranks agreed on the step (then no rank takes it). The writer
        thread copies the state too, while the next step's forward and backward run (they
        read the weights and change neither them nor the optimizer's state); the next
        optimizer step waits for that copy (:meth:`copied`)."""
        if busy:
            self._say("busy", f"a snapshot of an earlier step was still being written (or "
                      f"copied to another host) when step {step} ended, so no rank snapshots "
                      f"step {step} (a snapshot never makes a step wait; the next one is taken "
                      "when every writer is free)")
            return
        if self._thread is not None:  # done (no writer was busy): its buffer is free
            self._thread.join()
        self._copy_done, self._copy_error = threading.Event(), None
        self._thread = threading.Thread(target=self._copy_and_write,
                                        args=(step, models, chunks, optimizer), daemon=True,
                                        name="ldt-snapshot")
        self._thread.start()

    def copied(self) -> None:
        """Wait until the last take has copied the state (call before anything changes it:
        the optimizer step); its copy's error, if any, is raised here, in training's thread."""
        if self._copy_done is None:
            return
        self._copy_done.wait()
        error, self._copy_error = self._copy_error, None
        if error is not None:
            raise error

    def _copy_and_write(self, step: int, models, chunks, optimizer) -> None:
        """Copy the state into the file of the part's oldest generation (through its mapping,
        :class:`~ldt.storage.snapshot_files.MappedFiles`), which becomes step ``step``'s part,
        then send it to its holder."""
        sums = None
        try:
            try:
                if self._params is None:  # a model's parameters and names stay as built
                    self._params = list(_unique_params(models, chunks))
                tensors = taken_state(models, chunks, optimizer, step,
                                      optimizer.run_state() if optimizer is not None else {},
                                      params=self._params)
            except BaseException as exc:
                self._copy_error = exc
                raise
            shapes = [(name, t.shape, t.dtype) for name, t in tensors.items()]
            if shapes != self._shapes:  # the first take
                self._shapes = shapes
                self._mapped.close()  # files mapped for another state's index
                index, self._size = flat_state.layout(tensors)
                self._meta = json.dumps({**part_meta(models, chunks, optimizer, self.state),
                                         "index": index}).encode()
            sums = snapshot_files.write_in_place(
                self.root, step, self.part, lambda tmp: self._fill(tmp, tensors),
                self._size + len(self._meta))
        except BaseException as exc:
            if self._copy_error is None:  # a full /dev/shm: training goes on, on checkpoints
                self._say("failed", f"the snapshot of step {step} could not be written to "
                          f"{self.root} ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
                          "training goes on")
        finally:
            self._copy_done.set()
        if self.copies is not None:
            try:  # a part not written is sent empty: its holder keeps no copy of that step
                snapshot_copies.exchange(self.copies, self.root, step, self._meta,
                                         self._flat.buffer if sums else None, sums or {},
                                         self._held)
            except Exception as exc:  # a peer gone: the world is failing; the next one recovers
                self._say("copy", f"the copies of step {step}'s snapshot to or from another "
                          f"host failed ({type(exc).__name__}: {str(exc).splitlines()[0]})")

    def _fill(self, tmp: str, tensors: dict) -> dict:
        """Inside the part's temporary folder: the state copied into its file's mapping (the
        copy training waits for), and the meta written; the files as they are in memory."""
        self._flat = self._mapped.of(os.path.join(tmp, STATE_FILE), self._size,
                                     lambda buffer: FlatState(tensors, buffer))
        try:
            self._flat.fill(tensors)
        except BaseException as exc:  # raised in training's thread by copied()
            self._copy_error = exc
            raise
        self._copy_done.set()
        with open(os.path.join(tmp, META_FILE), "wb") as f:
            f.write(self._meta)
        return {STATE_FILE: self._flat.bytes(), META_FILE: self._meta}

    def close(self, finished: bool) -> None:
        """Wait for the last write; a run that trained all its steps removes its snapshots
        (host memory), a stopped or failed one keeps them for its restart."""
        if self._thread is not None:
            self._thread.join()
        self._flat = None
        self._mapped.close()
        self._held.close()
        self.copied()
        if finished:
            for writer in () if self.copies is None else self.copies.writers:
                snapshot_files.remove(snapshot_files.copies_root(self.root),
                                      snapshot_files.part_name(writer))
            snapshot_files.remove(self.root, self.part)

    def _say(self, what: str, text: str) -> None:
        if what not in self._said:  # once per kind per run
            self._said.add(what)
            print(f"ldt: warning: rank {dist.get_rank()} (stage {self.state.stage}): {text}",
                  file=sys.stderr, flush=True)


def _unique_params(models, chunks):
    """(global name, parameter) of this rank's chunks, each parameter once (the U-shape edge's
    tied head is its embedding). Walking the modules for the names cost a snapshot ~0.3 ms a
    step on a cpu_demo rank (of 0.5-0.9 ms for the whole state), so :class:`Snapshots` walks
    once and passes the list on."""
    seen: set = set()
    for name, p in named_params(models, chunks):
        if id(p) not in seen:
            seen.add(id(p))
            yield name, p


def live_state(models, chunks, optimizer, params=None) -> dict[str, torch.Tensor]:
    """This rank's state as it lives (not copied): ``model.<name>`` (its shard of each
    parameter) and, with an optimizer, ``optim.<name>.<kind>`` as it keeps them
    (:func:`ldt.training.optim.local_param_state`: looked up every time, as an optimizer may
    replace its state's tensors, e.g. at a load). ``params``: :func:`_unique_params`, when
    already walked. No collective."""
    out = {}
    for name, p in _unique_params(models, chunks) if params is None else params:
        out[f"model.{name}"] = p
        if optimizer is not None:
            for kind, t in local_param_state(optimizer, p).items():
                out[f"optim.{name}.{kind}"] = t
    return out


def taken_state(models, chunks, optimizer, step: int, run_state: dict,
                params=None) -> dict[str, torch.Tensor]:
    """What a snapshot part holds: :func:`live_state`, the step, and the optimizer's run
    counters (:func:`run_tensors`)."""
    return {**live_state(models, chunks, optimizer, params), "step": torch.tensor(step),
            **run_tensors(run_state)}


def run_tensors(run_state: dict) -> dict[str, torch.Tensor]:
    """The optimizer's run counters (:meth:`ldt.training.optim.StageOptimizer.run_state`)
    as ``run.<key>`` float64 scalars beside a part's tensors."""
    return {f"run.{k}": torch.tensor(float(v), dtype=torch.float64) for k, v in run_state.items()}


def run_state_of(tensors: dict[str, torch.Tensor]) -> dict:
    """:func:`run_tensors` back as numbers (the loss scale a float, the counts ints)."""
    return {k[len("run."):]: (float(v) if k == "run.loss_scale" else int(v))
            for k, v in tensors.items() if k.startswith("run.")}


def part_meta(models, chunks, optimizer, state) -> dict:
    """What a part says of the rank that wrote it (:data:`META_FILE`), so that a world of
    another layout can join it with the other parts of its stage into full tensors
    (:mod:`ldt.training.snapshot_join`): where the rank sits in its layout, which flat span of
    each parameter its optimizer state covers (the distributed optimizer), the parameters it
    holds under another name (the U-shape edge's tied head), and which optimizer's state it
    holds (a run of another one refuses it:
    :func:`ldt.storage.snapshot_parts.check_optimizer`)."""
    topo, info = state.topology, state.info
    unique = dict((id(p), name) for name, p in reversed(list(named_params(models, chunks))))
    spans = {}
    if optimizer is not None:
        for name, p in _unique_params(models, chunks):
            span = local_span(optimizer, p)
            if span is not None:
                spans[name] = list(span)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "stages": topo.num_stages,
            "stage": state.stage, "tp": len(state.stage_ranks), "tp_rank": info.tp_rank,
            "dp": topo.dp_of(state.stage), "dp_rank": info.dp_rank,
            "ep": topo.stages[state.stage].ep, "sharded": int(bool(spans)), "gated": int(is_gated(models[0])), "spans": spans,
            "optimizer": optimizer_name(optimizer),
            "aliases": {name: unique[id(p)] for name, p in named_params(models, chunks)
                        if unique[id(p)] != name}}


def optimizer_name(optimizer) -> Optional[str]:
    """``train.optimizer.name`` of the run stepping :class:`~ldt.training.optim.StageOptimizer`
    ``optimizer`` (megatron's ``OptimizerConfig.optimizer``: adam or sgd); None without one."""
    return None if optimizer is None else optimizer.optimizer.config.optimizer


def load_local(folder: str, models, chunks, optimizer) -> int:
    """Put this rank's part ``folder`` (:func:`live_state` of the same rank of the same
    layout) back into its chunks and optimizer (with its lr schedule and loss scale);
    returns the next step. A part of another optimizer is refused (every rank alike: the
    parts of one snapshot name one optimizer)."""
    meta, tensors = read_part(folder)
    if optimizer is not None:
        check_optimizer(meta.get("optimizer"), optimizer_name(optimizer), f"snapshot {folder}")
    optim: dict[str, dict] = {}  # name -> {kind: tensor}, grouped once (kinds have no dot)
    for key, value in tensors.items():
        if key.startswith("optim."):
            name, kind = key[len("optim."):].rsplit(".", 1)
            optim.setdefault(name, {})[kind] = value
    with torch.no_grad():
        for name, p in _unique_params(models, chunks):
            saved = tensors.get(f"model.{name}")
            if saved is None or saved.shape != p.shape:
                raise CheckpointError(
                    f"snapshot {folder} holds {'no' if saved is None else tuple(saved.shape)} "
                    f"{name} where this rank has {tuple(p.shape)}: it is another model's; "
                    f"remove it (or set train.snapshot_dir=null) and resume from a checkpoint")
            p.copy_(saved)
            if optimizer is not None:
                set_local_param_state(optimizer, p, optim.get(name, {}))
    step = int(tensors["step"]) + 1
    if optimizer is not None:
        optimizer.resume_at(step, run_state_of(tensors))
    return step


def read_part(folder: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """A part's meta (:func:`part_meta` and the buffer's index) and its tensors."""
    with open(os.path.join(folder, META_FILE), "rb") as f:
        meta = json.loads(f.read())
    if "index" not in meta:
        raise CheckpointError(f"snapshot {folder} was written by an earlier ldt (its {META_FILE} "
                              "has no index): remove it (or set train.snapshot_dir=null) and "
                              "resume from a checkpoint")
    return meta, flat_state.read(meta["index"], os.path.join(folder, STATE_FILE))


def resumes_after(resume: Optional[str]) -> int:
    """The step of the checkpoint a run resumes from (-1: a fresh start)."""
    return -1 if resume is None else int(read_info(latest(resume))["step"])


def newest(root: str, resume: Optional[str], steps: int, group=None) -> Optional[str]:
    """The step folder of the newest snapshot that every rank can read (its own part
    there, its checksums verified), when it is newer than ``resume``'s checkpoint (None: a
    fresh start) and leaves a step of the run's ``steps`` to train; else None. Collective
    over ``group`` (all ranks): a few all-reduces of one number, no pickled objects (these
    cross to every stage)."""
    after = resumes_after(resume)
    part = snapshot_files.part_name(dist.get_rank())
    mine = [s for s in snapshot_files.steps(root) if after < s < steps - 1
            and snapshot_files.readable(root, s, [part])]
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
                group=None) -> Optional[int]:
    """Load :func:`newest` into this rank's chunks and optimizer (collective); the next step,
    or None when there is no snapshot to start from. Rank 0 says which it loaded."""
    progress.current().begin("looking for snapshots", waiting=True)
    found = newest(root, resume, steps, group)
    if found is None:
        return None
    progress.current().begin("loading the snapshot")
    step = load_local(os.path.join(found, snapshot_files.part_name(dist.get_rank())), models,
                      chunks, optimizer)
    if dist.get_rank() == 0:
        print(f"ldt-train: resuming from the snapshot of step {step - 1} in host memory "
              f"({found}), newer than {resume and latest(resume) or 'any checkpoint'}",
              flush=True)
    return step


def continues(resume: Optional[str], run_dir: str) -> bool:
    """May a snapshot replace ``resume``? Only when the run continues its own folder (a
    fresh start, ``train.resume=auto``, the run folder or its newest checkpoint): a checkpoint
    of another run, or an older one of this run (a roll-back), is what the user asked for."""
    if resume is None:
        return True
    here, there = os.path.abspath(run_dir), os.path.abspath(resume)
    if there == here:
        return True
    newest = latest(here) if os.path.isdir(here) else None
    return there.startswith(here + os.sep) and newest is not None \
        and os.path.abspath(newest) == os.path.abspath(latest(there) or "")
