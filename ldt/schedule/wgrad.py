"""The W store: weight-gradient work deferred by a backward (B) and run by its W action.

A zero-bubble schedule (:mod:`ldt.schedule.zerobubble`) runs each backward as B now and W
later. The runtime calls, per micro-batch and chunk (``key = (micro-batch, chunk name)``)::

    store = WgradStore(seam)            # once per stage: ldt.patches.wgrad_split.WgradSeam
    with store.capture(key):            # a B action: the backward, weight GEMMs deferred
        backward_step(...)
    store.run(key)                      # its W action: the deferred GEMMs, then DDP's hooks
    store.finish()                      # at the step's end

and the store refuses, naming the micro-batch and the chunk, a W before its B, a W twice, a B
twice, W's of one chunk out of their B's order (Transformer Engine's store is a queue), and a
step that ends with a W not run (its gradient would be lost silently). The checker refuses
the same in a schedule before it runs (:mod:`ldt.schedule.check`); this is the runtime's check.

No torch here: what is deferred and how W runs it is the seam's (megatron-core's layers,
``ldt/patches/wgrad_split.py``); the store keeps the order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable
from typing import Any, Callable, Iterator, Protocol

Key = tuple[int, Hashable]
"""``(micro-batch, chunk)``: the chunk is a name, e.g. ``"start"`` / ``"end"`` on the U-shape's
edge, ``"stage"`` on a plain stage."""


class WgradOrderError(RuntimeError):
    """A W ran before its B, twice, out of order, or not at all."""


class Seam(Protocol):
    def deferring(self, key: Key, sink: Callable[[Any], None]) -> contextlib.AbstractContextManager:
        """While inside, the backward's deferred work goes to ``sink``."""

    def run(self, key: Key, items: list) -> None:
        """Run what ``key``'s backward deferred (``items``, in the order deferred)."""


def describe(key: Key) -> str:
    return f"micro-batch {key[0]}, chunk {key[1]!r}"


class WgradStore:
    """Deferred weight-gradient work per ``(micro-batch, chunk)`` of one stage and one step."""

    def __init__(self, seam: Seam) -> None:
        self.seam = seam
        self._items: dict[Key, list] = {}  # captured, W not run yet (in capture order)
        self._done: set[Key] = set()
        self._open: Key | None = None

    @contextlib.contextmanager
    def capture(self, key: Key) -> Iterator[None]:
        """The B of ``key``: what its backward defers is kept for :meth:`run`."""
        if key in self._items or key in self._done:
            raise WgradOrderError(f"the backward of {describe(key)} runs twice in one step; "
                                  "each (micro-batch, chunk) has one B and one W")
        if self._open is not None:
            raise WgradOrderError(f"the backward of {describe(key)} starts inside the capture "
                                  f"of {describe(self._open)}; captures do not nest")
        items: list = []
        self._open = key
        try:
            with self.seam.deferring(key, items.append):
                yield
        finally:
            self._open = None
        self._items[key] = items

    def run(self, key: Key) -> None:
        """The W of ``key``: run what its B deferred (megatron DDP's hooks fire here)."""
        if key in self._done:
            raise WgradOrderError(f"the W of {describe(key)} runs twice; a weight gradient is "
                                  "accumulated once")
        if key not in self._items:
            raise WgradOrderError(f"the W of {describe(key)} runs before its B (its backward "
                                  "was not captured); run the B first, inside capture()")
        oldest = next(k for k in self._items if k[1] == key[1])
        if oldest != key:
            raise WgradOrderError(f"the W of {describe(key)} runs before the W of "
                                  f"{describe(oldest)}; a chunk's W's run in the order of its "
                                  "B's (Transformer Engine keeps them in a queue)")
        items = self._items.pop(key)
        self._done.add(key)
        self.seam.run(key, items)

    def pending(self) -> list[Key]:
        """Keys whose B ran and whose W has not, oldest first."""
        return list(self._items)

    def finish(self) -> None:
        """The step's end: every captured W must have run. Resets for the next step."""
        left = self.pending()
        self._items, self._done = {}, set()
        if left:
            more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
            raise WgradOrderError(f"the step ended with the W of {describe(left[0])}{more} not "
                                  "run: its weight gradient would be lost; the schedule needs a "
                                  "W action after every B")
