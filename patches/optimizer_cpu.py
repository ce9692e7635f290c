"""CPU stand-ins for the CUDA-only parts of megatron-core's optimizer stack.

Applied with ``cpu_shims`` on CPU stages (``ldt.patches.apply(["optimizer_cpu"])``). Two kinds:

- The optimizer modules (``optimizer.optimizer``, ``optimizer.clip_grads``,
  ``optimizer.grad_scaler``, ``optimizer.distrib_optimizer``) create their flags, loss scale and
  norm scalars with ``device='cuda'`` / ``torch.cuda.current_device()``: their module-level
  ``torch`` becomes :data:`ldt.patches.cpu_shims.TORCH_ON_CPU` (CUDA means the CPU), as for DDP's
  buffers.
- The mixed-precision optimizers sort parameters by ``param.type()`` against the strings
  ``'torch.cuda.FloatTensor'``, ``'torch.cuda.HalfTensor'`` and ``'torch.cuda.BFloat16Tensor'``
  (a CPU parameter answers ``'torch.FloatTensor'`` and is refused). Only while the
  functions that do it run (``Float16OptimizerWithFloat16Params.__init__``,
  ``DistributedOptimizer.__init__`` and its ``_build_model_and_main_param_groups``), a CPU
  tensor's ``type()`` without arguments answers the CUDA name of its dtype; likewise in
  ``clip_grad_by_total_norm_fp32``, which asserts every gradient is ``'torch.cuda.FloatTensor'``.
- ``DynamicGradScaler.load_state_dict`` moves the saved scale with ``Tensor.cuda()`` (a resume
  of fp16's loss scale): on CPU the scale stays where it is.
"""

from __future__ import annotations

import functools
import importlib
import threading
from typing import Any

import torch

from ldt.patches.cpu_shims import TORCH_ON_CPU
from ldt.patches.registry import register, swap_attr

_MODULES = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.distrib_optimizer",
)
_CUDA_NAMES = {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
               torch.bfloat16: "torch.cuda.BFloat16Tensor"}
_inside = threading.local()
_original_type = torch.Tensor.type


def _type(self, *args, **kwargs):
    if not args and not kwargs and getattr(_inside, "depth", 0) and self.device.type == "cpu" \
            and self.dtype in _CUDA_NAMES:
        return _CUDA_NAMES[self.dtype]
    return _original_type(self, *args, **kwargs)


def _cuda_type_names(fn):
    """``fn`` with a CPU tensor's ``type()`` answering its CUDA name while it runs."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        _inside.depth = getattr(_inside, "depth", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _inside.depth -= 1

    return call


class _StaysOnCpu:
    """A saved loss scale whose ``.cuda(device)`` is the CPU tensor itself."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def cuda(self, *args, **kwargs) -> torch.Tensor:
        return self.tensor


def _scale_stays_on_cpu(load):
    @functools.wraps(load)
    def call(self, state_dict):
        return load(self, {**state_dict, "scale": _StaysOnCpu(state_dict["scale"])})

    return call


@register("optimizer_cpu", "megatron's optimizers, loss scaler and grad clipping on CPU "
                           "(CUDA scalars on the CPU; CPU params pass the CUDA type checks)")
def install(ctx) -> Any:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    undos = [swap_attr(importlib.import_module(name), "torch", TORCH_ON_CPU) for name in _MODULES]
    undos.append(swap_attr(torch.Tensor, "type", _type))
    undos.append(swap_attr(Float16OptimizerWithFloat16Params, "__init__",
                           _cuda_type_names(Float16OptimizerWithFloat16Params.__init__)))
    undos.append(swap_attr(DistributedOptimizer, "__init__",
                           _cuda_type_names(DistributedOptimizer.__init__)))
    from megatron.core.optimizer import clip_grads, optimizer

    # clipping asserts every grad is 'torch.cuda.FloatTensor' (optimizer.py imported it by name)
    clip = _cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    undos += [swap_attr(clip_grads, "clip_grad_by_total_norm_fp32", clip),
              swap_attr(optimizer, "clip_grad_by_total_norm_fp32", clip)]
    undos.append(swap_attr(DynamicGradScaler, "load_state_dict",
                           _scale_stays_on_cpu(DynamicGradScaler.load_state_dict)))
    build = DistributedOptimizer.__dict__["_build_model_and_main_param_groups"]  # classmethod
    undos.append(swap_attr(DistributedOptimizer, "_build_model_and_main_param_groups",
                           classmethod(_cuda_type_names(build.__func__))))

    def undo() -> None:
        for u in reversed(undos):
            u()

    return undo
