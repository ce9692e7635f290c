"""What one node brings to an elastic run: the kind of its devices, how many, how much memory.

A node states it in its environment, next to torchrun's own::

    LDT_NODE_KIND=ascend910b          # a kind of the run's inventory (cluster.inventory)
    LDT_NODE_MEMORY_GIB=32            # optional: memory per device, when it is not the kind's

and the number of devices is the number of processes torchrun starts there
(``--nproc-per-node``, ``LOCAL_WORLD_SIZE``): one per device, as always with torchrun. The
node's index is torchrun's ``GROUP_RANK`` of this round (it changes between rounds).
"""

from __future__ import annotations

import json
import math
import socket
from dataclasses import asdict, dataclass
from typing import Mapping, Optional

from ldt.config import ConfigError

KIND_VAR = "LDT_NODE_KIND"
MEMORY_VAR = "LDT_NODE_MEMORY_GIB"
HOST_MEMORY_VAR = "LDT_NODE_HOST_MEMORY_GIB"


class ElasticError(ConfigError):
    """An elastic world that cannot train (no data owner, no plan, a node misdescribed); the
    message is one line with the reason and what to do."""


@dataclass(frozen=True)
class Node:
    index: int
    """torchrun's GROUP_RANK of this node in this round."""
    host: str
    kind: str
    """The inventory kind of its devices."""
    devices: int
    """Processes torchrun started there (one per device)."""
    memory_gib: Optional[float] = None
    """Memory per device; None: the kind's ``memory_gib``."""
    host_memory_gib: Optional[float] = None
    """The host memory available at its start (``MemAvailable``, or ``LDT_NODE_HOST_MEMORY_GIB``):
    the room for ``train.snapshot_dir``'s snapshots; None: unknown."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "Node":
        return Node(**json.loads(text))

    def describe(self) -> str:
        mem = f", {self.memory_gib:g} GiB" if self.memory_gib is not None else ""
        return f"node {self.index} ({self.host}: {self.devices} x {self.kind}{mem})"


def node_from_env(env: Mapping[str, str], kinds: list[str]) -> Node:
    """This node as its environment describes it; ``kinds``: the inventory's kind names."""
    host = socket.gethostname()
    index, devices = int(env["GROUP_RANK"]), int(env["LOCAL_WORLD_SIZE"])
    kind = env.get(KIND_VAR, "").strip()
    if not kind:
        raise ElasticError(
            f"{KIND_VAR} is not set on node {index} ({host}): with cluster.inventory every "
            f"node names the kind of its devices; start its torchrun with {KIND_VAR}=KIND, "
            f"KIND one of {kinds}")
    if kind not in kinds:
        raise ElasticError(f"{KIND_VAR}={kind!r} on node {index} ({host}) is not a kind of the "
                           f"inventory; use one of {kinds}")
    memory = _gib(env, MEMORY_VAR, index, host, "memory per device), or unset for the kind's")
    host_memory = _gib(env, HOST_MEMORY_VAR, index, host,
                       "host memory), or unset for the host's MemAvailable")
    return Node(index, host, kind, devices, memory,
                available_host_gib() if host_memory is None else host_memory)


def _gib(env: Mapping[str, str], var: str, index: int, host: str, what: str) -> Optional[float]:
    if not env.get(var, "").strip():
        return None
    text = env[var].strip()
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ElasticError(f"{var}={text!r} on node {index} ({host}) must be a number of GiB "
                           f"> 0 ({what}")
    return value


def available_host_gib() -> Optional[float]:
    """This host's ``MemAvailable`` (Linux), GiB; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return round(int(line.split()[1]) / 2**20, 3)
    except (OSError, ValueError, IndexError):
        pass
    return None
