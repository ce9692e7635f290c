"""An unmodified megatron-core script under ldt: DDP, finalize_model_grads, tied embeddings,
dist-checkpointing, against the same script on megatron's own uniform parallel state.

``scripts/mcore_tied_train.py`` is written for CUDA and torchrun and knows nothing of ldt. It
runs once per layout, each in a local world started from this process (one forkserver for all):
megatron's ``initialize_model_parallel`` with TP 1 and PP 2 / PP 3 (the baselines, CPU shims
only), and ldt with VTP [1, 2], [2, 1] and [2, 1, 2]. For [2, 1, 2] the script is loaded first
and ``ldt.activate()`` is called after its imports, as a user who adds the line below the
imports does. Layouts split the same layers; megatron initializes a sharded weight as slices of
the same full weight (CPU initialization), so every run starts from the same model.
"""

import atexit
import json
import runpy
import sys
import types
from pathlib import Path

import pytest

from ldt.launch.local import run_local_world

SCRIPT = Path(__file__).parent / "scripts" / "mcore_tied_train.py"
STEPS = 3
LOSS_ATOL = 1e-5
RUNS = {  # name: (world size, pp, how, VTP TP sizes)
    "uniform_pp2": (2, 2, "megatron", None),
    "vtp_1_2": (3, 2, "ldt.job.megatron", [1, 2]),
    "vtp_2_1": (3, 2, "ldt.job.megatron", [2, 1]),
    "uniform_pp3": (3, 3, "megatron", None),
    "vtp_2_1_2": (5, 3, "late_activate", [2, 1, 2]),
}


def _cluster(tps):
    return {"stages": [{"name": f"s{i}", "device": "cpu", "tp": t} for i, t in enumerate(tps)]}


def _run(rank, world, how, tps, args):
    """One rank of one run: the script as a program, under the given parallel state."""
    sys.argv = [str(SCRIPT), *args]
    try:
        if how == "megatron":  # megatron's own groups; only the CPU stand-ins for CUDA calls
            from ldt import patches

            patches.apply(["cpu_shims", "cuda_to_cpu"])
            runpy.run_path(str(SCRIPT), run_name="__main__")
        elif how == "ldt.job.megatron":
            from ldt.job.megatron import _run_script

            _run_script(rank, world, _cluster(tps), None, 60.0, str(SCRIPT), args)
        else:  # the script's imports first, then activate(), then its main
            module = types.ModuleType("mcore_tied_train")
            sys.modules[module.__name__] = module
            module.__file__ = str(SCRIPT)
            exec(compile(SCRIPT.read_text(), str(SCRIPT), "exec"), module.__dict__)
            import ldt.job.megatron

            ldt.job.megatron.activate(_cluster(tps))
            module.main()
    finally:
        atexit._run_exitfuncs()  # the script's exit handlers, as when it ends as a program


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, (world, pp, how, tps) in RUNS.items():
        folder = tmp_path_factory.mktemp(name)
        args = ["--pp", str(pp), "--steps", str(STEPS), "--out", str(folder),
                "--ckpt", str(folder / "ckpt")]
        run_local_world(world, _run, (how, tps, args), timeout_s=180,
                        env={"TORCHELASTIC_USE_AGENT_STORE": "True"}, init_dist=False)
        out[name] = [json.loads((folder / f"rank_{r}.json").read_text()) for r in range(world)]
    return out


def _losses(records):
    found = [r["losses"] for r in records if r["losses"]]
    assert found, "no rank reported losses"
    assert all(f == found[0] for f in found)  # every TP rank of the last stage agrees
    return found[0]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("vtp, uniform", [("vtp_1_2", "uniform_pp2"), ("vtp_2_1", "uniform_pp2"),
                                          ("vtp_2_1_2", "uniform_pp3")])
def test_losses_equal_megatron_uniform(runs, vtp, uniform):
    got, want = _losses(runs[vtp]), _losses(runs[uniform])
    assert len(got) == STEPS
    assert got == pytest.approx(want, abs=LOSS_ATOL)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(RUNS))
def test_tied_output_weight_equals_embedding_every_step(runs, name):
    """The first stage's embedding and the last stage's output weight (each gathered to the
    full vocabulary over its own TP group) are equal after every step, and they moved."""
    import torch

    tied = [r["tied"] for r in runs[name] if r["tied"][0] is not None]
    assert len(tied) == 2, "expected the embedding and the head copy on TP rank 0 of two stages"
    first, last = ([torch.tensor(w) for w in t] for t in tied)
    for step in range(STEPS):
        assert torch.equal(first[step], last[step]), (step, (first[step] - last[step]).abs().max())
    assert not torch.equal(first[0], first[-1])  # trained, not frozen
    assert last[0].abs().sum() > 0  # the head copy is the embedding, not megatron's zeros


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(RUNS))
def test_checkpoint_loads_back_to_the_same_weights(runs, name):
    for r in runs[name]:
        assert r["ckpt_params"] > 0
        assert r["ckpt_max_diff"] == 0.0
