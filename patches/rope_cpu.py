"""CPU shim for megatron-core's rotary position embedding (Llama, Qwen2 on CPU stages).

``RotaryEmbedding.get_emb`` moves its ``inv_freq`` buffer to ``torch.cuda.current_device()``
on the first forward whenever the buffer is on CPU, which fails on a machine without CUDA.
The shim replaces the module-level name ``torch`` inside
``megatron.core.models.common.embeddings.rotary_pos_embedding`` with a proxy whose
``cuda.current_device()`` answers ``"cpu"``, so the move is a no-op and the module's own code
stays as it is. Applied only for CPU stages, together with ``cpu_shims``.
"""

from __future__ import annotations

import torch

from ldt.patches.cpu_shims import ModuleProxy
from ldt.patches.registry import register, swap_attr


@register("rope_cpu", "RoPE frequencies stay on CPU (megatron moves them to cuda in forward)")
def install(ctx):
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    cuda_is_cpu = ModuleProxy(torch.cuda, current_device=lambda: "cpu")
    return swap_attr(rotary_pos_embedding, "torch", ModuleProxy(torch, cuda=cuda_is_cpu))
