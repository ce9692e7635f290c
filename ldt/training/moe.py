"""The MoE load-balancing loss of a step: counted by megatron, logged by ldt.

megatron-core's router adds the auxiliary loss to the gradients itself (``MoEAuxLossAutoScaler``,
scaled by the schedule's ``forward_step`` like the language-model loss, on ldt's runtime as
on megatron's schedules) and records its unweighted value per layer in megatron's tracker
(a dict from ``moe_utils.get_moe_layer_wise_logging_tracker()`` up to megatron-core 0.17; from
0.18 ``moe_logging.get_moe_metrics_tracker()``, whose ``ensure_initialized`` sizes an entry,
while the old getter returns a copy: ``ldt.patches.versions``, ``moe_metrics_tracker``). What megatron's training loop does with the tracker
(``track_moe_metrics``) assumes one model per pipeline rank numbered from layer 1; ldt's chunks
are stand-alone models whose routers carry the model's global layer number
(:func:`ldt.models.build.build_chunk`), so here the tracker is sized for the whole model before
each step (:func:`reset`) and summed over every rank after it (:func:`aux_loss`). The value is
megatron's ``load_balancing_loss``: the unweighted balance loss (1 when the routing is
perfectly even), averaged over the MoE layers and the step's micro-batches; what the gradients
see is ``model.moe_aux_loss_coeff`` times it per layer.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ldt.patches import versions

AUX = "load_balancing_loss"  # megatron's tracker key (TopKRouter._apply_aux_loss)


def tracks_aux_loss(model) -> bool:
    return bool(model.num_moe_experts) and model.moe_aux_loss_coeff > 0


def reset(model) -> None:
    """Empty megatron's tracker and size it for every layer of ``model`` (before a step)."""
    if not tracks_aux_loss(model):
        return
    if versions.holds("moe_metrics_tracker"):
        from megatron.core.transformer.moe import moe_logging

        moe_logging.destroy_moe_metrics_tracker()
        moe_logging.get_moe_metrics_tracker().ensure_initialized(AUX, model.num_layers, "cpu")
        return
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    tracker.clear()
    tracker[AUX] = {"values": torch.zeros(model.num_layers), "reduce_group": None,
                    "avg_group": None, "reduce_group_has_dp": False}


def _tracked_values() -> Optional[torch.Tensor]:
    """The load-balancing loss per layer in megatron's tracker (None if nothing recorded)."""
    if versions.holds("moe_metrics_tracker"):
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        entry = get_moe_metrics_tracker().metrics.get(AUX)
        return None if entry is None else entry.values
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    entry = get_moe_layer_wise_logging_tracker().get(AUX)
    return None if entry is None else entry["values"]


def aux_loss(model, micro_batches: int, group=None) -> Optional[float]:
    """The step's load-balancing loss (None without one): every rank's tracked values summed
    over ``group`` (a group of every rank; collective), divided by the step's micro-batches
    over all replicas and by the MoE layers. A sum over every rank is right for every layout:
    each layer lives on one stage, a TP rank holds its slice of the sequence (megatron's MoE
    needs sequence parallelism with TP > 1) and a replica its micro-batches."""
    if not tracks_aux_loss(model):
        return None
    values = _tracked_values()
    total = torch.zeros(1, dtype=torch.float64)
    if values is not None:
        total += values.double().sum().cpu()
    dist.all_reduce(total, group=group)
    return float(total.item()) / micro_batches / sum(model.moe_layers())
