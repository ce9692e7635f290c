"""Run what one install of ldt enables, in the clean venv ``.ci/extras`` made for it.

    python .ci/check_extra.py base|hf|smollm2 WORK_DIR

Run from a folder outside the clone, so the installed package (not the source tree) is what
imports. Everything is tiny and offline; a missing dependency of the extra shows as an error.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

BIN = os.path.dirname(sys.executable)


def sh(*args: str, expect: int = 0) -> str:
    print("+", " ".join(args), flush=True)
    proc = subprocess.run([os.path.join(BIN, args[0]), *args[1:]], capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != expect:
        sys.exit(f"{args[0]} exited {proc.returncode}, not {expect}\n{proc.stdout[-3000:]}\n"
                 f"{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


def base() -> None:
    """ldt alone: compose, plan, train two steps; the HF converter says which extra it needs."""
    sh("ldt-train", "--cfg", "job", "cluster=cpu_vtp")
    sh("ldt-plan", "--inventory", "a100_910b", "--model", "llama_7b")
    out = sh("ldt-train", "train.steps=2", "run_dir=run")
    assert '"steps": 2' in out, out[-2000:]
    os.makedirs("hf_in", exist_ok=True)
    out = sh("ldt-convert", "import", "hf_in", "ckpt", expect=2)
    assert "ldt[hf]" in out and "Traceback" not in out, out


def hf() -> None:
    """ldt[hf]: a tiny Llama through ldt-convert import and export, loaded by transformers."""
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained("hf_in")
    sh("ldt-convert", "import", "hf_in", "ckpt")
    sh("ldt-convert", "export", "ckpt", "hf_out")
    back = transformers.AutoModelForCausalLM.from_pretrained("hf_out").eval()
    tokens = torch.arange(16)[None]
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, back(tokens).logits)


def smollm2() -> None:
    """ldt[smollm2]: transformers reads a GGUF file (a tiny Llama written with ``gguf``), as
    examples/finetune_smollm2.py reads SmolLM2's."""
    import numpy as np
    import gguf
    from transformers import AutoModelForCausalLM

    h, f, layers, heads, kv, vocab = 64, 128, 2, 4, 2, 96
    w = gguf.GGUFWriter("tiny.gguf", "llama")
    w.add_block_count(layers)
    w.add_context_length(64)
    w.add_embedding_length(h)
    w.add_feed_forward_length(f)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(33 + i) for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_token_merges([])
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,),
              "output.weight": (vocab, h)}
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_q.weight": (h, h), f"blk.{i}.attn_k.weight": (h // 2, h),
                       f"blk.{i}.attn_v.weight": (h // 2, h), f"blk.{i}.attn_output.weight": (h, h),
                       f"blk.{i}.ffn_gate.weight": (f, h), f"blk.{i}.ffn_up.weight": (f, h),
                       f"blk.{i}.ffn_down.weight": (h, f), f"blk.{i}.attn_norm.weight": (h,),
                       f"blk.{i}.ffn_norm.weight": (h,)})
    for name, shape in shapes.items():
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model = AutoModelForCausalLM.from_pretrained(".", gguf_file="tiny.gguf")
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 2


if __name__ == "__main__":
    which, work = sys.argv[1], sys.argv[2]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    os.chdir(work)
    {"base": base, "hf": hf, "smollm2": smollm2}[which]()
    print(f"ok: ldt[{which}]" if which != "base" else "ok: ldt")
