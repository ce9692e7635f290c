"""Keep a rank's output to what its user can act on: warnings filtered, logging at one level.

Imported first by every local worker (ldt.launch.local preloads it) and by ldt-train: "Transformer
Engine / Apex not installed" and similar notes say nothing a CPU user can act on. Any other
warning still shows.

:func:`set_log_level` sets a rank's Python logging (megatron-core's above all) to one level,
whatever launched it: a bare launch's ranks have no handler (Python prints warnings and errors
only), while under torchrun each rank is a Hydra app whose handler would print megatron-core's
INFO records (DDP buckets, every parameter name, the optimizer config) from every rank.
"""

import logging
import sys
import warnings
from typing import Optional, Sequence

from ldt.config import LOG_LEVELS  # noqa: F401  (re-exported: ldt.job.megatron's --log-level choices)

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
    # megatron-core 0.19 warns on importing its multimodal models' config, which ldt never uses
    r".*MimoModelConfig is experimental.*",
):
    warnings.filterwarnings("ignore", message=_pattern)

# Log records that say nothing a user of ldt can act on: logger -> the message's start.
_DROPPED_RECORDS = {
    # megatron-core 0.19 deprecates GPTModel for HybridModel; ldt builds GPTModel on every
    # supported release (docs/megatron_versions.md)
    "megatron.core.models.gpt.gpt_model": "GPTModel IS DEPRECATED",
    # torch's CUDA build on a machine without CUDA (it still runs on CPU)
    "torch.utils.cpp_extension": "No CUDA runtime is found",
}


def _dropping(start: str):
    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(start)

    return keep


for _name, _start in _DROPPED_RECORDS.items():
    logging.getLogger(_name).addFilter(_dropping(_start))


class _RankHandler(logging.StreamHandler):
    """ldt's handler: one line per record on stderr, prefixed with the rank."""


def set_log_level(level: str = "WARNING", rank: Optional[int] = None,
                  loggers: Sequence[str] = ("",)) -> None:
    """Records of ``loggers`` (default: the root, i.e. every library) at ``level`` and above
    go to stderr, one line each: ``[rank 3] WARNING megatron.core.x: message``.

    The root's handlers are replaced (a rank is ldt's process: under torchrun Hydra's console
    handler would print to stdout, mixed with the progress lines); a named logger gets ldt's
    handler and stops propagating, so a script's own logging setup (``python -m ldt.job.megatron``)
    neither shows nor hides megatron-core's records. Calling it again replaces what it set.
    """
    handler = _RankHandler(sys.stderr)
    who = f"[rank {rank}] " if rank is not None else ""
    handler.setFormatter(logging.Formatter(f"{who}%(levelname)s %(name)s: %(message)s"))
    for name in loggers:
        log = logging.getLogger(name)
        for old in list(log.handlers):
            if not name or isinstance(old, _RankHandler):
                log.removeHandler(old)
        log.addHandler(handler)
        log.setLevel(level.upper())
        if name:
            log.propagate = False
