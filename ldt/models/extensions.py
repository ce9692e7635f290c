"""megatron-core's C++ extension for recomputation, built before the first collective.

From 0.17, megatron's ``CheckpointWithoutOutput`` (selective recompute of ``layernorm``,
``moe_act``, ``mla_up_proj``) compiles a small C++ extension, ``share_storage_ext``, with
``torch.utils.cpp_extension.load_inline`` the first time it recomputes: inside the first
backward. On a machine that has not built it yet that takes ~25 s on 2 idle cores, longer under
load, while the neighbouring stages wait on their boundary receive (``train.comm_timeout_s``,
60 s by default): a first run then fails as a hang. ldt builds it before the world forms
(:func:`build_for`), where a build only delays the start. torch caches the build per machine,
so later runs load it in about a second.

A build killed midway (Ctrl-C, a host losing power) leaves torch's ``lock`` file behind, and
every later build waits for it forever: :func:`stale_locks` finds one and the refusal names it.
A build that fails (no compiler) is said in one line with the fix, before any process starts.
"""

from __future__ import annotations

import glob
import os
import sys
import time
from typing import Iterable

from ldt.models.recompute import stage_recompute
from ldt.patches import versions

NAME = "share_storage_ext"  # megatron's load_inline(name=...)
# the selective-recompute modules megatron wraps in CheckpointWithoutOutput (0.17-0.19)
MODULES = frozenset({"layernorm", "moe_act", "mla_up_proj"})
STALE_AFTER_S = 600.0  # a build takes well under a minute; a lock this old is a killed build's


class BuildError(RuntimeError):
    """The extension cannot be built: a killed build's lock file stands in the way, or the
    build itself failed (no C++ compiler, no ninja). The message names the cause and the fix."""


def needs_build(model, stages: Iterable) -> bool:
    """Whether a stage recomputes a module megatron checkpoints without its output."""
    for stage in stages:
        rc = stage_recompute(model, stage)
        if rc is not None and rc.granularity == "selective" and MODULES & set(rc.modules or []):
            return True
    return False


def _build_roots() -> list[str]:
    """Where torch builds extensions: ``TORCH_EXTENSIONS_DIR`` as given, else its default root,
    under which each Python/CUDA pair has a folder of its own (``py312_cu130``)."""
    given = os.environ.get("TORCH_EXTENSIONS_DIR")
    if given:
        return [os.path.join(given, NAME)]
    from torch.utils.cpp_extension import get_default_build_root

    return glob.glob(os.path.join(get_default_build_root(), "*", NAME))


def stale_locks() -> list[str]:
    """Lock files older than :data:`STALE_AFTER_S`: left by a build that was killed."""
    now = time.time()
    locks = [os.path.join(r, "lock") for r in _build_roots()]
    return [p for p in locks if os.path.exists(p) and now - os.path.getmtime(p) > STALE_AFTER_S]


def built() -> bool:
    return any(os.path.exists(os.path.join(r, f"{NAME}.so")) for r in _build_roots())


def build_for(model, stages: Iterable, say: bool = True) -> bool:
    """Build (or load) megatron's extension when this run needs it and the installed megatron
    has one; True when it did. Call before the first collective."""
    if not needs_build(model, stages):
        return False
    return build(say)


def build(say: bool = True) -> bool:
    """Build (or load) the extension if the installed megatron-core compiles one (0.17+)."""
    if not versions.holds("share_storage_ext"):  # 0.16: nothing to build (megatron not imported)
        return False
    stale = stale_locks()
    if stale:
        raise BuildError(
            f"megatron-core's {NAME} build is locked by {stale[0]}, older than "
            f"{STALE_AFTER_S:.0f} s: a build was killed midway and every later one would wait "
            "for it forever; delete that file (no build of it is running) and start again")
    if say and not built():
        print(f"ldt: building megatron-core's {NAME} (selective recompute of "
              f"{'/'.join(sorted(MODULES))} needs it; once per machine)", file=sys.stderr,
              flush=True)
    from megatron.core.tensor_parallel.random import _get_share_storage

    try:
        _get_share_storage()
    except Exception as exc:  # torch's build: RuntimeError, OSError, CalledProcessError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise BuildError(
            f"megatron-core's {NAME} could not be built ({type(exc).__name__}: {first}); "
            f"its selective recompute of {'/'.join(sorted(MODULES))} needs it: install a C++ "
            "compiler and ninja (pip install ninja), or recompute core_attn/mlp only, or "
            "use full recompute") from exc
    return True
