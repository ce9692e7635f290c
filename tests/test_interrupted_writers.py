"""Every writer survives its interruption (#39): a full disk, SIGTERM or Ctrl-C at each of a
command's writes and renames in turn (:mod:`faults`) ends in one line and leaves what the user
had as it was. In-process, one scratch folder per writer: ``ldt-convert import`` and
``export`` (a folder replaced whole), ``ldt-preprocess`` (a set of files), ``ldt-plan`` and
``ldt-sim`` (files), a checkpoint part and a run folder's files. Two real processes are
interrupted as a user does it: an export stopped inside torch.distributed.checkpoint's reader
(which wraps the stop), and a preprocess with worker processes stopped by a terminal's Ctrl-C
(which reaches the whole process group). With root, a tiny tmpfs is a real full disk.
"""

import os
import shutil
import signal
import subprocess
import sys

import pytest

from faults import each_fault, tree


@pytest.fixture(scope="module")
def scratch(tmp_path_factory, tiny_model_files):
    """A Hugging Face model, its import, a corpus and an earlier preprocessed pair, earlier
    outputs to be replaced (each command below writes over one with --overwrite)."""
    from ldt.data.preprocess import preprocess

    root = tmp_path_factory.mktemp("scratch")
    for name in ("hf", "ckpt", "corpus.txt"):
        (shutil.copytree if os.path.isdir(tiny_model_files / name) else shutil.copy)(
            tiny_model_files / name, root / name)
    (root / "old.txt").write_text("An earlier corpus.\n" * 20)
    preprocess([str(root / "old.txt")], str(root / "data"), progress=False)
    (root / "hf_out").mkdir()
    (root / "hf_out" / "old.safetensors").write_bytes(b"an earlier export")
    (root / "plans" / "cluster").mkdir(parents=True)
    (root / "plans" / "cluster" / "p.yaml").write_text("stages: [{name: old}]\n")
    (root / "t.json").write_text("{}")
    return root


def _tool(monkeypatch, main, argv):
    def run(root):
        monkeypatch.chdir(root)
        try:
            return main(argv)
        except SystemExit as exc:
            return exc.code
    return run


@pytest.mark.timeout(300)
def test_import_over_an_import(scratch, monkeypatch, capsys):
    from ldt.tools import convert

    n = each_fault(monkeypatch, capsys, scratch,
                   _tool(monkeypatch, convert.main, ["import", "hf", "ckpt", "--overwrite"]))
    assert n >= 10


@pytest.mark.timeout(300)
def test_export_over_an_export(scratch, monkeypatch, capsys):
    from ldt.tools import convert

    n = each_fault(monkeypatch, capsys, scratch,
                   _tool(monkeypatch, convert.main, ["export", "ckpt", "hf_out", "--overwrite"]))
    assert n >= 6


@pytest.mark.timeout(300)
def test_preprocess_over_a_pair(scratch, monkeypatch, capsys):
    from ldt.tools import preprocess

    n = each_fault(monkeypatch, capsys, scratch, _tool(
        monkeypatch, preprocess.main, ["--input", "corpus.txt", "--output-prefix", "data",
                                       "--overwrite", "--quiet"]))
    assert n >= 6


@pytest.mark.timeout(300)
def test_plan_and_sim_outputs(scratch, monkeypatch, capsys):
    from ldt.tools import plan, sim

    each_fault(monkeypatch, capsys, scratch, _tool(
        monkeypatch, plan.main, ["--inventory", "cpu_local", "--model", "gpt_tiny", "--out",
                                 "plans/cluster/p.yaml", "--trace", "t.json", "--overwrite"]))
    each_fault(monkeypatch, capsys, scratch, _tool(
        monkeypatch, sim.main, ["--cluster", "cpu_demo", "--model", "gpt_tiny", "--inventory",
                                "cpu_local", "-m", "4", "--trace", "t.json", "--overwrite"]))


@pytest.mark.timeout(300)
def test_a_checkpoint_save_and_a_run_folders_files(scratch, monkeypatch, capsys):
    """The writers inside a run: a checkpoint (two parts, then the seal; a failed save is
    discarded as ldt.training.checkpoint.save does) beside an earlier one that must stay,
    and the run folder's config.yaml and metrics.csv rewritten for a resume at step 2."""
    import torch

    from ldt.job.prepare import save_config
    from ldt.storage import checkpoint_files as files
    from ldt.models.tensor_files import write_tensors
    from ldt.tools.cli import guarded
    from ldt.training.outputs import MetricsLog

    run = scratch / "run"
    shutil.copytree(scratch / "ckpt", run / "checkpoints" / "step_0000001")
    (run / "config.yaml").write_text("train: {lr: 0.002}\n")
    (run / "metrics.csv").write_text("step,loss\n0,5.5\n1,5.4\n2,5.3\n3,5.2\n")

    def save(root):
        def body():
            target = files.step_dir(os.path.join(root, "run"), 3)
            try:
                for part in (0, 1):
                    write_tensors(target, part, {f"w{part}": torch.ones(64, 64) * part}, 3)
                files.seal(target, {"step": 3})
            except BaseException:
                files.discard(target)
                raise
        return guarded("save", body)

    def config(root):
        return guarded("config", lambda: save_config({"train": {"lr": 0.001}},
                                                     os.path.join(root, "run")))

    def metrics(root):
        return guarded("metrics", lambda: MetricsLog(os.path.join(root, "run"),
                                                     ["step", "loss"], 2).close())

    try:
        assert each_fault(monkeypatch, capsys, scratch, save) >= 10
        assert each_fault(monkeypatch, capsys, scratch, config) >= 4
        assert each_fault(monkeypatch, capsys, scratch, metrics) >= 4
    finally:
        shutil.rmtree(run)


@pytest.mark.timeout(120)
def test_an_export_stopped_inside_torchs_reader(scratch, tmp_path, monkeypatch, capsys):
    """SIGTERM and Ctrl-C that arrive inside torch.distributed.checkpoint.load come out of it
    wrapped in a CheckpointException (#39: a 55-64 line traceback): one line, exit 128 +
    signal, the earlier export as it was. (A real signal, sent where torch reads a file.)"""
    import torch.distributed.checkpoint.filesystem as fs

    from faults import _raise_stop
    from ldt.tools import convert

    shutil.copytree(scratch / "ckpt", tmp_path / "ckpt")
    shutil.copytree(scratch / "hf_out", tmp_path / "hf_out")
    monkeypatch.chdir(tmp_path)
    before = tree(tmp_path)
    real, sent = fs.FileSystemReader.read_data, []

    def read_data(self, *args, **kwargs):
        os.kill(os.getpid(), sent[-1])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(fs.FileSystemReader, "read_data", read_data)
    old = signal.signal(signal.SIGTERM, _raise_stop)  # never pytest's end, whatever happens
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            sent.append(sig)
            code = convert.main(["export", "ckpt", "hf_out", "--overwrite"])
            err = capsys.readouterr().err
            assert code == 128 + sig, err
            assert len(err.splitlines()) == 1 and "no output was left half-written" in err
            assert tree(tmp_path) == before
    finally:
        signal.signal(signal.SIGTERM, old)


_TOKENIZING = """
import sys, time
from ldt.data.preprocess import _parallel
from ldt.tools.cli import guarded

def chunks():  # a few chunks, then the reader waits (on a slow disk): the workers are idle
    for _ in range(6):
        yield ["words of a corpus " * 200] * 20, 1
    print("idle", flush=True)
    time.sleep(60)
    yield ["x"], 1

sys.exit(guarded("ldt-preprocess", lambda: _parallel(chunks(), 2, ("bytes", None, "uint16"),
                                                     lambda docs, size: None)))
"""


@pytest.mark.timeout(120)
def test_a_terminals_ctrl_c_reaches_preprocess_and_its_workers():
    """Ctrl-C in a terminal goes to the whole process group: ldt-preprocess's worker
    processes printed a traceback each (#39). They ignore it now, and the command stops in
    one line (its outputs are new_files', checked above)."""
    import time

    p = subprocess.Popen([sys.executable, "-c", _TOKENIZING], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert p.stdout.readline().strip() == "idle"
        time.sleep(0.5)  # the workers finish their chunks and wait for more
        os.killpg(p.pid, signal.SIGINT)
        err = p.communicate(timeout=60)[1]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130, err
    assert err.splitlines() == ["ldt-preprocess: interrupted (SIGINT); no output was left "
                                "half-written"]


def test_a_real_full_disk(scratch, tmp_path):
    """A tmpfs too small for the outputs (root only): export and preprocess end in one line
    naming the target and leave nothing on it."""
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs",
                                            str(tiny)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        for argv in (["ldt-convert", "export", str(scratch / "ckpt"), str(tiny / "out")],
                     ["ldt-preprocess", "--input", str(scratch / "corpus.txt"), "--quiet",
                      "--output-prefix", str(tiny / "c")]):
            from ldt.tools import convert, preprocess

            main = convert.main if argv[0] == "ldt-convert" else preprocess.main
            import io
            from contextlib import redirect_stderr

            err = io.StringIO()
            if argv[0] == "ldt-preprocess":  # the corpus fits; make it not
                (tmp_path / "big.txt").write_text("x " * 200000)
                argv[2] = str(tmp_path / "big.txt")
            with redirect_stderr(err):
                code = main(argv[1:])
            assert code == 2 and "no space left on the device" in err.getvalue(), err.getvalue()
            assert len(err.getvalue().splitlines()) == 1 and os.listdir(tiny) == []
    finally:
        subprocess.run(["umount", str(tiny)])
