"""Boundary transfer across a bandwidth-limited link: ldt's leader send vs megatron's lanes.

Two hosts (network namespaces, ``ldt.testing.hosts``), two stages of TP 2, one stage per host
(ranks 0-1 on host 0, 2-3 on host 1), started as torchrun starts them. Host 0's link is
limited with ``tbf``. Each repetition sends one activation [seq, mbs, hidden] from stage 0 to
stage 1 and waits until every rank of stage 1 has it (between two world barriers):

* megatron-core's own ``P2PCommunicator`` on ``initialize_model_parallel(2, 2)``: every TP rank
  sends its copy to its peer on the other host, so TP copies share the link;
* ldt's ``VtpCommunicator``: the leader sends one copy, stage 1's leader relays it to its
  TP peer over host 1's loopback, piece by piece as the pieces arrive (``ldt.boundary.relay``);
* *ldt whole*: the same, one piece (the relay starts when the whole message arrived).

All paths run in one world, alternating, on the same link; such a world runs per link (host
0 limited to 400 and to 2000 Mbit/s, and a bare veth), so the table shows where the boundary
transfer dominates. Prints a table and one JSON line (``link_bandwidth``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile

SHAPE = (1024, 1, 1024)  # seq, mbs, hidden: 4 MiB of fp32
RATE_MBIT = 400
FAST_MBIT = 2000  # a link where host 1's relay is a large share of the transfer
REPS = 12
TP = 2

# bench/RESULTS.md's summary rows (bench.summary): (figure, value, goal), templates over the JSON
SUMMARY = [
    ("boundary time ldt / megatron, TP 2 -> TP 2 on 2 namespace hosts, {mib} MiB, host 0's "
     "link at 400 / 2000 Mbit/s / unlimited (the relay in pieces; median of 12 alternating; "
     "400 Mbit/s quartiles)",
     "**{ratio:.3f}** / **{ratio_fast:.3f}** / {ratio_unlimited:.3f} "
     "({ratio_spread[q1]:.3f}-{ratio_spread[q3]:.3f}); {ldt_ms:.1f} / {megatron_ms:.1f} ms "
     "at 400", "<= 0.55"),
    ("the same, one piece (the relay before #27)",
     "{ratio_whole:.3f} / {ratio_fast_whole:.3f} / {ratio_whole_unlimited:.3f}", "-"),
]
# figures documents quote from the latest run (bench.summary, tests/test_bench_summary.py)
QUOTES = [
    ("docs/network.md", "400 Mbit/s: ldt {ldt_ms:.1f} ms, megatron's per-lane p2p "
     "{megatron_ms:.1f} ms, ratio {ratio:.3f}"),
    ("docs/network.md", "{ratio_fast:.3f} at 2000 Mbit/s ({ratio_whole:.3f} / "
     "{ratio_fast_whole:.3f} with the message relayed whole, same rounds)"),
    ("docs/network.md", "On an unlimited link {ratio_unlimited:.3f}"),
]


def _worker(out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    import ldt
    from bench.common import timed_step
    from ldt import patches
    from ldt.config import ClusterConfig, StageConfig
    from ldt.boundary.communicator import VtpCommunicator
    from ldt.topology.ranks import Topology

    dist.init_process_group("gloo")
    cfg = type("Cfg", (), dict(pipeline_dtype=torch.float32,
                                virtual_pipeline_model_parallel_size=None,
                                sequence_parallel=False, variable_seq_lengths=False,
                                use_ring_exchange_p2p=False, batch_p2p_comm=False,
                                batch_p2p_sync=False, mtp_standalone=False, timers=None))()
    patches.apply(["cpu_shims"])
    act = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))  # TP copies agree
    ps.initialize_model_parallel(tensor_model_parallel_size=TP, pipeline_model_parallel_size=2)
    mcomm = P2PCommunicator(ps.get_pipeline_model_parallel_group(), cfg)
    first = ps.is_pipeline_first_stage()
    topo = Topology.from_config(ClusterConfig(stages=[StageConfig("a", "cpu", TP),
                                                      StageConfig("b", "cpu", TP)]))
    state = ldt.initialize_vtp(topo, timeout_s=120)
    vcomm, whole = VtpCommunicator(cfg, state), VtpCommunicator(cfg, state)
    whole.piece_unit_bytes = 1 << 62  # every message one piece
    got = {}

    def megatron_step():
        if first:
            mcomm.send_forward(act, is_last_stage=False)
        else:
            got["m"] = mcomm.recv_forward(SHAPE, is_first_stage=False)

    def ldt_step(comm, key):
        if state.stage == 0:
            comm.send_forward(act, is_last_stage=False)
        else:
            got[key] = comm.recv_forward(SHAPE, is_first_stage=False)

    steps = {"megatron": megatron_step, "ldt": lambda: ldt_step(vcomm, "l"),
             "ldt whole": lambda: ldt_step(whole, "w")}
    for fn in steps.values():  # warm-up: connections, TCP windows
        timed_step(fn)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for i in range(REPS):
        for name in (list(steps) if i % 2 == 0 else list(steps)[::-1]):
            times[name].append(timed_step(steps[name]))
    if not first:  # every path delivered the same tensor to every rank of stage 1
        assert torch.equal(got["m"], got["l"]), "megatron and ldt received different data"
        assert torch.equal(got["m"], got["w"]), "megatron and ldt whole received different data"
    ldt.destroy_vtp()
    ps.destroy_model_parallel()
    patches.revert()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def _run(rate_mbit) -> dict:
    from bench.common import spread
    from ldt.testing.hosts import Hosts

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp, Hosts(2, rate_mbit=[rate_mbit, None]) as net:
        out = os.path.join(tmp, "times.json")
        job = net.start([sys.executable, "-m", "bench.bench_link_bandwidth", "--worker", out],
                        [TP, TP], cwd=root)
        results = job.wait(300)
        bad = [r for r in results if r.returncode != 0]
        if bad:
            raise RuntimeError(f"rank {bad[0].rank} failed ({bad[0].returncode}):\n"
                               f"{bad[0].stderr[-3000:]}")
        with open(out) as f:
            times = json.load(f)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"rate_mbit": rate_mbit, "megatron_s": med["megatron"], "ldt_s": med["ldt"],
            "ratio": med["ldt"] / med["megatron"], "whole_s": med["ldt whole"],
            "ratio_whole": med["ldt whole"] / med["megatron"],
            "pair_ratios": [a / b for a, b in zip(times["ldt"], times["megatron"])],
            "ratio_spread": spread(a / b for a, b in zip(times["ldt"], times["megatron"]))}


def main() -> dict:
    from bench.common import machine_load
    from ldt.testing.hosts import unavailable

    reason = unavailable()
    if reason:
        print(f"skipped: {reason}")
        return {"bench": "link_bandwidth", "skipped": reason}
    load = machine_load()
    rows = [_run(RATE_MBIT), _run(FAST_MBIT), _run(None)]
    nbytes = SHAPE[0] * SHAPE[1] * SHAPE[2] * 4
    print(f"one activation {SHAPE} fp32 ({nbytes / 2**20:.0f} MiB), stage 0 (host 0, TP {TP}) "
          f"-> stage 1 (host 1, TP {TP}); median of {REPS}, alternating")
    print(f"{'host 0 link':>14} {'megatron ms':>12} {'ldt ms':>9} {'ldt/megatron':>13} "
          f"{'megatron MB/s':>14} {'ldt MB/s':>9} {'whole ms':>9} {'whole/megatron':>15}")
    for r in rows:
        link = f"{r['rate_mbit']} Mbit/s" if r["rate_mbit"] else "unlimited"
        print(f"{link:>14} {r['megatron_s'] * 1e3:12.1f} {r['ldt_s'] * 1e3:9.1f} "
              f"{r['ratio']:13.3f} {TP * nbytes / r['megatron_s'] / 1e6:14.1f} "
              f"{nbytes / r['ldt_s'] / 1e6:9.1f} {r['whole_s'] * 1e3:9.1f} "
              f"{r['ratio_whole']:15.3f}")
    limited, fast, free = rows
    wire = nbytes / (RATE_MBIT * 1e6 / 8)
    print(f"  limited link: megatron moves {TP} copies ({TP * wire * 1e3:.0f} ms at line rate), "
          f"ldt one ({wire * 1e3:.0f} ms) plus host 1's loopback relay; ideal ratio 1/{TP}")
    out = {"bench": "link_bandwidth", "ratio": round(limited["ratio"], 3), "tp": TP,
           "rate_mbit": RATE_MBIT, "mib": round(nbytes / 2**20, 2),
           "megatron_ms": round(limited["megatron_s"] * 1e3, 1),
           "ldt_ms": round(limited["ldt_s"] * 1e3, 1),
           "ratio_unlimited": round(free["ratio"], 3),
           "ratio_whole": round(limited["ratio_whole"], 3),
           "ratio_fast": round(fast["ratio"], 3), "ratio_fast_whole": round(fast["ratio_whole"], 3),
           "ratio_spread": limited["ratio_spread"],
           "load": {"before": load["loadavg"], "after": machine_load()["loadavg"]},
           "ratio_whole_unlimited": round(free["ratio_whole"], 3)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        _worker(sys.argv[2])
    else:
        main()
