"""Every cloud rank's snapshot part also on another host: who sends to whom, and the transfer.

Who keeps whose part is decided once, at the start (:func:`copies`, from
:func:`ldt.topology.buddies.copy_holders`); after each snapshot a rank's writer thread sends
its part, with the checksums it took, to its holder and keeps the parts of the ranks it holds
for (:func:`exchange`), over a gloo group of its own while training uses the others.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ldt.launch import progress
from ldt.storage import snapshot_files
from ldt.storage.snapshot_parts import META_FILE, STATE_FILE
from ldt.topology.buddies import copy_holders
from ldt.training import flat_state


@dataclass(frozen=True)
class Copies:
    """Where this rank's snapshot part is copied (``holder``, None: nowhere) and whose parts
    it keeps (``writers``), over ``group`` (gloo, its own: the copies travel from the writer
    thread while training uses the others)."""

    holder: Optional[int]
    writers: tuple[int, ...]
    group: object


def copies(topo, distributed_optimizer: bool, timeout_s: float) -> Optional[Copies]:
    """This rank's :class:`Copies` (collective over all ranks): each rank's host is its
    torchrun node (``GROUP_RANK``) or, without torchrun, its host name (the bare launcher's
    ranks are on one host); the data owner's host
    is the U-shape edge's, whose parts are never copied (:mod:`ldt.topology.buddies`).
    None when no rank has a copy to make (one host)."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    here = os.environ.get("GROUP_RANK")  # torchrun's node (and ldt.testing.hosts')
    key = hashlib.sha256((here or socket.gethostname()).encode()).digest()[:7]
    mine = torch.tensor([int.from_bytes(key, "big")], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine, group=group)
    nodes = [f"{int(t.item()):014x}" for t in every]
    owner = nodes[topo.leader(0)] if topo.u_shape else None
    holders = copy_holders(topo, nodes, owner, sharded=distributed_optimizer)
    if not holders:
        dist.destroy_process_group(group)
        return None
    rank = dist.get_rank()
    return Copies(holders.get(rank), tuple(sorted(w for w, h in holders.items() if h == rank)),
                  group)


def exchange(c: Copies, root: str, step: int, meta: bytes, buffer: Optional[torch.Tensor],
             sums: dict, held: snapshot_files.MappedFiles) -> None:
    """Send this rank's part of step ``step`` (``meta`` and the flat ``buffer``, with their
    checksums ``sums``; no buffer and no sums: a part not written, of which no copy is kept)
    to its holder on another host and keep the parts of the ranks it holds for under
    ``root``'s copies, each received straight into the file of its oldest generation (mapped
    in ``held``): every rank takes the same steps, so each copy sent is received. A copy
    travels with its writer's checksums and is kept with them, so it verifies against what
    its writer wrote (the transfer included) and its holder takes no checksum. Sends first,
    then receives, then waits: copies around a ring of hosts never wait on each other."""
    progress.current().begin("copying the snapshot to another host")  # (a drill's point)
    sends = [] if c.holder is None else send_part(meta, sums, buffer, c.holder, c.group)
    failed: Optional[Exception] = None
    for writer in c.writers:
        try:
            keep(c, root, step, writer, held)
        except OSError as exc:  # a full /dev/shm here: the other writers' copies still come
            failed = failed or exc
    for work in sends:
        work.wait()
    if failed is not None:
        raise failed


def keep(c: Copies, root: str, step: int, writer: int, held: snapshot_files.MappedFiles) -> None:
    """Receive ``writer``'s part of step ``step`` (:func:`exchange`) into the copies under
    ``root``; a part its writer did not write is received and dropped (its bytes drained
    when the copy cannot be written, so the next message is the next writer's)."""
    their_meta, their_sums, size = recv_part_head(writer, c.group)
    posted = False  # the receive of the state was posted (it may fail: a writer gone)

    def save(tmp: str) -> dict:
        nonlocal posted
        state = held.of(os.path.join(tmp, STATE_FILE), size, flat_state.as_bytes)
        posted = True
        recv_into(state, writer, c.group)
        with open(os.path.join(tmp, META_FILE), "wb") as f:
            f.write(their_meta)
        return {META_FILE: their_meta, STATE_FILE: state.numpy()}
    try:
        if their_sums:
            snapshot_files.write_in_place(snapshot_files.copies_root(root), step,
                                          snapshot_files.part_name(writer), save,
                                          size + len(their_meta), their_sums)
    finally:
        if not posted:  # (not after a failed receive: its writer is gone, no bytes come)
            recv_into(torch.empty(size, dtype=torch.uint8), writer, c.group)


def send_part(meta: bytes, sums: dict, buffer: Optional[torch.Tensor], dst: int,
              group) -> list:
    """Send a part to global rank ``dst`` in three messages (each costs a rank of 0.3 core
    ~0.1 ms of CPU): the sizes of its meta, its checksums and its state, then the meta and
    the checksums together, then the state buffer as it is (none when it is empty). Works
    to wait."""
    sums_bytes = json.dumps(sums).encode()
    state = torch.empty(0, dtype=torch.uint8) if buffer is None else buffer
    head = torch.tensor([len(meta), len(sums_bytes), state.numel()], dtype=torch.int64)
    works = [dist.isend(head, dst, group=group),
             dist.isend(flat_state.byte_tensor(meta + sums_bytes), dst, group=group)]
    return works + ([dist.isend(state, dst, group=group)] if state.numel() else [])


def recv_part_head(src: int, group) -> tuple[bytes, dict, int]:
    """The first two messages of :func:`send_part` from ``src``: the meta, the checksums and
    the size of the state that comes next (receive it with :func:`recv_into`)."""
    head = torch.zeros(3, dtype=torch.int64)
    dist.recv(head, src, group=group)
    meta_n, sums_n, size = (int(v) for v in head.tolist())
    small = torch.empty(meta_n + sums_n, dtype=torch.uint8)
    recv_into(small, src, group)
    data = bytes(small.numpy())
    return data[:meta_n], json.loads(data[meta_n:]), size


def isend_buffer(data, dst: int, group) -> list:
    """Send ``data`` (bytes, or a uint8 tensor as it is: a part's flat buffer) to global rank
    ``dst``: its length, then its bytes unless it has none (works to wait)."""
    if not isinstance(data, torch.Tensor):
        data = flat_state.byte_tensor(data)
    size = dist.isend(torch.tensor([data.numel()], dtype=torch.int64), dst, group=group)
    return [size, dist.isend(data, dst, group=group)] if data.numel() else [size]


def recv_size(src: int, group) -> int:
    """The length :func:`isend_buffer` sends first."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    return int(size.item())


def recv_into(data: torch.Tensor, src: int, group) -> None:
    """The bytes :func:`isend_buffer` sends after their length, into ``data``."""
    if data.numel():
        dist.recv(data, src, group=group)


def recv_buffer(src: int, group) -> torch.Tensor:
    """What :func:`isend_buffer` sent from ``src``, as a new uint8 tensor."""
    data = torch.empty(recv_size(src, group), dtype=torch.uint8)
    recv_into(data, src, group)
    return data
