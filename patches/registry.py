"""The patch registry: one table of everything ldt changes in megatron-core."""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable, Iterator, Optional

# The megatron-core releases these patches were written and tested against.
MEGATRON_MIN = (0, 16, 0)
MEGATRON_MAX_EXCLUSIVE = (0, 17, 0)
MEGATRON_RANGE = ">=0.16.0,<0.17"


class PatchError(RuntimeError):
    """A patch cannot be applied (wrong megatron-core version, already applied, ...)."""


def _parse(v: str) -> tuple[int, ...]:
    parts = []
    for p in v.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_megatron_version(installed: Optional[str] = None) -> str:
    """Return the installed megatron-core version, or raise if the patches do not target it."""
    if installed is None:
        try:
            installed = version("megatron-core")
        except PackageNotFoundError:
            raise PatchError(
                "megatron-core is not installed; `pip install 'megatron-core"
                f"{MEGATRON_RANGE}'` (ldt's patches target that range)"
            ) from None
    if not MEGATRON_MIN <= _parse(installed) < MEGATRON_MAX_EXCLUSIVE:
        raise PatchError(
            f"megatron-core {installed} is installed but ldt's patches were written for "
            f"megatron-core{MEGATRON_RANGE}; install a version in that range "
            f"(`pip install 'megatron-core{MEGATRON_RANGE}'`) or update ldt"
        )
    return installed


@dataclass
class Patch:
    """One reversible change: ``install(ctx)`` applies it and returns the function that undoes it."""

    name: str
    description: str
    install: Callable[[Any], Callable[[], None]]
    _undo: Optional[Callable[[], None]] = None

    @property
    def is_applied(self) -> bool:
        return self._undo is not None


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


def register(name: str, description: str) -> Callable:
    """Decorator for a module-level ``install(ctx) -> undo`` function."""

    def deco(fn: Callable[[Any], Callable[[], None]]):
        REGISTRY[name] = Patch(name, description, fn)
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
    """Apply the named patches (default: all); returns the names newly applied."""
    check_megatron_version()
    _load_all()
    todo = list(REGISTRY) if names is None else list(names)
    done = []
    for name in todo:
        if name not in REGISTRY:
            raise PatchError(f"unknown patch {name!r}; known: {sorted(REGISTRY)}")
        patch = REGISTRY[name]
        if patch.is_applied:
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
