"""``ldt-train`` run in the test's own process: its ``main(argv)``, the function the console
script calls, so the same code runs (Hydra's command line, validation, the memory check, the
launcher, the local world and the reference run of ``train.verify``), without a new
interpreter that imports torch and megatron-core again. The ranks fork from this process's
forkserver, which has them loaded after the first world: a 1-step run of cpu_demo takes ~3 s
here against ~8 s as a subprocess.

What only a process of its own shows stays a subprocess (tests/test_cli.py, the documents,
the kill, signal and torchrun tests): its exit by signal or ``os._exit``, its stderr after a
crash, environment variables the ranks must see (the forkserver keeps the environment it
started with), a hang the test must outlive.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from typing import Optional


@dataclass
class Finished:
    """What the launcher printed (the ranks' own lines go to the forkserver's stdout)."""

    returncode: int
    stdout: str
    stderr: str

    def summary(self) -> dict:
        """The run's last line: its JSON summary; fails with the launcher's output if absent."""
        assert self.returncode == 0, (self.returncode, self.stdout[-3000:], self.stderr[-3000:])
        return json.loads(self.stdout.strip().splitlines()[-1])


def run_train(*argv, own_process: bool = False, timeout: float = 240,
              env: Optional[dict] = None, cwd=None) -> Finished:
    """``ldt-train ARGV...`` in this process; ``own_process``: as a subprocess (with ``env``
    and ``cwd``), where the test reads what the ranks print (a rank's warning, a snapshot
    join's line) or plays a torchrun rank (``RANK`` set: a failing rank leaves by
    ``os._exit``)."""
    if own_process:
        proc = subprocess.run([sys.executable, "-m", "ldt.job.train", *map(str, argv)],
                              capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
        return Finished(proc.returncode, proc.stdout, proc.stderr)
    from ldt.job.train import main

    _absl_off_captured_stderr()
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([str(a) for a in argv])
    return Finished(code, out.getvalue(), err.getvalue())


def _absl_off_captured_stderr() -> None:
    """Point absl's log handler at ``sys.__stderr__`` before ``main()`` runs in this process.

    absl.logging (imported by ``import megatron.core`` from 0.17: megatron.core.hyper_comm_grid)
    makes its handler on import, on the ``sys.stderr`` of that moment: in pytest's process,
    when a test, a test module or the extension fixture (conftest) imported megatron-core
    first, pytest's capture file. ``main()``'s Hydra configures its logging with
    ``logging.config.dictConfig``, which closes every handler alive in the process, and
    absl's ``PythonHandler.close`` closes its stream unless it is the current ``sys.stderr``
    or ``sys.stdout`` (here ``redirect_stderr``'s buffer, then ldt's ``HeldStderr``): pytest's
    capture file was closed, the test failed with "I/O operation on closed file" and pytest's
    process ended with "lost sys.stderr". absl writes a record to the ``sys.stderr`` of the
    moment anyway (its flags are never parsed here); the stream it holds is only closed."""
    absl_logging = sys.modules.get("absl.logging")
    if absl_logging is not None and sys.__stderr__ is not None:
        absl_logging.get_absl_handler().python_handler.stream = sys.__stderr__
