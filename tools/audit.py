"""``ldt-audit``: what the cloud of a U-shape can recover from what it receives, measured.

    ldt-audit                                  # cpu_demo + gpt_tiny, as ldt-train's defaults
    ldt-audit model=gpt_tiny train.steps=20 --noise 1 --json audit.json
    ldt-audit --checkpoint outputs/RUN --out outputs/audit_ckpt

Makes real U-shape runs of the config (Hydra overrides as for ldt-train) on this machine: the
edge training on its data, with and without ``train.boundary_noise``, and the cloud's shadow
runs on its own text; then plays the honest-but-curious cloud on exactly the tensors it
received. Prints what crossed, a table (attack, setting, tensor, recovery, chance) and the
defence's trade-off (loss against recovery), and writes them as JSON. Everything runs
locally: nothing is sent anywhere. The folder is built beside --out and renamed into place
when the report is complete; an --out that holds anything is refused unless --overwrite.
Threat model and figures: docs/privacy.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Optional, Sequence

from ldt.config import ConfigError
import ldt.launch.quiet
from ldt.storage.atomic import check_output, write_text
from ldt.tools.cli import Parser, count
from ldt.tools.cli import guarded


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="ldt-audit", description=__doc__.split("\n\n")[0],
               formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for ldt-train")
    p.add_argument("--out", default="outputs/audit",
                   help="folder for the runs and captures (must not exist yet, or be empty)")
    p.add_argument("--json", help="write the report here (default: OUT/audit.json)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out folder (and --json file) whole")
    p.add_argument("--steps", type=count(1), help="training steps of each victim run "
                   "(default: train.steps)")
    p.add_argument("--noise", default="1,2,4",
                   help="train.boundary_noise settings to measure besides 0, comma-separated "
                   "('' for none; default 1,2,4)")
    p.add_argument("--checkpoint", help="start the runs from this checkpoint (the weights the "
                   "cloud knows): a run folder with checkpoints/ or a checkpoints/step_N folder")
    p.add_argument("--cloud-text", help="the cloud's own text (default: the Python standard "
                   "library's sub-packages, none of the edge's default corpus)")
    p.add_argument("--shadow-tokens", type=count(1), default=24_576,
                   help="token vectors per shadow run: the probes' training set (default 24576)")
    p.add_argument("--clusters", type=count(2), default=64,
                   help="clusters of the unknown-weights attack (>= 2; default 64)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    return guarded("ldt-audit", lambda: _run(args))


def _run(args) -> int:
    from hydra.errors import HydraException

    from ldt.privacy.audit import AuditOptions, audit, format_report

    try:
        noise = tuple(float(x) for x in args.noise.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--noise {args.noise!r}: give numbers > 0, comma-separated "
                          "(e.g. 1,2,4)") from None
    if any(not math.isfinite(x) or x <= 0 for x in noise):
        raise ConfigError(f"--noise {args.noise}: give finite settings > 0 (0 is always "
                          "measured)")
    path = args.json or os.path.join(args.out, "audit.json")
    out = os.path.abspath(args.out)
    inside = os.path.commonpath([os.path.abspath(path), out]) == out
    check_output(args.out, flag="--out", overwrite=args.overwrite)  # before any run
    if not inside:
        check_output(path, flag="--json", overwrite=args.overwrite, file=True)
    opts = AuditOptions(overrides=args.overrides, out=args.out, steps=args.steps,
                        noise_levels=noise, checkpoint=args.checkpoint,
                        cloud_text=args.cloud_text, shadow_tokens=args.shadow_tokens,
                        clusters=args.clusters, overwrite=args.overwrite, json=path)
    try:
        report = audit(opts, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    except HydraException as exc:  # an override Hydra refuses: its first line, and options
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        raise ConfigError("; ".join(lines[:1] + (lines[2:lines.index("Config search path:")]
                                                  if "Config search path:" in lines else [])))
    print(format_report(report))
    if not inside:
        write_text(path, json.dumps(report, indent=1), flag="--json", overwrite=args.overwrite)
    print(f"ldt-audit: report written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
