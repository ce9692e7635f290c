"""``ldt-rankmap [hydra flags] [overrides]``: print the rank map of a config.

A Hydra app over the same ``conf/`` as ``ldt-train`` (so ``--help``, ``--cfg job`` and
``--config-dir`` work alike); it validates the config (not the devices: a rank map of a GPU/NPU
cluster is printed on any machine) and starts nothing.
"""

from __future__ import annotations

import sys
from typing import Sequence

from ldt.config.errors import EXIT_CONFIG
from ldt.config.errors import one_line
from ldt.job.hydra import run_app
from ldt.topology.validate import validate


def main(argv: Sequence[str] | None = None) -> int:
    return run_app(_print_rank_map, argv, run_folder=False)


def _print_rank_map(cfg) -> int:
    return 0 if show_rank_map(cfg) is not None else EXIT_CONFIG


def show_rank_map(cfg):
    """Validate ``cfg`` (not the devices) and print which config it is and its rank map; the
    Topology, or None after printing the refusal in one line. (ldt-memory starts the same way.)"""
    from hydra.core.hydra_config import HydraConfig

    try:
        topo = validate(cfg.cluster, cfg.model, world_size=None, train=cfg.train,
                        check_devices=False)
    except ValueError as exc:  # ConfigError, LayoutError
        print(f"ldt: invalid config: {one_line(exc)}", file=sys.stderr)
        return None
    choices = HydraConfig.get().runtime.choices
    print(f"cluster={choices.get('cluster')} model={choices.get('model')}")
    print(topo.rank_map())
    return topo


if __name__ == "__main__":
    sys.exit(main())
