"""The B/W split of megatron-core's local linear layers (patches/wgrad_split.py) and the W store
(ldt/schedule/wgrad.py).

The proof that the split changes nothing but *when*: one gloo world of 2 ranks runs a real
GPTModel stage (embedding, 2 decoder layers, head) wrapped by ldt's optimizer path (megatron's
DistributedDataParallel with ``overlap_grad_reduce`` and its Adam) three times from the same
initial weights and data: unpatched (the reference), patched without a capture (W runs inside
the backward), and patched with every backward captured by a W store whose W's run later,
interleaved with the next backwards. Every parameter's ``main_grad`` after the DP reduce and
every weight after the optimizer step must equal the reference's (fp32, bit for bit), and a
spy on DDP's ``register_grad_ready`` (what DDP's grad-accumulator hook calls with
``overlap_grad_reduce``) must see each linear weight made ready during the last W, never during
a B, and everything else during the last B. Variants: TP 1 x DP 2 (a real reduce), the same
with gradient-accumulation fusion (a CPU stand-in for Apex's kernel, in every run), TP 2 with
sequence parallelism (megatron gathers the layer input into a shared buffer).
"""

from __future__ import annotations

import contextlib

import pytest

from ldt.launch.local import run_local_world
from ldt.schedule.wgrad import WgradOrderError, WgradStore

M = 4  # micro-batches per step
# B's and W's interleaved as a zero-bubble schedule does: W's late, between later backwards
ORDER = [("B", 0), ("B", 1), ("W", 0), ("B", 2), ("W", 1), ("B", 3), ("W", 2), ("W", 3)]
MODEL = dict(name="wgrad", num_layers=2, hidden_size=32, num_attention_heads=4,
             ffn_hidden_size=64, vocab_size=128, seq_length=16, add_bias_linear=True)
SPLIT = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight",
         "output_layer.weight")


class CpuFusedKernels:
    """A stand-in for Apex's ``fused_weight_gradient_mlp_cuda`` on CPU: what its two kernels
    compute (``main_grad += grad_output^T @ input``)."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
        main_grad.add_(grad_output.t().matmul(total_input))

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


def _cfg(tp: int, dp: int, sp: bool) -> dict:
    return {"cluster": {"stages": [{"name": "s", "device": "cpu", "tp": tp}], "dp": dp},
            "model": {**MODEL, "sequence_parallel": sp},
            "train": {"micro_batch_size": 2, "num_microbatches": M, "clip_grad": 0.0,
                      "overlap_grad_reduce": True, "ddp_bucket_size": 4000, "lr": 1e-2,
                      "seed": 5}}


def _batches(dp_rank: int):
    import torch

    g = torch.Generator().manual_seed(100 + dp_rank)  # each replica its own data
    out = []
    for _ in range(M):
        tokens = torch.randint(0, MODEL["vocab_size"], (2, MODEL["seq_length"] + 1), generator=g)
        out.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                    "position_ids": torch.arange(MODEL["seq_length"]).repeat(2, 1)})
    return out


def _run(c, topo, state, mode: str, fused: bool) -> dict:
    """One step; ``mode``: "ref" (unpatched), "inline" (patched, no capture), "store"."""
    from megatron.core.tensor_parallel import layers

    from ldt import patches
    from ldt.models.build import causal_mask
    from ldt.patches.wgrad_split import WgradSeam
    from ldt.training.optim import build_stage_optimizer
    from ldt.training.stage import build_stage_models

    models = build_stage_models(c, topo, state)
    if fused:
        for module in models[0].modules():
            if isinstance(module, (layers.ColumnParallelLinear, layers.RowParallelLinear)):
                module.gradient_accumulation_fusion = True
    opt = build_stage_optimizer(c, topo, state, models, shared_chunks=False)
    ddp, chunk = opt.ddp[0], opt.chunks[0]
    name = {p: n for n, p in ddp.module.named_parameters()}
    phase, ready = [""], []
    for group in ddp.bucket_groups:  # the spy: DDP's hook calls it every time it fires
        def spy(param, *args, _group=group, _original=group.register_grad_ready, **kwargs):
            ready.append((name[param], phase[0], _group.is_last_microbatch))
            return _original(param, *args, **kwargs)
        group.register_grad_ready = spy
    opt.zero_grad()
    data, mask = _batches(state.info.dp_rank), causal_mask(MODEL["seq_length"])
    store = WgradStore(WgradSeam({"stage": chunk})) if mode == "store" else None
    after_b: dict = {}
    with patches.applied(["wgrad_split"] if mode != "ref" else []):
        for op, mb in ORDER if mode == "store" else [("B", mb) for mb in range(M)]:
            phase[0] = f"{op}{mb}"
            sync = contextlib.nullcontext() if mb == M - 1 else ddp.no_sync()
            with sync:
                if op == "W":
                    store.run((mb, "stage"))
                    continue
                batch = data[mb]
                out = chunk(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"])
                loss = out.float().mean() / M
                with store.capture((mb, "stage")) if store else contextlib.nullcontext():
                    loss.backward()
            if mode == "store" and mb == 0 and op == "B":  # what B alone accumulated
                after_b = {name[p]: float(p.main_grad.abs().sum()) for p in ddp.module.parameters()}
        if store:
            store.finish()
    opt.step()  # megatron's finalize_model_grads (the DP reduce), then Adam
    return {"grads": {name[p]: p.main_grad.detach().clone() for p in ddp.module.parameters()},
            "weights": {name[p]: p.detach().clone() for p in ddp.module.parameters()},
            "ready": ready, "after_b0": after_b}


def _compare(rank, world, tp: int, dp: int, sp: bool, fused: bool) -> dict:
    import ldt
    from megatron.core.tensor_parallel import layers

    from ldt import patches
    from ldt.config import typed_config
    from ldt.topology.validate import validate

    c = typed_config(_cfg(tp, dp, sp))
    topo = validate(c.cluster, c.model, world_size=world, train=c.train)
    state = ldt.initialize_vtp(topo, timeout_s=60)
    names = ["cpu_shims", "optimizer_cpu", "sequence_parallel_norms"]
    patches.apply(names)
    undo = []
    if fused:  # megatron checks the kernel exists when it builds a fused layer: ours
        for attr, value in (("fused_weight_gradient_mlp_cuda", CpuFusedKernels),
                            ("_grad_accum_fusion_available", True)):
            undo.append((attr, getattr(layers, attr, None)))
            setattr(layers, attr, value)
    try:
        runs = {mode: _run(c, topo, state, mode, fused) for mode in ("ref", "inline", "store")}
    finally:
        for attr, value in undo:
            setattr(layers, attr, value)
        patches.revert(names)
        ldt.destroy_vtp()
    ref = runs["ref"]

    def diff(kind: str, mode: str) -> float:
        return max(float((runs[mode][kind][n] - t).abs().max()) for n, t in ref[kind].items())

    return {"grad_diff": {m: diff("grads", m) for m in ("inline", "store")},
            "weight_diff": {m: diff("weights", m) for m in ("inline", "store")},
            "ready": {m: runs[m]["ready"] for m in runs}, "after_b0": runs["store"]["after_b0"],
            "params": sorted(ref["grads"]),
            "zero_in_ref": [n for n, t in ref["grads"].items() if not t.abs().sum()],
            "grad_norm": sum(float(t.abs().sum()) for t in ref["grads"].values())}


def _world(rank, world, variants):
    return [_compare(rank, world, **v) for v in variants]


VARIANTS = [dict(tp=1, dp=2, sp=False, fused=False), dict(tp=1, dp=2, sp=False, fused=True),
            dict(tp=2, dp=1, sp=True, fused=False)]


@pytest.fixture(scope="module")
def world():
    return run_local_world(2, _world, (VARIANTS,), timeout_s=240, comm_timeout_s=60)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_split_gives_megatrons_gradients_and_ddp_fires_after_w(world, variant):
    for rank, results in enumerate(world):
        r = results[variant]
        label = f"rank {rank} {VARIANTS[variant]}"
        assert r["grad_norm"] > 0, label
        # every main_grad after DP reduce and every weight after Adam: bit for bit (fp32)
        assert r["grad_diff"] == {"inline": 0.0, "store": 0.0}, label
        assert r["weight_diff"] == {"inline": 0.0, "store": 0.0}, label
        split = [n for n in r["params"] if n.endswith(SPLIT)]
        assert len(split) == 4 * MODEL["num_layers"] + 1, label
        for mode, fired in r["ready"].items():
            # DDP's hook fires once per parameter and micro-batch: for a split weight in its
            # W (store), else in its B; the last micro-batch's makes it ready for the reduce
            assert len(fired) == M * len(r["params"]), (label, mode)
            for n, phase, last in fired:
                op = "W" if mode == "store" and n in split else "B"
                assert phase[0] == op and last == (phase == f"{op}{M - 1}"), (label, mode, n)
            assert sorted(n for n, _, last in fired if last) == r["params"], (label, mode)
        # after micro-batch 0's B, a split weight's main_grad is untouched, the rest is not
        assert all(r["after_b0"][n] == 0 for n in split), label
        # TP 2 pads the vocabulary to 256: rank 1's embedding and head rows are padding
        padding = ["embedding.word_embeddings.weight", "output_layer.weight"]
        assert r["zero_in_ref"] == (padding if VARIANTS[variant]["tp"] == 2 and rank == 1
                                    else []), label
        assert [n for n in r["params"] if n not in split and r["after_b0"][n] == 0] == \
            [n for n in r["zero_in_ref"] if n not in split], label


# ---- the store's order rules (no processes) ------------------------------------------------
class FakeSeam:
    def __init__(self):
        self.ran = []

    @contextlib.contextmanager
    def deferring(self, key, sink):
        sink(f"work of {key}")
        yield

    def run(self, key, items):
        self.ran.append((key, items))


def test_store_runs_each_w_once_after_its_b():
    seam = FakeSeam()
    store = WgradStore(seam)
    for key in [(0, "end"), (0, "start"), (1, "end")]:
        with store.capture(key):
            pass
    assert store.pending() == [(0, "end"), (0, "start"), (1, "end")]
    store.run((0, "start"))  # chunks are independent queues
    store.run((0, "end"))
    store.run((1, "end"))
    assert seam.ran == [((0, "start"), ["work of (0, 'start')"]),
                        ((0, "end"), ["work of (0, 'end')"]),
                        ((1, "end"), ["work of (1, 'end')"])]
    store.finish()
    with store.capture((0, "end")):  # a new step starts empty
        pass


@pytest.mark.parametrize("steps, message", [
    ([("run", (2, "end"))], r"the W of micro-batch 2, chunk 'end' runs before its B"),
    ([("B", (0, "s")), ("run", (0, "s")), ("run", (0, "s"))],
     r"the W of micro-batch 0, chunk 's' runs twice"),
    ([("B", (0, "s")), ("B", (0, "s"))], r"the backward of micro-batch 0, chunk 's' runs twice"),
    ([("B", (0, "s")), ("B", (1, "s")), ("run", (1, "s"))],
     r"the W of micro-batch 1, chunk 's' runs before the W of micro-batch 0, chunk 's'"),
    ([("B", (0, "s")), ("B", (1, "e")), ("finish", None)],
     r"the step ended with the W of micro-batch 0, chunk 's' \(and 1 more\) not run"),
])
def test_store_refuses_out_of_order_w(steps, message):
    store = WgradStore(FakeSeam())
    with pytest.raises(WgradOrderError, match=message):
        for op, key in steps:
            if op == "B":
                with store.capture(key):
                    pass
            elif op == "run":
                store.run(key)
            else:
                store.finish()


def test_nested_capture_is_refused():
    store = WgradStore(FakeSeam())
    with pytest.raises(WgradOrderError, match=r"inside the capture of micro-batch 0"):
        with store.capture((0, "s")):
            with store.capture((1, "s")):
                pass


# ---- the patch: registry, version, backend choice (no processes) --------------------------
def test_patch_applies_and_reverts_megatrons_names():
    from megatron.core.tensor_parallel import layers

    from ldt import patches

    original = layers.LinearWithGradAccumulationAndAsyncCommunication
    had = hasattr(layers, "fused_weight_gradient_mlp_cuda")
    with patches.applied(["wgrad_split"]):
        split = layers.LinearWithGradAccumulationAndAsyncCommunication
        assert split is not original and issubclass(split, original)
        assert hasattr(layers, "fused_weight_gradient_mlp_cuda")
    assert layers.LinearWithGradAccumulationAndAsyncCommunication is original
    assert hasattr(layers, "fused_weight_gradient_mlp_cuda") == had


def _fake_te_layer(delay: bool):
    import torch

    class Config:
        delay_wgrad_compute = delay

    cls = type("Linear", (torch.nn.Linear,), {"__module__": "transformer_engine.pytorch.module"})
    cls2 = type("TELinear", (cls,), {"__module__": "megatron.core.extensions.transformer_engine",
                                    "backward_dw": lambda self: calls.append(self.tag)})
    layer = cls2(2, 2)
    layer.config = Config()
    return layer


calls: list = []


def test_backend_is_local_without_te_layers_and_te_where_it_can_split():
    import torch

    from ldt.patches import PatchError
    from ldt.patches.wgrad_split import WgradSeam, te_linears, wgrad_backend

    local = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert wgrad_backend(local, te=None) == "local"
    te_chunk = torch.nn.Sequential(_fake_te_layer(True), _fake_te_layer(True))
    assert len(te_linears(te_chunk)) == 2
    assert wgrad_backend(te_chunk, te="2.3.0") == "te"
    assert wgrad_backend(te_chunk, te="2.8.0+cu13") == "te"
    with pytest.raises(PatchError, match=r"Transformer Engine 2\.2\.1 cannot delay .*>=2\.3"):
        wgrad_backend(te_chunk, te="2.2.1")
    with pytest.raises(PatchError, match=r"Transformer Engine \(not found\) cannot delay"):
        wgrad_backend(te_chunk, te=None)
    with pytest.raises(PatchError, match=r"built with delay_wgrad_compute=False"):
        wgrad_backend(torch.nn.Sequential(_fake_te_layer(False)), te="2.3.0")
    # W on a TE chunk: each TE layer's backward_dw, last layer first (backward order)
    for i, layer in enumerate(te_chunk):
        layer.tag = i
    calls.clear()
    WgradSeam({"end": te_chunk, "start": local}, te="2.4").run((0, "end"), [])
    assert calls == [1, 0]
    WgradSeam({"end": te_chunk, "start": local}, te="2.4").run((0, "start"), [])
    assert calls == [1, 0]


# ---- W hands autograd its gradients without a copy (no processes) --------------------------
def _ops_during(fn, seen: list) -> list:
    """The aten ops ``fn`` dispatches (autograd's accumulators' included), added to ``seen``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with Spy():
        fn()
    return seen


@pytest.mark.parametrize("fused", [False, True])
def test_w_accumulates_each_weight_once_and_copies_no_gradient(fused):
    """A gradient W hands autograd must reach the weight's accumulator unreferenced, so the
    accumulator takes it instead of copying it (a weight-sized copy per layer and micro-batch
    made B + W ~20% slower than the unsplit backward); each weight's accumulator (where
    megatron DDP hooks) fires once per W, in backward order, before the next weight's
    gradient is made (one at a time, as in the unsplit backward); a weight used twice gets
    the sum."""
    import torch

    from ldt.patches.wgrad_split import WgradWork, _Pending, run_wgrad

    g = torch.Generator().manual_seed(3)
    weights = [torch.nn.Parameter(torch.randn(6, 4, generator=g)) for _ in range(2)]
    events, accumulators = [], []  # kept alive, as megatron DDP keeps them
    for i, w in enumerate(weights):
        accumulators.append(w.expand_as(w).grad_fn.next_functions[0][0])
        accumulators[-1].register_hook(lambda *_, i=i: events.append(f"hook {i}"))
        if fused:
            w.main_grad, w.grad_added_to_main_grad = torch.zeros(6, 4), False
    kernel = CpuFusedKernels.wgrad_gemm_accum_fp32 if fused else None
    pairs = [(weights[i], torch.randn(5, 4, generator=g), torch.randn(5, 6, generator=g))
             for i in (0, 1, 0)]  # weight 0 used twice
    works = [WgradWork(_Pending(w, fused, False, torch.float32), kernel, x, dy)
             for w, x, dy in pairs]
    ops = _ops_during(lambda: run_wgrad(works), events)
    assert [e for e in events if e in ("aten.mm", "hook 0", "hook 1")] == \
        ["aten.mm", "aten.mm", "hook 0", "aten.mm", "hook 1"], events
    want = [sum(dy.t() @ x for w, x, dy in pairs if w is weights[i]) for i in range(2)]
    for w, expected in zip(weights, want):
        got = w.main_grad if fused else w.grad
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        assert not fused or w.grad_added_to_main_grad
    assert ops.count("aten.mm") == 3, ops
    assert not {"aten.clone", "aten.copy_"} & set(ops), ops
