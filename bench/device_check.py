"""``make device-check OUT=DIR``: what only a GPU can show, in one timed run (issue #41).

``tools/device_check.sh`` sets up the machine (carried wheels, ldt) and then runs this driver,
which runs every check of :data:`CHECKS` in turn, each in its own process (its own process
group) with its own time budget, under one global deadline. Each check writes one JSON line
to ``DIR/checks.jsonl`` as it ends: ``{"check", "status", "seconds", ...figures}`` with
status ``pass``, ``fail`` (it ran and its figures or tests say no, or it raised: ``error``
holds the last lines), ``timeout`` (killed at its budget; the next check still runs),
``skipped`` (the deadline left too little time) or ``rehearsed`` (the CPU rehearsal: the
logic ran, on the CPU, at tiny sizes). Its output goes to ``DIR/logs/<check>.log``. At the
end ``DIR/summary.md`` says in a few lines what passed and what was measured.

``LDT_DEVICE_CHECK_REHEARSE=1`` (or ``--rehearse``) runs every check with the CUDA stage on
the CPU and tiny sizes, so the whole path (driver, JSON lines, summary, timeouts, result
parsing) is proven on a machine without a GPU. The checks themselves are
:mod:`bench.device_checks`; docs/device_check.md says what each one measures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

DEADLINE_S = 520.0  # every check done by then (the whole command, with its set-up: < 9 min)
PASS, FAIL, TIMEOUT, SKIPPED, REHEARSED = "pass", "fail", "timeout", "skipped", "rehearsed"


@dataclass(frozen=True)
class Check:
    name: str
    budget_s: float  # killed after this, its line says "timeout"
    what: str


# In order; the budgets are the most each may take on one H100 (expected times: docs).
CHECKS = (
    Check("environment", 40, "device, torch / CUDA / megatron-core versions, the peak used"),
    Check("gpu_tests", 60, "pytest -m gpu: host staging of device tensors"),
    Check("mixed_edge_on_gpu", 60, "U-shape, edge on cuda, cloud on cpu: fp32 parity"),
    Check("mixed_cloud_on_gpu", 60, "U-shape, cpu edge feeding a cuda cloud stage: fp32 parity"),
    Check("mixed_bf16", 60, "U-shape, edge on cuda, bf16: parity and the loss falling"),
    Check("memory", 100, "ldt-memory's estimate against torch.cuda's peaks"),
    Check("speed", 150, "ldt against a plain megatron-core loop, ABBA; MFU"),
    Check("gpu_mutants", 130, "the gpu tests kill mutants of the host copies"),
)


def rehearsing() -> bool:
    return os.environ.get("LDT_DEVICE_CHECK_REHEARSE", "") not in ("", "0")


def run_check(check: Check, out_dir: str, timeout_s: float, rehearse: bool,
              module: str = "bench.device_checks") -> dict:
    """Run one check (``python -m MODULE NAME RESULT.json``) in its own process group; its
    JSON line (status, seconds, figures)."""
    os.makedirs(os.path.join(out_dir, "logs"), exist_ok=True)
    result_path = os.path.join(out_dir, "logs", f"{check.name}.json")
    if os.path.exists(result_path):
        os.remove(result_path)
    cmd = [sys.executable, "-m", module, check.name, result_path]
    env = dict(os.environ, LDT_DEVICE_CHECK_REHEARSE="1" if rehearse else "0",
               LDT_DEVICE_CHECK_OUT=os.path.abspath(out_dir), PYTHONWARNINGS="ignore")
    t0 = time.monotonic()
    with open(os.path.join(out_dir, "logs", f"{check.name}.log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return {"check": check.name, "status": TIMEOUT,
                    "seconds": round(time.monotonic() - t0, 1),
                    **{k: v for k, v in _read(result_path).items() if k != "status"},
                    "error": f"killed after its budget of {timeout_s:.0f} s",
                    "log_tail": _tail(log.name)}
    seconds = round(time.monotonic() - t0, 1)
    result = _read(result_path)
    if result.get("status") in (None, "partial"):
        result = {**result, "status": FAIL, "error": f"exited {code} without a result",
                  "log_tail": _tail(log.name)}
    elif code != 0 and result.get("status") in (PASS, REHEARSED):
        result = dict(result, status=FAIL, error=f"exited {code} after its result")
    return {"check": check.name, "status": result.pop("status", FAIL), "seconds": seconds,
            **result}


def _read(path: str) -> dict:
    """A check's result file: its final result, what it had saved so far (status
    ``partial``: a check that was stopped keeps its finished parts), or nothing."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _kill_group(proc: subprocess.Popen) -> None:
    """The check and everything it started (worlds of ranks, their forkserver)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def run_all(out_dir: str, checks=CHECKS, deadline_s: float = DEADLINE_S,
            started: Optional[float] = None, rehearse: bool = False,
            min_s: float = 10.0, module: str = "bench.device_checks") -> list[dict]:
    """Every check in turn, each within its budget and the global deadline (measured from
    ``started``, a ``time.time()``); one JSON line each, appended to ``checks.jsonl`` as it
    ends, and ``summary.md`` at the end."""
    os.makedirs(out_dir, exist_ok=True)
    started = time.time() if started is None else started
    lines = []
    path = os.path.join(out_dir, "checks.jsonl")
    open(path, "w").close()
    for check in checks:
        left = deadline_s - (time.time() - started)
        if left < min_s:
            line = {"check": check.name, "status": SKIPPED, "seconds": 0.0,
                    "error": f"the global deadline ({deadline_s:.0f} s) left {left:.0f} s"}
        else:
            line = run_check(check, out_dir, min(check.budget_s, left), rehearse, module)
        lines.append(line)
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
        print(f"device-check: {check.name}: {line['status']} ({line['seconds']} s)"
              + (f": {line['error'].splitlines()[-1]}" if line.get("error") else ""),
              flush=True)
    summary = summarize(lines, rehearse, time.time() - started)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(summary)
    print(summary, flush=True)
    return lines


def summarize(lines: list[dict], rehearse: bool, seconds: float) -> str:
    """A few lines: the device, each check's status and its figure that matters."""
    env = next((x for x in lines if x["check"] == "environment"), {})
    head = ("# device check (REHEARSAL on the CPU: no figure below is a GPU's)" if rehearse
            else "# device check")
    out = [head, "",
           f"device: {env.get('device', '?')}; torch {env.get('torch', '?')}, CUDA "
           f"{env.get('cuda', '?')}, megatron-core {env.get('megatron_core', '?')}, Python "
           f"{env.get('python', '?')}; peak used for MFU: {env.get('peak', '?')}", ""]
    for x in lines:
        out.append(f"- {x['check']}: **{x['status']}** ({x['seconds']} s) {_figure(x)}")
    counts = {s: sum(x["status"] == s for x in lines) for s in
              (PASS, FAIL, TIMEOUT, SKIPPED, REHEARSED)}
    out += ["", ", ".join(f"{n} {s}" for s, n in counts.items() if n)
            + f"; {seconds:.0f} s in all", ""]
    return "\n".join(out)


def _figure(x: dict) -> str:
    """The one figure of a check's line worth reading first."""
    keys = {"gpu_tests": ("passed", "failed", "skipped"),
            "mixed_edge_on_gpu": ("parity_max_abs_diff", "gpu_stage_estimate_over_peak"),
            "mixed_cloud_on_gpu": ("parity_max_abs_diff", "gpu_stage_estimate_over_peak"),
            "mixed_bf16": ("parity_max_abs_diff", "loss_fell", "gpu_stage_estimate_over_peak"),
            "memory": ("estimate_over_allocated", "estimate_over_reserved",
                       "estimate_over_resident"),
            "speed": ("ldt_over_megatron", "mfu_ldt", "mfu_megatron"),
            "gpu_mutants": ("killed", "mutants")}.get(x["check"], ())
    shown = [f"{k} {x[k]}" for k in keys if k in x]
    if x.get("error"):
        shown.append(x["error"].strip().splitlines()[-1][:200])
    return "; ".join(shown)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.device_check",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("out", help="folder for checks.jsonl, summary.md and logs/")
    parser.add_argument("--rehearse", action="store_true", default=rehearsing(),
                        help="the CUDA stage on the CPU, tiny sizes (LDT_DEVICE_CHECK_REHEARSE=1)")
    parser.add_argument("--only", nargs="*", help="run only these checks")
    parser.add_argument("--deadline", type=float, default=DEADLINE_S,
                        help="seconds from --started for every check (default %(default)s)")
    parser.add_argument("--started", type=float, default=None,
                        help="time.time() the whole command started (the set-up counts)")
    ns = parser.parse_args(argv)
    checks = [c for c in CHECKS if not ns.only or c.name in ns.only]
    lines = run_all(ns.out, checks, ns.deadline, ns.started, ns.rehearse)
    return 0 if all(x["status"] in (PASS, REHEARSED) for x in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
