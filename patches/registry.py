"""The patch registry: one table of everything ldt changes in megatron-core."""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import ldt.patches.versions as versions

# The megatron-core releases these patches are written and tested for (ldt.patches.versions).
MEGATRON_RANGE = versions.SUPPORTED


class PatchError(RuntimeError):
    """A patch cannot be applied (wrong megatron-core version, already applied, ...)."""


def check_megatron_version(installed: Optional[str] = None) -> str:
    """Return the installed megatron-core version, or refuse it in one line naming the range."""
    if installed is None:
        installed = versions.installed_version()
        if installed is None:
            raise PatchError(
                "megatron-core is not installed; `pip install 'megatron-core"
                f"{MEGATRON_RANGE}'` (the releases ldt's patches are written for)")
    if not versions.in_range(MEGATRON_RANGE, installed):
        raise PatchError(
            f"megatron-core {installed} is installed but ldt supports megatron-core"
            f"{MEGATRON_RANGE} (tested: {', '.join(versions.TESTED)}); install one "
            f"(`pip install 'megatron-core{MEGATRON_RANGE}'`) or an ldt written for yours")
    return installed


@dataclass
class Patch:
    """One reversible change: ``install(ctx)`` applies it and returns the function that undoes it."""

    name: str
    description: str
    install: Callable[[Any], Callable[[], None]]
    # the megatron-core releases the patch changes (a version specifier inside MEGATRON_RANGE);
    # on the others megatron-core does what it patches by itself, and apply() skips it
    versions: str = MEGATRON_RANGE
    _undo: Optional[Callable[[], None]] = None

    @property
    def is_applied(self) -> bool:
        return self._undo is not None

    def targets(self, installed: Optional[str] = None) -> bool:
        """Whether the installed (or given) megatron-core release needs this patch."""
        return versions.in_range(self.versions, installed)


REGISTRY: dict[str, Patch] = {}

# Modules that declare patches; importing one adds its patches to REGISTRY.
_PATCH_MODULES = (
    "ldt.patches.init_model_parallel",
    "ldt.patches.cpu_shims",
    "ldt.patches.optimizer_cpu",
    "ldt.patches.schedules",
    "ldt.patches.cuda_to_cpu",
    "ldt.patches.rope_cpu",
    "ldt.patches.dist_checkpointing",
    "ldt.patches.sequence_parallel",
    "ldt.patches.recompute",
    "ldt.patches.fake_tensors",
    "ldt.patches.moe",
    "ldt.patches.wgrad_split",
)


def register(name: str, description: str, versions: str = MEGATRON_RANGE) -> Callable:
    """Decorator for a module-level ``install(ctx) -> undo`` function; ``versions``: the
    megatron-core releases it is for (a specifier, by default every supported release)."""

    def deco(fn: Callable[[Any], Callable[[], None]]):
        REGISTRY[name] = Patch(name, description, fn, versions)
        return fn

    return deco


def _load_all() -> None:
    for mod in _PATCH_MODULES:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name != mod:  # a real import error inside a patch module
                raise


def apply(names: Optional[list[str]] = None, ctx: Any = None) -> list[str]:
    """Apply the named patches (default: all); returns the names newly applied. A patch the
    installed release does not need (:attr:`Patch.versions`) is skipped."""
    installed = check_megatron_version()
    _load_all()
    todo = list(REGISTRY) if names is None else list(names)
    done = []
    for name in todo:
        if name not in REGISTRY:
            raise PatchError(f"unknown patch {name!r}; known: {sorted(REGISTRY)}")
        patch = REGISTRY[name]
        if patch.is_applied or not patch.targets(installed):
            continue
        patch._undo = patch.install(ctx)
        done.append(name)
    return done


def revert(names: Optional[list[str]] = None) -> None:
    """Undo the named patches (default: every applied one), newest first."""
    _load_all()
    todo = [n for n in (list(REGISTRY) if names is None else names) if REGISTRY[n].is_applied]
    for name in reversed(todo):
        patch = REGISTRY[name]
        undo, patch._undo = patch._undo, None
        undo()


def is_applied(name: str) -> bool:
    _load_all()
    return name in REGISTRY and REGISTRY[name].is_applied


@contextlib.contextmanager
def applied(names: Optional[list[str]] = None, ctx: Any = None) -> Iterator[list[str]]:
    """``with applied([...], ctx):`` apply, then revert exactly what this call applied."""
    done = apply(names, ctx)
    try:
        yield done
    finally:
        revert(done)


def swap_everywhere(original: Any, new: Any) -> Callable[[], None]:
    """Rebind every module-level name bound to ``original`` (in any imported module) to ``new``.

    A script that ran ``from megatron.core... import get_forward_backward_func`` before ldt
    was activated holds the original function under its own name; swapping the attribute of
    megatron's module alone would miss it. Returns the function restoring every binding.
    """
    import sys

    undos = []
    for module in list(sys.modules.values()):
        try:
            names = [k for k, v in vars(module).items() if v is original]
        except TypeError:  # not a module (some libraries put other objects in sys.modules)
            continue
        undos += [swap_attr(module, name, new) for name in names]

    def undo() -> None:
        for u in reversed(undos):
            u()

    return undo


def swap_attr(obj: Any, attr: str, new: Any) -> Callable[[], None]:
    """Set ``obj.attr = new`` and return the function restoring the old value."""
    old = getattr(obj, attr)
    setattr(obj, attr, new)

    def undo() -> None:
        setattr(obj, attr, old)

    return undo
