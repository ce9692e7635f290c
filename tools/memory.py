"""``ldt-memory [hydra flags] [overrides]``: does this config fit, and where does the memory go?

A Hydra app over the same ``conf/`` as ``ldt-train``: it validates the config (not the
devices: a GPU/NPU cluster is estimated on any machine), prints the rank map and every stage's
memory per rank (:mod:`ldt.memory`: the stages' real chunks on fake tensors, two micro-batches
through megatron-core, times what the schedule keeps in flight), and starts nothing. Exit
status 2 when a stage's estimate exceeds its ``cluster.stages[i].memory_gib`` (the line
``ldt-train`` would refuse with), else 0.
"""

from __future__ import annotations

import sys
from typing import Sequence

from ldt import memory
from ldt.config import to_train
from ldt.config.errors import EXIT_CONFIG, one_line
from ldt.job.hydra import run_app
from ldt.memory.report import refusal, snapshot_line, table
from ldt.tools.rankmap import show_rank_map


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):  # Hydra's would be ldt-train's (its template)
        try:
            print(__doc__.strip() + "\n\nThe config groups, keys and Hydra flags are "
                  "ldt-train's (ldt-train --help lists them); e.g. ldt-memory cluster=cpu_vtp "
                  "model=llama_tiny train.micro_batch_size=4", flush=True)
        except BrokenPipeError:  # `ldt-memory --help | head -3`: the reader has what it wanted
            import os

            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return run_app(_estimate, args, run_folder=False)


def _estimate(cfg) -> int:
    import time

    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(cfg, resolve=True)
    topo = show_rank_map(cfg)
    if topo is None:
        return EXIT_CONFIG
    t0 = time.perf_counter()
    try:
        stages = memory.estimate(plain)
    except ValueError as exc:  # what the estimate cannot cover
        print(f"ldt: cannot estimate: {one_line(exc)}", file=sys.stderr)
        return EXIT_CONFIG
    train = to_train(plain["train"])
    print(table(stages))
    if snapshot_line(stages, train):
        print(snapshot_line(stages, train))
    print(f"(estimated in {time.perf_counter() - t0:.1f} s)")
    over = [s for s in stages if not s.fits]
    for s in over:
        print(f"ldt: does not fit: {refusal(s, topo, train)}", file=sys.stderr)
    return EXIT_CONFIG if over else 0


if __name__ == "__main__":
    sys.exit(main())
