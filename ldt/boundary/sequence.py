"""How a tensor crossing a VTP stage boundary is laid out on the TP ranks of one stage.

Without sequence parallelism a boundary activation (and its gradient) ``[s, b, h]`` is
replicated on every TP rank of a stage: the leader sends it whole and, after a receive,
broadcasts it to its stage. With sequence parallelism (megatron's ``sequence_parallel=True``,
on a stage of TP > 1) each TP rank holds ``[s/TP, b, h]``, the rank's slice of the sequence in
TP-rank order. Stages of a VTP pipeline have different TP sizes, so the slices of two
neighbouring stages do not line up. The boundary keeps its one link between the two leaders:

- sending: the leader *gathers* the slices of its TP group (``dist.gather``: only the leader
  needs the whole tensor) and sends ``[s, b, h]``;
- receiving: the leader receives ``[s, b, h]`` and *scatters* it along the sequence over its
  TP group (where the stage without sequence parallelism broadcasts).

Each side needs only its own layout: the link always carries the whole tensor, so a stage of
TP 1, or without sequence parallelism, sends and receives exactly as before.

With ``variable_seq_lengths=True`` the whole tensor's shape crosses the link first (leader to
leader, as megatron's ``_communicate_shapes`` does, with its own tag per direction on the
boundary's own group, so a two-stage ring, where prev == next, cannot swap them), and the
receiving leader broadcasts it to its stage so every rank can size its slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ldt.config import ConfigError
from ldt.topology.routes import SHAPE_TAGS  # the shape messages' tags (every wire tag is there)


@dataclass(frozen=True)
class SequenceLayout:
    """The boundary layout of one stage: its TP size and whether the sequence is split."""

    tp: int
    sequence_parallel: bool = False
    variable_seq_lengths: bool = False

    @classmethod
    def of(cls, config, tp: int) -> "SequenceLayout":
        """The layout a stage of TP ``tp`` running megatron ``config`` has at its boundaries."""
        sp = bool(getattr(config, "sequence_parallel", False))
        if sp and tp < 2:
            raise ConfigError(f"sequence_parallel=True on a stage of TP {tp}: megatron splits "
                              "the sequence over TP ranks, so it needs TP > 1; turn it off on "
                              "TP 1 stages (ldt's model.sequence_parallel does that itself)")
        return cls(tp, sp, bool(getattr(config, "variable_seq_lengths", False)))

    @property
    def sharded(self) -> bool:
        """Each TP rank holds a slice of the sequence (else: the whole tensor)."""
        return self.sequence_parallel and self.tp > 1

    @property
    def shards(self) -> int:
        return self.tp if self.sharded else 1

    def full_shape(self, local_shape) -> tuple[int, ...]:
        """The whole tensor's shape from one rank's slice shape."""
        shape = tuple(map(int, local_shape))
        return shape if self.shards == 1 else (shape[0] * self.shards,) + shape[1:]

    def local_shape(self, full_shape) -> tuple[int, ...]:
        """One rank's slice shape from the whole tensor's shape."""
        shape = tuple(int(d) for d in full_shape)
        if shape[0] % self.shards:
            raise ConfigError(f"a boundary tensor of sequence length {shape[0]} cannot be split "
                              f"over {self.shards} TP ranks (sequence_parallel=True); use "
                              f"sequence lengths that are multiples of {self.shards}")
        return (shape[0] // self.shards,) + shape[1:]

    # ---- the collectives inside the stage (every rank of the stage calls them) -------------
    def gather(self, tensor: torch.Tensor, group, leader: int,
               is_leader: bool) -> Optional[torch.Tensor]:
        """The whole tensor on the leader (None elsewhere); a slice-holding stage gathers."""
        if not self.sharded:
            return tensor if is_leader else None
        local = tensor.detach().contiguous()
        parts = [torch.empty_like(local) for _ in range(self.tp)] if is_leader else None
        dist.gather(local, gather_list=parts, dst=leader, group=group)
        return torch.cat(parts, dim=0) if is_leader else None

    def distribute(self, full: Optional[torch.Tensor], out: torch.Tensor, group,
                   leader: int) -> None:
        """Fill every rank's ``out`` from the leader's whole tensor ``full``: its sequence
        slice (scatter) or, without sequence parallelism, all of it (broadcast)."""
        if self.tp < 2:
            return
        if not self.sharded:
            dist.broadcast(out, src=leader, group=group)
            return
        parts = list(full.chunk(self.tp, dim=0)) if full is not None else None
        dist.scatter(out, scatter_list=[p.contiguous() for p in parts] if parts else None,
                     src=leader, group=group)

    def share_shape(self, shape: Optional[tuple], group, leader: int,
                    device) -> tuple[int, ...]:
        """The leader's received whole shape, on every rank of the stage."""
        buf = torch.tensor(shape if shape is not None else (0, 0, 0), dtype=torch.int64,
                           device=device)
        if self.tp > 1:
            dist.broadcast(buf, src=leader, group=group)
        return tuple(int(d) for d in buf.tolist())


def send_shape(shape, dst: int, group, direction: str, device):
    """Post the whole tensor's shape to the peer leader; returns (work, the kept buffer).
    ``device``: where the boundary's group takes tensors (the CPU for a host-staged one)."""
    buf = torch.tensor(tuple(shape), dtype=torch.int64, device=device)
    return dist.isend(buf, dst=dst, group=group, tag=SHAPE_TAGS[direction]), buf


def recv_shape(src: int, group, direction: str, device) -> tuple[int, ...]:
    """Receive the shape the peer leader sent before its tensor (blocking, as megatron's
    ``_communicate_shapes``: the receive buffer's size depends on it)."""
    buf = torch.empty(3, dtype=torch.int64, device=device)
    dist.recv(buf, src=src, group=group, tag=SHAPE_TAGS[direction])
    return tuple(int(d) for d in buf.tolist())
