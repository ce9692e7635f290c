"""Run an existing Megatron-core script with VTP: ``python -m ldt.job.megatron --cluster FILE.yaml script.py args``.

The script is unchanged: it calls ``torch.distributed.init_process_group``,
``parallel_state.initialize_model_parallel(tp, pp)``, builds a GPTModel for its pipeline stage
and calls ``get_forward_backward_func()``. :func:`activate` applies ldt's patches first, so
those calls build the cluster's VTP state (each stage its own TP size) and megatron's schedules
run over ldt's stage boundaries. Under torchrun (RANK set) this process joins that world;
launched bare it starts the cluster's world on this machine, like ``ldt-train``.
For CPU stages, CUDA-only calls of the script map to CPU and gloo (patch ``cuda_to_cpu``).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from ldt import patches
from ldt.config import ConfigError, load_cluster_yaml, to_cluster
from ldt.config.errors import EXIT_CONFIG
import ldt.launch.quiet
from ldt.launch.quiet import LOG_LEVELS
from ldt.launch.quiet import set_log_level
from ldt.launch.lifetime import stop_with_torchrun_agent
from ldt.topology.ranks import Topology


@dataclass
class Activation:
    """What :func:`activate` applied; ``deactivate()`` reverts it."""

    topology: Topology
    timeout_s: Optional[float]
    patches: list

    # what the init_model_parallel and schedules patches call back into (they sit below ldt's
    # groups and runtime, so the caller hands them in)
    @property
    def initialize_vtp(self):
        from ldt.groups.parallel_state import initialize_vtp

        return initialize_vtp

    @property
    def megatron_hooks(self):
        from ldt.pipeline.forward_backward import MegatronHooks

        return MegatronHooks()

    def deactivate(self) -> None:
        patches.revert(self.patches)


def activate(cluster, *, u_shape: Optional[bool] = None, timeout_s: Optional[float] = None,
             rank: Optional[int] = None) -> Activation:
    """One line in a Megatron-core script turns VTP on: anywhere before the script calls
    ``parallel_state.initialize_model_parallel`` (also after it imported megatron's functions,
    e.g. ``get_forward_backward_func`` or ``initialize_model_parallel`` itself).

    ``cluster``: a path to a cluster YAML, a ClusterConfig or a dict. The stage device of this
    rank (``RANK`` from the environment) decides whether the CPU shims are applied.
    """
    from megatron.core import parallel_state as ps

    from ldt.groups.parallel_state import is_vtp_initialized

    if ps.model_parallel_is_initialized() and not is_vtp_initialized():
        raise ConfigError(
            "ldt.activate() was called after parallel_state.initialize_model_parallel(): "
            "megatron's uniform groups are already built. Call activate() before "
            "initialize_model_parallel (anywhere above it in the script), or run the script "
            "unchanged with `python -m ldt.job.megatron --cluster FILE.yaml script.py`")

    cfg = load_cluster_yaml(cluster) if isinstance(cluster, (str, os.PathLike)) else to_cluster(cluster)
    if u_shape is not None:
        cfg = replace(cfg, u_shape=u_shape)
    topo = Topology.from_config(cfg)
    if topo.is_vdp:
        raise ConfigError(
            f"cluster.stages[*].dp = {topo.dp_sizes}: per-stage data parallelism runs on "
            "ldt's runtime and optimizer (ldt-train), not under a Megatron script, whose "
            "schedules pair each stage with one neighbour and whose model-parallel group is "
            "one replica of the pipeline; give every stage the same dp (cluster.dp) or train "
            "with ldt-train")
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    on_cpu = topo.rank_info(rank).device == "cpu" if rank < topo.world_size else False
    names = (["init_model_parallel", "schedules", "dist_checkpointing", "sequence_parallel_norms",
              "recompute_norms", "moe_without_te"]
             + (["cpu_shims", "optimizer_cpu", "rope_cpu", "cuda_to_cpu"] if on_cpu else []))
    act = Activation(topo, timeout_s, names)
    patches.apply(names, ctx=act)
    return act


def _run_script(rank: int, world: int, cluster: dict, u_shape: Optional[bool],
                timeout_s: float, script: str, args: list, log_level: str = "WARNING") -> None:
    import atexit

    # megatron-core's and ldt's logging are ldt's business here, whatever the script sets up
    # for its own (a script's logging.basicConfig(level=INFO) would show megatron's INFO)
    set_log_level(log_level, rank, loggers=("megatron", "ldt"))
    activate(cluster, u_shape=u_shape, timeout_s=timeout_s, rank=rank)
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        # What the interpreter does when a script ends; this process ends with os._exit
        # instead, which would leave e.g. the multiprocessing Manager that megatron's
        # dist-checkpointing writer starts running, holding the launcher's output open.
        atexit._run_exitfuncs()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ldt.job.megatron", description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", required=True, help="cluster YAML (stages, u_shape, dp)")
    parser.add_argument("--u-shape", action="store_true", default=None,
                        help="force the U-shape (stage 0 runs the head and the loss)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a collective may wait before the run is stopped")
    parser.add_argument("--log-level", default="WARNING", type=str.upper, choices=LOG_LEVELS,
                        help="megatron-core's and ldt's logging on every rank (INFO: "
                             "megatron's setup notes); the script's own logging is its own")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    import dataclasses

    try:
        cluster = dataclasses.asdict(load_cluster_yaml(ns.cluster))
    except ConfigError as exc:
        print(f"ldt.job.megatron: invalid config: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if "RANK" in os.environ:  # torchrun: this process is one rank of its world
        stop_with_torchrun_agent()  # and never outlives torchrun's agent
        return _torchrun_rank(cluster, ns)
    from ldt.launch.local import WorldError, run_local_world

    topo = Topology.from_config(to_cluster(cluster))
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True"}  # the script's env:// joins our store
    try:
        run_local_world(topo.world_size, _run_script,
                        (cluster, ns.u_shape, ns.timeout, ns.script, ns.args, ns.log_level),
                        timeout_s=None, comm_timeout_s=ns.timeout,
                        env=env, init_dist=False)
    except WorldError as exc:
        print(f"ldt.job.megatron: {exc}", file=sys.stderr)
        return 1
    return 0


def _torchrun_rank(cluster: dict, ns) -> int:
    """One rank of torchrun's world. A failure that is not the script's own error or a bug
    (a boundary transfer, a lost peer, a refused config) is one line, as under ldt-train;
    anything else keeps its traceback, printed as Python prints it."""
    rank = int(os.environ["RANK"])
    try:
        _run_script(rank, int(os.environ["WORLD_SIZE"]), cluster, ns.u_shape, ns.timeout,
                    ns.script, ns.args, ns.log_level)
    except (Exception, KeyboardInterrupt) as exc:
        from ldt.training import failure

        if failure.reason(exc) is None:
            raise
        topo = Topology.from_config(to_cluster(cluster))
        return failure.report(exc, failure.rank_label(topo, rank), prog="ldt.job.megatron")
    return 0


if __name__ == "__main__":
    sys.exit(main())
