"""What every ldt command line shares: one-line refusals and checked ranges.

:class:`Parser` is argparse with its error printed as one line (``PROG: what; see PROG
--help``, exit 2) instead of the usage block; :func:`count` and :func:`number` are argparse
types that check a flag's range as it is parsed (``--clusters 0`` is refused before anything
runs); :func:`guarded` turns a user's mistake found later (a :class:`~ldt.config.ConfigError`,
a file that cannot be read or written) into one line and exit 2. A traceback is left for
ldt's own bugs.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Callable, Optional

from ldt.config.errors import ConfigError, exception_chain, one_line
from ldt.config.layout import LayoutError
from ldt.storage.commit import out_of_space

EXIT_USAGE = 2


class Parser(argparse.ArgumentParser):
    """argparse, with a refused command line in one line."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: {message}; see {self.prog} --help\n")


def count(low: int = 1, high: Optional[int] = None, why: str = ""):
    """An argparse type: an integer in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low or (high is not None and value > high):
            span = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"{value} must be {span}{why}")
        return value

    parse.__name__ = "count"  # argparse names the type in its messages
    return parse


def number(low: float = 0.0, *, strict: bool = False):
    """An argparse type: a finite number >= low (> low when ``strict``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(
                f"{text} must be a finite number {'>' if strict else '>='} {low:g}")
        return value

    parse.__name__ = "number"
    return parse


def add_pricing_flags(p: argparse.ArgumentParser) -> None:
    """The flags ldt-plan and ldt-sim price alike: give ldt-sim the ones ldt-plan planned with
    (the train file's header names them; ldt-plan's printed command carries them to
    ldt-train as model overrides)."""
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="training dtype (default: the model's params_dtype)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="price megatron's sequence parallelism on stages of TP > 1 "
                        "(model.sequence_parallel=true)")
    p.add_argument("--no-flash", action="store_true",
                   help="price megatron's local attention (scores kept) on every stage, cuda "
                        "too (a cuda host without Transformer Engine: "
                        "model.transformer_impl=local); default: fused attention on cuda "
                        "stages, local on npu and cpu, as training runs")


class Stopped(BaseException):
    """SIGTERM or SIGHUP: unwinds like Ctrl-C, so every temporary output is removed."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop(signum, frame):
    raise Stopped(signum)


def guarded(prog: str, body: Callable[[], Optional[int]]) -> int:
    """``body()``'s exit status; a ConfigError (a refused input or output) or an OSError (a
    file that cannot be read or written) is printed as one line, exit status 2. Ctrl-C,
    SIGTERM and SIGHUP stop it with one line (exit 128 + signal) after the outputs being
    built are removed: what existed before is as it was. Libraries that wrap what happened
    inside them (``torch.distributed.checkpoint`` raises a CheckpointException around a
    Ctrl-C or a full disk in its reader or writer) are looked through."""
    import signal

    previous = {}
    for s in (signal.SIGTERM, signal.SIGHUP):
        try:
            previous[s] = signal.signal(s, _stop)
        except ValueError:  # not the main thread: the caller owns signals
            pass
    try:
        return int(body() or 0)
    except BaseException as exc:
        return _report(prog, exc)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _report(prog: str, exc: BaseException) -> int:
    """One line for a stop or a user's mistake found in ``exc`` (or behind it); anything else
    is re-raised: a traceback is for ldt's own bugs."""
    import signal

    chain = list(exception_chain(exc))
    for e in chain:
        if isinstance(e, KeyboardInterrupt):
            print(f"{prog}: interrupted (SIGINT); no output was left half-written",
                  file=sys.stderr)
            return 128 + signal.SIGINT
        if isinstance(e, Stopped):
            print(f"{prog}: stopped by {signal.Signals(e.signum).name}; no output was left "
                  "half-written", file=sys.stderr)
            return 128 + e.signum
    if isinstance(exc, SystemExit):
        raise exc
    if isinstance(exc, BrokenPipeError) and not exc.filename:
        # the reader of stdout is gone (``ldt-plan ... | head``): nothing to say, and no one
        # to say it to; stdout goes to /dev/null so the exit's flush does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    for e in chain:
        if isinstance(e, (ConfigError, LayoutError)):
            print(f"{prog}: {one_line(e)}", file=sys.stderr)
            return EXIT_USAGE
    for e in chain:
        if isinstance(e, OSError):
            where = f" {e.filename}" if getattr(e, "filename", None) else ""
            if out_of_space(e, "."):
                print(f"{prog}: no space left on the device{' of' + where if where else ''}; "
                      "what was being written was removed and what was there is as it was: "
                      "free space and run it again", file=sys.stderr)
            else:
                print(f"{prog}: cannot use{where}: {e.strerror or e}; check the path and its "
                      "permissions", file=sys.stderr)
            return EXIT_USAGE
    raise exc
