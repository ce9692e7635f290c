"""An unmodified Megatron-core script under `python -m ldt.run`, VTP vs a uniform cluster.

Both pipelines have two stages with the same layers each (megatron splits them), so the VTP
run ([2, 1]: TP 2 then TP 1) must reproduce the uniform run's losses; megatron initializes a
sharded weight as slices of the same full weight, so the models start equal.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "megatron_simple_train.py"


def run_script(cluster_file, *args):
    proc = subprocess.run([sys.executable, "-m", "ldt.run", "--cluster", str(cluster_file),
                           "--timeout", "60", str(SCRIPT), *args],
                          capture_output=True, text=True, timeout=240)
    return proc


@pytest.mark.timeout(300)
def test_script_under_vtp_matches_uniform(tmp_path):
    vtp = tmp_path / "vtp.yaml"
    vtp.write_text("stages:\n  - {name: a, device: cpu, tp: 2}\n  - {name: b, device: cpu, tp: 1}\n")
    uniform = run_script(ROOT / "conf" / "cluster" / "cpu_uniform.yaml", "--pp", "2", "--steps", "3")
    hetero = run_script(vtp, "--pp", "2", "--steps", "3")
    for proc in (uniform, hetero):
        assert proc.returncode == 0, proc.stderr[-3000:]
    want = json.loads(uniform.stdout.strip().splitlines()[-1])["losses"]
    got = json.loads(hetero.stdout.strip().splitlines()[-1])["losses"]
    assert len(got) == 3
    assert got == pytest.approx(want, rel=1e-6)


@pytest.mark.timeout(300)
def test_script_pp_mismatch_is_explained():
    proc = run_script(ROOT / "conf" / "cluster" / "cpu_vtp.yaml", "--pp", "2", "--steps", "1")
    assert proc.returncode != 0
    assert "pipeline_model_parallel_size=2" in proc.stderr and "3 stages" in proc.stderr
