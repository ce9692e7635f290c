"""``ldt-plan``: plan a heterogeneous pipeline for an inventory and a model.

    ldt-plan --inventory a100_910b --model llama_7b --mbs 1 --global-batch 64 --out my.yaml
    python -m ldt.tools.plan --inventory edge_cloud --model llama_7b --json

Prints the picked plan's per-stage table, the time/cost front the search met and why it picked
that plan (or ``--json``), writes the cluster YAML with ``--out`` (validated with
``ldt.topology.validate`` first; missing folders are created) and the timeline with ``--trace`` /
``--png``. Every file is written whole or not at all; files that exist are refused unless
``--overwrite``. ``--objective`` / ``--max-slowdown`` set what is picked
(:mod:`ldt.plan.objective`). Thin over :mod:`ldt.plan`.

When ``--out`` is ``DIR/cluster/NAME.yaml`` (a Hydra config folder), the planned micro-batch
settings go to ``DIR/train/NAME.yaml``, so ``ldt-train --config-dir DIR cluster=NAME train=NAME``
runs the plan as it was priced.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Optional, Sequence

from ldt.config import ConfigError
from ldt.config import load_cluster_yaml
from ldt.plan import Objective
from ldt.plan import (PlannerOptions, Workload, cluster_yaml, export_timeline, front_rows,
                      front_table, load_inventory, load_model, plan, summary, table)
from ldt.plan import planned_train_path
from ldt.plan import train_yaml
from ldt.plan.results import train_overrides, train_settings
from ldt.schedule.size import BYTES_PER_ACTION, actions_per_step, check_fits
from ldt.storage.atomic import check_output, new_files
from ldt.tools.cli import Parser, add_pricing_flags, count, number
from ldt.tools.cli import guarded
from ldt.topology.validate import validate


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="ldt-plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--inventory", required=True, help="conf/inventory name or path to a YAML")
    p.add_argument("--model", required=True, help="conf/model name or path to a YAML")
    p.add_argument("--mbs", type=count(1), default=1, help="micro-batch size (default 1)")
    p.add_argument("--global-batch", type=count(1), default=64,
                   help="sequences per step (default 64)")
    add_pricing_flags(p)
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--u-shape", dest="u_shape", action="store_true", default=None,
                       help="plan a U-shape (needs inventory.edge)")
    shape.add_argument("--no-u-shape", dest="u_shape", action="store_false",
                       help="plan a plain pipeline even if the inventory names an edge")
    p.add_argument("--edge-min-layers", type=count(0), default=1,
                   help="decoder layers the edge keeps in each chunk (default 1)")
    p.add_argument("--no-recompute", dest="recompute", action="store_false",
                   help="plan without activation recomputation (by default a stage that does "
                        "not fit otherwise recomputes, priced as the extra forward)")
    p.add_argument("--max-stages", type=count(1), default=None, help="cap on pipeline stages")
    p.add_argument("--objective", choices=["time", "cost"], default="time",
                   help="time (default): the fastest plan, a cheaper one within --max-slowdown "
                        "of it preferred; cost: the cheapest per step (per trained token), ties "
                        "within 1%% to the faster")
    p.add_argument("--max-slowdown", type=number(0.0), default=None, metavar="FRACTION",
                   help="with --objective time: how much slower than the fastest a cheaper plan "
                        "may be (default 0.01; 0.05 = 5%%)")
    p.add_argument("--out", help="write the planned cluster YAML here (DIR/cluster/NAME.yaml: "
                   "also DIR/train/NAME.yaml with the micro-batch settings)")
    p.add_argument("--trace", help="write a Chrome trace of the planned iteration")
    p.add_argument("--png", help="write a PNG timeline of the planned iteration")
    p.add_argument("--overwrite", action="store_true",
                   help="replace files that exist at --out / --trace / --png (default: refuse)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    return guarded("ldt-plan", lambda: _run(args))


def _run(args) -> int:
    outputs = _outputs(args)  # checked before the planner runs: a refusal is immediate
    inputs = [(f, v) for f, v in (("--inventory", args.inventory), ("--model", args.model))
              if os.path.exists(v)]
    for path, flag in outputs:
        check_output(path, flag=flag, overwrite=args.overwrite, inputs=inputs, file=True)
    inventory, model = load_inventory(args.inventory), load_model(args.model)
    overrides = _model_overrides(args, model)
    if args.sequence_parallel:
        model = dataclasses.replace(model, sequence_parallel=True)
    workload = Workload(args.mbs, args.global_batch, args.dtype, False if args.no_flash else None,
                        args.u_shape, args.edge_min_layers, args.recompute)
    _check_size(args, inventory, model)
    _check_shape(args, inventory, model)
    result = plan(inventory, model, workload, PlannerOptions(max_stages=args.max_stages),
                  _objective(args))
    with new_files([p for p, _ in outputs], flags=[f for _, f in outputs],
                   overwrite=args.overwrite, inputs=inputs) as tmps:
        tmp = {flag: t for (_, flag), t in zip(outputs, tmps)}
        if args.out:
            _write_validated(tmp["--out"], cluster_yaml(result.best, inventory, model.name,
                                                        args.mbs, result.reason,
                                                        _cost_inventory(args.inventory),
                                                        overrides), model)
        if TRAIN_FLAG in tmp:
            with open(tmp[TRAIN_FLAG], "w") as f:
                f.write(_train_text(args.out, result.best, model.name, args.mbs,
                                    args.inventory, overrides))
        export_timeline(result.best, tmp.get("--trace"), tmp.get("--png"))
    written = [_shown(args.out, p) for p, f in outputs if f in ("--out", TRAIN_FLAG)]
    if args.json:
        out = summary(result.best, inventory)
        out.update(objective=dataclasses.asdict(result.objective), reason=result.reason,
                   front=front_rows(result.front, inventory, result.best),
                   plan_time_s=result.seconds, stage_sets_scored=result.stage_sets_scored,
                   plans_split=result.plans_split, simulations=result.simulations,
                   notes=result.notes)
        print(json.dumps(out, indent=2))
    else:
        print(table(result.best))
        print()
        print(front_table(result.front, inventory, result.best))
        print(result.reason)
        print(f"planned in {result.seconds:.2f} s ({result.stage_sets_scored} stage sets scored, "
              f"{result.plans_split} splits, {result.simulations} simulations)"
              + (f"; wrote {', '.join(written)}" if written else ""))
        for note in result.notes:
            print(note)
        if written:
            print(_how_to_train(written, model.name, result.best, args.mbs, args.inventory,
                                overrides))
    return 0


TRAIN_FLAG = "--out (its train/ file)"


def _model_overrides(args, model) -> list[str]:
    """What the plan is priced with beyond the model's file: ldt-train must be told too, else
    it trains (and estimates) another run than the one planned."""
    out = []
    if args.dtype and args.dtype != model.params_dtype:
        out.append(f"model.params_dtype={args.dtype}")
    if args.sequence_parallel and not model.sequence_parallel:
        out.append("model.sequence_parallel=true")
    if args.no_flash and model.transformer_impl != "local":
        # megatron's local layers on every stage: local attention, as priced (the memory
        # check before a start then prices it too)
        out.append("model.transformer_impl=local")
    return out


def _objective(args):
    """The objective from --objective / --max-slowdown (one of them decides the tolerance)."""
    if args.max_slowdown is None:
        return Objective(args.objective)
    if args.objective == "cost":
        raise ConfigError(f"--max-slowdown {args.max_slowdown} goes with --objective time (the "
                          "cheapest plan at most that much slower than the fastest); drop one")
    return Objective("time", args.max_slowdown)


def _check_shape(args, inventory, model) -> None:
    """Flags that leave the planner nothing to search, said as such (not as 'no plan fits')."""
    u_shape = args.u_shape if args.u_shape is not None else inventory.edge is not None
    if not u_shape:
        return
    if args.max_stages == 1:
        raise ConfigError("--max-stages 1 with a U-shape: it needs an edge and at least one "
                          "cloud stage; give --max-stages >= 2, or --no-u-shape")
    most = (model.num_layers - 1) // 2  # the edge's two chunks, and a layer for the cloud
    if args.edge_min_layers > most:
        raise ConfigError(f"--edge-min-layers {args.edge_min_layers}: the edge would keep "
                          f"{2 * args.edge_min_layers} of {model.name}'s {model.num_layers} "
                          f"layers, leaving the cloud none; give at most {most}")


def _check_size(args, inventory, model) -> None:
    """The planner simulates schedules of up to global-batch / mbs micro-batches (over the
    replicas of per-stage DP too) over up to every device: bounded first."""
    stages = min(args.max_stages or inventory.total_devices, model.num_layers + 2)
    per_mb = actions_per_step(stages, 1) * BYTES_PER_ACTION
    m = args.global_batch // args.mbs
    check_fits("--global-batch", args.global_batch, m * per_mb,
               f"the planner's simulated schedules ({m} micro-batches over up to {stages} "
               "stages)", unit_bytes=per_mb / args.mbs)


def _outputs(args) -> list[tuple[str, str]]:
    """(path, flag) of every file this run writes."""
    out = []
    if args.out:
        out.append((args.out, "--out"))

        train = planned_train_path(args.out)
        if train:
            out.append((train, TRAIN_FLAG))
    out += [(getattr(args, k), f"--{k}") for k in ("trace", "png") if getattr(args, k)]
    return out


def _shown(cluster_path: str, path: str) -> str:
    """A written path as the user gave --out: relative stays relative."""
    return path if os.path.isabs(cluster_path) else os.path.relpath(path)


def _cost_inventory(inventory: str) -> str:
    """The inventory a zero-bubble run prices its order with (``train.cost_inventory``): as
    given (a conf/inventory name), or a file's absolute path."""
    return os.path.abspath(inventory) if os.path.isfile(inventory) else inventory


def _train_text(cluster_path: str, best, model_name: str, mbs: int, inventory: str,
                overrides: list[str]) -> str:
    stem = os.path.splitext(os.path.basename(cluster_path))[0]
    return train_yaml(best, model_name, mbs, stem, _cost_inventory(inventory), overrides)


def _how_to_train(written: list[str], model_name: str, best, mbs: int, inventory: str,
                  overrides: list[str]) -> str:
    cluster = written[0]
    stem = os.path.splitext(os.path.basename(cluster))[0]
    if len(written) == 2:
        root = os.path.dirname(os.path.dirname(cluster)) or "."
        import shlex

        return "train it: " + shlex.join(["ldt-train", "--config-dir", root, f"cluster={stem}",
                                          f"train={stem}", f"model={model_name}", *overrides])
    settings = train_overrides(train_settings(best, mbs, _cost_inventory(inventory)))
    return (f"train it with: {settings} model={model_name} "
            + "".join(f"{o} " for o in overrides) + "(put the file in a cluster/ "
            "folder to get a train/ file with these too)")


def _write_validated(path: str, text: str, model) -> None:
    """Write the YAML at ``path`` (a temporary of :func:`ldt.storage.atomic.new_files`) and
    check it loads and validates the way users will load it; a refusal leaves no file."""
    with open(path, "w") as f:
        f.write(text)
    validate(load_cluster_yaml(path), model, check_devices=False)


if __name__ == "__main__":
    sys.exit(main())
