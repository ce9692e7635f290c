"""The memory estimate's arithmetic and what a user reads (issue #45): ``StageEstimate``'s
peak and its parts on numbers chosen by hand (each term a different power of two, so a term
dropped or counted twice shows), when a config is estimated at all, and the table and the
one-line refusal, read in full. No process, no model: the terms are given."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ldt.memory import GIB, StageEstimate

MIB = 2**20


def stage(**over) -> StageEstimate:
    """Weights 1, grads 2, main 4, optimizer 8 (resident 15); activations 16 x 2 + 32 x 1 (64);
    transient 128; one receive and two sent tensors of 256 (768); step transient 3."""
    base = dict(index=0, name="edge", device="cpu", tp=1, dp=1, ranks=[0], recompute="-",
                attention="local", weights=1, grads=2, main_params=4, optimizer=8,
                activations=[16, 32], inflight=(2, 1), transient=128, recv_buffers=1,
                boundary_tensor=256, step_transient=3)
    return StageEstimate(**(base | over))


def test_the_peak_is_resident_plus_activations_plus_buffers_plus_transient():
    st = stage()
    assert (st.resident, st.activation_bytes, st.recv_tensor) == (15, 64, 256)
    assert st.buffer_bytes == 256  # no sent tensor by default
    st = stage(sent=2)
    assert st.buffer_bytes == 256 + 2 * 256
    assert st.peak == 15 + 64 + 768 + 128 == 975
    assert st.peak_transient == 128
    assert st.components() == {"weights": 1, "gradients": 2, "fp32 main params": 4,
                               "optimizer states": 8, "activations": 64,
                               "receive buffers": 768, "transient": 128}


def test_a_sequence_parallel_receive_holds_the_whole_and_its_slice():
    """A posted receive of a stage in 3 slices: the leader's whole tensor (256) and the slice
    it scatters into, 256 // 3 = 85 bytes."""
    assert stage(shards=3).recv_tensor == 256 + 85
    assert stage(shards=3, recv_buffers=2, sent=1).buffer_bytes == 2 * 341 + 256
    assert stage(shards=1).recv_tensor == 256


@pytest.mark.parametrize("step,peak,transient", [
    (64 + 256 + 128, 15 + 64 + 256 + 128, 128),  # equal: the pipeline's moment
    (64 + 256 + 129, 15 + 64 + 256 + 129, 64 + 256 + 129),  # the optimizer step's
])
def test_the_optimizer_steps_transient_wins_only_above_the_pipelines_moment(step, peak,
                                                                            transient):
    st = stage(step_transient=step)
    assert (st.peak, st.peak_transient) == (peak, transient)
    assert st.components()["transient"] == transient


def test_a_stage_fits_when_its_peak_is_at_most_its_limit():
    peak = stage().peak
    assert stage().fits and stage(limit=peak).fits
    assert not stage(limit=peak - 1).fits


def test_needs_estimate_asks_train_estimate_memory_then_any_stated_memory():
    from ldt.memory import needs_estimate

    def cfg(asked, *limits):
        train = {} if asked == "unset" else {"estimate_memory": asked}
        return {"train": train, "cluster": {"stages": [{"memory_gib": g} for g in limits]}}

    assert needs_estimate(cfg(True, None)) and needs_estimate(cfg(1, None))
    assert not needs_estimate(cfg(False, 40.0))
    assert needs_estimate(cfg(None, None, 40.0)) and needs_estimate(cfg("unset", 40.0))
    assert not needs_estimate(cfg(None, None, None)) and not needs_estimate(cfg("unset"))


def test_estimate_runs_the_worker_in_one_helper_process_without_a_process_group(monkeypatch):
    """``estimate`` starts one helper process (a world of 1) by the worker's name, without a
    process group (the helper becomes a rank of a fake world itself), hands it the config and
    the attention, and returns that one rank's answer; by default ``auto`` attention and 600
    s."""
    import ldt.memory
    from ldt.launch import local

    calls = []

    def run_local_world(*args, **kwargs):
        calls.append((args, kwargs))
        return [f"rank 0's stages {len(calls)}", "no second rank"]

    monkeypatch.setattr(local, "run_local_world", run_local_world)
    cfg = {"cluster": {}, "model": {}, "train": {}}
    assert ldt.memory.estimate(cfg) == "rank 0's stages 1"
    assert ldt.memory.estimate(cfg, "flash", 5.0) == "rank 0's stages 2"
    assert calls == [
        ((1, "ldt.memory.stages:estimate_worker", (cfg, "auto")),
         {"timeout_s": 600.0, "init_dist": False}),
        ((1, "ldt.memory.stages:estimate_worker", (cfg, "flash")),
         {"timeout_s": 5.0, "init_dist": False})]


def test_what_a_process_makes_once_is_in_every_chunks_transient():
    """The first chunk's measure made it (once 10, 0, 5 of transients 100, 50, 70): each
    chunk's transient is its own without its once-made part, plus all of it (15)."""
    from ldt.memory.stages import _transients
    from ldt.memory.measure import ChunkMemory

    chunks = [ChunkMemory(0, 100, 10), ChunkMemory(0, 50, 0), ChunkMemory(0, 70, 5)]
    assert _transients(chunks) == [105, 65, 80]


# ---- the table and the refusal, read in full ------------------------------------------------
def test_the_table_shows_every_part_per_stage_in_mib():
    from ldt.memory.report import table

    edge = stage(name="edge", ranks=[0], weights=MIB, grads=MIB, main_params=0,
                 optimizer=2 * MIB, activations=[MIB // 2, MIB], inflight=(4, 1),
                 transient=MIB // 4, recv_buffers=1, boundary_tensor=MIB // 8, sent=1,
                 step_transient=0, limit=4 * MIB)
    cloud = stage(index=1, name="cloud", tp=2, ranks=[1, 2, 3, 4], recompute="full",
                  attention="flash", weights=3 * MIB, grads=3 * MIB, main_params=0,
                  optimizer=0, activations=[MIB], inflight=(2,), transient=0, recv_buffers=0,
                  boundary_tensor=0, step_transient=0)
    assert table([edge, cloud]).split("\n") == [
        "stage    ranks  tp  recompute  weights  grads  main  optim  act/mb x in flight  "
        "buffers  transient  peak    limit",
        "-------  -----  --  ---------  -------  -----  ----  -----  ------------------  "
        "-------  ---------  ------  -----",
        "0:edge   0      1   -          1.00     1.00   0.00  2.00   0.50x4 + 1.00x1     "
        "0.25     0.25       7.50 !  4.00",
        "1:cloud  1-4    2   full       3.00     3.00   0.00  0.00   1.00x2              "
        "0.00     0.00       8.00    -",
        "memory per rank, MiB (estimate: the stages' real chunks on fake tensors, two "
        "micro-batches through megatron-core; attention flash/local); '!' exceeds the "
        "stage's memory_gib"]


def test_the_table_switches_to_gib_at_one_gib_and_lists_ranks_compactly():
    from ldt.memory.report import _ranks, table

    assert [_ranks(r) for r in ([5], [0, 1], [0, 1, 2], [0, 2, 3], [3, 4, 5, 6])] == \
        ["5", "0,1", "0-2", "0,2,3", "3-6"]
    at = stage(weights=GIB - 15 - 64 - 256 - 128 + 1)  # peak exactly 1 GiB
    assert at.peak == GIB
    assert "memory per rank, GiB" in table([at]) and " 1.00 " in table([at]).split("\n")[2]
    below = stage(weights=GIB - 15 - 64 - 256 - 128)
    assert "memory per rank, MiB" in table([below])


def test_a_zero_bubble_table_adds_the_w_store_column():
    """``train.schedule=zb``: a column of each chunk's W store entry x entries held, between
    the buffers and the transient, shown as soon as one stage has a W store (here the edge,
    two chunks: 0.25 MiB x 2 + 0.50 MiB x 1 = 1 MiB; the cloud stage's cell is empty). Peaks:
    edge 1 + 1 (resident) + 1 + 1 (activations) + 1 (W store) = 5 MiB, cloud 3 + 2 = 5 MiB."""
    from ldt.memory.report import table

    edge = stage(weights=MIB, grads=MIB, main_params=0, optimizer=0, activations=[MIB, MIB],
                 inflight=(1, 1), transient=0, recv_buffers=0, boundary_tensor=0,
                 step_transient=0, wstore=[MIB // 4, MIB // 2], wstore_held=(2, 1))
    cloud = stage(index=1, name="cloud", ranks=[1], weights=3 * MIB, grads=0, main_params=0,
                  optimizer=0, activations=[MIB], inflight=(2,), transient=0, recv_buffers=0,
                  boundary_tensor=0, step_transient=0)
    assert table([cloud, edge]).split("\n")[:4] == [
        "stage    ranks  tp  recompute  weights  grads  main  optim  act/mb x in flight  "
        "buffers  W store/mb x held  transient  peak  limit",
        "-------  -----  --  ---------  -------  -----  ----  -----  ------------------  "
        "-------  -----------------  ---------  ----  -----",
        "1:cloud  1      1   -          3.00     0.00   0.00  0.00   1.00x2              "
        "0.00                        0.00       5.00  -",
        "0:edge   0      1   -          1.00     1.00   0.00  0.00   1.00x1 + 1.00x1     "
        "0.00     0.25x2 + 0.50x1    0.00       5.00  -"]


def _topo(u_shape: bool, stages: int):
    return SimpleNamespace(u_shape=u_shape, num_stages=stages)


def test_a_refusal_names_the_stage_the_peak_the_limit_the_largest_part_and_the_levers():
    """Activations the largest part, no recomputation, one replica, not the last stage of a
    plain pipeline, no prefetch."""
    from ldt.memory.report import refusal

    st = stage(index=1, name="s1", tp=2, ranks=[1, 2], weights=MIB, grads=MIB, main_params=0,
               optimizer=2 * MIB, activations=[MIB, 2 * MIB], inflight=(3, 1),
               transient=0, recv_buffers=0, step_transient=0, limit=GIB // 1024)
    assert refusal(st, _topo(False, 3), SimpleNamespace(prefetch=0)) == (
        "stage 1 (s1, ranks 1,2) needs 9.00 MiB per rank (estimate) but "
        "cluster.stages[1].memory_gib=0.000976562; the largest part is activations 5.00 MiB "
        "(3 micro-batches x 1.00 MiB + 1 micro-batch x 2.00 MiB in flight); levers: recompute "
        "that stage (cluster.stages[1].recompute.granularity=selective, or full with method "
        "uniform, num_layers 1); more TP (cluster.stages[1].tp=4); fewer micro-batches in "
        "flight (fewer stages after it, a smaller train.micro_batch_size)")


def test_a_refusal_offers_full_recompute_the_distributed_optimizer_and_less_prefetch():
    """Optimizer states the largest part (GiB), selective recomputation already, two
    replicas without the distributed optimizer, the U-shape's edge with prefetch 2."""
    from ldt.memory.report import refusal

    st = stage(index=0, name="edge", dp=2, ranks=[0, 1], recompute="selective(layernorm)",
               weights=GIB, grads=GIB, main_params=0, optimizer=3 * GIB, activations=[GIB],
               inflight=(1,), transient=0, recv_buffers=0, step_transient=0, limit=4 * GIB)
    assert refusal(st, _topo(True, 3), SimpleNamespace(prefetch=2)) == (
        "stage 0 (edge, ranks 0,1) needs 6.00 GiB per rank (estimate) but "
        "cluster.stages[0].memory_gib=4; the largest part is optimizer states 3.00 GiB; levers: "
        "recompute that stage (cluster.stages[0].recompute.granularity=full with method "
        "uniform, num_layers 1); more TP (cluster.stages[0].tp=2); the distributed optimizer "
        "(train.distributed_optimizer=true); fewer micro-batches in flight (fewer stages after "
        "it, train.prefetch < 2, a smaller train.micro_batch_size)")


@pytest.mark.parametrize("u_shape,index,stages", [(True, 1, 3), (False, 2, 3)])
def test_a_refusal_leaves_out_the_levers_that_cannot_act(u_shape, index, stages):
    """Full recomputation already (no recompute lever), replicas with the distributed
    optimizer, no stage after it (a U-shape's cloud stage, a plain pipeline's last), a train
    config without prefetch."""
    from ldt.memory.report import refusal

    st = stage(index=index, name="c", tp=4, dp=2, ranks=[7], recompute="full(uniform,1)",
               distributed_optimizer=True, activations=[GIB], inflight=(1,),
               limit=GIB // 2)
    assert refusal(st, _topo(u_shape, stages), SimpleNamespace()) == (
        f"stage {index} (c, ranks 7) needs 1.00 GiB per rank (estimate) but "
        f"cluster.stages[{index}].memory_gib=0.5; the largest part is activations 1.00 GiB "
        f"(1 micro-batch x 1.00 GiB in flight); levers: more TP (cluster.stages[{index}].tp=8); "
        "fewer micro-batches in flight (a smaller train.micro_batch_size)")


def test_the_pre_flight_check_refuses_on_the_first_stage_that_does_not_fit(monkeypatch):
    """``check`` (ldt-train's pre-flight): the table of every stage, and the refusal of the
    first stage over its limit (stage 1 here, not stage 2), or None when all fit."""
    from omegaconf import OmegaConf

    import ldt.memory
    from ldt.job.hydra import compose
    from ldt.memory.report import check, refusal, table

    cfg = OmegaConf.to_container(compose(["cluster=cpu_demo", "train.prefetch=1"]),
                                 resolve=True)
    fits = stage(limit=GIB)
    over = [fits, stage(index=1, name="one", limit=10), stage(index=2, name="two", limit=10)]
    topo = _topo(True, 3)
    for got in ([fits], over):
        monkeypatch.setattr(ldt.memory, "estimate", lambda c, got=got: got if c is cfg else 0)
        shown, refused = check(cfg, topo)
        assert shown == table(got)
        assert refused == (None if got == [fits] else
                           refusal(over[1], topo, SimpleNamespace(prefetch=1)))
        # an estimate made already (the elastic job's rank 0, in its own process): no helper
        monkeypatch.setattr(ldt.memory, "estimate", lambda c: 1 / 0)
        assert check(cfg, topo, stages=got) == (shown, refused)
    assert "train.prefetch < 1" in refused  # the run's train config, not a default


# ---- the measuring tools, on real tensors ------------------------------------------------------
def test_live_peak_counts_live_storages_and_their_peak():
    """torch's MemTracker reduced to live storage bytes: what exists now, the highest point
    since reset_peak (the reset returns the bytes alive then), views counted once."""
    import torch

    from ldt.memory.measure import LivePeak

    fresh = LivePeak()  # nothing tracked yet: nothing alive, no peak
    assert (fresh.current(), fresh.peak()) == (0, 0)
    with fresh:  # a peak before any reset_peak: the highest point so far
        kept = torch.empty(1000, dtype=torch.float32)
        assert fresh.peak() >= fresh.current() >= 4000
    del kept

    tracker = LivePeak()
    with tracker:
        base = tracker.reset_peak()
        a = torch.empty(1000, dtype=torch.float32)  # 4000 bytes
        view = a[10:20]
        assert tracker.current() - base == 4000
        b = torch.empty(500, dtype=torch.float64)  # 4000 more
        assert tracker.current() - base == 8000 and tracker.peak() - base == 8000
        del b
        assert tracker.current() - base == 4000 and tracker.peak() - base == 8000
        assert tracker.reset_peak() - base == 4000 and tracker.peak() - base == 4000
        c = torch.empty(250, dtype=torch.float32)
        assert tracker.peak() - base == 5000
        del a, view, c
        assert tracker.current() == base


def test_live_peak_puts_back_a_peak_taken_before():
    """``set_peak``: a peak taken before is put back (what ran since is counted elsewhere),
    never below what is alive now."""
    import torch

    from ldt.memory.measure import LivePeak

    tracker = LivePeak()
    with tracker:
        base = tracker.reset_peak()
        tracker.set_peak(base + 6000)
        assert tracker.peak() - base == 6000
        d = torch.empty(2000, dtype=torch.float32)  # 8000 bytes alive, above the 6000 put back
        tracker.set_peak(base + 6000)
        assert tracker.peak() - base == 8000
        del d
        assert tracker.peak() - base == 8000


def test_the_optimizer_step_is_measured_as_torch_steps_on_the_stages_device():
    """``_measure_step`` on real tensors: one AdamW step over a parameter of 1000 fp32 values
    (known to the tracker, its gradient made before the step) creates the optimizer's states,
    exp_avg and exp_avg_sq of 4000 bytes each and the step count (a one-value fp32 tensor, 4
    bytes); torch's single-tensor loop on a cpu stage (torch's default there), its foreach
    loop elsewhere. The torch optimizers are megatron's inner ones, one per chained
    optimizer."""
    from types import SimpleNamespace

    import torch

    from ldt.memory.measure import LivePeak, _inner_optimizers, _measure_step

    for device, foreach in (("cpu", False), ("cuda", True)):
        p = torch.nn.Parameter(torch.zeros(1000))
        opt = torch.optim.AdamW([p])
        tracker = LivePeak()
        tracker.track_external(p)  # as measure_stage tells it of the resident part first
        with tracker:
            states, step = _measure_step(tracker, [opt], device)
        assert opt.param_groups[0]["foreach"] is foreach
        assert states == 2 * 4000 + 4 and step >= 0
    one = SimpleNamespace(optimizer="torch's")
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer="first"),
                                                  SimpleNamespace(optimizer="second")])
    assert _inner_optimizers(one) == ["torch's"]
    assert _inner_optimizers(chained) == ["first", "second"]


def test_the_resident_parts_are_read_off_every_ddp_buffer_and_each_storage_once():
    """A DDP's gradient buffers: its dense ones, then its expert-parallel ones (a MoE
    model's), either absent on some DDPs. The tracker is told of each counted storage through
    one uint8 tensor over it (all its bytes, on its device)."""
    from types import SimpleNamespace

    import torch

    from ldt.memory.measure import _ddp_buffers, _storages_of

    assert _ddp_buffers(SimpleNamespace()) == []
    assert _ddp_buffers(SimpleNamespace(buffers=["dense"])) == ["dense"]
    assert _ddp_buffers(SimpleNamespace(expert_parallel_buffers=["experts"])) == ["experts"]
    assert _ddp_buffers(SimpleNamespace(buffers=["dense"], expert_parallel_buffers=["e1", "e2"])
                        ) == ["dense", "e1", "e2"]
    on_cpu = torch.zeros(5, dtype=torch.float16).untyped_storage()  # 10 bytes
    on_meta = torch.empty(3, dtype=torch.float32, device="meta").untyped_storage()  # 12 bytes
    got = _storages_of({on_cpu: True, on_meta: True})
    assert [(t.dtype, t.numel(), t.device.type) for t in got] == [
        (torch.uint8, 10, "cpu"), (torch.uint8, 12, "meta")]
    assert got[0].untyped_storage().data_ptr() == on_cpu.data_ptr()


def test_attention_is_flash_on_cuda_stages_unless_asked():
    from types import SimpleNamespace

    from ldt.memory.measure import attention_of

    te, local = SimpleNamespace(transformer_impl="auto"), SimpleNamespace(transformer_impl="local")
    assert attention_of(te, "cuda") == "flash" and attention_of(local, "cuda") == "local"
    assert attention_of(te, "cpu") == "local" and attention_of(te, "npu") == "local"
    assert attention_of(te, "cpu", "flash") == "flash"
    assert attention_of(te, "cuda", "local") == "local"


def test_the_flash_stand_in_keeps_qkv_its_output_and_the_log_sum_exp():
    """Grouped-query shapes (q 4 heads, k and v 2, head size 8, s 16, b 2): the stand-in's
    output is [s, b, heads * d]; it keeps q, k, v, its output and an fp32 log-sum-exp [b,
    heads, s]; its backward gives each input a gradient of that input's shape."""
    import torch

    from ldt.memory.measure import FlashAttention

    q = torch.zeros(16, 2, 4, 8, dtype=torch.bfloat16, requires_grad=True)
    k = torch.zeros(16, 2, 2, 8, dtype=torch.bfloat16, requires_grad=True)
    v = torch.zeros(16, 2, 2, 8, dtype=torch.float64, requires_grad=True)
    out = FlashAttention()(q, k, v, None)
    assert tuple(out.shape) == (16, 2, 32) and out.dtype == torch.bfloat16
    saved = out.grad_fn.saved_tensors
    assert [tuple(t.shape) for t in saved] == [(16, 2, 4, 8), (16, 2, 2, 8), (16, 2, 2, 8),
                                               (16, 2, 32), (2, 4, 16)]
    assert saved[4].dtype == torch.float32 and saved[3].dtype == torch.bfloat16
    out.sum().backward()
    assert [tuple(t.grad.shape) for t in (q, k, v)] == [(16, 2, 4, 8), (16, 2, 2, 8),
                                                         (16, 2, 2, 8)]
    assert v.grad.dtype == torch.float64


def test_the_in_process_estimate_refuses_a_process_with_a_process_group():
    import torch.distributed as dist

    from ldt.memory.stages import estimate_here

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match=r"^estimate_here needs a process without a "
                           r"process group \(it becomes a rank of a fake world\); call "
                           r"ldt.memory.estimate instead$"):
            estimate_here({})
    finally:
        dist.destroy_process_group()


def test_the_in_process_estimate_is_the_helpers_rank_0_of_1(monkeypatch):
    """Without a process group, ``estimate_here`` runs the worker as the helper process
    would: rank 0 of a world of 1, with the config and the attention (``auto`` by
    default)."""
    from ldt.memory import stages

    calls = []
    monkeypatch.setattr(stages, "estimate_worker", lambda *a: calls.append(a) or len(calls))
    cfg = {"cluster": {}}
    assert (stages.estimate_here(cfg), stages.estimate_here(cfg, "flash")) == (1, 2)
    assert calls == [(0, 1, cfg, "auto"), (0, 1, cfg, "flash")]


def test_the_worker_validates_the_train_settings_and_routes_only_a_moe_models_experts(
        monkeypatch):
    """The estimate refuses what training refuses, train settings included, before it
    measures anything; each stage is measured as its leader of the whole world (cpu_demo:
    TP 1, 2, 1, so 4 ranks; stage 0's leader rank 0), with BalancedRouting's ``(topk, experts)`` for a MoE
    model (qwen3_moe_tiny: top-2 of 8) and none for a dense one (gpt_tiny)."""
    from omegaconf import OmegaConf

    from ldt.config.errors import ConfigError
    from ldt.job.hydra import compose
    from ldt.memory import stages

    def cfg(*over):
        return OmegaConf.to_container(compose(["cluster=cpu_demo", *over]), resolve=True)

    with pytest.raises(ConfigError, match=r"train.eval_every=-1 must be >= 0"):
        stages.estimate_here(cfg("train.eval_every=-1"))

    class Entered(Exception):
        pass

    def fake_rank(world_size, rank, experts=None):
        raise Entered(world_size, rank, experts)

    monkeypatch.setattr(stages, "fake_rank", fake_rank)
    for model, experts in (("gpt_tiny", None), ("qwen3_moe_tiny", (2, 8))):
        with pytest.raises(Entered) as entered:
            stages.estimate_here(cfg(f"model={model}"))
        assert entered.value.args == (4, 0, experts)


def test_a_zero_bubble_stage_whose_peak_is_a_w_takes_the_ws_transient(monkeypatch):
    """``train.schedule=zb``: a W's transient is its own (every weight gradient of the chunk
    at once), not the forward's and B's. With the measure stubbed (nothing held, a forward /
    B transient of 1 byte, a W's of 1000) every stage's fullest moment is one of its Ws:
    transient and peak 1000 bytes."""
    from omegaconf import OmegaConf

    from ldt.job.hydra import compose
    from ldt.memory import stages
    from ldt.memory.measure import ChunkMemory, StageMeasure
    from test_memory_total import OVERRIDES

    def measure_stage(c, topo, state, device, attention):
        return StageMeasure(0, 0, 0, 0, [ChunkMemory(0, 1, 0, 0, 1000)], 0, 0, "local")

    monkeypatch.setattr(stages, "measure_stage", measure_stage)
    cfg = OmegaConf.to_container(compose(OVERRIDES + ["train.schedule=zb"]), resolve=True)
    got = stages.estimate_here(cfg)
    assert [(s.transient, s.peak) for s in got] == [(1000, 1000)] * 3


def test_the_launcher_names_the_estimates_helper_and_loads_no_megatron():
    """ldt-train's launcher and ldt-memory import the estimate without megatron-core (its INFO
    records would reach every torchrun rank's Hydra handler, and a refusal would wait for it):
    the helper process imports the measuring side by name."""
    import subprocess
    import sys

    from ldt.launch.local import entry
    from ldt.memory import stages

    assert entry("ldt.memory.stages:estimate_worker") is stages.estimate_worker
    code = ("import sys, ldt.memory, ldt.memory.report, ldt.job.prepare, ldt.tools.memory\n"
            "assert 'megatron' not in sys.modules and 'torch' not in sys.modules, 'loaded'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_failed_estimate_says_why_and_the_run_starts(monkeypatch, capsys):
    """A forecast stops nothing: an estimate whose helper failed is a warning that names the
    cause (the last line of the helper's traceback, not "rank 0 failed"), and the run starts."""
    from ldt.job import prepare
    from ldt.launch.local import WorldError

    def fail(*_):
        raise WorldError("rank 0 failed", 0, "Traceback (most recent call last):\n  ...\n"
                         "ValueError: the stage's chunk could not be built\n")

    monkeypatch.setattr(prepare.memory_report, "check", fail)
    plain = {"train": {"estimate_memory": True}, "cluster": {"stages": []}}
    assert prepare.memory_estimate(plain, None) == ("", None)
    err = capsys.readouterr().err
    assert err == ("ldt: warning: the memory estimate failed (ValueError: the stage's chunk "
                   "could not be built); starting without it\n"), err

    def stopped(*_):  # Ctrl-C while the helper world ran: the user stops the launch
        raise WorldError("stopped", None, stopped_by=2)

    monkeypatch.setattr(prepare.memory_report, "check", stopped)
    with pytest.raises(WorldError) as caught:
        prepare.memory_estimate(plain, None)
    assert caught.value.stopped_by == 2 and capsys.readouterr().err == ""
