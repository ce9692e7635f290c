"""``ldt-preprocess``: text or JSONL into a Megatron indexed dataset for ``data.blend``.

    ldt-preprocess --input corpus.txt --output-prefix data/corpus --tokenizer tok/tokenizer.json
    ldt-preprocess --input a.jsonl b.jsonl --json-key content --output-prefix data/ab --workers 4

Writes ``PREFIX.bin`` and ``PREFIX.idx`` (megatron-core's format; train with
``ldt-train data.blend=PREFIX data.tokenizer=...``) and prints one JSON line (documents,
tokens, bad lines, tokens/s). Bad lines are listed on stderr and in ``PREFIX.bad_lines.tsv``.
Bad input (a missing or empty file, a tokenizer that is not a local path, an output that
exists without ``--overwrite`` or that is also an input, ...) exits with status 2 and one line
naming the file and the fix. Thin over :mod:`ldt.data.preprocess`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from ldt.data.preprocess import FORMATS, TEXT_DOCUMENTS
from ldt.data.preprocess import preprocess
from ldt.tools.cli import Parser, count
from ldt.tools.cli import guarded

EXIT_INPUT = 2


def parser() -> argparse.ArgumentParser:
    import os

    p = Parser(prog="ldt-preprocess", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="text or JSONL files, in order")
    p.add_argument("--output-prefix", required=True,
                   help="writes PREFIX.bin and PREFIX.idx (the folder must exist; existing "
                        "files are refused unless --overwrite)")
    p.add_argument("--tokenizer", default="bytes",
                   help="'bytes' (default) or a local tokenizer.json / Hugging Face tokenizer "
                        "folder; never downloaded")
    p.add_argument("--format", default="auto", choices=FORMATS,
                   help="auto (default): .jsonl / .json / .ndjson are JSONL, the rest text")
    p.add_argument("--json-key", default="text", help="JSONL field holding a document's text")
    p.add_argument("--text-documents", default="paragraph", choices=TEXT_DOCUMENTS,
                   help="in a text file, a document is a paragraph (default), a line or the file")
    p.add_argument("--eod-token", default=None,
                   help="end-of-document token (default: the tokenizer's eos_token)")
    cores = os.cpu_count() or 1
    p.add_argument("--workers", type=count(1, 4 * cores, " (4 per core on this machine)"),
                   default=1, help="tokenizing processes (default 1)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace existing PREFIX.bin / .idx / .bad_lines.tsv (default: refuse)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    return guarded("ldt-preprocess", lambda: _run(args))


def _run(args) -> int:
    summary = preprocess(args.input, args.output_prefix, args.tokenizer,
                         workers=args.workers, fmt=args.format, json_key=args.json_key,
                         text_documents=args.text_documents, eod_token=args.eod_token,
                         progress=not args.quiet, overwrite=args.overwrite)
    bad = summary.bad_lines
    if bad:
        print(f"ldt-preprocess: skipped {len(bad)} bad line(s) (all in "
              f"{summary.output_prefix}.bad_lines.tsv):", file=sys.stderr)
        for line in bad[:20]:
            print(f"  {line}", file=sys.stderr)
        if len(bad) > 20:
            print(f"  ... and {len(bad) - 20} more", file=sys.stderr)
    print(json.dumps(summary.as_dict()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
