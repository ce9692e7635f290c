"""``ldt-convert``: Hugging Face checkpoints in and out of ldt.

    ldt-convert import HF_FOLDER OUT            # LlamaForCausalLM / Qwen2ForCausalLM -> ldt
    ldt-convert export CHECKPOINT OUT           # an ldt checkpoint -> a Hugging Face folder

``import`` writes an ldt checkpoint folder (``train.load=OUT`` starts a run from it, in any
cluster layout) and ``OUT/conf/model/<name>.yaml`` with the model's config, so

    ldt-train hydra.searchpath=[file://$PWD/OUT/conf] model=<name> train.load=OUT

trains it. ``export`` takes an import or any training checkpoint (a run folder or one of its
``checkpoints/step_N``). Thin over :mod:`ldt.models.hf`.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Optional, Sequence


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ldt-convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face folder -> ldt checkpoint")
    imp.add_argument("hf_folder", help="folder with config.json and *.safetensors")
    imp.add_argument("out", help="ldt checkpoint folder to write")
    imp.add_argument("--name", help="model config name (default: the out folder's name)")
    imp.add_argument("--seq-length", type=int, default=None,
                     help="model.seq_length in the written YAML (default: min(2048, the "
                          "model's max_position_embeddings))")
    imp.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                     help="model.params_dtype in the written YAML (default: the checkpoint's)")
    exp = sub.add_parser("export", help="ldt checkpoint -> Hugging Face folder")
    exp.add_argument("checkpoint", help="ldt checkpoint (run folder or checkpoints/step_N)")
    exp.add_argument("out", help="Hugging Face folder to write")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    import warnings

    import ldt.quiet  # noqa: F401

    # torch.distributed.checkpoint in one process (no_dist=True) says so on every file
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    from ldt.config import ConfigError
    from ldt.models.hf import export_hf, import_hf, write_model_yaml

    try:
        if args.command == "export":
            export_hf(args.checkpoint, args.out)
            return 0
        model = import_hf(args.hf_folder, args.out)
        name = args.name or re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(
            os.path.abspath(args.out)))
        seq = args.seq_length or min(2048, model.max_position_embeddings or 2048)
        path = write_model_yaml(model, os.path.join(args.out, "conf", "model", f"{name}.yaml"),
                                seq_length=seq, params_dtype=args.dtype or _dtype_of(args.out))
        conf = os.path.abspath(os.path.join(args.out, "conf"))
        print(f"model config: {path}\nstart a run from it (with a cluster that fits it):\n"
              f"  ldt-train hydra.searchpath=[file://{conf}] model={name} "
              f"train.load={os.path.abspath(args.out)} cluster=...")
    except (ConfigError, FileNotFoundError) as exc:
        print(f"ldt-convert: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        if exc.name not in ("transformers", "safetensors", "accelerate"):
            raise
        print(f"ldt-convert: {exc.name} is not installed; Hugging Face checkpoints need the hf "
              "extra: pip install 'ldt[hf]' (pip install -e '.[hf]' in a clone)", file=sys.stderr)
        return 2
    return 0


def _dtype_of(checkpoint: str) -> str:
    from ldt.storage.tensors import tensor_index

    meta = tensor_index(checkpoint)["embedding.word_embeddings.weight"][1]
    return str(meta.properties.dtype).replace("torch.", "")


if __name__ == "__main__":
    sys.exit(main())
