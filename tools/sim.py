"""``ldt-sim``: simulate one iteration of an existing cluster config with the planner's cost model.

    ldt-sim --cluster mixed_gpu_npu --model llama_7b --inventory a100_910b -m 8 --png t.png
    python -m ldt.tools.sim --cluster my.yaml --model llama_7b --inventory edge_cloud -m 16 --json

Runs the real schedule (1F1B or U-shape, lowered with communication; with ``--schedule zb``
the zero-bubble one generated from the plan's prices, ``ldt.plan.zb_prices``) through
``ldt.schedule.simulate``; prints the per-stage table (or ``--json``) and writes the timeline.
Stages map to inventory kinds by device type, or explicitly with ``--kinds``.

    ldt-sim --measured outputs/2026-11-21/10-00-00 [--skip 3] [--json] [--png t.png]

replays an ldt-train run instead: the action lists it executed with its measured per-action
times (its ``action_times.csv``, see ``ldt.plan.calibrate``), against its measured step.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from ldt.config import ConfigError
from ldt.config.userfiles import load_yaml
from ldt.plan import (CostModel, cluster_to_plan, export_timeline, load_cluster, load_inventory,
                      load_model, simulate_plan, summary, table)
from ldt.plan import calibrate
from ldt.plan import read_planned_train
from ldt.plan.zb_prices import runs_zb, simulate_zb
from ldt.schedule.size import check_schedule_size
from ldt.schedule.timeline import to_chrome_trace, to_png
from ldt.storage.atomic import check_output
from ldt.storage.atomic import new_files
from ldt.tools.cli import Parser, add_pricing_flags, count
from ldt.tools.cli import guarded
from ldt.topology.validate import validate


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="ldt-sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", help="conf/cluster name or path to a YAML")
    p.add_argument("--model", help="conf/model name or path to a YAML")
    p.add_argument("--inventory", help="conf/inventory name or path to a YAML")
    p.add_argument("-m", "--num-microbatches", type=count(1),
                   help="micro-batches per iteration per replica (default: ldt-plan's "
                        "DIR/train/NAME.yaml next to a --cluster DIR/cluster/NAME.yaml)")
    p.add_argument("--measured", metavar="RUN_DIR",
                   help="replay an ldt-train run's action_times.csv instead of the cost model")
    p.add_argument("--skip", type=count(0), default=3,
                   help="with --measured: warm-up steps to leave out (default 3)")
    p.add_argument("--mbs", type=count(1), default=None,
                   help="micro-batch size (default: the planned one, as -m; else 1)")
    add_pricing_flags(p)
    p.add_argument("--kinds", help="inventory kind per stage, comma-separated")
    p.add_argument("--prefetch", type=count(0), default=None,
                   help="U-shape prefetch depth (train.prefetch; default: the planned one, "
                        "as -m; else 0)")
    p.add_argument("--schedule", choices=["auto", "zb"], default=None,
                   help="train.schedule to price: auto (1F1B / the U-shape) or zb (zero-bubble, "
                        "generated from the plan's prices; default: the planned one, as -m; "
                        "else auto)")
    p.add_argument("--trace", help="write a Chrome trace (open in Perfetto)")
    p.add_argument("--png", help="write a PNG timeline")
    p.add_argument("--overwrite", action="store_true",
                   help="replace files that exist at --trace / --png (default: refuse)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.measured:
        return guarded("ldt-sim", lambda: _replay(args))
    status = guarded("ldt-sim", lambda: _take_planned(args))
    if status:
        return status
    missing = [f"--{n.replace('_', '-')}" for n in ("cluster", "model", "inventory",
                                                    "num_microbatches") if getattr(args, n) is None]
    if missing:
        p.error(f"{', '.join(missing)} required (-m can come from ldt-plan's DIR/train/NAME.yaml "
                "next to --cluster DIR/cluster/NAME.yaml; or --measured RUN_DIR to replay a run)")
    return guarded("ldt-sim", lambda: _simulate(args))


def _outputs(args, inputs) -> list[tuple[str, str]]:
    """(path, flag) of the files this run writes, refused before any work if they exist."""
    out = [(getattr(args, k), f"--{k}") for k in ("trace", "png") if getattr(args, k)]
    for path, flag in out:
        check_output(path, flag=flag, overwrite=args.overwrite, inputs=inputs, file=True)
    return out


def _simulate(args) -> int:
    import os
    from dataclasses import replace

    inputs = [(f"--{k}", getattr(args, k)) for k in ("cluster", "model", "inventory")
              if os.path.exists(getattr(args, k))]
    outputs = _outputs(args, inputs)
    inventory, model = load_inventory(args.inventory), load_model(args.model)
    if args.sequence_parallel:
        model = replace(model, sequence_parallel=True)
    if model.mtp_num_layers:  # the cost model has no MTP layers: they would cost nothing
        raise ConfigError(f"model.mtp_num_layers={model.mtp_num_layers}: ldt-sim does not "
                          "price MTP layers yet (their time and memory would be left out); "
                          "simulate the model without them (model.mtp_num_layers=0, no 'm' "
                          "in cluster.layout)")
    cluster = load_cluster(args.cluster)
    topo = validate(cluster, model, check_devices=False)
    check_schedule_size("-m", args.num_microbatches, topo.num_stages,  # before it is built
                        replicas=max(topo.dp_sizes) if topo.is_vdp else 1)
    kinds = args.kinds.split(",") if args.kinds else None
    if args.prefetch > args.num_microbatches:
        raise ConfigError(f"--prefetch {args.prefetch} exceeds -m {args.num_microbatches}: "
                          "no more micro-batches than there are can be in flight; give at most "
                          f"{args.num_microbatches}")
    if args.prefetch and not cluster.u_shape:
        raise ConfigError(f"--prefetch {args.prefetch}: the depth of a U-shape's schedule; the "
                          "cluster is a plain pipeline: drop --prefetch")
    try:
        plan = replace(cluster_to_plan(cluster, model, inventory, args.num_microbatches,
                                       kinds), prefetch=args.prefetch)
        cost = CostModel(model, inventory, args.mbs, args.dtype,
                         False if args.no_flash else None)
        if args.schedule == "zb":
            if not runs_zb(plan):
                raise ConfigError(f"--schedule zb needs two stages at least (one has no "
                                  f"bubble); got {plan.num_stages}: drop --schedule zb")
            ev = simulate_zb(plan, cost, plan.prefetch)
        else:
            ev = simulate_plan(plan, cost)
    except ValueError as exc:  # the cost model's refusals (ConfigError is one)
        raise ConfigError(str(exc)) from None
    with new_files([p for p, _ in outputs], flags=[f for _, f in outputs],
                   overwrite=args.overwrite, inputs=inputs) as tmps:
        tmp = {flag: t for (_, flag), t in zip(outputs, tmps)}
        export_timeline(ev, tmp.get("--trace"), tmp.get("--png"))
    if args.json:
        print(json.dumps(summary(ev, inventory), indent=2))
    else:
        print(table(ev))
    return 0


def _take_planned(args) -> None:
    """Settings not given on the command line from the train file ldt-plan wrote next to the
    cluster file (``DIR/train/NAME.yaml``), and the model overrides its header names (what
    ``--dtype``, ``--sequence-parallel`` and ``--no-flash`` priced): the simulator prices the
    plan as it was planned."""
    path, planned = read_planned_train(args.cluster) if args.cluster else (None, {})
    taken = []
    for arg, key, default in (("num_microbatches", "num_microbatches", None),
                              ("mbs", "micro_batch_size", 1), ("prefetch", "prefetch", 0),
                              ("schedule", "schedule", "auto")):
        if getattr(args, arg) is None and key in planned:
            setattr(args, arg, planned[key])
            taken.append(f"{key}={planned[key]}")
        elif getattr(args, arg) is None:
            setattr(args, arg, default)
    for override in planned.get("model_overrides", ()):  # what ldt-plan's flags priced
        key, _, value = override.partition("=")
        if key == "model.params_dtype" and args.dtype is None:
            args.dtype = value
        elif key == "model.sequence_parallel" and value == "true" and not args.sequence_parallel:
            args.sequence_parallel = True
        elif key == "model.transformer_impl" and value == "local" and not args.no_flash:
            args.no_flash = True
        else:
            continue
        taken.append(override)
    if taken:
        print(f"ldt-sim: {', '.join(taken)} from {path}", file=sys.stderr)


def _stage_names(run_dir: str):
    """The run's stage names (its config.yaml), or None for a folder without one."""
    import os

    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        return None
    stages = load_yaml(path, "the run's config").get("cluster", {}).get("stages") or []
    return [s.get("name", str(i)) for i, s in enumerate(stages)] or None


def _replay(args) -> int:
    outputs = _outputs(args, [("--measured", args.measured)])
    try:
        rows = calibrate.steady(calibrate.read_action_times(args.measured), args.skip)
        comparison = calibrate.compare(rows)
    except FileNotFoundError as exc:
        raise ConfigError(f"--measured {args.measured}: {exc}") from None
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"--measured {args.measured}: {exc}") from None
    names = _stage_names(args.measured)
    with new_files([p for p, _ in outputs], flags=[f for _, f in outputs],
                   overwrite=args.overwrite, inputs=[("--measured", args.measured)]) as tmps:
        tmp = {flag: t for (_, flag), t in zip(outputs, tmps)}
        if "--trace" in tmp:
            to_chrome_trace(comparison.full, tmp["--trace"], us_per_unit=1e6, stage_names=names)
        if "--png" in tmp:
            to_png(comparison.full, tmp["--png"], f"replay of {args.measured}",
                   stage_names=names)
    if args.json:
        print(json.dumps(comparison.summary(), indent=2))
        return 0
    cal, full = comparison.calibration, comparison.full
    print(f"{args.measured}: {comparison.steps} steps after {args.skip} skipped, "
          f"{len(cal.schedule)} stages")
    print(f"  measured schedule span (median)  {comparison.measured_s * 1e3:9.2f} ms")
    print(f"  simulated, compute only          {comparison.compute_only.iteration_time * 1e3:9.2f}"
          f" ms  {comparison.error_compute_only:+.1%}")
    print(f"  simulated, with communication    {full.iteration_time * 1e3:9.2f} ms  "
          f"{comparison.error:+.1%}")
    figures = comparison.summary()
    print(f"  least, any order of these ops    {figures['least_ms']:9.2f} ms  "
          f"bubble {full.bubble_fraction:.1%} (least {figures['bubble_least']:.1%})")
    print(f"{'stage':>5} {'busy ms':>9} {'start ms':>9}  mean ms per action")
    for stage in cal.schedule:
        ops = {op: t for (s, op), t in {**cal.compute, **cal.local}.items() if s == stage}
        print(f"{stage:>5} {full.busy[stage] * 1e3:9.2f} {cal.start_at[stage] * 1e3:9.2f}  "
              + " ".join(f"{op.value}={t * 1e3:.2f}" for op, t in ops.items()))
    return 0

if __name__ == "__main__":
    sys.exit(main())
