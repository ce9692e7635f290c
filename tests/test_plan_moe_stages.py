"""A model that mixes dense and MoE layers (``model.moe_layer_freq``, e.g. first-k-dense):
each chunk is priced by the layers it holds, not at the model's average (ldt/plan/cost.py and
ldt/plan/moe_cost.py, :attr:`ChunkLoad.moe_layers`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ldt.plan import CostModel, Plan, StageSpec
from ldt.plan.cost import ChunkLoad
from ldt.plan.evaluate import _stage_terms
from ldt.plan.inventory import load_model
from ldt.plan.memory_cost import Recompute
from ldt.plan.synthetic import synthetic_inventory

FIRST_DENSE = [0, 0, 1, 1, 1, 1]  # two dense layers first (DeepSeek's first_k_dense_replace)


def _costs():
    """qwen3_moe_tiny at six layers, the first two dense; the same model with only dense
    layers, and with only MoE layers."""
    mixed = replace(load_model("qwen3_moe_tiny"), moe_layer_freq=FIRST_DENSE)
    dense = replace(mixed, num_moe_experts=None, moe_layer_freq=1)
    moe = replace(mixed, moe_layer_freq=1)
    inv = synthetic_inventory({"a100": 8})
    return tuple(CostModel(m, inv, 1) for m in (mixed, dense, moe))


def test_a_chunk_of_dense_or_moe_layers_costs_what_those_layers_cost():
    """A chunk that says it holds no MoE layer is priced as the dense model's layers, one
    that holds only MoE layers as the all-MoE model's: parameters, activations, recomputation,
    forward and backward times, a zero-bubble W and its store, at TP 1 and 2; a chunk with
    both is the sum of its layers; a chunk that does not say is at the model's average."""
    mixed, dense, moe = _costs()
    rc = Recompute("selective", modules=("mlp",))
    for tp in (1, 2):
        for other, k in ((dense, 0), (moe, 2)):
            for c in (ChunkLoad(2, inflight=3), ChunkLoad(2, embedding=True, recompute=rc),
                      ChunkLoad(2, head=True, recompute=Recompute("full", "uniform", 1))):
                ours = replace(c, moe_layers=k)
                assert mixed.stage_memory("a100", tp, [ours]) == \
                    other.stage_memory("a100", tp, [c]), (tp, k, c)
                assert mixed.chunk_time("a100", tp, ours) == other.chunk_time("a100", tp, c)
                assert mixed.wgrad_time("a100", tp, ours) == other.wgrad_time("a100", tp, c)
                assert mixed.wstore_bytes(tp, ours) == other.wstore_bytes(tp, c)
                assert mixed.wgrad_transient(tp, ours) == other.wgrad_transient(tp, c)
        both = ChunkLoad(2, moe_layers=1)
        assert mixed.chunk_params(tp, both) == pytest.approx(
            dense.chunk_params(tp, ChunkLoad(1)) + moe.chunk_params(tp, ChunkLoad(1)))
        assert sum(mixed.chunk_time("a100", tp, both)) == pytest.approx(
            sum(dense.chunk_time("a100", tp, ChunkLoad(1)))
            + sum(moe.chunk_time("a100", tp, ChunkLoad(1))))
        average = ChunkLoad(6)  # 4 of 6 MoE layers: the model's share
        assert mixed.chunk_params(tp, average) == pytest.approx(
            mixed.chunk_params(tp, ChunkLoad(6, moe_layers=4)))


def test_a_plan_s_chunks_count_the_moe_layers_where_they_sit():
    """U-shape over qwen3_moe_tiny's six layers (dense first and last): the edge's start chunk
    holds layer 0, its end chunk layer 5 (both dense), the cloud stages layers 1-2 and 3-4;
    with the first two layers dense, the first cloud stage holds one MoE layer. A model whose
    layers are all alike leaves the count unset (priced as before)."""
    shipped = CostModel(load_model("qwen3_moe_tiny"), synthetic_inventory({"a100": 8}), 1)
    mixed, dense, moe = _costs()
    plan = Plan((StageSpec("a100", 1),) * 3, (1, 2, 2, 1), True, 1, 4)
    assert [[c.moe_layers for c in plan.stage_chunks(i, cost=shipped)] for i in range(3)] == \
        [[0, 0], [2], [2]]
    assert [[c.moe_layers for c in plan.stage_chunks(i, cost=mixed)] for i in range(3)] == \
        [[0, 1], [1], [2]]
    assert [c.moe_layers for c in plan.stage_chunks(1)] == [None]  # no cost: not known
    for alike in (dense, moe):
        assert {c.moe_layers for i in range(3) for c in plan.stage_chunks(i, cost=alike)} == {None}


def test_the_planner_s_stage_memo_tells_where_a_stage_s_layers_sit():
    """Stage 1 with two layers after one (layers 1-2: one MoE) and after two (layers 2-3:
    both MoE) are two stages to price: the memo that keeps a stage's terms across plans must
    not hand the first's to the second."""
    mixed, _, _ = _costs()
    stages = (StageSpec("a100", 1),) * 3
    after_one = Plan(stages, (1, 2, 3), False, 1, 4)
    after_two = Plan(stages, (2, 2, 2), False, 1, 4)
    first = _stage_terms(after_one, 1, mixed).times
    second = _stage_terms(after_two, 1, mixed).times
    fresh = _costs()[0]
    assert second == _stage_terms(after_two, 1, fresh).times != first


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp,recompute", [(1, None), (2, None), (1, "moe"), (2, "mlp,moe")])
def test_a_stage_of_dense_layers_and_one_of_moe_layers_are_priced_as_estimated(tp, recompute):
    """qwen3_moe_tiny at four layers, the first two dense ([0, 0, 1, 1]), on two cpu stages:
    stage 0 the embedding and the dense layers, stage 1 (TP ``tp``, sequence parallelism) the
    MoE layers and the head. The plan's memory per stage (what ``ldt-sim`` reports) bounds
    the estimate's peak (megatron-core's own layers on fake tensors, ``ldt.memory``) from
    above within 10%, as tests/test_plan_cost_oracles.py holds a stage of a dense model, and
    its weights, gradients and optimizer state are the estimate's (less Adam's step
    counters). At the model's average per layer it was not (MiB, planned / estimated, at TP
    1 and 2): stage 0 3.866 / 3.430 (+12.7%; its weights, gradients and Adam state 1.763 /
    1.380), stage 1 3.151 / 3.317 (-5.0%; 1.764 / 2.147) and 1.662 / 1.764 (-5.8%); now
    3.511 / 3.430, 3.521 / 3.317 and 1.867 / 1.764. With ``recompute``, stage 1 recomputes
    those modules (selective; ``moe``: its MoE layers' whole MLP)."""
    from omegaconf import OmegaConf

    from ldt.config import typed_config
    from ldt.job.hydra import compose
    from ldt.memory.stages import estimate_here
    from ldt.plan import cluster_to_plan, load_inventory, simulate_plan

    cfg = OmegaConf.to_container(compose([
        "model=qwen3_moe_tiny", "model.num_layers=4", "model.moe_layer_freq=[0,0,1,1]",
        "cluster.u_shape=false", "cluster.layout=Ett|ttL",
        f"cluster.stages=[{{name:a,device:cpu,tp:1}},{{name:b,device:cpu,tp:{tp}}}]",
        "train.micro_batch_size=1", "train.num_microbatches=4", "train.runtime=ldt",
        *([] if recompute is None else ["cluster.stages.1.recompute.granularity=selective",
                                        f"cluster.stages.1.recompute.modules=[{recompute}]"])]),
        resolve=True)
    estimated = estimate_here(cfg)
    c = typed_config(cfg)
    inventory = load_inventory("cpu_local")
    plan = cluster_to_plan(c.cluster, c.model, inventory, c.train.num_microbatches)
    cost = CostModel(c.model, inventory, c.train.micro_batch_size)
    assert [[ch.moe_layers for ch in plan.stage_chunks(i, cost=cost)] for i in (0, 1)] == \
        [[0], [2]]
    planned = [s.memory for s in simulate_plan(plan, cost).stages]
    for p, e in zip(planned, estimated):
        assert e.peak <= p.total <= 1.10 * e.peak, (e.index, p.total / 2**20, e.peak / 2**20)
        assert p.weights + p.grads + p.optimizer == pytest.approx(e.resident, rel=1e-3), e.index


def test_moe_recomputation_is_tried_only_where_moe_layers_are():
    """Selective ``moe`` recomputes MoE layers only (megatron ignores it elsewhere, ldt-train
    refuses it on a stage without them): the planner offers it on a stage that holds one,
    and on no other."""
    from ldt.plan.evaluate import recompute_levels

    mixed, dense, moe = _costs()
    assert mixed.holds_moe([ChunkLoad(2, moe_layers=1)])
    assert not mixed.holds_moe([ChunkLoad(2, moe_layers=0), ChunkLoad(0, head=True)])
    assert moe.holds_moe([ChunkLoad(2)])  # every layer a MoE layer: the model's share
    assert not moe.holds_moe([ChunkLoad(0, embedding=True), ChunkLoad(0, head=True)])
    assert not dense.holds_moe([ChunkLoad(2)])

    def offered(cost, chunks):
        return [rc.modules for rc in recompute_levels(cost, "a100", 1, chunks)
                if "moe" in rc.modules]

    assert offered(mixed, [ChunkLoad(2, moe_layers=1)]) == [("layernorm", "moe"),
                                                            ("layernorm", "mlp", "moe")]
    assert offered(mixed, [ChunkLoad(2, moe_layers=0)]) == offered(dense, [ChunkLoad(2)]) == []
