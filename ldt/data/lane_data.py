"""A data stage's replica under per-stage data parallelism (VDP): which micro-batches it reads.

Micro-batch ``g`` is read as the uniform run's replica ``g mod D`` reads its micro-batch
``g // D`` (:mod:`ldt.schedule.routing`), on the data stage's own replica: data and labels never
cross a boundary.
"""

from __future__ import annotations

import copy
from typing import Iterator

from ldt.schedule.routing import virtual_of


class LaneData:
    """A data stage replica's micro-batches under per-stage DP, in the order it runs them.

    ``data`` is the stage's uniform-DP data object (``dp`` = the largest stage dp); a shallow
    copy per uniform replica ``v`` (``dp_rank = v``) reads what that replica would read.
    """

    def __init__(self, data, microbatches: list[int], dp_max: int):
        self.microbatches, self.dp_max = list(microbatches), dp_max
        self._replicas = {}
        for g in self.microbatches:
            v, _ = virtual_of(g, dp_max)
            if v not in self._replicas:
                self._replicas[v] = copy.copy(data)
                self._replicas[v].dp_rank = v

    def _of(self, g: int):
        v, j = virtual_of(g, self.dp_max)
        return self._replicas[v], j

    def step_iterator(self, step: int) -> Iterator[dict]:
        return (rep.batch(step, j) for rep, j in map(self._of, self.microbatches))

    def eval_iterator(self) -> Iterator[dict]:
        return (rep.eval_batch(j) for rep, j in map(self._of, self.microbatches))
