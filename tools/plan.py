"""``ldt-plan``: plan a heterogeneous pipeline for an inventory and a model.

    ldt-plan --inventory a100_910b --model llama_7b --mbs 1 --global-batch 64 --out my.yaml
    python -m ldt.tools.plan --inventory edge_cloud --model llama_7b --json

Prints the picked plan's per-stage table, the time/cost front the search met and why it picked
that plan (or ``--json``), writes the cluster YAML with ``--out`` (validated with
``ldt.validate`` first; missing folders are created) and the timeline with ``--trace`` /
``--png``. ``--objective`` / ``--max-slowdown`` set what is picked (:mod:`ldt.plan.objective`).
Thin over :mod:`ldt.plan`.

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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ldt-plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--inventory", required=True, help="conf/inventory name or path to a YAML")
    p.add_argument("--model", required=True, help="conf/model name or path to a YAML")
    p.add_argument("--mbs", type=int, default=1, help="micro-batch size (default 1)")
    p.add_argument("--global-batch", type=int, default=64, help="sequences per step (default 64)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="training dtype (default: the model's params_dtype)")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--u-shape", dest="u_shape", action="store_true", default=None,
                       help="plan a U-shape (needs inventory.edge)")
    shape.add_argument("--no-u-shape", dest="u_shape", action="store_false",
                       help="plan a plain pipeline even if the inventory names an edge")
    p.add_argument("--edge-min-layers", type=int, default=1,
                   help="decoder layers the edge keeps in each chunk (default 1)")
    p.add_argument("--no-flash", action="store_true",
                   help="price materialised attention scores (no flash / fused attention)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="price megatron's sequence parallelism on stages of TP > 1 (train with "
                        "model.sequence_parallel=true)")
    p.add_argument("--max-stages", type=int, default=None, help="cap on pipeline stages")
    p.add_argument("--objective", choices=["time", "cost"], default="time",
                   help="time (default): the fastest plan, a cheaper one within --max-slowdown "
                        "of it preferred; cost: the cheapest per step (per trained token), ties "
                        "within 1%% to the faster")
    p.add_argument("--max-slowdown", type=float, default=None, metavar="FRACTION",
                   help="with --objective time: how much slower than the fastest a cheaper plan "
                        "may be (default 0.01; 0.05 = 5%%)")
    p.add_argument("--out", help="write the planned cluster YAML here (DIR/cluster/NAME.yaml: "
                   "also DIR/train/NAME.yaml with the micro-batch settings)")
    p.add_argument("--trace", help="write a Chrome trace of the planned iteration")
    p.add_argument("--png", help="write a PNG timeline of the planned iteration")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    from ldt.config import ConfigError
    from ldt.plan import (PlannerOptions, Workload, cluster_yaml, export_timeline, front_rows,
                          front_table, load_inventory, load_model, plan, summary, table)

    try:
        inventory, model = load_inventory(args.inventory), load_model(args.model)
        if args.sequence_parallel:
            model = dataclasses.replace(model, sequence_parallel=True)
        workload = Workload(args.mbs, args.global_batch, args.dtype, not args.no_flash,
                            args.u_shape, args.edge_min_layers)
        result = plan(inventory, model, workload, PlannerOptions(max_stages=args.max_stages),
                      _objective(args))
        written = []
        if args.out:
            _write_validated(args.out, cluster_yaml(result.best, inventory, model.name, args.mbs,
                                                    result.reason), model)
            written = [args.out, *_write_train(args.out, result.best, model.name, args.mbs)]
        for path in (args.trace, args.png):
            if path:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        export_timeline(result.best, args.trace, args.png)
    except ConfigError as exc:
        print(f"ldt-plan: {exc}", file=sys.stderr)
        return 2
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
            print(_how_to_train(written, model.name, result.best.plan, args.mbs))
    return 0


def _objective(args):
    """The objective from --objective / --max-slowdown (one of them decides the tolerance)."""
    from ldt.config import ConfigError
    from ldt.plan import Objective

    if args.max_slowdown is None:
        return Objective(args.objective)
    if args.objective == "cost":
        raise ConfigError(f"--max-slowdown {args.max_slowdown} goes with --objective time (the "
                          "cheapest plan at most that much slower than the fastest); drop one")
    return Objective("time", args.max_slowdown)


def _write_train(cluster_path: str, best, model_name: str, mbs: int) -> list[str]:
    """``DIR/train/NAME.yaml`` next to ``DIR/cluster/NAME.yaml`` (nothing for other paths)."""
    from ldt.plan import planned_train_path, train_yaml

    path = planned_train_path(cluster_path)
    if path is None:
        return []
    stem = os.path.splitext(os.path.basename(cluster_path))[0]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(train_yaml(best, model_name, mbs, stem))
    return [path]


def _how_to_train(written: list[str], model_name: str, plan, mbs: int) -> str:
    cluster = written[0]
    stem = os.path.splitext(os.path.basename(cluster))[0]
    if len(written) == 2:
        root = os.path.dirname(os.path.dirname(cluster)) or "."
        return (f"train it: ldt-train --config-dir {root} cluster={stem} train={stem} "
                f"model={model_name}")
    prefetch = f"train.prefetch={plan.prefetch} " if plan.prefetch else ""
    return (f"train it with: train.num_microbatches={plan.num_microbatches} {prefetch}"
            f"train.micro_batch_size={mbs} model={model_name} (put the file in a cluster/ "
            "folder to get a train/ file with these too)")


def _write_validated(path: str, text: str, model) -> None:
    """Write the YAML only if it loads and validates the way users will load it."""
    import tempfile

    from ldt.config import load_cluster_yaml
    from ldt.validate import validate

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as tmp:
        tmp.write(text)
    try:
        validate(load_cluster_yaml(tmp.name), model, check_devices=False)
    finally:
        os.unlink(tmp.name)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


if __name__ == "__main__":
    sys.exit(main())
