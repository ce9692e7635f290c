"""One way to write: every file or folder ldt hands to a user appears whole or not at all.

An output is built under a temporary sibling name (``.NAME.ldt-tmp-<host>-<pid>-<random>``,
in the same folder, so the final rename is atomic), checked by its writer, flushed to disk,
and only then renamed into place (:mod:`ldt.storage.commit`: one target, or a set of them
together). A failure at any point (an exception, a full disk, Ctrl-C, SIGTERM, a refused
tensor) removes the temporary and leaves the target exactly as it was; a full disk is one
line naming the flag and the target. What a killed writer left beside a target is removed
by the next writer to it, once its owner is dead (:func:`ldt.storage.commit.sweep`).

Before anything is written, :func:`check_output` refuses, in one line naming the flag, the
path and the fix:

- a target that exists and holds anything (a file, a non-empty folder), unless the user asked
  to replace it (``overwrite``); a replaced target is replaced whole (swapped for the new one,
  then removed), never merged with the new output;
- a target that is, contains or lies inside one of the command's inputs (an input is never
  also an output), or that holds the working directory;
- a target whose folder cannot be created or written.

Folders a write has to create above its target are removed again if the write fails.
:func:`new_folder` builds a folder, :func:`new_files` a set of files that belong together
(written as temporaries first, put in place as a set only once all are complete), and
:func:`write_text` one text file. A run folder is the exception by design: it is live while
the run goes (``metrics.csv`` row by row, checkpoints as they are saved), so ``ldt-train``
only refuses a folder that holds anything (:func:`check_run_folder`) and writes each of its
files through this module.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

from ldt.config.errors import ConfigError
from ldt.storage.commit import (OLD_MARK, TMP_MARK, commit_set, fsync_dir, fsync_file,  # noqa: F401
                                out_of_space, put_in_place, remove, sibling, sweep)
from ldt.storage.runlock import LOCK_NAME


class OutputError(ConfigError):
    """An output that cannot be written where asked: the message names the flag, the path
    and the fix."""


# ---- checks, before anything is written ------------------------------------------------------
def holds_anything(path: str) -> bool:
    """Anything but nothing or an empty folder: a file (even an empty one), a link, a folder
    with at least one entry, a device or a pipe (``/dev/null`` is not a place to write to)."""
    if not os.path.lexists(path):
        return False
    return not (os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path))


def _inside(child: str, parent: str) -> bool:
    return os.path.commonpath([child, parent]) == parent


def check_output(path: str, *, flag: str, overwrite: bool = False,
                 inputs: Sequence[tuple[str, str]] = (), overwrite_flag: str = "--overwrite",
                 file: bool = False) -> str:
    """Refuse an output that would damage what the user has (see the module's docstring);
    return its absolute path. ``inputs``: (flag, path) of each of the command's inputs;
    ``file``: the output is a file, so a folder there (even an empty one) is refused."""
    if not path or not str(path).strip():
        raise OutputError(f"{flag} is empty; give a path to write")
    target = os.path.abspath(os.path.expanduser(str(path)))
    if file and (str(path).endswith(os.sep) or os.path.isdir(target)):
        raise OutputError(f"{flag} {path} is a folder; give the path of the file to write")
    real = os.path.realpath(target)
    for in_flag, in_path in inputs:
        if in_path is None:
            continue
        src = os.path.realpath(os.path.abspath(os.path.expanduser(str(in_path))))
        if real == src:
            raise OutputError(f"{flag} {path} is also the input {in_flag}; an input is never "
                              f"overwritten: give another {flag}")
        if _inside(real, src) and os.path.isdir(src):
            raise OutputError(f"{flag} {path} lies inside the input {in_flag} {in_path}; give "
                              f"a {flag} outside it")
        if _inside(src, real):
            raise OutputError(f"{flag} {path} holds the input {in_flag} {in_path}; writing it "
                              f"would replace that input: give a {flag} that does not contain it")
    if _inside(os.getcwd(), real):
        raise OutputError(f"{flag} {path} holds the working directory; give a new folder")
    if os.path.lexists(target) and not (os.path.isdir(target) or os.path.isfile(target)):
        raise OutputError(f"{flag} {path} is not a regular file or folder (a device, a pipe, "
                          "a broken link); give a path to write to")
    if holds_anything(target) and not overwrite:
        what = "a non-empty folder" if os.path.isdir(target) else "a file"
        raise OutputError(f"{flag} {path} already exists ({what}); ldt never writes over what "
                          f"you have: give a new path, or add {overwrite_flag} to replace it "
                          "whole")
    parent = _existing_parent(target)
    if not os.path.isdir(parent):
        raise OutputError(f"{flag} {path}: {parent} is not a folder; give a path in a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{flag} {path}: the folder {parent} is not writable; give a path "
                          "in a folder you can write to")
    return target


def check_run_folder(run_dir: str, resume: Optional[str], *, flag: str = "hydra.run.dir"
                     ) -> None:
    """A run never writes into a folder that holds anything, unless it resumes the run that
    lives there (``resume`` is that folder or lies inside it)."""
    run_dir = os.path.abspath(run_dir)
    names = run_files(run_dir)
    if not names:
        return
    if resume and _inside(os.path.realpath(resume), os.path.realpath(run_dir)):
        return
    import shlex

    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    raise OutputError(f"{flag}={run_dir} already holds files ({shown}); a run never writes "
                      f"into another run's folder: give a new run_dir, or "
                      f"{shlex.quote(f'train.resume={run_dir}')} to continue the run that is "
                      "there")


def run_files(run_dir: str) -> list[str]:
    """What a run folder holds, but the lock a run that is starting there took
    (:mod:`ldt.storage.runlock`): its names, sorted (``[run_dir]`` for a file)."""
    if not holds_anything(run_dir):
        return []
    if not os.path.isdir(run_dir) or os.path.islink(run_dir):
        return [run_dir]
    return sorted(n for n in os.listdir(run_dir) if n != LOCK_NAME)


def _existing_parent(target: str) -> str:
    parent = os.path.dirname(target)
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    return parent or "/"


# ---- writing --------------------------------------------------------------------------------
@contextmanager
def new_folder(path: str, *, flag: str, overwrite: bool = False,
               inputs: Sequence[tuple[str, str]] = ()) -> Iterator[str]:
    """Yield an empty temporary folder beside ``path``; when the block ends without an
    exception the folder is flushed and renamed to ``path`` (an existing ``path`` is replaced
    whole when ``overwrite``); otherwise it is removed and ``path`` is untouched. Verify the
    output inside the block: what leaves it is what the user gets."""
    _sweep(path)  # first: a target a killed writer moved aside is back before it is checked
    target = check_output(path, flag=flag, overwrite=overwrite, inputs=inputs)
    created: list[str] = []
    tmp = sibling(target, TMP_MARK)
    try:
        created += _make_parents(target, flag)
        _probe(tmp, target, flag, folder=True)
        yield tmp
        fsync_tree(tmp)
        put_in_place(tmp, target, replace=overwrite)
    except BaseException as exc:
        remove(tmp)
        _remove_empty(created)
        _disk_full(exc, [(flag, path, target)])
        _appeared(exc, [(flag, path, target)])
        raise


@contextmanager
def new_files(paths: Sequence[str], *, flags: Sequence[str], overwrite: bool = False,
              inputs: Sequence[tuple[str, str]] = ()) -> Iterator[list[str]]:
    """Yield a temporary path beside each of ``paths``, to be written in the block. When it
    ends without an exception, each written temporary is flushed and renamed into place (all
    are complete before the first rename); a temporary left unwritten means that output is
    absent this time, and an old file at its path (allowed with ``overwrite``) is removed so
    no stale output stays beside new ones; the set appears together or not at all
    (:func:`ldt.storage.commit.commit_set`). On an exception every temporary is removed and
    nothing at ``paths`` changes."""
    if len(set(map(os.path.abspath, paths))) != len(paths):
        raise OutputError(f"{', '.join(flags)} name the same file twice; give distinct paths")
    for p in paths:  # first: what a killed writer left is rolled back before the checks
        _sweep(p)
    targets = [check_output(p, flag=f, overwrite=overwrite, inputs=inputs, file=True)
               for p, f in zip(paths, flags)]
    created: list[str] = []
    tmps = [sibling(t, TMP_MARK) for t in targets]
    try:
        for t, f in zip(targets, flags):
            created += _make_parents(t, f)
        for tmp, target, flag in zip(tmps, targets, flags):
            _probe(tmp, target, flag, folder=False)
            os.remove(tmp)
        yield tmps
        for tmp in tmps:
            if os.path.exists(tmp):
                fsync_file(tmp)
        commit_set([(tmp if os.path.exists(tmp) else None, target)
                    for tmp, target in zip(tmps, targets)], replace=overwrite)
    except BaseException as exc:
        for tmp in tmps:
            remove(tmp)
        _remove_empty(created)
        _disk_full(exc, list(zip(flags, paths, targets)))
        _appeared(exc, list(zip(flags, paths, targets)))
        raise


def write_text(path: str, text: str, *, flag: str, overwrite: bool = False,
               inputs: Sequence[tuple[str, str]] = ()) -> str:
    """One text file, whole or not at all (see :func:`new_files`); returns its path."""
    with new_files([path], flags=[flag], overwrite=overwrite, inputs=inputs) as (tmp,):
        with open(tmp, "w") as f:
            f.write(text)
    return os.path.abspath(path)


@contextmanager
def replacing(path: str) -> Iterator[str]:
    """Rewrite a file inside a folder ldt owns (a run folder, a checkpoint being built): yield
    a temporary beside it to write; when the block ends it is flushed and renamed over
    ``path``; on an exception it is removed and the old file (if any) stays."""
    path = os.path.abspath(path)
    sweep(path)
    tmp = sibling(path, TMP_MARK)
    try:
        yield tmp
        fsync_file(tmp)
        put_in_place(tmp, path)
    except BaseException:
        remove(tmp)
        raise


def replace_file(path: str, text: str) -> None:
    """:func:`replacing` with a text."""
    with replacing(path) as tmp:
        with open(tmp, "w") as f:
            f.write(text)


def move_into_place(tmp: str, target: str) -> None:
    """Put a complete temporary (a file or a folder) at ``target``, swapping out whatever is
    there whole (for writers that name their own temporaries, e.g. a checkpoint part)."""
    put_in_place(tmp, target)


# ---- helpers --------------------------------------------------------------------------------
def _probe(tmp: str, target: str, flag: str, *, folder: bool) -> None:
    """Create the temporary (a folder, or an empty file): a place that cannot be written is
    refused here, naming the target, before any work is done."""
    try:
        if folder:
            os.mkdir(tmp)
        else:
            open(tmp, "x").close()
    except OSError as exc:
        _disk_full(exc, [(flag, target, target)])
        raise OutputError(f"{flag} {target}: cannot write there ({exc.strerror}); give a path "
                          "in a folder you can write to") from None


def _make_parents(target: str, flag: str) -> list[str]:
    """Create the missing folders above ``target``; return them, deepest last."""
    missing = []
    parent = os.path.dirname(target)
    while parent and not os.path.exists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    created = []
    try:
        for folder in reversed(missing):
            os.mkdir(folder)
            created.append(folder)
    except OSError as exc:
        _remove_empty(created)
        raise OutputError(f"{flag} {target}: cannot create {exc.filename or folder} "
                          f"({exc.strerror}); give a path in a folder you can write to") from None
    return created


def _remove_empty(folders: list[str]) -> None:
    for folder in reversed(folders):
        try:
            os.rmdir(folder)
        except OSError:
            return


def _sweep(path) -> None:
    """:func:`ldt.storage.commit.sweep` of a path as the user gave it (nothing for a path
    that names no place to write; the checks refuse it)."""
    if path and str(path).strip():
        sweep(os.path.abspath(os.path.expanduser(str(path))))


def _appeared(exc: BaseException, outputs: list) -> None:
    """A target another command wrote while this one worked (and this one was not told to
    replace it) as one line naming it."""
    if not isinstance(exc, FileExistsError):
        return
    for flag, path, target in outputs:
        if exc.filename == target:
            raise OutputError(f"{flag} {path} was written by another command while this one "
                              "worked; it is left as that command wrote it: give a new path, "
                              "or add --overwrite to replace it") from None


def _disk_full(exc: BaseException, outputs: list) -> None:
    """A full disk while writing ``outputs`` ((flag, path as given, absolute target)) as one
    line naming them."""
    if not isinstance(exc, Exception) or isinstance(exc, OutputError):
        return
    for flag, path, target in outputs:
        if out_of_space(exc, os.path.dirname(target)):
            raise OutputError(f"{flag} {path}: no space left on the device that holds "
                              f"{os.path.dirname(target)}; nothing was written and what was "
                              "there is as it was: free space there or give a path on another "
                              "disk") from None


def fsync_tree(root: str) -> None:
    """Flush every file and folder under ``root`` to disk (before it is renamed into place)."""
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                fsync_file(path)
        fsync_dir(folder)
