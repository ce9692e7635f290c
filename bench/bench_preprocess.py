"""Preprocessing throughput: ``ldt-preprocess`` tokens/s with one and with two workers.

    python -m bench.bench_preprocess

The corpus is Python's own standard library as JSONL (one document per source file, about
8 MB) and the tokenizer a byte-level BPE of 4096 tokens trained here on part of it with the
``tokenizers`` package (no download). The same input is preprocessed with 1 and 2 worker
processes (spawned: their start-up is part of the time, as for a user) and the outputs must be
byte-identical. Prints a table, then one JSON line: {"bench": "preprocess",
"tokens_per_s_1": ..., "tokens_per_s_2": ..., "speedup_2": ...}.
"""

from __future__ import annotations

import filecmp
import glob
import json
import os
import sysconfig
import tempfile

CORPUS_BYTES = 16 << 20
VOCAB = 4096

# bench/RESULTS.md's summary rows (bench.summary): (figure, value, goal), templates over the JSON
SUMMARY = [
    ("ldt-preprocess, {corpus_mb} MB of JSONL, 4096-token BPE: tokens/s with 1 / 2 workers "
     "(outputs identical: {identical})",
     "{tokens_per_s_1:,} / {tokens_per_s_2:,} (**{speedup_2:.2f}x**)", "-"),
]
# figures documents quote from the latest run (bench.summary, tests/test_bench_summary.py)
QUOTES = [
    ("docs/data.md", "workers on {corpus_mb} MB of JSONL with a 4096-token BPE; on the 2-core "
     "development machine (`make bench`'s latest run) {tokens_per_s_1:,} tokens/s with one "
     "worker, {tokens_per_s_2:,} with two"),
]


def make_corpus(folder: str) -> str:
    path = os.path.join(folder, "stdlib.jsonl")
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"),
                         recursive=True))
    total = 0
    with open(path, "w") as out:
        for name in files:
            with open(name, encoding="utf-8", errors="replace") as f:
                text = f.read()
            out.write(json.dumps({"text": text}) + "\n")
            total += len(text)
            if total >= CORPUS_BYTES:
                break
    return path


def train_tokenizer(corpus: str, folder: str) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)

    def texts():
        with open(corpus) as f:
            for i, line in enumerate(f):
                if i >= 300:
                    return
                yield json.loads(line)["text"]

    tok.train_from_iterator(texts(), trainer)
    path = os.path.join(folder, "tokenizer.json")
    tok.save(path)
    return path


def main() -> dict:
    from ldt.data.preprocess import preprocess

    with tempfile.TemporaryDirectory() as folder:
        corpus = make_corpus(folder)
        tokenizer = train_tokenizer(corpus, folder)
        runs = {}
        for workers in (1, 2):
            prefix = os.path.join(folder, f"out{workers}")
            runs[workers] = preprocess([corpus], prefix, tokenizer, workers=workers,
                                       progress=False)
        same = all(filecmp.cmp(os.path.join(folder, f"out1{ext}"),
                               os.path.join(folder, f"out2{ext}"), shallow=False)
                   for ext in (".bin", ".idx"))
        size = os.path.getsize(corpus)
    print(f"corpus {size / 1e6:.1f} MB JSONL, {runs[1].documents} documents, "
          f"{runs[1].tokens} tokens, BPE vocabulary {VOCAB}; outputs identical: {same}")
    print(f"{'workers':>7}  {'seconds':>8}  {'tokens/s':>10}  {'MB/s':>6}")
    for workers, s in runs.items():
        print(f"{workers:>7}  {s.seconds:>8.2f}  {s.tokens_per_s:>10.0f}  "
              f"{s.input_bytes / s.seconds / 1e6:>6.2f}")
    out = {"bench": "preprocess", "corpus_mb": round(size / 1e6, 1),
           "tokens": runs[1].tokens, "tokens_per_s_1": round(runs[1].tokens_per_s),
           "tokens_per_s_2": round(runs[2].tokens_per_s),
           "speedup_2": round(runs[2].tokens_per_s / runs[1].tokens_per_s, 3),
           "identical": same}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
