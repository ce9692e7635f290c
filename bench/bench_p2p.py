"""Boundary transfer: ldt's leader send + TP broadcast vs megatron-core's per-TP-rank p2p.

Two stages of TP 2 (uniform, so megatron's own path can run), 4 gloo processes on CPU, ONE
world holding both: megatron-core's groups (``initialize_model_parallel(2, 2)``, its
``P2PCommunicator`` on its pipeline group) and ldt's (``initialize_vtp``, a
``VtpCommunicator``), both built before anything is timed. Each repetition sends one activation
[seq, mbs, hidden] from stage 0 to stage 1 and waits until every rank of stage 1 has it (timed
between two world barriers: the slowest rank). Per size: WARMUP rounds of both paths discarded
(gloo connections, buffers), then REPS rounds alternating which path goes first (ABBA), so load
drift hits both (more rounds for the small sizes, whose rounds are short and spread
widely); the figure is the median of the per-round ratios ldt / megatron, with its
quartiles and each path's median. Every rank of stage 1 checks it received the sent tensor, on
every path. Prints a table and one JSON line (with the machine's load before and after).

*ldt* is what ``ldt-train`` does here (``cluster.boundary_fanout=auto``: both stages on one
node, so stage 0's leader sends its copy straight to both TP ranks of stage 1). Two more
paths show what the alternatives cost: *ldt relay* (``never``: one copy to stage 1's leader,
which relays it in pieces as they arrive, as between nodes) and *ldt whole* (the relay
unpipelined, every message one piece, as before issue #27).
``--units 32768,131072`` adds one relay path per piece unit (``VtpCommunicator.piece_unit_bytes``),
the measurement its default was chosen from.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import abba, emit, machine_load, spread, timed_step

SIZES = [(128, 1, 256), (512, 1, 512), (1024, 2, 1024), (2048, 2, 2048)]  # seq, mbs, hidden
REPS, WARMUP = 31, 2
ROUND_BYTES = 32 * 2**20  # a round moves about this much: small messages back to back


def transfers_per_round(nbytes: int) -> int:
    """Transfers timed together in one round (one after the other, each waited, as a pipeline
    sends one per micro-batch): a lone transfer of a small message takes ~1 ms, and the two
    world barriers around a round wake 4 processes on 2 cores with a spread of the same size
    (measured: per-round ratios 0.17-7.1 at 0.12 MiB with one transfer per round)."""
    return max(1, min(64, ROUND_BYTES // nbytes))


WHOLE = 1 << 62  # a piece unit no message reaches: one piece


def _worker(rank, world, sizes, reps, warmup, units=()):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    import ldt
    from ldt import patches
    from ldt.boundary.communicator import VtpCommunicator
    from ldt.config import ClusterConfig, StageConfig
    from ldt.topology import Topology

    cfg = type("Cfg", (), dict(pipeline_dtype=torch.float32, virtual_pipeline_model_parallel_size=None,
                                sequence_parallel=False, variable_seq_lengths=False,
                                use_ring_exchange_p2p=False, batch_p2p_comm=False,
                                batch_p2p_sync=False, mtp_standalone=False, timers=None))()
    topo = Topology.from_config(ClusterConfig(stages=[StageConfig("a", "cpu", 2),
                                                      StageConfig("b", "cpu", 2)]))
    patches.apply(["cpu_shims"])
    # megatron-core's own path: every TP rank sends to its peer in the next stage. Its
    # communicator keeps its pipeline group; the globals are not read after construction.
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    mcomm = P2PCommunicator(ps.get_pipeline_model_parallel_group(), cfg)
    first = ps.is_pipeline_first_stage()
    state = ldt.initialize_vtp(topo, timeout_s=120)
    vcomms = {"ldt": VtpCommunicator(cfg, state)}
    for name, unit in ([("ldt relay", None), ("ldt whole", WHOLE)]
                       + [(f"ldt unit {u}", u) for u in units]):
        vcomms[name] = VtpCommunicator(cfg, state)
        vcomms[name].boundary_fanout = "never"
        vcomms[name].piece_unit_bytes = unit or vcomms[name].piece_unit_bytes
    assert (state.stage == 0) == first, "rank maps differ"
    rows = []
    for shape in sizes:
        act = torch.randn(shape, generator=torch.Generator().manual_seed(len(rows)))
        got = {}

        burst = transfers_per_round(act.numel() * 4)

        def step(path):
            comm = mcomm if path == "megatron" else vcomms[path]
            for _ in range(burst):
                if first:
                    comm.send_forward(act, is_last_stage=False)
                else:
                    got[path] = comm.recv_forward(shape, is_first_stage=False)

        rounds = abba(lambda path: timed_step(lambda: step(path)) / burst,
                      ["megatron", *vcomms], reps, warmup)
        if not first:  # both paths delivered the activation to every rank of stage 1
            for path, tensor in got.items():
                if not torch.equal(tensor.detach(), act):
                    raise RuntimeError(f"{path}: rank {rank} received a different tensor")
        rows.append({"shape": list(shape), "bytes": act.numel() * 4, "burst": burst,
                     "rounds": rounds})
    patches.revert()
    ldt.destroy_vtp()
    dist.barrier()
    return rows


def main(argv=None) -> dict:
    from ldt.launch import run_local_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", default="", help="comma-separated piece units to add")
    units = [int(u) for u in parser.parse_args(argv or []).units.split(",") if u]
    load = machine_load()
    rows = run_local_world(4, _worker, (SIZES, REPS, WARMUP, units), timeout_s=300)[0]
    paths = [p for p in rows[0]["rounds"][0] if p != "megatron"]
    print(f"boundary transfer, 2 stages x TP 2 on CPU/gloo, one world; {WARMUP} warm-up rounds "
          f"discarded, then {REPS} alternating (ABBA), a round "
          f"of {ROUND_BYTES >> 20} MiB (small messages back to back); load before "
          f"{load['loadavg']}")
    print(f"{'shape':>18} {'MiB':>7} {'megatron ms':>12} " +
          " ".join(f"{p + ' ms':>12} {p + '/megatron':>16} {'quartiles':>12}" for p in paths))
    for r in rows:
        r["ms"] = {p: spread(x[p] * 1e3 for x in r["rounds"]) for p in ["megatron", *paths]}
        r["ratio"] = {p: spread(x[p] / x["megatron"] for x in r["rounds"]) for p in paths}
        print(f"{str(tuple(r['shape'])):>18} {r['bytes'] / 2**20:7.2f} "
              f"{r['ms']['megatron']['median']:12.3f} " +
              " ".join(f"{r['ms'][p]['median']:12.3f} {r['ratio'][p]['median']:16.3f} "
                       f"{r['ratio'][p]['q1']:5.3f}-{r['ratio'][p]['q3']:.3f}" for p in paths))
    name = lambda r: "x".join(map(str, r["shape"]))  # noqa: E731
    return emit({"bench": "p2p_boundary", "method": f"one world, {WARMUP} warm-up rounds "
                 f"discarded, {REPS} ABBA rounds of ~{ROUND_BYTES >> 20} MiB (small messages back "
                 "to back, at most 64), median of "
                 "per-round ratios",
                 "ratios": {name(r): r["ratio"]["ldt"]["median"] for r in rows},
                 "ratios_relay": {name(r): r["ratio"]["ldt relay"]["median"] for r in rows},
                 "ratios_whole": {name(r): r["ratio"]["ldt whole"]["median"] for r in rows},
                 "ratio_spread": {name(r): r["ratio"] for r in rows},
                 "ms": {name(r): r["ms"] for r in rows}}, load_before=load)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
