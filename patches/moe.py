"""megatron-core's MoE router without Transformer Engine.

megatron-core 0.16.1's ``moe_utils`` imports ``te_general_gemm`` only when Transformer Engine
is installed, but ``RouterGatingLinearFunction`` tests ``te_general_gemm is not None`` either
way: without TE the router's first forward raises ``NameError: name 'te_general_gemm' is not
defined``. The patch defines the missing name as ``None``, which selects megatron's own
``torch.mm`` path (what the test meant). Nothing changes where TE is installed. Applied on
every stage (CPU, NPU and GPUs without TE run the local spec). From 0.17 ``moe_utils`` defines
the name as ``None`` itself, so the patch is for 0.16 only (``ldt.patches.versions``:
``te_general_gemm_undefined``).
"""

from __future__ import annotations

from ldt.patches import versions
from ldt.patches.registry import register


@register("moe_without_te", "megatron's MoE router gating runs without Transformer Engine "
                            "(defines moe_utils.te_general_gemm = None when TE is absent)",
          versions=versions.releases("te_general_gemm_undefined"))
def install(ctx):
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return lambda: None
    moe_utils.te_general_gemm = None

    def undo() -> None:
        del moe_utils.te_general_gemm

    return undo
