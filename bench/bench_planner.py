"""Planner benchmark: optimality against brute force, and planning time at scale.

    python -m bench.bench_planner              # both parts, 5 timed runs per large instance
    python -m bench.bench_planner --repeat 9

(a) small instances (up to 12 devices of 2-3 kinds, plain and U-shape): the planner against
    exhaustive search with the same objective (ldt.plan.objective): the fastest plan each finds
    and the plan each picks, by default (the cheapest within 1% of the fastest) and with
    ``minimise="cost"``; the worst relative gap (time for the fastest, cost per step for the
    picks) must stay 0.0%.
(b) 64, 256, 1024 and 4096 devices of 2-3 kinds (llama_7b), plain and U-shape: planning time,
    the median of ``--repeat`` runs, each with the schedule caches emptied (as in a fresh
    ldt-plan process). Wall seconds are the goal (1024 devices < 1 s, 4096 < 5 s); CPU seconds
    are printed next to them because the machine is shared (the load average is printed too).
    The search's effort is counted in simulated actions, not seconds, so every run plans the
    same plan whatever the load.
Prints tables, then one JSON line: {"bench": "planner", "worst_gap": ..., "plan_time_s_64": ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from ldt.plan import Objective, Workload, devices, exhaustive, load_model, plan, step_cost
from ldt.plan.evaluate import lane_schedule, lowered_schedule
from ldt.plan.synthetic import small_model, synthetic_inventory

SMALL = [  # (kinds and counts, edge kind, layers, global batch)
    ({"a100": 2, "ascend910b": 4}, None, 8, 16),
    ({"a100": 3, "ascend910b": 3, "v100": 2}, None, 8, 16),
    ({"h100": 4, "v100": 4}, None, 8, 8),
    ({"h100": 2, "a100": 4, "v100": 6}, None, 6, 12),
    ({"edge_gpu": 2, "ascend910b": 6}, "edge_gpu", 8, 16),
    ({"edge_gpu": 1, "a100": 2, "ascend910b": 4}, "edge_gpu", 8, 8),
    ({"edge_gpu": 2, "h100": 4, "v100": 4}, "edge_gpu", 6, 8),
]
LARGE = {  # size -> [(kinds and counts, edge kind, global batch)]
    64: [({"a100": 32, "ascend910b": 32}, None, 256),
         ({"edge_gpu": 8, "ascend910b": 40, "a100": 16}, "edge_gpu", 256)],
    256: [({"a100": 128, "ascend910b": 96, "h100": 32}, None, 1024),
          ({"edge_gpu": 16, "ascend910b": 160, "a100": 80}, "edge_gpu", 1024)],
    1024: [({"ascend910b": 512, "a100": 384, "h100": 128}, None, 2048),
           ({"edge_gpu": 32, "ascend910b": 640, "h100": 352}, "edge_gpu", 2048)],
    4096: [({"ascend910b": 2048, "a100": 1536, "h100": 512}, None, 8192),
           ({"edge_gpu": 128, "ascend910b": 2560, "h100": 1408}, "edge_gpu", 8192)],
}

# bench/RESULTS.md's summary rows (bench.summary): (figure, value, goal), templates over the JSON
SUMMARY = [
    ("worst gap to exhaustive search, same objective (small instances)", "{worst_gap:.1%}",
     "0.0%"),
    ("planning time, 64 / 256 / 1024 / 4096 devices (worst of plain, U-shape; median)",
     "{plan_time_s_64:.2f} / {plan_time_s_256:.2f} / **{plan_time_s_1024:.2f}** / "
     "**{plan_time_s_4096:.2f}** s", "1024: < 1 s, 4096: < 5 s"),
]


def _label(counts: dict[str, int], edge) -> str:
    text = " + ".join(f"{n} {k}" for k, n in counts.items())
    return text + (" (U-shape)" if edge else "")


def bench_optimality() -> tuple[float, list[tuple]]:
    rows, worst = [], 0.0
    for counts, edge, layers, gbs in SMALL:
        inv = synthetic_inventory(counts, edge=edge, node_size=4)
        model, wl = small_model(layers), Workload(1, gbs)
        for objective in (Objective(), Objective("cost")):
            t0 = time.perf_counter()
            planned = plan(inv, model, wl, objective=objective)
            t1 = time.perf_counter()
            brute = exhaustive(inv, model, wl, objective=objective)
            t2 = time.perf_counter()
            pick_gap = step_cost(planned.best, inv) / step_cost(brute.best, inv) - 1
            fast_gap = (planned.front[0].iteration_time / brute.fastest.iteration_time - 1
                        if objective.minimise == "time" else None)  # cost prunes the fastest
            worst = max(worst, pick_gap, fast_gap or 0.0)
            rows.append((_label(counts, edge), objective.minimise,
                         f"{planned.front[0].iteration_time * 1e3:.3f}",
                         f"{brute.fastest.iteration_time * 1e3:.3f}" if fast_gap is not None
                         else "-", "-" if fast_gap is None else f"{fast_gap:+.3%}",
                         f"{devices(planned.best.plan)}/{devices(brute.best.plan)}",
                         f"{pick_gap:+.3%}", f"{t1 - t0:.2f}", f"{t2 - t1:.1f}",
                         str(brute.plans)))
    return worst, rows


def _fresh_plan(inv, model, wl):
    """One planning run as a fresh ldt-plan process would do it: no schedule cached."""
    lowered_schedule.cache_clear()
    lane_schedule.cache_clear()
    w0, c0 = time.perf_counter(), time.process_time()
    result = plan(inv, model, wl)
    return result, time.perf_counter() - w0, time.process_time() - c0


def bench_scale(repeat: int) -> tuple[dict[int, float], list[tuple]]:
    model, rows, times = load_model("llama_7b"), [], {}
    for size, cases in LARGE.items():
        for counts, edge, gbs in cases:
            inv = synthetic_inventory(counts, edge=edge)
            runs = [_fresh_plan(inv, model, Workload(1, gbs)) for _ in range(repeat)]
            wall = statistics.median(r[1] for r in runs)
            cpu = statistics.median(r[2] for r in runs)
            picks = {r[0].best.plan for r in runs}
            times[size] = max(times.get(size, 0.0), wall)
            result = runs[0][0]
            best, fastest = result.best, result.front[0]
            rows.append((str(size), _label(counts, edge), f"{wall:.2f}", f"{cpu:.2f}",
                         f"{min(r[1] for r in runs):.2f}-{max(r[1] for r in runs):.2f}",
                         "yes" if len(picks) == 1 else "NO",
                         f"{fastest.iteration_time * 1e3:.0f}", str(devices(fastest.plan)),
                         f"{best.iteration_time * 1e3:.0f}", str(devices(best.plan)),
                         f"{best.plan.dp} x [" + " ".join(f"{s.kind}/{s.tp}"
                                                          for s in best.plan.stages) + "]"))
    return times, rows


def _print(head: tuple, rows: list[tuple]) -> None:
    widths = [max(len(str(r[c])) for r in [head, *rows]) for c in range(len(head))]
    for i, r in enumerate([head, *rows]):
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def main(argv=None) -> dict:
    args = argparse.ArgumentParser(prog="bench_planner")
    args.add_argument("--repeat", type=int, default=5, help="timed runs per large instance")
    args = args.parse_args(argv if argv is not None else [])
    load = [round(x, 2) for x in os.getloadavg()]
    worst, small = bench_optimality()
    print("(a) planner vs exhaustive search, same objective (simulated ms; pick: devices "
          "planner/exhaustive and the planner's extra cost per step)")
    _print(("instance", "objective", "fastest", "exhaustive", "gap", "pick dev", "pick gap",
            "plan s", "brute s", "plans"), small)
    times, large = bench_scale(args.repeat)
    print(f"\n(b) planning time at scale (llama_7b; median of {args.repeat} runs, caches "
          f"emptied; load average before {load[0]} / {load[1]} / {load[2]})")
    _print(("devices", "instance", "wall s", "cpu s", "wall range", "same pick",
            "fastest ms", "dev", "pick ms", "dev", "picked stages (dp x kind/tp)"), large)
    after = [round(x, 2) for x in os.getloadavg()]
    out = {"bench": "planner", "worst_gap": worst,
           **{f"plan_time_s_{size}": round(t, 3) for size, t in times.items()},
           "load_before": load, "load_after": after}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
