"""megatron-core's index cache (data.cache_dir) after a run killed while it was written.

megatron-core writes each split's sample indices (``*.npy``) in place, one file after another,
and takes a set whose files all exist as built; a file cut short (the run killed while it was
written) then failed every later run in numpy ("mmap length is greater than file size")
until someone found and removed it. Rank 0 now removes such a file before the build, so
megatron-core builds that set again: the same samples as before.
"""

import os
from types import SimpleNamespace

import pytest
import torch

from ldt.config import DataConfig, ModelConfig, TrainConfig

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=320,
                    seq_length=32)


def _build(blend, cache_dir):
    """build_indexed as global rank 0 (the data stage's) calls it."""
    from ldt.data.indexed import build_indexed
    from ldt.topology.ranks import Stage, Topology

    topo = Topology((Stage(0, "edge", "cpu", 1), Stage(1, "cloud", "cpu", 1)), u_shape=True)
    state = SimpleNamespace(stage=0, rank=0, info=SimpleNamespace(dp_rank=0))
    data = DataConfig(blend=blend, tokenizer="bytes", cache_dir=cache_dir)
    train = TrainConfig(micro_batch_size=2, num_microbatches=2, eval_every=1, seed=7)
    return build_indexed(data, MODEL, train, topo, state)


def _batches(data) -> list:
    return [data.batch(step, mb)["tokens"] for step in range(4) for mb in range(2)] + \
        [data.eval_batch(mb)["tokens"] for mb in range(2)]


@pytest.mark.timeout(120)
def test_a_torn_index_file_is_built_again(one_process_world, tmp_path):
    from ldt.data.indexed import drop_torn_indices
    from ldt.data.preprocess import preprocess

    prefixes = []
    for name in ("a", "b"):
        text = tmp_path / f"{name}.txt"
        text.write_text("\n\n".join(f"{name} document {i}: " + "words " * (20 + i % 7)
                                    for i in range(200)))
        prefixes.append(preprocess([str(text)], str(tmp_path / name), "bytes",
                                   progress=False).output_prefix)
    blend = [0.4, prefixes[0], 0.6, prefixes[1]]  # weighted: the blend's indices are cached too
    cache = str(tmp_path / "cache")
    reference = _batches(_build(blend, cache))
    (folder,) = os.listdir(cache)
    folder = os.path.join(cache, folder)
    files = sorted(f for f in os.listdir(folder) if f.endswith(".npy"))
    assert any("GPTDataset" in f for f in files) and any("BlendedDataset" in f for f in files)
    assert drop_torn_indices(folder) == []  # whole files stay
    for name in files:
        path = os.path.join(folder, name)
        whole = os.path.getsize(path)
        for cut in (0, 40, whole - 1):  # empty, inside numpy's header, inside the data
            os.truncate(path, cut)
            again = _build(blend, cache)  # raised ValueError / EOFError in numpy.load
            assert os.path.getsize(path) == whole, (name, cut)
            assert all(torch.equal(x, y) for x, y in zip(_batches(again), reference)), name
