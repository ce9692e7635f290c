"""Simulator calibration: measured per-action times in, measured CPU step time out?

``ldt-train`` (ldt's runtime) writes every action of every step to action_times.csv. This bench
runs ``cluster=cpu_demo`` (U-shape, TP 1/2/1) and ``cluster=cpu_vtp train.runtime=ldt`` (1F1B,
TP 2/1/2), turns the steady steps into a :class:`ldt.plan.calibrate.Calibration` (the action lists
executed, mean time per (stage, op), stage start offsets) and replays it in the simulator.

Each config runs twice: the calibration comes from the first run and predicts the second (a
prediction of a run it has not seen, not a replay of its own input); the in-sample error of
the second run replayed on itself is shown next to it. Both runs put every rank on a host of
its own CPU quota (``bench.common.train_on_hosts``, ``HOST_CPUS`` cores each): with 4-5 ranks
on this machine's 2 shared cores an action's time depended on how many other stages ran at
once, and a stage idle in a bubble lent its core to the busy ones, so the error followed the
machine's load (issue #45: +2.6% / +2.7% one day, +9.5% / +15.4%, -0.3% / -22.2% and +32%
on others, with the same code).

Measured target: the median over steady steps of the schedule span (earliest stage's step start
to the last action's end, on the host clock). That is what the simulator's iteration_time
models; metrics.csv's step_time_s also contains the gradient norm all-reduce and the AdamW step,
which no schedule model covers (shown for reference).

Two predictions:
* ``compute only``: computes at their mean times, messages free, all stages start together;
* ``full`` (the headline figure): also the communication actions' own measured times (a WAIT
  from when its message could first have arrived) and the stage start offsets.
"""

from __future__ import annotations

import csv
import os
import tempfile

from bench.common import HOST_CPUS, emit, machine_load, median, train_on_hosts
from ldt.plan import calibrate

STEPS, SKIP = 23, 3  # 20 steady steps after 3 warm-up steps
# (name, overrides, world size: one host per rank)
RUNS = [("cpu_demo", ["cluster=cpu_demo"], 4),
        ("cpu_vtp", ["cluster=cpu_vtp", "train.runtime=ldt"], 5)]

# bench/RESULTS.md's summary rows (bench.summary): (figure, value, goal), templates over the JSON
SUMMARY = [
    ("cpu_demo (U-shape, TP 1/2/1): simulator calibrated on a first run / the second run's "
     "measured span, one rank per host of {cpus_per_rank} core (compute only; in-sample)",
     "{predicted_ms[cpu_demo]:.1f} / {measured_ms[cpu_demo]:.1f} ms, "
     "**{cpu_demo_error:+.1%}** ({cpu_demo_error_compute_only:+.1%}; "
     "{cpu_demo_error_in_sample:+.1%})", "within 10%"),
    ("cpu_vtp (1F1B on ldt's runtime, TP 2/1/2): the same",
     "{predicted_ms[cpu_vtp]:.1f} / {measured_ms[cpu_vtp]:.1f} ms, "
     "**{cpu_vtp_error:+.1%}** ({cpu_vtp_error_compute_only:+.1%}; "
     "{cpu_vtp_error_in_sample:+.1%})", "within 10%"),
]


def _measure(name: str, overrides: list[str], world: int, root: str) -> dict:
    """Two ldt-train runs -> calibrate.compare's figures (calibrated on the first, measured on
    the second) plus the second's in-sample error and metrics.csv's step time."""
    steady = []
    for i in range(2):
        run_dir = os.path.join(root, f"{name}{i}")
        train_on_hosts(run_dir, overrides + [f"train.steps={STEPS}", "train.num_microbatches=4",
                                             "train.tensorboard=false"], world)
        steady.append(calibrate.steady(calibrate.read_action_times(run_dir), SKIP))
    comparison = calibrate.compare(steady[0], measured=steady[1])
    in_sample = calibrate.compare(steady[1])
    with open(os.path.join(run_dir, "metrics.csv"), newline="") as f:
        step_times = [float(r["step_time_s"]) for r in csv.DictReader(f)][SKIP:]
    return {"config": name, "metrics_step_ms": median(step_times) * 1e3, **comparison.summary(),
            "error_in_sample": round(in_sample.error, 4)}


def _print(results: list[dict]) -> None:
    print(f"simulator (calibrated on run 1) vs measured ldt-train step of run 2 ({STEPS - SKIP} "
          f"steady steps each, m=4, means; one rank per host of {HOST_CPUS} core)")
    print(f"{'config':>9} {'measured ms':>12} {'metrics ms':>11} {'sim compute-only':>17} "
          f"{'err':>7} {'sim full':>9} {'err':>7} {'in-sample err':>14}")
    for r in results:
        print(f"{r['config']:>9} {r['measured_ms']:12.1f} {r['metrics_step_ms']:11.1f} "
              f"{r['predicted_compute_only_ms']:17.1f} {r['error_compute_only']:+7.1%} "
              f"{r['predicted_ms']:9.1f} {r['error']:+7.1%} {r['error_in_sample']:+14.1%}")
    for r in results:
        print(f"  {r['config']}: compute ms {r['compute_ms']}\n    communication ms {r['comm_ms']}"
              f"\n    stage start offsets ms {r['start_at_ms']}")


def main() -> dict:
    from ldt.testing.hosts import unavailable

    reason = unavailable()
    if reason:
        print(f"skipped: {reason}")
        return {"bench": "calibration", "skipped": reason}
    load = machine_load()
    with tempfile.TemporaryDirectory(prefix="ldt-calib-") as root:
        results = [_measure(name, overrides, world, root) for name, overrides, world in RUNS]
    _print(results)
    by = {r["config"]: r for r in results}
    return emit({"bench": "calibration", "cpus_per_rank": HOST_CPUS,
                 "cpu_demo_error": round(by["cpu_demo"]["error"], 3),
                 "cpu_vtp_error": round(by["cpu_vtp"]["error"], 3),
                 "cpu_demo_error_in_sample": round(by["cpu_demo"]["error_in_sample"], 3),
                 "cpu_vtp_error_in_sample": round(by["cpu_vtp"]["error_in_sample"], 3),
                 "cpu_demo_error_compute_only": round(by["cpu_demo"]["error_compute_only"], 3),
                 "cpu_vtp_error_compute_only": round(by["cpu_vtp"]["error_compute_only"], 3),
                 "measured_ms": {k: round(v["measured_ms"], 1) for k, v in by.items()},
                 "predicted_ms": {k: round(v["predicted_ms"], 1) for k, v in by.items()},
                 "metrics_step_ms": {k: round(v["metrics_step_ms"], 1) for k, v in by.items()}},
                load_before=load)


if __name__ == "__main__":
    main()
