"""CPU shims: let megatron-core's unmodified schedules, RNG tracker and memory buffer run on CPU.

Applied only when this rank's stage device is ``cpu`` (``ldt.patches.apply(["cpu_shims"])``).
Each shim replaces the module-level name ``torch`` inside one megatron module with a proxy that
differs from torch in the one or two attributes that hard-code CUDA, so the module's own code
stays as it is:

- ``pipeline_parallel.schedules``: ``torch.zeros(..., device="cuda")`` (the token counter)
  allocates on CPU;
- ``tensor_parallel.random``: ``torch.cuda.{manual_seed,get_rng_state}`` and the module's
  ``_get/_set_cuda_rng_state`` use the CPU generator, so ``model_parallel_cuda_manual_seed`` and
  ``get_cuda_rng_tracker().fork()`` work (dropout in TP regions stays reproducible);
- ``utils``: ``GlobalMemoryBuffer`` allocates on CPU (``torch.cuda.current_device()``);
- ``pipeline_parallel.p2p_communication``: megatron's own communicator (the uniform baseline in
  the benchmarks) allocates receive buffers on CPU and skips ``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from ldt.patches.registry import register, swap_attr


class ModuleProxy(types.ModuleType):
    """A module with a few attributes replaced; everything else is the module's own."""

    def __init__(self, target: types.ModuleType, **overrides: Any):
        super().__init__(target.__name__)
        self.__dict__["_target"] = target
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_target"], name)


def _cpu_device(device: Any) -> Any:
    if device is None:
        return None
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    return torch.device("cpu") if dev.type == "cuda" else dev


def _zeros_on_cpu(*size, device=None, **kwargs):
    return torch.zeros(*size, device=_cpu_device(device), **kwargs)


_cuda_rng_on_cpu = ModuleProxy(
    torch.cuda,
    manual_seed=torch.manual_seed,
    get_rng_state=lambda *a, **k: torch.get_rng_state(),
    set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
)
_cuda_device_is_cpu = ModuleProxy(torch.cuda, current_device=lambda: "cpu")
_cuda_p2p_on_cpu = ModuleProxy(torch.cuda, current_device=lambda: "cpu", synchronize=lambda: None)


@register("cpu_shims", "CPU stand-ins for megatron's CUDA-only token counter, RNG and buffers")
def install(ctx) -> Any:
    from megatron.core import utils
    from megatron.core.pipeline_parallel import p2p_communication, schedules
    from megatron.core.tensor_parallel import random as mrandom

    undos = [
        swap_attr(schedules, "torch", ModuleProxy(torch, zeros=_zeros_on_cpu)),
        swap_attr(mrandom, "torch", ModuleProxy(torch, cuda=_cuda_rng_on_cpu)),
        swap_attr(mrandom, "_get_cuda_rng_state",
                  lambda *a, **k: torch.get_rng_state()),
        swap_attr(mrandom, "_set_cuda_rng_state",
                  lambda state, *a, **k: torch.set_rng_state(state)),
        swap_attr(utils, "torch", ModuleProxy(torch, cuda=_cuda_device_is_cpu)),
        swap_attr(p2p_communication, "torch", ModuleProxy(torch, cuda=_cuda_p2p_on_cpu)),
    ]

    def undo() -> None:
        for u in reversed(undos):
            u()

    return undo
