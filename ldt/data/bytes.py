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
    """Fixed-length windows of a byte stream, each epoch every window once in a seeded order of
    its own, sharded by DP rank.

    Sample ``k = step * dp * m * mbs + (dp_rank * m + mb) * mbs + i`` of the run is window
    ``order_e[k % n]`` of epoch ``e = k // n`` (``n`` training windows, ``order_e`` a seeded
    permutation per epoch, as megatron's ``GPTDataset`` shuffles). So ``batch(step, mb)`` is a
    pure function of (seed, step, micro-batch, dp rank) and of the global batch alone: a
    resumed run (the checkpoint's step is the data position), a resume into another layout of
    the same global batch and a single-process reference read exactly the same samples, and
    every window is read once per epoch (no window twice in a step of fewer than ``n``
    samples). The last ``1/EVAL_SHARE`` of the windows is held out: training never reads it,
    and :meth:`eval_iterator` always reads the same micro-batches of it (a comparable eval
    loss).
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
        self._orders: dict = {}  # (stream, epoch) -> that epoch's order of the windows
        if min(self.num_windows, self.num_eval_windows) < micro_batch_size:
            raise ValueError(f"corpus of {len(raw)} bytes is too small for sequences of "
                             f"{seq_length} (1/{self.EVAL_SHARE} is held out for evaluation); "
                             "use a larger data.path or data.max_bytes")

    def batch(self, step: int, mb: int) -> dict:
        per_step = self.dp * self.m * self.mbs
        return self._windows(self.seed, step * per_step, mb, 0, self.num_windows)

    def eval_batch(self, mb: int) -> dict:
        # the first samples of an order of its own over the held-out windows: every eval compares
        return self._windows(self.seed * 1_000_003 - 1, 0, mb, self.num_windows,
                             self.num_eval_windows)

    def step_iterator(self, step: int) -> Iterator[dict]:
        return (self.batch(step, mb) for mb in range(self.m))

    def eval_iterator(self) -> Iterator[dict]:
        return (self.eval_batch(mb) for mb in range(self.m))

    def window_indices(self, step: int, mb: int) -> list[int]:
        """The training windows ``batch(step, mb)`` reads, in its rows' order."""
        return self._indices(self.seed, step * self.dp * self.m * self.mbs, mb,
                             self.num_windows)

    def _indices(self, stream: int, first_sample: int, mb: int, num_windows: int) -> list[int]:
        # sample k of the stream is window order[k % n] of epoch k // n (see the class docstring)
        first = first_sample + (self.dp_rank * self.m + mb) * self.mbs
        return [int(self._epoch_order(stream, k // num_windows, num_windows)[k % num_windows])
                for k in range(first, first + self.mbs)]

    def _windows(self, stream: int, first_sample: int, mb: int, first_window: int,
                 num_windows: int) -> dict:
        import torch

        starts = [(first_window + w) * self.seq
                  for w in self._indices(stream, first_sample, mb, num_windows)]
        rows = torch.stack([self.tokens[s:s + self.seq + 1] for s in starts])
        return {
            "tokens": rows[:, :-1].contiguous(),
            "labels": rows[:, 1:].contiguous(),
            "loss_mask": torch.ones(self.mbs, self.seq),
            "position_ids": torch.arange(self.seq).repeat(self.mbs, 1),
        }

    def _epoch_order(self, stream: int, epoch: int, num_windows: int):
        """Epoch ``epoch``'s permutation of the stream's windows: a pure function of (stream,
        epoch), cached (a run moves through its epochs in order, so a few are kept)."""
        import torch

        key = (stream, epoch)
        if key not in self._orders:
            if len(self._orders) > 4:
                self._orders.clear()
            g = torch.Generator().manual_seed(stream * 1_000_003 + epoch)
            self._orders[key] = torch.randperm(num_windows, generator=g)
        return self._orders[key]
