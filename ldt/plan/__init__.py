"""Heterogeneous pipeline planner: inventory + model + workload -> cluster config.

Typical use::

    from ldt.plan import load_inventory, load_model, Workload, plan, table, front_table
    inventory = load_inventory("a100_910b")
    result = plan(inventory, load_model("llama_7b"), Workload(1, 64))
    print(table(result.best))                                  # the picked plan, per stage
    print(front_table(result.front, inventory, result.best))   # the time/cost trade-off

See ``docs/planner.md`` for what is modelled, what is assumed and how a plan is picked.
"""

from ldt.plan.clusters import cluster_to_plan, export_timeline, load_cluster
from ldt.plan.cost import ChunkLoad, CostModel
from ldt.plan.evaluate import (Evaluation, Plan, StageReport, StageSpec, choose_prefetch,
                               closed_form, estimate_plan, simulate_plan, simulate_times)
from ldt.plan.exhaustive import ExhaustiveResult, exhaustive
from ldt.plan.inventory import (DeviceKind, Inventory, Link, Workload, load_inventory, load_model,
                                valid_tp_sizes)
from ldt.plan.memory_cost import Memory
from ldt.plan.objective import Objective, choose, devices, hourly_price, pareto_front, step_cost
from ldt.plan.planner import PlannerOptions, PlanResult, make_cost, plan
from ldt.plan.results import (cluster_dict, cluster_yaml, front_rows, front_table,
                             planned_cluster, planned_train_path, read_planned_train, summary,
                             table, train_yaml)

__all__ = [
    "ChunkLoad", "CostModel", "DeviceKind", "Evaluation", "ExhaustiveResult", "Inventory", "Link",
    "Memory", "Objective", "Plan", "PlanResult", "PlannerOptions", "StageReport", "StageSpec",
    "Workload", "choose", "choose_prefetch", "closed_form", "cluster_dict", "cluster_to_plan",
    "cluster_yaml", "devices", "estimate_plan", "exhaustive", "export_timeline", "front_rows",
    "front_table", "hourly_price", "load_cluster", "load_inventory", "load_model", "make_cost",
    "pareto_front", "plan", "planned_cluster", "planned_train_path", "read_planned_train",
    "simulate_plan",
    "simulate_times", "step_cost", "summary", "table", "train_yaml", "valid_tp_sizes",
]
