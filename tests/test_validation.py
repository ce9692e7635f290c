"""Every bad config is refused by `ldt-train` with the field, the value and the fix.

Each case runs the real entry point in a subprocess (with a timeout: a hang fails fast) and
checks the exit status and the message. Expected texts are written here by hand.
"""

import os
import subprocess
import sys

import pytest

CASES = {
    "world_size": ([], {"WORLD_SIZE": "3", "RANK": "0"},
                   ["world size is 3", "dp * sum(tp) = 1 * 4 = 4", "launch 4 processes"]),
    "tp_heads": (["cluster.stages.1.tp=3"], {},
                 ["cluster.stages[1].tp=3", "model.num_attention_heads=4"]),
    "tp_hidden": (["model.num_attention_heads=2", "model.hidden_size=65"], {},
                  ["cluster.stages[1].tp=2", "model.hidden_size=65"]),
    "layer_count": (["model.num_layers=7"], {},
                    ["cluster.layout", "6 decoder layers", "model.num_layers is 7", "fix:"]),
    "E_misplaced": (["cluster.layout=tE|tt|tt|tL"], {}, ["cluster.layout", "'E'", "first token"]),
    "L_misplaced": (["cluster.layout=Et|tt|tt|Lt"], {}, ["cluster.layout", "'L'", "last token"]),
    "u_shape_one_stage": (["cluster.stages=[{name:a,device:cpu,tp:1}]", "cluster.layout=null"],
                          {}, ["cluster.u_shape=true needs at least 2 stages", "got 1"]),
    "unknown_device": (["cluster.stages.0.device=tpu"], {},
                       ["cluster.stages[0].device='tpu'", "cuda, npu, cpu"]),
    "device_missing": (["cluster=mixed_gpu_npu", "model=llama_7b"], {},
                       ["cluster.stages[0].device='cuda'", "this machine has only ['cpu']"]),
    "dp_zero": (["cluster.dp=0"], {}, ["cluster.dp=0 must be >= 1"]),
    "typo_key": (["+cluster.stages.0.devise=cpu"], {}, ["devise"]),
    "interleaved_one_chunk": (["cluster=cpu_vtp", "train.schedule=interleaved"], {},
                              ["train.schedule=interleaved needs several chunks per stage",
                               "k * 3 segments", "Et|t|t|t|t|tL"]),
    "interleaved_m": (["cluster=cpu_vtp", "train.schedule=interleaved",
                       "cluster.layout=Et|t|t|t|t|tL", "train.num_microbatches=4"], {},
                      ["train.num_microbatches=4", "multiple of the stage count", "use 6"]),
    "eval_negative": (["train.eval_every=-1"], {},
                      ["train.eval_every=-1 must be >= 0", "0: no evaluation"]),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_config_is_refused(name):
    overrides, env, expected = CASES[name]
    full_env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    full_env.update(env)
    proc = subprocess.run([sys.executable, "-m", "ldt.train", *overrides], env=full_env,
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    for text in expected:
        assert text in proc.stderr, (text, proc.stderr[-2000:])
