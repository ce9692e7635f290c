"""Patch ``get_forward_backward_func`` so megatron's own schedules use ldt's VTP boundaries.

The schedules themselves stay unmodified: they accept ``p2p_communicator=`` and
``pg_collection=`` (both or neither), and with both given they make every pipeline decision
from those. This patch wraps the function ``get_forward_backward_func()`` returns and fills in
a :class:`~ldt.boundary.communicator.VtpCommunicator` and the stage's process-group
collection when the caller
passed neither. 1F1B, interleaved (incl. ``overlap_p2p_comm``) and no-pipelining all go
through it. A U-shape topology gets ldt's own schedule (:func:`ldt.schedule.forward_backward.forward_backward_ldt`),
since megatron has none with a wraparound loss stage. ctx: optional object with ``observers``
(boundary observers for audit/NaN checks).

The new function replaces the original under every module-level name bound to it
(:func:`~ldt.patches.registry.swap_everywhere`), so a script that imported
``get_forward_backward_func`` before ``ldt.run.activate()`` gets ldt's too.
"""

from __future__ import annotations

import functools

from megatron.core.pipeline_parallel import schedules
from megatron.core.utils import get_model_config

from ldt.patches.registry import register, swap_everywhere


def with_vtp_communicator(fn, observers=()):
    """Wrap one forward-backward function to inject ldt's communicator and groups."""

    @functools.wraps(fn)
    def forward_backward(**kwargs):
        from ldt.boundary.communicator import VtpCommunicator
        from ldt.parallel_state import get_vtp_state, is_vtp_initialized

        if (is_vtp_initialized() and kwargs.get("p2p_communicator") is None
                and kwargs.get("pg_collection") is None):
            state = get_vtp_state()
            model = kwargs["model"]
            config = get_model_config(model[0] if isinstance(model, list) else model)
            kwargs["p2p_communicator"] = VtpCommunicator(config, state, list(observers))
            kwargs["pg_collection"] = state.pg_collection()
        return fn(**kwargs)

    forward_backward.ldt_wrapped = fn
    return forward_backward


@register("schedules", "get_forward_backward_func() returns schedules using the VTP communicator")
def install(ctx):
    original = schedules.get_forward_backward_func
    observers = tuple(getattr(ctx, "observers", ()) or ())

    @functools.wraps(original)
    def get_forward_backward_func(*args, **kwargs):
        from ldt.parallel_state import get_vtp_state, is_vtp_initialized

        if is_vtp_initialized() and get_vtp_state().topology.u_shape:
            from ldt.schedule.forward_backward import forward_backward_ldt

            return functools.partial(forward_backward_ldt, observers=observers)
        fn = original(*args, **kwargs)
        if fn is schedules.forward_backward_no_pipelining:
            return fn
        return with_vtp_communicator(fn, observers)

    return swap_everywhere(original, get_forward_backward_func)
