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

import math
from dataclasses import dataclass
from typing import Optional

from ldt.plan.cost import ChunkLoad, CostModel
from ldt.plan.evaluate import StageSpec, recompute_levels

EPS = 1e-9


@dataclass(frozen=True)
class Unit:
    """One stage as the split sees it: w(l) = overhead + l * per_layer, l in [lo, cap]."""

    per_layer: float
    overhead: float
    lo: int
    cap: int


def stage_units(stages: tuple[StageSpec, ...], ushape: bool, m: int, cost: CostModel,
                num_layers: int, edge_min: int = 1, memo: Optional[dict] = None) -> list[Unit]:
    """The units of these stages; ``memo`` (one dict per cost model and model) keeps them across
    calls: the planner splits hundreds of orders of the same few (kind, TP, position)s."""
    p = len(stages)
    units = []
    for i, st in enumerate(stages):
        key = (st, i, p, m, ushape, num_layers, edge_min)
        if memo is not None and key in memo:
            units.append(memo[key])
            continue
        lf, lb = cost.layer_time(st.kind, st.tp)
        edge = ushape and i == 0
        fixed = [ChunkLoad(0, embedding=i == 0, inflight=min(p + ushape - i, m))]
        if edge or (not ushape and i == p - 1):
            fixed.append(ChunkLoad(0, head=True, inflight=1))
        overhead = sum(sum(cost.chunk_time(st.kind, st.tp, c)) for c in fixed)
        inflight = 1 if edge else min(p + ushape - i, m)  # edge: layers go to the end chunk first
        room = cost.memory_limit(st.kind) - cost.stage_memory(st.tp, fixed).total
        # with recomputation allowed, a layer costs what it costs fully recomputed (the
        # evaluation then recomputes only the stages that need it: evaluate.fit_recompute)
        rc = recompute_levels(cost)[-1] if cost.recompute else None
        per = cost.stage_memory(st.tp, [ChunkLoad(1, inflight=inflight, recompute=rc)]).total
        cap = -1 if room < 0 else min(num_layers, int(room // per))
        units.append(Unit(lf + lb, overhead, 2 * edge_min if edge else 1, cap))
        if memo is not None:
            memo[key] = units[-1]
    return units


def _take(u: Unit, bound: float) -> int:
    """Most layers unit u can take with w(l) <= bound (may be < u.lo: infeasible)."""
    return min(u.cap, math.floor((bound - u.overhead) / u.per_layer + EPS))


def _fill(units: list[Unit], bound: float, num_layers: int,
          fastest_first: list[int]) -> Optional[list[int]]:
    """Minimum per unit, then the rest to the fastest units first, each up to its bound."""
    caps = [_take(u, bound) for u in units]
    if any(c < u.lo for c, u in zip(caps, units)):
        return None
    layers = [u.lo for u in units]
    rest = num_layers - sum(layers)
    if rest < 0:
        return None
    for i in fastest_first:
        add = min(rest, caps[i] - layers[i])
        layers[i] += add
        rest -= add
    return layers if rest == 0 else None


def _fits(units: list[Unit], bound: float, num_layers: int) -> bool:
    """Whether every unit reaches its minimum and together they hold all layers at ``bound``."""
    total = 0
    for u in units:
        take = _take(u, bound)
        if take < u.lo:
            return False
        total += take
    return total >= num_layers


def objective(units: list[Unit], layers: list[int], m: int) -> float:
    w = [u.overhead + n * u.per_layer for u, n in zip(units, layers)]
    return sum(w) + (m - 1) * max(w)


def best_counts(units: list[Unit], num_layers: int, m: int, tries: int = 4) -> Optional[list[int]]:
    """Layers per unit minimising :func:`objective`: the smallest bottleneck that holds every
    layer, then fill; a few looser bottlenecks too. The bottleneck is some unit's time at some
    layer count, so a binary search over those values finds it exactly."""
    if (any(u.cap < u.lo for u in units) or sum(max(u.cap, 0) for u in units) < num_layers
            or sum(u.lo for u in units) > num_layers):
        return None
    bounds = sorted({u.overhead + k * u.per_layer for u in units
                     for k in range(u.lo, min(u.cap, num_layers) + 1)})
    lo, hi = 0, len(bounds) - 1
    if not _fits(units, bounds[hi], num_layers):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(units, bounds[mid], num_layers):
            hi = mid
        else:
            lo = mid + 1
    fastest_first = sorted(range(len(units)), key=lambda i: units[i].per_layer)
    best = _fill(units, bounds[lo], num_layers, fastest_first)
    bound = max(u.overhead + n * u.per_layer for u, n in zip(units, best))
    steps = sorted({u.overhead + (_take(u, bound) + 1) * u.per_layer for u in units
                    if _take(u, bound) < u.cap})
    for b in steps[:tries]:
        cand = _fill(units, b, num_layers, fastest_first)
        if cand is not None and objective(units, cand, m) < objective(units, best, m):
            best = cand
    return best


def edge_chunks(stage: StageSpec, total: int, num_stages: int, m: int, cost: CostModel,
                edge_min: int = 1) -> int:
    """Layers of the edge's start chunk: half of ``total`` if memory allows, else fewer."""
    rc = recompute_levels(cost)[-1] if cost.recompute else None
    for start in range(total // 2, edge_min - 1, -1):
        chunks = [ChunkLoad(start, embedding=True, inflight=min(num_stages + 1, m), recompute=rc),
                  ChunkLoad(total - start, head=True, inflight=1, recompute=rc)]
        if cost.stage_memory(stage.tp, chunks).total <= cost.memory_limit(stage.kind):
            return start
    return edge_min


def best_split(stages: tuple[StageSpec, ...], ushape: bool, m: int, cost: CostModel,
               num_layers: int, edge_min: int = 1, memo: Optional[dict] = None
               ) -> Optional[tuple[int, ...]]:
    """Layout segment sizes (P, or P+1 for the U-shape) for these stages, or None if none fits.
    The edge keeps at least ``edge_min`` decoder layers in each of its two chunks; ``memo``: see
    :func:`stage_units`."""
    units = stage_units(stages, ushape, m, cost, num_layers, edge_min, memo)
    counts = best_counts(units, num_layers, m)
    if counts is None:
        return None
    if not ushape:
        return tuple(counts)
    start = edge_chunks(stages[0], counts[0], len(stages), m, cost, edge_min)
    return (start, *counts[1:], counts[0] - start)
