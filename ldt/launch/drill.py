"""Fault drills: this host dies at a chosen point of a step (``LDT_FAULT_AT``).

A lost host is the failure elastic runs and snapshots are for, and where in a step it dies
decides what must be recovered: in the forward or the backward (activations and gradients in
flight), in the optimizer step (weights half updated), while a snapshot travels to its copy's
host. Killing a host from outside cannot aim at a phase of a 0.1 s step, so a torchrun worker
started with ``LDT_FAULT_AT=<n>:<point>`` kills its agent and itself, which is all a host runs,
when it first reaches ``<point>`` in or after the ``n``-th step it trains (1: its world's
first):

- ``forward``: its first forward action; ``backward``: its first backward action;
- ``optimizer``: the gradient reduction and optimizer step;
- ``copy``: the writer thread sending this rank's snapshot to another host.

It listens to the rank's progress record (:mod:`ldt.launch.progress`), which every one of those
points already marks. For tests and benches of recovery (docs/elastic.md); nothing else sets it.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from typing import Mapping

from ldt.config import ConfigError
from ldt.launch import progress

ENV = "LDT_FAULT_AT"
POINTS = {
    "forward": re.compile(r"\d+F[SE]?\d+$"),   # a schedule action: stage, op, micro-batch
    "backward": re.compile(r"\d+B[SE]?\d+$"),
    "optimizer": re.compile(r"grad reduce"),
    "copy": re.compile(r"copying the snapshot"),
}


class Drill:
    """Listens to the rank's progress record and kills the host at its point."""

    def __init__(self, nth: int, point: str):
        self.nth, self.pattern, self.steps = nth, POINTS[point], 0

    def step(self, step: int) -> None:
        self.steps += 1

    def begin(self, label: str) -> None:
        # at or after the nth step: a snapshot's copy can begin once the next step has
        # (a writer slowed by a loaded machine), and the drill must still fire
        if self.steps >= self.nth and self.pattern.match(label):
            print(f"ldt: drill: killing this host at {label!r} of its step {self.steps} "
                  f"(time {time.time():.3f})", file=sys.stderr, flush=True)
            os.kill(os.getppid(), signal.SIGKILL)  # torchrun's agent: the host's other process
            os.kill(os.getpid(), signal.SIGKILL)


def arm(env: Mapping[str, str] = os.environ) -> bool:
    """Install the drill ``env`` asks for (a torchrun worker only); whether one is armed."""
    text = env.get(ENV)
    if not text:
        return False
    nth, _, point = text.partition(":")
    if not nth.isdigit() or int(nth) < 1 or point not in POINTS:
        raise ConfigError(f"{ENV}={text!r}: give <n>:<point>, n >= 1, point one of "
                          f"{', '.join(POINTS)}")
    progress.listen(Drill(int(nth), point))
    return True
