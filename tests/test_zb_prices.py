"""train.schedule=zb generates its order from the run's own plan, priced by the cost model
(ldt/plan/zerobubble.py): each backward split into B and W by the linear layers' weight
gradient, figures derived here by hand from the shapes; the priced order differs from the
equal-cost one on a heterogeneous U-shape and the simulator times it faster with those prices.
Pure: no processes (the parity worlds that run the priced orders are test_ushape.py and
test_p2p_parity.py)."""

from __future__ import annotations

import math

import pytest

from ldt.config import ConfigError, typed_config
from ldt.config.load import config_dict
from ldt.plan.convert import cluster_to_plan, load_cluster
from ldt.plan.cost import CostModel
from ldt.plan.evaluate import op_table
from ldt.plan.inventory import DeviceKind, Inventory, Link, load_inventory, load_model
from ldt.plan.zerobubble import (nominal_inventory, planned_kinds, prices, run_prices,
                                 split_op_table)
from ldt.schedule import Op, lower, simulate
from ldt.schedule.zerobubble import zb_h1, zb_u_shape

# a made-up kind whose numbers make each term visible: 1 TFLOP/s, MFU 0.5, TP efficiency 0.5
KIND = DeviceKind(name="k", device="cpu", count=8, tflops=1.0, memory_gib=100,
                  intra_bw_gbps=1.0, mfu=0.5, tp_efficiency=0.5)
INVENTORY = Inventory(name="visible", kinds=[KIND], links=[Link("k", "k", 1.0, 0.0)])


def _run_cfg(cluster: str, m: int, **train):
    return typed_config({"cluster": config_dict(load_cluster(cluster)),
                         "model": config_dict(load_model("gpt_tiny")),
                         "train": {"num_microbatches": m, "schedule": "zb", **train}})


def test_w_is_the_linear_layers_weight_gradient_by_hand():
    """gpt_tiny (h 64, 4 heads, f 4h, V 256, s 64), b 2: per layer the linear layers' forward
    is 24 b s h^2 FLOPs (QKV 6, projection 2, fc1 8, fc2 8), the head's 2 b s h V; W repeats
    them, at tp * 1e12 * 0.5 * 0.5^log2(tp) FLOP/s. B is the rest of the whole backward."""
    cfg = _run_cfg("cpu_demo", 4)  # Et|tt|tt|tL on TP 1 / 2 / 1
    plan = cluster_to_plan(cfg.cluster, cfg.model, INVENTORY, 4)
    cost = CostModel(cfg.model, INVENTORY, 2)
    b, s, h, v = 2, 64, 64, 256
    layer, head = 24 * b * s * h * h, 2 * b * s * h * v

    def speed(tp):
        return tp * 1e12 * 0.5 * 0.5 ** math.log2(tp)

    split, whole = split_op_table(plan, cost), op_table(plan, cost)
    want = {(0, Op.WE): 1 * layer / speed(1), (0, Op.WS): (1 * layer + head) / speed(1),
            (1, Op.W): 2 * layer / speed(2), (2, Op.W): 2 * layer / speed(1)}
    for (stage, op), t in want.items():
        assert split[stage][op] == pytest.approx(t, rel=1e-12), (stage, op)
    for stage, b_op, w_op in ((0, Op.BE, Op.WE), (0, Op.BS, Op.WS), (1, Op.B, Op.W),
                              (2, Op.B, Op.W)):
        assert split[stage][b_op] + split[stage][w_op] == pytest.approx(whole[stage][b_op])
        assert split[stage][b_op] > 0
    for stage, ops in whole.items():  # forwards unchanged
        for op in (Op.F, Op.FS, Op.FE):
            if op in ops:
                assert split[stage][op] == ops[op]


@pytest.mark.parametrize("cluster,m", [("cpu_demo", 5), ("cpu_demo", 3), ("cpu_vtp", 6)])
def test_the_run_s_order_comes_from_its_prices(cluster, m):
    """The run's prices (run_prices: its cluster, model, m, as ldt-train computes them)
    give an order other than the equal-cost one, and the simulator, timing both with those
    prices, finds the priced order faster: the costs were not ignored."""
    cfg = _run_cfg(cluster, m)
    costs, comm = run_prices(cfg).tables()
    p, u = len(cfg.cluster.stages), cfg.cluster.u_shape
    generate, kind = (zb_u_shape, "ushape") if u else (zb_h1, "1f1b")
    priced, equal = generate(p, m, costs, comm), generate(p, m)
    assert priced != equal
    t_priced = simulate(lower(priced, kind), costs, comm).iteration_time
    t_equal = simulate(lower(equal, kind), costs, comm).iteration_time
    assert t_priced < t_equal, (t_priced, t_equal)


def test_the_run_is_priced_with_its_inventory():
    """Without train.cost_inventory every device type gets cpu_local's figures (so stages
    differ by their plan only); with one, its kinds price the stages."""
    plain = run_prices(_run_cfg("cpu_demo", 4))
    nominal = nominal_inventory(["cpu"])
    cfg = _run_cfg("cpu_demo", 4)
    want = prices(cluster_to_plan(cfg.cluster, cfg.model, nominal, 4),
                  CostModel(cfg.model, nominal, cfg.train.micro_batch_size))
    assert plain == want
    cfg = _run_cfg("cpu_demo", 4, cost_inventory="cpu_elastic")  # two cpu kinds
    with pytest.raises(ConfigError, match=r"cost_inventory.*matches kinds.*name each stage"):
        run_prices(cfg)
    for st, name in zip(cfg.cluster.stages, ("edge", "cloud_cpu_0", "cloud_cpu_1")):
        st.name = name  # as ldt-plan names them: the edge, then KIND_n
    named = run_prices(cfg)
    assert named != plain
    cfg.cluster.stages[2].name = "cloud_cpu.1_0"  # an elastic plan's second node group
    assert planned_kinds(cfg.cluster, load_inventory("cpu_elastic")) == [
        "edge_cpu", "cloud_cpu", "cloud_cpu"]
