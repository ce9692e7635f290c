"""An unmodified Megatron-core script under `python -m ldt.job.megatron`, VTP vs a uniform cluster.

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
    proc = subprocess.run([sys.executable, "-m", "ldt.job.megatron", "--cluster", str(cluster_file),
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
def test_script_pp_mismatch_is_explained(tmp_path):
    """The script asks for 3 pipeline stages of a 2-stage cluster. Bare, the launcher's report
    ends with the refusal; under torchrun (2 ranks) a rank prints it in one line naming
    itself, no traceback (torchrun stops the other rank as soon as one has failed, so it may
    not get to say it too), and torchrun's summary shows it."""
    import re
    import socket

    two = tmp_path / "two.yaml"
    two.write_text("stages:\n  - {name: a, device: cpu, tp: 1}\n"
                   "  - {name: b, device: cpu, tp: 1}\n")
    proc = run_script(two, "--pp", "3", "--steps", "1")
    assert proc.returncode != 0
    assert "pipeline_model_parallel_size=3" in proc.stderr and "2 stages" in proc.stderr
    refusal = proc.stderr.strip().splitlines()[-1].split("ConfigError: ", 1)[1]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                           "-m", "ldt.job.megatron", "--cluster", str(two), "--timeout", "60",
                           str(SCRIPT), "--pp", "3", "--steps", "1"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    ranks_part, summary = re.split(r"\n[IWE]\d{4} [^\n]* failed \(exitcode", proc.stderr,
                                     maxsplit=1)
    assert "Traceback" not in ranks_part, ranks_part[-3000:]
    lines = [x for x in ranks_part.splitlines()
             if x and not re.match(r"[IWE]\d{4} [\d:.]+ \d+ \S*torch/distributed/", x)]
    want = {f"ldt.job.megatron: rank {r} (stage {r} '{name}', TP rank 0) failed: invalid config: "
            f"{refusal}" for r, name in ((0, "a"), (1, "b"))}
    assert 1 <= len(lines) <= 2 and set(lines) <= want, proc.stderr[-3000:]
    assert f"traceback : {lines[0]}" in summary
