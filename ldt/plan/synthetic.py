"""Synthetic inventories and a small model, for tests, the benchmark and planner experiments.

Real inventories live in ``conf/inventory/``; these generate clusters of any size from a few
datasheet-like device kinds so that scaling and optimality can be measured without writing
YAML for every size.
"""

from __future__ import annotations

from typing import Optional

from ldt.config import ModelConfig
from ldt.plan.inventory import DeviceKind, Inventory, Link

KIND_SPECS: dict[str, dict] = {
    "h100": dict(device="cuda", tflops=989, memory_gib=80, intra_bw_gbps=450, mfu=0.45),
    "a100": dict(device="cuda", tflops=312, memory_gib=80, intra_bw_gbps=300, mfu=0.5),
    "ascend910b": dict(device="npu", tflops=313, memory_gib=64, intra_bw_gbps=196, mfu=0.42),
    "v100": dict(device="cuda", tflops=125, memory_gib=32, intra_bw_gbps=150, mfu=0.45),
    "edge_gpu": dict(device="cuda", tflops=165, memory_gib=24, intra_bw_gbps=25, mfu=0.45),
}


def synthetic_inventory(counts: dict[str, int], edge: Optional[str] = None,
                        node_size: int = 8, memory_gib: Optional[dict[str, float]] = None,
                        cross_gbps: float = 12.5, cross_latency_us: float = 30.0) -> Inventory:
    """Kinds from :data:`KIND_SPECS` with these counts; every pair of kinds linked (25 GB/s
    inside a kind, ``cross_gbps`` between kinds, a 2 ms WAN to the edge)."""
    kinds = []
    for name, count in counts.items():
        spec = dict(KIND_SPECS[name])
        if memory_gib and name in memory_gib:
            spec["memory_gib"] = memory_gib[name]
        kinds.append(DeviceKind(name=name, count=count, node_size=node_size, reserved_gib=1.0,
                                **spec))
    names = list(counts)
    links = []
    for i, a in enumerate(names):
        for b in names[i:]:
            if a == b:
                links.append(Link(a, b, 25.0, 10.0))
            elif edge in (a, b):
                links.append(Link(a, b, 3.125, 2000.0))
            else:
                links.append(Link(a, b, cross_gbps, cross_latency_us))
    label = "+".join(f"{c}x{n}" for n, c in counts.items())
    return Inventory(name=label, kinds=kinds, links=links, edge=edge)


def small_model(num_layers: int = 8) -> ModelConfig:
    """A ~0.4B GPT: big enough that compute dominates, small enough for exhaustive search."""
    return ModelConfig(name=f"gpt_small_{num_layers}l", num_layers=num_layers, hidden_size=2048,
                       num_attention_heads=16, ffn_hidden_size=8192, vocab_size=32000,
                       seq_length=2048, params_dtype="bfloat16")
