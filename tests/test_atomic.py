"""One way to write (ldt.storage.atomic): what a user has is never lost, no output is half there.

No processes: each check builds a few files in tmp_path and compares every byte before and
after. Failures are injected at each point of a write (inside the block, at the rename, in the
verification a writer does before the rename).
"""

import os

import pytest

from ldt.storage import atomic, commit
from ldt.storage.atomic import OutputError, check_output, check_run_folder, new_files, new_folder


def tree(root) -> dict:
    """Every path under ``root`` (hidden ones too) -> its bytes, or None for a folder."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(folder, d), root)] = None
        for f in files:
            path = os.path.join(folder, f)
            out[os.path.relpath(path, root)] = open(path, "rb").read()
    return out


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A user's folder: a model, notes and an input, with the working directory elsewhere."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "weights.bin").write_bytes(b"\x00\x01" * 100)
    (tmp_path / "model" / "keep.txt").write_text("mine")
    (tmp_path / "notes.txt").write_text("notes")
    (tmp_path / "input.txt").write_text("data")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    return tmp_path


def test_an_existing_target_is_refused_untouched(home):
    before = tree(home)
    for target in ("model", "notes.txt"):
        with pytest.raises(OutputError, match=r"already exists .* add --overwrite"):
            with new_folder(str(home / target), flag="OUT") as tmp:
                open(os.path.join(tmp, "x"), "w").close()
    with pytest.raises(OutputError, match="already exists"):
        atomic.write_text(str(home / "notes.txt"), "new", flag="--out")
    assert tree(home) == before


def test_overwrite_replaces_whole_never_merges(home):
    with new_folder(str(home / "model"), flag="OUT", overwrite=True) as tmp:
        with open(os.path.join(tmp, "new.bin"), "w") as f:
            f.write("new")
    assert sorted(os.listdir(home / "model")) == ["new.bin"]  # keep.txt went with the old
    assert not [n for n in os.listdir(home) if atomic.TMP_MARK in n or atomic.OLD_MARK in n]


def test_a_failure_at_any_point_leaves_the_target_as_it_was(home, monkeypatch):
    before = tree(home)

    class Boom(Exception):
        pass

    # in the writer's block (a wrong tensor, a full disk), also with overwrite
    for overwrite in (False, True):
        target = home / ("model" if overwrite else "fresh")
        with pytest.raises(Boom):
            with new_folder(str(target), flag="OUT", overwrite=overwrite) as tmp:
                open(os.path.join(tmp, "half"), "w").close()
                raise Boom()
        assert tree(home) == before
    # at the rename (the kernel cannot swap two names: old aside, new in, old removed)
    real_rename = os.rename
    monkeypatch.setattr(commit, "_exchange", lambda a, b: False)
    for failing_step in ("aside", "in"):
        def rename(src, dst, step=failing_step):
            if (step == "aside" and atomic.OLD_MARK in str(dst)) or \
                    (step == "in" and atomic.TMP_MARK in str(src)):
                raise OSError(5, "Input/output error")
            return real_rename(src, dst)

        monkeypatch.setattr(os, "rename", rename)
        with pytest.raises(OSError):
            with new_folder(str(home / "model"), flag="OUT", overwrite=True) as tmp:
                open(os.path.join(tmp, "new"), "w").close()
        monkeypatch.setattr(os, "rename", real_rename)
        assert tree(home) == before


def _set_of_three(home):
    """A set's targets: two that exist (one of them not written this time, so the old one
    must go with the commit) and one that does not."""
    return [str(home / "notes.txt"), str(home / "input.txt"), str(home / "new.idx")]


def test_a_set_appears_whole_or_not_at_all_whichever_rename_fails(home, monkeypatch):
    """new_files puts a set in place together: the i-th rename of its commit fails (i = 1,
    2, ... until the commit has no i-th rename), and every byte of the folder is as before;
    then the set goes in whole. Before #39 the renames went one by one, so with the second
    failing a new first file sat beside an old second one."""
    before = tree(home)
    real_rename = os.rename
    failed_at = 0
    for i in range(1, 20):
        calls = []

        def rename(src, dst):
            calls.append((src, dst))
            if len(calls) == i:
                raise OSError(5, "Input/output error")
            return real_rename(src, dst)

        monkeypatch.setattr(os, "rename", rename)
        try:
            with new_files(_set_of_three(home), flags=["-a", "-b", "-c"], overwrite=True) as (
                    a, _, c):
                open(a, "w").write("new notes")
                open(c, "w").write("new idx")
        except OSError:
            failed_at = i
            assert tree(home) == before, f"rename {i} failed and the set was left half-replaced"
            continue
        finally:
            monkeypatch.setattr(os, "rename", real_rename)
        break
    assert failed_at == 4  # notes aside, notes in, input aside (it goes), new.idx in
    assert (home / "notes.txt").read_text() == "new notes"
    assert not (home / "input.txt").exists()  # not written this time: the old one went
    assert (home / "new.idx").read_text() == "new idx"
    assert not [n for n in os.listdir(home) if ".ldt-" in n]


_KILLED_WRITER = """
import os, sys
from ldt.storage import atomic, commit
real, calls = os.rename, []
def rename(src, dst):
    calls.append(src)
    if len(calls) == int(sys.argv[1]):
        os._exit(9)  # killed here: no exception handler, no cleanup
    return real(src, dst)
os.rename = rename
with atomic.new_files(sys.argv[2:], flags=["-a", "-b", "-c"], overwrite=True) as (a, _, c):
    open(a, "w").write("new notes")
    open(c, "w").write("new idx")
"""


def test_a_writer_killed_mid_commit_is_undone_by_the_next_writer(home):
    """A writer killed at each rename of a set's commit leaves a journal; a reader sees it
    (set_in_progress: "was killed while it replaced them"), and the next writer to the set
    first puts every member back as it was, then writes. A killed writer's temporaries of a
    single target go too; a live owner's stay."""
    import subprocess
    import sys

    before = tree(home)
    targets = _set_of_three(home)
    for i in (1, 2, 3, 4):
        code = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(i), *targets],
                              cwd=home / "elsewhere").returncode
        assert code == 9
        assert "was killed while it replaced them" in commit.set_in_progress(targets[0])
        assert commit.sweep(targets[0])  # what the next writer does first
        assert tree(home) == before, f"killed at rename {i}: not rolled back"
    # leftovers of single targets: a dead owner's go, a live owner's (this process) stay
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    mine = commit.sibling(str(home / "notes.txt"), atomic.TMP_MARK)
    theirs = mine.replace(f"-{os.getpid()}-", f"-{dead}-")
    for path in (mine, theirs):
        open(path, "w").write("half")
    atomic.write_text(str(home / "notes.txt"), "new", flag="--out", overwrite=True)
    assert os.path.exists(mine) and not os.path.exists(theirs)
    os.remove(mine)
    # killed between moving the old target aside and renaming the new one in: the next
    # writer finds the old one back in place first (and so refuses to write over it)
    aside = theirs.replace(atomic.TMP_MARK, atomic.OLD_MARK)
    os.rename(home / "notes.txt", aside)
    with pytest.raises(OutputError, match="already exists"):
        atomic.write_text(str(home / "notes.txt"), "newer", flag="--out")
    assert (home / "notes.txt").read_text() == "new" and not os.path.exists(aside)


def test_missing_parents_are_made_and_removed_again_on_failure(home):
    before = tree(home)
    with pytest.raises(RuntimeError):
        with new_folder(str(home / "a" / "b" / "out"), flag="OUT"):
            raise RuntimeError()
    assert tree(home) == before
    path = atomic.write_text(str(home / "c" / "d.yaml"), "x: 1\n", flag="--out")
    assert open(path).read() == "x: 1\n"


def test_an_input_is_never_an_output(home):
    inputs = [("--input", str(home / "input.txt")), ("HF_FOLDER", str(home / "model"))]
    cases = {str(home / "input.txt"): "is also the input --input",
             str(home / "model"): "is also the input HF_FOLDER",
             str(home / "model" / "sub"): "lies inside the input HF_FOLDER",
             str(home): "holds the input"}
    for target, message in cases.items():
        with pytest.raises(OutputError, match=message):
            check_output(target, flag="OUT", overwrite=True, inputs=inputs)
    os.symlink(home / "input.txt", home / "link.txt")  # the same file by another name
    with pytest.raises(OutputError, match="is also the input"):
        check_output(str(home / "link.txt"), flag="OUT", overwrite=True, inputs=inputs)
    with pytest.raises(OutputError, match="holds the working directory"):
        check_output(str(home / "elsewhere"), flag="OUT", overwrite=True)


def test_an_unwritable_place_is_refused_naming_the_target(home):
    with pytest.raises(OutputError, match=r"OUT /proc/ldt_out: cannot write there"):
        with new_folder("/proc/ldt_out", flag="OUT"):
            pass
    (home / "afile").write_text("x")
    with pytest.raises(OutputError, match="is not a folder|cannot"):
        check_output(str(home / "afile" / "out"), flag="OUT")
    with pytest.raises(OutputError, match="is empty"):
        check_output("", flag="OUT")


def test_temporaries_keep_the_extension_and_are_hidden(home):
    with new_files([str(home / "t.png")], flags=["--png"]) as (tmp,):
        assert os.path.basename(tmp).startswith(".t.png" + atomic.TMP_MARK)
        assert tmp.endswith(".png")  # matplotlib picks the format from it
        open(tmp, "w").write("png")
    assert (home / "t.png").read_text() == "png"


def test_an_empty_folder_may_be_the_target(home):
    (home / "empty").mkdir()
    with new_folder(str(home / "empty"), flag="OUT") as tmp:
        open(os.path.join(tmp, "x"), "w").close()
    assert os.listdir(home / "empty") == ["x"]


def test_a_run_never_writes_into_another_runs_folder(home):
    run = home / "run"
    run.mkdir()
    check_run_folder(str(run), None)  # empty: a new run may start there
    (run / "metrics.csv").write_text("step,loss\n")
    with pytest.raises(OutputError, match=r"already holds files \(metrics.csv\).*train.resume="):
        check_run_folder(str(run), None)
    with pytest.raises(OutputError):
        check_run_folder(str(run), str(home / "model"))  # resuming another run
    check_run_folder(str(run), str(run))  # resuming this one
    check_run_folder(str(run), str(run / "checkpoints" / "step_0000003"))


def test_a_run_folder_has_one_owner_and_a_dead_owner_holds_nothing(home):
    """RunLock: a second owner is refused naming the holder (pid, host, the command as
    typed); a holder killed with SIGKILL holds nothing (the kernel released its flock), and
    its stale file is taken over; release removes the file."""
    import subprocess
    import sys

    from ldt.storage.runlock import LOCK_NAME, RunFolderInUse, RunLock, holder

    run = home / "run"
    run.mkdir()
    code = ("import sys, time\nfrom ldt.storage.runlock import RunLock\n"
            "RunLock(sys.argv[1]).acquire()\nprint('held', flush=True)\ntime.sleep(3600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(run), "--my-flag"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        who = holder(str(run))
        assert who.startswith(f"pid {proc.pid} on ") and "-c" in who and "--my-flag" in who
        with pytest.raises(RunFolderInUse, match=rf"run_dir={run} is in use by another run "
                                                 rf"\(pid {proc.pid} on .* since "):
            RunLock(str(run)).acquire()
    finally:
        proc.kill()
        proc.wait()
    assert (run / LOCK_NAME).exists() and holder(str(run)) is None  # stale: nobody holds it
    check_run_folder(str(run), None)  # a folder holding only a stale lock file is empty
    lock = RunLock(str(run)).acquire()
    assert holder(str(run)).startswith(f"pid {os.getpid()} ")
    lock.release()
    assert os.listdir(run) == []


def test_an_output_another_command_wrote_meanwhile_is_not_replaced(home):
    """Two commands writing one new target at once (two imports, two preprocess runs): both
    passed the check before either wrote; the one that finishes second is refused in one line
    and leaves the other's output as it is (before #39 it replaced it silently, exit 0)."""
    for make in ("folder", "files"):
        target = home / f"new_{make}"
        with pytest.raises(OutputError, match=r"was written by another command while"):
            if make == "folder":
                with new_folder(str(target), flag="OUT") as tmp:
                    open(os.path.join(tmp, "mine"), "w").close()
                    target.mkdir()
                    (target / "theirs").write_text("theirs")
            else:
                with new_files([str(target), str(home / "other")], flags=["-o", "-p"]) as (a, b):
                    open(a, "w").write("mine")
                    open(b, "w").write("mine")
                    target.write_text("theirs")
        assert (target / "theirs" if make == "folder" else target).read_text() == "theirs"
        assert not (home / "other").exists()
        assert not [n for n in os.listdir(home) if ".ldt-" in n]


def test_a_run_folder_that_cannot_be_locked_says_so_or_is_refused(tmp_path, monkeypatch, capsys):
    """flock's errors: a filesystem without locks is a warning (nothing stops a second run
    there), any other error (EIO, ...) refuses the folder; the lock was silently off before."""
    import errno

    from ldt.storage import runlock
    from ldt.storage.runlock import RunFolderInUse, RunLock

    def fails(code):
        def flock(fd, op):
            raise OSError(code, os.strerror(code))
        return flock

    monkeypatch.setattr(runlock.fcntl, "flock", fails(errno.EOPNOTSUPP))
    RunLock(str(tmp_path)).acquire()
    assert "cannot be locked" in capsys.readouterr().err
    monkeypatch.setattr(runlock.fcntl, "flock", fails(errno.EIO))
    with pytest.raises(RunFolderInUse, match="its lock cannot be taken .*a local disk"):
        RunLock(str(tmp_path)).acquire()
