"""Heterogeneous pipeline planner: inventory + model + workload -> cluster config.

Typical use::

    from ldt.plan import load_inventory, load_model, Workload, plan, cluster_yaml
    result = plan(load_inventory("a100_910b"), load_model("llama_7b"), Workload(1, 64))
    print(table(result.best))

See ``docs/planner.md`` for what is modelled and what is assumed.
"""

from ldt.plan.convert import cluster_to_plan, export_timeline, load_cluster
from ldt.plan.cost import ChunkLoad, CostModel, Memory
from ldt.plan.evaluate import (Evaluation, Plan, StageReport, StageSpec, choose_prefetch,
                               closed_form, estimate_plan, simulate_plan, simulate_times)
from ldt.plan.exhaustive import ExhaustiveResult, exhaustive
from ldt.plan.inventory import (DeviceKind, Inventory, Link, Workload, load_inventory, load_model,
                                valid_tp_sizes)
from ldt.plan.planner import PlannerOptions, PlanResult, make_cost, plan
from ldt.plan.report import (cluster_dict, cluster_yaml, planned_train_path, read_planned_train,
                             summary, table, train_yaml)

__all__ = [
    "ChunkLoad", "CostModel", "DeviceKind", "Evaluation", "ExhaustiveResult", "Inventory", "Link",
    "Memory", "Plan", "PlanResult", "PlannerOptions", "StageReport", "StageSpec", "Workload",
    "choose_prefetch", "closed_form", "cluster_dict", "cluster_to_plan", "cluster_yaml",
    "estimate_plan", "exhaustive", "export_timeline", "load_cluster", "load_inventory",
    "load_model", "make_cost", "plan", "planned_train_path", "read_planned_train",
    "simulate_plan", "simulate_times", "summary", "table", "train_yaml", "valid_tp_sizes",
]
