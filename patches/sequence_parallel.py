"""Sequence parallelism with megatron-core's local spec (torch norms), as on GPU with TE.

megatron-core's local layer spec (0.16 to 0.19) builds its norms through ``WrappedTorchNorm``,
which refuses ``sequence_parallel=True`` (``sequence parallel not supported by torch LayerNorm``),
for LayerNorm and RMSNorm alike. A norm works per token, so on a sequence slice it computes
exactly what it computes on the whole sequence; what sequence parallelism changes is the
gradient of its weight (and bias): each TP rank sees only its slice of the tokens, so the
gradients must be summed over the TP group. Transformer Engine's norms mark their parameters
``sequence_parallel=True`` for that, and megatron's ``finalize_model_grads`` sums every
parameter so marked (as it does for the row-parallel linear biases, marked by megatron's own
``RowParallelLinear``). This patch makes ``WrappedTorchNorm`` build the same torch norm with
sequence parallelism on and mark its parameters the same way; nothing changes with it off.
Applied on every stage using the local spec (CPU tests, and GPUs/NPUs without TE); the
``torch.cuda`` uses of ``tensor_parallel.mappings`` / ``layers`` on CPU are ``cpu_shims``'.
"""

from __future__ import annotations

from ldt.patches.registry import register


class _WithoutSequenceParallel:
    """A view of a TransformerConfig that answers sequence_parallel=False."""

    sequence_parallel = False

    def __init__(self, config):
        self._config = config

    def __getattr__(self, name):
        return getattr(self._config, name)


def _sequence_parallel_norm(original_new):
    def __new__(cls, config, hidden_size, *args, **kwargs):
        if not getattr(config, "sequence_parallel", False):
            return original_new(cls, config, hidden_size, *args, **kwargs)
        norm = original_new(cls, _WithoutSequenceParallel(config), hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True  # as Transformer Engine's norms do
        return norm

    return __new__


@register("sequence_parallel_norms", "megatron's torch norms (local spec) accept "
                                     "sequence_parallel and mark their weights as TE's do")
def install(ctx):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__dict__["__new__"]  # a staticmethod
    WrappedTorchNorm.__new__ = staticmethod(_sequence_parallel_norm(original.__func__))

    def undo() -> None:
        WrappedTorchNorm.__new__ = original

    return undo
