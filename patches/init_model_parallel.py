"""Patch ``parallel_state.initialize_model_parallel`` to build the active VTP topology.

An existing Megatron-core script calls ``initialize_model_parallel(tp, pp)``; with ldt active
that call builds the VTP state instead (each stage its own TP size), after checking that the
script's ``pp`` agrees with the cluster. ctx: an object with ``topology`` (the Topology to
build), ``initialize_vtp`` (the function that builds it, :func:`ldt.groups.parallel_state.initialize_vtp`,
passed in so that this adapter depends on megatron-core alone) and optionally ``timeout_s``.
"""

from __future__ import annotations

import functools
import inspect
import logging

from megatron.core import parallel_state as ps

from ldt.config import ConfigError
from ldt.patches.registry import register, swap_everywhere

log = logging.getLogger("ldt")


def _checked(ctx):
    if not (hasattr(ctx, "topology") and callable(getattr(ctx, "initialize_vtp", None))):
        raise ConfigError(
            "patch init_model_parallel needs ctx with .topology (the Topology to build) and "
            f".initialize_vtp (ldt.groups.parallel_state.initialize_vtp); got ctx={ctx!r}")
    return ctx


# Sizes ldt builds as 1 (or as given by the cluster); a script asking for more is refused.
_MUST_BE_ONE = ("context_parallel_size", "expert_model_parallel_size",
                "num_distributed_optimizer_instances")


def _refuse_unsupported(kwargs) -> None:
    for name in _MUST_BE_ONE:
        if kwargs.get(name, 1) not in (1, None):
            raise ConfigError(
                f"initialize_model_parallel({name}={kwargs[name]}) under ldt: ldt builds "
                f"{name}=1 on every stage (each stage's TP size comes from the cluster file); "
                f"pass {name}=1")
    etp = kwargs.get("expert_tensor_parallel_size")
    if etp is not None:
        log.info("ldt: expert_tensor_parallel_size=%s ignored; experts use each stage's TP", etp)


def _stages_of(get_ranks, topo):
    """Stage indices of megatron's ``get_embedding_ranks(pp_ranks)`` callback, given the
    leaders as the pipeline ranks (None: ldt's default)."""
    if get_ranks is None:
        return None
    leaders = list(topo.leaders(0))
    chosen = get_ranks(leaders)
    unknown = [r for r in chosen if r not in leaders]
    if unknown:
        raise ConfigError(f"get_embedding_ranks returned ranks {unknown} that are not among "
                          f"the pipeline ranks {leaders} it was given")
    return [leaders.index(r) for r in chosen]


@register("init_model_parallel",
          "parallel_state.initialize_model_parallel(tp, pp) builds the active VTP topology")
def install(ctx):
    ctx = _checked(ctx)
    original = ps.initialize_model_parallel
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                                  pipeline_model_parallel_size: int = 1, *args, **kwargs):
        kwargs = signature.bind(tensor_model_parallel_size, pipeline_model_parallel_size,
                                *args, **kwargs).arguments  # positional ones by name too
        topo = ctx.topology
        if pipeline_model_parallel_size != topo.num_stages:
            raise ConfigError(
                f"initialize_model_parallel(pipeline_model_parallel_size="
                f"{pipeline_model_parallel_size}) but the ldt cluster has {topo.num_stages} "
                f"stages (TP {topo.tp_sizes}); pass pipeline_model_parallel_size="
                f"{topo.num_stages} or change the cluster file"
            )
        _refuse_unsupported(kwargs)
        vpp = kwargs.get("virtual_pipeline_model_parallel_size")
        state = ctx.initialize_vtp(
            topo, timeout_s=getattr(ctx, "timeout_s", None),
            embedding_stages=_stages_of(kwargs.get("get_embedding_ranks"), topo),
            position_embedding_stages=_stages_of(kwargs.get("get_position_embedding_ranks"), topo))
        if vpp is not None:
            ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = vpp
            ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = 0
        stage_tp = topo.stages[state.stage].tp
        if tensor_model_parallel_size != stage_tp:
            log.info("ldt: script asked for TP %d; stage %d runs TP %d from the cluster config",
                     tensor_model_parallel_size, state.stage, stage_tp)

    # every name bound to it: a script may have imported it before ldt.activate()
    return swap_everywhere(original, initialize_model_parallel)
