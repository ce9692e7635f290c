"""``ldt-sim``: simulate one iteration of an existing cluster config with the planner's cost model.

    ldt-sim --cluster mixed_gpu_npu --model llama_7b --inventory a100_910b -m 8 --png t.png
    python -m ldt.tools.sim --cluster my.yaml --model llama_7b --inventory edge_cloud -m 16 --json

Runs the real schedule (1F1B or U-shape, lowered with communication) through
``ldt.schedule.simulate``; prints the per-stage table (or ``--json``) and writes the timeline.
Stages map to inventory kinds by device type, or explicitly with ``--kinds``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ldt-sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", required=True, help="conf/cluster name or path to a YAML")
    p.add_argument("--model", required=True, help="conf/model name or path to a YAML")
    p.add_argument("--inventory", required=True, help="conf/inventory name or path to a YAML")
    p.add_argument("-m", "--num-microbatches", type=int, required=True,
                   help="micro-batches per iteration per replica")
    p.add_argument("--mbs", type=int, default=1, help="micro-batch size (default 1)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--no-flash", action="store_true", help="price materialised attention scores")
    p.add_argument("--kinds", help="inventory kind per stage, comma-separated")
    p.add_argument("--trace", help="write a Chrome trace (open in Perfetto)")
    p.add_argument("--png", help="write a PNG timeline")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    from ldt.config import ConfigError
    from ldt.plan import (CostModel, cluster_to_plan, export_timeline, load_cluster,
                          load_inventory, load_model, simulate_plan, summary, table)
    from ldt.validate import validate

    try:
        if args.num_microbatches < 1:
            raise ConfigError(f"-m {args.num_microbatches}: need at least 1 micro-batch")
        inventory, model = load_inventory(args.inventory), load_model(args.model)
        cluster = load_cluster(args.cluster)
        validate(cluster, model, check_devices=False)
        kinds = args.kinds.split(",") if args.kinds else None
        plan = cluster_to_plan(cluster, model, inventory, args.num_microbatches, kinds)
        cost = CostModel(model, inventory, args.mbs, args.dtype, not args.no_flash)
        ev = simulate_plan(plan, cost)
        export_timeline(ev, args.trace, args.png)
    except (ConfigError, ValueError) as exc:
        print(f"ldt-sim: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary(ev, inventory), indent=2))
    else:
        print(table(ev))
    return 0


if __name__ == "__main__":
    sys.exit(main())
