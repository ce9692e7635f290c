"""U-shape (edge-cloud) training through ldt's schedule and runtime, against the reference.

Loss within 1e-6 relative, every gradient within 1e-5 absolute, for TP lists [1,2,1],
[2,1] (a two-stage ring) and [1,1,1,1], with fewer and more micro-batches than stages; and
the zero-bubble schedule (each backward split, its weight gradients run by W actions), also
with recomputation chosen per stage (full on the edge's both chunks, selective or a full
block on the cloud stages); and
evaluation (``forward_only=True``): the same losses, no gradient anywhere. The same worlds
record every boundary tensor (the audit) and whether a cloud rank read data. Into a TP 2
stage the messages go by fan-out (``auto``, one machine) and, in variants of their own, by
the relay of whole messages and in pieces (:data:`gpt_worlds.TRANSPORTS`); each variant shows
its receives took that route.
"""

import pytest

from gpt_worlds import ROUTES, TRANSPORTS, reference, vtp_run, zb_prices
from ldt.launch.local import run_local_world
from ldt.topology.ranks import Stage, Topology
from test_p2p_parity import (FULL_BLOCK, FULL_UNIFORM, GRAD_ATOL, LOSS_RTOL, SELECTIVE_ALL,
                             _assemble, expected_recomputes)

CASES = {"tp121": [1, 2, 1], "ring_tp21": [2, 1], "tp1111": [1, 1, 1, 1]}
# the relay under ldt's runtime: whole and in pieces into the cloud's TP 2 stage, in pieces
# into the ring's TP 2 edge
RELAYS = {"tp121": ["relay", "pieces"], "ring_tp21": ["pieces"], "tp1111": []}
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
    variants += [{"name": f"m{MS[1]}_{t}", "m": MS[1], "transport": t}
                 for t in RELAYS[request.param]]
    # the edge (both chunks) recomputes everything, the cloud only its attention, then none
    variants.append({"name": "recompute", "m": MS[1], "recompute": {
        **{s: {"granularity": "selective"} for s in range(1, len(tps))}, 0: FULL_UNIFORM}})
    # train.schedule=zb, its order generated from this world's prices (as ldt-train does);
    # then with recomputation per stage (the edge's both chunks whole layers, the cloud
    # stages their attention and norms or a block; the B re-runs the forward in the W store's
    # capture), priced with it as ldt-train prices it
    variants.append({"name": "zb", "m": MS[1], "zero_bubble": True,
                     "priced": zb_prices(topo, MS[1])})
    recompute = {s: FULL_UNIFORM if s == 0 else SELECTIVE_ALL if s % 2 else FULL_BLOCK
                 for s in range(len(tps))}
    variants.append({"name": "zb_recompute", "m": MS[1], "zero_bubble": True,
                     "recompute": recompute, "priced": zb_prices(topo, MS[1], recompute)})
    variants.append({"name": "eval", "m": MS[1], "forward_only": True})  # last: see test_eval
    out = run_local_world(topo.world_size, vtp_run, (topo, ref["full"], MS[0], variants),
                          timeout_s=240)
    return topo, variants, out


@pytest.mark.timeout(400)
def test_ushape_matches_reference(case, ref):
    topo, variants, out = case
    for i, v in enumerate(variants):
        if v.get("forward_only"):
            continue
        m = v["m"]
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
def test_eval_matches_reference_losses_without_gradients(case, ref):
    topo, variants, out = case
    i = len(variants) - 1
    assert variants[i]["forward_only"]
    want = ref[variants[i]["m"]]["losses"]  # the training forward's losses, same weights
    losses = next(rank[i]["losses"] for rank in out
                  if rank[i]["stage"] == topo.loss_stage() and rank[i]["tp_rank"] == 0)
    assert len(losses) == len(want)
    for got, exp in zip(losses, want):
        assert abs(got - exp) <= LOSS_RTOL * abs(exp), (got, exp)
    assert all(rank[i]["grads"] == {} for rank in out), "a forward-only step made gradients"


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
    # each micro-batch crosses every boundary once forward and once backward (evaluation:
    # forward only)
    for i, v in enumerate(variants):
        sent = [c for rank in out for c in rank[i]["sent"]]
        per_mb = 1 if v.get("forward_only") else 2
        assert len(sent) == per_mb * topo.num_stages * v["m"], v
        if v.get("forward_only"):
            assert {direction for _, _, direction, _, _ in sent} == {"F"}, v
    # the cloud never touched a data iterator; the edge did
    for rank in out:
        for r in rank:
            assert r["touched_data"] is False


def test_each_variant_ran_the_transport_it_names(case):
    """Receives into a TP 2 stage took the variant's route (fan-out unless it names the
    relay) and no other; a world without a TP 2 stage has no such receive."""
    topo, variants, out = case
    for i, v in enumerate(variants):
        calls = {route: sum(rank[i]["routes"][route] for rank in out) for route in ROUTES}
        if max(topo.tp_sizes) == 1:
            assert calls == dict.fromkeys(ROUTES, 0), (v["name"], calls)
            continue
        want = TRANSPORTS[v.get("transport", "fanout")][1]
        assert calls[want] > 0, (v["name"], calls)
        assert all(n == 0 for route, n in calls.items() if route != want), (v["name"], calls)


def test_zero_bubble_ran_every_w_after_its_backward(case):
    """The zb variants' gradients are checked above (without and with recomputation); here:
    their weight gradients really were deferred, one W store run per micro-batch and chunk,
    in each chunk's backward order; the order that ran is the one generated from the world's
    prices."""
    from gpt_worlds import assert_w_ran_after_each_backward

    from gpt_worlds import assert_ran_priced_order

    topo, variants, out = case
    zb = [j for j, v in enumerate(variants) if v.get("zero_bubble")]
    assert [variants[i]["name"] for i in zb] == ["zb", "zb_recompute"]
    assert_ran_priced_order(topo, variants, out)  # generated from this world's prices
    for i in zb:
        for rank_results in out:  # the edge runs both chunks' W's
            if rank_results[i]["stage"] == 0:
                assert {name for _, name in rank_results[i]["w_runs"]} == {"start", "end"}
    assert_w_ran_after_each_backward(variants, out, MS[1])


def test_recompute_ran_on_both_edge_chunks_and_the_cloud(case):
    """Each recomputing variant (today's schedule, and zb) entered exactly the checkpoints its
    settings ask for, on both edge chunks and every cloud stage."""
    from gpt_worlds import variant_topology

    topo, variants, out = case
    recomputing = [j for j, v in enumerate(variants) if v.get("recompute")]
    assert [variants[i]["name"] for i in recomputing] == ["recompute", "zb_recompute"]
    for i in recomputing:
        split = variant_topology(topo, variants[i]).split
        for rank_results in out:
            r = rank_results[i]
            layers = [c.num_layers for c in split.stage_chunks(r["stage"])]
            want = expected_recomputes(variants[i]["recompute"], r["stage"], layers,
                                       variants[i]["m"])
            assert want > 0 and r["recomputed"] == want, (variants[i]["name"], r["stage"],
                                                          r["recomputed"], want)
