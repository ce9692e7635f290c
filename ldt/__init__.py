"""ldt: heterogeneous layer-wise disaggregated training over megatron-core.

Importing ``ldt`` is cheap and does not import torch; the names below load on first use.
"""

__version__ = "0.1.0"

_LAZY = {
    "Topology": "ldt.topology",
    "validate": "ldt.validate",
    "initialize_vtp": "ldt.parallel_state",
    "destroy_vtp": "ldt.parallel_state",
    "get_vtp_state": "ldt.parallel_state",
    "is_vtp_stage_rank0": "ldt.parallel_state",
    "get_vtp_size_list": "ldt.parallel_state",
    "get_vtp_stage_ranks": "ldt.parallel_state",
    "get_vtp_my_stage_idx": "ldt.parallel_state",
    "is_vtp_enabled": "ldt.parallel_state",
    "get_vtp_intra_stage_group": "ldt.parallel_state",
    "vtp_allreduce": "ldt.parallel_state",
    "vtp_hierarchical_barrier": "ldt.parallel_state",
    "split_layers": "ldt.layout",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ldt' has no attribute {name!r}")
