"""The least iteration time any order of a pipeline's actions can have, from their costs.

A schedule is one order of the same actions; whatever the order, three facts hold on every
stage ``s`` (compute only, each transfer taking its ``comm`` time, micro-batches entering in
order):

1. nothing runs on ``s`` before micro-batch 0's forward reached it (``head``), and then all of
   its work runs one op at a time: ``head + busy``;
2. no backward runs on ``s`` before micro-batch 0's gradient came back to it, and all of its
   backward work (B and W of every micro-batch) runs after: ``first_backward + m * backward``;
3. its last B (of micro-batch m - 1) ends after everything but the W's, which may go after it,
   and the rest of that micro-batch's backward path (B's and transfers, no W) follows it:
   ``head + busy - m * W + tail``.

The iteration is at least the largest of these over the stages. With a whole backward (W
folded into B, today's schedules) the W term is 0. For equal costs the bound is what 1F1B and
ZB-H1 take exactly (``3m + 3(P - 1)`` and ``3m + P - 1`` at F = B = W = 1), so a schedule's
distance from it is the part of its bubble an order could still remove; on unequal stages
it is the floor a zero-bubble order is judged against (``bench/bench_zb.py``). No torch here.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping

from ldt.schedule.ir import W_OF, Op

Costs = Mapping[tuple[int, str], float]
Comm = Mapping[tuple[int, int], float]


def chain(num_stages: int, ushape: bool) -> list[tuple[int, Op]]:
    """One micro-batch's path: its forwards then its backwards, as ``(stage, op)``."""
    cloud = range(1, num_stages) if ushape else range(num_stages)
    if ushape:
        forward = [(0, Op.FS)] + [(s, Op.F) for s in cloud] + [(0, Op.FE)]
        # the edge's end chunk's backward first (BS: the backward's start), its start
        # chunk's last (BE: the backward's end), as ldt.schedule.generate names them
        backward = [(0, Op.BS)] + [(s, Op.B) for s in reversed(cloud)] + [(0, Op.BE)]
    else:
        forward = [(s, Op.F) for s in cloud]
        backward = [(s, Op.B) for s in reversed(cloud)]
    return forward + backward


def least_iteration(costs: Costs, comm: Comm, num_stages: int, num_microbatches: int,
                    ushape: bool, own: Costs | None = None,
                    start_at: Mapping[int, float] | None = None) -> float:
    """The largest of the module's three bounds over the stages (``costs``: ``(stage, op)``
    -> time of one micro-batch, ``"F"``/``"B"``/``"W"`` or the edge's ``"FS"``... as
    :func:`ldt.schedule.zerobubble.zb_u_shape` takes them, W absent for a whole backward;
    ``comm``: ``(a, b)`` -> one transfer's time between two stages, absent: 0).

    A replay of measured times (:meth:`ldt.plan.calibrate.Calibration.least_iteration`) also
    charges each stage its communication actions' own time (``own``: ``(stage, "SEND_F")``...,
    where a WAIT's is the transfer ``comm`` gives the pair) and starts each stage at its
    ``start_at`` offset: micro-batch 0 reaches no stage before it starts, and after its first
    arrival a stage also posts every send and waits for every other message (its receives may
    be posted earlier, so they are left out)."""
    path = chain(num_stages, ushape)
    m = num_microbatches
    cost = lambda stage, op: costs.get((stage, op.value), 0.0)  # noqa: E731
    mine_own = lambda stage, op: (own or {}).get((stage, op), 0.0)  # noqa: E731
    # the transfer before each step of the path (none between two steps of one stage)
    hops = [0.0] + [comm.get((a, b), 0.0) for (a, _), (b, _) in zip(path, path[1:])]
    starts, t = [], 0.0  # when each step of the path can start, micro-batch 0
    for (stage, op), hop in zip(path, hops):
        t = max(t + hop, (start_at or {}).get(stage, 0.0))
        starts.append(t)
        t += cost(stage, op)
    best = t  # one micro-batch's path
    posting = _posting(path, m, mine_own)
    for s in range(num_stages):
        mine = [i for i, (stage, _) in enumerate(path) if stage == s]
        backs = [i for i in mine if path[i][1] in W_OF]
        deferrable = m * sum(cost(s, W_OF[path[i][1]]) for i in backs)  # its W's
        backward = m * sum(cost(s, path[i][1]) for i in backs) + deferrable
        busy = backward + m * sum(cost(s, path[i][1]) for i in mine if i not in backs)
        last = backs[-1]
        tail = sum(hops[j] + cost(*path[j]) for j in range(last + 1, len(path)))
        best = max(best, starts[mine[0]] + busy + posting[s], starts[backs[0]] + backward,
                   starts[mine[0]] + busy - deferrable + tail)
    return best


def _posting(path: list[tuple[int, Op]], m: int, own) -> dict[int, float]:
    """Per stage, the own time of the communication actions it must run after micro-batch
    0 first reached it: a SEND after each of its steps that hands a micro-batch to another
    stage, a WAIT before each it is handed, less the WAIT micro-batch 0's arrival ends with."""
    out: dict[int, float] = defaultdict(float)
    first_wait_done: set[int] = set()
    for (a, _), (b, op) in zip(path, path[1:]):
        if a == b:
            continue
        d = "B" if op in W_OF else "F"
        out[a] += m * own(a, f"SEND_{d}")
        out[b] += m * own(b, f"WAIT_{d}")
        if b not in first_wait_done and path[0][0] != b:  # micro-batch 0's arrival: in starts
            out[b] -= own(b, f"WAIT_{d}")
        first_wait_done.add(b)
    return out
