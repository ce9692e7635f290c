"""Simulator calibration: measured per-action times in, measured CPU step time out?

``ldt-train`` (ldt's runtime) writes every compute action's start/end to action_times.csv.
This bench runs ``cluster=cpu_demo`` (U-shape, TP 1/2/1) and ``cluster=cpu_vtp
train.runtime=ldt`` (1F1B, TP 2/1/2), takes the per-(stage, op) median durations of the steady
steps, simulates the same lowered action lists (``u_shape(3, m)`` / ``one_f_one_b(3, m)``) and
compares with the measured step.

Measured target: the median over steady steps of the schedule span from action_times.csv (per
step, the latest compute end over all stages, each relative to its stage's step start). That is
what the simulator's iteration_time models; metrics.csv's step_time_s also contains the gradient
norm all-reduce and the AdamW step, which no schedule model covers (shown for reference).

Two predictions:
* ``compute only``: the medians as they are, zero-time messages;
* ``+ overhead``: each stage's compute also pays that stage's measured per-action overhead (the
  lower quartile of its gaps between computes: receive waits incl. the TP broadcast, send
  posting, Python), plus the measured step-start offset. The quartile is a fixed choice, not
  fitted to the target; see ldt/plan/calibrate.py:stage_overheads.
"""

from __future__ import annotations

import csv
import os
import tempfile

from bench.common import emit, ldt_train, median
from ldt.plan import calibrate

STEPS, SKIP = 23, 3  # 20 steady steps after 3 warm-up steps
RUNS = [("cpu_demo", "ushape", ["cluster=cpu_demo"]),
        ("cpu_vtp", "1f1b", ["cluster=cpu_vtp", "train.runtime=ldt"])]


def _measure(name: str, kind: str, overrides: list[str], root: str) -> dict:
    """One ldt-train run -> measured spans, cost table and both predictions."""
    run_dir = os.path.join(root, name)
    summary = ldt_train(run_dir, overrides + [f"train.steps={STEPS}", "train.num_microbatches=4"])
    rows = calibrate.steady(calibrate.read_action_times(run_dir), SKIP)
    table = calibrate.median_durations(rows)
    stages = 1 + max(stage for stage, _ in table)
    measured = median(calibrate.step_spans(rows).values())
    with open(os.path.join(run_dir, "metrics.csv"), newline="") as f:
        step_times = [float(r["step_time_s"]) for r in csv.DictReader(f)][SKIP:]
    raw = calibrate.predict(kind, stages, 4, table).iteration_time
    overheads = calibrate.stage_overheads(rows)
    offset = calibrate.start_offset(rows)
    calibrated = calibrate.predict(kind, stages, 4,
                                   calibrate.with_overheads(table, overheads)).iteration_time
    calibrated += offset
    return {"config": name, "kind": kind, "measured_span_s": measured,
            "metrics_step_s": median(step_times), "predicted_raw_s": raw,
            "predicted_s": calibrated, "error_raw": raw / measured - 1,
            "error": calibrated / measured - 1, "final_loss": summary["final_loss"],
            "table_ms": {f"{s}{op.value}": round(d * 1e3, 2) for (s, op), d in sorted(table.items())},
            "overhead_ms": {s: round(o * 1e3, 2) for s, o in sorted(overheads.items())},
            "start_offset_ms": round(offset * 1e3, 2)}


def _print(results: list[dict]) -> None:
    print(f"simulator vs measured ldt-train step ({STEPS - SKIP} steady steps, m=4, medians)")
    print(f"{'config':>9} {'measured ms':>12} {'metrics ms':>11} {'sim compute-only':>17} "
          f"{'err':>7} {'sim +overhead':>14} {'err':>7}")
    for r in results:
        print(f"{r['config']:>9} {r['measured_span_s'] * 1e3:12.1f} {r['metrics_step_s'] * 1e3:11.1f} "
              f"{r['predicted_raw_s'] * 1e3:17.1f} {r['error_raw']:+7.1%} "
              f"{r['predicted_s'] * 1e3:14.1f} {r['error']:+7.1%}")
    for r in results:
        print(f"  {r['config']}: per-action medians ms {r['table_ms']}; per-action overhead ms "
              f"{r['overhead_ms']}; start offset {r['start_offset_ms']} ms")


def main() -> dict:
    with tempfile.TemporaryDirectory(prefix="ldt-calib-") as root:
        results = [_measure(name, kind, ov, root) for name, kind, ov in RUNS]
    _print(results)
    by = {r["config"]: r for r in results}
    return emit({"bench": "calibration",
                 "cpu_demo_error": round(by["cpu_demo"]["error"], 3),
                 "cpu_vtp_error": round(by["cpu_vtp"]["error"], 3),
                 "cpu_demo_error_compute_only": round(by["cpu_demo"]["error_raw"], 3),
                 "cpu_vtp_error_compute_only": round(by["cpu_vtp"]["error_raw"], 3),
                 "measured_ms": {k: round(v["measured_span_s"] * 1e3, 1) for k, v in by.items()},
                 "predicted_ms": {k: round(v["predicted_s"] * 1e3, 1) for k, v in by.items()}})


if __name__ == "__main__":
    main()
