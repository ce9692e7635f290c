"""``ldt-train``: the main job, a Hydra app over ``conf/``.

Today it composes and validates the config on every rank before any collective, prints the
rank map and exits; the training loop lands with the main-job issue. A config that cannot work
exits with status 2 and one message naming the field, the value and the fix.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

EXIT_CONFIG = 2


def load(overrides: Sequence[str]):
    """Compose + validate: (cfg, topology). Raises ValueError subclasses on a bad config."""
    from omegaconf.errors import OmegaConfBaseException

    from ldt.config import ConfigError
    from ldt.hydra_app import compose
    from ldt.validate import validate

    try:
        cfg = compose(list(overrides))
        world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
        topo = validate(cfg.cluster, cfg.model, world_size=world, train=cfg.train)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{exc}".strip()) from None
    return cfg, topo


def main(argv: Sequence[str] | None = None) -> int:
    from hydra.errors import HydraException

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg, topo = load(args)
    except (ValueError, HydraException) as exc:
        rank = os.environ.get("RANK")
        where = f" (rank {rank})" if rank is not None else ""
        print(f"ldt: invalid config{where}: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    print(topo.rank_map())
    print("ldt: config is valid; the training loop is not implemented yet (see the open "
          "main-job issue), nothing was trained.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
