"""Small files the tests of bad inputs and interrupted writers share: a tiny Hugging Face
Llama, its ldt import, a corpus and its indexed pair (built once per session,
:func:`tiny_model_files` in conftest), and a measured ``action_times.csv``."""

import os
import shutil

import torch


def _hf_llama(folder):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=256, intermediate_size=64, hidden_size=32,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)


def _action_times(path, steps=6):
    from ldt.schedule import lower, one_f_one_b

    schedule = lower(one_f_one_b(2, 2), "1f1b")
    with open(path, "w") as f:
        f.write("step,stage,action,start_s,end_s,host,step_start_s\n")
        for step in range(steps):
            for stage, actions in schedule.items():
                for i, a in enumerate(actions):
                    f.write(f"{step},{stage},{a},{i * 0.01:.3f},{i * 0.01 + 0.005:.3f},h,"
                            f"{float(step):.1f}\n")


def build(root) -> None:
    """``root``: ``hf/`` (a tiny Llama), ``ckpt/`` (its import), ``corpus.txt`` and its
    indexed pair ``pair.bin`` / ``pair.idx``."""
    from ldt.data.preprocess import preprocess
    from ldt.models.hf import import_hf

    _hf_llama(os.path.join(root, "hf"))
    import_hf(os.path.join(root, "hf"), os.path.join(root, "ckpt"), log=lambda *_: None)
    with open(os.path.join(root, "corpus.txt"), "w") as f:
        f.write("A paragraph of text.\n\nAnother one.\n" * 40)
    preprocess([os.path.join(root, "corpus.txt")], os.path.join(root, "pair"), progress=False)


def copy(src, dst) -> None:
    shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)
