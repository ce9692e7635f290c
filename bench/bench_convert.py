"""Peak memory of ``ldt-convert`` on a checkpoint larger than 1 GiB (``make bench`` / by hand).

A random ``LlamaForCausalLM`` of 1.25 GiB (bf16; hidden 2048, 12 layers, GQA 16 / 4, FFN 5632,
vocabulary 32000; three safetensors shards) is written offline with ``safetensors`` directly
(no model object, no download). Then, each in a fresh process, the peak resident memory
(``VmHWM``) of: importing the libraries only (the baseline), the import into an ldt
checkpoint, and the export back to a Hugging Face folder. The conversion reads one tensor at a
time and writes one decoder layer at a time, so its peak above the baseline should be a few
layers, not the checkpoint.

    python -m bench.bench_convert [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

GIB = 2**30
SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=12,
             num_attention_heads=16, num_key_value_heads=4)

# bench/RESULTS.md's summary rows (bench.summary): (figure, value, goal), templates over the JSON
SUMMARY = [
    ("peak resident memory above the libraries, ldt-convert import / export of a "
     "{checkpoint_gib:.2f} GiB bf16 Llama (peak RSS)",
     "{import_above_baseline_gib:.2f} / {export_above_baseline_gib:.2f} GiB "
     "({import_peak_rss_gib:.2f} / {export_peak_rss_gib:.2f}); {import_s:.1f} / "
     "{export_s:.1f} s", "-"),
]
# figures documents quote from the latest run (bench.summary, tests/test_bench_summary.py)
QUOTES = [
    ("README.md", "a {checkpoint_gib:.2f} GiB checkpoint imports with a peak of "
     "{import_peak_rss_gib:.2f} GiB of memory, the libraries' {baseline_rss_gib:.2f} included)"),
    ("docs/models.md", "(`bench/bench_convert.py`: a {checkpoint_gib:.2f} GiB checkpoint imports "
     "with a peak of {import_peak_rss_gib:.2f} GiB)"),
]


def write_random_llama(folder: str, shard_bytes: int = 512 * 2**20) -> int:
    """A random bf16 Llama folder (config.json + sharded safetensors); returns its bytes."""
    import torch
    import transformers
    from safetensors.torch import save_file

    cfg = transformers.LlamaConfig(**SHAPE, tie_word_embeddings=False, torch_dtype="bfloat16",
                                   architectures=["LlamaForCausalLM"])
    h, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    kv = h // cfg.num_attention_heads * cfg.num_key_value_heads
    shapes = {"model.embed_tokens.weight": (v, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h),
                       p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h),
                       p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    shapes.update({"model.norm.weight": (h,), "lm_head.weight": (v, h)})
    os.makedirs(folder, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    shards, current, size, total = [], {}, 0, 0
    for name, shape in shapes.items():
        current[name] = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        size += current[name].numel() * 2
        if size >= shard_bytes:
            shards.append(current)
            current, size = {}, 0
    shards.append(current)
    weight_map = {}
    for k, shard in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(folder, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in shard})
        total += sum(t.numel() * 2 for t in shard.values())
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh)
    cfg.to_json_file(os.path.join(folder, "config.json"))
    return total


_CHILD = """
import sys, time
import torch.distributed.checkpoint, safetensors, transformers
from ldt.models.hf import export_hf, import_hf
t0 = time.perf_counter()
if sys.argv[1] == "import":
    import_hf(sys.argv[2], sys.argv[3], log=lambda *a: None, overwrite=True)  # its own scratch
elif sys.argv[1] == "export":
    export_hf(sys.argv[2], sys.argv[3], log=lambda *a: None, overwrite=True)
secs = time.perf_counter() - t0
# VmHWM: this process's own peak (ru_maxrss would include the parent's RSS at fork time)
hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]
print(int(hwm) * 1024, secs)
"""


def peak(*args: str) -> tuple[int, float]:
    """(peak RSS bytes, seconds) of one conversion in a fresh process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True,
                         timeout=1800, env=env, check=True).stdout.split()
    return int(out[-2]), float(out[-1])


def dir_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(folder) for n in ns)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", help="work in this folder and keep it (default: a temp dir)")
    args = parser.parse_args(argv if argv is not None else [])
    root = args.keep or tempfile.mkdtemp(prefix="ldt_bench_convert_")
    hf, ldt, back = (os.path.join(root, n) for n in ("hf", "ldt", "hf_back"))
    t0 = time.perf_counter()
    size = write_random_llama(hf)
    made = time.perf_counter() - t0
    base, _ = peak("none", "", "")
    imp, imp_s = peak("import", hf, ldt)
    exp, exp_s = peak("export", ldt, back)
    rows = [("libraries only (baseline)", base, 0.0), ("import HF -> ldt", imp, imp_s),
            ("export ldt -> HF", exp, exp_s)]
    print(f"random Llama: {size / GIB:.2f} GiB in {len(os.listdir(hf)) - 2} safetensors files "
          f"(written in {made:.0f} s); ldt checkpoint {dir_bytes(ldt) / GIB:.2f} GiB")
    print(f"{'process':28s} {'peak RSS GiB':>12s} {'above baseline GiB':>19s} {'time s':>7s}")
    for name, rss, secs in rows:
        print(f"{name:28s} {rss / GIB:12.2f} {(rss - base) / GIB:19.2f} {secs:7.1f}")
    if not args.keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    out = {"bench": "convert", "checkpoint_gib": round(size / GIB, 3),
           "baseline_rss_gib": round(base / GIB, 3), "import_peak_rss_gib": round(imp / GIB, 3),
           "import_above_baseline_gib": round((imp - base) / GIB, 3),
           "export_peak_rss_gib": round(exp / GIB, 3),
           "export_above_baseline_gib": round((exp - base) / GIB, 3),
           "import_s": round(imp_s, 1), "export_s": round(exp_s, 1)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
