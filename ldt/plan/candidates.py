"""Stage formation: which stages (kind, TP) one replica gets, scored by a quick estimate.

Why it scales: for a fixed number of stages of a kind, only a couple of TP sizes are worth
trying (the fastest per layer, and the largest, which needs the least memory per layer), plus one
"remainder" variant that turns leftover devices into one more, smaller stage. The per-kind option
lists are combined with numpy and scored by a continuous bound on the balanced pipeline,

    estimate = (m - 1 + logical stages) * L / (sum of stage speeds in layers/s) + dp all-reduce,

so thousands of combinations per dp size cost milliseconds. Only the best few go on to the exact
layer split and the simulator (:mod:`ldt.plan.planner`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from ldt.config import ConfigError
from ldt.plan.cost import CostModel, ring_allreduce_time
from ldt.plan.inventory import valid_tp_sizes

Group = tuple[tuple[int, int], ...]
"""Stages of one kind: ((tp, how many stages), ...), larger TP first."""

MAX_PRODUCT = 400_000


@dataclass(frozen=True)
class StageSet:
    """Stages of one replica before ordering: per kind its group; the edge kind is listed first."""

    dp: int
    num_microbatches: int
    groups: tuple[tuple[str, Group], ...]
    estimate: float

    @property
    def num_stages(self) -> int:
        return sum(n for _, g in self.groups for _, n in g)


def kind_options(cost: CostModel, kind: str, devices: int, max_stages: int,
                 edge: bool = False) -> list[Group]:
    """Candidate groups of stages for ``devices`` devices of one kind (one replica's share)."""
    k = cost.inventory.kind(kind)
    tps = [t for t in valid_tp_sizes(cost.model, k.node_size) if t <= devices]
    if edge:
        return [((t, 1),) for t in tps]
    speed = {t: sum(cost.layer_time(kind, t)) for t in tps}
    out: list[Group] = [()]
    for s in range(1, min(devices, max_stages) + 1):
        fit = [t for t in tps if s * t <= devices]
        if not fit:
            break
        for t in {min(fit, key=speed.__getitem__), max(fit)}:
            out.append(((t, s),))
            rest = [u for u in tps if u <= devices - s * t]
            if rest and s < max_stages:
                u = max(rest)
                out.append(((t, s), (u, 1)) if u < t else ((u, 1), (t, s)) if u > t else ((t, s + 1),))
    return list(dict.fromkeys(out))


def _thin(options: list[Group], keep: int) -> list[Group]:
    """Every n-th option (always the empty one and the largest), to bound the product."""
    if len(options) <= keep:
        return options
    step = len(options) / keep
    picked = {0, len(options) - 1} | {int(i * step) for i in range(keep)}
    return [options[i] for i in sorted(picked)]


def stage_sets(cost: CostModel, ushape: bool, global_batch: int, num_layers: int,
               max_stages: int | None = None) -> list[StageSet]:
    """Every (dp, per-kind group) combination worth splitting, best estimate first."""
    inv, b = cost.inventory, cost.b
    if ushape and inv.edge is None:
        raise ConfigError(f"u_shape planning needs inventory.edge (a kind name) in {inv.name!r}; "
                          "set edge: <kind> or plan a plain pipeline")
    kinds = [k.name for k in inv.kinds if not (ushape and k.name == inv.edge)]
    if ushape:
        kinds = [inv.edge] + kinds
    limit = min(max_stages or num_layers + ushape, num_layers + ushape)
    out: list[StageSet] = []
    for dp in range(1, inv.total_devices + 1):
        if (global_batch // b) % dp:
            continue
        m = global_batch // (b * dp)
        per = {name: inv.kind(name).count // dp for name in kinds}
        if ushape and per[inv.edge] < 1:
            break
        opts = [kind_options(cost, name, per[name], limit, edge=ushape and i == 0)
                for i, name in enumerate(kinds)]
        keep = max(4, int(MAX_PRODUCT ** (1 / len(opts))))
        while np.prod([len(o) for o in opts], dtype=float) > MAX_PRODUCT:
            opts = [_thin(o, keep) for o in opts]
            keep = max(2, keep * 3 // 4)
        out += _score(cost, kinds, opts, dp, m, ushape, num_layers, limit)
    out.sort(key=lambda s: s.estimate)
    return out


def _score(cost: CostModel, kinds: list[str], opts: list[list[Group]], dp: int, m: int,
           ushape: bool, num_layers: int, limit: int) -> list[StageSet]:
    """Vectorised estimate over the product of per-kind options."""
    stages = [np.array([sum(n for _, n in g) for g in o]) for o in opts]
    speed = [np.array([sum(n / sum(cost.layer_time(name, t)) for t, n in g) for g in o])
             for name, o in zip(kinds, opts)]
    devs = [np.array([sum(n * t for t, n in g) for g in o]) for o in opts]
    grids = np.meshgrid(*[np.arange(len(o)) for o in opts], indexing="ij")
    idx = [g.ravel() for g in grids]
    p = sum(s[i] for s, i in zip(stages, idx))
    v = sum(s[i] for s, i in zip(speed, idx))
    d = sum(s[i] for s, i in zip(devs, idx))
    ok = (p >= (2 if ushape else 1)) & (p <= limit)
    if ushape:
        ok &= (p - 1) <= num_layers
    params = num_layers * cost.layer_params(1) + cost.embedding_params(1) + cost.head_params(1)
    bw = min(cost.inventory.link(k, k).bandwidth_gbps for k in kinds)
    ar = ring_allreduce_time(params * cost.d, dp, bw)  # whole model; each rank holds ~1/d of it
    est = (m - 1 + p + ushape) * num_layers / np.where(v > 0, v, 1) + ar / np.maximum(d, 1)
    out = []
    for j in np.flatnonzero(ok):
        groups = tuple((name, opts[k][idx[k][j]]) for k, name in enumerate(kinds)
                       if opts[k][idx[k][j]])
        out.append(StageSet(dp, m, groups, float(est[j])))
    return out


def orders(stage_set: StageSet, ushape: bool) -> list[tuple[tuple[str, int], ...]]:
    """Stage sequences (kind, tp) to try: kinds in contiguous blocks, in every order of the blocks
    (the U-shape's edge block stays first); inside a block of two TP sizes, both orders. Order
    matters beyond speed: the first stage holds E and the most in-flight micro-batches, the last
    one holds the head (as costly as a layer for large vocabularies), and links differ."""
    variants = []
    for name, group in stage_set.groups:
        runs = [[(name, t)] * n for t, n in group]
        options = {tuple(x for run in perm for x in run) for perm in itertools.permutations(runs)}
        variants.append(sorted(options, reverse=True))
    head, rest = (variants[:1], variants[1:]) if ushape else ([], variants)
    seen: dict[tuple, None] = {}
    for perm in itertools.permutations(rest):
        for pick in itertools.product(*(head + list(perm))):
            seen[tuple(x for block in pick for x in block)] = None
    return list(seen)
