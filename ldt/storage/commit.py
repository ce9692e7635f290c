"""Putting finished temporaries in place, and what a killed writer leaves behind.

:mod:`ldt.storage.atomic` builds every output under a temporary name beside its target; this
module owns the step that makes it the target, and the names that step uses.

- Every temporary name records its owner: ``.NAME.ldt-tmp-<host>-<pid>-<random>[.ext]`` (a
  target moved aside while it is replaced: ``.NAME.ldt-old-...``). :func:`sweep`, called by
  the next writer to ``NAME``, removes the leftovers of an owner that is dead (same host, no
  such process), restoring a target a killed writer had moved aside; a live owner's, or
  another host's, are left alone.
- One target (:func:`put_in_place`): the kernel swaps the two names in one step where it can
  (renameat2 RENAME_EXCHANGE), else the old target is moved aside, the new one renamed in,
  the old one removed.
- A set of targets that belong together (``PREFIX.bin`` + ``PREFIX.idx``, a planned cluster
  and its train file: :func:`commit_set`) appears as a set or not at all: a journal naming
  every member (``.NAME.ldt-set-<host>-<pid>-<random>.json`` beside the first) is written
  before the first rename; each old member is moved aside and each new one renamed in; the
  asides and the journal are removed when all are in. An exception at any rename puts every
  member back as it was; a writer killed part-way is rolled back by the next writer
  (:func:`sweep`), and until then a reader sees the journal (:func:`set_in_progress`) and
  refuses the half-replaced set.
- SIGINT, SIGTERM and SIGHUP that arrive during a commit are held until it ends
  (:func:`signals_held`), so an interruption lands before the first rename or after the last.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import re
import secrets
import shutil
import signal
import socket
import threading
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

from ldt.config.errors import exception_chain

TMP_MARK = ".ldt-tmp-"
OLD_MARK = ".ldt-old-"
SET_MARK = ".ldt-set-"
_MARKS = (TMP_MARK, OLD_MARK, SET_MARK)
_HELD = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


# ---- names ----------------------------------------------------------------------------------
def host() -> str:
    """This machine's name as it appears in a temporary's name (no separators, no spaces)."""
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "localhost"


def sibling(target: str, mark: str, ext: Optional[str] = None) -> str:
    """A hidden name beside ``target`` owned by this process, ending in the target's
    extension (writers such as matplotlib pick the format from it)."""
    folder, name = os.path.split(target)
    ext = os.path.splitext(name)[1] if ext is None else ext
    return os.path.join(folder, f".{name}{mark}{host()}-{os.getpid()}-{secrets.token_hex(3)}"
                                f"{ext}")


def owner(entry: str, name: str) -> Optional[tuple[str, str, int]]:
    """``(mark, host, pid)`` of a temporary named ``entry`` that belongs to target ``name``;
    None for any other name. (Names written before owners were recorded,
    ``.NAME.ldt-tmp-<pid>-<random>``, count as this host's.)"""
    for mark in _MARKS:
        head = f".{name}{mark}"
        if entry.startswith(head):
            rest = entry[len(head):]
            found = re.match(r"^(?:(?P<host>.+)-)?(?P<pid>\d+)-[0-9a-f]{6}(?:\.[^.]*)?$", rest)
            if found:
                return mark, found.group("host") or host(), int(found.group("pid"))
    return None


def is_dead(owner_host: str, pid: int) -> bool:
    """Is the process that owns a temporary gone? Only this host's can be known."""
    if owner_host != host() or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: alive, another user's
        return False
    return False


# ---- leftovers --------------------------------------------------------------------------------
def sweep(target: str) -> list[str]:
    """Remove what dead writers left beside ``target`` (see the module docstring): a set's
    journal is rolled back first, then a moved-aside target whose replacement never came is
    put back, and the rest removed. Returns the names removed or restored."""
    folder, name = os.path.split(os.path.abspath(target))
    try:
        entries = sorted(os.listdir(folder))
    except OSError:
        return []
    found = [(e, owner(e, name)) for e in entries]
    found = [(e, o) for e, o in found if o is not None and is_dead(o[1], o[2])]
    done = []
    for entry, (mark, _, _) in sorted(found, key=lambda x: x[1][0] != SET_MARK):
        path = os.path.join(folder, entry)
        if not os.path.lexists(path):
            continue
        if mark == SET_MARK:
            _roll_back(path)
        elif mark == OLD_MARK and not os.path.lexists(target):
            os.rename(path, target)
        else:
            remove(path)
        done.append(entry)
    return done


def set_in_progress(target: str) -> Optional[str]:
    """One line when a set whose first member is ``target`` is being replaced (a journal
    beside it: its writer is committing now, or was killed while it did); else None."""
    folder, name = os.path.split(os.path.abspath(target))
    try:
        entries = os.listdir(folder)
    except OSError:
        return None
    for entry in entries:
        o = owner(entry, name)
        if o is not None and o[0] == SET_MARK:
            state = ("was killed while it replaced them" if is_dead(o[1], o[2])
                     else "is replacing them now")
            return f"process {o[2]} on {o[1]} {state} ({os.path.join(folder, entry)})"
    return None


# ---- putting in place -----------------------------------------------------------------------
def put_in_place(tmp: str, target: str, *, replace: bool = True) -> None:
    """Rename ``tmp`` to ``target``; an existing ``target`` is swapped out and removed:
    replaced whole, never merged. ``replace=False``: a ``target`` that exists now (another
    command wrote it while this one worked; an empty folder excepted) is a FileExistsError and
    stays as it is. Stop signals wait until it is done."""
    with signals_held():
        if not replace:
            _not_there(tmp, target)
        if not os.path.lexists(target):
            os.rename(tmp, target)
        elif _exchange(tmp, target):  # target now holds the new output, tmp the old one
            remove(tmp)
        else:
            old = sibling(target, OLD_MARK)
            os.rename(target, old)
            try:
                os.rename(tmp, target)
            except BaseException:
                os.rename(old, target)
                raise
            remove(old)
        fsync_dir(os.path.dirname(target))


def commit_set(members: Sequence[tuple[Optional[str], str]], *, replace: bool = True) -> None:
    """Put a set of outputs in place together (see the module docstring). ``members``:
    ``(tmp, target)``; a ``tmp`` of None removes an old ``target`` (an output this run does
    not have, which must not stay beside the new ones). ``replace``: as :func:`put_in_place`."""
    if not replace:
        with signals_held():
            for tmp, target in members:
                if tmp is not None:
                    _not_there(tmp, target)
    plan = [{"tmp": tmp, "target": target,
             "aside": sibling(target, OLD_MARK) if os.path.lexists(target) else None}
            for tmp, target in members if tmp is not None or os.path.lexists(target)]
    if not plan:
        return
    if len(plan) == 1 and plan[0]["tmp"] is not None:
        put_in_place(plan[0]["tmp"], plan[0]["target"])
        return
    journal = sibling(plan[0]["target"], SET_MARK, ext=".json")
    folders = sorted({os.path.dirname(m["target"]) for m in plan})
    with signals_held():
        try:
            with open(journal, "w") as f:
                json.dump({"members": plan}, f)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            remove(journal)
            raise
        done: list[tuple[dict, bool]] = []
        try:
            for m in plan:
                if m["aside"]:
                    os.rename(m["target"], m["aside"])
                done.append((m, False))
                if m["tmp"] is not None:
                    os.rename(m["tmp"], m["target"])
                    done[-1] = (m, True)
            for folder in folders:
                fsync_dir(folder)
        except BaseException:
            for m, placed in reversed(done):
                if placed:
                    remove(m["target"])
                if m["aside"]:
                    os.rename(m["aside"], m["target"])
            remove(journal)
            raise
        for m in plan:
            if m["aside"]:
                remove(m["aside"])
        remove(journal)
        for folder in folders:
            fsync_dir(folder)


def _not_there(tmp: str, target: str) -> None:
    """FileExistsError when ``target`` exists (an empty folder may take a folder)."""
    if os.path.lexists(target) and not (os.path.isdir(tmp) and os.path.isdir(target)
                                         and not os.path.islink(target)
                                         and not os.listdir(target)):
        import errno

        raise FileExistsError(errno.EEXIST, "written by another command meanwhile", target)


def _roll_back(journal: str) -> None:
    """Undo the commit of a killed writer: every member as it was before it (or, when every
    new member was already in, finish it)."""
    try:
        with open(journal) as f:
            plan = json.load(f)["members"]
    except (OSError, ValueError, KeyError, TypeError):  # killed while writing it: no rename yet
        remove(journal)
        return

    def placed(m):
        return not os.path.lexists(m["tmp"]) if m["tmp"] is not None \
            else not os.path.lexists(m["target"])

    if all(placed(m) for m in plan):  # every rename happened: only the asides are left
        for m in plan:
            if m["aside"]:
                remove(m["aside"])
    else:
        for m in reversed(plan):
            if m["tmp"] is not None and placed(m):
                remove(m["target"])
            if m["aside"] and os.path.lexists(m["aside"]):
                os.replace(m["aside"], m["target"])
            if m["tmp"] is not None:
                remove(m["tmp"])
    remove(journal)


@contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT / SIGTERM / SIGHUP are recorded, not acted on, inside the block; the first one
    is delivered again to the handlers it would have met once the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = {}
    for s in _HELD:
        handler = signal.getsignal(s)
        if handler is None:  # installed outside Python: leave it
            continue
        old[s] = signal.signal(s, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if got:
            os.kill(os.getpid(), got[0])


# ---- full disks ---------------------------------------------------------------------------------
_NO_SPACE = ("No space left on device", "os error 28", "Disk quota exceeded")


def out_of_space(exc: BaseException, folder: str, needed: int = 0) -> bool:
    """Did ``exc`` come from a full disk? ENOSPC / EDQUOT anywhere in its chain (including
    the writers' exceptions torch.distributed.checkpoint keeps, and libraries that say it in
    words: safetensors' "No space left on device (os error 28)"), or less free space at
    ``folder`` than the write ``needed`` (torch's zip writer hides the OSError behind
    "unexpected pos")."""
    import errno

    for e in exception_chain(exc):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(words in str(e) for words in _NO_SPACE):
            return True
    try:
        return needed > 0 and shutil.disk_usage(folder).free < needed
    except OSError:
        return False


# ---- helpers ------------------------------------------------------------------------------
def remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Swap two names in one step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    fn = _renameat2()
    return fn is not None and fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b),
                                 _RENAME_EXCHANGE) == 0


@functools.lru_cache(maxsize=1)
def _renameat2():
    """libc's renameat2, looked up once (a snapshot puts a part in place every step, and
    loading libc builds a class each time: ~0.1 ms); None where there is none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
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
