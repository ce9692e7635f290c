"""Draw a simulated (or measured) iteration: a Chrome trace (open in Perfetto) and a PNG timeline.

Both show what the numbers in :class:`SimResult` hide: which stage idles, when, and waiting for
which micro-batch. matplotlib is imported inside :func:`to_png` (Agg backend) so that importing
``ldt.schedule`` stays light. Stages are named by their cluster names where the caller knows
them (``stage_names``); times are seconds unless ``time_unit=None`` (a unit-cost model).
"""

from __future__ import annotations

import json
import os
from typing import Sequence

from ldt.schedule.ir import Op, parse_action
from ldt.schedule.simulate import Event, SimResult

# One colour per compute op: forwards in blues/greens, backwards in oranges/reds, the deferred
# weight gradients (zero-bubble) in grey, pink and khaki.
OP_COLOURS = {
    Op.F: "#4C72B0",
    Op.B: "#DD8452",
    Op.FS: "#55A868",
    Op.FE: "#8172B3",
    Op.BS: "#C44E52",
    Op.BE: "#937860",
    Op.W: "#8C8C8C",
    Op.WS: "#DA8BC3",
    Op.WE: "#CCB974",
}


# What each op means, for the legend (a reader of a PNG has no glossary at hand).
OP_MEANINGS = {
    Op.F: "F: forward of the stage's layers",
    Op.B: "B: backward of the stage's layers",
    Op.FS: "FS: edge forward, start chunk (embedding + first layers)",
    Op.FE: "FE: edge forward, end chunk (last layers + head + loss)",
    Op.BS: "BS: edge backward of the end chunk (starts the backward)",
    Op.BE: "BE: edge backward of the start chunk (ends the backward)",
    Op.W: "W: weights' gradient of a B, deferred (zero-bubble)",
    Op.WS: "WS: weights' gradient of BS (end chunk), deferred",
    Op.WE: "WE: weights' gradient of BE (start chunk), deferred",
}


def _stage_name(stage: int, result: SimResult, names: Sequence[str] | None = None,
                rows: str = "stage") -> str:
    """``stage 0: edge`` with a cluster name, else ``stage 0 (edge)`` for the U-shape's edge
    (``rows="lane"``: a per-stage DP run's rows are its lanes, ``lane 2: cloud r1``)."""
    if names is not None and stage < len(names):
        return f"{rows} {stage}: {names[stage]}"
    ops = {e.action.op for e in result.events if e.stage == stage}
    return f"stage {stage} (edge)" if Op.FS in ops else f"stage {stage}"


def _time_scale(span: float, time_unit: str | None) -> tuple[float, str]:
    """(factor, unit name) that shows a span in seconds as s, ms or µs."""
    if time_unit is None:
        return 1.0, "cost-model units"
    for factor, name in ((1.0, "s"), (1e3, "ms"), (1e6, "µs")):
        if span * factor >= 1.0:
            return factor, name
    return 1e6, "µs"


def to_chrome_trace(result: SimResult, path: str | os.PathLike[str], us_per_unit: float = 1e6,
                    stage_names: Sequence[str] | None = None, rows: str = "stage") -> None:
    """Write one complete ("X") event per compute action; ``us_per_unit`` converts sim time to µs.

    The default assumes the cost model is in seconds. Stages become processes (named by metadata
    events, since the trace format wants integer pids), so Perfetto shows one track per stage.
    """
    events: list[dict[str, object]] = []
    for stage in sorted(result.busy):
        events.append({"ph": "M", "name": "process_name", "pid": stage, "tid": 0,
                       "args": {"name": _stage_name(stage, result, stage_names, rows)}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": stage, "tid": 0,
                       "args": {"sort_index": stage}})
    for event in result.events:
        if not event.action.is_compute:
            continue
        events.append({
            "ph": "X",
            "name": str(event.action),
            "cat": event.action.op.value,
            "pid": event.stage,
            "tid": 0,
            "ts": float(event.start) * us_per_unit,
            "dur": float(event.end - event.start) * us_per_unit,
            "args": {"microbatch": event.action.mb, "op": event.action.op.value},
        })
    with open(path, "w", encoding="utf-8") as handle:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, handle)


def to_png(result: SimResult, path: str | os.PathLike[str], title: str, *,
           stage_names: Sequence[str] | None = None, time_unit: str | None = "s",
           rows: str = "stage") -> None:
    """One row per stage (stage 0 on top), one box per compute action labelled with its
    micro-batch; the legend says what each op is; saved with every label inside the image."""
    import matplotlib.pyplot as plt

    fig = draw(result, title, stage_names=stage_names, time_unit=time_unit, rows=rows)
    fig.savefig(path, dpi=120, bbox_inches="tight", pad_inches=0.15)
    plt.close(fig)


def draw(result: SimResult, title: str, *, stage_names: Sequence[str] | None = None,
         time_unit: str | None = "s", rows: str = "stage"):
    """The figure :func:`to_png` saves (the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    stages = sorted(result.busy)
    span = float(result.iteration_time) or 1.0
    scale, unit = _time_scale(span, time_unit)
    fig, ax = plt.subplots(figsize=(max(8.0, min(24.0, 0.25 * len(result.events) ** 0.5 * 4)),
                                    0.6 * len(stages) + 2.4), layout="constrained")
    used: set[Op] = set()
    for event in result.events:
        if not event.action.is_compute:
            continue
        start, width = float(event.start) * scale, float(event.end - event.start) * scale
        row = len(stages) - 1 - stages.index(event.stage)
        op = event.action.op
        used.add(op)
        ax.broken_barh([(start, width)], (row - 0.4, 0.8), facecolors=OP_COLOURS[op],
                       edgecolors="black", linewidth=0.5)
        if width > 0.012 * span * scale:
            ax.text(start + width / 2, row, str(event.action.mb), ha="center", va="center",
                    fontsize=7, color="white")
    ax.set_yticks(range(len(stages)))
    ax.set_yticklabels([_stage_name(s, result, stage_names, rows) for s in reversed(stages)])
    ax.set_ylim(-0.6, len(stages) - 0.4)
    ax.set_xlim(0, span * scale * 1.005)  # the last box's right edge stays visible
    ax.set_xlabel(f"time ({unit})")
    ax.set_ylabel(f"pipeline {rows}")
    iteration = f"{span * scale:.4g} {unit}" if time_unit is not None else f"{span:.4g}"
    ax.set_title(f"{title}\n(bubble {float(result.bubble_fraction):.1%}, iteration {iteration})")
    handles = [Patch(color=OP_COLOURS[op], label=OP_MEANINGS[op])
               for op in OP_COLOURS if op in used]
    fig.legend(handles=handles, loc="outside lower left", ncol=min(2, len(handles)),
               frameon=False, fontsize=8, title_fontsize=8, alignment="left",
               title="box number = micro-batch; gaps = waiting for a neighbour or idle "
                     "(sends, receives and waits are not drawn)")
    return fig


def median_step(per_stage: Sequence[Sequence[tuple[float, Sequence]]], one_clock: bool) -> int:
    """The index of the step with the median measured span (of ``[stage][step] -> (step start,
    [(action, start_s, end_s)])``): the step to draw, since the first carries warm-up and the
    last is not more typical than any other. With one clock (one host) a step spans from the
    earliest stage start to the latest action end; otherwise the longest stage's own span."""
    def span(i: int) -> float:
        ends = [max((end for _, _, end in steps[i][1]), default=0.0) for steps in per_stage]
        if not one_clock:
            return max(ends)
        starts = [steps[i][0] for steps in per_stage]
        return max(s + e for s, e in zip(starts, ends)) - min(starts)

    order = sorted(range(len(per_stage[0])), key=span)
    return order[(len(order) - 1) // 2]


def result_from_measurements(per_stage: list[list[tuple[str, float, float]]],
                             stage_offsets: list[float] | None = None) -> SimResult:
    """A SimResult from measured (action string, start s, end s) per stage, for the same
    trace and PNG as a simulation. Starts are relative to each stage's own step start, shifted
    by ``stage_offsets[stage]`` (its step start after the earliest stage's, when known)."""
    events, busy = [], {}
    for stage, rows in enumerate(per_stage):
        busy[stage] = 0.0
        shift = stage_offsets[stage] if stage_offsets else 0.0
        for text, start, end in rows or []:
            action = parse_action(text)
            events.append(Event(stage, action, start + shift, end + shift))
            if action.is_compute:
                busy[stage] += end - start
    span = max((e.end for e in events), default=0.0)
    bubble = 1.0 - sum(busy.values()) / (len(busy) * span) if span > 0 else 0.0
    return SimResult(iteration_time=span, busy=busy, bubble_fraction=bubble, peak_inflight={},
                     peak_inflight_end={}, events=events)
