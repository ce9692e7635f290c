"""What every step's snapshot in host memory costs (``train.snapshot_dir``, issue #43), measured
with ``ldt-train`` on hosts of their own CPU quota.

Both paths train ``conf/cluster/cpu_demo.yaml`` (U-shape, TP 1 / 2 / 1, 4 ranks) with the same
weights and batches; ``on`` snapshots every step into a fresh folder of ``/dev/shm``, ``off``
does not. A snapshot is taken after the step's optimizer step and agreement, outside
``step_time_s``, so the figure here is the wall time from one step's start to the next's
(``action_times.csv``'s ``step_start_s`` of the edge's leader, one clock per host): everything a
step costs, the snapshot's copy and whatever its background write takes from the host's cores.
Every rank runs on a host of its own with a quota of ``CPUS`` cores (``ldt.testing.hosts``), so
the background write competes with training for the same quota, as it competes with the host's
CPU work beside an accelerator, and never borrows an idle neighbour's core. Each host is a
node of its own (``GROUP_RANK``) with a snapshot folder of its own, so every cloud rank's part
is also sent to a rank of another cloud host, which writes it (docs/elastic.md): the copy's
sending and receiving is in the figure too. Runs in ABBA order
(off, on, on, off), the first step of each run left out. A finished run must leave nothing in
``/dev/shm`` (checked). Host memory: the most bytes the snapshot files held at once (sampled by
the file system's sizes every 20 ms), against what ``ldt-memory`` says for the same config.
"""

from __future__ import annotations

import csv
import os
import tempfile
import threading

from bench.common import emit, machine_load, median, spread

STEPS, ROUNDS = 12, 3
BASE = ["cluster=cpu_demo", f"train.steps={STEPS}", "train.tensorboard=false",
        "train.num_microbatches=4"]
RANKS = 4  # cpu_demo: TP 1 + 2 + 1
CPUS = float(os.environ.get("LDT_BENCH_SNAPSHOT_CPUS", "0.3"))
SHM = "/dev/shm"

SUMMARY = [
    ("step with a snapshot every step, each cloud part also copied to another host / without "
     "(cpu_demo, 4 ranks, a host of {cpus_per_rank} core each, wall time step start to step "
     "start, medians)", "**{ratio:.3f}**", "<= 1.05"),
    ("host memory of the snapshots, all 4 ranks (own parts, copies not counted): ldt-memory's "
     "estimate (3 x each rank's state) / the most the files held (sampled every 20 ms)",
     "{host_bytes_estimate} / {host_bytes_peak} bytes (**{host_bytes_ratio:.3f}**)",
     "bounds from above"),
]
QUOTES = [
    ("docs/elastic.md", "{step_s[off]:.3f} s without snapshots, {step_s[on]:.3f} s with a snapshot "
     "every step, **{ratio:.3f}**"),
    ("docs/elastic.md", "load average {recorded[load][before][0]:.1f} from other work"),
    ("docs/elastic.md", "at most {host_bytes_peak_mib:.2f} MiB for all 4 ranks, where the estimate "
     "says {host_bytes_estimate_mib:.2f} MiB ({host_bytes_ratio:.3f}"),
    ("docs/elastic.md", "part of {part[state_mib]:.2f} MiB (the average rank's state in cpu_demo) in its own "
     "process: copied to host memory in {part[copy_ms][refill]:.3f} ms ({part[copy_ms][fresh]:.3f} "
     "ms into fresh buffers"),
    ("docs/elastic.md", "written in {part[write_ms][crc32]:.2f} ms with its crc32 manifest "
     "({part[write_ms][sha256]:.2f} ms with sha256's)"),
]


def step_intervals(run_dir: str) -> list[float]:
    """Seconds from each step's start to the next's on the edge's leader (stage 0), the
    first step left out (warm-up)."""
    with open(os.path.join(run_dir, "action_times.csv")) as f:
        starts = sorted({(int(r["step"]), float(r["step_start_s"]))
                         for r in csv.DictReader(f) if r["stage"] == "0"})
    return [b[1] - a[1] for a, b in zip(starts[1:], starts[2:])]


def folder_bytes(folder: str) -> tuple[int, int]:
    """Bytes of the ranks' own parts, and of the copies kept for other hosts."""
    own = copies = 0
    for parent, _, files in os.walk(folder):
        for f in files:
            try:
                size = os.path.getsize(os.path.join(parent, f))
            except OSError:  # pruned while we looked
                continue
            if f"{os.sep}copies{os.sep}" in parent + os.sep:
                copies += size
            else:
                own += size
    return own, copies


class PeakBytes(threading.Thread):
    """The most bytes ``folder`` held at any of its samples (every 20 ms): the snapshots in
    host memory, as the file system counts them."""

    def __init__(self, folder: str):
        super().__init__(daemon=True)
        self.folder, self.peak, self.peak_copies = folder, 0, 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.02):
            own, copies = folder_bytes(self.folder)
            self.peak, self.peak_copies = max(self.peak, own), max(self.peak_copies, copies)


def run(tmp: str, name: str, snapshots: bool) -> tuple[list[float], int]:
    """A run's step intervals, and the most bytes its snapshots held in ``/dev/shm``."""
    from bench import common

    run_dir = os.path.join(tmp, name)
    extra, sampler = [], None
    if snapshots:  # a folder per host (the namespaces share /dev/shm; hosts do not)
        shm = tempfile.mkdtemp(prefix="ldt-bench-snapshot-", dir=SHM)
        for host in range(RANKS):
            os.makedirs(os.path.join(shm, f"host{host}"))
        extra = [f"train.snapshot_dir={shm}/host${{oc.env:GROUP_RANK}}"]
        sampler = PeakBytes(shm)
        sampler.start()
    try:
        common.train_on_hosts(run_dir, BASE + extra, RANKS, cpus=CPUS)
    finally:
        if snapshots:
            sampler.done.set()
            sampler.join()
            leftover = sum(len(files) for _, _, files in os.walk(shm))
            os.system(f"rm -rf {shm}")
            assert leftover == 0, f"a finished run left {leftover} snapshot files in {shm}"
    return step_intervals(run_dir), (sampler.peak, sampler.peak_copies) if sampler else (0, 0)


def estimated_bytes() -> int:
    """What ``ldt-memory`` says the run's ranks keep in host memory for snapshots, all ranks
    together: (2 kept + 1 being written) x each rank's state."""
    from omegaconf import OmegaConf

    from ldt import memory
    from ldt.job.hydra import compose
    from ldt.memory.report import SNAPSHOTS_HELD

    cfg = OmegaConf.to_container(compose(BASE), resolve=True)
    return sum(SNAPSHOTS_HELD * s.snapshot_bytes * len(s.ranks) for s in memory.estimate(cfg))


def part_costs(state_bytes: int, repeats: int = 50) -> dict:
    """What one rank's part costs the CPU per step, timed in this process on a state of
    ``state_bytes`` (fp32 tensors of 256, 64 and 16 KB): the copy of the state to host memory
    (``fresh``: new buffers every step, as before; ``refill``: the previous step's, as ldt does)
    and the write into ``/dev/shm`` with its manifest (crc32, as ldt does; sha256, a
    checkpoint's). Medians in ms."""
    import time

    import torch

    from ldt.storage import checkpoint_files, snapshot_files
    from ldt.training.snapshot import _host_copy, _writer

    n = state_bytes // 4
    sizes = [64 * 1024, 16 * 1024, 4 * 1024]  # big and small tensors, as a model's
    live, left = [], n
    while left > 0:
        live.append(torch.randn(min(sizes[len(live) % 3], left)))
        left -= live[-1].numel()

    def timed(fn) -> float:
        out = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            out.append((time.perf_counter() - start) * 1e3)
        return median(out)

    staged = {f"t{i}": t.clone() for i, t in enumerate(live)}
    copy = {"fresh": timed(lambda: [_host_copy(t, None, "") for t in live]),
            "refill": timed(lambda: [_host_copy(t, staged, f"t{i}") for i, t in enumerate(live)])}
    import io

    data = io.BytesIO()
    torch.save(staged, data)
    files = {"state.pt": data.getvalue()}
    root = tempfile.mkdtemp(prefix="ldt-bench-part-", dir=SHM)
    write = {}
    try:
        for algorithm in ("crc32", "sha256"):
            step = iter(range(10**6))
            write[algorithm] = timed(lambda: checkpoint_files.write_part_with(
                os.path.join(root, f"step_{next(step)}"), "rank_0", _writer(files), 0,
                algorithm=algorithm))
            snapshot_files.remove(root)
            os.makedirs(root, exist_ok=True)
    finally:
        os.system(f"rm -rf {root}")
    return {"state_mib": state_bytes / 2**20, "copy_ms": copy, "write_ms": write}


def main() -> dict:
    from ldt.testing.hosts import unavailable

    reason = unavailable()
    if reason or not os.path.isdir(SHM):
        print(f"skipped: {reason or SHM + ' missing'}")
        return {"bench": "snapshot", "skipped": reason or f"{SHM} missing"}
    load = machine_load()
    times: dict = {"off": [], "on": []}
    peak = peak_copies = 0
    with tempfile.TemporaryDirectory(prefix="ldt-bench-snapshot-") as tmp:
        for i in range(ROUNDS):
            for path in (("off", "on") if i % 2 == 0 else ("on", "off")):
                got, (held, copies) = run(tmp, f"{path}{i}", path == "on")
                times[path] += got
                peak, peak_copies = max(peak, held), max(peak_copies, copies)
    estimate = estimated_bytes()
    parts = part_costs(estimate // (3 * RANKS))  # the estimate: 3 generations per rank
    out = {"bench": "snapshot", "cpus_per_rank": CPUS, "host_bytes_peak": peak,
           "host_bytes_estimate": estimate, "host_bytes_ratio": estimate / peak,
           "host_bytes_peak_mib": peak / 2**20, "host_bytes_estimate_mib": estimate / 2**20,
           "copies_bytes_peak_mib": peak_copies / 2**20,
           "step_s": {p: median(v) for p, v in times.items()},
           "step_s_spread": {p: spread(v) for p, v in times.items()},
           "steps_measured": {p: len(v) for p, v in times.items()}, "part": parts}
    out["ratio"] = out["step_s"]["on"] / out["step_s"]["off"]
    print(f"step start to step start: with snapshots {out['step_s']['on'] * 1e3:.1f} ms / "
          f"without {out['step_s']['off'] * 1e3:.1f} ms = {out['ratio']:.3f} (one host of "
          f"{CPUS} core per rank); host memory, all ranks: {peak / 2**20:.2f} MiB at most in "
          f"the files, {estimate / 2**20:.2f} MiB estimated ({estimate / peak:.3f}); copies kept "
          f"for other hosts: {peak_copies / 2**20:.2f} MiB at most; one part of "
          f"{parts['state_mib']:.2f} MiB: copy {parts['copy_ms']['refill']:.2f} ms "
          f"(fresh buffers {parts['copy_ms']['fresh']:.2f}), write with crc32 "
          f"{parts['write_ms']['crc32']:.2f} ms (sha256 {parts['write_ms']['sha256']:.2f})")
    return emit(out, load_before=load)


if __name__ == "__main__":
    main()
