"""Record exactly what crossed the edge's boundaries in a real run, on both sides.

:class:`BoundaryCapture` is a :class:`ldt.boundary.communicator.BoundaryObserver`. On the
cloud's stage leaders
it records every tensor they receive and send (what an honest-but-curious cloud holds); on the
edge's leader it records what the edge sent, so the audit can check the two agree bit for bit.
Each channel ``<side>_<src>-<dst>_<F|B>`` is a raw float32 file plus one JSON line per message
(step, index within the step, shape). Messages on a channel arrive in micro-batch order, so
message ``index`` of ``step`` is micro-batch ``index`` (indices >= m are evaluation passes).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

CAPTURE_DIR = "capture"


class BoundaryCapture:
    """Appends the tensors one leader sends and/or receives to per-channel files."""

    def __init__(self, folder: str, *, sends: bool, recvs: bool):
        os.makedirs(folder, exist_ok=True)
        self.folder, self.sends, self.recvs = folder, sends, recvs
        self.step = 0
        self._index: Counter = Counter()
        self._files: dict = {}

    def new_step(self, step: int) -> None:
        self.step, self._index = step, Counter()

    def on_send(self, src: int, dst: int, direction: str, tensor: torch.Tensor) -> None:
        if self.sends:
            self._write(f"sent_{src}-{dst}_{direction}", tensor)

    def on_recv(self, src: int, dst: int, direction: str, tensor: torch.Tensor) -> None:
        if self.recvs:
            self._write(f"recv_{src}-{dst}_{direction}", tensor)

    def close(self) -> None:
        for data, index in self._files.values():
            data.close()
            index.close()
        self._files = {}

    def _write(self, channel: str, tensor: torch.Tensor) -> None:
        if channel not in self._files:
            path = os.path.join(self.folder, channel)
            self._files[channel] = (open(path + ".f32", "ab"), open(path + ".jsonl", "a"))
        data, index = self._files[channel]
        array = tensor.detach().to("cpu", torch.float32).contiguous().numpy()
        array.tofile(data)
        data.flush()
        index.write(json.dumps({"step": self.step, "index": self._index[channel],
                                "shape": list(array.shape)}) + "\n")
        index.flush()
        self._index[channel] += 1


def capture_observers(rank: int, topo, run_dir: str) -> list:
    """``train_worker``'s ``observe`` hook: leaders of replica 0 record their boundaries."""
    info = topo.rank_info(rank)
    if not info.is_leader or info.dp_rank != 0:
        return []
    edge = info.stage in topo.data_stages()
    folder = os.path.join(run_dir, CAPTURE_DIR)
    return [BoundaryCapture(folder, sends=True, recvs=not edge)]


@dataclass
class Channel:
    """One captured channel: ``tensors[k]`` is message k, ``steps[k]`` / ``indices[k]`` its
    step and index within the step."""

    tensors: torch.Tensor
    steps: np.ndarray
    indices: np.ndarray


def channel_name(side: str, src: int, dst: int, direction: str) -> str:
    return f"{side}_{src}-{dst}_{direction}"


def load_channel(run_dir: str, name: str) -> Channel:
    path = os.path.join(run_dir, CAPTURE_DIR, name)
    if not os.path.exists(path + ".jsonl"):
        raise FileNotFoundError(f"{path}.jsonl: no capture of channel {name} in {run_dir}")
    with open(path + ".jsonl") as f:
        meta = [json.loads(line) for line in f]
    shapes = {tuple(m["shape"]) for m in meta}
    if len(shapes) != 1:
        raise ValueError(f"{path}: messages of several shapes {sorted(shapes)}")
    flat = np.fromfile(path + ".f32", dtype=np.float32)
    tensors = torch.from_numpy(flat).reshape(len(meta), *shapes.pop())
    return Channel(tensors, np.array([m["step"] for m in meta]),
                   np.array([m["index"] for m in meta]))
