"""Between the planner's :class:`Plan` and the rest of ldt: cluster configs and timelines.

``ldt-sim`` prices an existing cluster config, which names device *types* per stage; the cost
model needs device *kinds* (an A100 and an H100 are both ``cuda``). :func:`cluster_to_plan`
maps each stage to a kind: the one given explicitly, else the only kind of that device type in
the inventory (stage 0 of a U-shape prefers the inventory's edge kind).
"""

from __future__ import annotations

from typing import Optional, Sequence

from ldt.config import ClusterConfig, ConfigError, ModelConfig
from ldt.config.layout import split_layers
from ldt.config.load import load_group
from ldt.models.recompute import stage_recompute
from ldt.plan.evaluate import Evaluation, Plan, StageSpec, lane_groups
from ldt.plan.inventory import Inventory
from ldt.plan.memory_cost import Recompute
from ldt.schedule import to_chrome_trace, to_png
from ldt.schedule.routing import Lanes


def load_cluster(name_or_path: str) -> ClusterConfig:
    """A cluster file or a shipped ``conf/cluster/<name>``; Hydra's ``defaults`` list is ignored."""
    return load_group(ClusterConfig, name_or_path, "cluster")


def stage_kinds(cluster: ClusterConfig, inventory: Inventory,
                kinds: Optional[Sequence[str]] = None) -> list[str]:
    if kinds is not None:
        if len(kinds) != len(cluster.stages):
            raise ConfigError(f"--kinds lists {len(kinds)} kinds for {len(cluster.stages)} stages; "
                              "give one kind per stage, comma-separated")
        for i, (k, st) in enumerate(zip(kinds, cluster.stages)):
            if inventory.kind(k).device != st.device:
                raise ConfigError(f"--kinds[{i}]={k!r} is a {inventory.kind(k).device} kind but "
                                  f"cluster.stages[{i}].device={st.device!r}; pick a {st.device} kind")
        return list(kinds)
    named = planned_kinds(cluster, inventory)  # ldt-plan's KIND_n names say it
    if named is not None and all(inventory.kind(k).device == st.device
                                 for k, st in zip(named, cluster.stages)):
        return named
    out = []
    for i, st in enumerate(cluster.stages):
        if cluster.u_shape and i == 0 and inventory.edge is not None \
                and inventory.kind(inventory.edge).device == st.device:
            out.append(inventory.edge)
            continue
        match = [k.name for k in inventory.kinds if k.device == st.device]
        if len(match) != 1:
            raise ConfigError(
                f"cluster.stages[{i}].device={st.device!r} matches kinds {match} of inventory "
                f"{inventory.name!r}; pass --kinds with one kind per stage (e.g. --kinds "
                f"{_example_kinds(cluster, inventory)})")
        out.append(match[0])
    return out


def _example_kinds(cluster: ClusterConfig, inventory: Inventory) -> str:
    """One kind per stage of its device type, comma-separated (an --kinds example)."""
    return ",".join(next((k.name for k in inventory.kinds if k.device == st.device), "?")
                    for st in cluster.stages)


def planned_kinds(cluster, inventory: Inventory) -> Optional[list[str]]:
    """Each stage's kind as the planner named the stage (``KIND_n``, an elastic world's too;
    ``KIND.j_n`` for the planner's j-th node group of a kind; a U-shape's stage 0 the
    inventory's edge kind), or None where a stage's name
    names no kind of ``inventory`` (a hand-written cluster: kinds by device type then)."""
    names, out = {k.name for k in inventory.kinds}, []
    for i, st in enumerate(cluster.stages):
        if cluster.u_shape and i == 0 and inventory.edge is not None:
            out.append(inventory.edge)
            continue
        kind = st.name.rpartition("_")[0].split(".")[0]
        if kind not in names:
            return None
        out.append(kind)
    return out


def cluster_to_plan(cluster: ClusterConfig, model: ModelConfig, inventory: Inventory,
                    num_microbatches: int, kinds: Optional[Sequence[str]] = None) -> Plan:
    """The Plan of an existing cluster config (one segment per stage, U-shape: P+1)."""
    p = len(cluster.stages)
    split = split_layers(model.num_layers, p, u_shape=cluster.u_shape, layout=cluster.layout)
    if split.vpp_size != 1:
        raise ConfigError(f"cluster.layout={cluster.layout!r} has {split.vpp_size} chunks per stage "
                          "(interleaved); the planner's simulator prices one segment per stage; "
                          "use a layout with one segment per stage")
    layers = tuple(c.num_layers for c in split.model_order)
    names = stage_kinds(cluster, inventory, kinds)
    stages = tuple(StageSpec(k, int(s.tp)) for k, s in zip(names, cluster.stages))
    dps = tuple(int(cluster.dp if s.dp is None else s.dp) for s in cluster.stages)
    recompute = tuple(Recompute.of(stage_recompute(model, s)) for s in cluster.stages)
    return Plan(stages, layers, bool(cluster.u_shape), max(dps), num_microbatches,
                stage_dp=dps if len(set(dps)) > 1 else (),
                recompute=recompute if any(recompute) else ())


def export_timeline(ev: Evaluation, trace: Optional[str] = None, png: Optional[str] = None,
                    title: str = "") -> None:
    """Chrome trace (seconds -> microseconds) and/or PNG of a simulated evaluation."""
    if ev.sim is None:
        raise ValueError("this evaluation was not simulated; use simulate_plan() to get a timeline")
    names = timeline_rows(ev.plan)
    if trace:
        to_chrome_trace(ev.sim, trace, us_per_unit=1e6, stage_names=names)
    if png:
        to_png(ev.sim, png, title or ev.plan.describe(), stage_names=names)


def timeline_rows(plan) -> list[str]:
    """A name per row of a plan's simulated timeline: its stages, or with per-stage dp the
    lanes it prices (:func:`ldt.plan.evaluate.lane_groups`), each ``NAME rJ`` for replica J."""
    names = plan.stage_names()
    if not plan.stage_dp:
        return names
    lanes = Lanes(lane_groups(plan))
    return [f"{names[stage]} r{replica}"
            for stage, replica in (lanes.of(lane) for lane in range(len(lanes)))]
