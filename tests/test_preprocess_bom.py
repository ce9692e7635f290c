"""ldt-preprocess on files that start with a UTF-8 byte-order mark (as Windows editors save
them): the mark is no part of the first document, and the first JSONL line is not bad."""

import json

import numpy as np
import pytest

BOM = b"\xef\xbb\xbf"


def _documents(prefix: str) -> list[bytes]:
    """Each document's bytes (the byte tokenizer: token = byte), end-of-document dropped."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    docs = [np.array(ds[i]) for i in range(len(ds))]  # copies: the mmap closes with ds
    assert all(d[-1] == 0 for d in docs)  # the byte tokenizer's end of document
    return [bytes(d[:-1].astype(np.uint8)) for d in docs]


@pytest.mark.parametrize("mark", [BOM, b""], ids=["bom", "plain"])
def test_a_byte_order_mark_is_no_part_of_the_first_document(mark, tmp_path):
    from ldt.data.preprocess import preprocess

    texts = ["héllo wörld", "second", "third"]
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_bytes(mark + b"".join(json.dumps({"text": t}).encode() + b"\n" for t in texts))
    got = preprocess([str(jsonl)], str(tmp_path / "j"), "bytes", progress=False)
    assert got.bad_lines == [] and got.documents == 3, [str(b) for b in got.bad_lines]
    assert _documents(got.output_prefix) == [t.encode() for t in texts]

    text = tmp_path / "a.txt"
    text.write_bytes(mark + "\n\n".join(texts).encode() + b"\n")
    for mode, wanted in (("paragraph", [t + "\n" for t in texts]),
                         ("line", [t + "\n" for t in texts]),
                         ("file", ["\n\n".join(texts) + "\n"])):
        got = preprocess([str(text)], str(tmp_path / f"t_{mode}"), "bytes",
                         text_documents=mode, progress=False)
        assert _documents(got.output_prefix) == [w.encode() for w in wanted], mode

    # a mark alone on the first line is a blank line
    (tmp_path / "b.jsonl").write_bytes(mark + b"\n" + b'{"text": "ok"}\n')
    got = preprocess([str(tmp_path / "b.jsonl")], str(tmp_path / "b"), "bytes", progress=False)
    assert got.bad_lines == [] and _documents(got.output_prefix) == [b"ok"]
    # a bad byte's offset counts the mark's 3 bytes; a mark after the first line is no
    # byte-order mark: that line stays bad
    (tmp_path / "c.jsonl").write_bytes(mark + b'{"text": "\xff"}\n' + mark + b'{"text": "x"}\n'
                                       + b'{"text": "ok"}\n')
    got = preprocess([str(tmp_path / "c.jsonl")], str(tmp_path / "c"), "bytes", progress=False)
    assert [(b.line, b.reason.split(" (")[0]) for b in got.bad_lines] == [
        (1, f"invalid UTF-8 at byte {len(mark) + 10}")] + ([(2, "invalid JSON")] if mark else [])
    assert _documents(got.output_prefix) == ([] if mark else [b"x"]) + [b"ok"]
