"""Per-rank progress: what each rank of a local world is doing, and whom a hang waits for.

Every rank of :func:`ldt.launch.local.run_local_world` owns one :class:`ProgressSlot` in memory
shared with the launcher. The training loop and the schedule runtime mark what they start
(``begin(label, waiting=...)``: a compute action, or a wait on peers: a receive, a collective,
the step-boundary agreement); the rank's lifeline thread stamps a heartbeat twice a second.
Writes are a few stores into shared memory, no system call.

When ranks time out, each only knows that *it* waited. The launcher reads every slot at the
first failure (:func:`snapshot`) and :func:`blame` names the rank the others were waiting for:
a rank whose process is stopped or frozen (no heartbeat), else the one busy in something other
than a wait while the others waited, else the one furthest behind.
Outside a local world (torchrun) :func:`current` is a record that goes nowhere.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from typing import Optional, Sequence

HEARTBEAT_S = 0.5
FROZEN_S = 3.0  # no heartbeat for this long: the process does not run (stopped, or frozen)


class ProgressSlot(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_int64), ("step", ctypes.c_int64), ("waiting", ctypes.c_int32),
                ("done", ctypes.c_int32), ("since", ctypes.c_double),
                ("heartbeat", ctypes.c_double), ("label", ctypes.c_char * 40)]


class Progress:
    """One rank's record (a no-op without a slot)."""

    def __init__(self, slot: Optional[ProgressSlot] = None):
        self._slot = slot

    def start(self, pid: int) -> None:
        if self._slot is not None:
            self._slot.pid, self._slot.step = pid, -1
            self.begin("starting")
            self.beat()

    def step(self, step: int) -> None:
        for listener in _LISTENERS:
            listener.step(step)
        if self._slot is not None:
            self._slot.step = step

    def begin(self, label: str, waiting: bool = False) -> None:
        """This rank now does ``label``; ``waiting``: it waits on other ranks."""
        for listener in _LISTENERS:
            listener.begin(label)
        s = self._slot
        if s is not None:
            s.label = label.encode()[:39]
            s.waiting, s.since = int(waiting), time.monotonic()

    def finish(self) -> None:
        if self._slot is not None:
            self.begin("finished")
            self._slot.done = 1

    def beat(self) -> None:
        if self._slot is not None:
            self._slot.heartbeat = time.monotonic()


_CURRENT = Progress()
_LISTENERS: list = []


def current() -> Progress:
    """This process's record: its slot when it is a rank of a local world, else a no-op."""
    return _CURRENT


def listen(listener) -> None:
    """Tell ``listener`` (``step(step)``, ``begin(label)``: a fault drill,
    :mod:`ldt.launch.drill`) what every record of this process marks, from now on."""
    _LISTENERS.append(listener)


def attach(slot: ProgressSlot) -> Progress:
    """Called once by the launcher's child: this process is the rank owning ``slot``."""
    global _CURRENT
    _CURRENT = Progress(slot)
    return _CURRENT


@dataclass(frozen=True)
class RankProgress:
    """One rank as the launcher saw it at a failure."""

    rank: int
    alive: bool  # the process still ran and had not reported
    os_state: str  # Linux process state: R running, S sleeping, T stopped, ... ('?' unknown)
    step: int
    label: str
    waiting: bool
    for_s: float  # how long it has been doing ``label``
    heartbeat_age_s: float
    done: bool

    def where(self) -> str:
        at = f"step {self.step}, " if self.step >= 0 else ""
        return f"{at}{'waiting in' if self.waiting else 'in'} {self.label!r} for {self.for_s:.1f}s"


def snapshot(slots: Sequence[ProgressSlot], alive: Sequence[bool]) -> list[RankProgress]:
    now = time.monotonic()
    out = []
    for rank, (s, up) in enumerate(zip(slots, alive)):
        out.append(RankProgress(
            rank=rank, alive=up, os_state=_os_state(s.pid) if up and s.pid else "?",
            step=s.step, label=s.label.decode(errors="replace"), waiting=bool(s.waiting),
            for_s=now - s.since if s.since else 0.0,
            heartbeat_age_s=now - s.heartbeat if s.heartbeat else 0.0, done=bool(s.done)))
    return out


def blame(ranks: Sequence[RankProgress]) -> Optional[tuple[int, str]]:
    """The rank everyone was waiting for and why, or None when the records do not say."""
    live = [r for r in ranks if r.alive and not r.done]
    stopped = [r for r in live if r.os_state in ("T", "t")]
    if stopped:
        r = stopped[0]
        return r.rank, f"its process is stopped (SIGSTOP or a debugger), {r.where()}"
    frozen = [r for r in live if r.heartbeat_age_s > FROZEN_S]
    if frozen:
        r = max(frozen, key=lambda x: x.heartbeat_age_s)
        return r.rank, (f"its process is frozen (no heartbeat for {r.heartbeat_age_s:.0f}s), "
                        f"{r.where()}")
    waiting = [r for r in ranks if r.waiting and not r.done]
    busy = [r for r in live if not r.waiting]
    if waiting and busy:
        r = max(busy, key=lambda x: x.for_s)
        return r.rank, f"it was busy while the others waited, {r.where()}"
    steps = {r.step for r in ranks if not r.done}
    if len(steps) > 1:
        r = min((x for x in ranks if not x.done), key=lambda x: (x.step, -x.for_s))
        return r.rank, f"it is furthest behind, {r.where()}"
    return None


def _os_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def waiting_ranks(ranks: Sequence[RankProgress], culprit: int) -> list[int]:
    return [r.rank for r in ranks if r.rank != culprit and not r.done]


def describe(ranks: Sequence[RankProgress]) -> str:
    """One line per rank, for a report."""
    return "\n".join(f"  rank {r.rank}: {r.where()}" + ("" if r.alive else " (ended)")
                     for r in ranks)

