"""What a stage holds while each of its computations runs, under the schedule a run really
uses: micro-batches per chunk, posted receives, sent tensors the runtime still holds. The
estimate's peak is the fullest of these moments with that chunk's transient on top (each
count at its own maximum overshot: cpu_vtp's middle stage by a receive buffer it never holds
while backwarding).

The moments are read off the action lists the runtime walks (:mod:`ldt.pipeline.forward_backward`:
the U-shape, per-stage DP lanes, ``train.runtime=ldt``): a micro-batch's activations live from
its forward (F, FS; FE for the edge's end chunk) to its backward (B, BE; BS), so the U-shape's
edge holds its start chunk for the whole trip round the ring and its end chunk for one FE->BS,
``train.prefetch`` adds micro-batches in flight, and a VDP stage's lanes each count. A
received tensor occupies a buffer from its RECV (posted early, ``1 + 2 * prefetch`` ahead on
the edge's links) to its WAIT, after which it is the chunk's input (counted with the chunk).
ldt's runtime lets a send go at the first action after it completed, and a send's work
holds its tensor until then: counted through the stage's next :data:`SENDS_OUTLIVE`
computations. Megatron's own 1F1B (a plain pipeline's default runtime) keeps
``min(P - stage, m)`` in flight, as ldt's 1F1B lists do, exchanges without posting ahead, and
keeps one stale tensor (see :func:`_walk`); its interleaved schedule keeps megatron's warm-up count,
``(P - stage - 1) * 2 + (vpp - 1) * P`` forwards plus one, in chunk order, groups of P.
A zero-bubble schedule (``train.schedule=zb``, its lists generated from the run's prices)
also holds W store entries: a micro-batch's from its backward (B, BE; BS) to its W (W, WE;
WS), whose computation is a moment of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ldt.pipeline.forward_backward import lane_schedules, stage_schedules
from ldt.schedule import Op
from ldt.schedule.routing import Lanes
from ldt.schedule.size import runs_on_ldt_runtime


SENDS_OUTLIVE = 2
"""Computations a sent tensor may still be held through on ldt's runtime: a send completes
once the peer posted its receive and took the data, and a peer posts it ahead of the
computation that needs it, so within about two of the peer's computations (a peer with k
times this stage's replicas runs k times fewer: k times as many of this stage's)."""


@dataclass(frozen=True)
class Moment:
    """What a stage holds while one of its computations runs (its transient on top)."""

    chunks: tuple[int, ...]
    """Micro-batches whose activations each chunk holds (one being backwarded included)."""
    recv_buffers: int
    """Posted receives not yet waited."""
    sent: int = 0
    """Sent tensors nothing else keeps, still held by their send's work: on ldt's runtime
    those sent within its last :data:`SENDS_OUTLIVE` computations (an input gradient
    sent back, or a sequence-parallel leader's gathered whole), which may still be crossing."""
    chunk: int = 0
    """The chunk computing (its transient is on top)."""
    wstore: tuple[int, ...] = ()
    """Zero-bubble schedules: per chunk, micro-batches whose backward ran and whose W has
    not (the one a W computes included); empty: none split."""
    w: bool = False
    """The computation is a W (its transient is the W's)."""


@dataclass(frozen=True)
class StageInflight:
    moments: tuple[Moment, ...]
    """Every computation of the stage's busiest lane(s); the peak is at one of them."""

    def peak(self, activations, transients, buffer: int, sent: int, wstore=(),
             wgrad_transients=()) -> Moment:
        """The moment holding the most bytes, with ``activations[c]`` bytes per micro-batch
        of chunk ``c``, ``buffer`` bytes per posted receive, ``sent`` per sent tensor,
        ``wstore[c]`` per W store entry of chunk ``c`` and the transient of the computing
        chunk, ``transients[c]`` (a W's: ``wgrad_transients[c]``), on top."""
        return max(self.moments, key=lambda mo: (
            sum(a * n for a, n in zip(activations, mo.chunks))
            + mo.recv_buffers * buffer + mo.sent * sent
            + (wgrad_transients if mo.w else transients)[mo.chunk]
            + sum(w * n for w, n in zip(wstore, mo.wstore))))

    @property
    def chunks(self) -> tuple[int, ...]:
        """Per chunk, the most micro-batches it ever holds."""
        return tuple(max(n) for n in zip(*(mo.chunks for mo in self.moments)))


def stage_inflight(topo, train, sequence_parallel: bool = False,
                   priced=None) -> dict[int, StageInflight]:
    """Per stage, for ``topo`` trained with ``train`` (its micro-batches, runtime, prefetch,
    schedule); ``sequence_parallel``: the model's (a stage with TP > 1 then gathers what it
    sends); ``priced``: with ``train.schedule=zb``, the prices its order is generated from
    (``ldt.plan.zb_prices.run_prices``)."""
    m = train.num_microbatches
    vpp = topo.split.vpp_size if topo.split is not None and not topo.u_shape else 1
    if vpp > 1:
        return {s: _interleaved(topo.num_stages, s, vpp, m) for s in range(topo.num_stages)}
    schedule, stage_of = _lists(topo, train, priced)
    ldt_runtime = runs_on_ldt_runtime(topo.u_shape, topo.is_vdp, train.runtime, train.schedule)
    out: dict[int, list[Moment]] = {}
    for lane, actions in schedule.items():
        stage = stage_of(lane)
        two = topo.u_shape and stage == 0
        gathers = sequence_parallel and topo.stages[stage].tp > 1
        # a peer with more replicas runs fewer computations a step each: a send to it waits
        # that many more of this lane's computations for its receive
        faster = max(topo.dp_of(p) for p in _peers(topo, stage)) / topo.dp_of(stage)
        outlive = SENDS_OUTLIVE * max(1, round(faster))
        out.setdefault(stage, []).extend(_walk(actions, two, ldt_runtime, gathers, outlive))
    return {stage: StageInflight(tuple(moments)) for stage, moments in out.items()}


def _lists(topo, train, priced=None):
    prefetch = train.prefetch if topo.u_shape else 0
    zb = train.schedule == "zb"
    if topo.is_vdp:
        lanes = Lanes(tuple(topo.dp_sizes))
        return (lane_schedules(tuple(topo.dp_sizes), train.num_microbatches, topo.u_shape,
                               prefetch=prefetch, zero_bubble=zb, priced=priced if zb else None),
                lambda lane: lanes.of(lane)[0])
    kind = "ushape" if topo.u_shape else "1f1b"
    return stage_schedules(kind, topo.num_stages, train.num_microbatches, prefetch=prefetch,
                           zero_bubble=zb, priced=priced if zb else None), lambda stage: stage


def _peers(topo, stage: int) -> set[int]:
    return {b for a, b in topo.activation_boundaries() if a == stage} | {
        a for a, b in topo.activation_boundaries() if b == stage} or {stage}


def _walk(actions, two_chunks: bool, ldt_runtime: bool = True,
          gathers: bool = False, outlive: int = 2) -> list[Moment]:
    """The moment of every computation in one lane's action list. A forward's moment counts
    its own micro-batch; a backward's still counts the micro-batch it backwards (its
    activations go as the backward proceeds; the transient measured the same way).

    ldt's runtime posts receives ahead (RECV .. WAIT) and lets a send go at its first action
    after the send completed, so a tensor only its send holds (an input gradient; a forward
    output is the chunk's until its backward, long after its send) is counted through the
    next computation, which the transfer may overlap, and not after; megatron's own 1F1B (a
    plain pipeline's default runtime) receives right before the computation that needs the
    tensor and waits for each send before it goes on, so neither
    buffers nor sent tensors outlive an exchange there: the one being consumed is the
    chunk's input (in its activations) or its output gradient (in the transient). Its loop
    keeps one tensor of the last exchange, though (measured: cpu_vtp's three stages): after
    the first backward of a step, a forward runs while the loop's ``output_tensor`` still
    names the output it last backwarded, and a backward while ``input_tensor_grad`` names
    the input gradient it last sent (each is reassigned when the call returns).

    A sequence-parallel stage's leader (``gathers``) sends a whole ``[s, b, h]`` it gathered
    from the slices, so each of its forward sends is a new tensor from the start (its
    backward sends are gathered wholes too, as every input gradient is counted)."""
    walk = _Walk(two_chunks, ldt_runtime, outlive,
                 {a.op for a in actions if a.op in (Op.SEND_F, Op.SEND_B)})
    if any(a.op in (Op.W, Op.WE, Op.WS) for a in actions):
        walk.wstore = [0, 0] if two_chunks else [0]
    for a in actions:
        walk.step(a.op, gathers)
    return walk.moments


class _Walk:
    """The counts along one lane's action list, and the moments taken so far."""

    def __init__(self, two_chunks: bool, ldt_runtime: bool, outlive: int, sends: set) -> None:
        self.two_chunks, self.ldt_runtime, self.sends = two_chunks, ldt_runtime, sends
        self.held = self.end = self.buffers = self.sent = self.backwards = 0
        self.wstore: Optional[list[int]] = None  # per chunk, once the lane has a W op
        self.recent = [0] * outlive  # sent before each of the last computations
        self.moments: list[Moment] = []

    def step(self, op: Op, gathers: bool) -> None:
        if op in (Op.F, Op.FS):
            self.held += 1
            self._moment(Op.SEND_F)
        elif op is Op.FE:
            self.end += 1
            self._moment(Op.SEND_F, 1)
        elif op in (Op.B, Op.BE):
            self._moment(Op.SEND_B)
            self.held -= 1
            self.backwards += 1
            self._store(0, 1)
        elif op is Op.BS:
            self._moment(Op.SEND_B, 1)
            self.end -= 1
            self._store(1, 1)
        elif op in (Op.W, Op.WE, Op.WS):  # W frees its entry as it runs
            chunk = 1 if op is Op.WS else 0
            self._moment(None, chunk, w=True)
            self._store(chunk, -1)
        elif op is Op.SEND_F and gathers:
            self.sent += 1  # a sequence-parallel leader sends the whole it gathered: a new tensor
        elif op is Op.SEND_B:
            self.sent += 1
        elif op in (Op.RECV_F, Op.RECV_B):
            self.buffers += 1
        elif op in (Op.WAIT_F, Op.WAIT_B):
            self.buffers -= 1

    def _store(self, chunk: int, change: int) -> None:
        if self.wstore is not None:
            self.wstore[chunk] += change

    def _moment(self, stale_op: Optional[Op], chunk: int = 0, w: bool = False) -> None:
        if self.ldt_runtime:
            self.recent.append(self.sent)
            del self.recent[0]
            extra = (self.buffers, sum(self.recent))
            self.sent = 0
        else:
            extra = (0, int(self.backwards > 0 and stale_op in self.sends))
        self.moments.append(Moment((self.held, self.end) if self.two_chunks else (self.held,),
                                   *extra, chunk,
                                   tuple(self.wstore) if self.wstore is not None else (), w))


def _interleaved(p: int, stage: int, vpp: int, m: int) -> StageInflight:
    """Megatron's interleaved 1F1B: its warm-up forwards plus one, chunk k taking forwards
    ``k*P .. k*P + P - 1`` of every group of ``vpp * P``."""
    total = min((p - stage - 1) * 2 + (vpp - 1) * p + 1, m * vpp)
    chunks = [0] * vpp
    for k in range(total):
        chunks[(k // p) % vpp] += 1
    return StageInflight((Moment(tuple(chunks), 2),))
