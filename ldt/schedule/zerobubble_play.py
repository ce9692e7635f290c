"""One play of the zero-bubble list scheduler: the pipeline run forward in time with given costs.

:mod:`ldt.schedule.zerobubble` decides which variants to play (cost models, W store sizes, fill
policies, chunk orders) and keeps the fastest; this module plays one. Its times are the
simulator's (:func:`ldt.schedule.simulate`): an action starts when its stage is free and its
input has arrived (sent at the producer's end). Each stage, when it is free, takes a backward
whose gradient has arrived unless its W store is full, else a forward whose activation has
arrived while its chunk holds fewer micro-batches than its cap, else a W (to make room for a
waiting backward, or to fill the wait for the next arrival, as ``fill`` says). No torch here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from math import inf
from typing import Optional

from ldt.schedule.ir import Action, Op, Schedule


@dataclass(frozen=True)
class Chunk:
    """One logical stage of the data flow: which stage runs it and with which ops."""

    index: int
    stage: int
    fwd: Op
    bwd: Op
    wgt: Op


def chunks_of(p: int, ushape: bool) -> list[Chunk]:
    """The chunks in data-flow order: one per stage, or the U-shape's start chunk on the edge,
    the cloud's stages, then the edge's end chunk."""
    if not ushape:
        return [Chunk(s, s, Op.F, Op.B, Op.W) for s in range(p)]
    cloud = [Chunk(s, s, Op.F, Op.B, Op.W) for s in range(1, p)]
    return [Chunk(0, 0, Op.FS, Op.BE, Op.WE), *cloud, Chunk(p, 0, Op.FE, Op.BS, Op.WS)]


class _Stage:
    """One stage during the play: its clock, its chunks and what it holds."""

    def __init__(self, chunks: list[Chunk], rank: dict) -> None:
        self.chunks = sorted(chunks, key=lambda c: (rank.get(c.bwd, 0), c.index))  # B order
        self.f_chunks = sorted(chunks, key=lambda c: (rank.get(c.fwd, 0), c.index))
        self.clock = 0.0  # free from (or, while idle, the time it looks again)
        self.idle_from: Optional[float] = None  # when it last ran out of work
        self.waiting = False  # idle with no arrival known: woken by the next message
        self.actions: list[Action] = []
        self.pending: deque = deque()  # the W store: (chunk, mb) in B order
        self.left = 0  # compute actions still to run
        self.peak = 0  # most micro-batches held at once (activations + W store)


def play(chunks: list[Chunk], p: int, m: int, price: dict, wire: dict, held_cap: list[int],
         wstore_cap: list[int], fill: tuple, order: tuple) -> tuple[Schedule, float, int]:
    """One list-scheduling play of the pipeline: (each stage's compute list, the time it
    ends, the most micro-batches a stage holds). ``order``: the ops whose chunk a stage with
    two chunks serves first; ``fill``: each stage's W policy (``"idle"`` or ``"fit"``)."""
    return _Play(chunks, p, m, price, wire, held_cap, wstore_cap, fill, order).run()


class _Play:
    """The play's state: per chunk the arrival times and the next micro-batches, per stage
    its clock and lists."""

    def __init__(self, chunks: list[Chunk], p: int, m: int, price: dict, wire: dict,
                 held_cap: list[int], wstore_cap: list[int], fill: tuple, order: tuple) -> None:
        n = len(chunks)
        self.chunks, self.p, self.m, self.n = chunks, p, m, n
        self.price, self.wire, self.fill = price, wire, fill
        self.held_cap, self.wstore_cap = held_cap, wstore_cap
        rank = {op: i for i, op in enumerate(order)}
        self.stages = [_Stage([c for c in chunks if c.stage == s], rank) for s in range(p)]
        for st in self.stages:
            st.left = 3 * m * len(st.chunks)
        # per chunk and micro-batch: when its activation arrives; when its gradient (or, at
        # the loss, its own forward) is done
        self.f_ready = [[0.0] * m if c.index == 0 else [inf] * m for c in chunks]
        self.b_ready = [[inf] * m for _ in chunks]
        self.next_f, self.next_b = [0] * n, [0] * n
        self.held = [0] * n  # forward run, backward not yet
        self.end_time = 0.0

    def run(self) -> tuple[Schedule, float, int]:
        while True:
            s = min(range(self.p), key=self._free)
            if self._free(s)[0] == inf:
                break
            self._step(s)
        stages = self.stages
        if any(st.left for st in stages):
            raise RuntimeError("zero-bubble play stopped with work left (a bug in the play: caps "
                               f"{self.held_cap}, W store {self.wstore_cap})")
        return ({s: st.actions for s, st in enumerate(stages)}, self.end_time,
                max(st.peak for st in stages))

    def _free(self, x: int) -> tuple:
        """(when stage ``x`` can act next, x): the earliest one acts first."""
        st = self.stages[x]
        return (st.clock if st.left and not st.waiting else inf, x)

    def _duration(self, c: Chunk, op: Op) -> float:
        return self.price[(c.stage, op.value)]

    def _step(self, s: int) -> None:
        """Stage ``s`` takes a backward, else a forward, else a W, else waits."""
        st = self.stages[s]
        t = st.clock
        b = self._ready_b(st, t)
        if b is not None and len(st.pending) < self.wstore_cap[s]:
            self._run(s, b, b.bwd, self.next_b[b.index], t)
            return
        f = self._ready_f(st, t)
        if f is not None:
            self._run(s, f, f.fwd, self.next_f[f.index], t)
            return
        if st.pending and (b is not None or self._w_fits(s, t)):
            # a W makes room for a backward the full W store holds back, or fills a wait
            c, mb = st.pending.popleft()
            self._run(s, c, c.wgt, mb, t)
            return
        self._idle(st, t)

    def _w_fits(self, s: int, t: float) -> bool:
        """Whether stage ``s``'s next W may fill the wait for its next arrival."""
        st = self.stages[s]
        wait = self._expected(st, t)
        w_time = self._duration(st.pending[0][0], st.pending[0][0].wgt)
        return self.fill[s] == "idle" or wait == inf or wait - t >= w_time

    def _idle(self, st: _Stage, t: float) -> None:
        """Nothing to run: look again at the next known arrival, or wait for a message."""
        wake = self._next_arrival(st, t)
        if st.idle_from is None:
            st.idle_from = t
        if wake < inf:
            st.clock = wake
        else:
            st.waiting = True

    def _ready_b(self, st: _Stage, t: float) -> Optional[Chunk]:
        for c in st.chunks:
            k = self.next_b[c.index]
            if k < self.m and self.b_ready[c.index][k] <= t:
                return c
        return None

    def _ready_f(self, st: _Stage, t: float) -> Optional[Chunk]:
        for c in st.f_chunks:
            i = c.index
            if self.next_f[i] < self.m and self.f_ready[i][self.next_f[i]] <= t \
                    and self.held[i] < self.held_cap[i]:
                return c
        return None

    def _next_arrival(self, st: _Stage, t: float) -> float:
        """The next known arrival the stage could act on (its wake-up time)."""
        m, next_b, next_f = self.m, self.next_b, self.next_f
        times = [self.b_ready[c.index][next_b[c.index]] for c in st.chunks if next_b[c.index] < m]
        times += [self.f_ready[c.index][next_f[c.index]] for c in st.chunks
                  if next_f[c.index] < m and self.held[c.index] < self.held_cap[c.index]]
        return min((x for x in times if x > t), default=inf)

    def _expected(self, st: _Stage, t: float) -> float:
        """The next arrival as far as it can be told now: a known one, or the earliest its
        producer could send it if that producer is not scheduled yet (one step back)."""
        times = []
        for c in st.chunks:
            i = c.index
            if self.next_b[i] < self.m:
                times.append(self._expected_b(c))
            if self.next_f[i] < self.m and self.held[i] < self.held_cap[i]:
                times.append(self._expected_f(c))
        return min((x for x in times if x > t), default=inf)

    def _expected_b(self, c: Chunk) -> float:
        i, k = c.index, self.next_b[c.index]
        known = self.b_ready[i][k]
        if known == inf and i + 1 < self.n:
            src = self.chunks[i + 1]
            known = max(self.stages[src.stage].clock, self.b_ready[i + 1][k]) + \
                self._duration(src, src.bwd) + self.wire.get((src.stage, c.stage), 0)
        return known

    def _expected_f(self, c: Chunk) -> float:
        i, k = c.index, self.next_f[c.index]
        known = self.f_ready[i][k]
        if known == inf and i > 0:
            src = self.chunks[i - 1]
            known = max(self.stages[src.stage].clock, self.f_ready[i - 1][k]) + \
                self._duration(src, src.fwd) + self.wire.get((src.stage, c.stage), 0)
        return known

    def _run(self, s: int, c: Chunk, op: Op, mb: int, t: float) -> None:
        """Stage ``s`` runs ``op`` of chunk ``c`` on micro-batch ``mb`` from ``t``."""
        st = self.stages[s]
        st.actions.append(Action(s, op, mb))
        st.idle_from, st.waiting = None, False
        st.left -= 1
        end = st.clock = t + self._duration(c, op)
        self.end_time = max(self.end_time, end)
        if op is c.fwd:
            self._forward_done(s, c, mb, end)
        elif op is c.bwd:
            self._backward_done(s, c, mb, end)
        st.peak = max(st.peak, sum(self.held[x.index] for x in st.chunks) + len(st.pending))

    def _forward_done(self, s: int, c: Chunk, mb: int, end: float) -> None:
        i = c.index
        self.next_f[i] += 1
        self.held[i] += 1
        if i + 1 < self.n:
            nxt = self.chunks[i + 1]
            self.f_ready[i + 1][mb] = end + self.wire.get((s, nxt.stage), 0)
            self._deliver(nxt.stage, self.f_ready[i + 1][mb])
        else:
            self.b_ready[i][mb] = end  # the loss: its backward may start at once

    def _backward_done(self, s: int, c: Chunk, mb: int, end: float) -> None:
        i = c.index
        self.next_b[i] += 1
        self.held[i] -= 1
        self.stages[s].pending.append((c, mb))
        if i > 0:
            prv = self.chunks[i - 1]
            self.b_ready[i - 1][mb] = end + self.wire.get((s, prv.stage), 0)
            self._deliver(prv.stage, self.b_ready[i - 1][mb])

    def _deliver(self, dst: int, when: float) -> None:
        """A message for ``dst`` arrives at ``when``: an idle ``dst`` looks again then."""
        st = self.stages[dst]
        if st.idle_from is not None and (st.waiting or when < st.clock):
            st.clock = max(st.idle_from, when)
            st.waiting = False
