"""ldt: heterogeneous layer-wise disaggregated training over megatron-core.

Importing ``ldt`` is cheap and does not import torch; the names below load on first use.
"""

__version__ = "0.1.0"

_LAZY = {
    "activate": "ldt.job.megatron",
    "Topology": "ldt.topology.ranks",
    "validate": "ldt.topology.validate",
    "initialize_vtp": "ldt.groups.parallel_state",
    "destroy_vtp": "ldt.groups.parallel_state",
    "get_vtp_state": "ldt.groups.parallel_state",
    "is_vtp_stage_rank0": "ldt.groups.parallel_state",
    "get_vtp_size_list": "ldt.groups.parallel_state",
    "get_vtp_stage_ranks": "ldt.groups.parallel_state",
    "get_vtp_my_stage_idx": "ldt.groups.parallel_state",
    "is_vtp_enabled": "ldt.groups.parallel_state",
    "get_vtp_intra_stage_group": "ldt.groups.parallel_state",
    "vtp_allreduce": "ldt.groups.parallel_state",
    "vtp_hierarchical_barrier": "ldt.groups.parallel_state",
    "split_layers": "ldt.config.layout",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ldt' has no attribute {name!r}")
