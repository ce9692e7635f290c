"""CPU shims: let megatron-core's unmodified schedules, DDP, checkpointing and RNG run on CPU.

Applied only when this rank's stage device is ``cpu`` (``ldt.patches.apply(["cpu_shims"])``).
Each shim replaces the module-level name ``torch`` inside one megatron module with a proxy that
differs from torch only where the module hard-codes CUDA, so the module's own code stays as it
is. One proxy, :data:`TORCH_ON_CPU`, serves every module: ``device="cuda"`` in ``zeros`` /
``empty`` / ``tensor`` means the CPU, ``torch.cuda.current_device()`` is the CPU and
``torch.cuda.synchronize()`` does nothing. The modules, and what in them needs it:

- ``pipeline_parallel.schedules``: the token counter (``torch.zeros(..., device="cuda")``);
- ``pipeline_parallel.p2p_communication``: megatron's own communicator (the uniform baseline in
  the benchmarks): receive buffers and ``torch.cuda.synchronize()``;
- ``utils``: ``GlobalMemoryBuffer`` allocates on ``torch.cuda.current_device()``;
- ``distributed.param_and_grad_buffer``: DDP's grad (and param) buffers, same; from
  megatron-core 0.19 its gradient reduce also waits on ``torch.cuda.current_stream()`` for
  CUDA-graph events (a stream that waits for nothing on CPU);
- ``dist_checkpointing.strategies.{state_dict_saver,filesystem_async}``: a flag tensor on
  ``'cuda'`` and ``torch.cuda.synchronize()`` after the device-to-host copy;
- ``dist_checkpointing.strategies.filesystem_async``: the writer's results queue lives in a
  multiprocessing Manager started with ``spawn``, which re-imports the launching script in a
  fresh interpreter (~6 s per rank and save on this CPU); on CPU ranks it is forked instead
  (megatron-core 0.17+ takes the start method as ``get_write_results_queue(mp_mode=)``, so
  the shim only passes ``"fork"``; 0.16's ``_get_write_results_queue()`` has no such
  argument and the shim makes the queue itself);
- ``tensor_parallel.{mappings,layers}``: the buffers of sequence parallelism's all-gather and
  reduce-scatter (``torch.cuda.current_device()``);
- ``transformer.multi_token_prediction``: the tracker of the MTP losses
  (``torch.zeros(..., device=torch.cuda.current_device())``);
- ``tensor_parallel.random``: ``torch.cuda.{manual_seed,get_rng_state}`` and the module's
  ``_get/_set_cuda_rng_state`` use the CPU generator, so ``model_parallel_cuda_manual_seed`` and
  ``get_cuda_rng_tracker().fork()`` work (dropout in TP regions stays reproducible). Its
  warning "CPU RNG state changed within GPU RNG context" is then always true and meaningless
  (the "GPU" generator *is* the CPU one), so that one message is filtered out.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import types
from typing import Any

import torch

from ldt.patches import versions
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
    if isinstance(device, str) and device == "cpu":
        return device
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    return torch.device("cpu") if dev.type == "cuda" else dev


def _on_cpu(factory):
    def make(*args, device=None, **kwargs):
        return factory(*args, device=_cpu_device(device), **kwargs)

    make.__name__ = factory.__name__
    return make


class _HostStream:
    """What ``torch.cuda.current_stream()`` answers on CPU: work is already in order, so
    waiting for an event or another stream does nothing."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


_CUDA_ON_CPU = ModuleProxy(torch.cuda, current_device=lambda: "cpu",
                           synchronize=lambda *a, **k: None,
                           current_stream=lambda *a, **k: _HostStream())
TORCH_ON_CPU = ModuleProxy(torch, cuda=_CUDA_ON_CPU, zeros=_on_cpu(torch.zeros),
                           empty=_on_cpu(torch.empty), tensor=_on_cpu(torch.tensor))

# megatron modules whose global name ``torch`` becomes TORCH_ON_CPU
_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.utils",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.tensor_parallel.mappings",  # sequence parallel: gather / reduce-scatter
    "megatron.core.tensor_parallel.layers",  # buffers (sequence parallel, vocab parallel)
    "megatron.core.transformer.moe.router",  # gating moves the router weight to cuda
    "megatron.core.transformer.moe.moe_utils",  # the aux-loss tracker's buffer on "cuda"
    "megatron.core.transformer.multi_token_prediction",  # the MTP losses' tracker
)

_cuda_rng_on_cpu = ModuleProxy(
    torch.cuda,
    manual_seed=torch.manual_seed,
    get_rng_state=lambda *a, **k: torch.get_rng_state(),
    set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
)

_RNG_WARNING = "CPU RNG state changed within GPU RNG context"


def _forked_results_queue():  # megatron-core 0.16
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    if fa._results_queue is None:
        fa._results_queue = multiprocessing.get_context("fork").Manager().Queue()
    return fa._results_queue


def _drop_rng_warning(record: logging.LogRecord) -> bool:
    return record.getMessage() != _RNG_WARNING


@register("cpu_shims", "CPU stand-ins for megatron's CUDA-only buffers, token counter, "
                       "checkpoint flags and RNG")
def install(ctx) -> Any:
    import importlib

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.tensor_parallel import random as mrandom

    undos = [swap_attr(importlib.import_module(name), "torch", TORCH_ON_CPU)
             for name in _MODULES]
    if versions.holds("results_queue_mp_mode"):
        forked = functools.partial(filesystem_async.get_write_results_queue, mp_mode="fork")
        undos.append(swap_attr(filesystem_async, "get_write_results_queue", forked))
    else:
        undos.append(swap_attr(filesystem_async, "_get_write_results_queue",
                               _forked_results_queue))
    undos += [
        swap_attr(mrandom, "torch", ModuleProxy(torch, cuda=_cuda_rng_on_cpu)),
        swap_attr(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state()),
        swap_attr(mrandom, "_set_cuda_rng_state",
                  lambda state, *a, **k: torch.set_rng_state(state)),
    ]
    rng_logger = logging.getLogger(mrandom.__name__)
    rng_logger.addFilter(_drop_rng_warning)
    undos.append(lambda: rng_logger.removeFilter(_drop_rng_warning))

    def undo() -> None:
        for u in reversed(undos):
            u()

    return undo
