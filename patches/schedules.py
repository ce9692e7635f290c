"""Patch ``get_forward_backward_func`` so megatron's own schedules use ldt's VTP boundaries.

The schedules themselves stay unmodified: they accept ``p2p_communicator=`` and
``pg_collection=`` (both or neither), and with both given they make every pipeline decision
from those. This patch wraps the function ``get_forward_backward_func()`` returns and fills in
a :class:`~ldt.boundary.communicator.VtpCommunicator` and the stage's process-group
collection when the caller
passed neither. 1F1B, interleaved (incl. ``overlap_p2p_comm``) and no-pipelining all go
through it. A U-shape topology gets ldt's own schedule (:func:`ldt.pipeline.forward_backward.forward_backward_ldt`),
since megatron has none with a wraparound loss stage.

ctx: :class:`ldt.pipeline.forward_backward.MegatronHooks` (or an object with one as
``megatron_hooks``): the VTP state, the communicator and the U-shape schedule come from the
caller, so this adapter depends on megatron-core alone and ldt's layers above it stay above it.

The new function replaces the original under every module-level name bound to it
(:func:`~ldt.patches.registry.swap_everywhere`), so a script that imported
``get_forward_backward_func`` before ``ldt.activate()`` gets ldt's too.
"""

from __future__ import annotations

import functools

from megatron.core.pipeline_parallel import schedules
from megatron.core.utils import get_model_config

from ldt.config import ConfigError
from ldt.patches.registry import register, swap_everywhere

HOOKS = ("state", "communicator", "ushape_schedule")  # what the caller's hooks provide


def hooks_of(ctx):
    """The caller's hooks (ctx itself or its ``megatron_hooks``), checked."""
    hooks = getattr(ctx, "megatron_hooks", ctx)
    if hooks is None or not all(callable(getattr(hooks, h, None)) for h in HOOKS):
        raise ConfigError(
            f"patch schedules needs ctx=MegatronHooks(observers) from "
            f"ldt.pipeline.forward_backward (the VTP state, communicator and U-shape schedule "
            f"it injects); got ctx={ctx!r}")
    return hooks


def with_vtp_communicator(fn, hooks):
    """Wrap one forward-backward function to inject ldt's communicator and groups."""

    @functools.wraps(fn)
    def forward_backward(**kwargs):
        state = hooks.state()
        if (state is not None and kwargs.get("p2p_communicator") is None
                and kwargs.get("pg_collection") is None):
            model = kwargs["model"]
            config = get_model_config(model[0] if isinstance(model, list) else model)
            kwargs["p2p_communicator"] = hooks.communicator(config, state)
            kwargs["pg_collection"] = state.pg_collection()
        return fn(**kwargs)

    forward_backward.ldt_wrapped = fn
    return forward_backward


@register("schedules", "get_forward_backward_func() returns schedules using the VTP communicator")
def install(ctx):
    original = schedules.get_forward_backward_func
    hooks = hooks_of(ctx)

    @functools.wraps(original)
    def get_forward_backward_func(*args, **kwargs):
        state = hooks.state()
        if state is not None and state.topology.u_shape:
            return hooks.ushape_schedule()
        fn = original(*args, **kwargs)
        if fn is schedules.forward_backward_no_pipelining:
            return fn
        return with_vtp_communicator(fn, hooks)

    return swap_everywhere(original, get_forward_backward_func)
