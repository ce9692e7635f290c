"""Zero-bubble U-shape against today's schedule, measured with ``ldt-train`` on hosts of their
own CPU quota (issue #42, item 5).

Both paths train ``conf/cluster/cpu_demo.yaml`` (U-shape, layout ``Et|tt|tt|tL``: the edge, TP
1, holds the embedding + 1 layer and 1 layer + head + loss; cloud0, TP 2, and cloud1, TP 1,
two layers each: unequal stages) on the default model, the same weights and batches:

* ``auto``: today's U-shape schedule (1F1B-style, the backward whole);
* ``zb``: ``train.schedule=zb``, the order generated from the run's own prices (the cost
  model's nominal CPU figures), the backward split into B and W (docs/zero_bubble.md);
* ``zb_measured``: the same, the order generated from the times the config's first ``auto``
  run measured (``train.cost_run``).

On the 2 shared cores a rank that waits lends its core to one that computes, so a bubble hardly
shows as step time while the zero-bubble runtime's extra work does (docs/zero_bubble.md,
*Measured on CPU*). Here every rank runs on a host of its own (``ldt.testing.hosts``: a network
namespace, started as torchrun starts ranks) with a CPU quota of ``CPUS`` cores, like a device
of its own: an idle rank's time is lost, as on a GPU (needs root; skipped with the reason
elsewhere). m = P = 3 and m = 2P = 6 micro-batches; runs in ABBA order (auto, zb, zb_measured,
then the reverse)
for each m. Figures: the median ``step_time_s`` of ``metrics.csv`` over every step but each
run's first, the median schedule span (``action_times.csv``: the pipeline's part of the step,
no optimizer), and the simulator's replay of each path's first run with that run's own action
times (its iteration time and bubble fraction): how much of the measured difference the
schedule model explains. The same run's measured op and transfer times also give the least
bubble any order of its actions could have (``bubble_least``,
:meth:`ldt.plan.calibrate.Calibration.least_iteration`: micro-batch 0's way to each stage,
the way back, every stage's own work with its sends, waits and start offset as the replay
charges them; today's ops with each backward whole, zero-bubble's split): what a schedule is judged against, since no order goes below it. The same runs again
on even stages (``even_`` keys: TP 1/1/1, 12 layers, layout ``Et|ttttt|ttttt|tL``, 3 ranks),
whose stages are closer to equal, and on cpu_demo with wide layers (``wide_`` keys: hidden
256, FFN 1024), whose weight GEMMs make W about as long as F and B.
"""

from __future__ import annotations

import os
import tempfile

from bench.common import emit, machine_load, median, schedule_spans, spread, step_times

MS, STEPS, ROUNDS = (3, 6), 10, 2
BASE = ["cluster=cpu_demo", f"train.steps={STEPS}", "train.tensorboard=false"]
# name: (overrides, ranks). cpu_demo's TP-2 stage computes ~4.5x longer than the others on
# these hosts (its all-reduces cross hosts), so its bubble is mostly that imbalance, which no
# order removes; with the middle stage at TP 1 the edge's two chunks (the embedding, the head
# and the loss beside a layer each) compute the longest (1 - mean / max busy ~0.4, 2026-12-05);
# "even" gives the cloud stages 5 layers each, near the edge's time (~0.2); "wide" is cpu_demo
# with hidden 256 (FFN 1024): its GEMMs outweigh the per-op overheads, so W takes about as
# long as F and as B, the zero-bubble paper's regime (at hidden 64, W was 4-34% of a backward)
CONFIGS = {"": ([], 4),
           "even_": (["cluster.stages.1.tp=1", "model.num_layers=12",
                      "cluster.layout=Et|ttttt|ttttt|tL"], 3),
           "wide_": (["model.hidden_size=256", "model.ffn_hidden_size=1024"], 4)}
# zb_measured: the order generated from the times the config's first auto run measured
# (train.cost_run), not from the cost model's nominal CPU prices
PATHS = {"auto": ["train.schedule=auto"], "zb": ["train.schedule=zb"],
         "zb_measured": ["train.schedule=zb"]}
# per rank (host): 4 x 0.3 = 1.2 of the 2 cores, room left for other work (bench/common.py)
CPUS = float(os.environ.get("LDT_BENCH_ZB_CPUS", "0.3"))


def _bubbles(key: str, what: str = "bubble_fraction") -> str:
    return " / ".join(f"{{runs[{key}][replay][{p}][{what}]:.3f}}" for p in PATHS)


def _config_rows(prefix: str, label: str) -> list[tuple[str, str, str]]:
    """A second config's two summary rows: its steps, its bubbles."""
    return [
        (f"{label}: step zero-bubble / today's, priced by the cost model / by measured times, "
         "m = 3; m = 6",
         f"**{{ratio_step[{prefix}m3]:.3f}}** / **{{ratio_step_measured[{prefix}m3]:.3f}}**; "
         f"**{{ratio_step[{prefix}m6]:.3f}}** / **{{ratio_step_measured[{prefix}m6]:.3f}}**",
         "<= 0.85 at m = P"),
        ("its bubble fraction, today's / zero-bubble / priced by measured times (the least any "
         "order allows), m = 3; m = 6", _bubbles(f"{prefix}m3") + " ("
         + _bubbles(f"{prefix}m3", "bubble_least") + "); " + _bubbles(f"{prefix}m6") + " ("
         + _bubbles(f"{prefix}m6", "bubble_least") + ")", "zb <= 1/3 of today's")]


# bench/RESULTS.md's summary rows (bench.summary): (figure, value, goal), templates over the JSON
SUMMARY = [
    ("step zero-bubble / today's U-shape (cpu_demo, TP 1/2/1, m = P = 3; m = 2P = 6), one rank "
     "per host of {cpus_per_rank} core (medians); the order priced by the cost model / by a "
     "run's measured times (`train.cost_run`)",
     "**{ratio_step[m3]:.3f}** / {ratio_step_measured[m3]:.3f}; **{ratio_step[m6]:.3f}** / "
     "{ratio_step_measured[m6]:.3f}", "<= 0.85 at m = P"),
    ("the same, schedule span only (no optimizer step); the simulator's replay of the runs",
     "{ratio_span[m3]:.3f}, {ratio_span[m6]:.3f}; {ratio_replay[m3]:.3f}, "
     "{ratio_replay[m6]:.3f}", "-"),
    ("bubble fraction of the replayed runs, today's / zero-bubble / priced by measured times, "
     "m = 3; m = 6 (in brackets, the least any order of each run's measured ops allows)",
     _bubbles("m3") + " (" + _bubbles("m3", "bubble_least") + "); " + _bubbles("m6") + " ("
     + _bubbles("m6", "bubble_least") + ")", "zb <= 1/3 of today's"),
    *_config_rows("even_", "even stages (TP 1/1/1, 12 layers, `Et|ttttt|ttttt|tL`, 3 ranks)"),
    *_config_rows("wide_", "wide layers (cpu_demo TP 1/2/1, hidden 256, FFN 1024: W about as "
                           "long as F and B)"),
]


def _row(label: str, m: int, key: str) -> str:
    return (f"| {label} | {m} | {{ratio_step[{key}]:.3f}} | {{ratio_step_measured[{key}]:.3f}} "
            f"| {_bubbles(key)} | {_bubbles(key, 'bubble_least')} |")


# docs/zero_bubble.md's table of the latest run: steps, bubbles and the least bubbles per config
# and m
QUOTES = [("docs/zero_bubble.md", _row(label, m, f"{prefix}m{m}"))
          for label, prefix in (("cpu_demo TP 1/2/1", ""), ("even TP 1/1/1", "even_"),
                                ("wide TP 1/2/1", "wide_"))
          for m in MS]


def compute_ms(run_dir: str) -> dict:
    """Per stage, per compute op (F, B, W; the edge's FS, BE, ...): the milliseconds one step
    spends in it, median over the steps after the first: where the split's extra work is
    (B + W against today's whole backward)."""
    from collections import defaultdict

    from ldt.plan.calibrate import read_action_times, steady

    per_step: dict = defaultdict(lambda: defaultdict(float))
    for r in steady(read_action_times(run_dir), 1):
        if r.action.is_compute:
            per_step[(r.action.stage, r.action.op.value)][r.step] += r.duration_s * 1e3
    out: dict = {}
    for (stage, op), steps in sorted(per_step.items()):
        out.setdefault(str(stage), {})[op] = round(median(list(steps.values())), 3)
    return out


def measure(tmp: str, m: int, config: str) -> dict:
    """ABBA runs of both paths at ``m`` micro-batches of ``CONFIGS[config]``: step times,
    spans, first-run replays."""
    from bench import common

    times: dict = {p: [] for p in PATHS}
    spans: dict = {p: [] for p in PATHS}
    replay: dict = {}
    compute: dict = {}  # each path's first run
    overrides, ranks = CONFIGS[config]
    order = list(PATHS)
    measured_by = os.path.join(tmp, f"{config}m{m}_auto0")  # the first run of all
    for i in range(ROUNDS):
        for path in (order if i % 2 == 0 else order[::-1]):
            run_dir = os.path.join(tmp, f"{config}m{m}_{path}{i}")
            priced = [f"train.cost_run={measured_by}"] if path == "zb_measured" else []
            common.train_on_hosts(run_dir, BASE + overrides + PATHS[path] + priced
                                  + [f"train.num_microbatches={m}"], ranks, cpus=CPUS)
            times[path] += step_times(run_dir)
            run_spans, summary = schedule_spans(run_dir)
            spans[path] += run_spans
            replay.setdefault(path, summary)
            compute.setdefault(path, compute_ms(run_dir))
    return {"step_s": {p: median(v) for p, v in times.items()},
            "step_s_spread": {p: spread(v) for p, v in times.items()},
            "span_s": {p: median(v) for p, v in spans.items()},
            "replay": {p: {k: replay[p].get(k) for k in
                           ("measured_ms", "predicted_ms", "error", "bubble_fraction",
                            "least_ms", "bubble_least", "busy_ms")} for p in PATHS},
            "compute_ms": compute,
            "steps_measured": {p: len(v) for p, v in times.items()}}


def main() -> dict:
    from ldt.testing.hosts import unavailable

    reason = unavailable()
    if reason:
        print(f"skipped: {reason}")
        return {"bench": "zb", "skipped": reason}
    load = machine_load()
    out: dict = {"bench": "zb", "cpus_per_rank": CPUS, "ratio_step": {},
                 "ratio_step_measured": {}, "ratio_span": {}, "ratio_replay": {}, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="ldt-bench-zb-") as tmp:
        for config, m in ((c, m) for c in CONFIGS for m in MS):
            got = measure(tmp, m, config)
            key = f"{config}m{m}"
            out["runs"][key] = got
            out["ratio_step"][key] = got["step_s"]["zb"] / got["step_s"]["auto"]
            out["ratio_step_measured"][key] = got["step_s"]["zb_measured"] / got["step_s"]["auto"]
            out["ratio_span"][key] = got["span_s"]["zb"] / got["span_s"]["auto"]
            out["ratio_replay"][key] = (got["replay"]["zb"]["predicted_ms"]
                                        / got["replay"]["auto"]["predicted_ms"])
            print(f"{config or 'cpu_demo '}m={m}: step zb {got['step_s']['zb'] * 1e3:.1f} ms / "
                  f"today {got['step_s']['auto'] * 1e3:.1f} ms = {out['ratio_step'][key]:.3f} "
                  f"(priced by measured times {out['ratio_step_measured'][key]:.3f}); span "
                  f"{out['ratio_span'][key]:.3f}; replay {out['ratio_replay'][key]:.3f} "
                  f"(bubble {got['replay']['zb']['bubble_fraction']:.3f} vs "
                  f"{got['replay']['auto']['bubble_fraction']:.3f}; no order of their ops "
                  f"goes below {got['replay']['zb']['bubble_least']:.3f} / "
                  f"{got['replay']['auto']['bubble_least']:.3f}: busy "
                  f"{got['replay']['auto']['busy_ms']} ms); one host of {CPUS} core per "
                  f"rank; compute per step (ms) today {got['compute_ms']['auto']}, zb "
                  f"{got['compute_ms']['zb']}")
    return emit(out, load_before=load)


if __name__ == "__main__":
    main()
