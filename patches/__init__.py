"""ldt's adapters into megatron-core, installed as ``ldt.patches``.

Every change ldt makes to megatron-core is a :class:`Patch` declared in :data:`REGISTRY`: it
knows what it replaces, can be applied and reverted, and refuses a megatron-core version it was
not written for. Every access to a private megatron-core name lives in this package.
"""

from ldt.patches.registry import (
    MEGATRON_RANGE,
    Patch,
    PatchError,
    apply,
    applied,
    check_megatron_version,
    is_applied,
    revert,
    REGISTRY,
)

__all__ = [
    "MEGATRON_RANGE", "Patch", "PatchError", "REGISTRY", "apply", "applied",
    "check_megatron_version", "is_applied", "revert",
]
