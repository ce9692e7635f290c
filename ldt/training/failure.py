"""A rank's own failure report, where no ldt launcher watches the world (torchrun).

The bare launcher (:mod:`ldt.launch.local`) sees every rank and names the one that failed first, in
one line. Under torchrun each rank only knows itself, so each failing rank says, in one line on
stderr, who it is (rank, stage, TP rank), where it was (the step, and the action or phase from
its progress record) and why:

* the reason ldt composed: a boundary transfer that failed (the boundary, the peer, the
  seconds), a non-finite tensor at a boundary, a config that cannot work;
* torch's own error when a peer went away or did not answer in time (a rank died or stalled,
  a link went down), or when memory ran out.

The same line goes to torchrun's error file (``TORCHELASTIC_ERROR_FILE``, the file torchrun's
``@record`` writes), so torchrun's summary at exit shows it for every failed rank, and its
"Root Cause" is the rank whose line came first. Any other exception is a bug in ldt: the line
says so and the traceback follows, once.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ldt.boundary.work import BoundaryError
from ldt.config import ConfigError
from ldt.config.errors import EXIT_CONFIG
from ldt.config.layout import LayoutError
from ldt.launch import progress
from ldt.launch.lifetime import write_torchrun_error
from ldt.launch.local import is_peer_symptom
from ldt.training.guard import EXIT_FAILED
from ldt.training.observe import NonFiniteError

EXIT_INTERRUPTED = 130  # 128 + SIGINT, like a shell


def rank_label(topo, rank: int) -> str:
    """``rank 3 (stage 2 'cloud1', TP rank 0)``: how a failure names a rank."""
    if not 0 <= rank < topo.world_size:
        return f"rank {rank}"
    info = topo.rank_info(rank)
    return (f"rank {rank} (stage {info.stage} '{topo.stages[info.stage].name}', "
            f"TP rank {info.tp_rank})")


def reason(exc: BaseException) -> Optional[tuple[str, int]]:
    """``(one-line reason, exit status)`` of a failure that is not a bug in ldt; None for a
    bug. The exception's causes count too (the runtime wraps a boundary's error)."""
    chain = _chain(exc)
    for e in chain:
        if isinstance(e, (ConfigError, LayoutError)):
            return f"invalid config: {_first_line(e)}", EXIT_CONFIG
    for e in chain:
        if isinstance(e, (BoundaryError, NonFiniteError)):  # ldt named the boundary and peer
            return _first_line(e), EXIT_FAILED
    for e in reversed(chain):  # torch's own error, not the runtime's wrapper around it
        what = f"{type(e).__name__}: {_first_line(e)}"
        if isinstance(e, KeyboardInterrupt):
            return "interrupted (SIGINT)", EXIT_INTERRUPTED
        if isinstance(e, (MemoryError, torch.OutOfMemoryError)):
            return f"out of memory: {what}", EXIT_FAILED
        if isinstance(e, dist.DistError) or (isinstance(e, RuntimeError)
                                              and is_peer_symptom(str(e))):
            return (f"lost a peer (a rank died or stalled, or a link is down): {what}",
                    EXIT_FAILED)
    return None


def track_progress() -> Callable[[], progress.RankProgress]:
    """Give this process a progress record of its own (under torchrun no launcher holds
    one), so that a failure can say what the rank was doing; returns a reader of it."""
    slot = progress.ProgressSlot()
    progress.attach(slot).start(os.getpid())
    return lambda: progress.snapshot([slot], [True])[0]


def report(exc: BaseException, label: str, prog: str = "ldt",
           seen: Optional[progress.RankProgress] = None) -> int:
    """Print this rank's line (and, for a bug, the traceback), fill torchrun's error file;
    return the exit status."""
    found = reason(exc)
    where = f" ({seen.where()})" if seen is not None else ""
    if found is None:
        text, code = (f"an error in ldt itself, please report it with the traceback below: "
                      f"{type(exc).__name__}: {_first_line(exc)}"), EXIT_FAILED
    else:
        text, code = found
    line = f"{prog}: {label} failed{where}: {text}"
    tb = "" if found is not None else "".join(traceback.format_exception(exc))
    # one write: the ranks of a node share torchrun's stderr, and print()'s two writes (text,
    # newline; unbuffered under PYTHONUNBUFFERED) let two ranks' lines run into one
    sys.stderr.write(f"{line}\n{tb}")
    sys.stderr.flush()
    write_torchrun_error(line)
    return code


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    e: Optional[BaseException] = exc
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return out


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
