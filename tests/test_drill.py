"""The fault drill (ldt.launch.drill, LDT_FAULT_AT): it fires at its point of its step, and
only there, with the labels the loop, the runtime and the snapshot writer really mark. The
drills themselves: tests/test_elastic.py::test_a_lost_host_costs_at_most_a_step_with_snapshots."""

from __future__ import annotations

import os

import pytest

from ldt.config import ConfigError
from ldt.launch import drill, progress


@pytest.fixture
def killed(monkeypatch):
    out = []
    monkeypatch.setattr(drill.os, "kill", lambda pid, sig: out.append(pid))
    monkeypatch.setattr(progress, "_LISTENERS", [])
    return out


@pytest.mark.parametrize("point,label,other", [
    ("forward", "2F1", "2B1"), ("forward", "0FS0", "forward-backward"),
    ("backward", "2B0", "2F0"), ("backward", "0BE1", "0W1"),
    ("optimizer", "grad reduce (data-parallel, tied embedding), global norm, optimizer step",
     "step boundary"),
    ("copy", "copying the snapshot to another host", "snapshot (copying this rank's state)"),
])
def test_the_drill_fires_at_its_point_of_its_step(killed, point, label, other):
    assert drill.arm({drill.ENV: f"2:{point}"})
    record = progress.current()
    record.step(7)  # its first step
    record.begin(label)
    assert killed == []
    record.step(8)  # its second
    record.begin(other)
    assert killed == []
    record.begin(label)
    assert killed == [os.getppid(), os.getpid()]  # the agent, then itself


def test_the_labels_are_the_ones_ldt_marks():
    import inspect

    from ldt.training import loop, snapshot_copies

    assert "grad reduce (data-parallel, tied embedding), global norm, optimizer step" in \
        inspect.getsource(loop)
    assert '"copying the snapshot to another host"' in inspect.getsource(snapshot_copies)


@pytest.mark.parametrize("text", ["0:forward", "x:forward", "2:sideways", "forward"])
def test_a_wrong_drill_is_refused(killed, text):
    with pytest.raises(ConfigError, match="LDT_FAULT_AT"):
        drill.arm({drill.ENV: text})
    assert not drill.arm({})
