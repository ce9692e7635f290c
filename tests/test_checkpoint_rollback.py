"""Disk checkpoints of one run folder, as files (no processes): a run that goes back to an
older step of its own folder sets the later steps aside before it saves, a step folder written
again stops being complete first, and the companion files of an import survive the pruning of
the checkpoint a run resumed from. (The save after the last step: ``tests/test_checkpoint.py``,
the retention test.)"""

from __future__ import annotations

import os

import pytest

from ldt.storage import checkpoint_files as files


def _checkpoint(run, step: int, extra: dict | None = None, complete: bool = True) -> str:
    """A step folder of ``run`` with one small part (and top-level files ``extra``), sealed
    unless not ``complete``."""
    folder = files.step_dir(str(run), step)
    files.write_part_files(folder, "stage_0", {"weights": bytes([step % 256]) * 16})
    for name, text in (extra or {}).items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
    if complete:
        files.seal(folder, {"step": step, "steps": 100})
    return folder


def _names(paths) -> list[str]:
    return [os.path.basename(p) for p in paths]


@pytest.mark.timeout(60)
def test_a_roll_back_in_the_run_folder_sets_the_later_steps_aside(tmp_path):
    """train.resume=RUN/checkpoints/step_10 with run_dir=RUN while steps 20 and 30 are there
    (and an unfinished 25): they are another history. Left in place, keep_last would remove
    the run's new step 15 and keep them, and train.resume=auto would continue step 30."""
    run = tmp_path / "run"
    source = _checkpoint(run, 10)
    for step in (20, 30):
        _checkpoint(run, step)
    _checkpoint(run, 25, complete=False)
    said = files.set_aside_later(str(run), 11, source)
    abandoned = run / "checkpoints" / files.ABANDONED
    assert said == (f"train.resume={source} continues the run in {run} at step 11, before its "
                    f"later checkpoints: step_0000020, step_0000030 moved to {abandoned} "
                    "(another history: kept there, never loaded or pruned); the unfinished "
                    "step_0000025 removed")
    assert sorted(os.listdir(abandoned)) == ["step_0000020", "step_0000030"]
    assert files.verify(str(abandoned / "step_0000030"))["step"] == 30  # whole, where it went
    assert files.latest(str(run)) == source
    _checkpoint(run, 15)  # the run's first save after the roll-back
    files.prune(str(run), keep_last=1)
    assert _names(files.complete_steps(str(run))) == ["step_0000015"]
    train = {"resume": files.AUTO, "load": None, "steps": 100}
    assert files.resume_auto(train, str(run)) is None
    assert train["resume"] == files.step_dir(str(run), 15)  # the new history, not step 30
    # rolled back to 10 again: the second step_15 and step_20... go beside the first ones
    files.set_aside_later(str(run), 11, source)
    assert sorted(os.listdir(abandoned)) == ["step_0000015", "step_0000020", "step_0000030"]
    assert files.set_aside_later(str(run), 11, source) is None  # nothing later: no line


@pytest.mark.timeout(60)
def test_a_resume_of_the_newest_step_or_into_another_folder_moves_nothing(tmp_path):
    run, other = tmp_path / "run", tmp_path / "other"
    newest = [_checkpoint(run, step) for step in (1, 3)][-1]
    assert files.set_aside_later(str(run), 4, newest) is None
    assert files.set_aside_later(str(other), 2, newest) is None  # a new run folder
    assert _names(files.complete_steps(str(run))) == ["step_0000001", "step_0000003"]
    # train.load of the run's own step 1 (a new history from step 0): the loaded one stays
    said = files.set_aside_later(str(run), 0, files.step_dir(str(run), 1), "train.load")
    assert said.startswith(f"train.load={files.step_dir(str(run), 1)} continues the run")
    assert _names(files.complete_steps(str(run))) == ["step_0000001"]


@pytest.mark.timeout(120)
def test_the_resume_sets_the_later_steps_aside_on_rank_0_before_training(tmp_path,
                                                                          monkeypatch, capsys):
    """ldt.training.checkpoint.load with the run's folder (what ldt.training.loop gives it),
    in a world of one rank: the later steps go aside, and the run says so in one line."""
    import torch.distributed as dist

    from ldt.training import checkpoint

    run = tmp_path / "run"
    source = _checkpoint(run, 10)
    _checkpoint(run, 20)
    monkeypatch.setattr(checkpoint, "load_step", lambda found, *a, **k: 11)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert checkpoint.load(source, [], [], None, None, run_dir=str(run)) == 11
    finally:
        dist.destroy_process_group()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ldt-train: train.resume={source} "), lines
    assert "step_0000020 moved to" in lines[0]
    assert files.latest(str(run)) == source


@pytest.mark.timeout(60)
def test_a_step_folder_written_again_is_not_complete_until_sealed_again(tmp_path):
    """A save into a step folder that exists (a step saved a second time) unseals it before
    its first part changes: a crash part-way leaves a folder that is never loaded, not a
    "complete" one with parts of two histories."""
    run = tmp_path / "run"
    earlier = _checkpoint(run, 1)
    again = _checkpoint(run, 3)
    with pytest.raises(RuntimeError, match="killed"):  # the writer dies inside its part
        files.write_part_with(again, "stage_0", _dies, 16)
    assert not os.path.exists(os.path.join(again, files.COMPLETE))
    assert files.latest(str(run)) == earlier
    files.write_part_files(again, "stage_0", {"weights": b"\1" * 16})  # saved again, whole
    files.seal(again, {"step": 3, "steps": 100})
    assert files.latest(str(run)) == again and files.verify(again)["step"] == 3


def _dies(tmp: str) -> None:
    raise RuntimeError("killed")


@pytest.mark.timeout(60)
def test_an_imports_files_come_from_the_runs_previous_checkpoint(tmp_path):
    """A run resumed from its own step 5, which came from an import (tokenizer,
    hf_config.json), then pruned by keep_last: the next saves take the files from the run's
    previous checkpoint, not from the origin that is gone."""
    run = tmp_path / "run"
    companions = {"hf_config.json": "{}\n", "tokenizer.json": "{\"v\": 1}\n"}
    origin = _checkpoint(run, 5, companions)
    nxt = _checkpoint(run, 7, companions)  # carried when the origin was still there
    files.prune(str(run), keep_last=1)
    assert not os.path.exists(origin)
    target = files.step_dir(str(run), 9)
    os.makedirs(target)
    assert files.carry_companions(origin, target, own=("model.json",)) == sorted(companions)
    for name, text in companions.items():
        with open(os.path.join(target, name)) as f:
            assert f.read() == text
    assert os.path.exists(nxt)
    # the run's first save: nothing before it in the run folder, so the origin's
    first = tmp_path / "fresh" / "checkpoints" / "step_0000000"
    first.mkdir(parents=True)
    assert files.carry_companions(nxt, str(first)) == sorted(companions)
