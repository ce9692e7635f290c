"""Worker functions shared by the model-parity tests (run inside ldt.launch.local worlds).

The reference is megatron-core's own no-pipelining schedule on one process with the full
model; the VTP runs load the same full weights, sharded per stage TP size, and must give the
same loss and gradients.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ldt.config import ModelConfig

MODEL = ModelConfig(name="parity", num_layers=6, hidden_size=64, num_attention_heads=4,
                    ffn_hidden_size=128, vocab_size=256, seq_length=16)
MBS = 2


def make_batches(m: int, seed: int = 7) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(m):
        tokens = torch.randint(0, MODEL.vocab_size, (MBS, MODEL.seq_length + 1), generator=g)
        mask = torch.ones(MBS, MODEL.seq_length)
        mask[:, -3:] = 0.0  # a loss mask that is not all ones
        out.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                    "loss_mask": mask,
                    "position_ids": torch.arange(MODEL.seq_length).repeat(MBS, 1)})
    return out


def even_layout(num_layers: int, segments: int) -> str:
    """``E...|...|...L`` with the layers spread over ``segments`` segments."""
    counts = [num_layers // segments + (i < num_layers % segments) for i in range(segments)]
    segs = ["t" * c for c in counts]
    segs[0], segs[-1] = "E" + segs[0], segs[-1] + "L"
    return "|".join(segs)


def forward_step(data_iterator, model):
    from ldt.models.build import causal_mask

    batch = next(data_iterator) if data_iterator is not None else None  # None: no data here
    if batch is None:
        out = model(None, None, causal_mask(MODEL.seq_length))
    else:
        out = model(batch["tokens"], batch["position_ids"], causal_mask(MODEL.seq_length),
                    labels=batch["labels"])

    def loss_func(output_tensor):
        mask = batch["loss_mask"]
        loss = (output_tensor.float() * mask).sum() / mask.sum()
        return loss, {"lm loss": loss.clone().detach()}

    return out, loss_func


def _setup(topo, observers=()):
    import ldt
    from ldt import patches

    state = ldt.initialize_vtp(topo, timeout_s=60)
    from types import SimpleNamespace

    from ldt.pipeline.forward_backward import MegatronHooks
    patches.apply(["cpu_shims", "schedules", "recompute_norms"],
                  ctx=MegatronHooks(tuple(observers)))
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(123)  # as a Megatron script does
    return state


class Tripwire:
    """A data iterator a stage must never touch (cloud stages of a U-shape)."""

    touched = False

    def __iter__(self):
        return self

    def __next__(self):
        Tripwire.touched = True
        raise AssertionError("a cloud stage read data")


class AuditLog:
    """Boundary observer: what crossed, as (src, dst, direction, dtype, shape)."""

    def __init__(self):
        self.sent = []

    def on_send(self, src, dst, direction, tensor):
        self.sent.append((src, dst, direction, str(tensor.dtype), tuple(tensor.shape)))

    def on_recv(self, src, dst, direction, tensor):
        pass


def recompute_kwargs(recompute, stage: int) -> dict:
    """TransformerConfig recompute fields of ``stage`` for a variant's ``recompute``: None, one
    ``cluster.stages[i].recompute`` dict for every stage, or ``{stage: dict}``."""
    from ldt.config import RecomputeConfig
    from ldt.models.recompute import transformer_kwargs

    if recompute and all(isinstance(k, int) for k in recompute):
        recompute = recompute.get(stage)
    return transformer_kwargs(RecomputeConfig(**recompute) if recompute else None)


def zb_prices(topo, m: int, recompute=None):
    """The prices ``train.schedule=zb`` generates a world's order from: :func:`MODEL`'s plan
    on ``topo``'s stages (even layers, ``recompute`` as :func:`recompute_kwargs` takes it),
    as ``ldt.plan.zb_prices.run_prices`` prices a run."""
    from ldt.config import typed_config
    from ldt.plan.zb_prices import run_prices

    def rc(stage):
        one = recompute.get(stage) if recompute and all(isinstance(k, int) for k in recompute) \
            else recompute
        return {"recompute": one} if one else {}

    cfg = {"cluster": {"stages": [{"name": st.name, "device": st.device, "tp": st.tp,
                                   **rc(st.index)} for st in topo.stages],
                       "u_shape": topo.u_shape},
           "model": dataclasses.asdict(MODEL),
           "train": {"num_microbatches": m, "micro_batch_size": MBS, "schedule": "zb"}}
    c = typed_config(cfg)
    return run_prices(c.cluster, c.model, c.train)


class RecomputeCount:
    """Counts megatron's recompute checkpoints entered in forward (full and selective core
    attention: CheckpointFunction; selective mlp / layernorm: CheckpointWithoutOutput): the
    proof that a variant really recomputed."""

    def __enter__(self):
        from megatron.core.tensor_parallel import random as mrandom

        self.calls, self._undo = 0, []
        for cls in (mrandom.CheckpointFunction, mrandom.CheckpointWithoutOutputFunction):
            original = cls.forward

            def counted(ctx, *args, _original=original):
                self.calls += 1
                return _original(ctx, *args)

            cls.forward = staticmethod(counted)
            self._undo.append((cls, original))
        return self

    def __exit__(self, *exc):
        for cls, original in self._undo:
            cls.forward = staticmethod(original)


# A variant's ``transport``: how a boundary message reaches a stage of TP > 1
# (cluster.boundary_fanout and the relay's piece unit, ldt.boundary.relay), and the route
# :class:`TransportCount` must then see: ``fanout`` the sending leader's copy straight to every
# rank, ``whole`` one copy to the leader and its broadcast (or scatter), ``pieces`` the
# leader's relay piece by piece (64 bytes: every message of this model is many pieces).
TRANSPORTS = {
    "fanout": ({"boundary_fanout": "auto"}, "fanout"),  # one machine: auto fans out
    "always": ({"boundary_fanout": "always"}, "fanout"),
    "relay": ({"boundary_fanout": "never"}, "whole"),
    "pieces": ({"boundary_fanout": "never", "piece_bytes": 64}, "pieces"),
}
ROUTES = ("fanout", "whole", "pieces")


class TransportCount:
    """Receives into a stage of TP > 1 per route (:data:`ROUTES`), counted on every rank of
    that stage where the route's code runs: the fan-out receive, the leader's broadcast or
    scatter of a whole message (every rank joins it), the piece relay. The proof that a
    variant ran the transport it names, and no other. ``fanout_sent``: the fan-out copies this
    rank sent (the sending ranks share them, ``ldt.topology.transport.fanout_sources``)."""

    def __enter__(self):
        from ldt.boundary.communicator import VtpCommunicator
        from ldt.boundary.sequence import SequenceLayout
        from ldt.boundary.relay import PieceRelay
        from ldt.topology.transport import FANOUT

        self.calls, self._undo, self.fanout_sent = dict.fromkeys(ROUTES, 0), [], 0
        targets = VtpCommunicator._targets

        def counted_targets(comm, route, how):
            out = targets(comm, route, how)
            self.fanout_sent += len(out) if how.kind == FANOUT else 0
            return out

        VtpCommunicator._targets = counted_targets
        self._undo.append((VtpCommunicator, "_targets", targets))
        for cls, name, route, tp in (
                (VtpCommunicator, "_recv_fanout", "fanout", lambda c: c.layout.tp),
                (SequenceLayout, "distribute", "whole", lambda layout: layout.tp),
                (PieceRelay, "run", "pieces", lambda r: r.layout.tp)):
            original = getattr(cls, name)

            def counted(obj, *args, _original=original, _route=route, _tp=tp, **kwargs):
                if _tp(obj) > 1:
                    self.calls[_route] += 1
                return _original(obj, *args, **kwargs)

            setattr(cls, name, counted)
            self._undo.append((cls, name, original))
        return self

    def __exit__(self, *exc):
        for cls, name, original in self._undo:
            setattr(cls, name, original)


def _run_schedule(state, topo, full_state, m, overlap=False, forward_only=False, recompute=None,
                  zero_bubble=False, priced=None):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from ldt.models.build import build_chunk, global_param_name
    from ldt.models.sharding import load_full_state

    chunks = topo.split.stage_chunks(state.stage)
    vpp = len(chunks) if len(chunks) > 1 and not topo.u_shape else None
    tp = topo.stages[state.stage].tp
    models = []
    for chunk in chunks:
        gpt = build_chunk(MODEL, chunk, tp, vpp=vpp, num_stages=topo.num_stages,
                          **recompute_kwargs(recompute, state.stage))
        load_full_state(gpt, full_state, tp, state.info.tp_rank,
                        rename=lambda n, c=chunk: global_param_name(c, n))
        gpt.config.overlap_p2p_comm = overlap
        gpt.config.batch_p2p_comm = not overlap
        models.append(gpt)
    batches = make_batches(m)
    iters = [iter(batches) for _ in models]
    if topo.u_shape:
        data = iter(batches) if state.stage == 0 else Tripwire()
        losses = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data,
            model=models if len(models) > 1 else models[0], num_microbatches=m,
            seq_length=MODEL.seq_length, micro_batch_size=MBS, forward_only=forward_only,
            **({"zero_bubble": True, "priced": priced} if zero_bubble else {}))
        return _collect(chunks, models, losses)
    # a plain pipeline's zero-bubble schedule (ZB-H1) runs on ldt's runtime, as ldt-train does
    if zero_bubble:
        from ldt.pipeline.forward_backward import forward_backward_ldt

        fb = functools.partial(forward_backward_ldt, zero_bubble=True, priced=priced)
    else:
        fb = get_forward_backward_func()
    losses = fb(
        forward_step_func=forward_step,
        data_iterator=iters if vpp else iters[0],
        model=models if vpp else models[0],
        num_microbatches=m, seq_length=MODEL.seq_length, micro_batch_size=MBS,
        forward_only=forward_only)
    return _collect(chunks, models, losses)


def _collect(chunks, models, losses):
    from ldt.models.build import global_param_name

    grads = {}  # only parameters that got one (none after a forward-only run)
    for chunk, gpt in zip(chunks, models):
        for name, p in gpt.named_parameters():
            if p.grad is not None:
                grads[global_param_name(chunk, name)] = p.grad.detach().clone()
    return [float(x["lm loss"]) for x in losses], grads


def reference(rank, world, ms, seed=1234):
    """Full model on one process through megatron's no-pipelining schedule."""
    from ldt.config.layout import split_layers
    from ldt.models.build import build_chunk
    from ldt.topology.ranks import Stage, Topology

    topo = Topology((Stage(0, "ref", "cpu", 1),),
                    split=split_layers(MODEL.num_layers, 1))
    state = _setup(topo)
    torch.manual_seed(seed)
    full = {n: p.detach().clone()
            for n, p in build_chunk(MODEL, topo.split.stage_chunks(0)[0], 1).named_parameters()}
    out = {"full": full}
    for m in ms:  # one reference per micro-batch count (each run builds a fresh model)
        out[m] = dict(zip(("losses", "grads"), _run_schedule(state, topo, full, m)))
    return out


def variant_topology(topo, v: dict):
    """``topo`` with a variant's chunks per stage (``vpp``: an even layout of that many
    chunks per stage; the U-shape keeps its own), ``host_staging`` and ``transport``'s
    ``cluster.boundary_fanout`` (:data:`TRANSPORTS`)."""
    from ldt.config.layout import split_layers

    layout = None if topo.u_shape else even_layout(MODEL.num_layers,
                                                      v.get("vpp", 1) * topo.num_stages)
    split = split_layers(MODEL.num_layers, topo.num_stages, u_shape=topo.u_shape, layout=layout)
    settings, _ = TRANSPORTS[v.get("transport", "fanout")]
    return dataclasses.replace(topo, split=split, force_host_staging=v.get("host_staging", False),
                               boundary_fanout=settings["boundary_fanout"])


def assert_ran_priced_order(topo, variants, out):
    """Every zero-bubble variant ran the order generated from its prices (``priced``), which
    is not the equal-cost one (else its parity would not cover an order generated from costs)."""
    from ldt.schedule import lower
    from ldt.schedule.zerobubble import zb_h1, zb_u_shape

    p, kind = topo.num_stages, "ushape" if topo.u_shape else "1f1b"
    generate = zb_u_shape if topo.u_shape else zb_h1
    for i in (j for j, v in enumerate(variants) if v.get("zero_bubble")):
        m = variants[i].get("m") or next(len(r[i]["losses"]) for r in out if r[i]["losses"])
        priced = lower(generate(p, m, *variants[i]["priced"].tables()), kind)
        assert priced != lower(generate(p, m), kind), variants[i].get("name")
        for rank_results in out:
            r = rank_results[i]
            assert r["ran"] == [str(a) for a in priced[r["stage"]]], (variants[i].get("name"),
                                                                      r["stage"])


def assert_w_ran_after_each_backward(variants, out, m):
    """Every zero-bubble variant's weight gradients really were deferred: one W store run per
    micro-batch (``m``, or the variant's own) and chunk on every rank, in each chunk's
    backward order (its gradients are compared with the reference by the caller); no other
    variant ran a W."""
    zb = [j for j, v in enumerate(variants) if v.get("zero_bubble")]
    for i in zb:
        n = variants[i].get("m", m)
        for rank_results in out:
            runs = rank_results[i]["w_runs"]
            u_edge = {"start", "end"} & {name for _, name in runs}
            chunks = ["start", "end"] if u_edge else ["stage"]
            assert sorted(runs) == sorted((mb, c) for mb in range(n) for c in chunks), runs
            for c in chunks:
                assert [mb for mb, name in runs if name == c] == list(range(n)), runs
    assert all(r[j]["w_runs"] == [] for r in out for j in range(len(variants)) if j not in zb)


def vtp_run(rank, world, topo, full_state, m, variants):
    """Run each variant ({"vpp": int, "overlap": bool, "host_staging": bool, "m": int,
    "forward_only": bool, "recompute": see :func:`recompute_kwargs`, "transport": a key of
    :data:`TRANSPORTS`, default ``fanout``}) in one world; each rank returns, per variant, its
    losses, gradients, what crossed (``sent``), the recomputations and the routes its
    receives took (:class:`TransportCount`). ``zero_bubble``: the zero-bubble schedule on ldt's
    runtime (ZB-H1, or the zero-bubble U-shape), the ``wgrad_split`` patch applied and every W
    store run recorded in ``w_runs``."""
    import ldt
    from ldt import patches
    from ldt.boundary.communicator import VtpCommunicator

    results = []
    for v in variants:
        t = variant_topology(topo, v)
        audit = AuditLog()
        state = _setup(t, observers=[audit])
        Tripwire.touched = False
        default_unit = VtpCommunicator.piece_unit_bytes
        settings, _ = TRANSPORTS[v.get("transport", "fanout")]
        VtpCommunicator.piece_unit_bytes = settings.get("piece_bytes", default_unit)
        w_runs = []  # zero-bubble: the W store's runs, (micro-batch, chunk)
        ran = []  # zero-bubble: the action list ldt's runtime walked
        if v.get("zero_bubble"):
            from ldt.pipeline import forward_backward as fb
            from ldt.schedule.wgrad import WgradStore

            patches.apply(["wgrad_split"])
            default_run, default_actions = WgradStore.run, fb.run_actions
            WgradStore.run = lambda store, key: (w_runs.append(key), default_run(store, key))
            fb.run_actions = lambda actions, **kw: (ran.extend(map(str, actions)),
                                                    default_actions(actions, **kw))[1]
        try:
            with RecomputeCount() as recomputed, TransportCount() as routes:
                losses, grads = _run_schedule(state, t, full_state, v.get("m", m),
                                              overlap=v.get("overlap", False),
                                              forward_only=v.get("forward_only", False),
                                              recompute=v.get("recompute"),
                                              zero_bubble=v.get("zero_bubble", False),
                                              priced=v.get("priced"))
        finally:
            VtpCommunicator.piece_unit_bytes = default_unit
            if v.get("zero_bubble"):
                WgradStore.run, fb.run_actions = default_run, default_actions
        results.append({"stage": state.stage, "tp_rank": state.info.tp_rank,
                        "losses": losses, "grads": grads, "sent": audit.sent,
                        "touched_data": Tripwire.touched, "recomputed": recomputed.calls,
                        "routes": routes.calls, "fanout_sent": routes.fanout_sent,
                        "w_runs": w_runs, "ran": ran})
        patches.revert()
        ldt.destroy_vtp()
    return results
