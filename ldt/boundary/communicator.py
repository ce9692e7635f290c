"""VTP boundary transport: leader send/recv + intra-stage broadcast, with async handles.

A stage's leader (TP rank 0) talks to neighbouring stages' leaders, over that boundary's own
group (see :mod:`ldt.groups.parallel_state`); a fan-out copy goes from a TP rank of the sending
stage straight to one of the receiving stage (:meth:`ldt.topology.routes.Route.fanout_sources`).
After a receive the leader broadcasts inside its TP group (boundary activations and their
gradients are replicated on every TP rank of a stage), or, with sequence parallelism, scatters
the sequence over it; before a send such a stage gathers its sequence slices on the leader
(:mod:`ldt.boundary.sequence`). A boundary the device layer marks host-staged (different device
types) copies to CPU, sends over gloo, and copies back to the device. The handles a transfer
returns (wait semantics, link delay, the boundary's error) are :mod:`ldt.boundary.work`'s.

:class:`VtpCommunicator` subclasses megatron-core's ``P2PCommunicator`` and overrides only
``_communicate``, the one hook every public send/recv method goes through, so megatron's
schedules run unmodified on top of it.
"""

from __future__ import annotations

import math
import time
from typing import Optional, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from ldt.boundary.relay import PieceGather, PieceRelay, flat, split
from ldt.boundary.sequence import SequenceLayout, recv_shape, send_shape
from ldt.boundary.work import BoundaryError, Landing, RecvWork, SendWork, boundary_error
from ldt.config import ConfigError
from ldt.groups.parallel_state import VtpState, get_vtp_state
from ldt.topology.device import rank_device
from ldt.topology.routes import BACKWARD, FORWARD, Route
from ldt.topology.transport import FANOUT, PIECE_UNIT_BYTES, PIECES, WHOLE, Carry

__all__ = ["BACKWARD", "FORWARD", "BoundaryError", "BoundaryObserver", "SendTransform",
           "VtpCommunicator"]


class BoundaryObserver(Protocol):
    """Sees every tensor crossing a boundary on the leader (audit, NaN checks)."""

    def on_send(self, src: int, dst: int, direction: str, tensor: torch.Tensor) -> None: ...

    def on_recv(self, src: int, dst: int, direction: str, tensor: torch.Tensor) -> None: ...


@runtime_checkable
class SendTransform(Protocol):
    """Changes what a rank sends across a boundary, before it sends it (e.g.
    :class:`ldt.boundary.noise.BoundaryNoise`). Subclass it: a stateless transform then
    inherits the no-op :meth:`skip`."""

    def __call__(self, tensor: torch.Tensor, src: int, dst: int,
                 direction: str) -> torch.Tensor: ...

    def skip(self, src: int, dst: int, direction: str) -> None:
        """A message of this rank's stage that another rank of it sends: a stateful transform
        counts it (so the ranks that send copies of one message transform it alike)."""


class VtpCommunicator(P2PCommunicator):
    """Megatron's P2PCommunicator with VTP stage boundaries underneath."""

    # a large message crosses in pieces of about sqrt(bytes * this) (ldt.boundary.relay);
    # both ends of a boundary must use the same value (benchmarks change it on every rank)
    piece_unit_bytes = PIECE_UNIT_BYTES
    # None: the topology's cluster.boundary_fanout (benchmarks compare modes in one world:
    # ``never`` on every rank; other modes need the groups the topology's mode created)
    boundary_fanout: Optional[str] = None

    def __init__(self, config, state: Optional[VtpState] = None,
                 observers: Optional[list[BoundaryObserver]] = None,
                 send_transforms: Optional[list[SendTransform]] = None):
        # Not calling super().__init__: it derives next/prev ranks from pp_group's members,
        # and a VTP pipeline "group" has none; the attributes the schedules read are set here.
        state = state or get_vtp_state()
        check_boundary_config(config)
        topo = state.topology
        self.layout = SequenceLayout.of(config, topo.stages[state.stage].tp)
        self.state, self.config = state, config
        self.pp_group = state.pp_group
        self.virtual_pipeline_model_parallel_size = config.virtual_pipeline_model_parallel_size
        self.next_stage = topo.next_stage(state.stage)
        self.prev_stage = topo.prev_stage(state.stage)
        leaders = topo.leaders(state.info.dp_rank)  # per-stage DP: replica d of the uniform run
        self.next_rank, self.prev_rank = leaders[self.next_stage], leaders[self.prev_stage]
        self.device = rank_device(topo, state.info.rank)  # this node's accelerator index
        self.observers = list(observers or [])
        self._descriptions: dict[tuple, str] = {}  # _describe's, made once per boundary
        # applied by each rank that sends a message before it sends, so observers and the
        # peer see what actually crossed; told (skip) of each message of the stage that this
        # rank does not send
        self.send_transforms = list(send_transforms or [])
        for transform in self.send_transforms:  # refused here, not on a rank that skips
            if not isinstance(transform, SendTransform):
                raise TypeError(f"send_transforms: {transform!r} has no skip(src, dst, "
                                "direction); make it a subclass of ldt.boundary.communicator."
                                "SendTransform (a stateless one inherits a no-op skip)")

    # ---- the one hook megatron's public methods call ---------------------------------------
    def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next,
                     tensor_shape, wait_on_reqs=True):
        handles = {}
        if tensor_send_next is not None:
            work = self.send(tensor_send_next, self.next_stage, FORWARD)
            if work is not None:
                handles["send_next"] = work
        if tensor_send_prev is not None:
            work = self.send(tensor_send_prev, self.prev_stage, BACKWARD)
            if work is not None:
                handles["send_prev"] = work
        recv_prev_tensor = recv_next_tensor = None
        if recv_prev:
            recv_prev_tensor, handles["recv_prev"] = self.recv(tensor_shape, self.prev_stage, FORWARD)
        if recv_next:
            recv_next_tensor, handles["recv_next"] = self.recv(tensor_shape, self.next_stage, BACKWARD)
        if wait_on_reqs:
            for key in ("recv_prev", "recv_next", "send_next", "send_prev"):
                if key in handles:
                    handles[key].wait()
            return recv_prev_tensor, recv_next_tensor, None
        return recv_prev_tensor, recv_next_tensor, handles

    # ---- leader transport --------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, peer_stage: int, direction: str,
             peer_replica: Optional[int] = None) -> Optional[SendWork]:
        """Send to ``peer_stage`` (activations forward, gradients backward); None off-leader.
        Every rank of the stage calls it: a sequence-parallel stage gathers on the leader.
        ``peer_replica``: per-stage DP, the peer stage's replica (default: this rank's)."""
        state, layout = self.state, self.layout
        route = self._route(state.stage, peer_stage, direction, peer_replica, sending=True)
        numel = math.prod(layout.full_shape(tensor.shape))
        how = self._carry(route, numel * tensor.element_size())
        bounds = split(numel, how.pieces)
        # piece by piece, a sequence-parallel leader sends while it still gathers; the send
        # transforms (noise) need the whole tensor first
        gather = (PieceGather(bounds, layout, tensor, state.tp_group, state.stage_ranks,
                              state.stage_ranks.index(state.info.rank))
                  if layout.sharded and how.kind == PIECES and not self.send_transforms
                  else None)
        whole = gather.whole if gather is not None else layout.gather(
            tensor, state.tp_group, state.stage_ranks[0], state.is_leader)
        targets = self._targets(route, how)
        if not targets:
            for transform in self.send_transforms:  # a stateful one counts every message
                transform.skip(route.src_stage, route.dst_stage, direction)
            return None
        group = state.named_groups[route.group] if state.is_leader else None
        # a fan-out copy from a rank beside the leader: its own replica of the whole tensor,
        # through the same transforms (the noise is seeded per pass, channel and message, so
        # every rank of the stage draws the same noise for it)
        payload = (tensor if whole is None else whole).detach()
        for transform in self.send_transforms:
            payload = transform(payload, route.src_stage, route.dst_stage, direction)
        if route.host_staged and gather is None:
            payload = payload.to("cpu", copy=True)
        payload = payload.contiguous()
        if gather is None:
            self._observe_send(route, payload)
        what = self._describe("send", route.src_stage, route.dst_stage, direction, targets[0])
        keep = [payload]
        try:
            works = self._post_sends(payload, route, group, how, bounds, gather, keep, targets)
        except Exception as exc:
            raise boundary_error(what, time.monotonic(), exc) from exc
        if gather is not None:  # the whole tensor is there now
            self._observe_send(route, payload)
        return SendWork(works, keep, what)

    def _targets(self, route: Route, how: Carry) -> list[int]:
        """The ranks this rank sends one message of ``route`` to: a fan-out's copies that
        :meth:`_fanout_sources` gives it, else the receiving leader from the sending leader."""
        if how.kind == FANOUT:
            me = self.state.info.rank
            return [r for r, s in zip(route.receivers, self._fanout_sources(route)) if s == me]
        return [route.dst_rank] if self.state.is_leader else []

    def _fanout_sources(self, route: Route) -> tuple[int, ...]:
        """Per rank across, who sends it its fan-out copy. Both ends ask with the same facts:
        a fan-out joins two stages of TP > 1 where the sender has several ranks, and on such
        stages sequence parallelism is the model's setting (ldt turns it off on TP 1 only)."""
        return route.fanout_sources(whole_on_every_sender=not self.layout.sequence_parallel)

    def _observe_send(self, route: Route, payload: torch.Tensor) -> None:
        if self.state.is_leader:  # what the leader sends (the other fan-out copies are equal)
            for obs in self.observers:
                obs.on_send(route.src_stage, route.dst_stage, route.direction, payload)

    def _post_sends(self, payload, route: Route, group, how: Carry, bounds, gather,
                    keep: list, targets: list[int]) -> list:
        """This rank's isends of one message along ``route`` to ``targets``, as ``how`` says."""
        works = []
        if self.layout.variable_seq_lengths:  # the shape first, as megatron does
            work, buf = send_shape(payload.shape, route.dst_rank, group, route.direction,
                                   "cpu" if route.host_staged else payload.device)
            works.append(work)
            keep.append(buf)
        if how.kind == FANOUT:  # straight to TP ranks across (ldt.boundary.relay)
            fan_group = self.state.named_groups[route.fanout_group]
            return works + [dist.isend(payload, dst=r, group=fan_group, tag=route.tag)
                            for r in targets]
        if how.kind == WHOLE:
            return works + [dist.isend(payload, dst=route.dst_rank, group=group, tag=route.tag)]
        for k, (a, b) in enumerate(bounds):  # in pieces, each as soon as it is gathered
            part = flat(payload)[a:b]
            if gather is not None:
                gather.wait_piece(k)
                if route.host_staged:
                    part = part.to("cpu", copy=True)
                    keep.append(part)
            works.append(dist.isend(part, dst=route.dst_rank, group=group, tag=route.tag))
        return works

    def recv(self, shape, peer_stage: int, direction: str,
             peer_replica: Optional[int] = None) -> tuple[torch.Tensor, RecvWork]:
        """Post a receive from ``peer_stage``; the returned tensor is valid after ``wait()``.
        ``shape``: this rank's, as megatron's schedules give it (the sequence slice on a
        sequence-parallel stage); with variable_seq_lengths the peer's message says it.
        ``peer_replica``: per-stage DP, the peer stage's replica (default: this rank's)."""
        if shape is None:
            raise RuntimeError("tensor_shape must be given to receive at a VTP boundary")
        dtype = self.config.pipeline_dtype
        if dtype is None:
            raise ConfigError("config.pipeline_dtype is None; set it to the model's params dtype")
        route = self._route(self.state.stage, peer_stage, direction, peer_replica,
                            sending=False)
        leader, layout = self.state.is_leader, self.layout
        # with variable_seq_lengths the schedule's shape is a placeholder (megatron-core 0.17+
        # passes ``()``): the peer's message says it, and such a boundary never fans out
        if not layout.variable_seq_lengths:
            whole_shape = layout.full_shape(shape)
            how = self._carry(route, math.prod(whole_shape) * dtype.itemsize)
            if how.kind == FANOUT:
                return self._recv_fanout(shape, route)
        what = self._describe("receive", peer_stage, self.state.stage, direction, route.src_rank)
        group = self.state.named_groups[route.group] if leader else None
        if layout.variable_seq_lengths:
            whole_shape = self._recv_shape(route, group, what)
            shape = layout.local_shape(whole_shape)
            how = self._carry(route, math.prod(whole_shape) * dtype.itemsize)
        tensor = torch.empty(tuple(shape), dtype=dtype, device=self.device, requires_grad=True)
        bounds = split(math.prod(whole_shape), how.pieces)
        landing = Landing(layout=layout)
        works = (self._post_recvs(tensor, whole_shape, route, group, bounds, landing, what)
                 if leader else [])
        if len(bounds) > 1:  # relayed piece by piece as the pieces arrive
            landing.relay = PieceRelay(bounds, layout, tensor, landing.full, landing.staged,
                                       self.state.tp_group, self.state.stage_ranks,
                                       self.state.stage_ranks.index(self.state.info.rank))
        return tensor, self._recv_work(tensor, works, route, landing, what)

    def _recv_shape(self, route: Route, group, what: str) -> tuple[int, ...]:
        """variable_seq_lengths: the whole shape the peer leader sent first, on every rank."""
        state = self.state
        try:
            got = (recv_shape(route.src_rank, group, route.direction,
                              "cpu" if route.host_staged else self.device)
                   if state.is_leader else None)
            return self.layout.share_shape(got, state.tp_group, state.stage_ranks[0],
                                           self.device)
        except Exception as exc:
            raise boundary_error(what + " (its shape)", time.monotonic(), exc) from exc

    def _post_recvs(self, tensor, whole_shape, route: Route, group, bounds, landing: Landing,
                    what: str) -> list:
        """The leader's irecvs of one message (in pieces where ``bounds`` has several),
        into the tensor, or its whole-tensor / host buffer (kept in ``landing``)."""
        dtype, target = tensor.dtype, tensor.detach()
        if self.layout.sharded:
            landing.full = target = torch.empty(whole_shape, dtype=dtype, device=self.device)
        if route.host_staged:
            landing.staged = target = torch.empty(whole_shape, dtype=dtype, device="cpu")
        parts = [target] if len(bounds) == 1 else [flat(target)[a:b] for a, b in bounds]
        try:
            return [dist.irecv(part, src=route.src_rank, group=group, tag=route.tag)
                    for part in parts]
        except Exception as exc:
            raise boundary_error(what, time.monotonic(), exc) from exc

    def _route(self, stage: int, peer_stage: int, direction: str,
               peer_replica: Optional[int], sending: bool) -> Route:
        """The plan's route of a message this rank's stage sends to / receives from
        ``peer_stage`` (``peer_replica``: the peer's replica, default this rank's)."""
        mine = self.state.info.dp_rank
        peer = mine if peer_replica is None else peer_replica
        if sending:
            return self.state.plan.route(stage, peer_stage, direction, mine, peer)
        return self.state.plan.route(peer_stage, stage, direction, peer, mine)

    def _carry(self, route: Route, nbytes: int) -> Carry:
        """How a message of ``nbytes`` crosses ``route`` (:meth:`ldt.topology.routes.Route.transport`;
        a shape that crosses first never fans out)."""
        mode = "never" if self.layout.variable_seq_lengths else self.boundary_fanout
        return route.transport(nbytes, self.piece_unit_bytes, mode)

    def _recv_fanout(self, shape, route: Route):
        """Every rank's own receive of its copy (from the sending rank
        :meth:`_fanout_sources` names), no relay: the whole tensor (the sender does not know
        the layout here), of which a sequence-parallel rank keeps its slice."""
        me = self.state.info.rank
        src = self._fanout_sources(route)[route.receivers.index(me)]
        what = self._describe("receive", route.src_stage, route.dst_stage, route.direction,
                              src, direct=True)
        dtype, layout = self.config.pipeline_dtype, self.layout
        tensor = torch.empty(tuple(shape), dtype=dtype, device=self.device, requires_grad=True)
        whole_shape = layout.full_shape(shape)
        full = (torch.empty(whole_shape, dtype=dtype, device=self.device) if layout.sharded
                else None)
        staged = torch.empty(whole_shape, dtype=dtype, device="cpu") if route.host_staged else None
        target = staged if staged is not None else full if full is not None else tensor.detach()
        group = self.state.named_groups[route.fanout_group]
        try:
            works = [dist.irecv(target, src=src, group=group, tag=route.tag)]
        except Exception as exc:
            raise boundary_error(what, time.monotonic(), exc) from exc
        keep_slice = ((layout.tp, self.state.stage_ranks.index(me))
                      if full is not None else None)
        landing = Landing(staged=staged, full=full, keep_slice=keep_slice)
        return tensor, self._recv_work(tensor, works, route, landing, what, direct=True)

    def _recv_work(self, tensor, works: list, route: Optional[Route], landing: Landing,
                   what: str = "receive", direct: bool = False) -> RecvWork:
        """The handle of a posted receive (the one place one is built). ``route``: None for a
        group the caller built (ldt.boundary.functional); ``direct``: every rank received its
        own copy (fan-out), so the stage relays nothing."""
        st = self.state
        return RecvWork(
            tensor, works, tp_group=st.tp_group, leader=st.stage_ranks[0],
            stage_size=1 if direct else len(st.stage_ranks), landing=landing,
            on_ready=None if route is None else self._on_ready(route.src_stage, route.direction),
            what=what, delay_s=0.0 if route is None else route.delay_ms / 1e3)

    def _on_ready(self, peer_stage: int, direction: str):
        """What a completed receive from ``peer_stage`` tells the observers (None: none)."""
        if not self.observers:
            return None
        src, dst = peer_stage, self.state.stage

        def on_ready(t: torch.Tensor) -> None:
            for obs in self.observers:
                obs.on_recv(src, dst, direction, t)

        return on_ready

    def _describe(self, verb: str, src: int, dst: int, direction: str, peer_rank: int,
                  direct: bool = False) -> str:
        """E.g. "boundary 2->0: rank 0 (stage 0 'edge') receive of an activation from stage 2
        'cloud1' (rank 3)"; ``src``/``dst``: the stages the message leaves and reaches. Every
        message gets one for its error; made once per boundary (a message's own Python work is
        its cost at small sizes, bench_p2p)."""
        key = (verb, src, dst, direction, peer_rank, direct)
        if key not in self._descriptions:
            self._descriptions[key] = self._description(*key)
        return self._descriptions[key]

    def _description(self, verb: str, src: int, dst: int, direction: str, peer_rank: int,
                     direct: bool) -> str:
        stages = self.state.topology.stages
        key = (src, dst) if direction == FORWARD else (dst, src)
        what = "an activation" if direction == FORWARD else "a gradient"
        peer, prep = (dst, "to") if verb == "send" else (src, "from")
        me = self.state.stage
        if not self.state.is_leader and not direct:
            verb += f" (through its stage leader, rank {self.state.stage_ranks[0]})"
        return (f"boundary {key[0]}->{key[1]}: rank {self.state.info.rank} (stage {me} "
                f"'{stages[me].name}') {verb} of {what} {prep} stage {peer} "
                f"'{stages[peer].name}' (rank {peer_rank})")


def check_boundary_config(config) -> None:
    """Refuse what the boundary transport cannot carry (before any communication)."""
    if getattr(config, "sequence_parallel", False) and getattr(config, "context_parallel_size",
                                                               1) > 1:
        raise ConfigError("sequence_parallel=True with context_parallel_size > 1: ldt's "
                          "boundaries reshard the sequence over TP only; set "
                          "context_parallel_size=1")

