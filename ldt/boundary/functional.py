"""The reference implementation's functional boundary API, on :class:`VtpCommunicator`.

As in MindSpeed LDT: receives take (tensor_shape, config, async_op) and return the tensor, or
(tensor, {"recv_prev" | "recv_next": handle}) with async_op; sends take the tensor and return
a list of work handles on a stage's rank 0 and on a rank that sends a fan-out copy of its own
(None elsewhere), so callers ``handles.extend()``.
Keywords pick the channel: ``group`` (a group or a list of groups) with ``next_rank`` /
``prev_rank`` (a global rank or a list, one per group). Without them, or with megatron's
pipeline group (ldt's StagePipelineGroup), the stage boundary to the neighbouring stage's
leader is used. ``state=`` / ``observers=`` go to the VtpCommunicator. With sequence
parallelism or variable sequence lengths, sends need the stage's ``config`` too (every rank of
the stage calls them: the leader gathers the sequence; the shape goes first).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ldt.boundary.communicator import BACKWARD, FORWARD, VtpCommunicator
from ldt.boundary.work import Landing, SendWork
from ldt.config import ConfigError
from ldt.groups.cross_stage import StagePipelineGroup
from ldt.topology.routes import DATA_TAGS

__all__ = ["vtp_recv_backward", "vtp_recv_forward", "vtp_send_backward", "vtp_send_forward"]


def vtp_recv_forward(tensor_shape, config, async_op: bool = False, **kwargs):
    """Receive this stage's input activation from the previous stage."""
    return _recv(tensor_shape, config, async_op, FORWARD, kwargs)


def vtp_recv_backward(tensor_shape, config, async_op: bool = False, **kwargs):
    """Receive the gradient of this stage's output from the next stage."""
    return _recv(tensor_shape, config, async_op, BACKWARD, kwargs)


def vtp_send_forward(tensor: torch.Tensor, config=None, **kwargs) -> Optional[list]:
    """Send this stage's output activation to the next stage: this rank's work handles."""
    return _send(tensor, config, FORWARD, kwargs)


def vtp_send_backward(tensor: torch.Tensor, config=None, **kwargs) -> Optional[list]:
    """Send the gradient of this stage's input to the previous stage: this rank's handles."""
    return _send(tensor, config, BACKWARD, kwargs)


def _communicator(config, kwargs: dict) -> tuple[VtpCommunicator, list]:
    """The communicator and the (group, peer rank) routes of one functional call."""
    groups = kwargs.pop("group", None)
    next_rank, prev_rank = kwargs.pop("next_rank", None), kwargs.pop("prev_rank", None)
    comm = VtpCommunicator(config or _SendOnlyConfig(), **kwargs)
    return comm, (groups, next_rank, prev_rank)


def _routes(comm: VtpCommunicator, routing, direction: str, sending: bool) -> list:
    """[(group or None, peer leader rank)]: None means the stage boundary of ``comm``."""
    groups, next_rank, prev_rank = routing
    toward_next = (direction == FORWARD) == sending  # send forward / receive a gradient
    peers = next_rank if toward_next else prev_rank
    default_peer = comm.next_rank if toward_next else comm.prev_rank
    groups = groups if isinstance(groups, (list, tuple)) else [groups]
    if peers is None:
        peers = [default_peer] * len(groups)
    peers = peers if isinstance(peers, (list, tuple)) else [peers]
    if len(groups) == 1 and len(peers) > 1:
        groups = groups * len(peers)
    if len(groups) != len(peers):
        raise ConfigError(f"group= has {len(groups)} groups but the peer ranks are {peers}; "
                          "give one rank per group")
    return [(None if g is None or isinstance(g, StagePipelineGroup) else g, int(r))
            for g, r in zip(groups, peers)]


def _peer_stage(comm: VtpCommunicator, rank: int) -> int:
    info = comm.state.topology.rank_info(rank)
    if not info.is_leader:
        raise ConfigError(f"rank {rank} is not a stage leader; stage boundaries run between "
                          f"leaders (get_vtp_stage_ranks()[stage][0])")
    return info.stage


def _send(tensor: torch.Tensor, config, direction: str, kwargs: dict) -> Optional[list]:
    comm, routing = _communicator(config, kwargs)
    sharded = comm.layout.sharded  # sequence parallel (config= given): every rank gathers
    handles = []
    for group, rank in _routes(comm, routing, direction, sending=True):
        if group is None:  # every rank: it gathers, or sends a fan-out copy of its own
            work = comm.send(tensor, _peer_stage(comm, rank), direction)
            if work is not None:
                handles.append(work)
        elif not comm.state.is_leader:
            continue
        elif sharded:
            raise ConfigError("sequence_parallel=True with group=: ldt gathers the sequence "
                              "only on its own stage boundaries; leave group= out")
        else:  # a group the caller built: send as given, through the host where it is gloo
            payload = tensor.detach()
            if dist.get_backend(group) == "gloo" and payload.device.type != "cpu":
                payload = payload.to("cpu")
            payload = payload.contiguous()
            handles.append(SendWork([dist.isend(payload, dst=rank, group=group,
                                                 tag=DATA_TAGS[direction])], payload))
    return handles if comm.state.is_leader or handles else None


def _recv(tensor_shape, config, async_op: bool, direction: str, kwargs: dict):
    comm, routing = _communicator(config, kwargs)
    routes = _routes(comm, routing, direction, sending=False)
    key = "recv_prev" if direction == FORWARD else "recv_next"
    if all(g is None for g, _ in routes) and len(routes) == 1:
        tensor, work = comm.recv(tensor_shape, _peer_stage(comm, routes[0][1]), direction)
    else:
        if any(g is None for g, _ in routes):
            raise ConfigError("mix of ldt's pipeline group and other groups in group=; give "
                              "only groups you built, or none")
        tensor, work = _recv_over_groups(comm, tensor_shape, routes, direction)
    if async_op:
        return tensor, {key: work}
    work.wait()
    return tensor


def _recv_over_groups(comm: VtpCommunicator, shape, routes, direction: str):
    """Receive over groups the caller built (one irecv per group into one buffer), then the
    stage broadcast, as the reference does."""
    if comm.layout.sharded or comm.layout.variable_seq_lengths:
        raise ConfigError("sequence_parallel / variable_seq_lengths with group=: ldt reshards "
                          "and exchanges shapes only on its own stage boundaries; leave "
                          "group= out")
    dtype = comm.config.pipeline_dtype
    tensor = torch.empty(tuple(shape), dtype=dtype, device=comm.device, requires_grad=True)
    works, staged = [], None
    if comm.state.is_leader:
        target = tensor.detach()
        if any(dist.get_backend(g) == "gloo" for g, _ in routes) and comm.device.type != "cpu":
            staged = target = torch.empty(tuple(shape), dtype=dtype, device="cpu")
        works = [dist.irecv(target, src=rank, group=g, tag=DATA_TAGS[direction]) for g, rank in routes]
    return tensor, comm._recv_work(tensor, works, None, Landing(staged=staged))


class _SendOnlyConfig:
    """Sends need no dtype or shape; the functional send API takes no config."""

    pipeline_dtype = None
    virtual_pipeline_model_parallel_size = None
    sequence_parallel = False
    variable_seq_lengths = False
