"""Tokenizers, ldt-preprocess, indexed data and the launcher's data checks (no training world).

The tokenizer is trained here on local text; preprocessed documents are checked against it
(decode(encode(x)) == x for a byte-level BPE), blend / split parsing against megatron-core's own
functions, and the weighted blend's mix against its weights. Bad input must give exit status 2
and one line naming the file, before any process group exists.
"""

import dataclasses
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from ldt.config import ConfigError, DataConfig, ModelConfig, TrainConfig
from data_corpus import BAD_LINES, EOD, VOCAB, sources, train_tokenizer, write_jsonl, write_text

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=320,
                    seq_length=32)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    text = write_text(str(root / "a.txt"))
    jsonl = write_jsonl(str(root / "b.jsonl"))
    tok = train_tokenizer(str(root / "tok"), sources(0, 8))
    return {"root": root, "text": text, "jsonl": jsonl, "tok": tok}


@pytest.fixture(scope="module")
def prefixes(corpus):
    from ldt.data.preprocess import preprocess

    root = corpus["root"]
    a = preprocess([corpus["text"]], str(root / "a"), corpus["tok"], workers=2, progress=False)
    b = preprocess([corpus["jsonl"]], str(root / "b"), corpus["tok"], progress=False)
    return {"a": a, "b": b}


def test_tokenizers_are_local_only(corpus, tmp_path):
    from tokenizers import Tokenizer as HF

    from ldt.data.tokenizer import load, resolve

    for name in ("gpt2", "meta-llama/Llama-3.2-1B"):
        with pytest.raises(ConfigError, match="never downloads"):
            resolve(name)
    hf = HF.from_file(corpus["tok"])
    for spec in (corpus["tok"], os.path.dirname(corpus["tok"])):  # the file or its folder
        tok = load(spec)
        assert (tok.vocab_size, tok.eod) == (VOCAB, hf.token_to_id(EOD))
    assert (load("bytes").vocab_size, load("bytes").eod) == (256, 0)
    assert load("bytes").encode(["hé"]) == [[104, 195, 169]]
    # a folder without tokenizer.json goes through transformers' AutoTokenizer, offline
    hf.model.save(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>"}')
    folder = load(str(tmp_path))
    assert folder.source.kind == "folder" and folder.eod == hf.token_to_id(EOD)
    text = "def f(x):\n    return x + 1  # héllo\n"
    assert folder.encode([text]) == [hf.encode(text, add_special_tokens=False).ids]


def test_a_tokenizer_json_saved_with_truncation_or_padding_encodes_whole_documents(corpus,
                                                                                    tmp_path):
    """A tokenizer.json saved after a call with truncation (or padding) keeps those settings:
    the tokenizers library would cut (or pad) every document, as transformers does not."""
    from tokenizers import Tokenizer as HF

    from ldt.data.tokenizer import load

    text = open(corpus["text"]).read()[:4000]
    plain = HF.from_file(corpus["tok"]).encode(text, add_special_tokens=False).ids
    assert len(plain) > 64
    for setting in ("truncation", "padding"):
        hf = HF.from_file(corpus["tok"])
        if setting == "truncation":
            hf.enable_truncation(16)
        else:
            hf.enable_padding(pad_id=0, length=2 * len(plain))
        path = tmp_path / setting / "tokenizer.json"
        path.parent.mkdir()
        hf.save(str(path))
        assert load(str(path)).encode([text, text[:50]])[0] == plain, setting


def _documents(prefix: str) -> list[np.ndarray]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return [np.array(ds[i]) for i in range(len(ds))]  # copies: the mmap closes with ds


def test_preprocess_text_and_jsonl(corpus, prefixes, tmp_path):
    from tokenizers import Tokenizer as HF

    from ldt.data.preprocess import preprocess

    hf = HF.from_file(corpus["tok"])
    eod = hf.token_to_id(EOD)
    text = open(corpus["text"]).read()
    docs = _documents(prefixes["a"].output_prefix)
    # a text file: one document per paragraph, each ending with the end-of-document token,
    # together exactly the file's non-blank lines
    paragraphs = [p for p in re.split(r"\n[ \t]*\n", text) if p.strip()]
    assert len(docs) == len(paragraphs) == prefixes["a"].documents > 100
    assert all(d[-1] == eod and eod not in d[:-1] for d in docs)
    assert "".join(hf.decode(d[:-1].tolist()) for d in docs) == \
        "".join(x for x in text.splitlines(keepends=True) if x.strip())
    assert docs[0].dtype == np.uint16 and prefixes["a"].tokens == sum(len(d) for d in docs)
    # the worker count changes nothing in the output
    one = preprocess([corpus["text"]], str(tmp_path / "one"), corpus["tok"], progress=False)
    for ext in (".bin", ".idx"):
        assert open(one.output_prefix + ext, "rb").read() == \
            open(prefixes["a"].output_prefix + ext, "rb").read()
    # JSONL: the good lines, in order; every bad line reported with its number and reason
    b = prefixes["b"]
    assert [(x.line, x.reason.split(" (")[0].split(" at ")[0]) for x in b.bad_lines] == [
        (3, "invalid JSON"), (5, "no 'text' field"), (7, "invalid UTF-8"),
        (9, "'text' is a int, not a string")]
    assert set(BAD_LINES) == {x.line for x in b.bad_lines}
    wanted = sources(40, 40)
    got = _documents(b.output_prefix)
    assert [hf.decode(d[:-1].tolist()) for d in got] == wanted
    report = [x.split("\t") for x in open(b.output_prefix + ".bad_lines.tsv").read().splitlines()]
    assert [r[1] for r in report[1:]] == ["3", "5", "7", "9"]
    assert report[1][0] == corpus["jsonl"] and report[1][2].startswith("invalid JSON (")


def test_interrupted_preprocess_keeps_no_half_written_pair(corpus, prefixes, tmp_path,
                                                           monkeypatch):
    import ldt.data.preprocess as pp

    prefix = str(tmp_path / "out")
    pp.preprocess([corpus["jsonl"]], prefix, corpus["tok"], progress=False)
    before = {ext: open(prefix + ext, "rb").read() for ext in (".bin", ".idx")}
    calls = []

    def crash(texts):
        calls.append(1)
        if len(calls) > 1:
            raise OSError("disk full")
        return pp._encode.__wrapped__(texts)

    crash.__wrapped__ = pp._encode
    monkeypatch.setattr(pp, "_encode", crash)
    monkeypatch.setattr(pp, "CHUNK_BYTES", 4096)  # many chunks: the crash comes half-way
    with pytest.raises(OSError, match="disk full"):  # replacing the earlier output
        pp.preprocess([corpus["text"]], prefix, corpus["tok"], progress=False, overwrite=True)
    assert len(calls) == 2
    assert sorted(os.listdir(tmp_path)) == ["out.bad_lines.tsv", "out.bin", "out.idx"]
    assert {ext: open(prefix + ext, "rb").read() for ext in (".bin", ".idx")} == before


def test_blend_and_split_parse_as_megatron_does():
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)
    from megatron.core.datasets.utils import get_blend_from_list

    from ldt.data.files import parse_blend, split_bookends

    for blend in (["/d/a"], ["/d/a", "/d/b"], ["0.3", "/d/a", "0.7", "/d/b"],
                  ["2", "/d/a", "1", "/d/b"]):
        prefixes, weights = get_blend_from_list(blend)
        assert parse_blend(blend) == (prefixes, weights if len(prefixes) > 1 else None)
    assert parse_blend("0.3 /d/a.bin 0.7 /d/b") == (["/d/a", "/d/b"], [0.3, 0.7])
    with pytest.raises(ConfigError, match="mixes weights and paths"):
        parse_blend(["0.3", "/d/a", "/d/b"])
    for split in ("969,30,1", "98,2,0", "1", "1,1", "7,2,1", "0,1,0"):
        want = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
        assert split_bookends(split) == want, split
    assert split_bookends("90/10/0") == split_bookends("90,10,0")


def _build(blend, tokenizer, topo, stage, dp_rank=0, m=2, cache_dir=None):
    """build_indexed as rank 0 of ``stage`` would call it (eval on: both splits)."""
    from types import SimpleNamespace

    from ldt.data.indexed import build_indexed

    state = SimpleNamespace(stage=stage, rank=0, info=SimpleNamespace(dp_rank=dp_rank))
    data = DataConfig(blend=blend, tokenizer=tokenizer, cache_dir=cache_dir)
    train = TrainConfig(micro_batch_size=2, num_microbatches=m, eval_every=1, seed=7)
    return build_indexed(data, MODEL, train, topo, state)


def test_indexed_data_is_megatron_gpt_dataset(corpus, prefixes, one_process_world, tmp_path):
    import torch

    from ldt.topology.ranks import Stage, Topology

    a, b = prefixes["a"].output_prefix, prefixes["b"].output_prefix
    blend = [0.3, a, 0.7, b]
    edge_and_cloud = Topology((Stage(0, "edge", "cpu", 1), Stage(1, "cloud", "cpu", 1)),
                              u_shape=True)
    cache = str(tmp_path / "cache")
    data = _build(blend, corpus["tok"], edge_and_cloud, 0, cache_dir=cache)
    # the weighted blend draws each dataset in proportion to its weight
    ids = np.array([data.train[i]["dataset_id"] for i in range(len(data.train))])
    assert len(ids) > 300 and abs((ids == 0).mean() - 0.3) < 0.02, (ids == 0).mean()
    batch = data.batch(3, 1)
    assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert batch["tokens"].shape == (2, MODEL.seq_length) and batch["tokens"].dtype == torch.long
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    assert batch["tokens"].max() < VOCAB
    # a pure function of (seed, step, micro-batch, DP rank): rebuilt (from the cache) the same,
    # and DP rank d's micro-batch mb is the reference's micro-batch d * m + mb
    assert any(f.endswith("shuffle_index.npy") for _, _, names in os.walk(cache) for f in names)
    assert not os.path.exists(a) and not os.path.exists(b)  # no cache folder beside the data
    again = _build(blend, corpus["tok"], edge_and_cloud, 0, cache_dir=cache)
    two_replicas = dataclasses.replace(edge_and_cloud, dp=2)
    dp0, dp1 = (_build(blend, corpus["tok"], two_replicas, 0, dp_rank=d, cache_dir=cache)
                for d in (0, 1))
    ref = _build(blend, corpus["tok"], edge_and_cloud, 0, m=4, cache_dir=cache)
    for step in range(3):
        for mb in range(2):
            assert torch.equal(again.batch(step, mb)["tokens"], data.batch(step, mb)["tokens"])
            assert torch.equal(ref.batch(step, mb)["tokens"], dp0.batch(step, mb)["tokens"])
            assert torch.equal(ref.batch(step, 2 + mb)["tokens"], dp1.batch(step, mb)["tokens"])
    assert not torch.equal(data.batch(1, 0)["tokens"], data.batch(0, 0)["tokens"])
    assert torch.equal(data.eval_batch(0)["tokens"], again.eval_batch(0)["tokens"])
    assert not torch.equal(data.eval_batch(0)["tokens"], data.batch(0, 0)["tokens"])
    # the cloud joins megatron-core's barriers with placeholders: it builds and reads nothing
    files = sorted(os.walk(cache))
    assert _build(blend, corpus["tok"], edge_and_cloud, 1, cache_dir=cache) is None
    assert sorted(os.walk(cache)) == files


def test_a_corpus_preprocessed_again_does_not_reuse_the_old_index_cache(corpus,
                                                                       one_process_world,
                                                                       tmp_path):
    """megatron-core keys its index cache by the dataset's path and settings: the same
    prefix preprocessed again (fewer documents) with the same data.cache_dir read the old
    corpus's sample indices, an IndexError inside training (#39). ldt keys the cache folder
    by the files themselves: the second build is the new corpus's, every sample readable."""
    import ldt.data.preprocess as pp
    from ldt.topology.ranks import Stage, Topology

    topo = Topology((Stage(0, "edge", "cpu", 1), Stage(1, "cloud", "cpu", 1)), u_shape=True)
    prefix, cache = str(tmp_path / "c"), str(tmp_path / "cache")
    pp.preprocess([corpus["jsonl"]], prefix, corpus["tok"], progress=False)
    big = _build(prefix, corpus["tok"], topo, 0, cache_dir=cache)
    pp.preprocess([corpus["text"]], prefix, corpus["tok"], progress=False, overwrite=True)
    small = _build(prefix, corpus["tok"], topo, 0, cache_dir=cache)
    assert len(small.train) < len(big.train)
    for i in range(len(small.train)):
        small.train[i]
    assert len(os.listdir(cache)) == 2  # one folder per version of the files


def test_cache_folder_per_host(monkeypatch, tmp_path):
    from ldt.data.indexed import cache_folder

    for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "XDG_CACHE_HOME"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_folder(None, 0) == str(tmp_path / "ldt" / "indices")
    assert cache_folder("/c", 5) == ""  # unknown launcher: build in memory
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # one machine
    assert cache_folder("/c", 5) == "/c"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("GROUP_RANK", "1")  # torchrun's second node: not rank 0's disk
    assert cache_folder("/c", 5) == ""
    monkeypatch.setenv("GROUP_RANK", "0")
    assert cache_folder("/c", 3) == "/c"


def _bad_inputs(root, prefixes):
    """name -> (files to make, ldt-train overrides, text the message must hold)."""
    a = prefixes["a"].output_prefix
    return {
        "missing": ([], [f"data.blend={root}/nothing"], [f"{root}/nothing.bin", "ldt-preprocess"]),
        "empty": ([("empty.bin", b""), ("empty.idx", b"")], [f"data.blend={root}/empty"],
                  [f"{root}/empty.idx is empty", "re-run ldt-preprocess"]),
        "bin_without_idx": ([("lone.bin", open(a + ".bin", "rb").read())],
                            [f"data.blend={root}/lone"],
                            [f"{root}/lone.idx is missing next to {root}/lone.bin"]),
        "idx_of_other_dtype": ([("mixed.bin", open(a + ".bin", "rb").read()),
                                ("mixed.idx", _as_int32_index(a))], [f"data.blend={root}/mixed"],
                               [f"{root}/mixed.idx describes", "int32", "another dtype"]),
        "tokenizer_too_big": ([], [f"data.blend={a}", "model.vocab_size=256"],
                              ["has 300 tokens but model.vocab_size=256",
                               "set model.vocab_size >= 300"]),
    }


def _as_int32_index(prefix):
    """The .idx of the same documents written as int32: it does not describe the uint16 .bin."""
    raw = bytearray(open(prefix + ".idx", "rb").read())
    raw[17] = 4  # the dtype code byte (after 9 magic + 8 version bytes): int32
    return bytes(raw)


@pytest.mark.parametrize("name", ["missing", "empty", "bin_without_idx", "idx_of_other_dtype",
                                  "tokenizer_too_big"])
def test_check_data_refuses(name, corpus, prefixes):
    from ldt.data.files import check_data

    root = corpus["root"]
    files, overrides, expected = _bad_inputs(root, prefixes)[name]
    for fname, content in files:
        (root / fname).write_bytes(content)
    fields = dict(o.split("=", 1) for o in overrides)
    data = DataConfig(blend=fields["data.blend"], tokenizer=corpus["tok"])
    model = ModelConfig(**{**MODEL.__dict__, "vocab_size": int(fields.get("model.vocab_size",
                                                                          320))})
    with pytest.raises(ConfigError) as exc:
        check_data(data, model, TrainConfig())
    for text in expected:
        assert text in str(exc.value), (text, str(exc.value))


def test_check_data_refuses_empty_split_and_unknown_tokenizer(corpus, prefixes):
    from ldt.data.files import check_data

    a = prefixes["a"].output_prefix
    data = DataConfig(blend=a, tokenizer=corpus["tok"], split="100,0,0")
    check_data(data, MODEL, TrainConfig())  # no evaluation: the validation split is not read
    with pytest.raises(ConfigError, match="gives the validation split no share"):
        check_data(data, MODEL, TrainConfig(eval_every=5))
    with pytest.raises(ConfigError, match=r"validation split of .*/a 0 of its 354 documents"):
        check_data(DataConfig(blend=a, tokenizer=corpus["tok"], split="99999,1,0"), MODEL,
                   TrainConfig(eval_every=5))
    with pytest.raises(ConfigError, match="never downloads"):
        check_data(DataConfig(blend=a, tokenizer="gpt2"), MODEL, TrainConfig())
    with pytest.raises(ConfigError, match="needs indexed data"):
        check_data(DataConfig(tokenizer=corpus["tok"]), MODEL, TrainConfig())


def _one_line(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines() if x.startswith("ldt")]


@pytest.mark.timeout(120)
def test_bad_input_exits_2_with_one_line(corpus, prefixes):
    """The real entry points: ldt-train (before any process group) and ldt-preprocess."""
    root = corpus["root"]
    cases = _bad_inputs(root, prefixes)
    for name, (files, overrides, expected) in cases.items():
        for fname, content in files:
            (root / fname).write_bytes(content)
        proc = subprocess.run([sys.executable, "-m", "ldt.job.train", f"run_dir={root}/run_{name}",
                               f"data.tokenizer={corpus['tok']}", "model.vocab_size=320",
                               *overrides], capture_output=True, text=True, timeout=60)
        lines = _one_line(proc.stderr)
        assert proc.returncode == 2 and len(lines) == 1, (name, proc.returncode, proc.stderr)
        assert all(t in lines[0] for t in expected), (name, lines)
        assert not os.path.exists(root / f"run_{name}" / "pids")  # no rank ever started
    (root / "empty.txt").write_text("")
    for args, expected in (
            (["--input", f"{root}/none.txt"], f"--input {root}/none.txt: no such file"),
            (["--input", f"{root}/empty.txt"], f"--input {root}/empty.txt is empty"),
            (["--input", corpus["text"], "--tokenizer", "gpt2"], "never downloads")):
        proc = subprocess.run([sys.executable, "-m", "ldt.tools.preprocess", *args,
                               "--output-prefix", f"{root}/x"], capture_output=True, text=True,
                              timeout=60)
        lines = _one_line(proc.stderr)
        assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], proc.stderr
        assert not any(f.startswith("x.") for f in os.listdir(root))


def test_the_byte_corpus_reads_every_window_once_per_epoch_whatever_the_layout():
    """The built-in byte data (``data.path``): a run of one epoch's samples reads each
    training window exactly once (no window twice in a step, none left out), the same windows
    in the same global order for dp 1 x 8 micro-batches as for dp 2 x 4 (and per-stage DP's
    lanes), and never a held-out one; the next epoch reads them all again in another order.
    (It drew each step's windows with replacement: 38% of an epoch's went unread.)"""
    from ldt.data.bytes import TextData
    from ldt.data.lane_data import LaneData

    def read(dp, m, steps):
        out = []
        for step in range(steps):
            for rank in range(dp):
                data = TextData(None, 32, 2, m, dp_rank=rank, dp=dp, seed=7, max_bytes=20_000)
                windows = [data.window_indices(step, mb) for mb in range(m)]
                for mb, ws in enumerate(windows):
                    rows = data.batch(step, mb)["tokens"]
                    assert [r.tolist() for r in rows] == [
                        data.tokens[w * 32:w * 32 + 32].tolist() for w in ws]
                    out += ws
        return out

    data = TextData(None, 32, 2, 8, seed=7, max_bytes=20_000)
    n, per_step = data.num_windows, 16
    steps = -(-n // per_step) * 2 + 1  # two epochs and a bit
    one = read(1, 8, steps)
    assert one == read(2, 4, steps)
    epoch, second = one[:n], one[n:2 * n]
    assert sorted(epoch) == sorted(second) == list(range(n))  # every window once, none held out
    assert epoch != second
    for step in range(n // per_step):  # no window twice in a step within an epoch
        assert len(set(one[step * per_step:(step + 1) * per_step])) == per_step
    lane = LaneData(TextData(None, 32, 2, 4, dp=2, seed=7, max_bytes=20_000), list(range(8)), 2)
    for step in range(steps):  # per-stage DP: a replica reading every micro-batch of the step
        rows = sorted(r.tolist() for b in lane.step_iterator(step) for r in b["tokens"])
        assert rows == sorted(data.tokens[w * 32:w * 32 + 32].tolist()
                              for w in one[step * per_step:(step + 1) * per_step])
    other_seed = TextData(None, 32, 2, 8, seed=8, max_bytes=20_000)
    assert [w for mb in range(8) for w in other_seed.window_indices(0, mb)] != one[:per_step]


def test_the_byte_corpus_resumes_mid_epoch_in_the_same_order():
    """A resumed run builds its data afresh and reads from the checkpoint's step on: the same
    windows as the run that went on, mid-epoch and across the epoch's end, also into another
    layout of the same global batch (dp 2 x 2 micro-batches of 2 from dp 1 x 4)."""
    from ldt.data.bytes import TextData

    def windows(data, steps):
        return [w for step in steps for mb in range(data.m) for w in data.window_indices(step,
                                                                                         mb)]

    whole = TextData(None, 32, 2, 4, seed=3, max_bytes=20_000)
    n, per_step = whole.num_windows, 8
    steps = range(2 * n // per_step + 2)
    uninterrupted = windows(whole, steps)
    for cut in (1, n // per_step // 2, n // per_step):  # early, mid-epoch, at the epoch's end
        fresh = TextData(None, 32, 2, 4, seed=3, max_bytes=20_000)
        assert windows(fresh, steps[cut:]) == uninterrupted[cut * per_step:], cut
        per_rank = [windows(TextData(None, 32, 2, 2, dp_rank=r, dp=2, seed=3, max_bytes=20_000),
                            [s]) for s in steps[cut:] for r in range(2)]
        assert [w for ws in per_rank for w in ws] == uninterrupted[cut * per_step:], cut
    for step in steps:  # the batches themselves, not only their indices
        for mb in range(4):
            a, b = whole.batch(step, mb), TextData(None, 32, 2, 4, seed=3,
                                                  max_bytes=20_000).batch(step, mb)
            assert all(a[k].equal(b[k]) for k in a)
