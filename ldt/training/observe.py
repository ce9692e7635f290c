"""Boundary observers: the communication audit and the non-finite check.

Both see every tensor that crosses a stage boundary (:class:`ldt.p2p.BoundaryObserver`):
the audit records what left each stage (``comm_audit.jsonl``: what a data owner checks), the
finite check stops training on a NaN/Inf activation or gradient and says where it came from.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Optional

import torch

KIND = {"F": "activation", "B": "gradient"}


class CommAudit:
    """Appends one JSON line per tensor a stage leader sends across a boundary."""

    def __init__(self, path: str, rank: int):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path, self.rank, self.step = path, rank, 0
        self._file = open(path, "a", buffering=1)

    def new_step(self, step: int) -> None:
        self.step = step

    def on_send(self, src: int, dst: int, direction: str, tensor: torch.Tensor) -> None:
        self._file.write(json.dumps({
            "step": self.step, "rank": self.rank, "src_stage": src, "dst_stage": dst,
            "direction": KIND[direction], "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape), "bytes": tensor.numel() * tensor.element_size(),
        }) + "\n")

    def on_recv(self, src: int, dst: int, direction: str, tensor: torch.Tensor) -> None:
        pass

    def close(self) -> None:
        self._file.close()


class NonFiniteError(FloatingPointError):
    pass


class FiniteCheck:
    """Raises on a received tensor with NaN/Inf, naming stage, direction and micro-batch.

    Messages on one channel arrive in micro-batch order (one per micro-batch and step under
    1F1B and the U-shape), so the k-th message of a step is micro-batch k.
    """

    def __init__(self):
        self.step: Optional[int] = None
        self._seen: Counter = Counter()

    def new_step(self, step: int) -> None:
        self.step, self._seen = step, Counter()

    def on_send(self, src, dst, direction, tensor) -> None:
        pass

    def on_recv(self, src: int, dst: int, direction: str, tensor: torch.Tensor) -> None:
        key = (src, dst, direction)
        index = self._seen[key]
        self._seen[key] += 1
        finite = torch.isfinite(tensor.detach())
        if not bool(finite.all()):
            bad = int((~finite).sum())
            raise NonFiniteError(
                f"non-finite {KIND[direction]} received by stage {dst} from stage {src}: "
                f"{bad} of {tensor.numel()} values are NaN/Inf (step {self.step}, micro-batch "
                f"{index}; message #{index} on this boundary under interleaving). The "
                f"{'forward pass of stage ' + str(src) if direction == 'F' else 'backward pass'} "
                "produced it: lower the learning rate, check the data, or enable grad clipping")
