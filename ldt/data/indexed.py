"""Training on Megatron indexed datasets: megatron-core's ``GPTDataset`` splits, built by its
``BlendedMegatronDatasetBuilder`` (blending, split, shuffling and index caching are its own).

Every rank calls :func:`build_indexed`, because ``build()`` runs world-wide barriers, but only
the data stages build anything. The cloud stages of a U-shape call it with nothing they could
read the data with: placeholder prefixes that name no file, a tokenizer stand-in without a
vocabulary (``GPTDatasetConfig`` asserts one), no cache folder, and ``is_built_on_rank`` false
(so megatron-core returns before touching a path). What they do receive is the *shape* of the
blend from the config (number of datasets, weighted or not, which splits exist), since the
number of barriers depends on it; never a size or anything read from the files.

Index cache: megatron-core writes its sample indices from global rank 0 only; every other rank
then reads them after a barrier (and ``path_to_cache=None`` would put them next to the data).
So rank 0, and the data ranks on rank 0's host, use ``data.cache_dir``; data ranks on other
hosts, which cannot see rank 0's files, get ``path_to_cache=""``, with which megatron-core
builds the same indices (same seed, same files) in memory and writes nothing.

The cache is keyed by the data's files as they are now: ``data.cache_dir/<fingerprint>``,
the fingerprint of every ``.bin`` / ``.idx`` of the blend (path, size, modification time,
inode; :func:`cache_for`). megatron-core keys its files by the dataset's path and settings
only, so a corpus preprocessed again under the same prefix (``ldt-preprocess --overwrite``)
would otherwise read the old corpus's sample indices (an IndexError inside training).

megatron-core writes each split's ``.npy`` files in place, one after another, and trusts a set
whose files all exist; a run killed while it wrote the last one left a torn file that every
later run would fail on (numpy: "mmap length is greater than file size"). Rank 0 removes a
file numpy cannot map before building (:func:`drop_torn_indices`): megatron-core then builds
that set again.

Sample order: sample ``g = step * dp * m * mbs + (dp_rank * m + mb) * mbs + i`` of the train
split (modulo its length), so a batch is a pure function of (seed, step, micro-batch, DP
rank): ``train.verify``'s single-process reference, a resume and a resume into another layout
read the same samples. Every split is sized to one epoch of its documents (the sizes do not
depend on ``train.steps``); a longer run wraps around to the same order.
"""

from __future__ import annotations

import os
from typing import Iterator, Optional

from ldt.data.files import (SPLIT_NAMES, TRAIN, VALID, parse_blend, read_index, split_bookends,
                            used_splits)
from ldt.data.tokenizer import TokenIds, load

KEYS = ("tokens", "labels", "loss_mask", "position_ids")


class IndexedData:
    """Micro-batches of the train and validation splits, as :class:`~ldt.data.bytes.TextData`
    gives them (``batch``, ``eval_batch``, ``step_iterator``, ``eval_iterator``)."""

    def __init__(self, train_split, valid_split, micro_batch_size: int, num_microbatches: int,
                 *, dp_rank: int = 0, dp: int = 1):
        self.train, self.valid = train_split, valid_split
        self.mbs, self.m, self.dp_rank, self.dp = micro_batch_size, num_microbatches, dp_rank, dp

    def batch(self, step: int, mb: int) -> dict:
        return self._rows(self.train, step * self.dp * self.m * self.mbs + self._offset(mb))

    def eval_batch(self, mb: int) -> dict:
        # the same first samples of the validation split at every evaluation: comparable losses
        return self._rows(self.valid, self._offset(mb))

    def step_iterator(self, step: int) -> Iterator[dict]:
        return (self.batch(step, mb) for mb in range(self.m))

    def eval_iterator(self) -> Iterator[dict]:
        return (self.eval_batch(mb) for mb in range(self.m))

    def _offset(self, mb: int) -> int:
        return (self.dp_rank * self.m + mb) * self.mbs

    def _rows(self, split, first: int) -> dict:
        import torch

        samples = [split[(first + i) % len(split)] for i in range(self.mbs)]
        return {k: torch.stack([s[k] for s in samples]) for k in KEYS}


def build_indexed(data, model, train, topo, state) -> Optional[IndexedData]:
    """Build ``data.blend``'s splits (a world-wide collective); None off the data stages."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder)
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    owns = state.stage in topo.data_stages()
    prefixes, weights = parse_blend(data.blend)
    used = used_splits(train)
    if owns:
        tokens, cache = TokenIds.of(load(data.tokenizer)), cache_for(prefixes, data.cache_dir,
                                                                     state.rank)
        if cache and state.rank == 0:  # megatron-core's writer; the others read after it
            drop_torn_indices(cache)
        sizes = split_sizes(prefixes, weights, split_bookends(data.split), used,
                            model.seq_length)
    else:  # the cloud: the blend's shape only (see the module docstring)
        prefixes = [f"<withheld dataset {i}>" for i in range(len(prefixes))]
        tokens, cache = TokenIds.withheld(), ""
        sizes = [None] * 3 if weights is None else [1 if s in used else 0 for s in range(3)]
    config = GPTDatasetConfig(
        random_seed=train.seed, sequence_length=model.seq_length, blend=(prefixes, weights),
        split=str(data.split), path_to_cache=cache,  # megatron-core reads 969,30,1 and 969/30/1
        tokenizer=tokens, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=False)  # ldt passes its own causal mask
    # splits ldt never reads are not built (an empty unused split would loop forever too)
    config.split_matrix = [b if s in used else None for s, b in enumerate(config.split_matrix)]
    built = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: owns, config).build()
    if not owns:
        return None
    for s in used:
        if built[s] is None or len(built[s]) == 0:
            raise RuntimeError(f"megatron-core built an empty {SPLIT_NAMES[s]} split of "
                               f"data.blend={data.blend!r} (data.split={data.split!r})")
    return IndexedData(built[TRAIN], built[VALID] if VALID in used else None,
                       train.micro_batch_size, train.num_microbatches,
                       dp_rank=state.info.dp_rank, dp=topo.dp)


def split_sizes(prefixes, weights, bookends, used, seq_length: int) -> list:
    """Samples megatron-core builds per split: one epoch. Unweighted, megatron-core's ``None``
    (one epoch of each dataset); weighted blends need a number: one epoch of the whole blend,
    ``sum(tokens) // seq_length``, the weights then decide how often each dataset is drawn."""
    if weights is None:
        return [None] * 3
    infos = [read_index(p) for p in prefixes]
    return [max(1, sum(i.split(bookends[s])[1] for i in infos) // seq_length) if s in used
            else 0 for s in range(3)]


def cache_folder(cache_dir: Optional[str], rank: int) -> str:
    """This data rank's ``path_to_cache`` ("" = build in memory; see the module docstring)."""
    if rank != 0 and not on_rank0_host():
        return ""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.abspath(os.path.expanduser(cache_dir or os.path.join(root, "ldt", "indices")))


def cache_for(prefixes, cache_dir: Optional[str], rank: int) -> str:
    """This data rank's ``path_to_cache`` for a blend of ``prefixes``: :func:`cache_folder`,
    in a sub-folder named by the fingerprint of the blend's files (see the module docstring;
    "" stays "")."""
    import hashlib

    folder = cache_folder(cache_dir, rank)
    if not folder:
        return folder
    h = hashlib.sha256()
    for prefix in prefixes:
        for path in (prefix + ".bin", prefix + ".idx"):
            st = os.stat(path)
            h.update(f"{os.path.abspath(path)}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\n"
                     .encode())
    return os.path.join(folder, h.hexdigest()[:16])


def drop_torn_indices(folder: str) -> list[str]:
    """Remove the ``.npy`` files of ``folder`` that numpy cannot map as megatron-core will
    (cut short: a run killed while megatron-core wrote them in place); returns their paths.
    Only global rank 0 may call it, before the build: megatron-core builds a set one of whose
    files is missing again, on rank 0, and the other ranks read the set after its barrier."""
    import numpy as np

    torn = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        path = os.path.join(folder, name)
        if not name.endswith(".npy"):
            continue
        try:
            np.load(path, allow_pickle=True, mmap_mode="r")  # megatron-core's own read
        except (ValueError, EOFError):  # (an unreadable file is megatron-core's to report)
            os.remove(path)
            torn.append(path)
    return torn


def on_rank0_host() -> bool:
    """Whether this process shares global rank 0's machine: one machine holds the whole world
    (a bare launch, single-node torchrun), or torchrun says this is node 0 (``GROUP_RANK``,
    the node that holds rank 0). Unknown launchers answer False: building in memory is always
    correct, reading a cache another machine wrote is not."""
    env = os.environ
    if "WORLD_SIZE" in env and env.get("LOCAL_WORLD_SIZE") == env["WORLD_SIZE"]:
        return True
    return env.get("GROUP_RANK") == "0"
