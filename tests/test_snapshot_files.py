"""Snapshots in host memory, as files (no processes): two generations per part, a write cut
short or a damaged file leaves the previous generation readable, a run folder made again or
another layout never finds the old snapshots, and a bad ``train.snapshot_dir`` is refused."""

from __future__ import annotations

import json
import os
import shutil
import zlib

import pytest
import torch

from ldt.config import ConfigError
from ldt.storage import checkpoint_files as files
from ldt.storage import snapshot_files as snap


def _state(step: int) -> dict:
    """A part's files: one rank's state after ``step`` (its bytes, as ldt.training.snapshot
    writes them)."""
    return {"state.bin": torch.full((4, 3), float(step)).numpy(), "meta.json": b"{}"}


@pytest.fixture
def root(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "shm").mkdir()
    return snap.snapshot_root(str(tmp_path / "shm"), str(run), "layout A")


def test_each_part_keeps_two_generations(root):
    for step in range(4):
        snap.write(root, step, "rank_0", _state(step))
        if step < 3:
            snap.write(root, step, "rank_1", _state(step))
    assert snap.steps(root) == [3, 2, 1]  # step 0 is gone with its last part
    assert sorted(os.listdir(files.step_dir(root, 3))) == ["rank_0"]
    assert sorted(os.listdir(files.step_dir(root, 2))) == ["rank_0", "rank_1"]
    assert sorted(os.listdir(files.step_dir(root, 1))) == ["rank_1"]
    assert snap.readable(root, 2, ["rank_0", "rank_1"])
    assert not snap.readable(root, 3, ["rank_0", "rank_1"])  # rank_1 of step 3 never came
    snap.remove(root, "rank_0")
    snap.remove(root, "rank_1")
    assert not os.path.exists(os.path.dirname(root))  # nothing left in host memory


def test_a_cut_write_or_a_damaged_file_leaves_the_previous_generation(root):
    for step in (5, 6):
        snap.write(root, step, "rank_0", _state(step))
    # a writer killed while writing step 7: its temporary folder, no part
    os.makedirs(os.path.join(files.step_dir(root, 7), "rank_0.tmp"))
    assert not snap.readable(root, 7, ["rank_0"])
    assert snap.readable(root, 6, ["rank_0"])
    part = os.path.join(files.step_dir(root, 6), "rank_0")
    data = "state.bin"
    # a snapshot's checksums are crc32s (a checkpoint's: sha256), as zlib computes them
    with open(os.path.join(part, files.MANIFEST)) as f:
        manifest = json.load(f)
    with open(os.path.join(part, data), "rb") as f:
        assert manifest["algorithm"] == "crc32"
        assert manifest["files"][data]["crc32"] == f"{zlib.crc32(f.read()):08x}"
    with open(os.path.join(part, data), "r+b") as f:  # one byte flipped, same size
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    assert not snap.readable(root, 6, ["rank_0"])
    assert snap.readable(root, 5, ["rank_0"])


def test_a_new_generation_is_written_over_the_oldest_in_place(root, monkeypatch):
    """The third generation of a part takes the first one's folder and files (the same
    inode: written over, not made anew), and holds its own bytes; a file of another size is
    made anew and one the new part lacks is gone. A write cut short after taking the oldest
    folder leaves the step before it whole."""
    def state_inode(step):
        return os.stat(os.path.join(files.step_dir(root, step), "rank_0", "state.bin")).st_ino

    for step in (0, 1):
        snap.write(root, step, "rank_0", {**_state(step), "old.bin": b"x"})
    first = state_inode(0)
    snap.write(root, 2, "rank_0", _state(2))
    assert snap.steps(root) == [2, 1] and state_inode(2) == first
    part = os.path.join(files.step_dir(root, 2), "rank_0")
    assert sorted(os.listdir(part)) == sorted(["state.bin", "meta.json", files.MANIFEST])
    assert open(os.path.join(part, "state.bin"), "rb").read() == _state(2)["state.bin"].tobytes()
    assert snap.readable(root, 2, ["rank_0"]) and snap.readable(root, 1, ["rank_0"])
    bigger = {"state.bin": torch.full((5, 3), 3.0).numpy(), "meta.json": b"{}"}
    snap.write(root, 3, "rank_0", bigger)
    assert snap.readable(root, 3, ["rank_0"]) and snap.steps(root) == [3, 2]
    assert os.path.getsize(os.path.join(files.step_dir(root, 3), "rank_0", "state.bin")) == 60

    def cut(folder, views):
        raise OSError("killed while writing")
    monkeypatch.setattr(files, "_save_views", cut)
    with pytest.raises(OSError, match="killed while writing"):
        snap.write(root, 4, "rank_0", _state(4))
    assert 2 not in snap.steps(root)  # step 2's folder was the one given up
    assert snap.readable(root, 3, ["rank_0"]) and not snap.readable(root, 4, ["rank_0"])


def test_a_copy_keeps_its_writers_checksums_so_a_damaged_transfer_is_found(root):
    """A copy from another host is written with the checksums its writer took (not taken
    again by its holder): bytes damaged on the way are found when the copy is read, and bytes
    of another size are refused before they are written."""
    sent = _state(3)
    sums = snap.checksums(sent)
    assert sums["state.bin"]["crc32"] == f"{zlib.crc32(sent['state.bin'].tobytes()):08x}"
    copies = snap.copies_root(root)
    snap.write(copies, 3, "rank_1", sent, sums)
    assert snap.readable(copies, 3, ["rank_1"])
    damaged = sent["state.bin"].copy()
    damaged[0, 0] += 1  # a flipped bit on the way: same size, other bytes
    snap.write(copies, 4, "rank_1", {**sent, "state.bin": damaged}, sums)
    assert not snap.readable(copies, 4, ["rank_1"])
    assert snap.readable(copies, 3, ["rank_1"])
    with pytest.raises(files.CheckpointError, match="not the ones its writer's checksums name"):
        snap.write(copies, 5, "rank_1", {**sent, "state.bin": sent["state.bin"][:2]}, sums)
    assert snap.steps(copies) == [4, 3]


def test_another_run_folder_or_layout_finds_none(tmp_path, root):
    run = tmp_path / "run"
    shm = str(tmp_path / "shm")
    assert snap.snapshot_root(shm, str(run), "layout A") == root
    assert snap.snapshot_root(shm, str(run), "layout B") != root
    shutil.rmtree(run)
    run.mkdir()  # the same path (maybe the same inode): another run
    assert snap.snapshot_root(shm, str(run), "layout A") != root
    snap.write(root, 1, "rank_0", _state(1))
    other = snap.snapshot_root(shm, str(run), "layout A")
    sibling = snap.snapshot_root(shm, str(run), "layout B")
    os.makedirs(other)
    os.makedirs(sibling)
    snap.remove_other_layouts(other)  # the same run's other layouts only
    assert os.path.isdir(other) and not os.path.exists(sibling) and snap.steps(root) == [1]


def test_a_bad_snapshot_dir_is_refused(tmp_path):
    snap.check_snapshot_dir(None)
    snap.check_snapshot_dir(str(tmp_path))
    with pytest.raises(ConfigError, match=r"train.snapshot_dir='shm' must be an absolute"):
        snap.check_snapshot_dir("shm")
    with pytest.raises(ConfigError, match=r"train.snapshot_dir='.*/missing' is not a folder"):
        snap.check_snapshot_dir(str(tmp_path / "missing"))


def test_auto_continues_a_folder_whose_run_left_snapshots(tmp_path):
    """train.resume=auto refuses a folder holding a run without a checkpoint, unless that
    run's snapshots are in this host's memory (the workers then start from them)."""
    run, shm = tmp_path / "run", tmp_path / "shm"
    run.mkdir()
    shm.mkdir()
    (run / "metrics.csv").write_text("step,loss\n0,5.5\n")

    def auto():
        train = {"resume": "auto", "steps": 10}
        files.resume_auto(train, str(run), restarted=snap.held(str(shm), str(run)))
        return train["resume"]

    with pytest.raises(files.CheckpointError, match="it saved no checkpoint"):
        auto()
    root = snap.snapshot_root(str(shm), str(run), "layout A")
    with pytest.raises(files.CheckpointError, match="it saved no checkpoint"):
        auto()  # the run's id, no snapshot yet
    snap.write(root, 3, "rank_0", _state(3))
    assert auto() is None  # a start that the snapshot continues


def test_a_start_takes_the_newest_whole_snapshot_that_leaves_a_step(root):
    """ldt.training.snapshot.newest in a world of one rank: a damaged newest generation
    falls back to the one before; the run's last step (nothing left to train) is passed over;
    only another rank's part: None."""
    import torch.distributed as dist

    from ldt.training.snapshot import newest

    for step in (3, 4):
        snap.write(root, step, "rank_1", _state(step))  # another rank's part: not this rank's
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert newest(root, None, steps=10) is None
        for step in (3, 4):
            snap.write(root, step, "rank_0", _state(step))
        assert newest(root, None, steps=10) == files.step_dir(root, 4)
        assert newest(root, None, steps=5) == files.step_dir(root, 3)  # 4 is the last
        os.remove(os.path.join(files.step_dir(root, 4), "rank_0", files.MANIFEST))
        assert newest(root, None, steps=10) == files.step_dir(root, 3)
    finally:
        dist.destroy_process_group()


def test_a_take_refills_one_flat_buffer_and_reads_back_every_dtype(tmp_path):
    """ldt.training.flat_state: a rank's state (fp32, bf16, an int64 step of no dimensions,
    odd sizes) packed into one buffer at aligned offsets; filled again in place (the same
    buffer, the new values, nothing aliasing the live tensors); other shapes or dtypes do not
    fit; the bytes written read back equal."""
    from ldt.training.flat_state import ALIGN, FlatState, read

    live = {"model.w": torch.arange(6.0).reshape(2, 3),
            "model.b": torch.arange(3, dtype=torch.bfloat16),
            "optim.w.exp_avg": torch.randn(5, dtype=torch.float64), "step": torch.tensor(7)}
    flat = FlatState(live)
    assert all(offset % ALIGN == 0 for *_, offset in flat.index)
    assert flat.buffer.numel() == 32 + 16 + 48 + 16  # each tensor's bytes rounded up to ALIGN
    flat.fill(live)
    buffer = flat.buffer.data_ptr()
    for t in live.values():
        t += 1
    assert flat.fits(live)
    flat.fill(live)
    assert flat.buffer.data_ptr() == buffer
    for name, t in live.items():
        assert torch.equal(flat.views[name], t) and flat.views[name].data_ptr() != t.data_ptr()
    live["model.w"] += 1  # the copy does not follow the live tensor
    assert not torch.equal(flat.views["model.w"], live["model.w"])
    assert not flat.fits({**live, "model.b": live["model.b"].float()})
    assert not flat.fits({**live, "model.w": live["model.w"][:1]})
    assert not flat.fits({k: v for k, v in live.items() if k != "step"})
    path = tmp_path / "state.bin"
    path.write_bytes(flat.bytes().tobytes())
    back = read(flat.index, str(path))
    assert list(back) == list(live)
    for name, t in back.items():
        assert t.dtype == flat.views[name].dtype and torch.equal(t, flat.views[name]), name
    assert int(back["step"]) == 8 and back["step"].dim() == 0


def test_a_parts_files_take_no_more_than_the_memory_estimate_counts(root):
    """ldt-memory counts a snapshot part as flat_state.part_bytes: what the files of a part
    really take on disk (the buffer, meta.json with the index and a rank's fields, the
    manifest), measured by the file system, stays within it."""
    from ldt.training.flat_state import FlatState, part_bytes

    names = [f"decoder.layers.{i}.mlp.linear_fc{j}.weight" for i in range(8) for j in (1, 2)]
    live = {f"model.{n}": torch.randn(33, 7) for n in names}
    live |= {f"optim.{n}.{k}": torch.randn(33, 7) for n in names for k in ("exp_avg", "exp_avg_sq")}
    live |= {f"optim.{n}.step": torch.tensor(3.0) for n in names}
    live["step"] = torch.tensor(3)
    flat = FlatState(live)
    flat.fill(live)
    meta = {"rank": 3, "world": 8, "stages": 3, "stage": 1, "tp": 2, "tp_rank": 1, "dp": 2,
            "dp_rank": 1, "ep": 1, "sharded": 1, "gated": 0, "optimizer": "adam",
            "spans": {n: [123456, 234567] for n in names}, "aliases": {}, "index": flat.index}
    part = snap.write(root, 0, "rank_3", {"state.bin": flat.bytes(),
                                          "meta.json": json.dumps(meta).encode()})
    written = sum(os.path.getsize(os.path.join(part, f)) for f in os.listdir(part))
    state = sum(t.numel() * t.element_size() for t in live.values())
    assert state < written <= part_bytes(live), (state, written, part_bytes(live))



def test_a_start_drops_the_snapshots_of_its_steps_and_later(root):
    """A run that starts at step 5 (all ranks agreed) makes the snapshots of step 5 and later
    another history's: they go, parts and copies alike, so a later start cannot continue a
    history that was rolled back."""
    for step in (4, 5):
        snap.write(root, step, "rank_0", _state(step))
        snap.write(snap.copies_root(root), step, "rank_1", _state(step))
    snap.remove_from(root, 5)
    assert snap.steps(root) == [4] and snap.steps(snap.copies_root(root)) == [4]


def test_a_roll_back_to_an_older_checkpoint_is_not_replaced_by_a_snapshot(tmp_path):
    """A snapshot may stand in for the run folder, its newest checkpoint or a fresh start; a
    roll-back to an older checkpoint of the run, or another run's, is what the user asked
    for."""
    from ldt.training.snapshot import continues

    run, other = tmp_path / "run", tmp_path / "other"
    for step in (40, 45):
        os.makedirs(files.step_dir(str(run), step))
        files.seal(files.step_dir(str(run), step), {"step": step})
    os.makedirs(files.step_dir(str(other), 50))
    files.seal(files.step_dir(str(other), 50), {"step": 50})
    assert continues(None, str(run)) and continues(str(run), str(run))
    assert continues(files.step_dir(str(run), 45), str(run))
    assert not continues(files.step_dir(str(run), 40), str(run))
    assert not continues(str(other), str(run))


@pytest.mark.parametrize("written_by,refused", [("adam", True), ("sgd", False), (None, False)])
def test_a_snapshot_of_another_optimizer_is_refused(root, written_by, refused):
    """ldt.training.snapshot.load_local refuses a part whose meta names another optimizer than
    the run's (SGD would drop Adam's moments without a word, as train.resume of such a
    checkpoint is refused); a part of an earlier ldt, which names none, is accepted."""
    from types import SimpleNamespace

    from ldt.training.flat_state import FlatState
    from ldt.training.snapshot import load_local

    tensors = {"step": torch.tensor(4)}
    flat = FlatState(tensors)
    flat.fill(tensors)
    meta = {"index": flat.index} | ({"optimizer": written_by} if written_by else {})
    part = snap.write(root, 4, "rank_0", {"state.bin": flat.bytes(),
                                          "meta.json": json.dumps(meta).encode()})
    sgd_run = SimpleNamespace(optimizer=SimpleNamespace(config=SimpleNamespace(optimizer="sgd")),
                              resume_at=lambda step, saved: None)
    if refused:
        with pytest.raises(files.CheckpointError) as got:
            load_local(part, [], [], sgd_run)
        assert str(got.value) == (
            f"snapshot {part} was written by a train/optimizer=adam run, and this run's "
            "train.optimizer is sgd, which keeps other state: resume with train/optimizer=adam, "
            "or remove the run's snapshots (or set train.snapshot_dir=null) and start from a "
            "checkpoint's weights alone with train.load")
    else:
        assert load_local(part, [], [], sgd_run) == 5


def test_the_optimizer_step_waits_for_the_takes_copy_and_gets_its_error(root, monkeypatch):
    """A take copies the state in the writer thread, beside the next step's forward and
    backward: ``copied()`` (called before the optimizer step) waits for that copy, the part
    holds the state as it was at the take, and an error of the copy is raised by
    ``copied()`` in training's thread."""
    import threading

    import torch.distributed as dist

    from ldt.training import snapshot as snapshot_mod

    release = threading.Event()
    weights = torch.arange(4.0)

    def slow_state(models, chunks, optimizer, step, run_state, **kw):
        release.wait(10)
        if step == 2:
            raise RuntimeError("a tensor of another shape")
        return {"model.w": weights, "step": torch.tensor(step)}

    monkeypatch.setattr(snapshot_mod, "taken_state", slow_state)
    monkeypatch.setattr(snapshot_mod, "part_meta", lambda *args: {})
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        snaps = snapshot_mod.Snapshots(root, state=None)
        snaps.take(1, [], [], None)
        waiting = threading.Thread(target=snaps.copied)
        waiting.start()
        waiting.join(0.3)
        assert waiting.is_alive()  # the copy is not made yet
        release.set()
        waiting.join(10)
        assert not waiting.is_alive()
        weights += 1  # the optimizer step, after copied()
        snaps.take(2, [], [], None)
        with pytest.raises(RuntimeError, match="another shape"):
            snaps.copied()
        snaps.copied()  # raised once
        _, tensors = snapshot_mod.read_part(os.path.join(files.step_dir(root, 1), "rank_0"))
        assert torch.equal(tensors["model.w"], torch.arange(4.0)) and int(tensors["step"]) == 1
        assert snap.steps(root) == [1]  # step 2's copy failed: nothing written
        snaps.close(finished=True)
    finally:
        dist.destroy_process_group()


def test_a_part_is_copied_into_its_oldest_generations_file_and_nothing_else(root, monkeypatch,
                                                                            capfd):
    """The writer copies the state straight into the state file of its part's oldest
    generation, through a mapping kept from step to step (snapshot_files.MappedFiles): the
    part of step 3 is step 1's file written over (its inode), and the buffer the copy went into
    is that file's mapping (kept, and what is stored into it is in the file), so a rank's snapshots hold two copies of its state in host memory
    (ldt-memory's count), no third in a buffer. Each part holds the state of its take. A full
    /dev/shm is said once and training goes on: the next step's snapshot is whole."""
    import errno
    from types import SimpleNamespace

    import torch.distributed as dist

    from ldt.training import snapshot as snapshot_mod

    weights = torch.arange(6.0)
    monkeypatch.setattr(snapshot_mod, "taken_state", lambda m, c, o, step, r, **kw: {
        "model.w": weights, "step": torch.tensor(step)})
    monkeypatch.setattr(snapshot_mod, "part_meta", lambda *args: {})
    state_file = lambda step: os.path.join(files.step_dir(root, step), "rank_0", "state.bin")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        snaps = snapshot_mod.Snapshots(root, state=SimpleNamespace(stage=0))
        inodes, buffers = {}, {}
        for step in range(4):
            snaps.take(step, [], [], None)
            snaps.copied()
            snaps._thread.join()
            inodes[step] = os.stat(state_file(step)).st_ino
            buffers[step] = snaps._flat  # the FlatState over the file's mapping
            _, got = snapshot_mod.read_part(os.path.dirname(state_file(step)))
            assert torch.equal(got["model.w"], weights) and int(got["step"]) == step
            held = [s for s in snap.steps(root) if os.path.exists(state_file(s))]
            assert held == [step, step - 1][:step + 1], held
            weights += 1  # the optimizer step
        assert inodes[2] == inodes[0] and inodes[3] == inodes[1] != inodes[0]
        assert buffers[2] is buffers[0] and buffers[3] is buffers[1] is not buffers[0]
        kept = buffers[3].buffer[:4].clone()
        buffers[3].buffer[:4] = 255  # the buffer is the file: no copy of it is written
        with open(state_file(3), "rb") as f:
            assert f.read(4) == b"\xff" * 4
        buffers[3].buffer[:4] = kept

        def full(*args):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(snaps._mapped, "of", full)
        snaps.take(4, [], [], None)
        snaps.copied()  # not the copy's error: training goes on
        snaps._thread.join()
        assert "the snapshot of step 4 could not be written" in capfd.readouterr().err
        assert snap.steps(root) == [3] and snap.readable(root, 3, ["rank_0"])
        monkeypatch.delattr(snaps._mapped, "of")  # room again
        snaps.take(5, [], [], None)
        snaps.copied()
        snaps.close(finished=False)
        assert snap.steps(root) == [5, 3] and snap.readable(root, 5, ["rank_0"])
    finally:
        dist.destroy_process_group()


def test_a_full_dev_shm_is_an_error_when_mapped_not_a_crash_when_filled(tmp_path):
    """MappedFiles takes a file's pages when it maps it: on a full tmpfs that is an OSError
    the writer says and survives, where filling a mapping whose pages the tmpfs cannot give
    kills the process with SIGBUS (run in a child, so that a regression fails this test)."""
    import subprocess
    import sys

    tiny = tmp_path / "tiny"
    tiny.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs",
                                            str(tiny)], capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        child = subprocess.run([sys.executable, "-c", (
            "import os, errno\n"
            "from ldt.storage.snapshot_files import MappedFiles\n"
            "try:\n"
            f"    m = MappedFiles().of(os.path.join({str(tiny)!r}, 'state.bin'), 1 << 20,"
            " memoryview)\n"
            "    m[:] = b'x' * len(m)\n"
            "except OSError as exc:\n"
            "    print('refused', errno.errorcode[exc.errno])\n")],
            capture_output=True, text=True, timeout=60)
    finally:
        subprocess.run(["umount", "-l", str(tiny)], check=False)
    assert child.returncode == 0 and child.stdout.strip() == "refused ENOSPC", (
        child.returncode, child.stdout, child.stderr)


def _copy_rank(rank: int, world: int, shm: str) -> list:
    """Rank 0 writes a part at steps 0-3 and sends each to rank 1, which keeps the copies:
    step 1's part was not written (sent empty), and rank 1 cannot write step 2's copy (its
    /dev/shm full). Returns what rank 1 holds, per step: the copy's state, or None."""
    import errno

    import torch.distributed as dist

    from ldt.training.snapshot_copies import Copies, exchange

    group = dist.new_group(backend="gloo")
    copies = Copies(1, (), group) if rank == 0 else Copies(None, (0,), group)
    root = os.path.join(shm, f"host{rank}")
    held = snap.MappedFiles(snap.GENERATIONS)
    real_of = held.of
    errors = []
    for step in range(4):
        state = torch.full((1000,), float(step)).view(torch.uint8)
        meta = json.dumps({"step": step}).encode()
        files_ = {"state.bin": state.numpy(), "meta.json": meta}
        written = step != 1
        if rank == 1:
            held.of = real_of if step != 2 else lambda *args: (_ for _ in ()).throw(
                OSError(errno.ENOSPC, "No space left on device"))
        try:
            exchange(copies, root, step, meta, state if written else None,
                     snap.checksums(files_) if written else {}, held)
        except OSError as exc:
            errors.append((step, exc.errno))
    dist.barrier()
    if rank == 0:
        return errors
    kept = snap.copies_root(root)
    out = {}
    for step in range(4):
        folder = os.path.join(files.step_dir(kept, step), "rank_0")
        if not os.path.isdir(folder):
            out[step] = None
            continue
        assert snap.readable(kept, step, ["rank_0"]), step
        with open(os.path.join(folder, "state.bin"), "rb") as f:
            out[step] = float(torch.frombuffer(bytearray(f.read()), dtype=torch.float32)[0])
    return [errors, out]


def test_a_holder_keeps_each_copy_skips_an_unwritten_part_and_survives_a_failed_one(tmp_path):
    """ldt.training.snapshot_copies over a real gloo pair: each copy is received into the
    holder's copies and verifies against its writer's checksums; a part its writer could not
    write comes empty and no copy of that step is kept; a copy the holder cannot write
    (ENOSPC) is drained and said, and the next step's copy arrives whole (the messages stay
    in step)."""
    import errno

    from ldt.launch.local import run_local_world

    writer, (holder_errors, kept) = run_local_world(2, _copy_rank, (str(tmp_path),),
                                                    timeout_s=120)
    assert writer == [] and holder_errors == [(2, errno.ENOSPC)]
    assert kept == {0: 0.0, 1: None, 2: None, 3: 3.0}, kept


def test_a_holder_whose_writer_is_gone_does_not_receive_again(root, monkeypatch):
    """A copy whose state never comes (its writer's host gone: the receive fails) fails the
    holder's ``keep`` at once: that receive is not posted again (its bytes never come), and
    nothing of that step is kept. A copy the holder cannot write (ENOSPC before its receive)
    is drained, once, so the next message is the next writer's."""
    import errno

    from ldt.training import snapshot_copies

    head = (b"{}", {"state.bin": {"bytes": 4000, "crc32": "0"}, "meta.json": {"bytes": 2}}, 4000)
    monkeypatch.setattr(snapshot_copies, "recv_part_head", lambda src, group: head)
    receives = []

    def gone(data, src, group):
        receives.append(data.numel())
        raise RuntimeError("Connection closed by peer")
    monkeypatch.setattr(snapshot_copies, "recv_into", gone)
    copies = snapshot_copies.Copies(None, (0,), None)
    with pytest.raises(RuntimeError, match="closed by peer"):
        snapshot_copies.keep(copies, root, 0, 0, snap.MappedFiles())
    assert receives == [4000] and snap.steps(snap.copies_root(root)) == []

    receives.clear()
    monkeypatch.setattr(snapshot_copies, "recv_into", lambda data, src, group:
                        receives.append(data.numel()))
    full = snap.MappedFiles()
    monkeypatch.setattr(full, "of", lambda *args: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(OSError):
        snapshot_copies.keep(copies, root, 0, 0, full)
    assert receives == [4000]  # drained once
