"""Faults at a command's writes and renames, one at a time (tests of #39's writers).

:class:`Faults` wraps the calls through which ldt and the libraries it uses write (``open``
for writing, ``os.rename``, ``os.replace``, the kernel's name exchange, ``os.fsync``) and
counts them. A dry run of a command lists them; then the command runs again with the k-th
call failing as a full disk does (``OSError(ENOSPC)``) or with a real signal sent to this
process right there (SIGTERM, SIGINT: the handler the command installed runs at that point).
:func:`each_fault` does that for a sample of the calls (every rename that puts an output in
place, the first, middle and last writes) and checks what a user sees: exit status 2 (full disk) or 128 + the signal, one
line on stderr naming the cause, no traceback, and every byte of the folder as it was (or,
for a signal that arrived while the outputs were being put in place, which holds it until
they are, the outputs complete: the same files as a clean run). A fault whose failure changes nothing (a folder's flush,
which ldt does not require) lets the command succeed with its outputs complete.
"""

from __future__ import annotations

import builtins
import errno
import hashlib
import io
import os
import shutil
import signal

WRITE_MODES = set("wax+")


def tree(root) -> dict:
    """Every path under ``root`` (hidden ones too) -> sha1 of its bytes, or "dir"."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(folder, d), root)] = "dir"
        for f in files:
            path = os.path.join(folder, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, root)] = hashlib.sha1(fh.read()).hexdigest()
    return out


class Faults:
    def __init__(self, monkeypatch):
        from ldt.storage import commit

        self.calls: list[tuple[str, str]] = []
        self.at, self.fault = None, None
        real_open, real_rename, real_replace = builtins.open, os.rename, os.replace
        real_fsync, real_exchange = os.fsync, commit._exchange

        def hit(kind, what):
            self.calls.append((kind, str(what)))
            if self.at is not None and len(self.calls) == self.at:
                if self.fault == "enospc":
                    raise OSError(errno.ENOSPC, "No space left on device", str(what))
                os.kill(os.getpid(), self.fault)

        def open_(file, mode="r", *args, **kwargs):
            if isinstance(file, (str, bytes, os.PathLike)) and set(str(mode)) & WRITE_MODES:
                hit("open", file)
            return real_open(file, mode, *args, **kwargs)

        def rename(src, dst, **kwargs):
            hit("rename", dst)
            return real_rename(src, dst, **kwargs)

        def replace(src, dst, **kwargs):
            hit("rename", dst)
            return real_replace(src, dst, **kwargs)

        def exchange(a, b):
            hit("rename", b)
            return real_exchange(a, b)

        def fsync(fd):
            hit("fsync", fd)
            return real_fsync(fd)

        monkeypatch.setattr(builtins, "open", open_)
        monkeypatch.setattr(io, "open", open_)
        monkeypatch.setattr(os, "rename", rename)
        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(commit, "_exchange", exchange)
        # a SIGTERM this test sends itself must never end pytest, whatever is active
        self._old_term = signal.signal(signal.SIGTERM, _raise_stop)

    def close(self) -> None:
        signal.signal(signal.SIGTERM, self._old_term)

    def sample(self) -> list[int]:
        """1-based indices to fault: every rename that puts an output in place (not one
        inside a temporary folder), and the first, middle and last of the writes, of the
        flushes and of the renames."""
        picked = {i + 1 for i, (kind, what) in enumerate(self.calls)
                  if kind == "rename" and ".ldt-tmp-" not in os.path.dirname(what)}
        for kind in ("open", "fsync", "rename"):
            idx = [i + 1 for i, (k, _) in enumerate(self.calls) if k == kind]
            if idx:
                picked |= {idx[0], idx[len(idx) // 2], idx[-1]}
        return sorted(picked)


def _raise_stop(signum, frame):
    from ldt.tools.cli import Stopped

    raise Stopped(signum)


def each_fault(monkeypatch, capsys, scratch, run, *, signals=True) -> int:
    """Run ``run(root)`` (-> exit status) on a copy of ``scratch``: once clean (it must
    succeed), then with a fault at each sampled write or rename, each time on a fresh copy;
    check what the user sees and what is left (see the module docstring). Returns the number
    of faults tried."""
    import tempfile

    base = tempfile.mkdtemp(prefix="ldt-faults-")
    try:
        faults = Faults(monkeypatch)
        try:
            for n in range(2):  # the second time: what a first import of a library writes
                # (a cache) is not part of the command's writes
                dry = os.path.join(base, f"dry{n}")
                shutil.copytree(scratch, dry, symlinks=True)
                before = tree(dry)
                faults.calls = []
                code = run(dry)
                out, err = capsys.readouterr()
                assert code == 0, err
            after = tree(dry)
            assert after != before
            points = faults.sample()
            tried = 0
            for n, at in enumerate(points):
                kinds = ["enospc"] + ([[signal.SIGTERM, signal.SIGINT][n % 2]] if signals
                                      else [])
                for fault in kinds:
                    root = os.path.join(base, f"try{n}-{fault}")
                    shutil.copytree(scratch, root, symlinks=True)
                    faults.calls, faults.at, faults.fault = [], at, fault
                    try:
                        code = run(root)
                    finally:
                        faults.at = None
                    out, err = capsys.readouterr()
                    what = (fault, at, faults.calls[at - 1] if at <= len(faults.calls) else None)
                    assert "Traceback" not in out + err, (what, err)
                    lines = [ln for ln in err.splitlines() if ln.strip()]
                    if code == 0 and fault == "enospc":  # a flush whose failure changes nothing
                        assert not lines and set(tree(root)) == set(after), (what, err)
                        continue
                    assert len(lines) == 1, (what, err)
                    if fault == "enospc":
                        assert code == 2 and "no space left" in lines[0], (what, code, err)
                        assert tree(root) == before, what
                    else:
                        assert code == 128 + fault, (what, code, err)
                        assert ("stopped by SIGTERM" if fault == signal.SIGTERM
                                else "interrupted (SIGINT)") in lines[0], (what, err)
                        got = tree(root)  # (a checkpoint's metadata holds a random id)
                        assert got == before or set(got) == set(after), what
                    shutil.rmtree(root)
                    tried += 1
            return tried
        finally:
            faults.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
