"""`make bench`: run every bench/bench_*.py module's main() in turn, record its JSON line.

Each benchmark prints its own table and one JSON line with a "bench" key; this runner prints
them again together at the end and records each in ``bench/results/<name>.json`` (``name``:
the module without ``bench_``), the latest run replacing the one before: the JSON line as the
bench returned it, and when, on which commit, how long it took and the machine's load before
and after (:func:`record`). Then bench/RESULTS.md's summary table is generated again from those
files (``bench.summary``), so a published figure is the latest recorded run, and the documents
that quote a figure the new runs changed are named. A bench that was skipped (no namespaces,
the example's download missing) or failed records nothing and leaves its previous file.
``make bench ARGS='p2p calibration'`` runs some of them.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import pkgutil
import subprocess
import sys
import time
import traceback

import bench
from bench.common import machine_load

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _commit() -> dict:
    root = os.path.dirname(RESULTS.rstrip(os.sep))
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, timeout=10,
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                    cwd=root, timeout=10, capture_output=True, text=True,
                                    check=True).stdout.strip())
        return {"commit": sha, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def record(name: str, result: dict, seconds: float, load_before: dict, load_after: dict,
           folder: str = RESULTS) -> str | None:
    """Write ``folder/<name>.json`` for a bench's result; None (nothing written) when the
    bench was skipped. Returns the path."""
    if not isinstance(result, dict) or "bench" not in result or "skipped" in result:
        return None
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}.json")
    entry = {"module": f"bench.bench_{name}",
             "recorded": {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                          **_commit(), "seconds": round(seconds, 1),
                          "load": {"before": load_before["loadavg"],
                                   "after": load_after["loadavg"],
                                   "cpus": load_before["cpus"]}},
             "result": result}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(entry, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    return path


def main(argv=None) -> int:
    only = set(argv if argv is not None else sys.argv[1:])
    names = sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if m.name.startswith("bench_"))
    results, failed, recorded = [], [], []
    for name in names:
        short = name.removeprefix("bench_")
        if only and name not in only and short not in only:
            continue
        print(f"\n=== {name} ===", flush=True)
        t0, load = time.perf_counter(), machine_load()
        try:
            result = importlib.import_module(f"bench.{name}").main()
        except Exception:
            traceback.print_exc()
            failed.append(name)
            continue
        seconds = time.perf_counter() - t0
        results.append(result)
        path = record(short, result, seconds, load, machine_load())
        recorded += [os.path.relpath(path)] if path else []
        print(f"({name}: {seconds:.1f}s{'' if path else ', not recorded'})", flush=True)
    print("\n=== summary ===")
    for r in results:
        print(json.dumps(r))
    if recorded:
        from bench import summary

        print(f"recorded: {', '.join(recorded)}; bench/RESULTS.md's summary table generated "
              "again")
        stale = summary.main(["--write"])
        failed += ["documents quoting earlier figures (above)"] if stale else []
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
