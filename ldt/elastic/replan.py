"""The pipeline for the nodes that are there: ``ldt.plan`` over them, then which process runs what.

Pure (no processes, no torch): every rank of an elastic world calls :func:`plan_world` with the
same nodes and config, and must get the same :class:`WorldPlan` (its :meth:`~WorldPlan.digest`
is compared across ranks before anything else happens). That is why the planner runs here with
work limits instead of its default time budgets (a slower rank would otherwise stop searching
earlier and pick another plan).

How nodes become the planner's inventory: nodes of one kind with the same device count and
memory form one planner kind (``count`` = their devices together, ``node_size`` = one node's, so
a stage's TP group never spans nodes); the inventory's links between the original kinds price
the boundaries. With a U-shape the inventory's ``edge`` kind is the data owner: exactly one node
must be of that kind, and it alone is the edge's planner kind, so stage 0 (data, embedding,
head, loss) lands on it and nowhere else. The global batch is the configured one,
``cluster.dp x train.num_microbatches x train.micro_batch_size``; the planner picks dp and the
micro-batches per replica that keep it.

Placement: ldt's ranks are contiguous per stage, the replica outermost (:mod:`ldt.topology.ranks`);
each (stage, replica) TP group goes, in rank order, to the first node of its planner kind with
enough free processes, taking that node's lowest local ranks. Processes left over are idle for
this world (they wait for the run to end).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from ldt.config import ClusterConfig, ConfigError, ModelConfig
from ldt.config.load import config_dict
from ldt.config.schema import to_train
from ldt.elastic.nodes import KIND_VAR, ElasticError, Node
from ldt.plan import Inventory, Link, PlannerOptions, Workload, plan, planned_cluster
from ldt.topology.ranks import Topology
from ldt.topology.validate import per_stage_dp_refusal

# A smaller search than ldt-plan's, as it runs at every start; the planner's budgets count
# simulated actions, not seconds, so every rank plans the same plan whatever its speed.
PLANNER = PlannerOptions(simulate_min=6, simulate_max=64, refine_top=2, refine_sims=40)


@dataclass(frozen=True)
class WorldPlan:
    cluster: dict
    """The planned cluster (:func:`ldt.plan.planned_cluster` over the configured one) as plain
    data (:func:`ldt.config.load.config_dict`): what every rank compares, the run records and
    the job trains with."""
    num_microbatches: int
    prefetch: int
    placement: tuple[tuple[int, int], ...]
    """Per ldt rank: (node index, torchrun local rank) of the process that runs it."""
    nodes: tuple[Node, ...]
    iteration_s: float
    """The planner's predicted step time."""
    rank_stages: tuple[int, ...] = ()
    """Per ldt rank: its stage (:meth:`stage_nodes`)."""
    schedule: str = "auto"
    """The ``train.schedule`` the world runs: ``zb`` only where it was configured and the
    planner kept it for these nodes (a zero-bubble order whose W store does not fit, or that is
    slower here, gives way to today's schedule, as ``ldt-plan`` would write it)."""

    @property
    def world_size(self) -> int:
        return len(self.placement)

    def rank_of(self, node: int, local_rank: int) -> Optional[int]:
        """The ldt rank of a process, None when this world leaves it idle."""
        for rank, where in enumerate(self.placement):
            if where == (node, local_rank):
                return rank
        return None

    def stage_nodes(self) -> list[list[int]]:
        """The nodes each stage's replicas run on."""
        out: list[list[int]] = [[] for _ in self.cluster["stages"]]
        for stage, (node, _) in zip(self.rank_stages, self.placement):
            if node not in out[stage]:
                out[stage].append(node)
        return out

    def digest(self) -> str:
        """What every rank must agree on, as a short hash."""
        text = json.dumps({"cluster": self.cluster, "m": self.num_microbatches,
                           "prefetch": self.prefetch, "placement": self.placement,
                           "schedule": self.schedule},
                          sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        """One line: the stages, where they run, dp, micro-batches, layout, prediction."""
        where = self.stage_nodes()
        stages = " | ".join(
            f"{st['name']} tp {st['tp']}" + (f" dp {st['dp']}" if "dp" in st else "")
            + f" on node {','.join(map(str, where[i]))}"
            for i, st in enumerate(self.cluster["stages"]))
        idle = sum(n.devices for n in self.nodes) - self.world_size
        return (f"{len(self.nodes)} nodes, {self.world_size} processes"
                + (f" ({idle} idle)" if idle else "") + f": {stages}; dp {self.cluster['dp']}, "
                f"{self.num_microbatches} micro-batches, "
                + (f"prefetch {self.prefetch}, " if self.prefetch else "")
                + ("the zero-bubble schedule, " if self.schedule == "zb" else "")
                + f"layout {self.cluster['layout']}; predicted {self.iteration_s * 1e3:.1f} ms "
                "per step")


def global_batch(cluster: ClusterConfig, train: dict) -> int:
    """Sequences per step the run keeps: cluster.dp x train.num_microbatches x mbs."""
    return int(cluster.dp or 1) * int(train["num_microbatches"]) \
        * int(train["micro_batch_size"])


def plan_world(nodes: Sequence[Node], inventory: Inventory, model: ModelConfig,
               cluster: ClusterConfig, train: dict) -> WorldPlan:
    """The pipeline for these nodes (raises :class:`ElasticError` with the reason); ``cluster``
    the configured one (its inventory, host staging, fan-out, link delays are kept)."""
    nodes = tuple(sorted(nodes, key=lambda n: n.index))
    u_shape = bool(cluster.u_shape)
    if u_shape:
        _check_edge(nodes, inventory)
    groups, inv = _planner_inventory(nodes, inventory, u_shape)
    mbs, batch = int(train["micro_batch_size"]), global_batch(cluster, train)
    try:
        # priced on the schedule the world will run: its prediction and prefetch are that one's;
        # only plans this run can train (validate refuses the rest, at a start after a loss)
        vdp_refused = per_stage_dp_refusal(model, to_train(train), u_shape)
        opts = replace(PLANNER, zero_bubble=train.get("schedule") == "zb",
                       per_stage_dp=vdp_refused is None)
        result = plan(inv, model, Workload(mbs, batch, u_shape=u_shape), opts)
    except ConfigError as exc:
        raise ElasticError(f"no plan fits the nodes there are ({_nodes(nodes)}): "
                           f"{exc}") from None
    best = result.best
    if not best.fits:
        worst = max(best.stages, key=lambda s: s.memory.total / s.memory_limit)
        raise ElasticError(
            f"no plan fits the nodes there are ({_nodes(nodes)}): the best one needs "
            f"{worst.memory.total / 2**30:.2f} GiB per device on stage {worst.index} "
            f"({worst.kind}, tp {worst.tp}) where {worst.memory_limit / 2**30:.2f} GiB are "
            "usable; add nodes, lower train.micro_batch_size, or raise the memory")
    kind_of = {name: kind for name, (kind, _) in groups.items()}
    counts: dict[str, int] = {}
    names = []
    for i, spec in enumerate(best.plan.stages):
        kind = kind_of[spec.kind]
        # KIND_n as ldt-plan names stages: train.schedule=zb prices each by the kind it names
        names.append("edge" if u_shape and i == 0 else f"{kind}_{counts.get(kind, 0)}")
        counts[kind] = counts.get(kind, 0) + 1
    planned = planned_cluster(best.plan, inv, base=cluster)
    planned = replace(planned, stages=[replace(st, name=name)
                                       for st, name in zip(planned.stages, names)])
    topo = Topology.from_config(planned)
    placement = _place(topo, planned, [s.kind for s in best.plan.stages], groups, nodes)
    prefetch = best.plan.prefetch if u_shape else 0
    return WorldPlan(config_dict(planned), best.plan.num_microbatches, prefetch, placement,
                     nodes, best.iteration_time,
                     tuple(topo.rank_info(r).stage for r in range(topo.world_size)),
                     schedule=best.schedule)


def _nodes(nodes: Sequence[Node]) -> str:
    return ", ".join(n.describe() for n in nodes)


def _check_edge(nodes: Sequence[Node], inventory: Inventory) -> None:
    """A U-shape's stage 0 holds the data: it runs on the data owner's node or not at all."""
    edge = inventory.edge
    if edge is None:
        raise ElasticError(f"cluster.u_shape=true needs the data owner's kind in inventory.edge "
                           f"(inventory {inventory.name!r} has none); set edge: KIND there, or "
                           "cluster.u_shape=false")
    owners = [n for n in nodes if n.kind == edge]
    if not owners:
        raise ElasticError(
            f"the data owner is gone: no node of the edge kind {edge!r} is in the world torchrun "
            f"formed ({_nodes(nodes)}), and the U-shape's stage 0 (the data, embedding, head "
            f"and loss) runs only there; restart the data owner's torchrun ({KIND_VAR}={edge}, "
            "the same command) and the run continues from its newest checkpoint "
            "(train.resume=auto)")
    if len(owners) > 1:
        raise ElasticError(
            f"{len(owners)} nodes say they are the data owner ({KIND_VAR}={edge}): "
            f"{_nodes(owners)}; the U-shape's edge is one node, give the others a cloud kind")


def _planner_inventory(nodes: Sequence[Node], inventory: Inventory, u_shape: bool
                       ) -> tuple[dict[str, tuple[str, list[Node]]], Inventory]:
    """One planner kind per (kind, devices, memory) of nodes: name -> (kind, nodes)."""
    keyed: dict[tuple, list[Node]] = {}
    for n in nodes:
        keyed.setdefault((n.kind, n.devices, n.memory_gib), []).append(n)
    per_kind: dict[str, int] = {}
    for kind, _, _ in keyed:
        per_kind[kind] = per_kind.get(kind, 0) + 1
    groups: dict[str, tuple[str, list[Node]]] = {}
    seen: dict[str, int] = {}
    for (kind, _, _), members in keyed.items():
        j = seen.get(kind, 0)
        seen[kind] = j + 1
        groups[kind if per_kind[kind] == 1 else f"{kind}.{j}"] = (kind, members)
    kinds, links = [], []
    for name, (kind, members) in groups.items():
        base, devices = inventory.kind(kind), members[0].devices
        memory = members[0].memory_gib or base.memory_gib
        kinds.append(replace(base, name=name, count=devices * len(members),
                             node_size=min(base.node_size, devices), memory_gib=memory))
    names = list(groups)
    for i, a in enumerate(names):
        for b in names[i:]:
            ka, kb = groups[a][0], groups[b][0]
            if a == b and len(groups[a][1]) == 1:
                continue  # stages of one node talk inside it (the kind's intra-node bandwidth)
            link = inventory.link(ka, kb)
            links.append(Link(a, b, link.bandwidth_gbps, link.latency_us))
    edge = next((n for n, (k, _) in groups.items() if k == inventory.edge), None)
    try:
        inv = Inventory(name=f"{inventory.name} (elastic)", kinds=kinds, links=links,
                        edge=edge if u_shape else None)
    except ConfigError as exc:  # e.g. LDT_NODE_MEMORY_GIB below the kind's reserved memory
        raise ElasticError(f"the nodes there are ({_nodes(nodes)}) do not make an inventory: "
                           f"{exc}") from None
    return groups, inv


def _place(topo: Topology, cluster: ClusterConfig, stage_kinds: list[str], groups: dict,
           nodes: Sequence[Node]) -> tuple[tuple[int, int], ...]:
    """(node, local rank) per ldt rank: each (stage, replica) TP group on one node."""
    free = {n.index: list(range(n.devices)) for n in nodes}
    placement: list[Optional[tuple[int, int]]] = [None] * topo.world_size
    for rank in range(topo.world_size):
        info = topo.rank_info(rank)
        if info.tp_rank:
            continue
        tp = topo.stages[info.stage].tp
        members = groups[stage_kinds[info.stage]][1]
        node = next((n.index for n in members if len(free[n.index]) >= tp), None)
        if node is None:
            raise ElasticError(
                f"the plan's stage {info.stage} ({cluster.stages[info.stage].name}, tp "
                f"{tp}) finds no node with {tp} free processes among {_nodes(members)}; "
                "give the nodes of one kind the same --nproc-per-node")
        for k in range(tp):
            placement[rank + k] = (node, free[node].pop(0))
    return tuple(p for p in placement if p is not None)
