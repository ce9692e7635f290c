"""Checkpoint files: atomic writes, checksums, verification, retention. No collectives here.

A checkpoint is a step folder ``<run>/checkpoints/step_<N>/`` holding parts (``stage_<S>``,
one per writer), each a ``torch.distributed.checkpoint`` folder plus ``MANIFEST.json`` (size
and sha256 of every file in it). A part is written into ``<part>.tmp`` and renamed into place
with its manifest, so a part either exists whole or not at all. ``checkpoint.json`` (the step,
the run's length, and the size and sha256 of every other top-level file: ``model.json``, an
import's ``hf_config.json`` and tokenizer files) and then the ``COMPLETE`` marker seal the
folder; a folder without the marker is never loaded, and a part written into a sealed folder
removes the marker first. A roll-back in a run's own folder sets the later steps aside
(:func:`set_aside_later`).

What goes *into* a checkpoint is :mod:`ldt.training.checkpoint`'s business (the training
state, gathered collectively) or a converter's (a model imported from elsewhere); both write
through :func:`write_part` and :func:`seal`. Before a run starts, :func:`preflight` checks a
``train.resume`` / ``train.load`` folder (``ldt.topology.validate`` calls it; the model against the
run's is ``ldt.models.tensor_files.check_compatible``): every file against its size or
checksum, and that there is something left to train; each problem is one line naming the
file or the parameter and the fix.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import warnings
import zlib
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

from ldt.config import ConfigError
from ldt.config.userfiles import not_a
from ldt.storage.atomic import fsync_dir, fsync_tree, move_into_place, replace_file
from ldt.storage.atomic import run_files
from ldt.storage.commit import out_of_space, remove

COMPLETE = "COMPLETE"
INFO = "checkpoint.json"
MANIFEST = "MANIFEST.json"
PART_PREFIX = "stage_"


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used. The message names the file or parameter and the fix."""


class DiskFullError(OSError):
    """A write ran out of space; the partial files are gone, earlier checkpoints untouched."""

    def __init__(self, path: str):
        super().__init__(errno.ENOSPC, f"disk full at {path}")
        self.path = path

    def __str__(self) -> str:
        return f"disk full at {self.path}"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, "checkpoints", f"step_{step:07d}")


# ---- writing ---------------------------------------------------------------------------------
def write_part(folder: str, part: str, state_dict: dict) -> str:
    """Write ``state_dict`` (torch.distributed.checkpoint, this process alone) as ``folder/part``,
    atomically and with a manifest. Raises :class:`DiskFullError` when the disk is full."""
    import torch.distributed.checkpoint as dcp

    def save(tmp: str) -> None:
        with warnings.catch_warnings():  # "assuming ... a single process": yes, on purpose
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.save(state_dict, checkpoint_id=tmp, no_dist=True)

    return write_part_with(folder, part, save, _nbytes(state_dict))


def write_part_with(folder: str, part: str, save: Callable[[str], None], nbytes: int,
                    algorithm: str = "sha256") -> str:
    """``folder/part`` as ``save(tmp)`` fills a fresh folder ``tmp`` (``nbytes``: about what it
    writes), atomically: ``tmp`` gets a manifest with the checksum (``algorithm``, one of
    :data:`CHECKSUMS`) of every file, is synced and renamed into place. Raises
    :class:`DiskFullError` when the disk is full."""
    return _write_part(folder, part, save, nbytes,
                       lambda tmp: _manifest(tmp, (MANIFEST,), algorithm), algorithm)


def write_part_files(folder: str, part: str, files: dict[str, Any],
                     algorithm: str = "sha256", checksums: Optional[dict] = None,
                     reuse: Optional[str] = None) -> str:
    """:func:`write_part_with` for files whose bytes are in memory (``files``: name -> any
    buffer, e.g. a numpy array over a tensor): each written as it is, and its checksum taken
    from the same memory, not read back (a snapshot part, every step). ``checksums``: the
    manifest's files as their writer took them (:func:`checksums_of`; a part received from
    another host) are kept, not taken again: the part then verifies against what its writer
    wrote, the transfer included. ``reuse``: a part folder that is given up for this one (a
    snapshot's oldest generation); it becomes the temporary folder and its files of the same
    size are written over in place."""
    views = {name: memoryview(data).cast("B") for name, data in files.items()}
    _check_sizes(folder, part, views, checksums)

    def save(tmp: str) -> dict:
        _save_views(tmp, views)
        return views
    return write_part_in_place(folder, part, save, sum(v.nbytes for v in views.values()),
                               algorithm, checksums, reuse)[0]


def write_part_in_place(folder: str, part: str, save: Callable[[str], dict], nbytes: int,
                        algorithm: str = "sha256", checksums: Optional[dict] = None,
                        reuse: Optional[str] = None) -> tuple[str, dict]:
    """:func:`write_part_files` where ``save(tmp)`` puts the part's files into its temporary
    folder itself (``reuse``'s files are there: a snapshot fills its state file through a
    mapping kept from step to step) and returns them as they are in memory (name -> any
    buffer), for their checksums (or ``checksums``, a writer's, checked against their sizes).
    Returns the part's folder and its manifest's files."""
    manifest: dict = {}

    def saved(tmp: str) -> None:
        views = {name: memoryview(data).cast("B") for name, data in save(tmp).items()}
        _check_sizes(folder, part, views, checksums)
        manifest.update(checksums_of(views, algorithm) if checksums is None else checksums)
    final = _write_part(folder, part, saved, nbytes, lambda _tmp: manifest, algorithm, reuse)
    return final, manifest


def _check_sizes(folder: str, part: str, views: dict, checksums: Optional[dict]) -> None:
    """A writer's ``checksums`` must name the files ``views`` holds, of their sizes."""
    if checksums is not None and ({n: c.get("bytes") for n, c in checksums.items()}
                                  != {n: v.nbytes for n, v in views.items()}):
        raise CheckpointError(f"part {part} of {folder} is not written: its files "
                              f"({ {n: v.nbytes for n, v in views.items()} } bytes) are not "
                              f"the ones its writer's checksums name ({checksums})")


def checksums_of(files: dict[str, Any], algorithm: str) -> dict:
    """A part manifest's files (name -> bytes and checksum) for files in memory."""
    views = {name: memoryview(data).cast("B") for name, data in files.items()}
    return {name: {"bytes": view.nbytes, algorithm: _checksum_of(view, algorithm)}
            for name, view in sorted(views.items())}


def _save_views(folder: str, views: dict[str, memoryview]) -> None:
    """Each view into its file; a file already there of the same size (a reused part folder)
    is written over in place: in host memory (tmpfs) its pages are kept, where a new file's are
    allocated and zeroed and the old one's freed (bench_snapshot: 64 MiB in 31 ms, 41 ms as a
    new file)."""
    for name in set(os.listdir(folder)) - set(views) - {MANIFEST}:
        remove(os.path.join(folder, name))
    for name, view in views.items():
        path = os.path.join(folder, name)
        same = os.path.isfile(path) and os.path.getsize(path) == view.nbytes
        with open(path, "r+b" if same else "wb") as f:
            f.write(view)


def _write_part(folder: str, part: str, save: Callable[[str], None], nbytes: int,
                manifest: Callable[[str], dict], algorithm: str,
                reuse: Optional[str] = None) -> str:
    final = os.path.join(folder, part)
    tmp = final + ".tmp"
    try:
        os.makedirs(folder, exist_ok=True)
        _unseal(folder)
        shutil.rmtree(tmp, ignore_errors=True)
        if reuse is not None and os.path.isdir(reuse):
            os.rename(reuse, tmp)  # no longer a part (its name says so) before a byte changes
        else:
            os.makedirs(tmp)
        save(tmp)
        # written as it is: the temporary folder is what is put in place whole (a snapshot
        # writes one every step, and a file replaced atomically cost it ~0.2 ms more)
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            f.write(json.dumps({"algorithm": algorithm, "files": manifest(tmp)}))
        fsync_tree(tmp)
        move_into_place(tmp, final)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if _out_of_space(exc, folder, nbytes):
            raise DiskFullError(folder) from None
        raise
    return final


def _unseal(folder: str) -> None:
    """A step folder that is written into again (a step saved a second time) stops being
    complete before anything in it changes: its ``COMPLETE`` marker goes first, so a crash
    part-way leaves a folder that is never loaded, not a "complete" one holding parts of two
    histories. :func:`seal` marks it again once every part is in place."""
    marker = os.path.join(folder, COMPLETE)
    if not os.path.lexists(marker):
        return
    try:
        os.remove(marker)
    except FileNotFoundError:  # another writer of the step removed it first
        pass
    fsync_dir(folder)  # gone on disk before a part of the new history replaces an old one


def seal(folder: str, info: dict) -> None:
    """Mark ``folder`` complete: ``checkpoint.json`` (``info``: at least ``step``; plus the
    checksums of the folder's other top-level files), then the ``COMPLETE`` marker, each
    written and renamed into place."""
    with disk_full_at(folder):
        files = _manifest(folder, skip=(INFO, COMPLETE))
        _write_json(os.path.join(folder, INFO), {**info, "files": files})
        _write_text(os.path.join(folder, COMPLETE), f"{info['step']}\n")


@contextmanager
def disk_full_at(folder: str) -> Iterator[None]:
    """An OSError for want of space inside becomes :class:`DiskFullError` naming ``folder``."""
    try:
        yield
    except OSError as exc:
        if not isinstance(exc, DiskFullError) and _out_of_space(exc, folder, 0):
            raise DiskFullError(folder) from None
        raise


def carry_companions(origin: Optional[str], target: str, own: tuple = ()) -> list[str]:
    """Copy the top-level files of a checkpoint that describe where its weights came from (an
    import's ``hf_config.json`` and tokenizer files) into step folder ``target`` before it is
    sealed, so a run started from an import saves checkpoints that export with them. They
    come from the run's own previous checkpoint (the newest complete one beside ``target``)
    when it has one, else from ``origin`` (``train.resume`` / ``train.load``): ``keep_last``
    may have removed the origin since, when it was one of the run's own steps. ``own``: the
    files the writer makes itself (``model.json``); never the seal's."""
    found = _previous(target) or (latest(origin) if origin else None)
    if found is None:
        return []
    names = [n for n in sorted(os.listdir(found)) if n not in (INFO, COMPLETE, *own)
             and not n.endswith(".tmp") and not n.startswith(".")  # no writer's temporaries
             and os.path.isfile(os.path.join(found, n))]
    with disk_full_at(target):
        for name in names:
            shutil.copyfile(os.path.join(found, name), os.path.join(target, name))
    return names


def _previous(target: str) -> Optional[str]:
    """The newest complete step folder before step folder ``target`` beside it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(target)))
    name = os.path.basename(os.path.normpath(target))
    done = [d for d in complete_steps(root) if os.path.basename(d) < name]
    return done[-1] if done else None


def discard(folder: str) -> None:
    """Remove an unsealed step folder (a save that failed part-way)."""
    if not os.path.exists(os.path.join(folder, COMPLETE)):
        shutil.rmtree(folder, ignore_errors=True)


def prune(root: str, keep_last: int) -> list[str]:
    """Keep the newest ``keep_last`` complete checkpoints under ``root`` (0: all); also drop
    unsealed step folders older than the newest complete one (leftovers of a crash)."""
    done = complete_steps(root)
    if not done:
        return []
    folder = os.path.join(root, "checkpoints")
    gone = done[:-keep_last] if keep_last else []
    gone += [d for d in sorted(os.listdir(folder)) if d.startswith("step_")
             and d < os.path.basename(done[-1])
             and not os.path.exists(os.path.join(folder, d, COMPLETE))]
    for d in gone:
        shutil.rmtree(os.path.join(folder, os.path.basename(d)), ignore_errors=True)
    return gone


ABANDONED = "abandoned"
"""``<run>/checkpoints/abandoned/``: the step folders of a history the run rolled back from
(:func:`set_aside_later`). Not a ``step_*`` name: :func:`latest`, :func:`prune` and
:func:`resume_auto` never see what is in it."""


def set_aside_later(run_dir: str, first_step: int, source: str,
                    field: str = "train.resume") -> Optional[str]:
    """A run in ``run_dir`` that starts at ``first_step`` from ``source`` (``field``), e.g.
    ``train.resume=RUN/checkpoints/step_0000010`` while step_0000030 exists (a roll-back),
    writes a new history from there, and its step folders from ``first_step`` on are the old
    history's: retention (by name) would keep them and remove the new ones,
    ``train.resume=auto`` would continue them, a save would write into them. The complete
    ones move to ``checkpoints/abandoned/`` (the user may want them back), the unfinished
    ones are removed (nothing loads them), ``source`` stays. Returns the line saying so, or
    None when there was nothing. Rank 0 alone, before the run's first save."""
    folder = os.path.join(run_dir, "checkpoints")
    later = [d for d in (sorted(os.listdir(folder)) if os.path.isdir(folder) else [])
             if _step_of(d) is not None and _step_of(d) >= first_step
             and os.path.realpath(os.path.join(folder, d)) != os.path.realpath(source)]
    if not later:
        return None
    moved, removed = [], []
    for name in later:
        path = os.path.join(folder, name)
        if not os.path.exists(os.path.join(path, COMPLETE)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
            continue
        os.makedirs(os.path.join(folder, ABANDONED), exist_ok=True)
        os.rename(path, _free_name(os.path.join(folder, ABANDONED, name)))
        moved.append(name)
    said = [f"{', '.join(moved)} moved to {os.path.join(folder, ABANDONED)} (another "
            "history: kept there, never loaded or pruned)"] if moved else []
    said += [f"the unfinished {', '.join(removed)} removed"] if removed else []
    return (f"{field}={source} continues the run in {run_dir} at step {first_step}, before "
            f"its later checkpoints: {'; '.join(said)}")


def _step_of(name: str) -> Optional[int]:
    """N of a step folder's name ``step_N``; None for any other name."""
    digits = name[len("step_"):]
    return int(digits) if name.startswith("step_") and digits.isdigit() else None


def _free_name(path: str) -> str:
    """``path``, or ``path.1``, ``path.2``... when it is taken (a second roll-back)."""
    candidate, n = path, 0
    while os.path.lexists(candidate):
        n += 1
        candidate = f"{path}.{n}"
    return candidate


# ---- finding and checking -------------------------------------------------------------------
def complete_steps(root: str) -> list[str]:
    """The complete step folders under a run folder, oldest first."""
    folder = os.path.join(root, "checkpoints")
    if not os.path.isdir(folder):
        return []
    return [os.path.join(folder, d) for d in sorted(os.listdir(folder))
            if d.startswith("step_") and os.path.exists(os.path.join(folder, d, COMPLETE))]


def latest(path: str) -> Optional[str]:
    """A complete step folder: ``path`` itself, or the newest complete one under a run folder."""
    if os.path.exists(os.path.join(path, COMPLETE)):
        return path
    done = complete_steps(path)
    return done[-1] if done else None


def skipped(path: str) -> Optional[str]:
    """One line naming the step folders of a run that are newer than the one :func:`latest`
    picks from ``path`` (a run folder, or its newest complete ``checkpoints/step_N``) but
    incomplete (no marker: a save that did not finish), which a reader passes over; None when
    it passes over nothing."""
    found = latest(path)
    root = path
    if found is not None and os.path.abspath(found) == os.path.abspath(path):
        root = os.path.dirname(os.path.dirname(os.path.abspath(path)))  # checkpoints/step_N
        if os.path.basename(os.path.dirname(os.path.abspath(path))) != "checkpoints" \
                or latest(root) is None \
                or os.path.abspath(latest(root)) != os.path.abspath(found):
            return None
    folder = os.path.join(root, "checkpoints")
    if found is None or not os.path.isdir(folder):
        return None
    newer = [d for d in sorted(os.listdir(folder)) if d.startswith("step_")
             and d > os.path.basename(found) and os.path.isdir(os.path.join(folder, d))
             and not os.path.exists(os.path.join(folder, d, COMPLETE))]
    if not newer:
        return None
    return (f"{os.path.join(folder, newer[-1])}"
            + (f" and {len(newer) - 1} more" if len(newer) > 1 else "")
            + f" {'are' if len(newer) > 1 else 'is'} incomplete (no {COMPLETE} marker: the save "
            f"did not finish), so the newest complete checkpoint, {found}, is used")


def parts(folder: str) -> list[str]:
    """The part folders (``stage_<S>``) of a step folder. Other sub-folders are not parts: an
    import keeps its model config in ``conf/`` next to them (``ldt-convert import``)."""
    return sorted(d for d in os.listdir(folder) if d.startswith(PART_PREFIX)
                  and os.path.isdir(os.path.join(folder, d)) and not d.endswith(".tmp"))


def read_info(folder: str, field: str = "train.resume") -> dict:
    path = os.path.join(folder, INFO)
    try:
        with open(path) as f:
            info = json.load(f)
        int(info["step"])
        return info
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(f"{path} is missing or damaged; {_fix(folder, field)}") from None


def verify(folder: str, *, which: Optional[list[str]] = None, hashes: bool = True,
           field: str = "train.resume") -> dict:
    """Check ``folder`` against its manifests (sizes always, sha256 when ``hashes``); return
    its info. ``which``: only these parts. Raises :class:`CheckpointError` naming the file
    and a fix in terms of ``field`` (``train.resume`` or ``train.load``: what the user gave)."""
    if not os.path.exists(os.path.join(folder, COMPLETE)):
        raise CheckpointError(f"{folder} is not a complete checkpoint (no {COMPLETE} marker: "
                              f"its save did not finish); {_fix(folder, field)}")
    info = read_info(folder, field)
    names = parts(folder)
    if not names:
        raise CheckpointError(f"{folder} holds no parts ({PART_PREFIX}* folders); "
                              f"{_fix(folder, field)}")
    _verify_files(folder, info.get("files", {}), hashes, folder, field)
    for part in which if which is not None else names:
        _verify_part(os.path.join(folder, part), hashes, field)
    return info


def verify_part(part: str, hashes: bool = True, field: str = "train.resume") -> None:
    """One part folder against its manifest (an unsealed step's too: a snapshot's)."""
    _verify_part(part, hashes, field)


def _verify_part(part: str, hashes: bool, field: str) -> None:
    path = os.path.join(part, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
        files, algorithm = manifest["files"], manifest.get("algorithm", "sha256")
        if algorithm not in CHECKSUMS:
            raise ValueError(algorithm)
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(f"{path} is missing or damaged, so {part} cannot be checked; "
                              f"{_fix(os.path.dirname(part), field)}") from None
    _verify_files(part, files, hashes, os.path.dirname(part), field, algorithm)


def _verify_files(where: str, files: dict, hashes: bool, step_folder: str,
                  field: str, algorithm: str = "sha256") -> None:
    """Each file of a manifest (name -> bytes, checksum) in ``where`` against it."""
    for name, want in files.items():
        file = os.path.join(where, name)
        size = os.path.getsize(file) if os.path.exists(file) else None
        if size is None:
            problem = "is missing"
        elif size != want["bytes"]:
            problem = (f"is truncated ({size} of {want['bytes']} bytes)" if size < want["bytes"]
                       else f"has {size} bytes, not {want['bytes']}")
        elif hashes and _checksum(file, algorithm) != want[algorithm]:
            problem = f"is corrupted (its {algorithm} differs from the one written with it)"
        else:
            continue
        raise CheckpointError(f"checkpoint file {file} {problem}; {_fix(step_folder, field)}")


AUTO = "auto"
"""``train.resume=auto``: continue from the run folder's newest checkpoint, if it has one."""


def resume_auto(train: dict, run_dir: str, elastic: bool = False,
                restarted: bool = False) -> Optional[str]:
    """Resolve ``train.resume=auto`` (an elastic run's default, whatever it says) in the
    ``train`` dict: the run folder's newest complete checkpoint (over ``train.load``), or a
    fresh start in a folder that is absent or empty. A folder that holds a run without a
    complete checkpoint is refused (:class:`CheckpointError` naming its incomplete steps): a
    fresh start would write over that run's files. ``restarted``: torchrun restarted this
    elastic job's own world, so the folder is its own and a fresh start is its continuation.
    Returns a line saying so when that checkpoint is the run's last step (nothing left to
    train), else None."""
    if train.get("resume") == AUTO:
        train["resume"] = None
    elif not elastic:
        return None
    found = latest(run_dir) if os.path.isdir(run_dir) else None
    if found is None:
        names = run_files(run_dir)
        if names and not restarted:
            raise CheckpointError(_no_complete_checkpoint(run_dir, names))
        return None
    step = int(read_info(found)["step"])
    if step + 1 >= train["steps"]:
        train["resume"] = None
        where = ("the last" if step + 1 == train["steps"] else "past the end")
        return (f"{found} is step {step}, {where} of train.steps={train['steps']}: the run "
                "is complete, nothing left to train (raise train.steps to go on)")
    train["resume"], train["load"] = found, None
    return None


def _no_complete_checkpoint(run_dir: str, names: list) -> str:
    """train.resume=auto's refusal of a folder that holds a run it cannot continue."""
    import shlex

    folder = os.path.join(run_dir, "checkpoints")
    steps = sorted(d for d in os.listdir(folder) if d.startswith("step_")) \
        if os.path.isdir(folder) else []
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    why = (f"its checkpoints are all incomplete ({', '.join(steps[:3])}"
           f"{' and more' if len(steps) > 3 else ''}: no {COMPLETE} marker, the saves did not "
           "finish)" if steps else "it saved no checkpoint (train.save_every=0, or it stopped "
           "before the first save)")
    return (f"train.resume=auto: {run_dir} holds a run ({shown}) that cannot be continued: "
            f"{why}; auto never starts afresh over another run's files: give a new run_dir "
            f"to start a new run (e.g. {shlex.quote(f'run_dir={run_dir}-2')}), or move that "
            "folder away")


def preflight(path: str, field: str = "train.resume", steps: Optional[int] = None, *,
              hashes: bool = True) -> str:
    """Everything about a checkpoint folder given as ``field`` (``train.resume`` or
    ``train.load``) that its files can tell before any process starts: it exists, is
    complete, every file has its size (and sha256 when ``hashes``), and, with ``steps`` (a
    resume), something is left to train. Returns the step folder to load."""
    if not os.path.exists(path):
        raise CheckpointError(f"{field}={path!r} does not exist; give the run folder of an "
                              "earlier run (with checkpoints/), one of its checkpoints/step_N "
                              "folders or an ldt-convert output folder")
    if not os.path.isdir(path):
        raise CheckpointError(not_a(path, f"{field}={path!r}", "folder", "give the run folder "
                                    "of an earlier run, one of its checkpoints/step_N folders "
                                    "or an ldt-convert output folder"))
    found = latest(path)
    if found is None:
        raise CheckpointError(
            f"{field}={path!r} holds no complete checkpoint (no {COMPLETE} marker in it or "
            "in checkpoints/step_*/): the run saved none (train.save_every=0?) or was stopped "
            "mid-save; give a folder with a complete checkpoint, or drop " + field)
    info = verify(found, hashes=hashes, field=field)
    next_step = int(info["step"]) + 1
    if steps is not None and next_step >= steps:
        raise CheckpointError(
            f"checkpoint {found} is the end of its run (it continues at step {next_step}, and "
            f"train.steps={steps}): nothing left to train; raise train.steps to go on")
    return found


def _fix(step_folder: str, field: str) -> str:
    """The fix for a damaged checkpoint given as ``field`` (``train.resume`` / ``train.load``,
    or a tool's argument such as ``CHECKPOINT``): an earlier complete one, if any."""
    import shlex

    root = os.path.dirname(os.path.dirname(os.path.abspath(step_folder)))
    earlier = [d for d in complete_steps(root)
               if os.path.basename(d) < os.path.basename(os.path.normpath(step_folder))]
    training = field.startswith("train.")
    if earlier and training:
        return (f"give an earlier one ({shlex.quote(f'{field}={earlier[-1]}')}) or start "
                f"without {field}")
    if earlier:
        return f"give an earlier one as {field} ({shlex.quote(earlier[-1])})"
    if training:
        return f"start without {field}, or restore the checkpoint from a copy"
    return "restore the checkpoint from a copy"


# ---- helpers -----------------------------------------------------------------------------------
def _manifest(folder: str, skip: tuple, algorithm: str = "sha256") -> dict:
    """Size and checksum of every regular file directly in ``folder`` but ``skip`` (and .tmp)."""
    return {name: {"bytes": os.path.getsize(os.path.join(folder, name)),
                   algorithm: _checksum(os.path.join(folder, name), algorithm)}
            for name in sorted(os.listdir(folder))
            if name not in skip and not name.endswith(".tmp")
            and os.path.isfile(os.path.join(folder, name))}


class _Crc32:
    """hashlib's interface over zlib.crc32."""

    def __init__(self):
        self.value = 0

    def update(self, data: bytes) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


# a checkpoint's files: sha256. A snapshot part in host memory, written every step and read
# back only by its own host or a copy's: crc32, which finds a torn or damaged file at a
# quarter of sha256's cost (6 MB: 0.8 ms against 2.9 ms here), twice a step on a host
# that keeps a copy
CHECKSUMS: dict[str, Callable[[], Any]] = {"sha256": hashlib.sha256, "crc32": _Crc32}


def _checksum(path: str, algorithm: str) -> str:
    h = CHECKSUMS[algorithm]()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _checksum_of(data: memoryview, algorithm: str) -> str:
    h = CHECKSUMS[algorithm]()
    h.update(data)
    return h.hexdigest()


def _write_json(path: str, obj: Any) -> None:
    _write_text(path, json.dumps(obj, indent=1) + "\n")


def _write_text(path: str, text: str) -> None:
    replace_file(path, text)


def _nbytes(obj: Any) -> int:
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if hasattr(obj, "element_size") and hasattr(obj, "numel"):
        return obj.numel() * obj.element_size()
    return 0


def _out_of_space(exc: BaseException, folder: str, needed: int) -> bool:
    return out_of_space(exc, folder, needed)
