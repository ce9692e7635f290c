"""megatron-core under torch's FakeTensorMode (the memory estimate, :mod:`ldt.memory`).

Fake tensors have shapes and dtypes but no data, so an operation whose Python code needs a
value fails (``DataDependentOutputException``). One such place is on every forward path of a
megatron model: ``CudaRNGStatesTracker.fork`` compares the CPU RNG state before and after the
forked region (``torch.all(a == b).item()``), which under FakeTensorMode is a fake tensor.
The patch makes ``fork`` an empty context for the duration: the RNG streams change no memory,
and dropout's masks are still made (from the default generator).
"""

from __future__ import annotations

import contextlib

from ldt.patches.registry import register, swap_attr


@register("fake_tensors", "megatron's RNG tracker fork runs under FakeTensorMode (no value "
                          "check; the memory estimate)")
def install(ctx):
    from megatron.core.tensor_parallel import random as mrandom

    @contextlib.contextmanager
    def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
        yield

    return swap_attr(mrandom.CudaRNGStatesTracker, "fork", fork)
