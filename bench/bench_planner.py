"""Planner benchmark: optimality against brute force, and planning time at scale.

    python -m bench.bench_planner

(a) small instances (up to 12 devices of 2-3 kinds, plain and U-shape): the planner's simulated
    iteration time against exhaustive search's; the worst relative gap must stay within 1%.
(b) 64, 256 and 1024 devices of 2-3 kinds (llama_7b), plain and U-shape: planning time
    (goal: < 5 s for 1024 devices on a 2-core machine).
Prints tables, then one JSON line: {"bench": "planner", "worst_gap": ..., "plan_time_s_64": ...}.
"""

from __future__ import annotations

import json
import time

from ldt.plan import Workload, exhaustive, load_model, plan
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
}


def _label(counts: dict[str, int], edge) -> str:
    text = " + ".join(f"{n} {k}" for k, n in counts.items())
    return text + (" (U-shape)" if edge else "")


def bench_optimality() -> tuple[float, list[tuple]]:
    rows, worst = [], 0.0
    for counts, edge, layers, gbs in SMALL:
        inv = synthetic_inventory(counts, edge=edge, node_size=4)
        model, wl = small_model(layers), Workload(1, gbs)
        t0 = time.perf_counter()
        planned = plan(inv, model, wl).best
        t1 = time.perf_counter()
        brute = exhaustive(inv, model, wl)
        t2 = time.perf_counter()
        gap = planned.iteration_time / brute.best.iteration_time - 1
        worst = max(worst, gap)
        rows.append((_label(counts, edge), layers, f"{planned.iteration_time * 1e3:.3f}",
                     f"{brute.best.iteration_time * 1e3:.3f}", f"{gap:+.3%}", f"{t1 - t0:.2f}",
                     f"{t2 - t1:.1f}", str(brute.plans)))
    return worst, rows


def bench_scale() -> tuple[dict[int, float], list[tuple]]:
    model, rows, times = load_model("llama_7b"), [], {}
    for size, cases in LARGE.items():
        for counts, edge, gbs in cases:
            inv = synthetic_inventory(counts, edge=edge)
            t0 = time.perf_counter()
            result = plan(inv, model, Workload(1, gbs))
            dt = time.perf_counter() - t0
            times[size] = max(times.get(size, 0.0), dt)
            p = result.best.plan
            rows.append((str(size), _label(counts, edge), f"{dt:.2f}", str(p.dp),
                         str(p.num_stages), " ".join(f"{s.kind}/{s.tp}" for s in p.stages),
                         f"{result.best.iteration_time * 1e3:.0f}",
                         f"{result.best.bubble_fraction:.1%}"))
    return times, rows


def _print(head: tuple, rows: list[tuple]) -> None:
    widths = [max(len(str(r[c])) for r in [head, *rows]) for c in range(len(head))]
    for i, r in enumerate([head, *rows]):
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def main() -> dict:
    worst, small = bench_optimality()
    print("(a) planner vs exhaustive search (simulated iteration time, ms)")
    _print(("instance", "layers", "planner", "exhaustive", "gap", "plan s", "brute s", "plans"),
           small)
    times, large = bench_scale()
    print("\n(b) planning time at scale (llama_7b)")
    _print(("devices", "instance", "plan s", "dp", "P", "stages (kind/tp)", "iter ms", "bubble"),
           large)
    out = {"bench": "planner", "worst_gap": worst, "plan_time_s_64": times[64],
           "plan_time_s_256": times[256], "plan_time_s_1024": times[1024]}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
