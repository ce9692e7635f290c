"""The pipeline runtime: walk one stage's action list with megatron-core's compute steps.

The schedule is data (:mod:`ldt.schedule`): this module only executes it. Compute actions use
megatron-core's own ``forward_step`` / ``backward_step`` (loss scaling, loss collection and
``retain_grad`` stay Megatron's); communication uses
:class:`~ldt.boundary.communicator.VtpCommunicator`. A RECV
posts the receive as early as the list says, the WAIT right before the compute that needs it
waits it (and runs the stage broadcast), and a send is let go (waited, its tensor freed) at
the first action after it completed, the rest at the end of the step, so communication
overlaps compute and a sent tensor does not outlive its transfer (held to the step's end,
the edge of llama3_8b's U-shape plan would keep 122 sent tensors of 64 MiB: 7.6 GiB). On an
error the stage's action grid is printed with the failing action marked, which is what a
user with a crashed pipeline needs.

Roles per op: on a U-shape edge (stage 0) FS runs the start chunk on data, FE runs the end
chunk and the loss, BS its backward, BE the start chunk's backward; F / B run a stage's only
chunk (the first stage of a plain pipeline reads data, the last computes the loss). A
zero-bubble list (W, WS, WE ops) runs each backward inside a W store's capture, which defers
the linear layers' weight GEMMs (``ldt.patches.wgrad_split``), and its W op runs them; the
last W of a chunk, like its last backward, runs outside megatron DDP's ``no_sync``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel.schedules import backward_step, forward_step

from ldt.boundary.communicator import BACKWARD, FORWARD, VtpCommunicator
from ldt.launch import progress
from ldt.patches import versions
from ldt.patches.wgrad_split import WgradSeam
from ldt.schedule import Action, Op, format_grid
from ldt.schedule.wgrad import WgradStore

_DIRECTION = {Op.RECV_F: FORWARD, Op.WAIT_F: FORWARD, Op.SEND_F: FORWARD,
              Op.RECV_B: BACKWARD, Op.WAIT_B: BACKWARD, Op.SEND_B: BACKWARD}


@dataclass
class StageRoles:
    """Which chunk each compute op runs and where data and the loss are, for one stage."""

    chunks: dict[Op, Any]  # op -> model chunk (FS/BE: start, FE/BS: end, F/B: the chunk)
    reads_data: frozenset  # forward ops that call the data iterator
    computes_loss: frozenset  # forward ops whose output is the loss
    models: tuple = ()  # the stage's chunks in order (config.no_sync_func lists follow it)

    @classmethod
    def for_stage(cls, stage: int, num_stages: int, u_shape: bool, models: list) -> "StageRoles":
        if u_shape and stage == 0:
            start, end = models
            return cls({Op.FS: start, Op.BE: start, Op.WE: start, Op.FE: end, Op.BS: end,
                        Op.WS: end},
                       frozenset({Op.FS, Op.FE}), frozenset({Op.FE}), (start, end))
        (chunk,) = models
        first, last = stage == 0, (stage == num_stages - 1 and not u_shape)
        return cls({Op.F: chunk, Op.B: chunk, Op.W: chunk},
                   frozenset({Op.F}) if first or last else frozenset(),
                   frozenset({Op.F}) if last else frozenset(), (chunk,))


@dataclass
class StepResult:
    losses: list = field(default_factory=list)  # forward_data_store entries (loss stage only)
    timings: list = field(default_factory=list)  # (action, start_s, end_s) per action


class ActionError(RuntimeError):
    pass


_BACKWARD_OF = {Op.B: Op.F, Op.BS: Op.FE, Op.BE: Op.FS}
_WEIGHTS = (Op.W, Op.WS, Op.WE)
# a W store's key names the chunk: the edge's end chunk runs BS / WS, its start chunk BE / WE
_CHUNK_NAME = {Op.B: "stage", Op.W: "stage", Op.BS: "end", Op.WS: "end", Op.BE: "start",
               Op.WE: "start"}


def run_actions(actions: list[Action], *, roles: StageRoles, comm: VtpCommunicator,
                forward_step_func: Callable, data_iterator: Optional[Iterator],
                num_microbatches: int, tensor_shape, config, schedule=None,
                record_timings: bool = False, keep_activations: bool = True) -> StepResult:
    """Execute one stage's lowered action list for one step. ``keep_activations=False`` is
    evaluation (a forward-only list): no forward keeps its input/output for a backward."""
    step = _Step(actions, roles, comm, forward_step_func, data_iterator, num_microbatches,
                 tensor_shape, config, keep_activations)
    record = progress.current()  # what this rank does now, for naming the rank a hang waits on
    for index, a in enumerate(actions):
        record.begin(str(a), waiting=a.op in (Op.WAIT_F, Op.WAIT_B))
        t0 = time.perf_counter()
        try:
            step.sends.let_go_completed()  # a failed send raises here
            with _label(a):
                step.run(a)
            if record_timings:  # every action: a WAIT's span is its blocked time (calibration)
                step.result.timings.append((a, t0, time.perf_counter()))
        except Exception as exc:
            grid = format_grid(schedule, mark=(a.stage, index)) if schedule else ""
            raise ActionError(
                f"stage {a.stage} failed at action #{index} {a} ({type(exc).__name__}: {exc})\n"
                f"{grid}") from exc
    record.begin("waiting for this step's sends", waiting=True)
    step.finish()
    return step.result


class _Step:
    """One step of one stage: the tensors between the actions that make and use them."""

    def __init__(self, actions: list[Action], roles: StageRoles, comm: VtpCommunicator,
                 forward_step_func: Callable, data_iterator: Optional[Iterator],
                 num_microbatches: int, tensor_shape, config, keep_activations: bool) -> None:
        self.roles, self.comm, self.config = roles, comm, config
        self.forward_step_func, self.data_iterator = forward_step_func, data_iterator
        self.num_microbatches, self.tensor_shape = num_microbatches, tensor_shape
        self.keep_activations = keep_activations
        # megatron-core 0.16's backward_step takes the model type before the config
        self.model_type = ((ModelType.encoder_or_decoder,)
                           if versions.holds("backward_step_model_type") else ())
        self.result = StepResult()
        self.posted: dict[tuple, Any] = {}  # (direction, mb) -> (tensor, work)
        self.ready: dict[tuple, torch.Tensor] = {}  # (direction, mb) -> waited tensor
        self.saved: dict[tuple, tuple] = {}  # (forward op, mb) -> (input, output)
        self.to_send: dict[tuple, torch.Tensor] = {}  # (direction, mb) -> tensor to send
        self.batches: dict[int, Any] = {}  # mb -> batch, read once, used by FS and FE
        self.sends = PendingSends()
        # each backward op's last micro-batch in this list (per-stage DP: a lane's micro-batches
        # are global ids, not 0..m-1), where megatron's DDP may start its gradient reduce
        self.last_backward = {a.op: a.mb for a in actions
                              if a.op in _BACKWARD_OF or a.op in _WEIGHTS}
        # None unless the list splits backwards
        self.store, self.split = _wgrad_store(actions, roles)

    def run(self, a: Action) -> None:
        if a.op in (Op.RECV_F, Op.RECV_B):
            direction = _DIRECTION[a.op]
            self.posted[(direction, a.mb)] = self.comm.recv(self.tensor_shape, a.peer, direction)
        elif a.op in (Op.WAIT_F, Op.WAIT_B):
            key = (_DIRECTION[a.op], a.mb)
            tensor, work = self.posted.pop(key)
            work.wait()
            self.ready[key] = tensor
        elif a.op in (Op.SEND_F, Op.SEND_B):
            self._send(a)
        elif a.op in _WEIGHTS:
            with _no_sync(self.config, self.roles, a, self.last_backward[a.op]):
                self.store.run((a.mb, _CHUNK_NAME[a.op]))
        elif a.op in _BACKWARD_OF:
            self._backward(a)
        else:
            self._forward(a)

    def _send(self, a: Action) -> None:
        tensor = self.to_send.pop((_DIRECTION[a.op], a.mb))
        work = self.comm.send(tensor, a.peer, _DIRECTION[a.op])
        if work is not None:
            self.sends.add(work)

    def _forward(self, a: Action) -> None:
        model = self.roles.chunks[a.op]
        inp = self.ready.pop((FORWARD, a.mb), None)
        is_loss = a.op in self.roles.computes_loss
        # the chunk's own config: megatron's forward_step scales the MTP losses only when the
        # config it gets has mtp_num_layers, and ldt gives only the head's chunk that
        out, _ = forward_step(self.forward_step_func, self._data_for(a.op, a.mb), model,
                              self.num_microbatches, inp, self.result.losses,
                              getattr(model, "config", self.config), cp_group_size=1,
                              current_microbatch=a.mb, is_last_stage=is_loss)
        if self.keep_activations:
            self.saved[(a.op, a.mb)] = (inp, out)
        if not is_loss:
            self.to_send[(FORWARD, a.mb)] = out

    def _data_for(self, op: Op, mb: int):
        if op not in self.roles.reads_data or self.data_iterator is None:
            return None
        if mb not in self.batches:
            self.batches[mb] = next(self.data_iterator)
        batch = self.batches[mb] if op is not Op.FE else self.batches.pop(mb)
        return iter([batch])

    def _backward(self, a: Action) -> None:
        inp, out = self.saved.pop((_BACKWARD_OF[a.op], a.mb))
        grad = None if a.op is Op.BS or (a.op is Op.B and Op.F in self.roles.computes_loss) \
            else self.ready.pop((BACKWARD, a.mb))
        # megatron's DDP with overlap_grad_reduce: only the last micro-batch's backward may
        # start the bucket reduces (config.no_sync_func, set as megatron's training loop does)
        capture = self.store.capture((a.mb, _CHUNK_NAME[a.op])) if a.op in self.split \
            else contextlib.nullcontext()
        with _no_sync(self.config, self.roles, a, self.last_backward[a.op]), capture:
            in_grad = backward_step(inp, out, grad, *self.model_type, self.config)
        if in_grad is not None:
            self.to_send[(BACKWARD, a.mb)] = in_grad

    def finish(self) -> None:
        """Wait the sends still in flight, run what the W store still holds, and check that
        every receive and every kept activation was used."""
        self.sends.wait_all()
        if self.store is not None:
            self.store.finish()  # every deferred weight gradient has run
        if self.posted or self.saved:
            raise ActionError(f"step ended with unconsumed receives {sorted(self.posted)} or "
                              f"activations {sorted(self.saved)}: the action list is "
                              "inconsistent")


def _wgrad_store(actions: list[Action], roles: StageRoles) -> tuple:
    """(the W store of a zero-bubble list, the backward ops it captures); (None, empty) for a
    list without W ops."""
    names = {_CHUNK_NAME[a.op] for a in actions if a.op in _WEIGHTS}
    split = frozenset(op for op in _BACKWARD_OF if _CHUNK_NAME[op] in names)
    if not split:
        return None, split
    # late: importing a patch module registers its patch, and the registry applies patches in
    # the order their modules were first imported (patches/registry.py)

    return WgradStore(WgradSeam({_CHUNK_NAME[op]: roles.chunks[op] for op in split})), split


class PendingSends:
    """The step's sends in flight. Each holds its tensor until waited; the runtime lets the
    completed ones go before every action (waiting a completed send returns at once, and a
    gloo work is waited once), the rest at the step's end."""

    def __init__(self):
        self.works: list = []

    def add(self, work) -> None:
        self.works.append(work)

    def let_go_completed(self) -> None:
        still = []
        for work in self.works:
            if work.is_completed():
                work.wait()
            else:
                still.append(work)
        self.works = still

    def wait_all(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []


def _no_sync(config, roles: StageRoles, a: Action, last_mb: int):
    no_sync = getattr(config, "no_sync_func", None)
    if no_sync is None or a.mb == last_mb:
        return contextlib.nullcontext()
    if isinstance(no_sync, list):  # one per chunk, in the order of the stage's models
        no_sync = no_sync[roles.models.index(roles.chunks[a.op])]
    return no_sync()


def _label(a: Action):
    """A profiler range per action (``PP:0FS3``), visible in torch.profiler traces."""
    try:
        return torch.profiler.record_function(f"PP:{a}")
    except Exception:  # profiler unavailable in this build
        return contextlib.nullcontext()
