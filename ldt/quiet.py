"""Silence megatron-core's import-time warnings that are expected on CPU-only machines.

Imported first by every local worker (ldt.launch preloads it) and by ldt-train: "Transformer
Engine / Apex not installed" and similar notes say nothing a CPU user can act on. Any other
warning still shows.
"""

import warnings

for _pattern in (
    r".*Transformer Engine and Apex are not installed.*",
    r".*Apex is not installed.*",
    r".*full scope is deprecated.*",
    r".*Transformer Engine is not installed.*",
    r".*CUDA_DEVICE_MAX_CONNECTIONS.*",
    # megatron-core's sequence-parallel all-gather / reduce-scatter use torch's older names
    r".*`torch.distributed.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated.*",
    # a MoE expert whole on its rank (expert TP 1) under sequence parallelism: expected
    r".*`sequence_parallel` is set to `True`, but tensor model parallel size is 1.*",
):
    warnings.filterwarnings("ignore", message=_pattern)
