"""Split the backward of megatron-core's local linear layers: B now, the weight gradient later.

A zero-bubble schedule runs each backward as B (the input's gradient, which the previous stage
waits for) and W (the weights' gradient, run later to fill an idle slot). megatron-core 0.16
splits it only for Transformer Engine's layers (``delay_wgrad_compute``, TE >= 2.3); its local
layers compute both in ``LinearWithGradAccumulationAndAsyncCommunication.backward``. This patch
defers, for ``ColumnParallelLinear`` and ``RowParallelLinear``, exactly the weight-gradient GEMM
of that backward, and leaves everything else (the input gradient, its TP all-reduce or
sequence-parallel reduce-scatter, the bias gradient) to megatron's own code, unchanged.

How, with two names of ``megatron.core.tensor_parallel.layers`` and no copied code:

* ``LinearWithGradAccumulationAndAsyncCommunication`` (the autograd function both layers'
  ``_forward_impl`` reach through ``linear_with_grad_accumulation_and_async_allreduce``)
  becomes a subclass whose ``apply`` gives megatron's function a *detached* view of the
  weight, so the
  weight's gradient accumulator is not in the backward graph at all (its hooks, megatron DDP's
  among them, cannot fire during B), and gradient-accumulation fusion is switched on for it,
  with a stand-in for ``main_grad`` that records the layer. On that branch megatron's backward
  computes the weight gradient only through the fused kernel's module-level name.
* ``fused_weight_gradient_mlp_cuda`` (Apex's kernel module; absent on CPU) becomes a proxy:
  for a split layer it stores the kernel's arguments (the layer's input, gathered over the
  sequence with sequence parallelism: then copied, since megatron gathers into a shared
  buffer, and the output gradient) instead of running it; for any other layer it calls the
  real kernel.

W (:func:`run_wgrad`) then computes what megatron would have: with fusion, the real kernel into
``main_grad`` and megatron's dummy gradient; without, ``grad_output.t() @ total_input``; and
hands it to autograd from inside the backward of a node whose input is the weight (so that
autograd takes the gradient instead of copying it). That runs the weight's own
gradient accumulator, the node megatron's ``DistributedDataParallel`` hooked
(``param.expand_as(param).grad_fn.next_functions[0][0].register_hook``), so DDP's hook fires
after W, not after B, and does what it does without the split: adds ``param.grad`` to
``main_grad`` (or skips it when fusion already did), clears ``param.grad``, and with
``overlap_grad_reduce`` marks the parameter ready for its bucket's reduce. Layer norms,
biases, embeddings stay in B (small, or not a GEMM).

Outside a capture (``deferring``) a split layer runs its W at once inside the backward, so a
model with the patch applied trains exactly as without it under any schedule.

Where Transformer Engine >= 2.3 builds the layers, megatron-core's own split is used instead
(``delay_wgrad_compute=True`` in the model's and DDP's configs; W = each TE layer's
``backward_dw()``): :func:`wgrad_backend` chooses, :class:`WgradSeam` runs either.

For every supported megatron-core (the registry's range, ``patches/versions.py``): 0.16 to
0.19's ``LinearWithGradAccumulationAndAsyncCommunication`` keep both names and the same fused
branch (0.19 adds ``gtp_remat_size``, whose re-materialised weights this patch leaves
unsplit); ``.ci/mcore`` runs its tests on 0.18 and 0.19.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable, Iterator, Optional

import torch

from ldt.patches.registry import PatchError, register

TE_MIN = (2, 3)
"""Transformer Engine from which megatron-core's ``delay_wgrad_compute`` works."""

_SINK: Optional[Callable[["WgradWork"], None]] = None
"""Where a split layer's W goes during a capture (None: run at once). A plain module global,
not a thread-local: with CUDA the autograd engine runs backward functions on its own thread."""


@dataclass
class _Pending:
    """Stands in for ``main_grad`` on the detached weight megatron's function sees: megatron
    reads its ``dtype`` to pick the kernel and passes it to the kernel, which finds the layer."""

    weight: Any
    fused: bool  # the layer accumulates into main_grad itself (gradient_accumulation_fusion)
    gathered: bool  # sequence parallel: the kernel's input is megatron's shared gather buffer
    dtype: Any


@dataclass
class WgradWork:
    """One deferred weight-gradient GEMM: megatron's kernel call for one layer and micro-batch."""

    pending: _Pending
    kernel: Optional[Callable]  # the real fused kernel (fused layers), else None
    total_input: Any
    grad_output: Any


def run_wgrad(works: list[WgradWork]) -> None:
    """W: compute the stored weight gradients and hand them to autograd, so each weight's
    accumulator and its hooks (DDP's) run once per weight, as after an unsplit backward.

    Each weight's gradient is made inside the backward of a node of a small graph
    (:class:`_Delivery`, one node per weight, chained in backward order), not passed to
    ``torch.autograd.backward(weights, grads)``:

    * the accumulator steals a gradient nobody else references and copies one that Python
      still holds: a weight-sized copy per layer and micro-batch, measured at +20-25% of B + W
      against the unsplit backward (hidden 256, CPU);
    * autograd runs a weight's accumulator (and DDP's hook, which adds the gradient to
      ``main_grad`` and drops it) before the next node, so one weight's gradient exists at a
      time, as in megatron's unsplit backward, instead of the whole chunk's at once."""
    by_weight: dict = {}  # weight -> its works, in backward order (tensors hash by identity)
    for work in works:
        by_weight.setdefault(work.pending.weight, []).append(work)
    if not by_weight:
        return
    with torch.enable_grad():
        root = None
        for weight, its_works in reversed(by_weight.items()):  # the first W's node outermost
            root = _Delivery.apply(its_works, root, weight)
    torch.autograd.backward(root)


class _Delivery(torch.autograd.Function):
    """One weight's W as an autograd node: its input edge is the weight's accumulator (the
    node megatron DDP hooked), its backward makes the gradient as megatron's would, referenced
    by nothing else once returned; ``after`` chains the next weight's node behind this one."""

    @staticmethod
    def forward(ctx, works, after, weight):
        ctx.works = works
        return weight.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        grads: dict = {}
        for work in ctx.works:
            _compute(work, grads)
        ctx.works = None  # the stored inputs and output gradients go with this W
        (weight_grad,) = grads.values() or (None,)
        return None, grad if ctx.needs_input_grad[1] else None, weight_grad


def _compute(work: WgradWork, grads: dict) -> None:
    """One layer's weight gradient, as megatron's backward computes it."""
    weight = work.pending.weight
    if work.pending.fused:  # megatron's fused branch: accumulate, then a dummy gradient
        work.kernel(work.total_input, work.grad_output, weight.main_grad)
        if not hasattr(weight, "grad_added_to_main_grad"):
            return  # megatron returns no gradient then: nothing reaches autograd
        weight.grad_added_to_main_grad = True
        grad = torch.zeros_like(weight) if getattr(weight, "zero_out_wgrad", False) \
            else torch.empty_like(weight)
    else:
        grad = work.grad_output.t().matmul(work.total_input)
    grads[weight] = grads[weight] + grad if weight in grads else grad


@contextlib.contextmanager
def deferring(sink: Callable[[WgradWork], None]) -> Iterator[None]:
    """While inside, split layers hand their W to ``sink`` instead of running it."""
    global _SINK
    if _SINK is not None:
        raise RuntimeError("a weight-gradient capture is already open; captures do not nest "
                           "(one backward at a time per process)")
    _SINK = sink
    try:
        yield
    finally:
        _SINK = None


class _Kernels:
    """Proxy for megatron's ``fused_weight_gradient_mlp_cuda``: defers a split layer's call."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def wgrad_gemm_accum_fp32(self, total_input, grad_output, main_grad):
        return self._call("wgrad_gemm_accum_fp32", total_input, grad_output, main_grad)

    def wgrad_gemm_accum_fp16(self, total_input, grad_output, main_grad):
        return self._call("wgrad_gemm_accum_fp16", total_input, grad_output, main_grad)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def _call(self, name: str, total_input, grad_output, main_grad):
        if not isinstance(main_grad, _Pending):  # a fused layer this patch did not split
            return getattr(self.real, name)(total_input, grad_output, main_grad)
        kernel = getattr(self.real, name) if main_grad.fused else None
        # held until W without the forward's graph; megatron's gather buffer (sequence
        # parallel) is reused by the next layer, so that one is copied
        total_input = total_input.detach()
        if main_grad.gathered:
            total_input = total_input.clone()
        work = WgradWork(main_grad, kernel, total_input, grad_output.detach())
        if _SINK is None:
            run_wgrad([work])
        else:
            _SINK(work)


def _split(function: type) -> type:
    """``function`` (megatron's ``LinearWithGradAccumulationAndAsyncCommunication``) with an
    ``apply`` that hands it, for a layer it splits, a detached alias of the weight and
    gradient-accumulation fusion on. megatron's ``linear_with_grad_accumulation_and_async_
    allreduce`` calls ``apply(*args)`` through the module-level name, every argument
    positional in ``forward``'s order (0.16 to 0.19): the narrowest hook that sees them.
    Positions are read from ``forward``'s signature once; a call costs a few microseconds
    (binding the wrapped function's signature on every call cost ~15 us per layer, 25-30% of a
    small layer's forward)."""
    import torch  # bound once here: apply runs for every linear layer of every micro-batch

    params = list(inspect.signature(function.forward).parameters)[1:]  # without ctx
    at = {name: i for i, name in enumerate(params)}
    i_input, i_weight, i_bias = at["input"], at["weight"], at["bias"]
    i_fusion, i_sp, i_buffer = at["gradient_accumulation_fusion"], at["sequence_parallel"], \
        at["grad_output_buffer"]
    i_remat = at.get("gtp_remat_size")  # 0.19: re-gathered weights, left unsplit

    def apply(cls, *args):
        weight, bias = args[i_weight], args[i_bias]
        if not (torch.is_grad_enabled() and weight.requires_grad
                and args[i_buffer] is None  # megatron's own embedding deferral
                and not hasattr(weight, "__fsdp_param__")  # Megatron-FSDP's own buffers
                and (i_remat is None or args[i_remat] in (None, 1))
                and (args[i_input].requires_grad or (bias is not None and bias.requires_grad))):
            return function.apply(*args)
        fused = bool(args[i_fusion]) and hasattr(weight, "main_grad")
        alias = weight.detach()  # no edge to the weight: its accumulator waits for W
        alias.main_grad = _Pending(weight, fused, bool(args[i_sp]),
                                   weight.main_grad.dtype if fused else torch.float32)
        args = list(args)
        args[i_weight], args[i_fusion] = alias, True
        return function.apply(*args)  # megatron's own class: its backward node, unchanged

    return type(function.__name__, (function,), {
        "apply": classmethod(apply), "__module__": __name__, "__doc__": _split.__doc__})


@register("wgrad_split", "local linear layers defer their weight-gradient GEMM to a W step "
                         "(zero-bubble schedules); megatron DDP's hooks fire after W")
def install(ctx):
    from megatron.core.tensor_parallel import layers

    name = "LinearWithGradAccumulationAndAsyncCommunication"
    original = getattr(layers, name)
    had_kernels = hasattr(layers, "fused_weight_gradient_mlp_cuda")
    real_kernels = getattr(layers, "fused_weight_gradient_mlp_cuda", None)
    setattr(layers, name, _split(original))
    layers.fused_weight_gradient_mlp_cuda = _Kernels(real_kernels)

    def undo() -> None:
        setattr(layers, name, original)
        if had_kernels:
            layers.fused_weight_gradient_mlp_cuda = real_kernels
        else:
            del layers.fused_weight_gradient_mlp_cuda

    return undo


# ---- which split a model chunk uses, and W for it -----------------------------------------
def te_version() -> Optional[str]:
    for dist in ("transformer-engine", "transformer_engine", "transformer-engine-torch"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def te_linears(chunk) -> list:
    """Transformer Engine's layers in ``chunk`` (the modules whose class comes from TE), in
    forward order."""
    return [m for m in chunk.modules()
            if any(k.__module__.split(".")[0] == "transformer_engine" for k in type(m).__mro__)]


def wgrad_backend(chunk, te: Optional[str] = "installed") -> str:
    """``"local"`` (this patch splits the chunk's local linear layers) or ``"te"`` (its layers
    are Transformer Engine's: megatron-core's ``delay_wgrad_compute`` splits them, W calls
    their ``backward_dw()``). ``te``: the installed TE version (default: looked up). Raises
    PatchError where TE's layers cannot split (TE older than 2.3, or the model built without
    ``delay_wgrad_compute``)."""
    layers = te_linears(chunk)
    if not layers:
        return "local"
    te = te_version() if te == "installed" else te
    if te is None or tuple(int("".join(c for c in p if c.isdigit()) or 0)
                           for p in te.split(".")[:2]) < TE_MIN:
        raise PatchError(
            f"the model's linear layers are Transformer Engine's ({type(layers[0]).__name__}) "
            f"and Transformer Engine {te or '(not found)'} cannot delay their weight gradient: "
            f"megatron-core's delay_wgrad_compute needs transformer-engine>="
            f"{TE_MIN[0]}.{TE_MIN[1]}; install it, or build the stages with megatron's local "
            f"layers (model.transformer_impl=local)")
    missing = [type(m).__name__ for m in layers
               if not getattr(getattr(m, "config", None), "delay_wgrad_compute", False)]
    if missing:
        raise PatchError(
            f"Transformer Engine layers {sorted(set(missing))} were built with "
            f"delay_wgrad_compute=False, so their backward computes the weight gradient at "
            f"once; build the model with TransformerConfig(delay_wgrad_compute=True) and wrap "
            f"it with DistributedDataParallelConfig(delay_wgrad_compute=True)")
    return "te"


class WgradSeam:
    """What a :class:`~ldt.schedule.wgrad.WgradStore` defers and runs W with, for one stage:
    ``chunks`` maps the chunk names of the store's keys to the stage's model chunks."""

    def __init__(self, chunks: dict, te: Optional[str] = "installed") -> None:
        self.te = {name: te_linears(chunk) for name, chunk in chunks.items()
                   if wgrad_backend(chunk, te) == "te"}

    def deferring(self, key, sink: Callable[[Any], None]):
        return deferring(sink)

    def run(self, key, items: list) -> None:
        run_wgrad(items)  # the local layers' (a TE model's output layer is megatron's own)
        for module in reversed(self.te.get(key[1], ())):  # backward order, as megatron does
            module.backward_dw()
