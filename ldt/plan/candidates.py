"""Stage formation: which stages (kind, TP) one replica gets, scored by a quick estimate.

Why it scales: per kind, the options are "s stages at TP t" for every (s, t) that fits the
kind's share of devices (fewer devices than the share is how cheaper plans are met), plus, for
the fastest, the smallest and the largest TP of each s, a "remainder" variant that turns the
leftover devices into one more stage of the largest TP they hold (the fastest plans use
everything; without the smallest TP's variant the planner missed the best plan of a 6-device
instance by 0.07% once boundary messages could fan out). Options that cannot hold the
model in memory even with one micro-batch in flight are dropped. The per-kind option lists are
combined with numpy and scored by a continuous estimate of the balanced pipeline,

    plain:   (m - 1 + P) * L / V                                  + dp all-reduce
    U-shape: (m + P) * B, B the smallest bottleneck when the edge  + dp all-reduce
             runs its embedding and head (time o) plus at least 2 * edge_min layers

(V: the stages' summed speed in layers/s; without o a U-shape whose edge is the bottleneck
looked faster the more cloud devices it had, and could not tell a plan using half of them
from one using all). Each set also carries its devices and hourly price, so thousands of
combinations per dp size cost milliseconds and the planner (:mod:`ldt.plan.planner`) can take
the best few by estimated time, by estimated cost and from the front between them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from ldt.config import ConfigError
from ldt.plan.cost import ChunkLoad, CostModel, ring_allreduce_time
from ldt.plan.evaluate import KEEPS_LEAST, StageSpec
from ldt.plan.inventory import valid_tp_sizes
from ldt.plan.split import layers_that_fit

Group = tuple[tuple[int, int], ...]
"""Stages of one kind: ((tp, how many stages), ...), larger TP first."""

MAX_PRODUCT = 400_000
KEEP_PER_DP = 256
"""Sets per dp size kept by estimated time, and as many by estimated cost; plus the estimated
front of the two (thinned to as many)."""


@dataclass(frozen=True)
class StageSet:
    """Stages of one replica before ordering: per kind its group; the edge kind is listed first."""

    dp: int
    num_microbatches: int
    groups: tuple[tuple[str, Group], ...]
    estimate: float
    devices: int = 0
    """Devices of all ``dp`` replicas."""
    hourly_price: float = 0.0
    """Their price per hour (``Inventory.price``)."""
    kind_dp: tuple[int, ...] = ()
    """Per-stage DP: the replicas of each group's stages (``groups``' order), each dividing
    ``dp``, the largest; empty: every stage has ``dp``."""

    def dp_of_kind(self, kind: str) -> int:
        if not self.kind_dp:
            return self.dp
        return dict(zip((name for name, _ in self.groups), self.kind_dp))[kind]

    @property
    def num_stages(self) -> int:
        return sum(n for _, g in self.groups for _, n in g)

    @property
    def estimated_cost(self) -> float:
        return self.estimate * self.hourly_price


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
        out += [((t, s),) for t in sorted(fit, reverse=True)]
        for t in {min(fit, key=speed.__getitem__), min(fit), max(fit)}:
            rest = [u for u in tps if u <= devices - s * t]
            if rest and s < max_stages:
                u = max(rest)
                out.append(((t, s), (u, 1)) if u < t else ((u, 1), (t, s)) if u > t else ((t, s + 1),))
    return list(dict.fromkeys(out))


def _layer_capacity(cost: CostModel, kind: str, tp: int, fixed: list[ChunkLoad]) -> int:
    """Decoder layers one stage can hold next to ``fixed`` with a single micro-batch in flight:
    an optimistic bound (the split's real caps count the schedule's in-flight micro-batches)."""
    # with recomputation allowed, a layer costs what it costs fully recomputed (as in the split)
    rc = KEEPS_LEAST if cost.recompute else None
    chunks = list(fixed) or [ChunkLoad(0)]
    return layers_that_fit(cost, StageSpec(kind, tp), chunks, len(chunks) - 1, rc,
                           cost.model.num_layers)


def _thin(options: list[Group], keep: int) -> list[Group]:
    """Every n-th option (always the empty one and the largest), to bound the product."""
    if len(options) <= keep:
        return options
    step = len(options) / keep
    picked = {0, len(options) - 1} | {int(i * step) for i in range(keep)}
    return [options[i] for i in sorted(picked)]


def stage_sets(cost: CostModel, ushape: bool, global_batch: int, num_layers: int,
               max_stages: int | None = None, edge_min: int = 1,
               per_stage_dp: bool = True) -> tuple[list[StageSet], int]:
    """(dp, per-kind group) combinations worth splitting, best estimate first: per dp size the
    best by estimated time, the best by estimated cost and the estimated front between; and how
    many combinations were scored. ``per_stage_dp``: kinds may run fewer replicas than dp."""
    inv, b = cost.inventory, cost.b
    if ushape and inv.edge is None:
        raise ConfigError(f"u_shape planning needs inventory.edge (a kind name) in {inv.name!r}; "
                          "set edge: <kind> or plan a plain pipeline")
    kinds = [k.name for k in inv.kinds if not (ushape and k.name == inv.edge)]
    if ushape:
        kinds = [inv.edge] + kinds
    limit = min(max_stages or num_layers + ushape, num_layers + ushape)
    out: list[StageSet] = []
    scored = 0
    for dp in range(1, inv.total_devices + 1):
        if (global_batch // b) % dp:
            continue
        m = global_batch // (b * dp)
        mixes = (_replica_shares(dp, len(kinds))
                 if per_stage_dp and inv.total_devices <= SHARED_UP_TO else [(1,) * len(kinds)])
        for shares in mixes:
            kind_dp = [dp // r for r in shares]
            per = {name: inv.kind(name).count // d for name, d in zip(kinds, kind_dp)}
            if ushape and per[inv.edge] < 1:
                continue
            opts = [kind_options(cost, name, per[name], limit, edge=ushape and i == 0)
                    for i, name in enumerate(kinds)]
            caps = [_capacities(cost, name, o, ushape and i == 0, edge_min)
                    for i, (name, o) in enumerate(zip(kinds, opts))]
            opts = [[g for g, c in zip(o, cap) if c >= 0] for o, cap in zip(opts, caps)]
            keep = max(4, int(MAX_PRODUCT ** (1 / len(opts))))
            while np.prod([len(o) for o in opts], dtype=float) > MAX_PRODUCT:
                opts = [_thin(o, keep) for o in opts]
                keep = max(2, keep * 3 // 4)
            kept, n = _score(cost, kinds, opts, dp, m, ushape, num_layers, limit, edge_min,
                             kind_dp)
            out += kept
            scored += n
    out = list(dict.fromkeys(out))  # a kind with no stage has every share: one set
    out.sort(key=lambda s: s.estimate)
    return out, scored


SHARES = (1, 2, 3, 4)
"""Per-stage DP in stage formation: a kind's stages may have ``dp / r`` replicas for these
``r`` (one kind at ``dp``): a kind that is fast per device serves the other kinds' replicas
in turn (docs/vdp.md), and a slow one runs as more replicas of smaller TP."""
SHARED_UP_TO = 64
"""Per-stage DP is tried in stage formation on inventories of up to this many devices; past
it only uniform dp is (the combinations multiply the sets scored), and the U-shape's step 6
tries more cloud replicas."""


def _replica_shares(dp: int, kinds: int) -> list[tuple[int, ...]]:
    """Per kind, the share ``r`` of the replicas its stages have (``dp / r``): all 1 (uniform
    dp), and every mix of :data:`SHARES` dividing ``dp`` with some kind at 1."""
    rs = [r for r in SHARES if dp % r == 0]
    return [c for c in itertools.product(rs, repeat=kinds) if min(c) == 1]


def _capacities(cost: CostModel, kind: str, options: list[Group], edge: bool,
                edge_min: int) -> list[int]:
    """Optimistic layer capacity of each option (-1: some stage holds no layer at all; the
    edge: its embedding, head and 2 * edge_min layers do not fit)."""
    per_tp: dict[int, int] = {}
    out = []
    for group in options:
        total = 0
        for t, n in group:
            if t not in per_tp:
                fixed = ([ChunkLoad(0, embedding=True), ChunkLoad(0, head=True)] if edge
                         else [])
                per_tp[t] = _layer_capacity(cost, kind, t, fixed)
            least = 2 * edge_min if edge else 1
            total = -1 if per_tp[t] < least or total < 0 else total + n * per_tp[t]
        out.append(total)
    return out


def _score(cost: CostModel, kinds: list[str], opts: list[list[Group]], dp: int, m: int,
           ushape: bool, num_layers: int, limit: int, edge_min: int,
           kind_dp: list[int] | None = None) -> tuple[list[StageSet], int]:
    """Vectorised estimate over the product of per-kind options; the kept sets as objects, and
    how many were valid. ``kind_dp``: each kind's replicas (default ``dp``): a stage with
    ``d`` of ``dp`` replicas runs ``dp / d`` micro-batches for each one of the uniform
    replica, so its speed counts ``d / dp`` times; a set must have a stage at ``dp``."""
    inv = cost.inventory
    kind_dp = kind_dp or [dp] * len(kinds)
    stages = [np.array([sum(n for _, n in g) for g in o]) for o in opts]
    speed = [np.array([sum(n / sum(cost.layer_time(name, t)) for t, n in g) for g in o])
             * (d / dp) for name, o, d in zip(kinds, opts, kind_dp)]
    devs = [np.array([sum(n * t for t, n in g) for g in o]) * d / dp
            for o, d in zip(opts, kind_dp)]
    price = [d * inv.price(name) for d, name in zip(devs, kinds)]
    at_top = [s if d == dp else 0 * s for s, d in zip(stages, kind_dp)]
    capacity = [np.array(_capacities(cost, name, o, ushape and i == 0, edge_min))
                for i, (name, o) in enumerate(zip(kinds, opts))]
    grids = np.meshgrid(*[np.arange(len(o)) for o in opts], indexing="ij")
    idx = [g.ravel() for g in grids]
    p = sum(s[i] for s, i in zip(stages, idx))
    v = sum(s[i] for s, i in zip(speed, idx))
    d = sum(s[i] for s, i in zip(devs, idx))
    hourly = dp * sum(s[i] for s, i in zip(price, idx))
    ok = (p >= (2 if ushape else 1)) & (p <= limit)
    ok &= sum(s[i] for s, i in zip(at_top, idx)) > 0
    ok &= sum(c[i] for c, i in zip(capacity, idx)) >= num_layers
    if ushape:
        ok &= (p - 1) <= num_layers
    params = num_layers * cost.layer_params(1) + cost.embedding_params(1) + cost.head_params(1)
    bw = min(cost.inventory.link(k, k).bandwidth_gbps for k in kinds)
    ar = ring_allreduce_time(params * cost.d, dp, bw)  # whole model; each rank holds ~1/d of it
    if ushape:
        bottleneck = _edge_bound(cost, kinds[0], opts[0], idx[0], v - speed[0][idx[0]],
                                 num_layers, 2 * edge_min)
    else:
        bottleneck = num_layers / np.where(v > 0, v, 1)
    # fill and drain: one micro-batch through every stage, a stage with d of dp replicas
    # taking d / dp of a round (it runs dp / d micro-batches in each)
    fill = sum(s[i] * (k / dp) for s, i, k in zip(stages, idx, kind_dp))
    est = (m - 1 + fill + ushape) * bottleneck + ar / np.maximum(d, 1)
    rows = np.flatnonzero(ok)
    out = []
    for j in rows[_keep(est[rows], est[rows] * hourly[rows], KEEP_PER_DP)]:
        groups = tuple((name, opts[k][idx[k][j]]) for k, name in enumerate(kinds)
                       if opts[k][idx[k][j]])
        shared = tuple(kind_dp[k] for k in range(len(kinds)) if opts[k][idx[k][j]])
        out.append(StageSet(dp, m, groups, float(est[j]), int(round(dp * d[j])),
                            float(hourly[j]), shared if len(set(shared)) > 1 else ()))
    return out, len(rows)


def _edge_bound(cost: CostModel, edge: str, options: list[Group], pick: np.ndarray,
                cloud_speed: np.ndarray, num_layers: int, least: int) -> np.ndarray:
    """The smallest bottleneck B of a U-shape (continuous): the edge runs its embedding and
    head (o seconds) and at least ``least`` layers at p s/layer, the cloud the rest at its
    speed; balanced, the edge takes (B - o) / p layers and the cloud B * cloud_speed."""
    tps = [group[0][0] for group in options]  # the edge's options: one stage each
    fixed = (ChunkLoad(0, embedding=True), ChunkLoad(0, head=True))
    o = np.array([sum(sum(cost.chunk_time(edge, t, c)) for c in fixed) for t in tps])
    per = np.array([sum(cost.layer_time(edge, t)) for t in tps])
    o, per = o[pick], per[pick]
    vc = np.where(cloud_speed > 0, cloud_speed, np.inf)
    balanced = (num_layers + o / per) / (1 / per + vc)
    floor = np.maximum(o + least * per, (num_layers - least) / vc)
    return np.where((balanced - o) / per >= least, balanced, floor)


def _keep(est: np.ndarray, cost: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k best by ``est``, the k best by ``cost`` and of the (est, cost) front
    (non-dominated, at most k of it, evenly spaced), in ascending ``est`` order."""
    order = np.argsort(est, kind="stable")
    if len(est) <= 3 * k:
        return order
    by_cost = np.argpartition(cost, k)[:k]
    running = np.minimum.accumulate(cost[order])
    on_front = order[np.concatenate(([True], cost[order][1:] < running[:-1]))]
    if len(on_front) > k:
        on_front = on_front[np.linspace(0, len(on_front) - 1, k).astype(int)]
    picked = np.unique(np.concatenate((order[:k], by_cost, on_front)))
    return picked[np.argsort(est[picked], kind="stable")]


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
