"""What a boundary transfer returns: the handles megatron's schedules and ldt's runtime wait.

A send is the leader's isend(s) (:class:`SendWork`); a receive is the leader's irecv(s), then
the stage's broadcast or sequence scatter (:class:`RecvWork`), optionally delivered late by
``cluster.link_delay_ms`` (:class:`LinkDelay`). A failure becomes a :class:`BoundaryError` that
names the boundary. :mod:`ldt.boundary.communicator` posts the transfers and builds these handles.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ldt.boundary.relay import PieceRelay
from ldt.boundary.sequence import SequenceLayout


class BoundaryError(RuntimeError):
    """A send or receive across a stage boundary failed (peer gone, link down, timeout); the
    message names the boundary's stages, the direction and the peer rank."""


class SendWork:
    """The leader's isend(s); keeps the sent buffer alive until waited."""

    def __init__(self, works: list, keep_alive: torch.Tensor, what: str = "send"):
        self._works, self._keep_alive, self._what = works, keep_alive, what
        self._posted = time.monotonic()

    def wait(self) -> None:
        try:
            for w in self._works:
                w.wait()
        except Exception as exc:
            raise boundary_error(self._what, self._posted, exc) from exc
        self._works, self._keep_alive = [], None

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


@dataclass
class Landing:
    """Where a received message lands before this rank's tensor has it (all optional)."""

    staged: Optional[torch.Tensor] = None  # the leader's host buffer of a host-staged link
    full: Optional[torch.Tensor] = None  # a sequence-parallel leader's (or fan-out) whole
    layout: Optional[SequenceLayout] = None  # the stage's broadcast or sequence scatter
    relay: Optional[PieceRelay] = None  # a message in pieces, relayed as they arrive
    keep_slice: Optional[tuple[int, int]] = None  # (TP size, TP rank): keep a slice of full


class RecvWork:
    """A posted boundary receive. ``wait()``: the leader's irecv, then the stage broadcast.

    On the leader, ``wait()`` first waits its irecv(s) (and copies host-staged data to the
    device); then every rank of the stage joins the broadcast from the leader, skipped for a
    one-rank stage. Ranks of a stage run the same schedule, so they wait in the same order.
    A message in pieces (``relay``, :mod:`ldt.boundary.relay`): ``works`` are its pieces'
    irecvs, and the leader relays each piece as soon as it arrived.
    """

    def __init__(self, tensor: torch.Tensor, works: list, *, tp_group, leader: int,
                 stage_size: int, landing: Optional["Landing"] = None, on_ready=None,
                 what: str = "receive", delay_s: float = 0.0):
        landing = landing or Landing()
        self.tensor, self._relay = tensor, landing.relay
        # a sequence-parallel stage: the leader receives ``full`` and scatters it
        self._layout, self._full = landing.layout, landing.full
        # (TP size, TP rank): a sequence-parallel rank that received the whole tensor itself
        # (ldt.boundary.relay's fan-out) keeps its slice of ``full``
        self._keep_slice = landing.keep_slice
        self._works, self._tp_group, self._leader = works, tp_group, leader
        self._stage_size, self._staged, self._on_ready = stage_size, landing.staged, on_ready
        self._done, self._what, self._posted = False, what, time.monotonic()
        self._delay = LinkDelay(works, delay_s) if delay_s > 0 and works else None

    def wait(self) -> None:
        if self._done:
            return
        try:
            if self._relay is not None:
                self._relay.run(self._arrivals())
            else:
                self._receive_whole()
        except Exception as exc:
            raise boundary_error(self._what, self._posted, exc) from exc
        self._done = True
        if self._on_ready is not None:
            self._on_ready(self.tensor if self._full is None else self._full)

    def _arrivals(self) -> list:
        """The pieces' irecvs to wait (None: the link delay's helper waited them already)."""
        if self._delay is None:
            return self._works
        self._delay.wait()  # it waited the works (a gloo work must be waited once)
        return [None] * len(self._works)

    def _receive_whole(self) -> None:
        for w in self._arrivals():
            if w is not None:
                w.wait()
        buf = self.tensor.detach()
        whole = buf if self._full is None else self._full
        if self._staged is not None:
            whole.copy_(self._staged)
        if self._keep_slice is not None:
            tp, tp_rank = self._keep_slice
            buf.copy_(whole.chunk(tp, dim=0)[tp_rank])
        elif self._layout is not None:  # broadcast, or the sequence scatter
            self._layout.distribute(self._full, buf, self._tp_group, self._leader)
        elif self._stage_size > 1:  # a non-leader's receive is this broadcast
            dist.broadcast(buf, src=self._leader, group=self._tp_group)

    def is_completed(self) -> bool:
        return self._done


class LinkDelay:
    """``cluster.link_delay_ms``: deliver a received message ``delay_s`` late (measurement tool).

    Only the receiver's clock is used (hosts' clocks differ): a helper thread waits the leader's
    irecv and notes when the message arrived; :meth:`wait` returns no earlier than
    ``max(arrival + delay, posted + 2 * delay)``. The first term is the link's one-way delay on
    the data. The second is gloo's rendezvous (its TCP transport sends a message only once the
    receiver's "ready" notice reached the sender): a receive posted after the sender was ready
    costs a round trip from the post on a real link, whatever the local arrival says. The
    sender and the receiver's other work are never blocked; only the WAIT that consumes the
    message is. Measured lateness with the receiver busy in Python: ~1.3 ms (5 ms before the
    switch interval was shortened).
    """

    SWITCH_INTERVAL_S = 2e-4

    def __init__(self, works: list, delay_s: float):
        # The helper needs the GIL to note the arrival; with Python's default switch interval
        # (5 ms) a main thread in pure-Python code held it long enough to make the delay ~5 ms
        # late (measured). A short interval costs nothing while no other thread wants the GIL.
        if sys.getswitchinterval() > self.SWITCH_INTERVAL_S:
            sys.setswitchinterval(self.SWITCH_INTERVAL_S)
        self.delay_s, self.posted = delay_s, time.monotonic()
        self.arrived: Optional[float] = None
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._watch, args=(works,), daemon=True,
                                        name="ldt-link-delay")
        self._thread.start()

    def _watch(self, works: list) -> None:
        try:
            for w in works:
                w.wait()
            self.arrived = time.monotonic()
        except BaseException as exc:  # re-raised by wait() on the main thread
            self.error = exc

    def wait(self) -> None:
        self._thread.join()
        if self.error is not None:
            raise self.error
        due = max(self.arrived + self.delay_s, self.posted + 2 * self.delay_s)
        pause = due - time.monotonic()
        if pause > 0:
            time.sleep(pause)


def boundary_error(what: str, posted: float, exc: Exception) -> BoundaryError:
    return BoundaryError(f"{what} failed {time.monotonic() - posted:.1f} s after it was posted "
                         f"({type(exc).__name__}: {exc})")
