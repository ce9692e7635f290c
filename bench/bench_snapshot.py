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
(off, on, on, off, off, on, on, off), the first step of each run left out; the ratio of the
medians of all steps, and each round's own ratio (an off run and an on run next to each other),
whose range shows how far the machine moves the figure. Worlds of the same code differ here by
±15%, more than the goal's margin, so each round also runs one world with a snapshot every
second step (``train.snapshot_every=2``), where each step a snapshot runs beside is set against
its two neighbours in the same world (:func:`paired_ratios`). A finished run must leave nothing in
``/dev/shm`` (checked). CPU: each rank's CPU seconds per step over the same steps, as the
kernel counts them for its process (all threads, the writer's and gloo's included:
``bench.common.CpuSamples``), the sum of the ranks with / without snapshots. Host memory: the most bytes the snapshot files held at once (sampled by
the file system's sizes every 20 ms), against what ``ldt-memory`` says for the same config.
"""

from __future__ import annotations

import csv
import os
import tempfile
import threading

from bench.common import emit, machine_load, median, spread

STEPS, ROUNDS = 20, 4  # 18 intervals a run (10 before 2026-12-07)
PAIRED_STEPS = 40  # a world with a snapshot every second step: 18 steps beside one
BASE = ["cluster=cpu_demo", f"train.steps={STEPS}", "train.tensorboard=false",
        "train.num_microbatches=4"]
RANKS = 4  # cpu_demo: TP 1 + 2 + 1
CPUS = float(os.environ.get("LDT_BENCH_SNAPSHOT_CPUS", "0.3"))
SHM = "/dev/shm"
LARGE_MIB = 64  # a part where the bytes cost more than the calls (a real rank's: GBs)

SUMMARY = [
    ("step with a snapshot every step, each cloud part also copied to another host / without "
     "(cpu_demo, 4 ranks, a host of {cpus_per_rank} core each, wall time step start to step "
     "start, medians; in brackets each ABBA round's)", "**{ratio:.3f}** ({rounds_text})",
     "<= 1.05"),
    ("the same inside one world (drift between worlds left out): `train.snapshot_every=2`, each "
     "step a snapshot's copy and write run beside / the mean of its two neighbours without, "
     "median of {paired_spread[n]} (quartiles); each world's median",
     "**{paired_ratio:.3f}** ({paired_spread[q1]:.3f}-{paired_spread[q3]:.3f}); "
     "{paired_worlds_text}", "<= 1.05"),
    ("CPU per step, the 4 ranks' processes as the kernel counts them (all threads: the "
     "writer's and gloo's too), with / without snapshots, the same steps (medians of the runs); "
     "each rank's ratio; each ABBA round's",
     "**{cpu_ratio:.3f}** (ranks {cpu_ranks_text}; rounds {cpu_rounds_text})", "-"),
    ("host memory of the snapshots' files, all 4 ranks (own parts, copies not counted): "
     "ldt-memory's estimate of them (2 generations x each rank's part: its state and what its "
     "files add; the next is copied into the oldest's file, so no buffer is beside them) / "
     "the most the files held "
     "(sampled every 20 ms)",
     "{host_bytes_estimate} / {host_bytes_peak} bytes (**{host_bytes_ratio:.3f}**)",
     "bounds from above"),
]
QUOTES = [
    ("docs/elastic.md", "{step_s[off]:.3f} s without snapshots, {step_s[on]:.3f} s with a snapshot "
     "every step, **{ratio:.3f}**"),
    ("docs/elastic.md", "load average {recorded[load][before][0]:.1f} from other work"),
    ("docs/elastic.md", "each ABBA round's own ratio {rounds_text}"),
    ("docs/elastic.md", "each step a snapshot's copy and write run beside against the mean of "
     "its two neighbours: **{paired_ratio:.3f}** (quartiles {paired_spread[q1]:.3f}-"
     "{paired_spread[q3]:.3f}, {paired_spread[n]} steps; each world's median "
     "{paired_worlds_text})"),
    ("docs/elastic.md", "the CPU the 4 ranks' processes used per step, as the kernel counts "
     "it: **{cpu_ratio:.3f}** with / without (rounds {cpu_rounds_text})"),
    ("docs/elastic.md", "and {copies_bytes_peak_mib:.2f} MiB of copies kept\nfor other hosts"),
    ("docs/elastic.md", "at most {host_bytes_peak_mib:.2f} MiB for all 4 ranks, where the estimate "
     "says {host_bytes_estimate_mib:.2f} MiB ({host_bytes_ratio:.3f}"),
    ("docs/elastic.md", "part of {part[state_mib]:.2f} MiB in {part[tensors]} tensors (the average "
     "rank's state in cpu_demo) in its own process: copied into its oldest generation's file "
     "and put in place with its crc32 manifest in {part[mapped_ms]:.2f} ms; before, copied "
     "into a flat buffer in {part[copy_ms]:.3f} ms and the buffer written over the oldest "
     "generation in {part[write_ms][flat]:.2f} ms ({part[write_ms][new_files]:.2f} ms into new "
     "files, {part[write_ms][torch_save]:.2f} ms pickled by torch.save"),
    ("docs/elastic.md", "a part of {part_large[state_mib]:.0f} MiB is copied into its oldest "
     "generation's file in {part_large[mapped_ms]:.1f} ms; before, copied into a buffer in "
     "{part_large[copy_ms]:.1f} ms and written over its oldest generation in "
     "{part_large[write_ms][flat]:.1f} ms, into new files in "
     "{part_large[write_ms][new_files]:.1f} ms"),
]


def starts_by_step(run_dir: str) -> dict[int, float]:
    """Each step's start on the edge's leader (stage 0; ``perf_counter``, one clock for the
    machine's processes)."""
    with open(os.path.join(run_dir, "action_times.csv")) as f:
        return {int(r["step"]): float(r["step_start_s"])
                for r in csv.DictReader(f) if r["stage"] == "0"}


def step_starts(run_dir: str) -> list[float]:
    """:func:`starts_by_step` in step order, the first step left out (warm-up)."""
    return [start for _, start in sorted(starts_by_step(run_dir).items())[1:]]


def paired_ratios(run_dir: str) -> list[float]:
    """In a world that snapshots after every second step (``train.snapshot_every=2``: after
    steps 1, 3, ...), each step that a snapshot's copy and write run beside (2, 4, ...: start
    to next start) against the mean of its two neighbours, which none runs beside: the
    snapshot's cost measured inside one world, where the drift from one world to the next
    (±15% here) does not enter."""
    start = starts_by_step(run_dir)
    span = {s: start[s + 1] - start[s] for s in start if s + 1 in start}
    return [span[s] / ((span[s - 1] + span[s + 1]) / 2) for s in sorted(span)
            if s >= 2 and s % 2 == 0 and s + 1 in span]


def step_intervals(run_dir: str) -> list[float]:
    """Seconds from each step's start to the next's (:func:`step_starts`)."""
    starts = step_starts(run_dir)
    return [b - a for a, b in zip(starts, starts[1:])]


def cpu_per_step(run_dir: str, samples) -> list[float]:
    """Each rank's CPU seconds per step (the kernel's count, :class:`bench.common.CpuSamples`)
    from the edge's second step start to its last: the same steps as :func:`step_intervals`."""
    starts = step_starts(run_dir)
    return [samples.between(rank, starts[0], starts[-1]) / (len(starts) - 1)
            for rank in range(RANKS)]


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


def run(tmp: str, name: str, snapshots: bool,
        every: int = 1) -> tuple[list[float], tuple, list[float], str]:
    """A run's step intervals, the most bytes its snapshots held in ``/dev/shm`` (own parts,
    copies), each rank's CPU seconds per step (:func:`cpu_per_step`) and its folder. ``every``:
    ``train.snapshot_every`` (then :data:`PAIRED_STEPS` steps)."""
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
    if every > 1:
        extra += [f"train.snapshot_every={every}", f"train.steps={PAIRED_STEPS}"]
    args = [a for a in BASE if not (every > 1 and a.startswith("train.steps="))] + extra
    cpu: list = []
    try:
        common.train_on_hosts(run_dir, args, RANKS, cpus=CPUS, cpu=cpu)
    finally:
        if snapshots:
            sampler.done.set()
            sampler.join()
            leftover = sum(len(files) for _, _, files in os.walk(shm))
            os.system(f"rm -rf {shm}")
            assert leftover == 0, f"a finished run left {leftover} snapshot files in {shm}"
    return (step_intervals(run_dir), (sampler.peak, sampler.peak_copies) if sampler else (0, 0),
            cpu_per_step(run_dir, cpu[0]), run_dir)


def estimated_bytes() -> int:
    """What ``ldt-memory`` says the run's ranks keep in snapshot files in host memory, all
    ranks together: 2 generations x each rank's part (``SNAPSHOTS_HELD``: the state is copied
    into the oldest generation's file, mapped, so there is no buffer beside the files)."""
    from omegaconf import OmegaConf

    from ldt import memory
    from ldt.job.hydra import compose
    from ldt.storage.snapshot_files import GENERATIONS

    cfg = OmegaConf.to_container(compose(BASE), resolve=True)
    return sum(GENERATIONS * s.snapshot_bytes * len(s.ranks) for s in memory.estimate(cfg))


def part_costs(state_bytes: int, tensors: int = 100, repeats: int = 50) -> dict:
    """What one rank's part costs the CPU per step, timed in this process on a state of
    ``state_bytes`` in ``tensors`` fp32 tensors (a cpu_demo cloud rank holds 97: weights,
    biases and norms, each with its fp32 main copy and two moments), into ``/dev/shm`` with
    its crc32 manifest: ``mapped_ms`` as ldt does, the copy and the write in one (the state
    copied into the file of the part's oldest generation through its kept mapping,
    :class:`ldt.storage.snapshot_files.MappedFiles`, checksums from memory, put in place);
    ``copy_ms``, the copy into a flat host buffer (:mod:`ldt.training.flat_state`) that the
    writes of ``write_ms`` then write: ``flat`` as before the mapping (2026-12-07: the buffer
    written over the part's oldest generation), ``new_files`` before that (into new files,
    the oldest generation removed after) and ``torch_save`` before that (the tensors pickled
    by ``torch.save``, the manifest read back from the files). Medians in ms."""
    import io
    import json
    import time

    import torch

    from ldt.storage import checkpoint_files, snapshot_files
    from ldt.training.flat_state import FlatState

    weights = [4.0, 1.0, 0.25]  # a weight, a bias, a norm
    unit = state_bytes / 4 / sum(weights[i % 3] for i in range(tensors))
    live = {f"t{i}": torch.randn(max(1, int(unit * weights[i % 3]))) for i in range(tensors)}
    flat = FlatState(live)

    def timed(fn) -> float:
        out = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            out.append((time.perf_counter() - start) * 1e3)
        return median(out)

    def torch_save(folder: str) -> None:
        data = io.BytesIO()
        torch.save(flat.views, data)
        with open(os.path.join(folder, "state.pt"), "wb") as f:
            f.write(data.getvalue())

    def new_files(root: str, step: int, state, meta: bytes) -> None:
        part = {"state.bin": state, "meta.json": meta}
        checkpoint_files.write_part_files(checkpoint_files.step_dir(root, step), "rank_0", part,
                                          algorithm=snapshot_files.ALGORITHM)
        snapshot_files.prune(root, "rank_0")

    meta = json.dumps({"index": flat.index}).encode()
    root = tempfile.mkdtemp(prefix="ldt-bench-part-", dir=SHM)
    step = iter(range(10**6))
    mapped = snapshot_files.MappedFiles()

    def in_place(tmp: str) -> dict:
        into = mapped.of(os.path.join(tmp, "state.bin"), flat.buffer.numel(),
                         lambda buffer: FlatState(live, buffer))
        into.fill(live)
        with open(os.path.join(tmp, "meta.json"), "wb") as f:
            f.write(meta)
        return {"state.bin": into.bytes(), "meta.json": meta}
    try:
        mapped_ms = timed(lambda: snapshot_files.write_in_place(
            root, next(step), "rank_0", in_place, flat.buffer.numel() + len(meta)))
        mapped.close()
        write = {"flat": timed(lambda: snapshot_files.write(
                     root, next(step), "rank_0", {"state.bin": flat.bytes(), "meta.json": meta})),
                 "new_files": timed(lambda: new_files(root, next(step), flat.bytes(), meta)),
                 "torch_save": timed(lambda: checkpoint_files.write_part_with(
                     os.path.join(root, f"step_{next(step)}"), "rank_0", torch_save, 0,
                     algorithm="crc32"))}
    finally:
        os.system(f"rm -rf {root}")
    return {"state_mib": flat.buffer.numel() / 2**20, "tensors": tensors,
            "mapped_ms": mapped_ms, "copy_ms": timed(lambda: flat.fill(live)),
            "write_ms": write}


def main() -> dict:
    from ldt.storage.snapshot_files import GENERATIONS
    from ldt.testing.hosts import unavailable

    reason = unavailable()
    if reason or not os.path.isdir(SHM):
        print(f"skipped: {reason or SHM + ' missing'}")
        return {"bench": "snapshot", "skipped": reason or f"{SHM} missing"}
    load = machine_load()
    times: dict = {"off": [], "on": []}
    cpu: dict = {"off": [], "on": []}  # per run: each rank's CPU seconds per step
    rounds, cpu_rounds = [], []  # each round's on / off: step medians; all ranks' CPU
    paired: list = []  # each round's world with a snapshot every second step: its ratios
    peak = peak_copies = 0
    with tempfile.TemporaryDirectory(prefix="ldt-bench-snapshot-") as tmp:
        for i in range(ROUNDS):
            this = {}
            for path in (("off", "on") if i % 2 == 0 else ("on", "off")):
                got, (held, copies), used, _ = run(tmp, f"{path}{i}", path == "on")
                times[path] += got
                cpu[path].append(used)
                this[path] = median(got), sum(used)
                peak, peak_copies = max(peak, held), max(peak_copies, copies)
            rounds.append(this["on"][0] / this["off"][0])
            cpu_rounds.append(this["on"][1] / this["off"][1])
            paired.append(paired_ratios(run(tmp, f"paired{i}", True, every=2)[3]))
    cpu_ms = {p: [median(used[r] for used in runs) * 1e3 for r in range(RANKS)]
              for p, runs in cpu.items()}
    estimate = estimated_bytes()
    parts = part_costs(estimate // (GENERATIONS * RANKS))  # the estimate: 2 generations a rank
    large = part_costs(LARGE_MIB << 20, repeats=20)  # where the bytes, not the calls, cost
    out = {"bench": "snapshot", "cpus_per_rank": CPUS, "host_bytes_peak": peak,
           "host_bytes_estimate": estimate, "host_bytes_ratio": estimate / peak,
           "host_bytes_peak_mib": peak / 2**20, "host_bytes_estimate_mib": estimate / 2**20,
           "copies_bytes_peak_mib": peak_copies / 2**20,
           "step_s": {p: median(v) for p, v in times.items()},
           "step_s_spread": {p: spread(v) for p, v in times.items()},
           "steps_measured": {p: len(v) for p, v in times.items()}, "part": parts,
           "part_large": large,
           "round_ratios": rounds, "rounds_text": " / ".join(f"{r:.3f}" for r in rounds),
           "cpu_ms_per_step": cpu_ms,
           "cpu_ratio": sum(cpu_ms["on"]) / sum(cpu_ms["off"]),
           "cpu_rank_ratios": [a / b for a, b in zip(cpu_ms["on"], cpu_ms["off"])],
           "cpu_round_ratios": cpu_rounds,
           "paired_ratio": median(r for world in paired for r in world),
           "paired_spread": spread([r for world in paired for r in world]),
           "paired_worlds": [median(world) for world in paired],
           "paired_worlds_text": " / ".join(f"{median(world):.3f}" for world in paired),
           "cpu_rounds_text": " / ".join(f"{r:.3f}" for r in cpu_rounds)}
    out["ratio"] = out["step_s"]["on"] / out["step_s"]["off"]
    out["cpu_ranks_text"] = " / ".join(f"{r:.3f}" for r in out["cpu_rank_ratios"])
    print(f"step start to step start: with snapshots {out['step_s']['on'] * 1e3:.1f} ms / "
          f"without {out['step_s']['off'] * 1e3:.1f} ms = {out['ratio']:.3f}, rounds "
          f"{out['rounds_text']} (one host of "
          f"{CPUS} core per rank); a snapshot every second step, the step beside one / its "
          f"neighbours: {out['paired_ratio']:.3f} (worlds {out['paired_worlds_text']}); "
          f"CPU per step, all ranks: {sum(cpu_ms['on']):.1f} / "
          f"{sum(cpu_ms['off']):.1f} ms = {out['cpu_ratio']:.3f} (ranks "
          f"{out['cpu_ranks_text']}; rounds {out['cpu_rounds_text']}); host memory, all ranks: "
          f"{peak / 2**20:.2f} MiB at most in "
          f"the files, {estimate / 2**20:.2f} MiB estimated ({estimate / peak:.3f}); copies kept "
          f"for other hosts: {peak_copies / 2**20:.2f} MiB at most; one part of "
          f"{parts['state_mib']:.2f} MiB in {parts['tensors']} tensors: copied into its file "
          f"{parts['mapped_ms']:.2f} ms; before, copy "
          f"{parts['copy_ms']:.3f} ms, write {parts['write_ms']['flat']:.2f} ms (new files "
          f"{parts['write_ms']['new_files']:.2f}, torch.save's "
          f"{parts['write_ms']['torch_save']:.2f}); one of {LARGE_MIB} MiB: copied into "
          f"its file {large['mapped_ms']:.1f} ms, before copy {large['copy_ms']:.1f} + write "
          f"{large['write_ms']['flat']:.1f} ms (new files {large['write_ms']['new_files']:.1f})")
    return emit(out, load_before=load)


if __name__ == "__main__":
    main()
