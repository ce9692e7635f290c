"""U-shape (edge-cloud) training through ldt's schedule and runtime, against the reference.

Loss within 1e-6 relative, every gradient within 1e-5 absolute, for TP lists [1,2,1],
[2,1] (a two-stage ring) and [1,1,1,1], with fewer and more micro-batches than stages. The
same worlds record every boundary tensor (the audit) and whether a cloud rank read data.
"""

import pytest

from gpt_worlds import reference, vtp_run
from ldt.launch import run_local_world
from ldt.topology import Stage, Topology
from test_p2p_parity import GRAD_ATOL, LOSS_RTOL, _assemble

CASES = {"tp121": [1, 2, 1], "ring_tp21": [2, 1], "tp1111": [1, 1, 1, 1]}
MS = (2, 5)  # below and above every P here


@pytest.fixture(scope="module")
def ref():
    return run_local_world(1, reference, (list(MS),), timeout_s=120)[0]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, ref):
    tps = CASES[request.param]
    topo = Topology(tuple(Stage(i, "edge" if i == 0 else f"cloud{i}", "cpu", t)
                          for i, t in enumerate(tps)), u_shape=True)
    variants = [{"name": f"m{m}", "m": m} for m in MS]
    out = run_local_world(topo.world_size, vtp_run, (topo, ref["full"], MS[0], variants),
                          timeout_s=240)
    return topo, variants, out


@pytest.mark.timeout(400)
def test_ushape_matches_reference(case, ref):
    topo, variants, out = case
    for i, (v, m) in enumerate(zip(variants, MS)):
        losses, grads = _assemble(topo, out, i)
        want = ref[m]
        assert losses is not None and len(losses) == m, v
        for got, exp in zip(losses, want["losses"]):
            assert abs(got - exp) <= LOSS_RTOL * abs(exp), (v, got, exp)
        assert set(grads) == set(want["grads"])
        for name, exp in want["grads"].items():
            diff = (grads[name] - exp).abs().max().item()
            assert diff <= GRAD_ATOL, (v, name, diff)


@pytest.mark.timeout(400)
def test_only_activations_and_gradients_cross_boundaries(case):
    from gpt_worlds import MBS, MODEL

    topo, variants, out = case
    crossings = [c for rank in out for r in rank for c in r["sent"]]
    assert crossings, "the audit saw nothing"
    label_shape = (MBS, MODEL.seq_length)
    for src, dst, direction, dtype, shape in crossings:
        assert dtype == "torch.float32", (src, dst, dtype)  # no token ids, no labels
        assert shape == (MODEL.seq_length, MBS, MODEL.hidden_size), shape
        assert shape != label_shape
    # each micro-batch crosses every boundary once forward and once backward
    for i, m in enumerate(MS):
        sent = [c for rank in out for c in rank[i]["sent"]]
        assert len(sent) == 2 * topo.num_stages * m
    # the cloud never touched a data iterator; the edge did
    for rank in out:
        for r in rank:
            assert r["touched_data"] is False
