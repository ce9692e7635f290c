"""Snapshots in host memory: every step's state, in files that outlive the worker processes.

A snapshot is a checkpoint's step folder without the seal: ``<root>/checkpoints/step_<N>/``
holding one part per rank, ``rank_<R>`` (its own state, as the same rank of the same layout
loads it back), written by :func:`ldt.storage.checkpoint_files.write_part_with` (the files and
a ``MANIFEST.json`` with the crc32 of every one, written into ``<part>.tmp`` and renamed into
place), so a part is whole or absent and its checksums say whether it is still what was
written. No rank waits for the others to write: a
step's snapshot is complete when every part it needs is there and verifies, which the readers
decide together at a start (:mod:`ldt.training.snapshot`). Each writer keeps the newest
:data:`GENERATIONS` of its own part, and writes the next over the oldest (:func:`write`): a
write cut short leaves the previous one whole.

``root`` (:func:`snapshot_root`) is a folder of ``train.snapshot_dir`` (host memory, e.g.
``/dev/shm``) named after the run (an id kept in its run folder, so a run folder removed and
made again does not find the old run's snapshots) and the layout (a re-planned world does not load
another layout's parts as its own). No torch and no collectives here.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import shutil
import uuid
from collections import OrderedDict
from typing import Any, Callable, Iterable, Optional

from ldt.config import ConfigError
from ldt.storage import checkpoint_files as files

GENERATIONS = 2
ALGORITHM = "crc32"  # every step's parts: a checksum for torn or damaged bytes, not an adversary
PREFIX = "ldt-snapshots-"
ID_FILE = "snapshot_id"  # in the run folder
COPIES = "copies"  # in a layout's folder: the parts kept for ranks of other hosts


def run_key(run_dir: str) -> str:
    """The run's name for its snapshots: a random id kept in the run folder
    (:data:`ID_FILE`), made by whichever rank comes first (``os.link`` either puts a whole
    file in place or finds one there), so a run folder removed and made again is another
    run, whatever inode or path it has."""
    path = os.path.join(run_dir, ID_FILE)
    if not os.path.exists(path):
        tmp = f"{path}.{uuid.uuid4().hex}"
        with open(tmp, "w") as f:
            f.write(uuid.uuid4().hex + "\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    with open(path) as f:
        return f.read().strip()[:16]


def snapshot_root(snapshot_dir: str, run_dir: str, layout: str) -> str:
    """The snapshot folder of a run (``run_dir``) in one layout (any text that names it, e.g.
    the rank map)."""
    digest = hashlib.sha256(layout.encode()).hexdigest()[:12]
    return os.path.join(snapshot_dir, PREFIX + run_key(run_dir), digest)


def copies_root(root: str) -> str:
    """Where a host keeps the parts it holds for ranks of other hosts (their copies), apart
    from its own ranks' parts: two hosts given one folder (a shared file system) never
    write the same part folder."""
    return os.path.join(root, COPIES)


def held(snapshot_dir: Optional[str], run_dir: str) -> bool:
    """Does this host hold snapshots of the run in ``run_dir`` (any layout)? Then the folder
    is that run's own and a start there continues it, even without a checkpoint
    (``train.resume=auto``, :func:`ldt.storage.checkpoint_files.resume_auto`)."""
    path = os.path.join(run_dir, ID_FILE)
    if not snapshot_dir or not os.path.exists(path):
        return False
    with open(path) as f:
        run = os.path.join(snapshot_dir, PREFIX + f.read().strip()[:16])
    return os.path.isdir(run) and any(steps(os.path.join(run, layout))
                                      for layout in os.listdir(run))


def check_snapshot_dir(path: Optional[str]) -> None:
    """``train.snapshot_dir`` must be an existing folder this process can write (in host
    memory: snapshots are written every step); refused in one line otherwise."""
    if path is None:
        return
    if not os.path.isabs(path):
        raise ConfigError(f"train.snapshot_dir={path!r} must be an absolute path (the same on "
                          "every host), e.g. /dev/shm")
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"train.snapshot_dir={path!r} is not a folder this process can write; "
                          "give a folder in host memory, e.g. /dev/shm, or null to turn "
                          "snapshots off")


def part_name(rank: int) -> str:
    """The part a rank writes and reads."""
    return f"rank_{rank}"


def write(root: str, step: int, part: str, part_files: dict,
          sums: Optional[dict] = None) -> str:
    """Write ``part`` of step ``step``'s snapshot (``part_files``: file name -> its bytes, any
    buffer), then drop this part's generations older than the newest :data:`GENERATIONS`
    (each writer touches only its own part). ``sums``: the files' :func:`checksums` as their
    writer took them (a copy from another host), kept instead of taken again.

    The generation this write makes old (the part's oldest, once :data:`GENERATIONS` are
    held) is not removed but written over: its folder becomes the new one's temporary folder,
    its files are overwritten in place (in host memory that spares allocating, zeroing and
    freeing pages: docs/elastic.md has the figures). It stops being a part before a byte
    changes, so while a step is written every rank still holds the step before it whole: the
    ranks snapshot the same steps (:mod:`ldt.training.snapshot`), so that is the step a start
    falls back to."""
    return _write(root, step, part, lambda folder, reuse: files.write_part_files(
        folder, part, part_files, algorithm=ALGORITHM, checksums=sums, reuse=reuse))


def write_in_place(root: str, step: int, part: str, save: Callable[[str], dict], nbytes: int,
                   sums: Optional[dict] = None) -> dict:
    """:func:`write` where ``save(tmp)`` puts the files into the part's temporary folder
    itself, the oldest generation's files there (:class:`MappedFiles` fills a state file
    through its mapping), and returns them as they are in memory; returns the part's
    :func:`checksums` (``sums``, when given)."""
    return _write(root, step, part, lambda folder, reuse: files.write_part_in_place(
        folder, part, save, nbytes, algorithm=ALGORITHM, checksums=sums, reuse=reuse))[1]


def _write(root: str, step: int, part: str, write_part: Callable[[str, Optional[str]], Any]):
    held = [s for s in steps(root) if s != step
            and os.path.isdir(os.path.join(files.step_dir(root, s), part))]
    oldest = held[-1] if len(held) >= GENERATIONS and held[-1] < step else None
    try:
        done = write_part(files.step_dir(root, step),
                          None if oldest is None else os.path.join(files.step_dir(root, oldest),
                                                                   part))
    except BaseException:
        _rmdir(files.step_dir(root, step))  # made for this part (when no other is there)
        raise
    finally:
        if oldest is not None:
            _rmdir(files.step_dir(root, oldest))  # its last part
    prune(root, part)
    return done


class MappedFiles:
    """Files a writer fills in place through a memory mapping, each mapped once and kept
    (the newest :data:`GENERATIONS`, by inode) with what ``make`` builds over it: a snapshot
    part's state file, whose folder moves from the oldest generation to the newest at each
    write (:func:`write_in_place`), is then the buffer the state is copied into (or a copy
    received from another host). No copy is made to write it, and a rank's snapshots hold
    :data:`GENERATIONS` of its state in host memory, not one more in a buffer they are
    written from."""

    def __init__(self, keep: int = GENERATIONS):
        self.keep = keep  # files mapped at most (a holder's: GENERATIONS per writer)
        self._held: OrderedDict = OrderedDict()  # (device, inode) -> (mapping, made)

    def of(self, path: str, nbytes: int, make: Callable[[Any], Any]) -> Any:
        """``make(buffer)`` over the file ``path`` of ``nbytes`` (made, or cut to that size,
        when it is not so), as kept from an earlier write of the same file."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            info = os.fstat(fd)
            key = (info.st_dev, info.st_ino)
            if key in self._held and info.st_size == nbytes:
                self._held.move_to_end(key)
                return self._held[key][1]
            self._drop(key)
            if info.st_size != nbytes:
                os.ftruncate(fd, nbytes)
            if nbytes:
                # the pages are taken now: a full /dev/shm is an OSError (ENOSPC) here, where a
                # store through the mapping into a page it cannot have kills the process (SIGBUS)
                os.posix_fallocate(fd, 0, nbytes)
            mapping = mmap.mmap(fd, nbytes) if nbytes else bytearray()
        finally:
            os.close(fd)
        made = make(mapping)
        self._held[key] = (mapping, made)
        while len(self._held) > max(self.keep, 1):
            self._drop(next(iter(self._held)))
        return made

    def close(self) -> None:
        for key in list(self._held):
            self._drop(key)

    def _drop(self, key) -> None:
        mapping, made = self._held.pop(key, (None, None))
        del made  # its views of the mapping go first
        if isinstance(mapping, mmap.mmap):
            try:
                mapping.close()
            except BufferError:  # a view of it is still held: unmapped when the last one goes
                pass


def checksums(part_files: dict) -> dict:
    """The checksums a part's manifest keeps of ``part_files`` (name -> bytes in memory)."""
    return files.checksums_of(part_files, ALGORITHM)


def steps(root: str) -> list[int]:
    """The steps with a snapshot folder under ``root``, newest first."""
    folder = os.path.join(root, "checkpoints")
    if not os.path.isdir(folder):
        return []
    return sorted((int(d.split("_")[1]) for d in os.listdir(folder)
                   if d.startswith("step_") and d.split("_")[1].isdigit()), reverse=True)


def prune(root: str, part: str, keep: int = GENERATIONS) -> None:
    """Remove ``part`` from every step but the newest ``keep`` that hold it, and step folders
    left empty."""
    held = [s for s in steps(root)
            if os.path.isdir(os.path.join(files.step_dir(root, s), part))]
    for s in held[keep:]:
        folder = files.step_dir(root, s)
        shutil.rmtree(os.path.join(folder, part), ignore_errors=True)
        try:
            os.rmdir(folder)  # the last part of that step
        except OSError:
            pass


def readable(root: str, step: int, needed: Iterable[str]) -> bool:
    """Are the ``needed`` parts of step ``step`` there and do their checksums verify?"""
    folder = files.step_dir(root, step)
    try:
        for part in needed:
            files.verify_part(os.path.join(folder, part))
    except files.CheckpointError:
        return False
    return True


def remove_other_layouts(root: str) -> None:
    """Drop the run's snapshots of other layouts on this host: a world plans once, and a
    later one with another layout starts from its own snapshots or the disk."""
    parent = os.path.dirname(root)
    if os.path.isdir(parent):
        for name in os.listdir(parent):
            if name != os.path.basename(root):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def remove_from(root: str, first_step: int) -> None:
    """Drop this layout's snapshots of step ``first_step`` and later, the parts and the copies
    kept for other hosts: a run that starts at ``first_step`` (all ranks agreed on it) makes
    them another history's, or unfinished, and a later start must never take them for its own
    (a rolled-back run would continue the steps it rolled back)."""
    for folder in (root, copies_root(root)):
        for s in steps(folder):
            if s >= first_step:
                shutil.rmtree(files.step_dir(folder, s), ignore_errors=True)


def remove(root: str, part: Optional[str] = None) -> None:
    """A finished run's snapshots: ``part``'s (every step), or all; folders left empty go."""
    if part is None:
        shutil.rmtree(root, ignore_errors=True)
    else:
        for s in steps(root):
            shutil.rmtree(os.path.join(files.step_dir(root, s), part), ignore_errors=True)
            _rmdir(files.step_dir(root, s))
        _rmdir(os.path.join(root, "checkpoints"))
        _rmdir(root)
    _rmdir(os.path.dirname(root))


def _rmdir(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass
