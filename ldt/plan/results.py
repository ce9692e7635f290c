"""What the planner hands back: a cluster YAML, a human table and a JSON summary.

The YAML has exactly the keys of ``conf/cluster/*.yaml`` (``ClusterConfig``), so it loads with
``ldt.config.load_cluster_yaml`` and validates with ``ldt.topology.validate.validate``; the prediction
goes into comments at its top, where it is visible but cannot break loading.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Optional, Sequence

from omegaconf import OmegaConf

from ldt.config import ClusterConfig, ConfigError, RecomputeConfig, StageConfig
from ldt.config.load import config_dict
from ldt.config.userfiles import load_yaml
from ldt.plan.cost import GIB
from ldt.plan.evaluate import Evaluation, Plan
from ldt.schedule.size import runs_on_ldt_runtime
from ldt.plan.inventory import Inventory
from ldt.plan.objective import devices, hourly_price, ms, spread, step_cost

FRONT_ROWS = 8
"""Plans of the time/cost front that ldt-plan prints (the fastest, the pick, the cheapest and
others spread between); ``--json`` lists them all."""


def _usable_gib(inventory: Inventory, kind: str) -> float:
    """What a rank of ``kind`` may fill: its memory less what the planner never fills."""
    k = inventory.kind(kind)
    return round(k.memory_gib - k.reserved_gib, 3)


def planned_cluster(plan: Plan, inventory: Inventory,
                    base: Optional[ClusterConfig] = None) -> ClusterConfig:
    """The plan as a cluster config: ``base`` (the configured cluster: an elastic run's
    inventory, host staging, fan-out, link delays; None: the schema's defaults) with the
    planned stages, U-shape, layout and dp. A stage planned without recomputation says
    ``granularity: none``: unset, it would take the model's ``recompute_granularity``, which
    the plan was not priced with."""
    stages = [StageConfig(name, inventory.kind(s.kind).device, s.tp,
                          dp=plan.dp_of(i) if plan.stage_dp else None,
                          recompute=plan.recompute_of(i).to_config() if plan.recompute_of(i)
                          else RecomputeConfig(granularity="none"),
                          memory_gib=_usable_gib(inventory, s.kind))
              for i, (name, s) in enumerate(zip(plan.stage_names(), plan.stages))]
    return replace(base or ClusterConfig(), stages=stages, u_shape=plan.u_shape,
                   layout=plan.layout(), dp=plan.dp)


def cluster_dict(plan: Plan, inventory: Inventory) -> dict[str, Any]:
    """The plan's cluster config as plain data (:func:`ldt.config.load.config_dict`)."""
    return config_dict(planned_cluster(plan, inventory))


def cluster_yaml(ev: Evaluation, inventory: Inventory, model_name: str, micro_batch_size: int,
                 reason: str = "", cost_inventory: Optional[str] = None,
                 model_overrides: Sequence[str] = ()) -> str:
    """A cluster file for ``conf/cluster/`` with the prediction (and ``reason``, why the planner
    picked it) as header comments; ``cost_inventory``: how a run names the inventory
    (``train.cost_inventory`` of a zero-bubble pick; default its name); ``model_overrides``:
    what the plan was priced with beyond the model's file (e.g. ``model.params_dtype=...``)."""
    p = ev.plan
    settings = train_settings(ev, micro_batch_size, cost_inventory or inventory.name)
    head = [
        f"# Planned by ldt-plan for model {model_name} on inventory {inventory.name}.",
        "# Train with " + "".join(f"{o} " for o in model_overrides)
        + train_overrides(settings) + " (global batch "
        f"{p.dp * p.num_microbatches * micro_batch_size}).",
        f"# Predicted iteration {ev.iteration_time * 1e3:.1f} ms (pipeline "
        f"{ev.pipeline_time * 1e3:.1f} ms + dp all-reduce {ev.dp_allreduce_time * 1e3:.1f} ms), "
        f"bubble {ev.bubble_fraction:.1%}.",
    ]
    head += [f"#   stage {s.index} {s.name}: {s.kind} tp={s.tp} layers {s.layers}, "
             f"{s.memory.total / GIB:.1f}/{s.memory_limit / GIB:.1f} GiB"
             + (f", recomputes ({p.recompute_of(s.index).describe()})"
                if p.recompute_of(s.index) else "") for s in ev.stages]
    head.append("# memory_gib: the inventory's memory less reserved_gib; ldt-train estimates "
                "every rank against it before it starts (docs/memory.md).")
    head += [f"# {devices(p)} devices, cost per step {step_cost(ev, inventory):.4g} "
             f"({_cost_unit(inventory)})."] + ([f"# {reason}."] if reason else [])
    body = OmegaConf.to_yaml(OmegaConf.create(cluster_dict(p, inventory)))
    return "\n".join(head) + "\n" + body


def train_settings(ev: Evaluation, micro_batch_size: int, inventory: Optional[str] = None
                   ) -> dict[str, Any]:
    """The ``train.*`` settings the plan was priced with (one source for the train file, the
    cluster file's header and ldt-plan's printed command): its micro-batches, the U-shape's
    prefetch depth, the zero-bubble schedule with the ``inventory`` its order is priced by,
    and ``runtime: ldt`` for a plain pipeline (priced on ldt's runtime's action lists, where
    ``train.runtime=auto`` would run megatron's 1F1B, which blocks on each exchange)."""
    p = ev.plan
    out: dict[str, Any] = {"num_microbatches": p.num_microbatches}
    if p.prefetch:
        out["prefetch"] = p.prefetch
    if ev.schedule == "zb":
        out["schedule"] = "zb"
        if inventory:
            out["cost_inventory"] = inventory
    if not runs_on_ldt_runtime(p.u_shape, bool(p.stage_dp), "auto", ev.schedule):
        out["runtime"] = "ldt"
    out["micro_batch_size"] = micro_batch_size
    return out


def train_overrides(settings: dict[str, Any]) -> str:
    """:func:`train_settings` as ldt-train's command-line overrides."""
    return " ".join(f"train.{k}={v}" for k, v in settings.items())


def train_yaml(ev: Evaluation, model_name: str, micro_batch_size: int, cluster_name: str,
               inventory: Optional[str] = None, model_overrides: Sequence[str] = ()) -> str:
    """A ``conf/train/`` file with the micro-batch settings the plan was priced with: on top of
    ``train/default``, so ``ldt-train cluster=NAME train=NAME`` runs the plan as planned. With
    the zero-bubble schedule picked (``ev.schedule``): ``schedule: zb`` and, given, the
    ``inventory`` it was priced with as ``cost_inventory`` (the run generates its order from
    the same prices). ``model_overrides`` (a train file cannot set them) go in its header."""
    p = ev.plan
    settings = {"defaults": ["default"], **train_settings(ev, micro_batch_size, inventory)}
    body = OmegaConf.to_yaml(OmegaConf.create(settings))
    return (f"# Planned by ldt-plan for model {model_name} with cluster={cluster_name}: global "
            f"batch {p.dp * p.num_microbatches * micro_batch_size} = dp {p.dp} x "
            f"{p.num_microbatches} micro-batches x {micro_batch_size}"
            + (f", prefetch {p.prefetch}" if p.prefetch else "")
            + (", the zero-bubble schedule" if ev.schedule == "zb" else "") + ".\n"
            + (f"{PRICED_WITH}{' '.join(model_overrides)}{PRICED_TAIL}\n"
               if model_overrides else "") + body)


# a train file cannot hold model keys: the ones a plan was priced with are this header line
# (ldt-sim reads them back: read_planned_train)
PRICED_WITH, PRICED_TAIL = "# Priced with ", ": give them to ldt-train too."


def planned_train_path(cluster_path: str) -> Optional[str]:
    """Where :func:`train_yaml` goes for a cluster file: ``DIR/train/NAME.yaml`` next to
    ``DIR/cluster/NAME.yaml`` (a Hydra config folder); None for a cluster file elsewhere."""
    folder, name = os.path.split(os.path.abspath(cluster_path))
    if os.path.basename(folder) != "cluster":
        return None
    path = os.path.join(os.path.dirname(folder), "train", os.path.splitext(name)[0] + ".yaml")
    return path if os.path.isabs(cluster_path) else os.path.relpath(path)


def read_planned_train(cluster_path: str) -> tuple[Optional[str], dict[str, Any]]:
    """The settings ldt-plan wrote next to ``cluster_path`` (``num_microbatches``,
    ``micro_batch_size``, ``prefetch`` and ``schedule`` when planned, and the model overrides
    it priced with as ``model_overrides``, e.g. ``["model.params_dtype=float32"]``): (that
    file, settings), or (None, {})."""
    path = planned_train_path(cluster_path)
    if path is None or not os.path.isfile(path):
        return None, {}
    planned = load_yaml(path, "ldt-plan's train file")
    try:
        out: dict[str, Any] = {k: int(planned[k]) for k in ("num_microbatches",
                                                            "micro_batch_size", "prefetch")
                               if k in planned}
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: {exc}; give whole numbers, or write it again with ldt-plan"
                          ) from None
    if "schedule" in planned:
        out["schedule"] = str(planned["schedule"])
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith(PRICED_WITH) and line.endswith(PRICED_TAIL):
                out["model_overrides"] = line[len(PRICED_WITH):-len(PRICED_TAIL)].split()
    return path, out


def stage_rows(ev: Evaluation) -> list[dict[str, Any]]:
    return [{
        "stage": s.index, "name": s.name, "kind": s.kind, "device": s.device, "tp": s.tp,
        "layers": s.layers, "fwd_ms": s.fwd * 1e3, "bwd_ms": s.bwd * 1e3,
        "busy_ms": s.busy * 1e3, "inflight": list(s.inflight),
        "memory_gib": s.memory.total / GIB, "memory_limit_gib": s.memory_limit / GIB,
        "weights_gib": s.memory.weights / GIB, "activations_gib": s.memory.activations / GIB,
        "grads_gib": s.memory.grads / GIB, "optimizer_gib": s.memory.optimizer / GIB,
        "recompute": ev.plan.recompute_of(s.index).config() if ev.plan.recompute_of(s.index)
        else None,
    } for s in ev.stages]


def summary(ev: Evaluation, inventory: Inventory) -> dict[str, Any]:
    """JSON-ready description of an evaluated plan."""
    p = ev.plan
    return {
        "cluster": cluster_dict(p, inventory),
        "num_microbatches": p.num_microbatches,
        "prefetch": p.prefetch,
        "schedule": ev.schedule,
        "iteration_time_s": ev.iteration_time,
        "pipeline_time_s": ev.pipeline_time,
        "dp_allreduce_time_s": ev.dp_allreduce_time,
        "bubble_fraction": ev.bubble_fraction,
        "fits": ev.fits,
        "devices": devices(p),
        "hourly_price": hourly_price(p, inventory),
        "cost_per_step": step_cost(ev, inventory),
        "stages": stage_rows(ev),
    }


def _cost_unit(inventory: Inventory) -> str:
    return ("the inventory's price_per_hour x hours" if inventory.priced
            else "device-hours: the inventory states no price_per_hour")


def front_rows(front: list[Evaluation], inventory: Inventory, pick: Evaluation
               ) -> list[dict[str, Any]]:
    """One JSON-ready row per plan of the time/cost front (fastest first)."""
    fastest = front[0].iteration_time if front else 0.0
    return [{
        "picked": ev is pick, "stages": ev.plan.num_stages, "devices": devices(ev.plan),
        "iteration_time_s": ev.iteration_time,
        "slower_than_fastest": ev.iteration_time / fastest - 1 if fastest else 0.0,
        "cost_per_step": step_cost(ev, inventory), "bubble_fraction": ev.bubble_fraction,
        "dp": list(ev.plan.stage_dp) if ev.plan.stage_dp else ev.plan.dp,
        "tp": [st.tp for st in ev.plan.stages], "kinds": [st.kind for st in ev.plan.stages],
        "layout": ev.plan.layout(), "num_microbatches": ev.plan.num_microbatches,
        "prefetch": ev.plan.prefetch,
    } for ev in front]


def front_table(front: list[Evaluation], inventory: Inventory, pick: Evaluation,
                rows: int = FRONT_ROWS) -> str:
    """The time/cost trade-off, a few rows of it: the fastest, the pick, the cheapest and plans
    spread between (``*`` marks the pick)."""
    if not front:
        return ""
    shown = {0, len(front) - 1} | {i for i, ev in enumerate(front) if ev is pick}
    for i in spread(len(front)):
        if len(shown) >= rows:
            break
        shown.add(i)
    head = ("", "stages", "devices", "iteration ms", "vs fastest", "cost/step", "bubble", "plan")
    lines = [head]
    for r in (front_rows(front, inventory, pick)[i] for i in sorted(shown)):
        runs: list[list] = []  # consecutive equal stages as one "kind/tpN xK"
        for stage in zip(r["kinds"], r["tp"]):
            if runs and runs[-1][0] == stage:
                runs[-1][1] += 1
            else:
                runs.append([stage, 1])
        tps = ", ".join(f"{k}/tp{t}" + (f" x{n}" if n > 1 else "") for (k, t), n in runs)
        lines.append(("*" if r["picked"] else "", str(r["stages"]), str(r["devices"]),
                      ms(r["iteration_time_s"]), f"{r['slower_than_fastest']:+.1%}",
                      f"{r['cost_per_step']:.4g}", f"{r['bubble_fraction']:.1%}",
                      f"dp={r['dp']}: {tps}"))
    widths = [max(len(r[c]) for r in lines) for c in range(len(head))]
    out = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    title = (f"time/cost front: {len(front)} plans met that no other beats on both"
             + (f", {len(shown)} shown" if len(shown) < len(front) else "")
             + f"; cost in {_cost_unit(inventory)}")
    return "\n".join([title] + out)


def table(ev: Evaluation) -> str:
    """Per-stage table plus a summary line. The memory columns are every term of the stage's
    total (GiB per rank; the W store only where a zero-bubble schedule keeps one)."""
    wstore = any(s.memory.wstore for s in ev.stages)
    head = ("stage", "kind", "dev", "tp", "layers", "fwd ms", "bwd ms", "busy ms", "inflight",
            "recompute", "weights", "grads", "optim", "act", "buffers", "transient",
            *(("W store",) if wstore else ()), "mem GiB", "limit")
    rows = [head]
    for s in ev.stages:
        rc = ev.plan.recompute_of(s.index)
        mem = s.memory
        terms = (mem.weights, mem.grads, mem.optimizer, mem.activations, mem.buffers,
                 mem.transient, *((mem.wstore,) if wstore else ()))
        rows.append((f"{s.index}:{s.name}", s.kind, s.device, str(s.tp), s.layers,
                     f"{s.fwd * 1e3:.2f}", f"{s.bwd * 1e3:.2f}", f"{s.busy * 1e3:.1f}",
                     "/".join(map(str, s.inflight)), rc.describe() if rc else "-",
                     *(f"{v / GIB:.2f}" for v in terms),
                     f"{mem.total / GIB:.2f}" + ("" if s.fits else " !"),
                     f"{s.memory_limit / GIB:.1f}"))
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    p = ev.plan
    lines.append(
        f"{'U-shape' if p.u_shape else 'pipeline'}: {p.num_stages} stages, "
        + (f"dp per stage {list(p.stage_dp)} (VDP), " if p.stage_dp else f"dp={p.dp}, ") +
        f"m={p.num_microbatches}, " + (f"prefetch {p.prefetch}, " if p.prefetch else "")
        + ("zero-bubble schedule (train.schedule=zb), " if ev.schedule == "zb" else "")
        + f"layout {p.layout()!r}; iteration {ev.iteration_time * 1e3:.2f} ms "
        f"(pipeline {ev.pipeline_time * 1e3:.2f} + dp all-reduce {ev.dp_allreduce_time * 1e3:.2f}), "
        f"bubble {ev.bubble_fraction:.1%}" + ("" if ev.fits else "; DOES NOT FIT in memory (!)"))
    return "\n".join(lines)
