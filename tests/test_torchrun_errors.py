"""Under torchrun, a worker that stops before the world forms writes its one line into the
error file torchrun gives it (``TORCHELASTIC_ERROR_FILE``), so that torchrun's summary names
the cause instead of "error_file: <N/A>" and a link to torch's docs.

Each case runs the real entry point (``python -m ldt.job.train``) in a subprocess with the
environment torchrun gives a worker (no agent: the error file is read back as torchrun's
summary reads it). The elastic job's store timeouts run with a 2 s deadline instead of its
120 s (the one change to the entry point, made in the subprocess).
"""

import json
import os
import subprocess
import sys

import pytest

ELASTIC = """
import sys
import ldt.job.elastic as elastic
real = elastic.form_world
elastic.form_world = lambda plain, model, run, env, timeout_s: real(plain, model, run, env, 2.0)
from ldt.job.train import main
sys.exit(main())
"""


def _worker(tmp_path, args, env, elastic=False):
    """(exit status, stderr's "ldt: " lines, the error file's message or None)."""
    error_file = tmp_path / "error.json"
    full = {k: v for k, v in os.environ.items()
            if not k.startswith(("TORCHELASTIC_", "LDT_", "GROUP_", "LOCAL_"))
            and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    full.update(env, TORCHELASTIC_ERROR_FILE=str(error_file), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-c", ELASTIC] if elastic else [sys.executable, "-m", "ldt.job.train"]
    proc = subprocess.run([*cmd, *args], env=full, cwd=tmp_path, capture_output=True, text=True,
                          timeout=90)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("ldt: ")]
    message = None
    if error_file.exists():
        from torch.distributed.elastic.multiprocessing.errors import (ChildFailedError,
                                                                      ProcessFailure)

        message = json.loads(error_file.read_text())["message"]["message"]
        seen = ProcessFailure(local_rank=0, pid=1, exitcode=proc.returncode,
                              error_file=str(error_file))
        summary = ChildFailedError("ldt.job.train", {0: seen}).format_msg()
        assert f"traceback : {message}\n" in summary, summary  # torchrun's report shows it
    return proc.returncode, lines, message


@pytest.mark.timeout(120)
def test_a_refusal_before_the_world_forms_fills_torchruns_error_file(tmp_path):
    # ldt's own check of the config: the world is not the one the cluster needs
    code, lines, message = _worker(tmp_path, ["run_dir=out"], {"RANK": "0", "WORLD_SIZE": "3"})
    assert code == 2 and len(lines) == 1 and "world size is 3" in lines[0], lines
    assert message == lines[0]
    # refused before Hydra composes the config (a key the schema lacks), on another rank
    (tmp_path / "error.json").unlink()
    code, lines, message = _worker(tmp_path, ["train.stepz=3"], {"RANK": "1", "WORLD_SIZE": "4"})
    assert code == 2 and len(lines) == 1 and "train.stepz" in lines[0], lines
    assert message == lines[0]


def _elastic_env(rank: int, local_rank: int, port: int) -> dict:
    return {"RANK": str(rank), "WORLD_SIZE": "2", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
            "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "LDT_NODE_KIND": "edge_cpu"}


@pytest.mark.timeout(120)
def test_a_store_timeout_while_the_elastic_world_forms_is_one_line(tmp_path):
    """No traceback: one line saying which store timed out and what to check, from the
    node's local rank 0; every worker's error file holds it."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:  # a free port: rank 0 hosts the store, no other rank comes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, lines, message = _worker(tmp_path, ["cluster=cpu_elastic", f"run_dir={tmp_path}/run"],
                                   _elastic_env(0, 0, port), elastic=True)
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"ldt: the elastic world did not form: torchrun's store at "
                               f"127.0.0.1:{port}: Timed out after "), lines
    assert "1/2 clients joined" in lines[0] and "--rdzv-endpoint" in lines[0]
    assert message == lines[0]
    assert not (tmp_path / "run").exists()  # the refused start's run folder is gone
    # a local rank other than 0 says nothing (its node's local rank 0 does), but its error
    # file names the cause: here the node descriptions it waited for
    (tmp_path / "error.json").unlink()
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    code, lines, message = _worker(tmp_path, ["cluster=cpu_elastic", f"run_dir={tmp_path}/run"],
                                   _elastic_env(1, 1, store.port), elastic=True)
    assert code == 1 and lines == [], lines
    assert message.startswith(f"ldt: the elastic world did not form: torchrun's store at "
                              f"127.0.0.1:{store.port}: wait timeout after 2000ms, keys: "), message
