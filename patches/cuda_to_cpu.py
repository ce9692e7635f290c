"""Run a script written for CUDA on CPU ranks: the few CUDA-only calls map to CPU and gloo.

Like torch_npu's ``transfer_to_npu`` maps CUDA calls to NPUs, this maps what a Megatron-core
training script typically calls: ``torch.cuda.set_device`` (no-op), the ``"nccl"`` backend of
``init_process_group`` (gloo), ``Tensor.cuda()`` / ``Module.cuda()`` and ``.to("cuda")`` /
``.to(torch.device("cuda"))`` (stay on CPU). Applied only for CPU stages (test runs); a script
on real GPUs/NPUs is left alone.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ldt.patches.registry import register, swap_attr


def _stay_on_cpu(self, *args, **kwargs):
    return self


def _cpu_if_cuda(target):
    if isinstance(target, str) and target.split(":")[0] == "cuda":
        return "cpu"
    if isinstance(target, torch.device) and target.type == "cuda":
        return torch.device("cpu")
    return target


def _to_without_cuda(original):
    """``.to(...)`` with a CUDA device (positional or ``device=``) meaning the CPU."""

    @functools.wraps(original)
    def to(self, *args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        return original(self, *(_cpu_if_cuda(a) for a in args), **kwargs)

    return to


@register("cuda_to_cpu", "torch.cuda.set_device / 'nccl' / .cuda() map to CPU and gloo")
def install(ctx):
    original_init = dist.init_process_group

    @functools.wraps(original_init)
    def init_process_group(backend=None, *args, **kwargs):
        if backend in ("nccl", "cuda:nccl") or backend is None:
            backend = "gloo"
        return original_init(backend, *args, **kwargs)

    undos = [
        swap_attr(torch.cuda, "set_device", lambda *a, **k: None),
        swap_attr(dist, "init_process_group", init_process_group),
        swap_attr(torch.Tensor, "cuda", _stay_on_cpu),
        swap_attr(torch.nn.Module, "cuda", _stay_on_cpu),
        swap_attr(torch.Tensor, "to", _to_without_cuda(torch.Tensor.to)),
        swap_attr(torch.nn.Module, "to", _to_without_cuda(torch.nn.Module.to)),
    ]

    def undo():
        for u in reversed(undos):
            u()

    return undo
