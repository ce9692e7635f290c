"""ldt's own forward-backward function: the U-shape schedule run by :mod:`ldt.pipeline.runtime`.

It has the signature of megatron-core's forward-backward functions, so with ldt active
``get_forward_backward_func()`` returns it for a U-shape cluster and a Megatron training loop
calls it unchanged. The schedule comes from :mod:`ldt.schedule` (generated, lowered and
checked for deadlock once per (kind, stages, micro-batches)), the same lists the simulator and
the planner use.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

from megatron.core.utils import get_model_config

from ldt.boundary.communicator import VtpCommunicator
from ldt.boundary.lane_communicator import LaneCommunicator, lane_of
from ldt.groups.parallel_state import get_vtp_state, is_vtp_initialized
from ldt.pipeline.runtime import StageRoles, StepResult, run_actions
from ldt.schedule import check_schedule, forwards_of, lower, one_f_one_b, u_shape
from ldt.schedule.routing import Lanes
from ldt.schedule.vdp import vdp_schedule
from ldt.schedule.zerobubble import Priced, zb_h1, zb_u_shape


@functools.lru_cache(maxsize=64)
def stage_schedules(kind: str, num_stages: int, num_microbatches: int,
                    forward_only: bool = False, prefetch: int = 0, zero_bubble: bool = False,
                    priced: Optional[Priced] = None):
    """The lowered, deadlock-checked action lists of every stage (``forward_only``: the
    training schedule's forwards only, for evaluation; ``prefetch``: the U-shape's depth;
    ``zero_bubble``: the backwards split into B and W, :mod:`ldt.schedule.zerobubble`,
    generated from ``priced``, the run's per-stage costs (``ldt.plan.zb_prices.run_prices``;
    None: all equal))."""
    if zero_bubble:
        tables = priced.tables() if priced is not None else (None, None)
        compute = (zb_u_shape(num_stages, num_microbatches, *tables, prefetch=prefetch)
                   if kind == "ushape" else zb_h1(num_stages, num_microbatches, *tables))
    elif kind == "ushape":
        compute = u_shape(num_stages, num_microbatches, prefetch=prefetch)
    else:
        compute = one_f_one_b(num_stages, num_microbatches)
    if forward_only:
        compute = forwards_of(compute)
    schedule = lower(compute, kind, prefetch=prefetch if kind == "ushape" else 0)
    check_schedule(schedule)
    return schedule


@functools.lru_cache(maxsize=64)
def lane_schedules(stage_dp: tuple, num_microbatches: int, u_shape: bool,
                   forward_only: bool = False, prefetch: int = 0, zero_bubble: bool = False,
                   priced: Optional[Priced] = None):
    """Per-stage DP: the checked lane lists (:mod:`ldt.schedule.vdp`; ``zero_bubble``: each
    backward split, its W placed from ``priced``)."""
    return vdp_schedule(stage_dp, num_microbatches, u_shape, forward_only,
                        prefetch=prefetch if u_shape else 0, zero_bubble=zero_bubble,
                        priced=priced)


def run_step(*, forward_step_func, data_iterator, model, num_microbatches: int,
             seq_length: int, micro_batch_size: int, comm, state, config,
             record_timings: bool = False, forward_only: bool = False,
             prefetch: int = 0, zero_bubble: bool = False,
             priced: Optional[Priced] = None) -> StepResult:
    """One training step (or, ``forward_only``, one evaluation step: losses, no gradients) of
    this rank's stage (the U-shape when the topology says so, with ``prefetch``; its
    zero-bubble schedule with ``zero_bubble``, the ``wgrad_split`` patch applied, generated
    from ``priced``)."""
    topo = state.topology
    kind = "ushape" if topo.u_shape else "1f1b"
    models = model if isinstance(model, list) else [model]
    roles = StageRoles.for_stage(state.stage, topo.num_stages, topo.u_shape, models)
    if topo.is_vdp:  # per-stage DP: this replica's lane; peers are lanes; m of its own
        schedule = lane_schedules(tuple(topo.dp_sizes), num_microbatches, topo.u_shape,
                                  forward_only, prefetch, zero_bubble, priced)
        lane = lane_of(state)
        actions, comm = schedule[lane], LaneCommunicator(comm, tuple(topo.dp_sizes))
        # megatron's forward_step scales the loss by 1 / this, and on every MoE stage the
        # load-balancing loss: a loss-stage lane's count, which the stage's grad_factor
        # (ldt.schedule.routing) turns into the uniform-DP gradient for both (a lane's own
        # count would weigh a MoE stage's aux loss dp_s / dp_loss times the reference's)
        loss_lane = Lanes(tuple(topo.dp_sizes)).lane(topo.loss_stage(), 0)
        num_microbatches = len(schedule.microbatches[loss_lane])
    else:
        schedule = stage_schedules(kind, topo.num_stages, num_microbatches, forward_only,
                                   prefetch, zero_bubble, priced)
        actions = schedule[state.stage]
    return run_actions(
        actions, roles=roles, comm=comm, forward_step_func=forward_step_func,
        data_iterator=data_iterator if roles.reads_data else None,
        num_microbatches=num_microbatches,
        # this rank's boundary shape, as megatron's get_tensor_shapes (sequence parallel: a slice)
        tensor_shape=(seq_length // comm.layout.shards, micro_batch_size, config.hidden_size),
        config=config,
        schedule=schedule, record_timings=record_timings, keep_activations=not forward_only)


def forward_backward_ldt(*, forward_step_func, data_iterator, model, num_microbatches: int,
                         seq_length: int, micro_batch_size: int,
                         decoder_seq_length: Optional[int] = None, forward_only: bool = False,
                         collect_non_loss_data: bool = False, first_val_step=None,
                         adjust_tensor_shapes_fn=None, p2p_communicator=None,
                         pg_collection=None, force_all_reduce=False, observers=(),
                         zero_bubble: bool = False, priced: Optional[Priced] = None
                         ) -> list[Any]:
    """Megatron-compatible forward-backward over ldt's schedule; returns the loss stage's
    ``forward_data_store`` (empty elsewhere), like megatron's schedules. ``zero_bubble``:
    ldt's own argument, the zero-bubble schedule (the ``wgrad_split`` patch applied),
    generated from ``priced`` (None: equal costs)."""
    if collect_non_loss_data:
        raise NotImplementedError(
            "collect_non_loss_data is not supported by ldt's schedule runtime; collect what "
            "you need inside forward_step_func's loss function, or evaluate a plain pipeline "
            "(cluster.u_shape=false) on megatron's schedule")
    state = get_vtp_state()
    models = model if isinstance(model, list) else [model]
    config = get_model_config(models[0])
    comm = p2p_communicator or VtpCommunicator(config, state, list(observers))
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    return run_step(forward_step_func=forward_step_func, data_iterator=data_iterator,
                    model=model, num_microbatches=num_microbatches, seq_length=seq_length,
                    micro_batch_size=micro_batch_size, comm=comm, state=state,
                    config=config, forward_only=forward_only, zero_bubble=zero_bubble,
                    priced=priced).losses


@dataclass(frozen=True)
class MegatronHooks:
    """What the ``schedules`` patch puts into megatron's forward-backward functions (ctx of
    ``patches.apply([..., "schedules"])``): the VTP state, a communicator per call and, for a
    U-shape, ldt's schedule. ``observers`` see every boundary tensor (audit, NaN checks)."""

    observers: tuple = ()

    def state(self):
        """The active VTP state, or None (megatron's schedules then run unchanged)."""
        return get_vtp_state() if is_vtp_initialized() else None

    def communicator(self, config, state):
        return VtpCommunicator(config, state, list(self.observers))

    def ushape_schedule(self):
        return functools.partial(forward_backward_ldt, observers=self.observers)
