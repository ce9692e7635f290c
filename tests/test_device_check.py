"""``make device-check`` itself, on a machine without a GPU (docs/device_check.md): the
driver's JSON lines, timeouts (with the parts a stopped check had finished), deadline and
summary with stand-in checks (each a tiny process), the peaks MFU is computed against, and the mutants the GPU run applies. The
script's CPU-only path (one line, exit 0) runs in docs/device_check.md's first block
(tests/test_docs.py); the full CPU rehearsal is `LDT_DEVICE_CHECK_REHEARSE=1 make
device-check` (minutes, not in the suite)."""

import json
import os
import textwrap
import time

import pytest

from bench import device_check as dc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STAND_INS = textwrap.dedent('''
    import json, subprocess, sys, time
    name, path = sys.argv[1:]
    def result(**kw):
        json.dump(kw, open(path, "w"))
    if name == "fine":
        result(status="pass", figure=1.5)
    elif name == "bad":
        result(status="fail", error="parity 0.1 > 1e-05")
    elif name == "crash":
        print("a traceback's last line"); sys.exit(3)
    elif name == "late_crash":
        result(status="pass"); sys.exit(1)
    elif name == "slow":  # leaves a grandchild that only a process-group kill ends
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open(path + ".pid", "w").write(str(child.pid))
        result(status="partial", runs_done=1)  # what a timeout keeps
        time.sleep(60)
''')


@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    (tmp_path / "stand_in_checks.py").write_text(STAND_INS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), ROOT]))
    return tmp_path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its reaper is gone too
        return f.read().split()[2] != "Z"


def test_every_check_writes_its_line_whatever_it_does(stand_ins, tmp_path):
    out = tmp_path / "out"
    checks = [dc.Check("fine", 20, ""), dc.Check("bad", 20, ""), dc.Check("crash", 20, ""),
              dc.Check("late_crash", 20, ""), dc.Check("slow", 1.5, "")]
    t0 = time.monotonic()
    lines = dc.run_all(str(out), checks, deadline_s=60, min_s=1, module="stand_in_checks")
    assert time.monotonic() - t0 < 30  # the slow one was stopped at its budget
    written = [json.loads(x) for x in (out / "checks.jsonl").read_text().splitlines()]
    assert written == lines
    assert [(x["check"], x["status"]) for x in lines] == [
        ("fine", "pass"), ("bad", "fail"), ("crash", "fail"), ("late_crash", "fail"),
        ("slow", "timeout")]
    assert lines[0]["figure"] == 1.5 and lines[1]["error"] == "parity 0.1 > 1e-05"
    assert "exited 3 without a result" in lines[2]["error"]
    assert "a traceback's last line" in lines[2]["log_tail"]
    assert lines[3]["error"] == "exited 1 after its result"
    assert lines[4]["error"] == "killed after its budget of 2 s"
    assert lines[4]["runs_done"] == 1  # the parts it had finished
    grandchild = int((out / "logs" / "slow.json.pid").read_text())
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild)  # the whole process group went
    summary = (out / "summary.md").read_text()
    assert "- bad: **fail**" in summary and "parity 0.1 > 1e-05" in summary
    assert "1 pass, 3 fail, 1 timeout" in summary


def test_the_global_deadline_skips_what_it_cannot_fit(stand_ins, tmp_path):
    lines = dc.run_all(str(tmp_path / "out"), [dc.Check("fine", 20, "")], deadline_s=100,
                       started=time.time() - 95, min_s=10, module="stand_in_checks")
    assert lines[0]["status"] == "skipped"
    assert lines[0]["error"].startswith("the global deadline (100 s) left ")


def test_the_peak_is_named_from_the_device(monkeypatch):
    from bench.device_checks import peak_tflops

    assert peak_tflops("NVIDIA H100 80GB HBM3") == (989.0, "H100 SXM: 989 TFLOP/s bf16 dense")
    assert peak_tflops("NVIDIA H200")[0] == 989.0
    assert peak_tflops("NVIDIA H100 PCIe")[0] == 756.0
    assert peak_tflops("NVIDIA H100 NVL")[0] == 835.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == (
        None, "no peak known for 'NVIDIA A100-SXM4-80GB': MFU not computed")


def test_every_mutant_of_the_gpu_run_still_matches_its_source():
    """The GPU run mutates these lines and expects the gpu tests to fail; a refactor that
    moves one must move its mutant too, or the day a GPU is lent that check breaks."""
    from bench.device_checks import MUTANTS

    for path, text, mutated, what in MUTANTS:
        with open(os.path.join(ROOT, path)) as f:
            assert f.read().count(text) == 1, (path, what)
        assert mutated != text


def test_the_hooks_of_the_gpu_run_are_there():
    """What the memory and speed checks reach into: ldt's per-step peak reader (recorded
    before it resets the allocator's peaks), the rank worker, the runs' metrics columns and
    the model FLOPs; a rename would break the GPU run, not the suite."""
    import inspect

    from ldt.training import loop
    from ldt.training.outputs import REPORT_KEYS, memory_keys, model_flops_per_step

    assert callable(loop.peak_memory_gib) and "peak_memory_gib(device)" in inspect.getsource(
        loop._train)
    assert list(inspect.signature(loop.train_worker).parameters)[:4] == [
        "rank", "world", "cfg", "run_dir"]
    assert {"step_time_s", "loss"} <= set(REPORT_KEYS)
    assert memory_keys(1) == ["peak_mem_gib_stage0"]
    assert callable(model_flops_per_step)
