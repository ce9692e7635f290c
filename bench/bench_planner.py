"""Planner benchmark: optimality against a truly exhaustive reference, and planning time at scale.

    python -m bench.bench_planner              # both parts, 5 timed runs per large instance
    python -m bench.bench_planner --repeat 9
    python -m bench.bench_planner --part optimality

(a) small instances (up to 12 devices of 2-3 kinds, plain and U-shape; 5 of them with memory
    tight enough that stages must recompute): the planner against the exhaustive reference
    (``ldt.plan.exhaustive``: every stage sequence, TP, per-stage dp, split, prefetch depth and
    recomputation; it shares only the pricing of a fully specified plan and the objective's
    choice), by default (the cheapest within 1% of the fastest) and with ``minimise="cost"``.
    Signed gaps, planner / reference - 1: the picks' time and cost per step, and (objective
    time) the fastest plans' times. A positive gap is a plan the planner misses; a negative one
    a plan outside the reference's space. Both must be 0.0%.
(b) 64, 256, 1024 and 4096 devices of 2-3 kinds (llama_7b), plain and U-shape: planning time,
    the median of ``--repeat`` runs, each with the schedule caches emptied (as in a fresh
    ldt-plan process). Wall seconds are the goal (1024 devices < 1 s, 4096 < 5 s); CPU seconds
    are printed next to them because the machine is shared (the load average is printed too).
    The search's effort is counted in simulated actions, not seconds, so every run plans the
    same plan whatever the load.
Prints tables, then one JSON line (``bench.common.emit``): {"bench": "planner", "gaps": [...],
"worst_gap": ..., "plan_time_s_64": ..., ...}.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common import emit, machine_load
from ldt.plan import Objective, Workload, devices, exhaustive, load_model, plan, step_cost
from ldt.plan.evaluate import lane_schedule, lowered_schedule
from ldt.plan.synthetic import small_model, synthetic_inventory

SMALL = [  # (kinds and counts, edge kind, layers, global batch[, micro-batch, memory GiB])
    ({"a100": 2, "ascend910b": 4}, None, 8, 16),
    ({"a100": 3, "ascend910b": 3, "v100": 2}, None, 8, 16),
    ({"h100": 4, "v100": 4}, None, 8, 8),
    ({"h100": 2, "a100": 4, "v100": 6}, None, 6, 12),
    ({"edge_gpu": 2, "ascend910b": 6}, "edge_gpu", 8, 16),
    ({"edge_gpu": 1, "a100": 2, "ascend910b": 4}, "edge_gpu", 8, 8),
    ({"edge_gpu": 2, "h100": 4, "v100": 4}, "edge_gpu", 6, 8),
    # memory binds: micro-batches of 4 on devices of 4-8 GiB, stages must recompute
    ({"v100": 4, "a100": 2}, None, 6, 16, 4, {"v100": 6, "a100": 7}),
    ({"v100": 4, "a100": 2}, None, 6, 16, 4, {"v100": 5, "a100": 6}),
    ({"v100": 4, "a100": 2}, None, 6, 16, 4, {"v100": 4, "a100": 5}),
    ({"edge_gpu": 1, "v100": 4}, "edge_gpu", 6, 16, 4, {"edge_gpu": 8, "v100": 6}),
    ({"edge_gpu": 2, "a100": 2}, "edge_gpu", 6, 16, 4, {"edge_gpu": 6, "a100": 8}),
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
# figures documents quote from the latest run (bench.summary, tests/test_bench_summary.py)
QUOTES = [
    ("docs/planner.md", "Planning llama_7b on 64 / 256 / 1024 / 4096 devices of 2-3 kinds: "
     "{plan_time_s_64:.2f} / {plan_time_s_256:.2f} / {plan_time_s_1024:.2f} / "
     "{plan_time_s_4096:.2f} s"),
]


def _label(counts: dict[str, int], edge, memory=None) -> str:
    text = " + ".join(f"{n} {k}" for k, n in counts.items())
    text += " (U-shape)" if edge else ""
    return text + (" " + "/".join(f"{g:g}" for g in memory.values()) + " GiB" if memory else "")


def _what(ev) -> str:
    """What the plan uses that the instance is about: per-stage dp, recomputation."""
    p = ev.plan
    out = [f"dp {list(p.stage_dp)}"] if p.stage_dp else []
    return ", ".join(out + [f"{p.stage_names()[i]} {rc.describe()}"
                            for i, rc in enumerate(p.recompute) if rc])


def bench_optimality() -> tuple[list[dict], list[tuple]]:
    rows, table = [], []
    for counts, edge, layers, gbs, *rest in SMALL:
        mbs, memory = rest if rest else (1, None)
        inv = synthetic_inventory(counts, edge=edge, node_size=4, memory_gib=memory)
        model, wl = small_model(layers), Workload(mbs, gbs)
        for objective in (Objective(), Objective("cost")):
            t0 = time.perf_counter()
            planned = plan(inv, model, wl, objective=objective)
            t1 = time.perf_counter()
            brute = exhaustive(inv, model, wl, objective=objective)
            t2 = time.perf_counter()
            time_gap = planned.best.iteration_time / brute.best.iteration_time - 1
            cost_gap = step_cost(planned.best, inv) / step_cost(brute.best, inv) - 1
            fast_gap = (planned.front[0].iteration_time / brute.fastest.iteration_time - 1
                        if objective.minimise == "time" else None)  # cost prunes the fastest
            row = {"instance": _label(counts, edge, memory), "objective": objective.minimise,
                   "pick_time_gap": time_gap, "pick_cost_gap": cost_gap,
                   "fastest_gap": fast_gap, "pick_ms": brute.best.iteration_time * 1e3,
                   "pick_devices": devices(brute.best.plan), "pick_uses": _what(brute.best),
                   "planner_s": t1 - t0, "reference_s": t2 - t1, "simulated": brute.simulated}
            rows.append(row)
            table.append((row["instance"], objective.minimise,
                          f"{planned.best.iteration_time * 1e3:.3f}",
                          f"{brute.best.iteration_time * 1e3:.3f}", f"{time_gap:+.3%}",
                          f"{cost_gap:+.3%}", "-" if fast_gap is None else f"{fast_gap:+.3%}",
                          row["pick_uses"] or "-", f"{t1 - t0:.2f}", f"{t2 - t1:.1f}",
                          str(brute.simulated)))
    return rows, table


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
                         f"{list(best.plan.stage_dp) or best.plan.dp} x ["
                         + " ".join(f"{s.kind}/{s.tp}" for s in best.plan.stages) + "]"))
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
    args.add_argument("--part", choices=["optimality", "scale", "both"], default="both")
    args = args.parse_args(argv if argv is not None else [])
    load = machine_load()
    out: dict = {"bench": "planner"}
    if args.part in ("optimality", "both"):
        gaps, small = bench_optimality()
        print("(a) planner vs the exhaustive reference, same objective (simulated ms of the picks;"
              " signed gaps planner / reference - 1)")
        _print(("instance", "objective", "planner", "reference", "time gap", "cost gap",
                "fastest gap", "reference's pick uses", "plan s", "ref s", "simulated"), small)
        signed = [g for r in gaps for g in (r["pick_time_gap"], r["pick_cost_gap"],
                                            r["fastest_gap"]) if g is not None]
        out.update(gaps=gaps, worst_gap=max(signed, key=abs), gap_min=min(signed),
                   gap_max=max(signed))
    if args.part in ("scale", "both"):
        times, large = bench_scale(args.repeat)
        print(f"\n(b) planning time at scale (llama_7b; median of {args.repeat} runs, caches "
              f"emptied; load average before {load['loadavg']})")
        _print(("devices", "instance", "wall s", "cpu s", "wall range", "same pick",
                "fastest ms", "dev", "pick ms", "dev", "picked stages (dp x kind/tp)"), large)
        out.update({f"plan_time_s_{size}": round(t, 3) for size, t in times.items()})
    return emit(out, load)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
