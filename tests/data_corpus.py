"""Offline inputs for the data tests: text and JSONL from Python's own sources, and a small
byte-level BPE tokenizer trained on them with the ``tokenizers`` package (no download)."""

from __future__ import annotations

import glob
import json
import os
import sysconfig

EOD = "<|endoftext|>"
VOCAB = 300  # tokenizer vocabulary; the tests' models use vocab_size 320 (divisible by TP 2)
# JSONL lines (1-based) that the corpus breaks on purpose, and why ldt-preprocess skips them
BAD_LINES = {3: "invalid JSON", 5: "no 'text' field", 7: "invalid UTF-8", 9: "not a string"}


def sources(first: int, count: int) -> list[str]:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    out = []
    for name in files[first:first + count]:
        with open(name, encoding="utf-8", errors="replace") as f:
            out.append(f.read().replace("\r", ""))
    return out


def write_text(path: str, first: int = 0, count: int = 8) -> str:
    with open(path, "w") as f:
        f.write("\n\n".join(sources(first, count)))
    return path


def write_jsonl(path: str, first: int = 40, count: int = 40) -> str:
    """One document per source file, with the lines of :data:`BAD_LINES` broken."""
    docs = iter(sources(first, count))
    with open(path, "wb") as f:
        for number in range(1, count + len(BAD_LINES) + 1):
            if number == 3:
                f.write(b'{"text": "unterminated\n')
            elif number == 5:
                f.write(json.dumps({"title": "no text"}).encode() + b"\n")
            elif number == 7:
                f.write(b'{"text": "bad \xff byte"}\n')
            elif number == 9:
                f.write(json.dumps({"text": 5}).encode() + b"\n")
            else:
                f.write(json.dumps({"text": next(docs)}).encode() + b"\n")
    return path


def train_tokenizer(folder: str, texts: list[str]) -> str:
    """A byte-level BPE with an end-of-text token; returns the tokenizer.json path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "tokenizer.json")
    tok.save(path)
    return path
