"""Device layer: what a stage's device type means for torch and for communication.

One place answers three questions: which torch device and process-group backend a stage uses,
which device types this machine has, and which transport two neighbouring stages' leaders
share (how a message then reaches a TP stage's ranks, whole, in pieces or fanned out, is
:mod:`ldt.topology.routes`' policy).
NCCL and HCCL cannot talk to each other, so a boundary between different device types (or over a
backend without point-to-point) is host-staged: copy to CPU, send over gloo, copy back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

from ldt.config import DEVICE_TYPES, ConfigError

if TYPE_CHECKING:  # torch loads on first use: config checks run before it (ldt-train answers fast)
    import torch

BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}
# Backends whose point-to-point send/recv ldt relies on between stage leaders.
P2P_BACKENDS = frozenset({"nccl", "hccl", "gloo"})


class Transport(str, Enum):
    NATIVE = "native"  # leaders use the stages' own backend
    HOST_STAGED = "host_staged"  # copy to CPU, gloo, copy back


def backend_for(device_type: str) -> str:
    """The process-group backend that ranks of one device type use among themselves."""
    try:
        return BACKENDS[device_type]
    except KeyError:
        raise ConfigError(
            f"device type {device_type!r} is unknown; use one of {', '.join(DEVICE_TYPES)}"
        ) from None


def torch_device(device_type: str, local_rank: int = 0) -> torch.device:
    """The torch device a rank of this device type computes on."""
    import torch

    backend_for(device_type)  # validates the name
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, local_rank)


def local_device_index(devices: Sequence[str], rank: int, local_rank: int) -> int:
    """Which of its node's accelerators ``rank`` computes on: its place among the node's ranks
    of its own device type. ``devices``: every rank's device type. A node runs the contiguous
    ranks ``rank - local_rank ..`` (torchrun and ldt's launcher start them so), so a node of one
    device type gets ``local_rank``, and a node that mixes types (a CUDA stage beside CPU
    stages on one GPU) numbers its accelerators from 0, whatever its CPU ranks took."""
    first = rank - local_rank
    if first < 0 or rank >= len(devices):  # not a contiguous node: trust LOCAL_RANK
        return local_rank
    return sum(1 for r in range(first, rank) if devices[r] == devices[rank])


def rank_device(topology, rank: int, local_rank: Optional[int] = None) -> torch.device:
    """The torch device of global ``rank`` of ``topology`` (:func:`local_device_index`);
    ``local_rank``: default ``LOCAL_RANK``, else ``rank`` (every rank on this machine)."""
    devices = [topology.rank_info(r).device for r in range(topology.world_size)]
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    return torch_device(devices[rank], local_device_index(devices, rank, local_rank))


def use_device(device: torch.device) -> None:
    """Make ``device`` this process's current accelerator (what megatron-core allocates on:
    ``torch.cuda.current_device()``); nothing for the CPU."""
    if device.type != "cpu":
        import torch

        getattr(torch, device.type).set_device(device)


def available_device_types() -> frozenset[str]:
    """Device types this machine can run: always ``cpu``, plus the accelerator torch sees.

    Uses ``torch.accelerator`` (which knows CUDA and, with torch_npu loaded, NPU) rather than
    probing vendor libraries by hand. ``LDT_FAKE_DEVICES=cuda,npu`` adds types for planning
    and for tests of the selection logic on machines without them.
    """
    import torch

    found = {"cpu"}
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        found.add(acc.current_accelerator().type)
    elif torch.cuda.is_available():
        found.add("cuda")
    fake = os.environ.get("LDT_FAKE_DEVICES", "")
    found.update(x.strip() for x in fake.split(",") if x.strip())
    return frozenset(found)


def check_devices_present(device_types: Iterable[str], available: frozenset[str] | None = None,
                          stages: Iterable[int] | None = None) -> None:
    """Refuse a cluster that names a device type this machine does not have; ``stages``: the
    stage index of each device type (default 0, 1, ...: every stage's)."""
    device_types = list(device_types)
    for dev in device_types:
        backend_for(dev)
    if available is None and set(device_types) <= {"cpu"}:
        return  # every machine has a CPU: no need to ask torch (and pay for importing it)
    available = available_device_types() if available is None else available
    for i, dev in zip(range(len(device_types)) if stages is None else stages, device_types):
        backend_for(dev)
        if dev not in available:
            raise ConfigError(
                f"cluster.stages[{i}].device={dev!r} but this machine has only "
                f"{sorted(available)}; run that stage on a node with {dev} devices "
                f"(launch with torchrun there) or change its device to one of {sorted(available)}"
            )


@dataclass(frozen=True)
class BoundaryPlan:
    """How the leaders of two neighbouring stages exchange tensors."""

    src_stage: int
    dst_stage: int
    transport: Transport
    backend: str  # backend of the leader group used for this boundary
    delay_ms: float = 0.0
    """Emulated one-way link delay (``cluster.link_delay_ms``; a measurement tool, 0: off)."""

    @property
    def host_staged(self) -> bool:
        return self.transport is Transport.HOST_STAGED


def plan_boundary(src_stage: int, src_device: str, dst_stage: int, dst_device: str,
                  force_host_staging: bool = False, delay_ms: float = 0.0) -> BoundaryPlan:
    """Native when both sides share a device type with point-to-point support, else host-staged."""
    src_backend = backend_for(src_device)
    backend_for(dst_device)  # validates the name
    native = (
        not force_host_staging
        and src_device == dst_device
        and src_backend in P2P_BACKENDS
    )
    if native:
        return BoundaryPlan(src_stage, dst_stage, Transport.NATIVE, src_backend, delay_ms)
    return BoundaryPlan(src_stage, dst_stage, Transport.HOST_STAGED, "gloo", delay_ms)
