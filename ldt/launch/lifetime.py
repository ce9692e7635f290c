"""A worker lives no longer than the process that started it.

Two launchers start ldt's workers: ldt's own (:mod:`ldt.launch.local`, whose children also
watch a lifeline) and torchrun's elastic agent. The agent starts every worker in a session
of its own (``Popen(start_new_session=True)``, torch's ``SubprocessHandler``), so a signal to
the agent's process group (a host's supervisor stopping it, ``kill -9 -PGID``) does not reach
the worker: it would go on, holding its memory and device, training with the other hosts'
ranks until a transfer with a rank of its host failed. The agent starts its workers from its
main thread and stays their parent, so the kernel's parent-death signal
(``PR_SET_PDEATHSIG``, Linux) ends a worker the moment its agent is gone, however it died.
Why a worker stops reaches its agent too: :func:`say_stop` prints the line and writes it to
the worker's error file, which the agent's summary names as the cause.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

#: set by torchrun's agent in every worker's environment (torch.distributed.elastic)
TORCHRUN_WORKER = "TORCHELASTIC_RUN_ID"


def die_with_parent() -> bool:
    """Linux: SIGKILL this process when its parent dies (``PR_SET_PDEATHSIG``); a parent that
    dies while it is being armed ends it at once (one that died before, in the second a
    worker takes to start Python, is not seen: the process has a new parent by then).
    Returns False where the platform has no such signal (the caller's other means apply)."""
    parent = os.getppid()
    try:
        import ctypes

        if ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL) != 0:
            return False  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # it died while the signal was being armed
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def stop_with_torchrun_agent() -> bool:
    """In a worker started by torchrun's agent: end with the agent (:func:`die_with_parent`).
    Elsewhere (bare, another launcher that sets ``RANK``) nothing changes. Returns whether
    the tie was made."""
    return TORCHRUN_WORKER in os.environ and die_with_parent()


def write_torchrun_error(line: str, replace: bool = True) -> None:
    """Under torchrun's agent: ``line`` in this worker's error file (``TORCHELASTIC_ERROR_FILE``),
    in the format torch's ``@record`` writes, so the agent's summary names it as the cause
    instead of "error_file: <N/A>" (torch has no function that writes a given line; its
    ``ErrorHandler`` adds a traceback the summary prefers). ``replace=False`` keeps a file a
    rank wrote first (a training failure's, the first cause)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or (not replace and os.path.exists(path)):
        return
    data = {"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the line is on stderr already


def say_stop(line: str, stream=None, *, printed: bool = True) -> None:
    """Why this process stops, as one line: printed on ``stream`` (default: stderr) in one
    write, flushed (the ranks of a node share torchrun's stderr), and under torchrun's agent
    written to this worker's error file, so the agent's summary names the cause.
    ``printed=False``: the error file only (a rank whose node's line another rank prints)."""
    if printed:
        stream = sys.stderr if stream is None else stream
        stream.write(f"{line}\n")
        stream.flush()
    # The first line wins: what a process says after its cause follows from it (the SIGTERM
    # torchrun sends the ranks left once one failed), and a training failure's line
    # (ldt.training.failure, replace=True) is the first cause.
    write_torchrun_error(line, replace=False)
