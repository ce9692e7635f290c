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
):
    warnings.filterwarnings("ignore", message=_pattern)
