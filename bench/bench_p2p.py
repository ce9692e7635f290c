"""Boundary transfer: ldt's leader send + TP broadcast vs megatron-core's per-TP-rank p2p.

Two stages of TP 2 (uniform, so megatron's own path can run), 4 gloo processes on CPU. Each
repetition sends one activation [seq, mbs, hidden] from stage 0 to stage 1 and waits until
every rank of stage 1 has it; both paths run in the same world, interleaved, and the median of
the per-repetition times is compared. Prints a table and one JSON line.
"""

from __future__ import annotations

import json
import statistics

import torch

from bench.common import timed_step

SIZES = [(128, 1, 256), (512, 1, 512), (1024, 2, 1024), (2048, 2, 2048)]  # seq, mbs, hidden
REPS = 15


def _worker(rank, world, sizes, reps):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    import ldt
    from ldt import patches
    from ldt.config import ClusterConfig, StageConfig
    from ldt.boundary.communicator import VtpCommunicator
    from ldt.topology import Topology

    cfg = type("Cfg", (), dict(pipeline_dtype=torch.float32, virtual_pipeline_model_parallel_size=None,
                                sequence_parallel=False, variable_seq_lengths=False,
                                use_ring_exchange_p2p=False, batch_p2p_comm=False,
                                batch_p2p_sync=False, mtp_standalone=False, timers=None))()
    topo = Topology.from_config(ClusterConfig(stages=[StageConfig("a", "cpu", 2),
                                                      StageConfig("b", "cpu", 2)]))
    patches.apply(["cpu_shims"])
    rows = []
    for shape in sizes:
        act = torch.randn(shape)
        # megatron-core's own path: every TP rank sends to its peer in the next stage
        ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
        mcomm = P2PCommunicator(ps.get_pipeline_model_parallel_group(), cfg)
        first = ps.is_pipeline_first_stage()

        def megatron_step():
            if first:
                mcomm.send_forward(act, is_last_stage=False)
            else:
                mcomm.recv_forward(shape, is_first_stage=False)

        m_times = [timed_step(megatron_step) for _ in range(reps)]
        ps.destroy_model_parallel()
        state = ldt.initialize_vtp(topo, timeout_s=60)
        vcomm = VtpCommunicator(cfg, state)

        def ldt_step():
            if state.stage == 0:
                vcomm.send_forward(act, is_last_stage=False)
            else:
                vcomm.recv_forward(shape, is_first_stage=False)

        l_times = [timed_step(ldt_step) for _ in range(reps)]
        ldt.destroy_vtp()
        rows.append({"shape": list(shape), "bytes": act.numel() * 4,
                     "megatron_s": statistics.median(m_times), "ldt_s": statistics.median(l_times)})
    patches.revert()
    dist.barrier()
    return rows


def main() -> dict:
    from ldt.launch import run_local_world

    rows = run_local_world(4, _worker, (SIZES, REPS), timeout_s=300)[0]
    print("boundary transfer, 2 stages x TP 2 on CPU/gloo (median of %d)" % REPS)
    print(f"{'shape':>18} {'MiB':>7} {'megatron ms':>12} {'ldt ms':>9} {'ldt/megatron':>13}")
    for r in rows:
        r["ratio"] = r["ldt_s"] / r["megatron_s"]
        print(f"{str(tuple(r['shape'])):>18} {r['bytes'] / 2**20:7.2f} {r['megatron_s'] * 1e3:12.3f} "
              f"{r['ldt_s'] * 1e3:9.3f} {r['ratio']:13.3f}")
    out = {"bench": "p2p_boundary",
           "ratios": {"x".join(map(str, r["shape"])): round(r["ratio"], 3) for r in rows}}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
