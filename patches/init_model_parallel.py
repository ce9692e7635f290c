"""Patch ``parallel_state.initialize_model_parallel`` to build the active VTP topology.

An existing Megatron-core script calls ``initialize_model_parallel(tp, pp)``; with ldt active
that call builds the VTP state instead (each stage its own TP size), after checking that the
script's ``pp`` agrees with the cluster. ctx: the :class:`~ldt.topology.Topology` to build
(and optionally ``timeout_s`` via ``ctx.timeout_s`` when ctx is an ldt ActiveContext).
"""

from __future__ import annotations

import functools
import logging

from megatron.core import parallel_state as ps

from ldt.config import ConfigError
from ldt.patches.registry import register, swap_attr

log = logging.getLogger("ldt")


def _topology_of(ctx):
    return getattr(ctx, "topology", ctx)


@register("init_model_parallel",
          "parallel_state.initialize_model_parallel(tp, pp) builds the active VTP topology")
def install(ctx):
    if ctx is None:
        raise ConfigError("patch init_model_parallel needs the topology to build (ctx=Topology)")
    original = ps.initialize_model_parallel

    @functools.wraps(original)
    def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                                  pipeline_model_parallel_size: int = 1, *args, **kwargs):
        from ldt.parallel_state import initialize_vtp

        topo = _topology_of(ctx)
        if pipeline_model_parallel_size != topo.num_stages:
            raise ConfigError(
                f"initialize_model_parallel(pipeline_model_parallel_size="
                f"{pipeline_model_parallel_size}) but the ldt cluster has {topo.num_stages} "
                f"stages (TP {topo.tp_sizes}); pass pipeline_model_parallel_size="
                f"{topo.num_stages} or change the cluster file"
            )
        vpp = kwargs.get("virtual_pipeline_model_parallel_size")
        state = initialize_vtp(topo, timeout_s=getattr(ctx, "timeout_s", None))
        if vpp is not None:
            ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = vpp
            ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = 0
        stage_tp = topo.stages[state.stage].tp
        if tensor_model_parallel_size != stage_tp:
            log.info("ldt: script asked for TP %d; stage %d runs TP %d from the cluster config",
                     tensor_model_parallel_size, state.stage, stage_tp)

    return swap_attr(ps, "initialize_model_parallel", initialize_model_parallel)
