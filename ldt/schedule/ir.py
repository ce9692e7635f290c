"""The schedule IR: actions, schedules, their string/CSV forms and the step grid.

A pipeline schedule is plain data so that it can be generated, lowered, checked for deadlocks,
timed and drawn before any process runs, and walked by one small runtime.

* An :class:`Action` is ``(stage, op, mb, peer)``; its compact string form is ``0FS3`` (stage 0,
  forward of the start chunk, micro-batch 3), ``0SEND_F3>1`` (stage 0 sends the activation of
  micro-batch 3 to stage 1) or ``2RECV_B1<3`` (stage 2 posts the receive of the gradient of
  micro-batch 1 from stage 3).
* A zero-bubble schedule splits each backward in two: ``B`` (``BS``, ``BE`` on the edge) computes
  the input's gradient, which the previous stage waits for, and ``W`` (``WS``, ``WE``) the
  weights' gradient, which nobody waits for, so it can fill an idle slot later. A W op pairs with
  the backward of the same suffix: ``W`` with ``B``, ``WS`` with ``BS`` (the end chunk), ``WE``
  with ``BE`` (the start chunk).
* A :data:`Schedule` is ``dict[stage, list[Action]]``. It is keyed by *stage*, not by rank: every
  rank of a stage runs the same list, only the stage leader really sends and receives.
* A message travels on a :data:`Channel` ``(src_stage, dst_stage, direction)``, direction ``"F"``
  for activations and ``"B"`` for gradients; messages on one channel are FIFO.

This module imports nothing heavy (no torch) so tools and tests can use it anywhere.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from enum import Enum
from typing import NamedTuple


class Op(str, Enum):
    """What an action does. The value is the token used in the string form."""

    F = "F"  # forward of a plain (cloud) stage
    B = "B"  # backward of a plain (cloud) stage
    FS = "FS"  # U-shape edge: forward of the start chunk
    FE = "FE"  # U-shape edge: forward of the end chunk, including the loss
    BS = "BS"  # U-shape edge: backward of the end chunk (starts the backward pass)
    BE = "BE"  # U-shape edge: backward of the start chunk (ends the backward pass)
    W = "W"  # zero-bubble: the weights' gradient of a plain stage's B, run later
    WS = "WS"  # zero-bubble edge: the weights' gradient of BS (the end chunk)
    WE = "WE"  # zero-bubble edge: the weights' gradient of BE (the start chunk)
    SEND_F = "SEND_F"  # send an activation to the next stage (non-blocking)
    RECV_F = "RECV_F"  # post the receive of an activation from the previous stage
    WAIT_F = "WAIT_F"  # block until that activation has arrived
    SEND_B = "SEND_B"  # send a gradient to the previous stage (non-blocking)
    RECV_B = "RECV_B"  # post the receive of a gradient from the next stage
    WAIT_B = "WAIT_B"  # block until that gradient has arrived

    def __str__(self) -> str:
        return self.value


COMPUTE_OPS = frozenset({Op.F, Op.B, Op.FS, Op.FE, Op.BS, Op.BE, Op.W, Op.WS, Op.WE})
EDGE_OPS = (Op.FS, Op.FE, Op.BS, Op.BE)  # in the order one micro-batch must run them
PLAIN_OPS = (Op.F, Op.B)
WEIGHT_OPS = {Op.W: Op.B, Op.WS: Op.BS, Op.WE: Op.BE}  # W op -> the backward it follows
W_OF = {b: w for w, b in WEIGHT_OPS.items()}  # a backward op -> the W split from it
FORWARD_OPS = frozenset({Op.F, Op.FS, Op.FE})  # an evaluation (forward-only) schedule's ops
SEND_OPS = frozenset({Op.SEND_F, Op.SEND_B})
RECV_OPS = frozenset({Op.RECV_F, Op.RECV_B})
WAIT_OPS = frozenset({Op.WAIT_F, Op.WAIT_B})
COMM_OPS = SEND_OPS | RECV_OPS | WAIT_OPS
_DIRECTION = {op: op.value[-1] for op in COMM_OPS}  # "F" or "B"; read per action, so a dict

Channel = tuple[int, int, str]
"""``(src_stage, dst_stage, direction)`` with direction ``"F"`` or ``"B"``."""


class Action(NamedTuple):
    """One step of one stage. ``peer`` names the other stage of a communication action."""

    stage: int
    op: Op
    mb: int
    peer: int | None = None

    def __str__(self) -> str:
        text = f"{self.stage}{self.op.value}{self.mb}"
        if self.op in SEND_OPS:
            return f"{text}>{self.peer}"
        if self.op in RECV_OPS or self.op in WAIT_OPS:
            return f"{text}<{self.peer}"
        return text

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS

    @property
    def channel(self) -> Channel | None:
        """The channel a communication action uses, ``None`` for compute."""
        direction = _DIRECTION.get(self.op)
        if direction is None:
            return None
        if self.op in SEND_OPS:
            return (self.stage, _peer(self), direction)
        return (_peer(self), self.stage, direction)

    @classmethod
    def parse(cls, text: str) -> Action:
        return parse_action(text)


Schedule = dict[int, list[Action]]
"""Stage index -> the ordered actions every rank of that stage runs."""


class LaneSchedule(dict):
    """A schedule keyed by *lane* (a stage replica, per-stage DP: :mod:`ldt.schedule.routing`)
    instead of stage: ``Action.stage`` and ``Action.peer`` hold lane ids. Each lane runs only
    its own micro-batches, listed in ``microbatches`` (lane -> ids) for the checker."""

    def __init__(self, actions: dict, microbatches: dict[int, list[int]]):
        super().__init__(actions)
        self.microbatches = {lane: list(mbs) for lane, mbs in microbatches.items()}


def _peer(action: Action) -> int:
    if action.peer is None:
        raise ValueError(f"communication action {action!r} has no peer stage; set Action.peer")
    return action.peer


_ACTION_RE = re.compile(
    r"^(\d+)(SEND_F|SEND_B|RECV_F|RECV_B|WAIT_F|WAIT_B|FS|FE|BS|BE|WS|WE|F|B|W)(\d+)(?:([<>])(\d+))?$"
)


def parse_action(text: str) -> Action:
    """Parse the compact string form back into an :class:`Action` (inverse of ``str``)."""
    match = _ACTION_RE.match(text.strip())
    if match is None:
        raise ValueError(
            f"cannot parse action {text!r}: expected e.g. '1F0', '0FS3', '0SEND_F3>1', '2RECV_B1<3'"
        )
    stage, op_name, mb, arrow, peer = match.groups()
    op = Op(op_name)
    expected_arrow = ">" if op in SEND_OPS else "<" if op in COMM_OPS else None
    if arrow != expected_arrow:
        want = f"'{expected_arrow}PEER'" if expected_arrow else "no peer"
        raise ValueError(f"cannot parse action {text!r}: {op.value} takes {want}")
    return Action(int(stage), op, int(mb), int(peer) if peer is not None else None)


def num_microbatches(schedule: Schedule) -> int:
    """Number of micro-batches a schedule covers (largest id + 1; 0 when empty)."""
    return 1 + max((a.mb for actions in schedule.values() for a in actions), default=-1)


def format_grid(
    schedule: Schedule,
    mark: tuple[int, int] | Iterable[tuple[int, int]] | None = None,
    context: int | None = None,
) -> str:
    """Render the schedule step by step: one column per stage, one row per list index.

    ``mark`` is one ``(stage, index)`` or several; marked cells are wrapped in ``>> <<`` so an error
    report shows where each stage is stuck. ``context`` keeps only the rows within that distance of
    a mark (long schedules otherwise drown the message).
    """
    marks = _normalise_marks(mark)
    stages = sorted(schedule)
    rows = max((len(schedule[s]) for s in stages), default=0)
    first, last = 0, rows - 1
    if context is not None and marks:
        first = max(0, min(i for _, i in marks) - context)
        last = min(rows - 1, max(i for _, i in marks) + context)

    def cell(stage: int, index: int) -> str:
        if index >= len(schedule[stage]):
            return ""
        text = str(schedule[stage][index])
        return f">>{text}<<" if (stage, index) in marks else text

    header = ["step"] + [f"stage {s}" for s in stages]
    body = [[str(i)] + [cell(s, i) for s in stages] for i in range(first, last + 1)]
    widths = [max(len(r[c]) for r in [header, *body]) for c in range(len(header))]
    lines = ["  ".join(t.ljust(w) for t, w in zip(r, widths)).rstrip() for r in [header, *body]]
    if first > 0:
        lines.insert(1, f"... ({first} earlier steps)")
    if last < rows - 1:
        lines.append(f"... ({rows - 1 - last} later steps)")
    return "\n".join(lines)


def _normalise_marks(mark: tuple[int, int] | Iterable[tuple[int, int]] | None) -> set[tuple[int, int]]:
    if mark is None:
        return set()
    if isinstance(mark, tuple) and len(mark) == 2 and all(isinstance(x, int) for x in mark):
        return {(mark[0], mark[1])}
    return {(int(s), int(i)) for s, i in mark}  # type: ignore[misc]


def to_csv(schedule: Schedule) -> str:
    """One line per stage: ``stage,action,action,...`` (write it with ``Path.write_text``)."""
    return "".join(
        ",".join([str(stage), *map(str, schedule[stage])]) + "\n" for stage in sorted(schedule)
    )


def from_csv(text: str) -> Schedule:
    """Inverse of :func:`to_csv`; checks each action belongs to the stage of its line."""
    schedule: Schedule = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        first, *cells = line.strip().split(",")
        stage = int(first)
        if stage in schedule:
            raise ValueError(f"CSV line {lineno}: stage {stage} appears twice")
        actions = [parse_action(c) for c in cells if c.strip()]
        for action in actions:
            if action.stage != stage:
                raise ValueError(f"CSV line {lineno}: action {action} is on stage {action.stage}, "
                                 f"but the line is for stage {stage}")
        schedule[stage] = actions
    return schedule
