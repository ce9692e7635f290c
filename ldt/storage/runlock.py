"""A run folder has one owner: the process that launched the run holds a lock on it.

The lock is ``fcntl.flock`` on ``<run_dir>/.ldt-lock``, held for the run's life by the
launcher (a bare ``ldt-train``; under torchrun, rank 0, the one rank whose run folder is
Hydra's; ranks on other nodes never lock). The kernel releases it when its process ends,
however it ends, so a crash never leaves a stale lock; the file holds the holder's pid, host,
command and start time so that a refusal can name it. A second run in the folder, a resume
of it, or a read of its checkpoints while it trains (``ldt-convert export``, ``train.resume``
/ ``train.load`` from another run) is refused in one line naming the holder.

The file is created when the lock is taken and removed when it is released (after a refused
start the folder is as it was). Removing a lock file is safe against a process that opened it
just before: :meth:`RunLock.acquire` checks, once it holds the lock, that the file it locked is
still the one at the path, and otherwise tries again.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shlex
import sys
import time
from typing import Optional

from ldt.config.errors import ConfigError
from ldt.storage.commit import host

LOCK_NAME = ".ldt-lock"


NO_LOCKS = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENOLCK)
"""flock's errors on a filesystem that has no locks (or no lock manager): the run goes on
unlocked with a warning; any other error refuses the run folder."""


class RunFolderInUse(ConfigError):
    """The run folder is locked by a live run; the message names it."""


def holder(run_dir: str) -> Optional[str]:
    """Who holds ``run_dir``'s lock (pid, host, command, since when), or None when no live
    process does. Reads only: a folder without a lock file is not touched."""
    path = os.path.join(run_dir, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
            return text or "a process that has not written its name yet"
        except OSError:  # a filesystem without locks: nothing can be known
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def run_of(path: str) -> Optional[str]:
    """The run folder ``path`` is or lies in (itself, or up to ``checkpoints/step_N/part``),
    when it holds a lock file; else None."""
    path = os.path.abspath(path)
    for _ in range(4):
        if os.path.exists(os.path.join(path, LOCK_NAME)):
            return path
        path = os.path.dirname(path)
    return None


def check_not_training(path: str, named: str) -> None:
    """Refuse to read checkpoints from a run that is training now (``named``: how the user
    named ``path``, e.g. ``train.load=DIR``): a save may be half-way, and
    ``train.keep_last`` may delete the checkpoint being read."""
    run = run_of(path)
    who = holder(run) if run else None
    if who:
        raise RunFolderInUse(f"{named}: the run in {run} is training now ({who}); its "
                             "checkpoints change while it runs: wait until it ends, or stop it "
                             "(Ctrl-C saves a checkpoint with train.save_every) and read them "
                             "then")


class RunLock:
    """The lock of one run folder (see the module docstring)."""

    def __init__(self, run_dir: str, flag: str = "run_dir"):
        self.run_dir, self.flag = os.path.abspath(run_dir), flag
        self.path = os.path.join(self.run_dir, LOCK_NAME)
        self._fd: Optional[int] = None

    def acquire(self) -> "RunLock":
        """Take the lock, or raise :class:`RunFolderInUse` naming its holder."""
        for attempt in range(100):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if attempt < 3:  # a reader's glance (holder()) holds it for microseconds
                    os.close(fd)
                    time.sleep(0.05)
                    continue
                text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
                os.close(fd)
                raise RunFolderInUse(
                    f"{self.flag}={self.run_dir} is in use by another run ("
                    f"{text or 'a process that has not written its name yet'}); a run folder "
                    f"has one owner: wait for that run to end (or stop it), or give a new "
                    f"{self.flag}") from None
            except OSError as exc:
                os.close(fd)
                if exc.errno == errno.ESTALE:  # its holder removed the file as we opened it
                    continue
                if exc.errno in NO_LOCKS:  # a filesystem without locks: say it, go on unlocked
                    print(f"ldt: warning: {self.flag}={self.run_dir} cannot be locked "
                          f"({os.strerror(exc.errno)}): nothing stops a second run from "
                          "writing there", file=sys.stderr)
                    return self
                why = exc.strerror or str(exc)
                raise RunFolderInUse(
                    f"{self.flag}={self.run_dir}: its lock cannot be taken ({why}), so a "
                    "second run could write there unseen; fix the file system's locking "
                    f"(e.g. NFS's lockd), or give a {self.flag} on a local disk") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._fd = fd
                os.ftruncate(fd, 0)
                os.pwrite(fd, self._describe().encode(), 0)
                return self
            os.close(fd)  # its holder removed it as we opened it: the next one is the lock
        raise RunFolderInUse(f"{self.flag}={self.run_dir}: its lock file keeps changing; "
                             "another process is starting and stopping runs there")

    def release(self) -> None:
        """Give the lock up and remove its file (held until removed: see the module
        docstring)."""
        if self._fd is None:
            return
        try:
            os.remove(self.path)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    @staticmethod
    def _describe() -> str:
        argv = list(getattr(sys, "orig_argv", sys.argv))  # as typed, before Hydra's additions
        if len(argv) > 1 and os.path.basename(argv[0]).startswith("python") \
                and not argv[1].startswith("-"):
            argv = argv[1:]  # an entry point's script: ldt-train ..., not python ldt-train ...
        command = shlex.join([os.path.basename(argv[0]), *argv[1:]])
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
        return f"pid {os.getpid()} on {host()} since {since}: {command}\n"
