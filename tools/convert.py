"""``ldt-convert``: Hugging Face checkpoints in and out of ldt.

    ldt-convert import HF_FOLDER OUT            # Llama (3.1+), Qwen2, Qwen3, Qwen3-MoE -> ldt
    ldt-convert export CHECKPOINT OUT           # an ldt checkpoint -> a Hugging Face folder

``import`` writes an ldt checkpoint folder (``train.load=OUT`` starts a run from it, in any
cluster layout) and ``OUT/conf/model/<name>.yaml`` with the model's config, so

    ldt-train hydra.searchpath=[file://$PWD/OUT/conf] model=<name> train.load=OUT

trains it. ``export`` takes an import or any training checkpoint (a run folder or one of its
``checkpoints/step_N``), checked against its checksums first. Both build OUT beside it and
rename it into place when complete and verified: an OUT that exists is refused unless
``--overwrite`` (then replaced whole), and a failure leaves it as it was. Thin over
:mod:`ldt.models.hf`.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from typing import Optional, Sequence

from ldt.config import ConfigError
import ldt.launch.quiet
from ldt.tools.cli import Parser, count
from ldt.tools.cli import guarded


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="ldt-convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face folder -> ldt checkpoint")
    imp.add_argument("hf_folder", help="folder with config.json and *.safetensors")
    imp.add_argument("out", help="ldt checkpoint folder to write (must not exist yet)")
    imp.add_argument("--name", help="model config name (default: the out folder's name)")
    imp.add_argument("--seq-length", type=count(1), default=None,
                     help="model.seq_length in the written YAML (default: min(2048, the "
                          "model's max_position_embeddings))")
    imp.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                     help="model.params_dtype in the written YAML (default: the checkpoint's)")
    exp = sub.add_parser("export", help="ldt checkpoint -> Hugging Face folder")
    exp.add_argument("checkpoint", help="ldt checkpoint (run folder or checkpoints/step_N)")
    exp.add_argument("out", help="Hugging Face folder to write (must not exist yet)")
    for command in (imp, exp):
        command.add_argument("--overwrite", action="store_true",
                             help="replace an existing OUT whole (default: refuse it)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    import warnings

    # torch.distributed.checkpoint in one process (no_dist=True) says so on every file
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    return guarded("ldt-convert", lambda: _with_hf_extra(
        _export if args.command == "export" else _import, args))


def _with_hf_extra(command, args) -> int:
    """Without the hf extra, say which extra to install (not a traceback)."""
    try:
        return command(args)
    except ModuleNotFoundError as exc:
        if exc.name not in ("transformers", "safetensors", "accelerate"):
            raise
        raise ConfigError(f"{exc.name} is not installed; Hugging Face checkpoints need the hf "
                          "extra: pip install 'ldt[hf]' (pip install -e '.[hf]' in a clone)"
                          ) from None


def _export(args) -> int:
    from ldt.models.hf import export_hf

    export_hf(args.checkpoint, args.out, overwrite=args.overwrite)
    return 0


def _import(args) -> int:
    from ldt.models.hf import import_hf, model_config_of

    name = args.name or re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(
        os.path.abspath(args.out)))
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name):
        raise ConfigError(f"--name {name!r}: a config name is letters, digits, '_', '.', '-' "
                          "(it becomes model=NAME); give another --name")
    _, model = model_config_of(args.hf_folder)
    most = model.max_position_embeddings or 2048
    seq = args.seq_length or min(2048, most)
    if seq > most:
        raise ConfigError(f"--seq-length {seq} exceeds the model's max_position_embeddings "
                          f"{most}; give at most {most}")
    import_hf(args.hf_folder, args.out, overwrite=args.overwrite,
              conf={"name": name, "seq_length": seq, "params_dtype": args.dtype})
    path = os.path.join(args.out, "conf", "model", f"{name}.yaml")
    conf = os.path.abspath(os.path.join(args.out, "conf"))
    command = shlex.join(["ldt-train", f"hydra.searchpath=[file://{conf}]", f"model={name}",
                          f"train.load={os.path.abspath(args.out)}"])
    print(f"model config: {path}\nstart a run from it (with a cluster that fits it):\n"
          f"  {command} cluster=...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
