"""Worker for tests/test_relay.py: boundary transfers in pieces, run inside one ldt.launch.local world.

Stage 0 has TP 1, stage 1 TP 3 (4 ranks). Per case, stage 0 sends ``whole`` forward (stage 1
relays it: broadcast, or with sequence parallelism a scatter in slices of a third, whose edges
do not fall on the pieces' edges) and stage 1 sends back ``2 * what it got`` (with sequence
parallelism gathered on its leader piece by piece), with or without host staging, with or
without a send transform (noise needs the whole tensor: the gather is not pipelined then), and
with ``cluster.boundary_fanout`` never (the relay) and always (stage 0's leader sends to
each rank of stage 1 itself, which keeps its slice with sequence parallelism).
Every rank returns what it found wrong (an empty list: all bytes arrived where they should).
"""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import torch

TPS = (1, 3)
SHAPES = [(6, 1, 4), (1200, 2, 342)]  # 1 piece; 5 pieces (tests/test_relay.py checks)


class Seen:
    """A boundary observer keeping what the leaders saw cross (the audit's view)."""

    def __init__(self):
        self.sent, self.received = [], []

    def on_send(self, src, dst, direction, tensor):
        self.sent.append(tensor.detach().clone())

    def on_recv(self, src, dst, direction, tensor):
        self.received.append(tensor.detach().clone())


def _case(state, shape, sp: bool, transform: bool, staged: bool) -> list[str]:
    from ldt.boundary.communicator import BACKWARD, FORWARD, SendTransform, VtpCommunicator

    class PlusOne(SendTransform):
        def __call__(self, t, src, dst, d):
            return t + 1.0

    tp = TPS[state.stage]
    config = SimpleNamespace(pipeline_dtype=torch.float32, sequence_parallel=sp and tp > 1,
                             variable_seq_lengths=False, virtual_pipeline_model_parallel_size=None)
    seen = Seen()
    plus_one = [PlusOne()] if transform and state.stage == 1 else []
    comm = VtpCommunicator(config, state, [seen], plus_one)
    case = f"{shape} sp={sp} transform={transform} staged={staged}"
    # values of this case only: a receive buffer that reuses a freed one of an earlier case
    # (malloc does) must not already hold the expected bytes
    whole = torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(case.encode())))
    back = 2 * whole + (1.0 if transform else 0.0)
    name = f"{case} rank {state.info.rank}"
    wrong = []
    if state.stage == 0:
        send = comm.send(whole.clone(), 1, FORWARD)
        got, work = comm.recv(shape, 1, BACKWARD)
        work.wait()
        send.wait()
        if not torch.equal(got.detach(), back):
            wrong.append(f"{name}: gradient received")
        if not (torch.equal(seen.sent[0], whole) and torch.equal(seen.received[0], back)):
            wrong.append(f"{name}: the observers saw other bytes")
        return wrong
    tp_rank = state.stage_ranks.index(state.info.rank)
    mine = whole.chunk(tp)[tp_rank] if config.sequence_parallel else whole
    got, work = comm.recv(mine.shape, 0, FORWARD)
    work.wait()
    if not torch.equal(got.detach(), mine):
        wrong.append(f"{name}: activation received")
    send = comm.send(2 * got.detach(), 0, BACKWARD)
    if send is not None:
        send.wait()
    if state.is_leader and not (torch.equal(seen.received[0], whole)
                                and torch.equal(seen.sent[0], back)):
        wrong.append(f"{name}: the observers saw other bytes")
    return wrong


def relay_cases(rank, world) -> list[str]:
    import ldt
    from ldt.config import ClusterConfig, StageConfig
    from ldt.topology.ranks import Topology

    wrong = []
    for staged, fanout in [(s, f) for f in ("never", "always") for s in (False, True)]:
        topo = Topology.from_config(ClusterConfig(
            stages=[StageConfig(f"s{i}", "cpu", tp) for i, tp in enumerate(TPS)],
            host_staging="always" if staged else "auto", boundary_fanout=fanout))
        state = ldt.initialize_vtp(topo, timeout_s=60)
        try:
            for shape in SHAPES:
                for sp in (False, True):
                    for transform in ((False, True) if sp and not staged else (False,)):
                        wrong += [f"fanout={fanout} {w}"
                                  for w in _case(state, shape, sp, transform, staged)]
        finally:
            ldt.destroy_vtp()
    return wrong
