import os
import signal
from pathlib import Path

import pytest

# Tests run on CPU/gloo; keep each process to one thread on this 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

# A shell starts a background job (`make test &`, `nohup ... &`) with SIGINT ignored, and
# Python then leaves it ignored: the tests of Ctrl-C (tests/test_interrupted_writers.py, whose
# children inherit the setting) would see no interruption at all. Ctrl-C as a terminal gives it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _signals_left_as_found():
    """A test that leaves a stop signal's handler changed in pytest's process fails, and the
    handler is put back: a later test that sends itself SIGINT, or starts a child (which
    inherits an ignored signal), would otherwise fail far from the cause."""
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    yield
    changed = {s.name: signal.getsignal(s) for s in STOP_SIGNALS
               if signal.getsignal(s) is not before[s]}
    for s in STOP_SIGNALS:
        signal.signal(s, before[s])
    assert not changed, f"the test left stop-signal handlers changed: {changed}"


def pytest_terminal_summary(terminalreporter):
    """The documents test (tests/test_docs.py): how many shell blocks ran, which were skipped
    and why (each skipped block's document says why in its first line)."""
    def blocks(kind):
        return [r for r in terminalreporter.stats.get(kind, [])
                if "test_block_runs_as_documented" in r.nodeid and r.when in ("call", "setup")]
    ran, failed, skipped = blocks("passed"), blocks("failed"), blocks("skipped")
    if not (ran or failed or skipped):
        return
    terminalreporter.write_line(f"documents: {len(ran)} shell blocks ran as written, "
                                f"{len(failed)} failed, {len(skipped)} skipped")
    for r in skipped:
        terminalreporter.write_line(f"  skipped {r.longrepr[2].removeprefix('Skipped: ')}")


GPU_SKIP = ("needs a CUDA device, which this machine lacks; `make device-check` runs it on one "
            "(docs/device_check.md)")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` exercise what only a device shows (host staging of a device
    tensor); without CUDA each is skipped and ``-ra`` prints why."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    for item in gpu:
        item.add_marker(pytest.mark.skip(reason=GPU_SKIP))


@pytest.fixture
def host_memory(tmp_path):
    """An empty folder for snapshots in host memory, as in real use: on /dev/shm (tmpfs),
    else under tmp_path; removed after the test. On a disk a snapshot's fsync can outlast a
    step of a loaded machine, and the snapshots then fall behind what a test expects."""
    import shutil
    import tempfile

    folder = (tempfile.mkdtemp(prefix="ldt-test-", dir="/dev/shm") if os.path.isdir("/dev/shm")
              else str(tmp_path / "host-memory"))
    os.makedirs(folder, exist_ok=True)
    yield Path(folder)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def one_process_world():
    """A gloo world of this process alone (what megatron-core's dataset builders expect to
    find: ``torch.distributed`` initialised, rank 0); destroyed after the test."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def tiny_model_files(tmp_path_factory):
    """A tiny Llama (``hf/``), its ldt import (``ckpt/``), ``corpus.txt`` and its indexed
    pair (``pair.*``), built once for the tests of bad inputs and interrupted writers
    (tests/tiny_files.py); copy what you change."""
    from tiny_files import build

    root = tmp_path_factory.mktemp("tiny_model_files")
    build(root)
    return root


@pytest.fixture(scope="session", autouse=True)
def _megatron_extension_built():
    """megatron-core 0.17+ compile a C++ extension in their first selective recompute
    (ldt.models.extensions): built once per session here, as ldt-train builds it before its
    world, so no test world's first backward spends the boundary timeout compiling it."""
    from ldt.models.extensions import build

    build(say=False)
