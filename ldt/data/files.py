"""The data files a config names, read and checked without torch (launcher side).

``data.blend`` lists Megatron indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``) the way
Megatron's ``--data-path`` does; ``data.split`` shares each dataset's documents between the
train / validation / test splits. :func:`check_data` refuses whatever cannot train, with the
file and the fix, before a process is started: missing or empty files, a ``.bin`` without its
``.idx`` (or the reverse), an ``.idx`` that does not describe its ``.bin`` (another dtype or
another dataset), token ids the tokenizer or the model cannot hold, a tokenizer larger than
the model's vocabulary, and a split ldt reads that gets no documents (megatron-core's
``GPTDataset`` would loop forever in ``_get_num_epochs`` on it).

The ``.idx`` header is read here with ``struct`` and numpy: megatron-core's reader
(``megatron.core.datasets.indexed_dataset``) imports torch and megatron-core, seconds per
check, and the ranks read the files through it anyway. The layout (from that module's
``_IndexWriter``): 9 bytes magic, u64 version 1, u8 dtype code, u64 sequence count, u64
document count, then the int32 sequence lengths.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ldt.config import ConfigError, DataConfig, ModelConfig, TrainConfig
from ldt.config.userfiles import not_a
from ldt.data.tokenizer import BYTES, load
from ldt.storage.commit import set_in_progress

SPLIT_NAMES = ("train", "validation", "test")
TRAIN, VALID, TEST = 0, 1, 2
_MAGIC = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<9sQBQQ")
# megatron.core.datasets.indexed_dataset.DType: code -> numpy dtype
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
           7: np.float32, 8: np.uint16}
SCAN_BYTES = 64 << 20  # token ids checked against the vocabularies: the first 64 MiB per .bin


def parse_blend(blend: Any, base: Optional[str] = None) -> tuple[list[str], Optional[list[float]]]:
    """``(prefixes, weights or None)`` from ``PREFIX``, ``"W1 P1 W2 P2"`` or a list of either
    form; ``.bin`` / ``.idx`` endings are dropped. Paths become absolute (relative ones are
    taken from ``base``, default the working directory). A string is one prefix, spaces and
    all, unless it is the weighted form (a number before every path)."""
    items = _blend_items(blend) if isinstance(blend, str) else [str(x) for x in (blend or [])]
    if not items:
        raise ConfigError("data.blend is empty; give a dataset prefix (what ldt-preprocess "
                          "--output-prefix wrote), e.g. data.blend=/data/corpus")
    numbers = [_number(x) for x in items]
    weights = None
    if len(items) % 2 == 0 and all(n is not None for n in numbers[0::2]):
        weights, items = [float(n) for n in numbers[0::2]], items[1::2]
        if any(w <= 0 for w in weights):
            raise ConfigError(f"data.blend weights {weights} must all be > 0; drop a dataset "
                              "instead of giving it weight 0")
    elif any(n is not None for n in numbers):
        raise ConfigError(
            f"data.blend={blend!r} mixes weights and paths; give prefixes only "
            "([PREFIX1, PREFIX2]) or a weight before every prefix ([0.3, PREFIX1, 0.7, PREFIX2])")
    prefixes = [os.path.abspath(os.path.join(base or os.getcwd(), os.path.expanduser(_strip(p))))
                for p in items]
    if len(prefixes) == 1:
        weights = None  # one dataset: a weight means nothing
    return prefixes, weights


def _blend_items(blend: str) -> list[str]:
    """A string ``data.blend``: ``"W1 P1 W2 P2"`` (split on spaces) or one prefix, whose path
    may hold spaces (``data/my corpus``)."""
    words = blend.split()
    weighted = len(words) >= 2 and len(words) % 2 == 0 and all(
        _number(w) is not None for w in words[0::2]) and not any(
        _number(w) is not None for w in words[1::2])
    return words if weighted else ([blend.strip()] if blend.strip() else [])


def format_blend(prefixes: list[str], weights: Optional[list[float]]) -> list:
    """The ``data.blend`` list form of :func:`parse_blend`'s result (parses back to it)."""
    if weights is None:
        return list(prefixes)
    return [x for w, p in zip(weights, prefixes) for x in (w, p)]


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def _strip(prefix: str) -> str:
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix):
            return prefix[: -len(suffix)]
    return prefix


def split_bookends(split: str) -> list[Optional[tuple[float, float]]]:
    """``[(begin, end) or None] * 3`` as fractions of the documents, as megatron-core's
    ``parse_and_normalize_split`` + ``convert_split_vector_to_split_matrix`` compute them."""
    parts = [p for p in str(split).replace("/", ",").split(",") if p.strip()]
    values = [_number(p.strip()) for p in parts]
    if not 1 <= len(values) <= 3 or any(v is None or v < 0 for v in values) or not sum(values):
        raise ConfigError(f"data.split={split!r}: give up to three non-negative shares for "
                          "train, validation and test, e.g. 969/30/1")
    values += [0.0] * (3 - len(values))
    total = float(np.sum(np.array(values, dtype=np.float64)))
    shares = (np.array(values, dtype=np.float64) / total).tolist()
    edges = [0.0]
    for share in shares:
        edges.append(edges[-1] + share)
    return [(a, b) if b > a else None for a, b in zip(edges[:-1], edges[1:])]


def used_splits(train) -> tuple[int, ...]:
    """The splits ldt reads: train always, validation with ``train.eval_every``."""
    return (TRAIN, VALID) if train.eval_every else (TRAIN,)


@dataclass
class IndexInfo:
    """One indexed dataset as its ``.idx`` describes it."""

    prefix: str
    dtype: type
    sequence_lengths: np.ndarray  # tokens of each sequence (one per document from ldt-preprocess)
    document_count: int

    @property
    def num_sequences(self) -> int:
        return len(self.sequence_lengths)

    def split(self, bookend: tuple[float, float]) -> tuple[int, int]:
        """(sequences, tokens) of one split, cut as megatron-core's builder cuts it."""
        n = self.num_sequences
        begin, end = int(round(bookend[0] * float(n))), int(round(bookend[1] * float(n)))
        return end - begin, int(self.sequence_lengths[begin:end].sum(dtype=np.int64))


def read_index(prefix: str) -> IndexInfo:
    """The ``.idx`` of ``prefix``, checked against its ``.bin``; ConfigError names the file."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    redo = "re-run ldt-preprocess to write both files again"
    busy = set_in_progress(bin_)
    if busy:  # the pair is being replaced, or was left half-replaced (ldt.storage.commit)
        raise ConfigError(f"data.blend: {prefix}.bin / .idx are not a complete pair: "
                          f"ldt-preprocess {busy}; wait for it, or run ldt-preprocess "
                          f"--output-prefix {prefix} --overwrite again (it first puts the "
                          "earlier pair back)")
    if not os.path.exists(idx) and not os.path.exists(bin_):
        several = (" (a data.blend string is one prefix, spaces and all; give several datasets "
                   "as a list, data.blend=[A,B])" if any(c.isspace() for c in prefix)
                   else "")
        raise ConfigError(f"data.blend: {bin_} and {idx} do not exist; give the prefix "
                          f"ldt-preprocess --output-prefix wrote (without .bin / .idx){several}")
    for missing, present in ((idx, bin_), (bin_, idx)):
        if not os.path.exists(missing):
            raise ConfigError(f"data.blend: {missing} is missing next to {present}; an indexed "
                              f"dataset needs both files: {redo}")
    for path in (idx, bin_):
        if os.path.getsize(path) == 0:
            raise ConfigError(f"data.blend: {path} is empty: {redo}")
    with open(idx, "rb") as f:
        head = f.read(_HEADER.size)
    magic, version, code, sequences, documents = (
        _HEADER.unpack(head) if len(head) == _HEADER.size else (b"", 0, 0, 0, 0))
    if magic != _MAGIC or version != 1 or code not in _DTYPES:
        raise ConfigError(f"data.blend: {idx} is not a Megatron indexed-dataset index (bad "
                          f"header); {redo}")
    if os.path.getsize(idx) < _HEADER.size + 12 * sequences + 8 * documents:
        raise ConfigError(f"data.blend: {idx} is truncated ({os.path.getsize(idx)} bytes for "
                          f"{sequences} sequences); {redo}")
    lengths = np.fromfile(idx, dtype=np.int32, count=sequences, offset=_HEADER.size)
    dtype = _DTYPES[code]
    expected = int(lengths.sum(dtype=np.int64)) * np.dtype(dtype).itemsize
    actual = os.path.getsize(bin_)
    if actual != expected:
        raise ConfigError(
            f"data.blend: {idx} describes {int(lengths.sum(dtype=np.int64))} tokens of "
            f"{np.dtype(dtype).name} ({expected} bytes) but {bin_} holds {actual} bytes: the "
            f".idx belongs to another dtype or another dataset; {redo}")
    if sequences == 0:
        raise ConfigError(f"data.blend: {prefix} holds no documents; preprocess a non-empty "
                          "input")
    return IndexInfo(prefix, dtype, lengths, max(0, documents - 1))


def max_token_id(info: IndexInfo, limit_bytes: int = SCAN_BYTES) -> int:
    """The largest token id in the first ``limit_bytes`` of the ``.bin``."""
    itemsize = np.dtype(info.dtype).itemsize
    count = min(int(info.sequence_lengths.sum(dtype=np.int64)), limit_bytes // itemsize)
    ids = np.fromfile(info.prefix + ".bin", dtype=info.dtype, count=count)
    return int(ids.max()) if len(ids) else -1


def check_data(data: DataConfig, model: ModelConfig, train: TrainConfig, topo=None,
               rank: Optional[int] = None) -> None:
    """Refuse data settings that cannot train (ConfigError naming the file and the fix).

    With ``rank`` (a torchrun rank) only the config's own syntax is checked on ranks outside
    the data stages: the cloud never opens the data or the tokenizer, and need not have them.
    """
    if data.blend is None:
        if data.tokenizer != BYTES:
            raise ConfigError(
                f"data.tokenizer={data.tokenizer!r} needs indexed data: run `ldt-preprocess "
                f"--input FILE --output-prefix PREFIX --tokenizer {data.tokenizer}` and pass "
                "data.blend=PREFIX (data.path trains on bytes only)")
        return
    if data.path:
        raise ConfigError(f"data.path={data.path!r} and data.blend are both set; data.path is "
                          "the bytes-as-tokens text file, data.blend indexed data: keep one")
    prefixes, _ = parse_blend(data.blend)
    bookends = split_bookends(data.split)
    for s in used_splits(train):
        if bookends[s] is None:
            raise ConfigError(
                f"data.split={data.split!r} gives the {SPLIT_NAMES[s]} split no share"
                + (" and train.eval_every reads it" if s == VALID else "")
                + "; give it one, e.g. data.split=969/30/1")
    if rank is not None and topo is not None and \
            topo.rank_info(rank).stage not in topo.data_stages():
        return
    if data.cache_dir:
        _check_cache_dir(data.cache_dir)
    tok = load(data.tokenizer)
    if tok.vocab_size > model.vocab_size:
        raise ConfigError(
            f"data.tokenizer {tok.name} has {tok.vocab_size} tokens but model.vocab_size="
            f"{model.vocab_size}; set model.vocab_size >= {tok.vocab_size} (or use the "
            "tokenizer the model was made for)")
    for prefix in prefixes:
        _check_dataset(read_index(prefix), tok, model, train, bookends, data.split)


def _check_cache_dir(path: str) -> None:
    """``data.cache_dir``: a folder megatron-core can write its sample indices into (or make),
    refused here rather than as megatron's exception on rank 0 inside training."""
    named, fix = f"data.cache_dir={path!r}", ("give a folder for the sample indices, or leave "
                                              "data.cache_dir unset")
    if os.path.exists(path):
        why = not_a(path, named, "folder", fix)
        if why is None and not os.access(path, os.W_OK | os.X_OK):
            why = f"{named} is not writable; {fix}"
    else:
        parent = os.path.dirname(os.path.abspath(path))
        while parent != os.path.dirname(parent) and not os.path.exists(parent):
            parent = os.path.dirname(parent)
        why = (None if os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK) else
               f"{named} cannot be made: {parent} is not a folder this process can write to; "
               f"{fix}")
    if why:
        raise ConfigError(why)


def _check_dataset(info: IndexInfo, tok, model, train, bookends, split: str) -> None:
    limit = np.iinfo(info.dtype).max + 1 if np.issubdtype(info.dtype, np.integer) else 0
    if limit < tok.vocab_size:
        raise ConfigError(
            f"data.blend: {info.prefix}.idx stores tokens as {np.dtype(info.dtype).name} "
            f"(ids < {limit}) but data.tokenizer {tok.name} has {tok.vocab_size} tokens: the "
            "data was preprocessed for another tokenizer; preprocess it again with this one")
    top = max_token_id(info)
    for name, size, fix in (
            (f"data.tokenizer {tok.name}", tok.vocab_size,
             "the data was tokenized with another tokenizer: pass that one as data.tokenizer"),
            ("model.vocab_size", model.vocab_size, "raise model.vocab_size")):
        if top >= size:
            raise ConfigError(f"data.blend: {info.prefix}.bin holds token id {top}, outside "
                              f"the {size} ids of {name}; {fix}")
    need = model.seq_length + 1
    for s in used_splits(train):
        sequences, tokens = info.split(bookends[s])
        if sequences == 0 or tokens < need:
            raise ConfigError(
                f"data.split={split!r} gives the {SPLIT_NAMES[s]} split of {info.prefix} "
                f"{sequences} of its {info.num_sequences} documents ({tokens} tokens; a sample "
                f"needs {need}); give that split a larger share, or more data")
