"""The step boundary: what every rank decides together after each step.

A run can only stop cleanly if every rank stops after the same step, so nothing is decided
alone: after each step one all-reduce (MAX) of a small vector over a gloo group of the whole
world carries

* a stop signal (SIGTERM, SIGINT, SIGHUP) any rank received since the last boundary; the
  handlers only note it, so a signal never interrupts a collective half-way;
* a non-finite loss (known on the loss stage) or gradient norm;
* each stage's peak memory in the step (every rank puts its own in its stage's slot), which
  the loss stage's leader writes to metrics.csv;
* whether any rank's snapshot writer is still busy with an earlier step, so that every rank
  skips this step's snapshot together (:mod:`ldt.training.snapshot`: a step's snapshot is
  whole only with every rank's part).

What a stop means for the run (a checkpoint, a message, an exit status) is :class:`Stop`.
"""

from __future__ import annotations

import math
import signal
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ldt.launch.local import STOP_SIGNALS

EXIT_FAILED = 1


@dataclass
class Decision:
    """What the ranks agreed on after one step."""

    signum: int = 0
    nonfinite_loss: bool = False
    nonfinite_grad_norm: bool = False
    peak_memory_gib: list = field(default_factory=list)  # per stage
    snapshot_busy: bool = False

    @property
    def nonfinite(self) -> bool:
        return self.nonfinite_loss or self.nonfinite_grad_norm


@dataclass
class Stop:
    """Why a run ended early; the launcher prints ``message`` as one line and exits with
    ``exit_code`` (128 + the signal for a signal, like a shell)."""

    message: str
    exit_code: int = EXIT_FAILED


class StopSignals:
    """Notes SIGTERM / SIGINT / SIGHUP while the ``with`` block runs (main thread only; the
    previous handlers come back after it), so a signal never interrupts a collective.

    ``hold_after_failure``: a block left by an exception keeps noting them, for a process
    that then reports its failure and exits. torchrun SIGTERMs every rank left as soon as one
    dies, while they are failing on the lost peer too: else one can die before it says why
    (and end by the signal, not with its own exit status)."""

    def __init__(self, hold_after_failure: bool = False):
        self.signum = 0
        self.hold_after_failure = hold_after_failure
        self._old: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None and self.hold_after_failure:
            return
        for s, handler in self._old.items():
            signal.signal(s, handler)
        self._old = {}

    def _on_signal(self, signum, frame) -> None:
        self.signum = self.signum or signum


class StepGuard:
    """The agreement at every step boundary (see the module docstring)."""

    def __init__(self, state, signals: StopSignals, group=None):
        self.state, self.signals, self.group = state, signals, group

    @staticmethod
    def world_group(timeout_s: float):
        """A gloo group of every rank: the default group when it is gloo, else a new one with
        ``timeout_s`` (``train.comm_timeout_s``; torch's default for a new group is 30
        minutes) (collective: call on every rank, in the same place)."""
        if dist.get_backend() == "gloo":
            return None
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def agree(self, *, loss: Optional[float], grad_norm: float, peak_gib: float,
              snapshot_busy: bool = False) -> Decision:
        """Collective over the whole world, once per step."""
        stages = self.state.topology.num_stages
        vec = torch.zeros(4 + stages, dtype=torch.float64)
        vec[0] = self.signals.signum
        vec[1] = float(loss is not None and not math.isfinite(loss))
        vec[2] = float(not math.isfinite(grad_norm))
        vec[3] = float(snapshot_busy)
        vec[4 + self.state.stage] = peak_gib
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=self.group)
        return Decision(signum=int(vec[0]), nonfinite_loss=bool(vec[1]),
                        nonfinite_grad_norm=bool(vec[2]), peak_memory_gib=vec[4:].tolist(),
                        snapshot_busy=bool(vec[3]))


def signal_stop(signum: int, step: int, saved: Optional[str], save_every: int,
                last_checkpoint: Optional[str], run_dir: str) -> Stop:
    name = signal.Signals(signum).name
    if saved:
        where = f"checkpoint {saved} written; resume with {_quoted('train.resume', run_dir)}"
    elif save_every:
        where = f"the last complete checkpoint is {last_checkpoint or 'none'}"
    else:
        where = ("no checkpoint written (train.save_every=0)"
                 + (f"; the last complete one is {last_checkpoint}" if last_checkpoint else ""))
    return Stop(f"stopped by {name} after step {step}; {where}", 128 + signum)


def nonfinite_stop(decision: Decision, step: int, loss: Optional[float], grad_norm: float,
                   loss_stage: str, last_checkpoint: Optional[str]) -> Stop:
    what = (f"non-finite loss ({loss}) on stage {loss_stage}" if decision.nonfinite_loss
            else f"non-finite gradient norm ({grad_norm})")
    resume = f"; the last complete checkpoint is {last_checkpoint}" if last_checkpoint else ""
    return Stop(f"training stopped at step {step}: {what}. Lower train.lr, check the data, or "
                f"set train.stop_on_nonfinite=false to go on{resume}")


def save_failed_stop(error: str, step: int, last_checkpoint: Optional[str],
                     run_dir: str) -> Stop:
    resume = (f"the last complete checkpoint, {last_checkpoint}, is intact: free space and "
              f"resume with {_quoted('train.resume', run_dir)}" if last_checkpoint
              else "no earlier checkpoint exists")
    return Stop(f"{error} while saving the checkpoint of step {step}; {resume}")


def _quoted(key: str, value: str) -> str:
    """``key=value`` as a shell word (a folder with spaces pastes as one argument)."""
    import shlex

    return shlex.quote(f"{key}={value}")


def peak_memory_gib(device: str) -> float:
    """This process's peak memory since the last call, GiB: the device allocator's peak on
    cuda / npu; on CPU the peak resident set (VmHWM), reset each call where Linux allows."""
    if device in ("cuda", "npu"):
        mod = getattr(torch, device)
        peak = mod.max_memory_allocated()
        mod.reset_peak_memory_stats()
        return peak / 2**30
    try:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak to the current resident set
        return kib / 2**20
    except (OSError, StopIteration, ValueError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # lifetime peak

