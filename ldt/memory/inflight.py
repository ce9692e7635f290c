"""How many micro-batches each chunk of a stage keeps alive, and how many received tensors
wait in boundary buffers, under the schedule a run really uses.

The count is read off the action lists the runtime walks (:mod:`ldt.schedule.forward_backward`:
the U-shape, per-stage DP lanes, ``train.runtime=ldt``): a micro-batch's activations live from
its forward (F, FS; FE for the edge's end chunk) to its backward (B, BE; BS), so the U-shape's
edge holds its start chunk for the whole trip round the ring and its end chunk for one FE->BS,
``train.prefetch`` adds micro-batches in flight, and a VDP stage counts its busiest lane. A
received tensor occupies a buffer from its RECV (posted early, ``1 + 2 * prefetch`` ahead on
the edge's links) to its WAIT, after which it is the chunk's input (counted with the chunk).
Megatron's own 1F1B (a plain pipeline's default runtime) keeps ``min(P - stage, m)`` in flight,
which is what ldt's 1F1B lists hold too; its interleaved schedule keeps megatron's warm-up
count, ``(P - stage - 1) * 2 + (vpp - 1) * P`` forwards plus one, in chunk order, groups of P.
"""

from __future__ import annotations

from dataclasses import dataclass

from ldt.schedule import Op


@dataclass(frozen=True)
class StageInflight:
    chunks: tuple[int, ...]
    """Micro-batches whose activations each chunk of the stage holds at its peak."""
    recv_buffers: int
    """Received tensors waiting at once (posted receives not yet consumed), at the peak."""


def stage_inflight(topo, train) -> dict[int, StageInflight]:
    """Per stage, for ``topo`` trained with ``train`` (its micro-batches, runtime, prefetch)."""
    m = train.num_microbatches
    vpp = topo.split.vpp_size if topo.split is not None and not topo.u_shape else 1
    if vpp > 1:
        return {s: _interleaved(topo.num_stages, s, vpp, m) for s in range(topo.num_stages)}
    schedule, stage_of = _lists(topo, train)
    out: dict[int, StageInflight] = {}
    for lane, actions in schedule.items():
        stage = stage_of(lane)
        start, end, buffers = _walk(actions)
        chunks = (start, end) if topo.u_shape and stage == 0 else (start,)
        mine = StageInflight(chunks, buffers)
        old = out.get(stage)
        if old is None or sum(mine.chunks) + mine.recv_buffers > sum(old.chunks) + old.recv_buffers:
            out[stage] = mine
    return out


def _lists(topo, train):
    from ldt.schedule.forward_backward import lane_schedules, stage_schedules

    prefetch = train.prefetch if topo.u_shape else 0
    if topo.is_vdp:
        from ldt.schedule.routing import Lanes

        lanes = Lanes(tuple(topo.dp_sizes))
        return (lane_schedules(tuple(topo.dp_sizes), train.num_microbatches, topo.u_shape,
                               prefetch=prefetch), lambda lane: lanes.of(lane)[0])
    kind = "ushape" if topo.u_shape else "1f1b"
    return stage_schedules(kind, topo.num_stages, train.num_microbatches,
                           prefetch=prefetch), lambda stage: stage


def _walk(actions) -> tuple[int, int, int]:
    """Peak held micro-batches (all chunks / the end chunk) and peak outstanding receives."""
    held = end = buffers = 0
    peak_held = peak_end = peak_buffers = 0
    for a in actions:
        if a.op in (Op.F, Op.FS):
            held += 1
        elif a.op in (Op.B, Op.BE):
            held -= 1
        elif a.op is Op.FE:
            end += 1
        elif a.op is Op.BS:
            end -= 1
        elif a.op in (Op.RECV_F, Op.RECV_B):
            buffers += 1
        elif a.op in (Op.WAIT_F, Op.WAIT_B):
            buffers -= 1
        peak_held, peak_end = max(peak_held, held), max(peak_end, end)
        peak_buffers = max(peak_buffers, buffers)
    return peak_held, peak_end, peak_buffers


def _interleaved(p: int, stage: int, vpp: int, m: int) -> StageInflight:
    """Megatron's interleaved 1F1B: its warm-up forwards plus one, chunk k taking forwards
    ``k*P .. k*P + P - 1`` of every group of ``vpp * P``."""
    total = min((p - stage - 1) * 2 + (vpp - 1) * p + 1, m * vpp)
    chunks = [0] * vpp
    for k in range(total):
        chunks[(k // p) % vpp] += 1
    return StageInflight(tuple(chunks), 2)
