"""Planner inputs: the cluster inventory (what hardware exists) and the workload (batch, dtype).

An inventory describes hardware, not a pipeline: device *kinds* (how many, how fast, how much
memory, how fast inside a node), *links* between kinds (bandwidth, latency) and, for the U-shape,
which kind is the data owner's *edge*. The planner turns it into a cluster config
(``conf/cluster/*.yaml``). Files live in ``conf/inventory/`` and load onto the dataclasses below
through :func:`ldt.config.load.load_group`, so a typo in a key is an error, not a silent default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional

from omegaconf import MISSING

from ldt.config import DEVICE_TYPES, ConfigError, ModelConfig
from ldt.config.load import load_group

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class DeviceKind:
    name: str = MISSING
    """Name used by links, ``edge`` and the generated stage names, e.g. ``a100``."""
    device: str = MISSING
    """Device type as in cluster configs: ``cuda``, ``npu`` or ``cpu``."""
    count: int = MISSING
    """How many devices of this kind exist."""
    tflops: float = MISSING
    """Peak dense TFLOP/s at the training dtype."""
    memory_gib: float = MISSING
    """Device memory per device."""
    intra_bw_gbps: float = MISSING
    """Bandwidth inside a node (NVLink, HCCS, shared memory), GB/s; prices TP all-reduces."""
    node_size: int = 8
    """Devices per node: a TP group never spans nodes, so TP <= node_size."""
    mfu: float = 0.5
    """Fraction of peak a transformer layer's matmuls reach on this kind (calibrate per kind)."""
    tp_efficiency: float = 0.95
    """Compute efficiency kept per doubling of TP (smaller GEMMs): TP t runs at eff**log2(t)."""
    host_bw_gbps: float = 25.0
    """Device <-> host copy bandwidth (PCIe), GB/s; prices host-staged boundaries."""
    reserved_gib: float = 2.0
    """Memory the planner never fills: framework context, workspaces, fragmentation."""
    price_per_hour: Optional[float] = None
    """What one device of this kind costs per hour, in any currency (0: hardware you own).
    State it for every kind or for none; without prices every device costs 1 per hour, so a
    plan's cost is the device-hours it holds (:mod:`ldt.plan.objective`)."""


@dataclass
class Link:
    a: str = MISSING
    """Kind name at one end."""
    b: str = MISSING
    """Kind name at the other end (may equal ``a``: the network between nodes of one kind)."""
    bandwidth_gbps: float = MISSING
    latency_us: float = 0.0


@dataclass
class Inventory:
    name: str = "inventory"
    kinds: List[DeviceKind] = MISSING
    links: List[Link] = field(default_factory=list)
    """Kind pairs that exchange activations. A missing self-link means stages of one kind talk
    over ``intra_bw_gbps``; a missing link between two kinds is an error."""
    edge: Optional[str] = None
    """Kind that is the U-shape's edge (data owner, stage 0); None: no edge, plain pipelines."""

    def __post_init__(self) -> None:
        names = [k.name for k in self.kinds]
        if len(set(names)) != len(names):
            raise ConfigError(f"inventory.kinds names {names} repeat; give every kind its own name")
        for i, k in enumerate(self.kinds):
            _check_kind(i, k)
        for i, link in enumerate(self.links):
            for end in ("a", "b"):
                if getattr(link, end) not in names:
                    raise ConfigError(f"inventory.links[{i}].{end}={getattr(link, end)!r} names no "
                                      f"kind; use one of {names}")
            if link.bandwidth_gbps <= 0 or link.latency_us < 0:
                raise ConfigError(f"inventory.links[{i}] bandwidth_gbps={link.bandwidth_gbps}, "
                                  f"latency_us={link.latency_us}: need bandwidth > 0, latency >= 0")
        priced = [k.name for k in self.kinds if k.price_per_hour is not None]
        if priced and len(priced) < len(names):
            missing = [n for n in names if n not in priced]
            raise ConfigError(f"inventory.kinds {missing}: price_per_hour missing while {priced} "
                              "state one; give every kind a price (0 for hardware you own) or none")
        if self.edge is not None and self.edge not in names:
            raise ConfigError(f"inventory.edge={self.edge!r} names no kind; use one of {names} "
                              "or null for plain pipelines")

    def kind(self, name: str) -> DeviceKind:
        for k in self.kinds:
            if k.name == name:
                return k
        raise ConfigError(f"no device kind {name!r} in inventory {self.name!r}; "
                          f"kinds are {[k.name for k in self.kinds]}")

    def link(self, a: str, b: str) -> Link:
        """The link between two kinds (either direction); self-link defaults to intra-node."""
        for link in self.links:
            if {link.a, link.b} == {a, b}:
                return link
        if a == b:
            return Link(a, a, self.kind(a).intra_bw_gbps, 0.0)
        raise ConfigError(f"inventory {self.name!r} has no link between kinds {a!r} and {b!r}; add "
                          f"'- {{a: {a}, b: {b}, bandwidth_gbps: ..., latency_us: ...}}' to links")

    @property
    def total_devices(self) -> int:
        return sum(k.count for k in self.kinds)

    @property
    def priced(self) -> bool:
        """Whether the kinds state prices (all of them do, or none)."""
        return any(k.price_per_hour is not None for k in self.kinds)

    def price(self, kind: str) -> float:
        """Per device-hour: the stated price, or 1 (cost counts device-hours) without prices."""
        stated = self.kind(kind).price_per_hour
        return 1.0 if stated is None else float(stated)


def _check_kind(i: int, k: DeviceKind) -> None:
    where = f"inventory.kinds[{i}] ({k.name})"
    if k.device not in DEVICE_TYPES:
        raise ConfigError(f"{where}.device={k.device!r}; use one of {', '.join(DEVICE_TYPES)}")
    for key in ("count", "tflops", "memory_gib", "intra_bw_gbps", "node_size", "host_bw_gbps"):
        if not getattr(k, key) > 0:
            raise ConfigError(f"{where}.{key}={getattr(k, key)} must be > 0")
    for key in ("mfu", "tp_efficiency"):
        if not 0 < getattr(k, key) <= 1:
            raise ConfigError(f"{where}.{key}={getattr(k, key)} must be in (0, 1]")
    if not 0 <= k.reserved_gib < k.memory_gib:
        raise ConfigError(f"{where}.reserved_gib={k.reserved_gib} must be in [0, memory_gib)")
    if k.price_per_hour is not None and not k.price_per_hour >= 0:
        raise ConfigError(f"{where}.price_per_hour={k.price_per_hour} must be >= 0 (per "
                          "device-hour)")


@dataclass
class Workload:
    """What one optimizer step processes, and the modelling switches that go with it."""

    micro_batch_size: int = 1
    global_batch_size: int = 64
    """Sequences per optimizer step over all replicas: dp * num_microbatches * micro_batch_size."""
    dtype: Optional[str] = None
    """Training dtype (activations, weights); None takes model.params_dtype."""
    flash_attention: Optional[bool] = None
    """None: price each stage's attention as training runs it there (fused on cuda stages, which
    keeps no s x s scores; megatron's local attention on npu and cpu stages:
    :func:`ldt.config.model.fused_attention`); False: local attention on every stage (a cuda
    host without Transformer Engine); True: fused attention on every stage."""
    u_shape: Optional[bool] = None
    """Plan a U-shape (edge = stage 0); None: a U-shape exactly when the inventory names an edge."""
    edge_min_layers: int = 1
    """Decoder layers the edge keeps in *each* of its chunks: with 0 the cloud would receive raw
    embeddings (trivially invertible to tokens) and send back the head's input."""
    recompute: bool = True
    """Let a stage recompute activations (megatron's, priced as the extra forward) where it
    would not fit otherwise (docs/memory.md); False: only plans that fit without it."""

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1 or self.global_batch_size < self.micro_batch_size:
            raise ConfigError(f"workload micro_batch_size={self.micro_batch_size}, global_batch_size="
                              f"{self.global_batch_size}: need 1 <= micro_batch_size <= global")
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(f"workload.global_batch_size={self.global_batch_size} is not a "
                              f"multiple of micro_batch_size={self.micro_batch_size}; make it one")
        if self.edge_min_layers < 0:
            raise ConfigError(f"workload.edge_min_layers={self.edge_min_layers} must be >= 0")
        if self.dtype is not None and self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"workload.dtype={self.dtype!r}; use one of {sorted(DTYPE_BYTES)}")


def load_inventory(name_or_path: str) -> Inventory:
    """Load ``conf/inventory/<name>.yaml`` (or a path), type-checked against :class:`Inventory`."""
    return load_group(Inventory, name_or_path, "inventory", "inventory")


def load_model(name_or_path: str) -> ModelConfig:
    """Load ``conf/model/<name>.yaml`` (or a path) as a :class:`ModelConfig`."""
    return load_group(ModelConfig, name_or_path, "model", "model file")


def valid_tp_sizes(model: ModelConfig, limit: int) -> list[int]:
    """TP sizes that divide heads, hidden, ffn (and query groups), up to ``limit``; the
    vocabulary is padded to fit (ldt.models.vocab)."""
    dims = [model.num_attention_heads, model.hidden_size, model.ffn_hidden_size or 4 * model.hidden_size]
    if model.num_query_groups:
        dims.append(model.num_query_groups)
    g = 0
    for d in dims:
        g = math.gcd(g, d)
    return [t for t in range(1, min(g, limit) + 1) if g % t == 0]
