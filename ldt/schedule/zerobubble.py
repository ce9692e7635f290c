"""Zero-bubble schedules from costs: ZB-H1 for a plain pipeline, and the zero-bubble U-shape.

A zero-bubble schedule (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR'24) splits each
backward into ``B``, the input's gradient that the previous stage waits for, and ``W``, the
weights' gradient that nobody waits for (:mod:`ldt.schedule.ir`: ``W``, and ``WS`` / ``WE`` on the
U-shape's edge). The B chain back through the pipeline gets shorter by every W, and the W's fill
the slots where a stage would otherwise wait: the warm-up and cool-down bubbles of 1F1B.

Published zero-bubble schedules assume equal stages and one link cost. Here the order comes
from the costs themselves, the way the paper's automatic scheduler (its section 3.1, without
the ILP) builds it: a list scheduler plays the pipeline forward in time with each stage's F, B
and W times and each boundary's transfer time, exactly as :func:`ldt.schedule.simulate` prices
them (``duration`` keyed ``(stage, op value)``, ``comm_time`` keyed ``(src, dst)``), and every
stage, when it is free, takes:

1. a backward whose gradient has arrived (the critical path), unless the W store is full;
2. else a forward whose activation has arrived, while the chunk holds fewer micro-batches than
   its cap;
3. else a W: when a backward waits for room in the W store, or to fill the wait for the next
   arrival (``fill="idle"``: whenever nothing else can run; ``fill="fit"``: only when the next
   known arrival is at least a W away);

forwards and backwards in micro-batch order per chunk, W's in their B's order (a queue per chunk,
as Transformer Engine's store is). A few variants of these choices are played and the one the
simulator times fastest is kept.

Memory, as the paper counts it: a forward leaves the activations its backward needs (``M_B``),
the backward frees them but leaves what the W needs (``M_W``: the linear layers' inputs and
output gradients, the W store), the W frees that. So there are two caps: ``max_held``, the
micro-batches whose activations a chunk holds (forward run, backward not yet: what
``SimResult.peak_inflight`` counts), by default exactly what the unsplit schedule holds
(1F1B's ``P - s``; the U-shape's per chunk), and ``max_wstore``, the W store's entries per stage
(backward run, W not yet: ``SimResult.peak_wstore``), by default ``P`` (plain) or ``P + 1``
(U-shape): as many as the stage holding most holds activations. ZB-H1 is the first cap at
1F1B's values; the W store comes on top, and ``M_W`` is smaller than ``M_B``.

Every stage acts at a time when what it consumes has been sent, so the lists are deadlock-free by
construction; :func:`~ldt.schedule.check.check_schedule` checks them anyway (tests: every P, m,
uneven costs). One play is :mod:`ldt.schedule.zerobubble_play`; this module chooses what to
play and keeps the best. No torch here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import product
from typing import Optional, Union

from ldt.schedule.generate import lower, one_f_one_b, u_shape
from ldt.schedule.ir import W_OF, Action, Op, Schedule, WEIGHT_OPS
from ldt.schedule.simulate import simulate
from ldt.schedule.zerobubble_play import Chunk, chunks_of, play

Costs = Mapping[tuple[int, str], float]
"""``(stage, op value) -> time`` of one micro-batch: the simulator's ``duration`` table."""
Comm = Mapping[tuple[int, int], float]
"""``(src stage, dst stage) -> time`` of one boundary tensor: the simulator's ``comm_time``."""
Cap = Union[int, Sequence[int], None]

FILLS = ("idle", "fit")


@dataclass(frozen=True)
class Priced:
    """A ``costs`` and a ``comm`` table, frozen: hashable, so a generated schedule can be
    cached by the prices it was generated from (``ldt.plan.zb_prices`` prices a run's plan)."""

    costs: tuple[tuple[tuple[int, str], float], ...]
    comm: tuple[tuple[tuple[int, int], float], ...]

    @classmethod
    def of(cls, costs: Costs, comm: Comm) -> "Priced":
        return cls(tuple(sorted(costs.items())), tuple(sorted(comm.items())))

    def tables(self) -> tuple[dict, dict]:
        """``(costs, comm)`` as :func:`zb_h1` and :func:`zb_u_shape` take them."""
        return dict(self.costs), dict(self.comm)


def zb_h1(num_stages: int, num_microbatches: int, costs: Optional[Costs] = None,
          comm: Optional[Comm] = None, max_held: Cap = None, max_wstore: Cap = None) -> Schedule:
    """Zero-bubble schedule of a plain pipeline (compute only; lower it with kind ``"1f1b"``).

    ``costs``: ``(stage, "F" | "B" | "W") -> time`` (default: all 1, the paper's equal case);
    ``comm``: ``(s, s + 1)`` and ``(s + 1, s) -> time`` (default 0). ``max_held``: micro-batches
    whose activations stage ``s`` may hold (one int for all, or one per stage; default 1F1B's
    ``P - s``: ZB-H1); ``max_wstore``: W store entries per stage (default ``P``)."""
    _require(num_stages >= 1 and num_microbatches >= 1,
             f"a zero-bubble schedule needs P >= 1 stages and m >= 1 micro-batches, got "
             f"P={num_stages}, m={num_microbatches}")
    p, m = num_stages, num_microbatches
    held = _caps(max_held, [p - s for s in range(p)], p, "max_held")
    return _best(p, m, False, costs, comm, held, _caps(max_wstore, [p] * p, p, "max_wstore"))


def zb_u_shape(num_stages: int, num_microbatches: int, costs: Optional[Costs] = None,
               comm: Optional[Comm] = None, max_held: Cap = None, max_wstore: Cap = None,
               prefetch: int = 0) -> Schedule:
    """Zero-bubble U-shape (compute only; lower it with kind ``"ushape"``): the edge (stage 0)
    runs the start chunk (FS, BE, WE) and the end chunk (FE, BS, WS), the cloud F, B, W.

    ``costs``: ``(0, "FS" | "FE" | "BS" | "BE" | "WS" | "WE")`` and ``(s, "F" | "B" | "W")``
    (default all 1); ``comm``: ``(0, 1), (1, 0), ..., (P - 1, 0), (0, P - 1) -> time``
    (default 0). ``max_held``: per logical chunk in data-flow order (start chunk, cloud stages
    1..P-1, end chunk: P + 1 values, or one int for all); default what the unsplit
    :func:`~ldt.schedule.generate.u_shape` holds: ``P + 1``, ``P - s + 1``, ``1``.
    ``max_wstore``: W store entries per stage (edge: both chunks together; default ``P + 1``).
    ``prefetch``: as :func:`~ldt.schedule.generate.u_shape`'s depth ``d``, the default
    ``max_held`` raised as its warm-up is (``2d`` on the start chunk, ``d`` on the cloud's), so
    forwards run ahead over slow edge links; lower the result with the same ``prefetch``."""
    _require(num_stages >= 2 and num_microbatches >= 1,
             f"the zero-bubble U-shape needs P >= 2 stages (edge + cloud) and m >= 1, got "
             f"P={num_stages}, m={num_microbatches}")
    _require(isinstance(prefetch, int) and prefetch >= 0,
             f"prefetch must be an integer >= 0, got {prefetch!r}")
    p, m, d = num_stages, num_microbatches, prefetch
    held = _caps(max_held, [p + 1 + 2 * d] + [p - s + 1 + d for s in range(1, p)] + [1], p + 1,
                 "max_held")
    return _best(p, m, True, costs, comm, held, _caps(max_wstore, [p + 1] * p, p, "max_wstore"))


def unsplit(costs: Costs) -> dict[tuple[int, str], float]:
    """The cost table of the same work without the split (B = B + W): what the unsplit
    schedules (:func:`~ldt.schedule.generate.one_f_one_b`,
    :func:`~ldt.schedule.generate.u_shape`) are timed with, for comparing them with a
    zero-bubble schedule on one workload."""
    out = {k: v for k, v in costs.items() if Op(k[1]) not in WEIGHT_OPS}
    for (stage, op), t in costs.items():
        if Op(op) in WEIGHT_OPS:
            key = (stage, WEIGHT_OPS[Op(op)].value)
            out[key] = out.get(key, 0) + t
    return out


def _caps(value: Cap, default: list[int], n: int, name: str) -> list[int]:
    if value is None:
        caps = default
    elif isinstance(value, int):
        caps = [value] * n
    else:
        caps = list(value)
    _require(len(caps) == n, f"{name} needs {n} values (one per chunk or stage), got {len(caps)}")
    _require(all(isinstance(c, int) and c >= 1 for c in caps),
             f"{name} must be integers >= 1 (a stage must hold one micro-batch), got {caps}")
    return caps


def _best(p: int, m: int, ushape: bool, costs: Optional[Costs], comm: Optional[Comm],
          held: list[int], wstore: list[int]) -> Schedule:
    """Play every variant of the choices and keep the fastest (then the one holding least)."""
    chunks = chunks_of(p, ushape)
    price = _price(chunks, costs)
    wire = _wire(p, ushape, comm)
    found = _Candidates(p, "ushape" if ushape else "1f1b", price, wire)
    unsplit_order = _unsplit_order(p, m, ushape, price, held, wstore)
    if unsplit_order is not None:
        found.add(unsplit_order)
    # The play is greedy: with the real costs it can trade the critical path for a W that
    # fits now. The same play with every stage's costs evened out (each op its mean over the
    # stages; and all 1, the paper's equal case) keeps the regular zero-bubble pattern, which
    # on uneven costs is often faster: each is played, then timed with the real costs.
    best_real = None
    for model in _cost_models(chunks, price, wire):
        for store, fill, order in _variants(chunks, p, ushape, held, wstore):
            score = found.add(play(chunks, p, m, model[0], model[1], held, store, fill, order)[0])
            if model[0] is price and (best_real is None or score < best_real[0]):
                best_real = (score, store, fill, order)
    # then, with the real costs, each stage's own fill policy, one stage at a time, while
    # that helps
    score, store, fill, order = best_real
    improved = True
    while improved:
        improved = False
        for s in range(p):
            flip = fill[:s] + (FILLS[1 - FILLS.index(fill[s])],) + fill[s + 1:]
            flipped = found.add(play(chunks, p, m, price, wire, held, store, flip, order)[0])
            if flipped < score:
                score, fill, improved = flipped, flip, True
    return found.best()


def _variants(chunks: list[Chunk], p: int, ushape: bool, held: list[int],
              wstore: list[int]) -> Iterator[tuple]:
    """(W store caps, fill policy per stage, chunk order) of every variant played."""
    orders = ([(Op.BS, Op.BE), (Op.BE, Op.BS)], [(Op.FE, Op.FS), (Op.FS, Op.FE)]) if ushape \
        else ([()], [()])
    # and a tighter W store: every stage holds at most one more micro-batch (activations or W
    # store) than the stage holding most activations, which is what ZB-H1 keeps
    per_stage = [sum(held[c.index] for c in chunks if c.stage == s) for s in range(p)]
    tight = [min(w, max(1, max(per_stage) - h + 1)) for w, h in zip(wstore, per_stage)]
    # the fill policy per stage: all alike, or the edge / first stage unlike the others
    fills = [(a,) + (b,) * (p - 1) for a in FILLS for b in FILLS]
    for store, fill, b_order, f_order in product(_unique([tight, wstore]), fills, *orders):
        yield store, fill, b_order + f_order


class _Candidates:
    """Every schedule played, each with its score: (iteration, most micro-batches a stage
    holds) as the simulator times it with the real costs (the play's own clock can only be
    later: it may idle before a W)."""

    def __init__(self, p: int, kind: str, price: dict, wire: dict) -> None:
        self.p, self.kind, self.price, self.wire = p, kind, price, wire
        self.seen: dict = {}
        self.played: list[tuple[tuple, Schedule]] = []

    def add(self, schedule: Schedule) -> tuple:
        """Time ``schedule`` (once per distinct list), keep it; returns its score."""
        key = tuple(tuple(a) for s in sorted(schedule) for a in schedule[s])
        if key not in self.seen:
            sim = simulate(lower(schedule, self.kind), self.price, self.wire)
            self.seen[key] = (sim.iteration_time, max(
                sim.peak_inflight[s] + sim.peak_inflight_end.get(s, 0)
                + sim.peak_wstore.get(s, 1) for s in range(self.p)))
        self.played.append((self.seen[key], schedule))
        return self.seen[key]

    def best(self) -> Schedule:
        """The first of the fastest (then holding least)."""
        return min(self.played, key=lambda c: c[0])[1]


def _cost_models(chunks: list[Chunk], price: dict, wire: dict) -> list[tuple[dict, dict]]:
    """The real prices, each op's mean over the chunks, and all equal (with no link cost)."""
    models = [(price, wire)]
    by_op: dict[str, list] = {}
    for c in chunks:
        for kind, op in (("f", c.fwd), ("b", c.bwd), ("w", c.wgt)):
            by_op.setdefault(kind, []).append(price[(c.stage, op.value)])
    mean = {k: sum(v) / len(v) for k, v in by_op.items()}
    even = {(c.stage, op.value): mean[kind] for c in chunks
            for kind, op in (("f", c.fwd), ("b", c.bwd), ("w", c.wgt))}
    if any(even[(c.stage, op.value)] != price[(c.stage, op.value)] for c in chunks
           for op in (c.fwd, c.bwd, c.wgt)):
        models.append((even, {k: sum(wire.values()) / max(len(wire), 1) for k in wire}))
    unit = {k: 1 for k in price}
    if unit != price:
        models.append((unit, {k: 0 for k in wire}))
    return models


def _unsplit_order(p: int, m: int, ushape: bool, price: dict, held: list[int],
                 wstore: list[int]) -> Optional[Schedule]:
    """The unsplit schedule with each W right after its backward: it times exactly as the
    unsplit schedule, so the one kept is never slower than that (None where it holds more
    than the caps allow)."""
    if ushape:
        cloud = [(price[(s, "B")] + price[(s, "W")]) / price[(s, "F")]
                 for s in range(1, p) if price[(s, "F")] > 0]
        ratio = sum(cloud) / len(cloud) if cloud else 2
        base = u_shape(p, m, backward_ratio=ratio if ratio > 0 else 2)
    else:
        base = one_f_one_b(p, m)
    out = {s: [x for a in acts for x in ([a, Action(s, W_OF[a.op], a.mb)] if a.op in W_OF
                                         else [a])] for s, acts in base.items()}
    counts = _held_peaks(out, chunks_of(p, ushape))
    return out if all(c <= cap for c, cap in zip(counts, held)) and min(wstore) >= 1 else None


def _held_peaks(schedule: Schedule, chunks: list[Chunk]) -> list[int]:
    """Per chunk, the most micro-batches between its forward and its backward."""
    peaks = []
    for c in chunks:
        held = top = 0
        for a in schedule[c.stage]:
            if a.op is c.fwd:
                held += 1
                top = max(top, held)
            elif a.op is c.bwd:
                held -= 1
        peaks.append(top)
    return peaks


def _unique(items: list) -> list:
    return [x for i, x in enumerate(items) if x not in items[:i]]


def _price(chunks: list[Chunk], costs: Optional[Costs]) -> dict[tuple[int, str], float]:
    needed = [(c.stage, op.value) for c in chunks for op in (c.fwd, c.bwd, c.wgt)]
    if costs is None:
        return {k: 1 for k in needed}
    missing = [k for k in needed if k not in costs]
    _require(not missing, f"costs has no time for {missing[:4]}{' ...' if len(missing) > 4 else ''}"
             "; give every (stage, op) of the schedule a time (W ops too: the weights' gradient)")
    bad = {k: costs[k] for k in needed if not costs[k] >= 0}
    _require(not bad, f"costs must be >= 0, got {bad}")
    return {k: costs[k] for k in needed}


def _wire(p: int, ushape: bool, comm: Optional[Comm]) -> dict[tuple[int, int], float]:
    pairs = [(s, s + 1) for s in range(p - 1)] + ([(p - 1, 0)] if ushape and p > 1 else [])
    links = [pair for a, b in pairs for pair in ((a, b), (b, a))]
    if comm is None:
        return {k: 0 for k in links}
    missing = [k for k in links if k not in comm]
    _require(not missing, f"comm has no time for the boundaries {missing}; give each direction "
             "of each boundary (src, dst) a time (0 for none)")
    return {k: comm[k] for k in links}


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
