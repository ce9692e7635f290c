"""One way to write: every file or folder ldt hands to a user appears whole or not at all.

An output is built under a temporary sibling name (``.NAME.ldt-tmp-<pid>-<random>``, in the
same folder, so the final rename is atomic), checked by its writer, flushed to disk, and only
then renamed into place. A failure at any point (an exception, a full disk, a refused
tensor) removes the temporary and leaves the target exactly as it was.

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
(written as temporaries first, renamed one after another only once all are complete), and
:func:`write_text` one text file. A run folder is the exception by design: it is live while
the run goes (``metrics.csv`` row by row, checkpoints as they are saved), so ``ldt-train``
only refuses a folder that holds anything (:func:`check_run_folder`) and writes each of its
files through this module.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

from ldt.errors import ConfigError

TMP_MARK = ".ldt-tmp-"
OLD_MARK = ".ldt-old-"


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
    if not holds_anything(run_dir):
        return
    if resume and _inside(os.path.realpath(resume), os.path.realpath(run_dir)):
        return
    names = sorted(os.listdir(run_dir)) if os.path.isdir(run_dir) else [run_dir]
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    raise OutputError(f"{flag}={run_dir} already holds files ({shown}); a run never writes "
                      f"into another run's folder: give a new run_dir, or train.resume="
                      f"{run_dir} to continue the run that is there")


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
    target = check_output(path, flag=flag, overwrite=overwrite, inputs=inputs)
    created = _make_parents(target, flag)
    tmp = _sibling(target, TMP_MARK)
    _probe(tmp, target, flag, created, folder=True)
    try:
        yield tmp
        fsync_tree(tmp)
        _put_in_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        raise


@contextmanager
def new_files(paths: Sequence[str], *, flags: Sequence[str], overwrite: bool = False,
              inputs: Sequence[tuple[str, str]] = ()) -> Iterator[list[str]]:
    """Yield a temporary path beside each of ``paths``, to be written in the block. When it
    ends without an exception, each written temporary is flushed and renamed into place (all
    are complete before the first rename); a temporary left unwritten means that output is
    absent this time, and an old file at its path (allowed with ``overwrite``) is removed so
    no stale output stays beside new ones. On an exception every temporary is removed and
    nothing at ``paths`` changes."""
    if len(set(map(os.path.abspath, paths))) != len(paths):
        raise OutputError(f"{', '.join(flags)} name the same file twice; give distinct paths")
    targets = [check_output(p, flag=f, overwrite=overwrite, inputs=inputs, file=True)
               for p, f in zip(paths, flags)]
    created = []
    for t, f in zip(targets, flags):
        created += _make_parents(t, f)
    tmps = [_sibling(t, TMP_MARK) for t in targets]
    for tmp, target, flag in zip(tmps, targets, flags):
        _probe(tmp, target, flag, created, folder=False)
        os.remove(tmp)
    try:
        yield tmps
        for tmp in tmps:
            if os.path.exists(tmp):
                _fsync_file(tmp)
        for tmp, target in zip(tmps, targets):
            if os.path.exists(tmp):
                _put_in_place(tmp, target)
            elif os.path.lexists(target):
                _remove(target)
    except BaseException:
        for tmp in tmps:
            _remove(tmp)
        _remove_empty(created)
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
    tmp = _sibling(os.path.abspath(path), TMP_MARK)
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def replace_file(path: str, text: str) -> None:
    """:func:`replacing` with a text."""
    with replacing(path) as tmp:
        with open(tmp, "w") as f:
            f.write(text)


def move_into_place(tmp: str, target: str) -> None:
    """Put a complete temporary (a file or a folder) at ``target``, swapping out whatever is
    there whole (for writers that name their own temporaries, e.g. a checkpoint part)."""
    _put_in_place(tmp, target)


# ---- helpers --------------------------------------------------------------------------------
def _sibling(target: str, mark: str) -> str:
    """A hidden name beside ``target``, ending in its extension (writers such as matplotlib
    pick the format from it)."""
    folder, name = os.path.split(target)
    ext = os.path.splitext(name)[1]
    return os.path.join(folder, f".{name}{mark}{os.getpid()}-{secrets.token_hex(3)}{ext}")


def _probe(tmp: str, target: str, flag: str, created: list[str], *, folder: bool) -> None:
    """Create the temporary (a folder, or an empty file): a place that cannot be written is
    refused here, naming the target, before any work is done."""
    try:
        if folder:
            os.mkdir(tmp)
        else:
            open(tmp, "x").close()
    except OSError as exc:
        _remove_empty(created)
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


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def _put_in_place(tmp: str, target: str) -> None:
    """Rename ``tmp`` to ``target``; an existing ``target`` is swapped out (in one step where
    the kernel can exchange two names) and then removed: replaced whole, never merged."""
    if not os.path.lexists(target):
        os.rename(tmp, target)
    elif _exchange(tmp, target):  # target now holds the new output, tmp the old one
        _remove(tmp)
    else:
        old = _sibling(target, OLD_MARK)
        os.rename(target, old)
        try:
            os.rename(tmp, target)
        except BaseException:
            os.rename(old, target)
            raise
        _remove(old)
    _fsync_dir(os.path.dirname(target))


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Swap two names in one step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """Flush every file and folder under ``root`` to disk (before it is renamed into place)."""
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                _fsync_file(path)
        _fsync_dir(folder)
