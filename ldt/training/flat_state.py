"""One rank's snapshot state in one flat host buffer: what a snapshot part's ``state.bin`` is.

The state's tensors (parameters, optimizer state, the step) are views of one uint8 buffer, at
offsets aligned to :data:`ALIGN` bytes, filled again in place every step; a part is that
buffer's bytes plus an index (name, dtype, shape, offset) in its ``meta.json``. Writing,
checksumming and sending a part to another host then each take the buffer as it is, with no
per-tensor serialization: ``torch.save`` pickled each of a part's ~100 tensors every step, and
a part of 0.98 MiB in 100 tensors took 3.47 ms to write that way against 0.88 ms as one buffer
(bench_snapshot), most of a snapshot's cost on a host of 0.3 core (docs/elastic.md). The index
is the same every step, so it is made once.
"""

from __future__ import annotations

import json
from typing import Any

import torch

ALIGN = 16  # every dtype's view of the buffer starts at a multiple of its element size
META_ALLOWANCE = 64  # bytes per tensor (at least 16 tensors' worth) for meta.json and the manifest


class FlatState:
    """Host buffers for tensors of these names, shapes and dtypes, all in one ``buffer``."""

    def __init__(self, tensors: dict[str, torch.Tensor], buffer: Any = None):
        """``buffer``: any writable buffer of :func:`layout`'s size to hold them (a mapped
        file, :class:`ldt.storage.snapshot_files.MappedFiles`); None: a new one in memory."""
        self.index, size = layout(tensors)
        self.buffer = torch.zeros(size, dtype=torch.uint8) if buffer is None else \
            as_bytes(buffer)
        if self.buffer.numel() != size:
            raise ValueError(f"a buffer of {self.buffer.numel()} bytes cannot hold a state "
                             f"of {size}")
        self.views = unpack(self.index, self.buffer)

    def fits(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Are these the tensors the buffer was made for (names, shapes, dtypes)?"""
        return tensors.keys() == self.views.keys() and all(
            t.shape == self.views[name].shape and t.dtype == self.views[name].dtype
            for name, t in tensors.items())

    def fill(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy ``tensors`` (any device) into their views (:meth:`fits` them): one foreach
        copy (118 tensors of 1 MiB: 0.13 ms, 0.23 ms as a copy per tensor; tensors of another
        device take torch's per-tensor path inside it)."""
        with torch.no_grad():
            torch._foreach_copy_([self.views[name] for name in tensors], list(tensors.values()))

    def bytes(self) -> Any:
        """The buffer as a buffer-protocol object (no copy), for writing and checksums."""
        return self.buffer.numpy()


def layout(tensors: dict[str, torch.Tensor]) -> tuple[list, int]:
    """The index of a buffer for these tensors (only their names, shapes and dtypes are read:
    fake tensors do) and its size in bytes."""
    index, offset = [], 0
    for name, t in tensors.items():
        index.append([name, _dtype_name(t.dtype), list(t.shape), offset])
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return index, offset


def part_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """What a snapshot part of these tensors takes in files: the buffer, its index (in
    ``meta.json``), and :data:`META_ALLOWANCE` per tensor for the rest of ``meta.json`` and the
    manifest (where the rank sits, a distributed optimizer's spans, two checksums)."""
    index, size = layout(tensors)
    return size + len(json.dumps(index)) + META_ALLOWANCE * max(len(index), 16)


def unpack(index: list, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of ``index`` (:attr:`FlatState.index`) as views of ``buffer`` (uint8)."""
    out = {}
    for name, dtype, shape, offset in index:
        dtype = getattr(torch, dtype)
        size = torch.Size(shape).numel() * dtype.itemsize
        out[name] = buffer[offset:offset + size].view(dtype).view(shape)
    return out


def read(index: list, path: str) -> dict[str, torch.Tensor]:
    """A part's ``state.bin`` at ``path`` as its tensors (views of one buffer read once)."""
    with open(path, "rb") as f:
        return unpack(index, byte_tensor(f.read()))


def as_bytes(buffer: Any) -> torch.Tensor:
    """A writable ``buffer`` as a uint8 tensor over its memory (no copy)."""
    return (torch.frombuffer(buffer, dtype=torch.uint8) if len(buffer)
            else torch.empty(0, dtype=torch.uint8))


def byte_tensor(data: bytes) -> torch.Tensor:
    """``data`` as a uint8 tensor over a writable copy (``torch.frombuffer`` refuses an empty
    buffer, which a part without state has)."""
    return (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data
            else torch.empty(0, dtype=torch.uint8))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
