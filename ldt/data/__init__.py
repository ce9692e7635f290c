"""Training data, owned by the data stages only (the cloud stages of a U-shape never read it).

Two sources: bytes as tokens (:mod:`ldt.data.bytes`, the zero-set-up default) and Megatron
indexed datasets (:mod:`ldt.data.indexed`, ``data.blend``) written by ``ldt-preprocess``
(:mod:`ldt.data.preprocess`) with a tokenizer from :mod:`ldt.data.tokenizer`.
:mod:`ldt.data.files` checks the files on the launcher, before any process starts.
"""

from __future__ import annotations

from ldt.data.bytes import TextData
from ldt.data.indexed import build_indexed
from ldt.data.lane_data import LaneData
from ldt.schedule.routing import microbatches_of


def build_training_data(c, topo, state):
    """This rank's data (None off the data stages). Every rank calls it: building indexed
    data runs megatron-core's world-wide barriers."""
    owns = state.stage in topo.data_stages()
    if c.data.blend is not None:
        return _per_lane(build_indexed(c.data, c.model, c.train, topo, state), c, topo, state)
    if not owns:
        return None

    return _per_lane(TextData(c.data.path, c.model.seq_length, c.train.micro_batch_size,
                              c.train.num_microbatches, dp_rank=state.info.dp_rank, dp=topo.dp,
                              seed=c.train.seed, max_bytes=c.data.max_bytes,
                              vocab_size=c.model.vocab_size), c, topo, state)


def _per_lane(data, c, topo, state):
    """Per-stage DP: this replica's micro-batches as routing gives them (ldt.data.lane_data)."""
    if data is None or not topo.is_vdp:
        return data

    mbs = microbatches_of(state.info.dp_rank, topo.dp_of(state.stage),
                          c.train.num_microbatches, topo.dp)
    return LaneData(data, mbs, topo.dp)
