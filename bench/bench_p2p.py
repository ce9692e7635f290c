"""Boundary transfer: ldt's leader send (fan-out, or relayed by the receiving leader) vs
megatron-core's per-TP-rank p2p, every rank on a host of its own CPU quota.

Two stages of TP 2 (uniform, so megatron's own path can run), 4 gloo processes, ONE world
holding both: megatron-core's groups (``initialize_model_parallel(2, 2)``, its
``P2PCommunicator`` on its pipeline group) and ldt's (``initialize_vtp``, ``VtpCommunicator``s),
all built before anything is timed. Each rank runs on its own host (``ldt.testing.hosts``: a
network namespace, started as torchrun starts ranks) with a CPU quota of ``CPUS`` cores, like a
device of its own: where all ranks shared this machine's 2 cores, a rank with nothing to do
lent its core to the busy ones, and ldt's fan-out (one sending process busy, the other idle)
was timed against megatron's two busy senders with more CPU than they had (issue #45: 0.565 /
0.681 at small sizes). Paths, alternating (ABBA) after discarded warm-up rounds:

* *megatron*: every TP rank of stage 0 sends its own copy to its peer in stage 1;
* *fanout* (``cluster.boundary_fanout=always``): each rank of stage 0 sends its own copy to
  one rank of stage 1, TP rank i to TP rank i (``ldt.topology.transport.fanout_sources``; until
  2026-12-05 stage 0's leader sent both copies and its second rank idled), no relay;
* *relay* (``never``): one copy to stage 1's leader, which relays it in pieces as they arrive
  (``ldt.boundary.relay``);
* *whole*: the relay unpipelined (every message one piece, as before issue #27);
* *raw_megatron*, *raw_fanout*: the fan-out's transfers by bare ``dist.isend`` / ``irecv``,
  TP rank i to TP rank i, on megatron's pipeline group and on ldt's fan-out group (no code of
  either above gloo): their ratio is what the group alone makes of a gap.

``auto`` picks per message from the nodes: here every rank is a node of its own, so it is the
relay for every size measured (all above ``ldt.topology.transport.CROSS_NODE_FANOUT_BYTES``); on
one node it is fan-out. A round times about ``ROUND_BYTES`` of transfers back to back (each
waited, as a pipeline waits one per micro-batch) between two world barriers; the figure is the
median of the per-round ratios path / megatron, with quartiles, and each path's median. Every
transfer sends a different tensor (``base + k``), and every rank of stage 1 checks every tensor
it received, on every path. Prints a table and one JSON line (with the machine's load before and
after).
``--units 32768,131072`` adds one relay path per piece unit.
"""

from __future__ import annotations

import argparse
import os

SIZES = [(128, 1, 256), (512, 1, 512), (1024, 2, 1024), (2048, 2, 2048)]  # seq, mbs, hidden
REPS, WARMUP = 31, 2
ROUND_BYTES = 32 * 2**20  # a round moves about this much: small messages back to back
WHOLE = 1 << 62  # a piece unit no message reaches: one piece
CPUS = float(os.environ.get("LDT_BENCH_P2P_CPUS", "0.3"))  # per rank (host); see bench.common
PYTHON_CALLS, PYTHON_ROUNDS = 500, 4  # the per-call Python cost, gloo stubbed (_python_cost)

# bench/RESULTS.md's summary rows (bench.summary): (figure, value, goal), templates over the JSON
SUMMARY = [
    ("boundary transfer / megatron's per-TP-rank p2p, TP 2 -> TP 2, 0.12 / 1 / 8 / 32 MiB, one "
     "rank per host of {cpus_per_rank} core; fan-out (`boundary_fanout=always`, one node's "
     "choice), median of 31 per-round ratios",
     "**{ratios_fanout[128x1x256]:.3f} / {ratios_fanout[512x1x512]:.3f} / "
     "{ratios_fanout[1024x2x1024]:.3f} / {ratios_fanout[2048x2x2048]:.3f}** (32 MiB quartiles "
     "{ratio_spread[2048x2x2048][fanout][q1]:.3f}-{ratio_spread[2048x2x2048][fanout][q3]:.3f})",
     "<= 1.05"),
    ("the same, the relay in pieces (`never`: one copy per boundary, what crosses between "
     "nodes) / one piece (the relay before #27)",
     "{ratios_relay[128x1x256]:.3f} / {ratios_relay[512x1x512]:.3f} / "
     "{ratios_relay[1024x2x1024]:.3f} / {ratios_relay[2048x2x2048]:.3f}; whole "
     "{ratios_whole[128x1x256]:.3f} / {ratios_whole[512x1x512]:.3f} / "
     "{ratios_whole[1024x2x1024]:.3f} / {ratios_whole[2048x2x2048]:.3f}", "-"),
    ("the same transfers by bare gloo isend / irecv (no ldt, no megatron code): on ldt's "
     "fan-out group / on megatron's pipeline group, median of per-round ratios",
     "{ratios_raw[128x1x256]:.3f} / {ratios_raw[512x1x512]:.3f} / {ratios_raw[1024x2x1024]:.3f} "
     "/ {ratios_raw[2048x2x2048]:.3f}", "-"),
    ("each path's own Python work per call, gloo's isend and irecv stubbed (0.12 MiB, the same "
     "hosts; a send on stage 0, a receive on stage 1, mean of its two ranks)",
     "megatron {python_us[send][megatron]:.0f} / {python_us[recv][megatron]:.0f} us, fan-out "
     "{python_us[send][fanout]:.0f} / {python_us[recv][fanout]:.0f} us", "-"),
]


def transfers_per_round(nbytes: int) -> int:
    """Transfers timed together in one round: a lone transfer of a small message takes ~1 ms,
    and the two world barriers around a round wake 4 processes with a spread of the same
    size (measured: per-round ratios 0.17-7.1 at 0.12 MiB with one transfer per round)."""
    return max(1, min(64, ROUND_BYTES // nbytes))


def _worker(rank, world, sizes, reps: int, warmup: int, units) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    import ldt
    from bench.common import abba, timed_step
    from ldt import patches
    from ldt.boundary.communicator import VtpCommunicator
    from ldt.config import ClusterConfig, StageConfig
    from ldt.topology.ranks import Topology
    from ldt.topology.routes import FORWARD

    cfg = type("Cfg", (), dict(pipeline_dtype=torch.float32,
                                virtual_pipeline_model_parallel_size=None,
                                sequence_parallel=False, variable_seq_lengths=False,
                                use_ring_exchange_p2p=False, batch_p2p_comm=False,
                                batch_p2p_sync=False, mtp_standalone=False, timers=None))()
    # always: the fan-out groups exist; the relay paths set their communicator to never
    topo = Topology.from_config(ClusterConfig(stages=[StageConfig("a", "cpu", 2),
                                                      StageConfig("b", "cpu", 2)],
                                              boundary_fanout="always"))
    patches.apply(["cpu_shims"])
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    pp_group = ps.get_pipeline_model_parallel_group()  # megatron's (ldt's replaces the global)
    mcomm = P2PCommunicator(pp_group, cfg)
    first = ps.is_pipeline_first_stage()
    state = ldt.initialize_vtp(topo, timeout_s=300)
    if (state.stage == 0) != first:
        raise RuntimeError("megatron's and ldt's rank maps differ")
    vcomms = {"fanout": VtpCommunicator(cfg, state)}
    # the same transfers by bare gloo isend / irecv, TP rank i to TP rank i, on megatron's
    # pipeline group and on ldt's fan-out group: how much of a gap is the group's, not the code's
    fan_route = state.plan.route(0, 1, FORWARD)
    raw_groups = {"raw_megatron": pp_group,
                  "raw_fanout": state.named_groups[fan_route.fanout_group]}
    peer = rank + 2 if first else rank - 2
    for name, unit in ([("relay", None), ("whole", WHOLE)]
                       + [(f"relay unit {u}", u) for u in units]):
        vcomms[name] = VtpCommunicator(cfg, state)
        vcomms[name].boundary_fanout = "never"
        vcomms[name].piece_unit_bytes = unit or vcomms[name].piece_unit_bytes
    rows, sent = [], [0]  # transfers so far: the k of the next tensor, alike on every rank
    for shape in sizes:
        base = torch.randn(shape, generator=torch.Generator().manual_seed(len(rows)))
        burst = transfers_per_round(base.numel() * 4)

        def run(path):
            comm = mcomm if path == "megatron" else vcomms.get(path)
            ks = range(sent[0], sent[0] + burst)
            sent[0] += burst
            outgoing = [base + k for k in ks] if first else []  # made before the clock
            got = []

            def step():
                for tensor in outgoing:
                    if comm is None:
                        dist.isend(tensor, dst=peer, group=raw_groups[path]).wait()
                    else:
                        comm.send_forward(tensor, is_last_stage=False)
                for _ in range(0 if first else burst):
                    if comm is None:
                        got.append(torch.empty(shape))
                        dist.irecv(got[-1], src=peer, group=raw_groups[path]).wait()
                    else:
                        got.append(comm.recv_forward(shape, is_first_stage=False))

            seconds = timed_step(step) / burst
            for k, tensor in zip(ks, got):  # every copy, after the clock
                if not torch.equal(tensor.detach(), base + k):
                    raise RuntimeError(f"{path}: rank {rank} received a wrong tensor "
                                       f"(transfer {k}, shape {shape})")
            if not first and len(got) != burst:
                raise RuntimeError(f"{path}: rank {rank} received {len(got)} of {burst}")
            return seconds

        rounds = abba(run, ["megatron", *vcomms, *raw_groups], reps, warmup)
        rows.append({"shape": list(shape), "bytes": base.numel() * 4, "burst": burst,
                     "rounds": rounds})
    checked = torch.tensor([sent[0] if not first else 0])
    dist.all_reduce(checked)  # what stage 1's two ranks checked together
    python_us = _python_cost({"megatron": mcomm, "fanout": vcomms["fanout"]}, first, sizes[0])
    patches.revert()
    ldt.destroy_vtp()
    ps.destroy_model_parallel()
    return {"rows": rows, "checked": int(checked), "python_us": python_us}


def _python_cost(comms: dict, first: bool, shape, calls: int = PYTHON_CALLS) -> dict:
    """Microseconds one ``send_forward`` (stage 0) / ``recv_forward`` (stage 1) costs on this
    rank with gloo's isend and irecv stubbed out (nothing moves): each path's own Python work
    (megatron's p2p; ldt's route lookup, transport decision, handles). Paths alternate, the
    median of ``PYTHON_ROUNDS``; every rank stubs alike, so no message is left posted."""
    import time

    import torch
    import torch.distributed as dist

    class Done:
        def wait(self, *args):
            return True

        def is_completed(self):
            return True

    real = dist.isend, dist.irecv
    dist.isend = dist.irecv = lambda *args, **kwargs: Done()
    try:
        tensor, took = torch.randn(shape), {name: [] for name in comms}
        for i in range(PYTHON_ROUNDS):
            for name in (list(comms) if i % 2 == 0 else list(comms)[::-1]):
                comm, start = comms[name], time.perf_counter()
                for _ in range(calls):
                    if first:
                        comm.send_forward(tensor, is_last_stage=False)
                    else:
                        comm.recv_forward(shape, is_first_stage=False)
                took[name].append((time.perf_counter() - start) / calls * 1e6)
    finally:
        dist.isend, dist.irecv = real
    dist.barrier()
    return {name: sorted(t)[len(t) // 2] for name, t in took.items()}


def main(argv=None) -> dict:
    from bench.common import emit, machine_load, run_on_hosts, spread
    from ldt.testing.hosts import unavailable

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", default="", help="comma-separated piece units to add")
    units = [int(u) for u in parser.parse_args(argv or []).units.split(",") if u]
    reason = unavailable()
    if reason:
        print(f"skipped: {reason}")
        return {"bench": "p2p_boundary", "skipped": reason}
    load = machine_load()
    results = run_on_hosts(_worker, (SIZES, REPS, WARMUP, units), 4, cpus=CPUS)
    data, rows = results[0], results[0]["rows"]
    # ranks 0 and 1 send, 2 and 3 receive (stage 0 and stage 1 of TP 2)
    python_us = {role: {p: round(sum(r["python_us"][p] for r in ranks) / 2, 1)
                        for p in ranks[0]["python_us"]}
                 for role, ranks in (("send", results[:2]), ("recv", results[2:]))}
    paths = [p for p in rows[0]["rounds"][0] if p != "megatron"]
    print(f"boundary transfer, 2 stages x TP 2, one rank per host of {CPUS} core, gloo; "
          f"{WARMUP} warm-up rounds discarded, then {REPS} alternating (ABBA), a round of "
          f"{ROUND_BYTES >> 20} MiB (small messages back to back); load before "
          f"{load['loadavg']}; {data['checked']} received tensors checked")
    print(f"{'shape':>18} {'MiB':>6} {'megatron ms':>12} " +
          " ".join(f"{p + '/megatron':>17} {'quartiles':>11}" for p in paths))
    for r in rows:
        r["ms"] = {p: spread(x[p] * 1e3 for x in r["rounds"]) for p in ["megatron", *paths]}
        r["ratio"] = {p: spread(x[p] / x["megatron"] for x in r["rounds"]) for p in paths}
        print(f"{str(tuple(r['shape'])):>18} {r['bytes'] / 2**20:6.2f} "
              f"{r['ms']['megatron']['median']:12.3f} " +
              " ".join(f"{r['ratio'][p]['median']:17.3f} "
                       f"{r['ratio'][p]['q1']:5.3f}-{r['ratio'][p]['q3']:.3f}" for p in paths))
    print(f"Python per call, gloo stubbed ({tuple(SIZES[0])}, mean of the two ranks), us: "
          + "; ".join(f"{role} " + ", ".join(f"{p} {t}" for p, t in by.items())
                      for role, by in python_us.items()))
    name = lambda r: "x".join(map(str, r["shape"]))  # noqa: E731
    return emit({"bench": "p2p_boundary",
                 "method": f"one rank per namespace host of {CPUS} core, one world, {WARMUP} "
                 f"warm-up rounds discarded, {REPS} ABBA rounds of ~{ROUND_BYTES >> 20} MiB "
                 "(small messages back to back, at most 64), median of per-round ratios; "
                 "every received tensor checked, a different one per transfer",
                 "cpus_per_rank": CPUS, "checked_tensors": data["checked"],
                 "mib": {name(r): round(r["bytes"] / 2**20, 2) for r in rows},
                 "ratios_fanout": {name(r): r["ratio"]["fanout"]["median"] for r in rows},
                 "ratios_relay": {name(r): r["ratio"]["relay"]["median"] for r in rows},
                 "ratios_whole": {name(r): r["ratio"]["whole"]["median"] for r in rows},
                 "ratio_spread": {name(r): r["ratio"] for r in rows},
                 "ratios_raw": {name(r): spread(x["raw_fanout"] / x["raw_megatron"]
                                                for x in r["rounds"])["median"] for r in rows},
                 "python_us": python_us,
                 "ms": {name(r): r["ms"] for r in rows}}, load_before=load)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
