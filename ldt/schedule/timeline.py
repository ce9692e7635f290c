"""Draw a simulated iteration: a Chrome trace (open in Perfetto) and a PNG timeline.

Both show what the numbers in :class:`SimResult` hide: which stage idles, when, and waiting for
which micro-batch. matplotlib is imported inside :func:`to_png` (Agg backend) so that importing
``ldt.schedule`` stays light.
"""

from __future__ import annotations

import json
import os

from ldt.schedule.ir import Op
from ldt.schedule.simulate import SimResult

# One colour per compute op: forwards in blues/greens, backwards in oranges/reds.
OP_COLOURS = {
    Op.F: "#4C72B0",
    Op.B: "#DD8452",
    Op.FS: "#55A868",
    Op.FE: "#8172B3",
    Op.BS: "#C44E52",
    Op.BE: "#937860",
}


def _stage_name(stage: int, result: SimResult) -> str:
    ops = {e.action.op for e in result.events if e.stage == stage}
    return f"stage {stage} (edge)" if Op.FS in ops else f"stage {stage}"


def to_chrome_trace(result: SimResult, path: str | os.PathLike[str], us_per_unit: float = 1e6) -> None:
    """Write one complete ("X") event per compute action; ``us_per_unit`` converts sim time to µs.

    The default assumes the cost model is in seconds. Stages become processes (named by metadata
    events, since the trace format wants integer pids), so Perfetto shows one track per stage.
    """
    events: list[dict[str, object]] = []
    for stage in sorted(result.busy):
        events.append({"ph": "M", "name": "process_name", "pid": stage, "tid": 0,
                       "args": {"name": _stage_name(stage, result)}})
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


def to_png(result: SimResult, path: str | os.PathLike[str], title: str) -> None:
    """One row per stage (stage 0 on top), one box per compute action labelled with its micro-batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    stages = sorted(result.busy)
    span = float(result.iteration_time) or 1.0
    fig, ax = plt.subplots(figsize=(max(8.0, min(24.0, 0.25 * len(result.events) ** 0.5 * 4)),
                                    0.6 * len(stages) + 1.6))
    used: set[Op] = set()
    for event in result.events:
        if not event.action.is_compute:
            continue
        start, width = float(event.start), float(event.end - event.start)
        row = len(stages) - 1 - stages.index(event.stage)
        op = event.action.op
        used.add(op)
        ax.broken_barh([(start, width)], (row - 0.4, 0.8), facecolors=OP_COLOURS[op],
                       edgecolors="black", linewidth=0.5)
        if width > 0.012 * span:
            ax.text(start + width / 2, row, str(event.action.mb), ha="center", va="center",
                    fontsize=7, color="white")
    ax.set_yticks(range(len(stages)))
    ax.set_yticklabels([_stage_name(s, result) for s in reversed(stages)])
    ax.set_xlim(0, span)
    ax.set_xlabel("time")
    ax.set_title(f"{title}  (bubble {float(result.bubble_fraction):.1%}, "
                 f"iteration {float(result.iteration_time):.4g})")
    ax.legend(handles=[Patch(color=OP_COLOURS[op], label=op.value) for op in OP_COLOURS if op in used],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(used), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def result_from_measurements(per_stage: list[list[tuple[str, float, float]]],
                             stage_offsets: list[float] | None = None) -> SimResult:
    """A SimResult from measured (action string, start s, end s) per stage, for the same
    trace and PNG as a simulation. Starts are relative to each stage's own step start, shifted
    by ``stage_offsets[stage]`` (its step start after the earliest stage's, when known)."""
    from ldt.schedule.ir import parse_action
    from ldt.schedule.simulate import Event

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
