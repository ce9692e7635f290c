"""dist-checkpointing's sharding check, for one tensor sharded by different stage TP sizes.

Before a save, megatron-core checks per key that all shards share one regular grid and that
the main replicas cover the tensor exactly once on that grid. Under VTP a key can have shards
on several grids: the stacked ``decoder.layers.*`` tensors hold each stage's layers split by
that stage's TP size, and the tied output layer is saved as a (non-main) replica of
``embedding.word_embeddings.weight`` split by the last stage's TP size. This patch keeps
megatron's check for a key on one grid and, for a key on several, checks the same property
directly: equal dtype and global shape everywhere, and the main replicas' boxes covering the
global tensor exactly once (counted on the common refinement of all their boundaries).
Loading needs nothing: every rank reads its own slice by global offsets.

megatron-core 0.16's ``_validate_sharding_for_key`` raises what it finds; from 0.17 it returns
the errors as a list, which ``validate_sharding_integrity`` joins into one exception
(``ldt.patches.versions``: ``sharding_errors_returned``). The patch reports its own findings
the way the installed release's caller expects.
"""

from __future__ import annotations

import itertools

from ldt.patches import versions
from ldt.patches.registry import register, swap_attr


def _box(sharding) -> list[tuple[int, int]]:
    """[start, end) per global axis (prepended axes have length 1)."""
    n = sharding.prepend_axis_num
    box = [(off, off + 1) for off in sharding.global_offset[:n]]
    box += [(off, off + sh) for off, sh in zip(sharding.global_offset[n:], sharding.local_shape)]
    return box


def coverage_errors(shardings, global_shape) -> list[str]:
    """How the boxes fail to tile ``global_shape`` exactly once (empty if they do)."""
    cuts = [sorted({0, size} | {b for s in shardings for b in _box(s)[axis]})
            for axis, size in enumerate(global_shape)]
    count = {cell: 0 for cell in itertools.product(*(range(len(c) - 1) for c in cuts))}
    for s in shardings:
        ranges = [range(c.index(lo), c.index(hi)) for c, (lo, hi) in zip(cuts, _box(s))]
        for cell in itertools.product(*ranges):
            count[cell] += 1
    return [f"cell {cell}: written {n} times" for cell, n in count.items() if n != 1][:5]


def _several_grids_errors(shards) -> list[str]:
    """What is wrong with one key's shards on several grids (empty if nothing is)."""
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    first = shards[0]
    for s in shards:
        if s.dtype != first.dtype or s.global_shape != first.global_shape:
            return [f"{s.key}: shards disagree on dtype/shape: {s.dtype} {s.global_shape} vs "
                    f"{first.dtype} {first.global_shape}"]
    errors = coverage_errors([s for s in shards if is_main_replica(s.replica_id)],
                             first.global_shape)
    return [f"Invalid access pattern for {first.key}: {errors}"] if errors else []


@register("dist_checkpointing", "dist-checkpointing accepts one tensor sharded by different "
                                "stage TP sizes (layers of VTP stages, tied embedding)")
def install(ctx):
    from megatron.core.dist_checkpointing import validation
    from megatron.core.dist_checkpointing.core import CheckpointingException

    original = validation._validate_sharding_for_key
    returns_errors = versions.holds("sharding_errors_returned")

    def _validate_sharding_for_key(rank_sharding):
        shards = [s for _, s in rank_sharding]
        if len({s.axis_fragmentations for s in shards}) == 1:
            return original(rank_sharding)
        errors = [CheckpointingException(e) for e in _several_grids_errors(shards)]
        if errors and not returns_errors:
            raise errors[0]
        return errors if returns_errors else None

    return swap_attr(validation, "_validate_sharding_for_key", _validate_sharding_for_key)
