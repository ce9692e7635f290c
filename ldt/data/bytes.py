"""Training data that works offline: bytes as tokens, over a corpus every machine has.

The default corpus is the Python standard library's own source files (present wherever Python
is); ``data.path=`` trains on a user's text file instead. Tokens are bytes (vocabulary 256),
so no tokenizer download is ever needed. Only data-owning stages create a :class:`TextData`
(see :meth:`ldt.topology.ranks.Topology.data_stages`): the cloud stages of a U-shape never do.
"""

from __future__ import annotations

import glob
import os
import sysconfig
from typing import Iterator, Optional

EVAL_SHARE = 20
"""The last 1/EVAL_SHARE of a corpus' windows is held out for evaluation."""


def default_corpus_files() -> list[str]:
    stdlib = sysconfig.get_paths()["stdlib"]
    return sorted(glob.glob(os.path.join(stdlib, "*.py")))


def load_bytes(path: Optional[str], max_bytes: int) -> bytes:
    if path:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"data.path={path!r} is not a file; give a text file or "
                                    "leave data.path unset for the built-in corpus")
        with open(path, "rb") as f:
            return f.read(max_bytes)
    out, total = [], 0
    for name in default_corpus_files():
        with open(name, "rb") as f:
            chunk = f.read(max_bytes - total)
        out.append(chunk)
        total += len(chunk)
        if total >= max_bytes:
            break
    return b"".join(out)


def corpus_size(path: Optional[str], max_bytes: int) -> int:
    """Bytes :func:`load_bytes` would return, from file sizes alone (nothing is read)."""
    if path:
        return min(os.path.getsize(path), max_bytes)
    total = 0
    for name in default_corpus_files():
        total += os.path.getsize(name)
        if total >= max_bytes:
            return max_bytes
    return total


def split_windows(num_tokens: int, seq_length: int) -> tuple[int, int]:
    """(training, held-out) windows of ``seq_length + 1`` tokens in a corpus of ``num_tokens``."""
    windows = max(0, num_tokens - 1) // seq_length
    return windows - windows // EVAL_SHARE, windows // EVAL_SHARE


def min_corpus_bytes(seq_length: int, micro_batch_size: int) -> int:
    """The smallest corpus :class:`TextData` accepts: ``micro_batch_size`` windows held out (so
    ``EVAL_SHARE * micro_batch_size`` windows in all) plus the one token the last label needs."""
    return EVAL_SHARE * micro_batch_size * seq_length + 1


class TextData:
    """Fixed-length windows of a byte stream, in a seeded order, sharded by DP rank.

    ``batch(step, mb)`` is a pure function of (seed, step, micro-batch, dp rank), so a resumed
    run and a single-process reference see exactly the same samples. The last
    ``1/EVAL_SHARE`` of the windows is held out: training never reads it, and
    :meth:`eval_iterator` always reads the same micro-batches of it (a comparable eval loss).
    """

    EVAL_SHARE = EVAL_SHARE

    def __init__(self, path: Optional[str], seq_length: int, micro_batch_size: int,
                 num_microbatches: int, *, dp_rank: int = 0, dp: int = 1, seed: int = 1234,
                 max_bytes: int = 4_000_000, vocab_size: int = 256):
        import torch

        raw = load_bytes(path, max_bytes)
        if vocab_size < 256:
            raise ValueError(f"model.vocab_size={vocab_size} < 256 cannot hold byte tokens")
        self.tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
        self.seq, self.mbs, self.m = seq_length, micro_batch_size, num_microbatches
        self.dp_rank, self.dp, self.seed = dp_rank, dp, seed
        self.num_windows, self.num_eval_windows = split_windows(len(self.tokens), seq_length)
        if min(self.num_windows, self.num_eval_windows) < micro_batch_size:
            raise ValueError(f"corpus of {len(raw)} bytes is too small for sequences of "
                             f"{seq_length} (1/{self.EVAL_SHARE} is held out for evaluation); "
                             "use a larger data.path or data.max_bytes")

    def batch(self, step: int, mb: int) -> dict:
        return self._windows(self.seed * 1_000_003 + step, mb, 0, self.num_windows)

    def eval_batch(self, mb: int) -> dict:
        # one fixed draw (the seed of "step -1") from the held-out windows: every eval compares
        return self._windows(self.seed * 1_000_003 - 1, mb, self.num_windows,
                             self.num_eval_windows)

    def step_iterator(self, step: int) -> Iterator[dict]:
        return (self.batch(step, mb) for mb in range(self.m))

    def eval_iterator(self) -> Iterator[dict]:
        return (self.eval_batch(mb) for mb in range(self.m))

    def _windows(self, seed: int, mb: int, first_window: int, num_windows: int) -> dict:
        import torch

        g = torch.Generator().manual_seed(seed)
        per_step = self.dp * self.m * self.mbs
        order = first_window + torch.randint(0, num_windows, (per_step,), generator=g)
        first = (self.dp_rank * self.m + mb) * self.mbs
        starts = order[first:first + self.mbs] * self.seq
        rows = torch.stack([self.tokens[s:s + self.seq + 1] for s in starts.tolist()])
        return {
            "tokens": rows[:, :-1].contiguous(),
            "labels": rows[:, 1:].contiguous(),
            "loss_mask": torch.ones(self.mbs, self.seq),
            "position_ids": torch.arange(self.seq).repeat(self.mbs, 1),
        }
