"""Recovery of an elastic run: from a lost host to the first step of the new world, and the work lost.

Three hosts (network namespaces, ``ldt.testing.hosts``), a torchrun elastic agent each
(``ldt.testing.elastic_agents``: the edge with the rendezvous, two 1-process cloud hosts),
``cluster=cpu_elastic`` with ``train.resume=auto``. Mid-interval after the first checkpoint
(``save_every - 1 + save_every // 2`` steps done) host 2 is lost, killed (every process) or cut
off (its link down: found only by ``train.comm_timeout_s``), and the run goes on without a
person on hosts 0 and 1. Measured on this machine's clock, per case:

* failure -> new world: until ldt rank 0 of the re-planned world records it (elastic.jsonl),
  and the phases that record has: that rank's process started (torchrun found the failure,
  formed its next rendezvous and started the workers), it planned the world (Python, Hydra,
  torch, the plan), its memory was checked (megatron-core's import and the estimate);
* failure -> first step: until the new world's first step starts (action_times.csv);
* failure -> first step done: until its metrics.csv row appears;
* work lost: the steps done after the checkpoint the new world resumed from (trained again),
  and the seconds from that checkpoint's step to the failure.

Each case is one run; ``save_every`` 2 and 8 show the lost work following the checkpoint
interval while the recovery time does not; the last case (``save_every`` 1000) has
``train.snapshot_dir``, a folder of host memory per host: each cloud rank's snapshot part
is also kept on the other cloud host, and the new world continues from the newest snapshot
it can join (docs/elastic.md). Prints a table and one JSON line (``elastic``).
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time

JOINED = re.compile(r"resuming from the snapshot of step (\d+) in host memory, joined")
NODES = [("edge_cpu", 1), ("cloud_cpu", 1), ("cloud_cpu", 1)]
COMM_TIMEOUT = 5
SNAPSHOTS = 1000  # save_every of the snapshot case: no disk checkpoint in reach
CASES = [("kill", 2), ("kill", 8), ("cut", 2), ("cut", 8), ("kill", SNAPSHOTS)]

# bench/RESULTS.md's summary rows (bench.summary): (figure, value, goal), templates over the JSON
SUMMARY = [
    ("a cloud host killed -> first step of the re-planned world done, `train.save_every` 2 / 8 "
     "(3 namespace hosts, comm_timeout_s {comm_timeout_s}; the new world formed)",
     "**{cases[0][to_first_step_done_s]:.1f} / {cases[1][to_first_step_done_s]:.1f} s** "
     "({cases[0][to_new_world_s]:.1f} / {cases[1][to_new_world_s]:.1f} s)", "-"),
    ("a cloud host cut off: the same",
     "**{cases[2][to_first_step_done_s]:.1f} / {cases[3][to_first_step_done_s]:.1f} s** "
     "({cases[2][to_new_world_s]:.1f} / {cases[3][to_new_world_s]:.1f} s)", "-"),
    ("steps lost per failure (trained again), save_every 2 / 8, kill",
     "{cases[0][lost_steps]} / {cases[1][lost_steps]} ({cases[0][lost_s]:.2f} / "
     "{cases[1][lost_s]:.2f} s)", "<= save_every"),
    ("a cloud host killed with `train.snapshot_dir` (a copy of each cloud rank's part on the "
     "other cloud host, save_every 1000): steps lost; -> first step of the new world done",
     "**{cases[4][lost_steps]}** steps; {cases[4][to_first_step_done_s]:.1f} s "
     "({cases[4][to_new_world_s]:.1f} s to the new world)", "<= 1 step, < 15 s"),
]
_ROW = ("| {{cases[{i}][failure]}} | {{cases[{i}][save_every]}} | "
        "{{cases[{i}][to_new_world_s]:.1f}} s | {{cases[{i}][to_first_step_s]:.1f}} s | "
        "{{cases[{i}][lost_steps]}} | {{cases[{i}][lost_s]:.2f}} |")
# figures documents quote from the latest run (bench.summary, tests/test_bench_summary.py)
QUOTES = [
    ("README.md", "a killed cloud host costs about {cases[0][to_first_step_s]:.0f} s here (to the "
     "re-planned world's first step; {cases[2][to_first_step_s]:.0f} s when its link is cut)"),
    ("docs/elastic.md", "Here: {cases[0][to_new_world_s]:.1f} s to the new world, "
     "{cases[0][to_first_step_s]:.1f} s to its first step"),
    ("docs/elastic.md", "Here (5 s timeout): {cases[2][to_new_world_s]:.1f} s to the new world, "
     "{cases[2][to_first_step_s]:.1f} s to its first step"),
    ("docs/elastic.md", "(`make bench`'s latest run, {recorded[date]:.10}, load average "
     "{recorded[load][before][0]:.1f} from other work)"),
    ("docs/elastic.md", "a step {cases[0][step_s]:.2f} s"),
] + [("docs/elastic.md", _ROW.format(i=i)) for i in range(5)] + [
    ("docs/elastic.md", "| 0 -> {cases[4][to_started_s]:.1f} s |"),
    ("docs/elastic.md", "| {cases[4][to_started_s]:.1f} -> {cases[4][to_planned_s]:.1f} s |"),
    ("docs/elastic.md", "| {cases[4][to_planned_s]:.1f} -> {cases[4][to_checked_s]:.1f} s |"),
    ("docs/elastic.md", "| {cases[4][to_checked_s]:.1f} -> {cases[4][to_first_step_s]:.1f} s |"),
    ("docs/elastic.md", "| {cases[4][to_first_step_s]:.1f} -> {cases[4][to_first_step_done_s]:.1f}"
     " s |")]


def _case(how: str, save_every: int, port: int) -> dict:
    from ldt.plan.calibrate import read_action_times
    from ldt.testing.elastic_agents import (ElasticAgents, RunFolder, resume_step, wait_first_step,
                                     wait_until)
    from ldt.testing.hosts import Hosts

    snapshots = save_every == SNAPSHOTS
    fail_after = 8 if snapshots else save_every - 1 + save_every // 2
    steps = fail_after + 12
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp, Hosts(len(NODES)) as net:
        run_dir = os.path.join(tmp, "run")
        run = RunFolder(run_dir)
        args = ["-m", "ldt.job.train", "cluster=cpu_elastic", f"run_dir={run_dir}",
                f"train.steps={steps}", f"train.save_every={save_every}",
                "train.num_microbatches=8", f"train.comm_timeout_s={COMM_TIMEOUT}",
                "train.resume=auto"]
        host_env = {}
        if snapshots:  # host memory of its own per host (namespaces share /dev/shm)
            args.append("train.snapshot_dir=${oc.env:LDT_BENCH_SNAPSHOTS}")
            for host in range(len(NODES)):
                os.makedirs(os.path.join(tmp, f"shm{host}"))
                host_env[host] = {"LDT_BENCH_SNAPSHOTS": os.path.join(tmp, f"shm{host}")}
        agents = ElasticAgents(net, NODES, args, min_nodes=2, port=port, cwd=root,
                               host_env=host_env)
        agents.start_all()
        seen: dict[int, float] = {}  # step -> when its row appeared (the first world)

        def reached(step):
            def check():
                now = time.monotonic()
                for s in run.rows():
                    seen.setdefault(s, now)
                return max(seen, default=-1) >= step
            return check
        try:
            wait_until(reached(fail_after), 300, f"step {fail_after}", agents, (0, 1))
            failed, failed_wall = time.monotonic(), time.time()
            if how == "kill":
                net.kill_host(2)
            else:
                net.set_link(2, up=False)
            wait_until(lambda: len(run.worlds()) >= 2, 180, "the new world", agents, (0, 1))
            last_before = run.last_step()  # before the new world rewrites metrics.csv
            world = run.worlds()[1]
            if snapshots:  # the step of the snapshot it joined, said by ldt rank 0
                wait_until(lambda: JOINED.search(agents.output(0)), 60,
                                    "the new world's join", agents, (0, 1))
                world = {**world, "resume": f"step_{int(JOINED.search(agents.output(0))[1])}"}
            resumed = resume_step(world)
            first_done = wait_first_step(run, world, last_before, 180, agents, (0, 1))
            codes = agents.wait((0, 1), 300)
        finally:
            net.kill_host(2)
        if codes != {0: 0, 1: 0}:
            raise RuntimeError(f"agents ended {codes}:\n{agents.output(0)[-3000:]}")
        first_start = min(r.step_start_s for r in read_action_times(run_dir)
                          if r.step == resumed + 1 and r.step_start_s is not None)
        rows = run.rows()
    step_s = sorted(float(r["step_time_s"]) for s, r in rows.items() if s > resumed + 1)
    phases = world["phases"]
    return {"failure": how, "save_every": save_every, "failed_after_step": last_before,
            "resumed_from_step": resumed,
            "to_started_s": phases["started"] - failed_wall,
            "to_planned_s": phases["planned"] - failed_wall,
            "to_checked_s": phases["checked"] - failed_wall,
            "to_new_world_s": world["time"] - failed_wall,
            "to_first_step_s": first_start - failed, "to_first_step_done_s": first_done - failed,
            "lost_steps": last_before - resumed, "lost_s": failed - seen[resumed],
            "step_s": step_s[len(step_s) // 2], "plan_after": world["plan"]}


def main() -> dict:
    from ldt.testing.hosts import unavailable

    reason = unavailable()
    if reason:
        print(f"skipped: {reason}")
        return {"bench": "elastic", "skipped": reason}
    rows = [_case(how, every, 29410 + i) for i, (how, every) in enumerate(CASES)]
    print(f"3 hosts (edge, 2 x cloud), cpu_elastic / gpt_tiny, 8 micro-batches, comm_timeout_s "
          f"{COMM_TIMEOUT}; host 2 lost mid-interval after the first checkpoint (save_every "
          f"{SNAPSHOTS}: after step 8, with snapshots)")
    print(f"{'failure':>8} {'save_every':>10} {'-> started s':>12} {'-> planned s':>12} "
          f"{'-> checked s':>12} {'-> world s':>10} {'-> 1st step s':>13} "
          f"{'-> done s':>9} {'lost steps':>10} {'lost s':>7} {'step s':>7}")
    for r in rows:
        print(f"{r['failure']:>8} {r['save_every']:>10} {r['to_started_s']:12.1f} "
              f"{r['to_planned_s']:12.1f} {r['to_checked_s']:12.1f} {r['to_new_world_s']:10.1f} "
              f"{r['to_first_step_s']:13.1f} {r['to_first_step_done_s']:9.1f} "
              f"{r['lost_steps']:>10} {r['lost_s']:7.2f} {r['step_s']:7.3f}")
    print(f"  new world: {rows[0]['plan_after']}")
    out = {"bench": "elastic", "comm_timeout_s": COMM_TIMEOUT,
           "cases": [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()
                      if k != "plan_after"} for r in rows]}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    sys.exit(0 if "skipped" not in main() else 0)
