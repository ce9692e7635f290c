"""The megatron-core releases ldt supports, and what differs between them, as data.

One place for both: :data:`SUPPORTED` is the range ``pyproject.toml`` pins and the version check
names when it refuses a release (``tests/test_patches.py`` holds the two equal); :data:`RELEASES`
lists the releases of that range that exist, :data:`TESTED` the ones a run proves (CI runs
them: ``make test`` and ``.ci/mcore``; docs/megatron_versions.md's table says what ran where). :data:`CHANGES` names each difference
between those releases that one of ldt's patches follows, the releases where it holds and
where it is in megatron-core; a patch asks :func:`holds` instead of comparing versions itself.
"""

from __future__ import annotations

import functools
from importlib.metadata import PackageNotFoundError, version
from typing import Optional

from packaging.specifiers import SpecifierSet
from packaging.version import Version

# the releases ldt's patches are written for; every other release is refused in one line
SUPPORTED = ">=0.16.0,<0.20"
# the releases of that range that exist (PyPI, 2026-11); a patch targets at least one of them
RELEASES = ("0.16.0", "0.16.1", "0.17.0", "0.17.1", "0.18.0", "0.18.2", "0.19.0", "0.19.2")
# the releases every CI run tests (`make test`: 0.16.1; `.ci/mcore`: the others); the refusal
# names these, so a user knows which releases were actually run, not only allowed
TESTED = ("0.16.1", "0.17.1", "0.18.2", "0.19.2")

# name -> (the releases where it holds, what and where it is in megatron-core)
CHANGES: dict[str, tuple[str, str]] = {
    "backward_step_model_type": (
        "<0.17", "pipeline_parallel.schedules.backward_step(input, output, grad, model_type, "
                 "config); from 0.17 without model_type"),
    "sharding_errors_returned": (
        ">=0.17", "dist_checkpointing.validation._validate_sharding_for_key returns its "
                  "errors as a list; 0.16 raises them"),
    "results_queue_mp_mode": (
        ">=0.17", "dist_checkpointing.strategies.filesystem_async.get_write_results_queue("
                  "mp_mode='spawn'); 0.16: _get_write_results_queue() always spawns"),
    "te_general_gemm_undefined": (
        "<0.17", "transformer.moe.moe_utils leaves te_general_gemm undefined without "
                 "Transformer Engine, and the router's gating reads it; 0.17 defines it None"),
    "moe_metrics_tracker": (
        ">=0.18", "transformer.moe.moe_logging.get_moe_metrics_tracker(): the MoE losses' "
                  "tracker, sized by ensure_initialized(); moe_utils."
                  "get_moe_layer_wise_logging_tracker() returns a copy of it (0.16, 0.17: the "
                  "tracker itself, a dict)"),
    "share_storage_ext": (
        ">=0.17", "tensor_parallel.random.CheckpointWithoutOutput (selective recompute of "
                  "layernorm, moe_act, mla_up_proj) compiles the C++ extension share_storage_ext "
                  "with load_inline in its first recompute, inside a backward"),
    "gtp_remat_groups": (
        ">=0.19", "parallel_state's generalized-TP weight-rematerialization groups "
                  "(_GTP_WEIGHT_REMAT_GROUP, _DATA_PARALLEL_GROUP_WITH_GTP_REMAT, ...): with "
                  "GTP off, groups of one rank and aliases of the plain data-parallel groups"),
}


@functools.cache
def installed_version() -> Optional[str]:
    """The installed megatron-core's version (None when it is not installed)."""
    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return None


def _release(v: str) -> Version:
    """The release part of a version (0.19.0rc1 and 0.19.0.dev0 are release 0.19.0)."""
    return Version(Version(v).base_version)


def in_range(spec: str, installed: Optional[str] = None) -> bool:
    """Whether the installed (or given) release is in ``spec`` (e.g. ``"<0.17"``)."""
    return _release(installed or installed_version()) in SpecifierSet(spec)


def releases(change: str) -> str:
    """The releases (a version specifier) where ``change`` holds: a patch that exists for
    that change alone declares them as its ``versions``."""
    return CHANGES[change][0]


def holds(change: str, installed: Optional[str] = None) -> bool:
    """Whether the difference ``change`` (a key of :data:`CHANGES`) holds for the installed
    (or given) release."""
    return in_range(releases(change), installed)
