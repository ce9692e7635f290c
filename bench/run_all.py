"""`make bench`: run every bench/bench_*.py module's main() in turn and collect its JSON line.

Each benchmark prints its own table and one JSON line with a "bench" key; this runner prints
them again together at the end, so the report is easy to paste into bench/RESULTS.md.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
import time
import traceback

import bench


def main(argv=None) -> int:
    only = set(argv if argv is not None else sys.argv[1:])
    names = sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if m.name.startswith("bench_"))
    results, failed = [], []
    for name in names:
        if only and name not in only and name.removeprefix("bench_") not in only:
            continue
        print(f"\n=== {name} ===", flush=True)
        t0 = time.perf_counter()
        try:
            results.append(importlib.import_module(f"bench.{name}").main())
        except Exception:
            traceback.print_exc()
            failed.append(name)
        print(f"({name}: {time.perf_counter() - t0:.1f}s)", flush=True)
    print("\n=== summary ===")
    for r in results:
        print(json.dumps(r))
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
