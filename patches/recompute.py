"""Selective recomputation of the norms (``recompute_modules: [layernorm]``) without
Transformer Engine.

megatron-core's ``CheckpointWithoutOutput(fp8=False)`` (0.16 to 0.19) sets
``self.fp8 = fp8 is not None``, i.e. true for every caller (the transformer layer passes no
argument), and its forward then asks Transformer Engine's ``FP8GlobalStateManager`` whether fp8 is on: a ``NameError``
where Transformer Engine is not installed (CPU, NPU). The patch keeps the constructor and
stores what the argument says (``bool(fp8)``); with Transformer Engine and fp8 off the result
is the same as before (the branch finds fp8 disabled).
"""

from __future__ import annotations

from ldt.patches.registry import register, swap_attr


@register("recompute_norms", "selective norm recomputation (CheckpointWithoutOutput) runs "
                             "without Transformer Engine")
def install(ctx):
    from megatron.core.tensor_parallel import random as mrandom

    cls = mrandom.CheckpointWithoutOutput
    original = cls.__init__

    def __init__(self, fp8=False):
        original(self, fp8)
        self.fp8 = bool(fp8)

    return swap_attr(cls, "__init__", __init__)
