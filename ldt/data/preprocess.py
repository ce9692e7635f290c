"""Text or JSONL into a Megatron indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``).

The library behind ``ldt-preprocess`` (:mod:`ldt.tools.preprocess`). Documents are read in
order by this process, tokenized by ``workers`` processes (chunks in flight are bounded, and
results come back in input order, so the output does not depend on the worker count), and
written with megatron-core's own writer (``IndexedDatasetBuilder``), each followed by the
tokenizer's end-of-document token.

What a document is: a JSONL line's ``text`` field (``--json-key``); in a text file a paragraph
(lines up to a blank line; ``--text-documents line`` or ``file`` for one per line / per file).
A line that cannot be used (invalid UTF-8, invalid JSON, no such field, not a string, empty) is
skipped, counted and reported with its file and line number (all of them in
``PREFIX.bad_lines.tsv``); nothing is dropped silently. Output is written to temporary names
and renamed into place only once complete (:func:`ldt.storage.atomic.new_files`), so an
interrupted run never leaves a ``.bin`` / ``.idx`` pair that looks complete; outputs that
exist are refused unless ``--overwrite``, and an input is never an output.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

from ldt.config import ConfigError
from ldt.config.userfiles import require
from ldt.data.tokenizer import load
import ldt.launch.quiet
from ldt.storage.atomic import check_output, new_files

FORMATS = ("auto", "jsonl", "text")
TEXT_DOCUMENTS = ("paragraph", "line", "file")
CHUNK_BYTES = 256 << 10  # documents per task: about 256 KiB of text
OUTPUTS = (".bin", ".idx", ".bad_lines.tsv")


@dataclass
class BadLine:
    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@dataclass
class Summary:
    output_prefix: str
    documents: int = 0
    tokens: int = 0
    input_bytes: int = 0
    seconds: float = 0.0
    workers: int = 1
    dtype: str = ""
    bad_lines: list = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict:
        return {"output_prefix": self.output_prefix, "documents": self.documents,
                "tokens": self.tokens, "bad_lines": len(self.bad_lines), "dtype": self.dtype,
                "workers": self.workers, "seconds": round(self.seconds, 3),
                "tokens_per_s": round(self.tokens_per_s, 1)}


def check_inputs(inputs: list[str], output_prefix: str, fmt: str) -> list[str]:
    """Absolute input paths; ConfigError for a missing, empty or unreadable input or output."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format={fmt!r}; use one of {', '.join(FORMATS)}")
    paths = []
    for name in inputs:
        path = os.path.abspath(os.path.expanduser(name))
        require(path, f"--input {name}", "file", "give a text or JSONL file")
        if os.path.getsize(path) == 0:
            raise ConfigError(f"--input {name} is empty; nothing to preprocess: give a file "
                              "with at least one document")
        paths.append(path)
    if not output_prefix.strip() or output_prefix.endswith(("/", os.sep)) \
            or os.path.isdir(output_prefix):
        raise ConfigError(f"--output-prefix {output_prefix!r} names a folder; a prefix names "
                          "the files to write (PREFIX.bin, PREFIX.idx): give e.g. "
                          f"{os.path.join(output_prefix.strip() or '.', 'corpus')}")
    folder = os.path.dirname(os.path.abspath(output_prefix)) or "."
    if not os.path.isdir(folder):
        raise ConfigError(f"--output-prefix {output_prefix}: folder {folder} does not exist; "
                          "create it first")
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"--output-prefix {output_prefix}: folder {folder} is not writable")
    if output_prefix.endswith((".bin", ".idx")):
        raise ConfigError(f"--output-prefix {output_prefix}: give the prefix without .bin / "
                          ".idx (both files are written)")
    return paths


def documents(path: str, fmt: str, json_key: str, text_documents: str,
              bad: list) -> Iterator[tuple[str, int]]:
    """(text, bytes consumed) of each document of ``path``; bad lines go to ``bad``."""
    if fmt == "auto":
        fmt = "jsonl" if path.endswith((".jsonl", ".json", ".ndjson")) else "text"
    with open(path, "rb") as f:
        if fmt == "jsonl":
            yield from _jsonl(f, path, json_key, bad)
        else:
            yield from _text(f, path, text_documents, bad)


def _jsonl(f, path: str, key: str, bad: list) -> Iterator[tuple[str, int]]:
    size = 0  # bytes read since the last document (bad lines included: the progress bar)
    for number, raw in enumerate(f, 1):
        size += len(raw)
        try:
            line = _decode(raw, number)
        except UnicodeDecodeError as exc:
            bad.append(BadLine(path, number, f"invalid UTF-8 at byte {exc.start}"))
            continue
        if not line.strip():
            continue  # a blank line holds no document (a byte-order mark alone neither)
        try:
            obj = json.loads(line)
        except ValueError as exc:
            bad.append(BadLine(path, number, f"invalid JSON ({exc})"))
            continue
        if not isinstance(obj, dict) or key not in obj:
            bad.append(BadLine(path, number, f"no {key!r} field"))
            continue
        text = obj[key]
        if not isinstance(text, str):
            bad.append(BadLine(path, number, f"{key!r} is a {type(text).__name__}, not a string"))
        elif not text:
            bad.append(BadLine(path, number, f"empty {key!r}"))
        else:
            yield text, size
            size = 0


def _decode(raw: bytes, number: int) -> str:
    """A line as text. The first may start with a byte-order mark (Windows editors write one):
    it is no part of the text (json.loads refuses it, and a text document would keep it)."""
    line = raw.decode("utf-8")  # (not utf-8-sig: a bad byte's offset then skips the mark)
    return line.removeprefix("\ufeff") if number == 1 else line


def _text(f, path: str, mode: str, bad: list) -> Iterator[tuple[str, int]]:
    if mode not in TEXT_DOCUMENTS:
        raise ConfigError(f"--text-documents={mode!r}; use one of {', '.join(TEXT_DOCUMENTS)}")
    lines, size = [], 0
    for number, raw in enumerate(f, 1):
        size += len(raw)
        try:
            line = _decode(raw, number)
        except UnicodeDecodeError as exc:
            bad.append(BadLine(path, number, f"invalid UTF-8 at byte {exc.start}"))
            continue
        blank = not line.strip()
        if mode == "line" or (mode == "paragraph" and blank):
            if not blank and mode == "line":
                lines.append(line)
            if lines:
                yield "".join(lines), size
                lines, size = [], 0
            continue
        lines.append(line)
    if lines:
        yield "".join(lines), size


# ---- workers: one tokenizer per process, loaded once --------------------------------------
_WORKER: dict = {}


def _init_worker(spec: str, eod_token: Optional[str], dtype, tok=None) -> None:
    """One core per worker: the Rust tokenizer's own thread pool is off, so ``--workers`` is
    the one knob (and workers do not oversubscribe the machine)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.update(tok=tok or load(spec, "--tokenizer", eod_token), dtype=dtype)


def _encode(texts: list[str]) -> list:
    """Each document's ids + end of document, as arrays (cheap to send back)."""
    import numpy as np

    tok, dtype = _WORKER["tok"], _WORKER["dtype"]
    return [np.array(ids + [tok.eod], dtype=dtype) for ids in tok.encode(texts)]


def _chunks(docs: Iterator[tuple[str, int]]) -> Iterator[tuple[list[str], int]]:
    texts, size = [], 0
    for text, consumed in docs:
        texts.append(text)
        size += consumed
        if size >= CHUNK_BYTES:
            yield texts, size
            texts, size = [], 0
    if texts:
        yield texts, size


def preprocess(inputs: list[str], output_prefix: str, tokenizer: str = "bytes", *,
               workers: int = 1, fmt: str = "auto", json_key: str = "text",
               text_documents: str = "paragraph", eod_token: Optional[str] = None,
               progress: bool = True, overwrite: bool = False) -> Summary:
    """Write ``output_prefix.bin`` / ``.idx`` (and ``.bad_lines.tsv`` when lines were
    skipped); ConfigError on bad input (nothing written). Outputs that exist are refused
    unless ``overwrite``; then the three are replaced together (an old ``.bad_lines.tsv`` goes
    when this run has no bad line)."""
    if workers < 1:
        raise ConfigError(f"--workers={workers} must be >= 1")
    paths = check_inputs(inputs, output_prefix, fmt)
    prefix = os.path.abspath(output_prefix)
    outputs = [prefix + ext for ext in OUTPUTS]
    for path in outputs:  # before seconds of imports: a refusal is immediate
        check_output(path, flag="--output-prefix", overwrite=overwrite,
                     inputs=[("--input", p) for p in paths], file=True)
    tok = load(tokenizer, "--tokenizer", eod_token)
    if tok.eod is None:
        raise ConfigError(f"--tokenizer {tok.name} names no end-of-document token (no "
                          "eos_token in a tokenizer_config.json, none of "
                          "<|endoftext|>, </s>, ...); pass --eod-token TOKEN")
    import megatron.core.datasets.indexed_dataset  # noqa: F401  (not timed: seconds of imports)

    summary = Summary(prefix, workers=workers)
    t0 = time.perf_counter()
    chunks = (c for p in paths
              for c in _chunks(documents(p, fmt, json_key, text_documents, summary.bad_lines)))
    with new_files(outputs, flags=["--output-prefix"] * len(outputs), overwrite=overwrite,
                   inputs=[("--input", p) for p in paths]) as (tmp_bin, tmp_idx, tmp_bad):
        bar = _bar(sum(os.path.getsize(p) for p in paths), progress)  # once writing can start
        _write(chunks, tok, (tokenizer, eod_token), tmp_bin, tmp_idx, summary, bar)
        if summary.documents == 0:
            raise ConfigError(f"no documents in {', '.join(inputs)}: every line was bad "
                              f"({_describe(summary.bad_lines)})")
        if summary.bad_lines:
            with open(tmp_bad, "w") as f:
                f.write("file\tline\treason\n")
                f.writelines(f"{b.path}\t{b.line}\t{b.reason}\n" for b in summary.bad_lines)
    summary.seconds = time.perf_counter() - t0
    return summary


def _write(chunks, tok, load_args: tuple, tmp_bin: str, tmp_idx: str, summary: Summary,
           bar) -> None:
    """Tokenize ``chunks`` (in ``summary.workers`` processes) into megatron-core's writer."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    dtype = DType.optimal_dtype(tok.vocab_size)
    summary.dtype = np.dtype(dtype).name
    builder = IndexedDatasetBuilder(tmp_bin, dtype=dtype)

    def write(docs: list, size: int) -> None:
        for doc in docs:
            builder.add_document(doc, [len(doc)])
            summary.tokens += len(doc)
        summary.documents += len(docs)
        summary.input_bytes += size
        bar.update(size)
        bar.set_postfix(docs=summary.documents, bad=len(summary.bad_lines))

    try:
        if summary.workers == 1:
            _init_worker(*load_args, dtype, tok)
            for texts, size in chunks:
                write(_encode(texts), size)
        else:
            _parallel(chunks, summary.workers, (*load_args, dtype), write)
        builder.finalize(tmp_idx)
        bar.update(bar.total - bar.n)  # bytes of trailing blank or bad lines
    finally:
        builder.data_file.close()
        bar.close()


def _parallel(chunks, workers: int, initargs: tuple, write) -> None:
    """Tokenize in ``workers`` processes, at most 2 chunks each in flight, in input order."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    ctx = mp.get_context("spawn")  # a clean interpreter: no inherited threads or torch state
    with _stops_ignored():  # the workers ignore Ctrl-C / SIGTERM (inherited through exec): a
        # terminal's Ctrl-C goes to the whole process group, and the workers' tracebacks would
        # bury the one line this process prints; it stops them itself
        pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                   initargs=initargs)
        for _ in range(workers):  # start them all now (Python starts one per submit)
            pool.submit(int)
    with pool:
        pending: deque = deque()
        for texts, size in chunks:
            pending.append((pool.submit(_encode, texts), size))
            if len(pending) >= 2 * workers:
                future, done = pending.popleft()
                write(future.result(), done)
        while pending:
            future, done = pending.popleft()
            write(future.result(), done)


@contextmanager
def _stops_ignored():
    """SIGINT, SIGTERM and SIGHUP ignored for the few milliseconds it takes to start the
    worker processes (which keep that setting)."""
    import signal
    import threading

    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    main = threading.current_thread() is threading.main_thread()
    old = {s: signal.signal(s, signal.SIG_IGN) for s in stops} if main else {}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="ldt-preprocess",
                disable=not enabled, mininterval=0.5, dynamic_ncols=True)


def _describe(bad: list, limit: int = 5) -> str:
    shown = "; ".join(str(b) for b in bad[:limit])
    return shown + (f"; ... {len(bad) - limit} more" if len(bad) > limit else "")
