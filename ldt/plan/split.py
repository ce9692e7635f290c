"""Contiguous layer split for a fixed, ordered list of stages.

Why a bottleneck search: in 1F1B the steady state runs at the pace of the slowest stage, so the
iteration is about ``sum(stage times) + (m-1) * max(stage time)``. For a threshold B every stage
can take at most ``floor((B - overhead) / per_layer_time)`` layers (and no more than its memory
allows); the smallest B whose capacities add up to the layer count is found by bisection, then the
layers are handed to the fastest stages first (which minimises the sum term at that B). A few
slightly larger B are tried too, since a looser bottleneck can buy a smaller sum when m is small.

Every plain stage and every cloud stage gets at least one decoder layer; the U-shape edge keeps
at least ``edge_min`` in each of its chunks (privacy: see Workload.edge_min_layers). The edge's
layers are split between its start chunk (kept alive for P+1 micro-batches) and its end chunk
(one micro-batch): half each when memory allows, else as many on the end chunk as needed.
"""

from __future__ import annotations

import heapq
from math import floor
from dataclasses import dataclass
from typing import Optional

from ldt.plan.cost import ChunkLoad, CostModel
from ldt.plan.evaluate import KEEPS_LEAST, StageSpec

EPS = 1e-9


@dataclass(frozen=True)
class Unit:
    """One stage as the split sees it: w(l) = overhead + l * per_layer, l in [lo, cap], for
    the ``runs`` micro-batches it runs in each one of a uniform replica (per-stage DP: a
    stage with d of D replicas runs D / d); one micro-batch takes w(l) / runs."""

    per_layer: float
    overhead: float
    lo: int
    cap: int
    runs: int = 1


def stage_units(stages: tuple[StageSpec, ...], ushape: bool, m: int, cost: CostModel,
                num_layers: int, edge_min: int = 1, memo: Optional[dict] = None,
                stage_dp: tuple[int, ...] = ()) -> list[Unit]:
    """The units of these stages; ``memo`` (one dict per cost model and model) keeps them across
    calls: the planner splits hundreds of orders of the same few (kind, TP, position)s.
    ``stage_dp`` (per-stage DP): a stage with ``d`` of the largest ``D`` replicas runs ``D /
    d`` micro-batches for each one of a uniform replica (its time counts that many times) and
    holds ``(P - s - 1) * D / d + 1`` in flight (:mod:`ldt.schedule.vdp`)."""
    p = len(stages)
    top = max(stage_dp, default=1)
    units = []
    for i, st in enumerate(stages):
        k = top // stage_dp[i] if stage_dp else 1
        key = (st, i, p, m, ushape, num_layers, edge_min, k)
        if memo is not None and key in memo:
            units.append(memo[key])
            continue
        lf, lb = cost.layer_time(st.kind, st.tp)
        edge = ushape and i == 0
        held = min((p + ushape - i - 1) * k + 1, m * k)
        # the chunks as the plan will hold them: a plain stage's layers, embedding and head in
        # one chunk (one transient), the edge's start and end chunks apart
        fixed = [ChunkLoad(0, embedding=i == 0, head=not ushape and i == p - 1,
                           inflight=held)]
        if edge:
            fixed.append(ChunkLoad(0, head=True, inflight=1))
        overhead = k * sum(sum(cost.chunk_time(st.kind, st.tp, c)) for c in fixed)
        inflight = 1 if edge else held  # edge: layers go to the end chunk first
        # with recomputation allowed, the layers cost what they cost fully recomputed (the
        # evaluation then recomputes only the stages that need it: evaluate.fit_recompute)
        rc = KEEPS_LEAST if cost.recompute else None
        cap = layers_that_fit(cost, st, fixed, len(fixed) - 1 if edge else 0, rc, num_layers)
        assert inflight == fixed[len(fixed) - 1 if edge else 0].inflight
        units.append(Unit(k * (lf + lb), overhead, 2 * edge_min if edge else 1, cap, k))
        if memo is not None:
            memo[key] = units[-1]
    return units


def layers_that_fit(cost: CostModel, stage: StageSpec, fixed: list[ChunkLoad], into: int,
                    recompute, most: int) -> int:
    """The most decoder layers (up to ``most``) chunk ``fixed[into]`` of a stage can take, with
    ``recompute``, within the stage's memory limit; -1 when ``fixed`` alone does not fit.
    Memory grows with the layers: the largest count is found by bisection."""
    limit = cost.memory_limit(stage.kind)

    def fits(n: int) -> bool:
        chunks = list(fixed)
        c = chunks[into]
        chunks[into] = ChunkLoad(n, c.embedding, c.head, c.inflight,
                                 recompute if n else None)
        return cost.stage_memory(stage.kind, stage.tp, chunks).total <= limit

    if not fits(0):
        return -1
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


Row = tuple[float, float, int, int, int]
"""A unit as the search reads it, ``(overhead, per_layer, cap, lo, runs)``: the planner splits
~1000 orders of ~20 stages at 1024 devices, and attribute reads were a third of the search."""


def _takes(rows: list[Row], bound: float) -> list[int]:
    """Most layers each unit can take with w(l) <= bound (may be < lo: infeasible)."""
    return [min(c, floor((bound - o) / p + EPS)) for o, p, c, _, _ in rows]


def _fits(rows: list[Row], bound: float, num_layers: int) -> bool:
    """Whether every unit reaches its minimum and together they hold all layers at ``bound``."""
    total = 0
    for o, p, c, lo, _ in rows:
        take = min(c, floor((bound - o) / p + EPS))
        if take < lo:
            return False
        total += take
    return total >= num_layers


def _fill(rows: list[Row], bound: float, num_layers: int,
          fastest_first: list[int]) -> Optional[list[int]]:
    """Minimum per unit, then the rest to the fastest units first, each up to its bound."""
    caps, layers, rest = [], [], num_layers
    for o, p, c, lo, _ in rows:
        take = floor((bound - o) / p + EPS)
        take = take if take < c else c
        if take < lo:
            return None
        caps.append(take)
        layers.append(lo)
        rest -= lo
    if rest < 0:
        return None
    for i in fastest_first:
        if rest == 0:
            break
        add = min(rest, caps[i] - layers[i])
        layers[i] += add
        rest -= add
    return layers if rest == 0 else None


def _cost(rows: list[Row], layers: list[int], m: int) -> float:
    """One micro-batch through every stage, then m - 1 rounds at the slowest stage's pace."""
    w = [o + n * p for (o, p, _, _, _), n in zip(rows, layers)]
    return sum(x / r for x, (_, _, _, _, r) in zip(w, rows)) + (m - 1) * max(w)


def objective(units: list[Unit], layers: list[int], m: int) -> float:
    return _cost(_rows(units), layers, m)


def _rows(units: list[Unit]) -> list[Row]:
    return [(u.overhead, u.per_layer, u.cap, u.lo, u.runs) for u in units]


def _candidates(row: Row, num_layers: int) -> range:
    """The layer counts whose times are candidate bottlenecks."""
    return range(row[3], min(row[2], num_layers) + 1)


def _first_bound(rows: list[Row], num_layers: int) -> Optional[float]:
    """The smallest bottleneck that holds every layer: each unit's time at some layer count, so
    the smallest such value where :func:`_fits` holds (it only grows with the bound). Picked
    directly, then checked against :func:`_fits` and its predecessor among those values; the
    bisection over all of them is the fallback when rounding makes the two disagree."""
    bound = _pick_bound(rows, num_layers)
    if bound is not None and _fits(rows, bound, num_layers):
        below = max((o + k * p for (o, p, _, _, _), k in
                     ((r, _last_below(r, bound, num_layers)) for r in rows) if k is not None),
                    default=None)
        if below is None or not _fits(rows, below, num_layers):
            return bound
    bounds = sorted({r[0] + k * r[1] for r in rows for k in _candidates(r, num_layers)})
    lo, hi = 0, len(bounds) - 1
    if not _fits(rows, bounds[hi], num_layers):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(rows, bounds[mid], num_layers):
            hi = mid
        else:
            lo = mid + 1
    return bounds[lo]


def _pick_bound(rows: list[Row], num_layers: int) -> Optional[float]:
    """Every unit at its minimum sets a floor; the layers still to place go one by one to
    whichever unit's next layer costs the least time (a heap of each unit's next time): the
    time of the last one placed, or the floor."""
    floor_time = max(o + lo * p for o, p, _, lo, _ in rows)
    left = num_layers - sum(r[3] for r in rows)
    heap = []
    for j, r in enumerate(rows):
        o, p = r[0], r[1]
        for k in _candidates(r, num_layers)[1:]:
            if o + k * p > floor_time:
                heap.append((o + k * p, j, k))
                break
            left -= 1  # at or below the floor: free
    if left <= 0:
        return floor_time
    heapq.heapify(heap)
    while heap:
        bound, j, k = heapq.heappop(heap)
        left -= 1
        if left == 0:
            return bound
        o, p, c, _, _ = rows[j]
        if k < min(c, num_layers):
            heapq.heappush(heap, (o + (k + 1) * p, j, k + 1))
    return None


def _last_below(row: Row, bound: float, num_layers: int) -> Optional[int]:
    """The largest candidate layer count of ``row`` whose time is below ``bound``."""
    o, p, _, lo, _ = row
    top = _candidates(row, num_layers)[-1]
    k = min(top, floor((bound - o) / p))
    while k >= lo and o + k * p >= bound:
        k -= 1
    while k < top and o + (k + 1) * p < bound:
        k += 1
    return k if k >= lo else None


def best_counts(units: list[Unit], num_layers: int, m: int, tries: int = 4) -> Optional[list[int]]:
    """Layers per unit minimising :func:`objective`: the smallest bottleneck that holds every
    layer, then fill; a few looser bottlenecks too."""
    if (any(u.cap < u.lo for u in units) or sum(max(u.cap, 0) for u in units) < num_layers
            or sum(u.lo for u in units) > num_layers):
        return None
    rows = _rows(units)
    first = _first_bound(rows, num_layers)
    if first is None:
        return None
    fastest_first = sorted(range(len(units)), key=lambda i: units[i].per_layer)
    best = _fill(rows, first, num_layers, fastest_first)
    bound = max(o + n * p for (o, p, _, _, _), n in zip(rows, best))
    steps = sorted({o + (take + 1) * p for (o, p, c, _, _), take in zip(rows, _takes(rows, bound))
                    if take < c})
    for b in steps[:tries]:
        cand = _fill(rows, b, num_layers, fastest_first)
        if cand is not None and _cost(rows, cand, m) < _cost(rows, best, m):
            best = cand
    return best


def edge_chunks(stage: StageSpec, total: int, num_stages: int, m: int, cost: CostModel,
                edge_min: int = 1) -> int:
    """Layers of the edge's start chunk: half of ``total`` if memory allows, else fewer (its
    chunks hold the model's first and last layers)."""
    rc = KEEPS_LEAST if cost.recompute else None
    last = cost.model.num_layers
    for start in range(total // 2, edge_min - 1, -1):
        end = total - start
        chunks = [ChunkLoad(start, embedding=True, inflight=min(num_stages + 1, m), recompute=rc,
                            moe_layers=cost.moe_count(0, start)),
                  ChunkLoad(end, head=True, inflight=1, recompute=rc,
                            moe_layers=cost.moe_count(last - end, end))]
        if cost.stage_memory(stage.kind, stage.tp, chunks).total <= cost.memory_limit(stage.kind):
            return start
    return edge_min


def best_split(stages: tuple[StageSpec, ...], ushape: bool, m: int, cost: CostModel,
               num_layers: int, edge_min: int = 1, memo: Optional[dict] = None,
               stage_dp: tuple[int, ...] = ()) -> Optional[tuple[int, ...]]:
    """Layout segment sizes (P, or P+1 for the U-shape) for these stages, or None if none fits.
    The edge keeps at least ``edge_min`` decoder layers in each of its two chunks; ``memo``,
    ``stage_dp``: see :func:`stage_units`."""
    units = stage_units(stages, ushape, m, cost, num_layers, edge_min, memo, stage_dp)
    counts = best_counts(units, num_layers, m)
    if counts is None:
        return None
    if not ushape:
        return tuple(counts)
    start = edge_chunks(stages[0], counts[0], len(stages), m, cost, edge_min)
    return (start, *counts[1:], counts[0] - start)
