"""Check a schedule before any process runs it: coverage, ordering, message matching, deadlock.

A hung pipeline is the worst failure a user can get (no stack trace, every rank waiting). Most
hangs are visible in the schedule itself, so :func:`check_schedule` rejects them up front and
says which stage would be stuck at which action, with the step grid marked.

The dry run model: SEND is buffered (never blocks), posting a RECV never blocks, WAIT blocks until
the matching SEND has run. Messages on one channel ``(src, dst, direction)`` match first-in
first-out. :func:`match_messages` and :func:`play` are the one implementation of that model; the
timed simulator (``simulate.py``) calls them with real durations.
"""

from __future__ import annotations

from collections import deque
from math import inf
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Optional, Union

from ldt.schedule.ir import (
    COMPUTE_OPS,
    EDGE_OPS,
    FORWARD_OPS,
    PLAIN_OPS,
    RECV_OPS,
    SEND_OPS,
    WAIT_OPS,
    WEIGHT_OPS,
    Action,
    Channel,
    Op,
    Schedule,
    format_grid,
    num_microbatches,
)

Slot = tuple[int, int]
"""``(stage, index into that stage's list)``."""


class ScheduleError(RuntimeError):
    """The schedule is wrong; the message names the stage, the action and the fix."""


def check_schedule(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless the schedule is complete, well-ordered and deadlock-free."""
    play(schedule, check_structure(schedule))


def check_structure(schedule: Schedule) -> dict[Slot, Slot]:
    """All checks except the dry run; returns the WAIT -> SEND matching the dry run needs."""
    _check_stage_keys(schedule)
    # a schedule without any backward is an evaluation schedule: it needs the forwards only
    training = any(a.op in COMPUTE_OPS - FORWARD_OPS for acts in schedule.values() for a in acts)
    count = num_microbatches(schedule)
    for stage in sorted(schedule):
        _check_compute(schedule, stage, training, count)
        _check_recv_wait_pairs(schedule, stage)
    return match_messages(schedule)


def _check_stage_keys(schedule: Schedule) -> None:
    for stage, actions in schedule.items():
        for index, action in enumerate(actions):
            if action.stage != stage:
                raise _error(schedule, (stage, index),
                             f"action #{index} {action} of stage {stage} says it runs on stage "
                             f"{action.stage}; a stage's list holds only its own actions")


def _check_compute(schedule: Schedule, stage: int, training: bool, count: int) -> None:
    """Each micro-batch runs each required compute op exactly once, in data-flow order; a
    stage that splits its backward (W ops) runs each W once, after its B, in the B's order."""
    actions = schedule[stage]
    ops = {a.op for a in actions if a.op in COMPUTE_OPS}
    edge = bool(ops & (set(EDGE_OPS) | {Op.WS, Op.WE}))
    kind_ops = EDGE_OPS if edge else PLAIN_OPS
    weight_ops = tuple(w for w, b in WEIGHT_OPS.items() if b in kind_ops)
    if ops - set(kind_ops) - set(weight_ops):
        raise _error(schedule, None, f"stage {stage} mixes plain ops {PLAIN_OPS} and U-shape edge "
                     f"ops {EDGE_OPS}; a stage is either a plain stage or the edge")
    required = kind_ops if training else tuple(op for op in kind_ops if op in FORWARD_OPS)
    split = tuple(w for w in weight_ops if w in ops)  # a W op present is needed for every mb
    seen: dict[tuple[int, object], int] = {}
    backwards: dict[Op, list[int]] = {WEIGHT_OPS[w]: [] for w in split}  # mbs in B order
    for index, action in enumerate(actions):
        if action.op not in COMPUTE_OPS:
            continue
        key = (action.mb, action.op)
        if key in seen:
            raise _error(schedule, [(stage, seen[key]), (stage, index)],
                         f"stage {stage} runs {action} twice (actions #{seen[key]} and #{index}); "
                         "each micro-batch runs each compute op once")
        if action.op in WEIGHT_OPS:
            _check_weight(schedule, stage, index, action, seen, backwards)
        else:
            position = required.index(action.op)
            if position > 0 and (action.mb, required[position - 1]) not in seen:
                before = Action(stage, required[position - 1], action.mb)
                raise _error(schedule, (stage, index),
                             f"stage {stage} runs {action} at #{index} before {before}; per "
                             f"micro-batch the order must be {'<'.join(o.value for o in required)}")
            if action.op in backwards:
                backwards[action.op].append(action.mb)
        seen[key] = index
    expected = getattr(schedule, "microbatches", None)  # a LaneSchedule: the lane's own
    extra = {mb for mb, _ in seen} - set(expected[stage]) if expected is not None else set()
    if extra:
        raise _error(schedule, None, f"lane {stage} runs micro-batches {sorted(extra)} that "
                     f"routing gives to other lanes (its own: {expected[stage]})")
    for mb in expected[stage] if expected is not None else range(count):
        for op in required + split:
            if (mb, op) not in seen:
                raise _error(schedule, None, f"stage {stage} never runs {Action(stage, op, mb)}; "
                             f"every micro-batch 0..{count - 1} needs it"
                             if expected is None else f"lane {stage} never runs "
                             f"{Action(stage, op, mb)}; its micro-batches {expected[stage]} "
                             "need it")


def _check_weight(schedule: Schedule, stage: int, index: int, action: Action,
                  seen: dict[tuple[int, object], int], backwards: dict[Op, list[int]]) -> None:
    """A W op runs after its backward (it computes what that backward deferred), and the W
    ops of one chunk run in the order of their backwards (Transformer Engine's deferred
    weight gradients are a queue per layer: the next ``backward_dw`` takes the oldest)."""
    backward = WEIGHT_OPS[action.op]
    if (action.mb, backward) not in seen:
        raise _error(schedule, (stage, index),
                     f"stage {stage} runs {action} at #{index} before "
                     f"{Action(stage, backward, action.mb)}; a weight gradient ({action.op.value})"
                     f" runs after the backward ({backward.value}) that deferred it")
    oldest = backwards[backward][sum(1 for mb in backwards[backward]
                                     if (mb, action.op) in seen)]
    if oldest != action.mb:
        raise _error(schedule, (stage, index),
                     f"stage {stage} runs {action} at #{index} before "
                     f"{Action(stage, action.op, oldest)}; {action.op.value} ops run in the order "
                     f"of their {backward.value} ops (a queue per chunk): run "
                     f"{Action(stage, action.op, oldest)} first")


def _check_recv_wait_pairs(schedule: Schedule, stage: int) -> None:
    """Every WAIT follows the RECV that posted it; every posted RECV is waited exactly once."""
    posted: dict[tuple[Channel | None, int], int] = {}
    for index, action in enumerate(schedule[stage]):
        key = (action.channel, action.mb)
        if action.op in RECV_OPS:
            if key in posted:
                raise _error(schedule, [(stage, posted[key]), (stage, index)],
                             f"stage {stage} posts {action} twice without waiting in between")
            posted[key] = index
        elif action.op in WAIT_OPS:
            if posted.pop(key, None) is None:
                raise _error(schedule, (stage, index),
                             f"stage {stage} action #{index} {action} waits for a receive it never "
                             f"posted; put {action.op.value.replace('WAIT', 'RECV')} for micro-batch "
                             f"{action.mb} from stage {action.peer} before it")
    if posted:
        key, index = next(iter(posted.items()))
        raise _error(schedule, (stage, index),
                     f"stage {stage} action #{index} {schedule[stage][index]} is posted but never "
                     "waited; add the matching WAIT before the compute that consumes it")


def match_messages(schedule: Schedule) -> dict[Slot, Slot]:
    """Pair every WAIT with the SEND that satisfies it: ``{wait slot: send slot}``.

    Receives on a channel match sends on that channel in order (FIFO), so the k-th RECV posted on
    a channel is the k-th SEND, and its WAIT is satisfied once that SEND has run. Raises when the
    two ends disagree on the number of messages or on a message's micro-batch.
    """
    sends: dict[Channel, list[Slot]] = {}
    recvs: dict[Channel, list[Slot]] = {}
    waits: dict[tuple[Channel, int], Slot] = {}
    for stage, actions in schedule.items():
        for index, action in enumerate(actions):
            if action.op in SEND_OPS:
                sends.setdefault(action.channel, []).append((stage, index))  # type: ignore[arg-type]
            elif action.op in RECV_OPS:
                recvs.setdefault(action.channel, []).append((stage, index))  # type: ignore[arg-type]
            elif action.op in WAIT_OPS:
                waits[(action.channel, action.mb)] = (stage, index)  # type: ignore[index]
    matches: dict[Slot, Slot] = {}
    for channel in sorted(set(sends) | set(recvs)):
        send_slots, recv_slots = sends.get(channel, []), recvs.get(channel, [])
        for k in range(max(len(send_slots), len(recv_slots))):
            if k >= min(len(send_slots), len(recv_slots)) or (
                _at(schedule, send_slots[k]).mb != _at(schedule, recv_slots[k]).mb
            ):
                _raise_mismatch(schedule, channel, send_slots, recv_slots, k)
            matches[waits[(channel, _at(schedule, recv_slots[k]).mb)]] = send_slots[k]
    return matches


def _raise_mismatch(schedule: Schedule, channel: Channel, send_slots: list[Slot],
                    recv_slots: list[Slot], k: int) -> None:
    src, dst, direction = channel
    sent = [_at(schedule, s).mb for s in send_slots]
    received = [_at(schedule, s).mb for s in recv_slots]
    name = f"channel {src}->{dst} ({direction})"
    lists = f"micro-batches sent {sent}, received {received}"
    if k >= len(send_slots):
        wait = _wait_of(schedule, recv_slots[k])
        mark: Slot | list[Slot] = wait
        text = (f"{name}: stage {dst} would be stuck at action #{wait[1]} {_at(schedule, wait)} "
                f"(message #{k} on the channel) because stage {src} never sends it; {lists}. Add "
                f"the missing SEND on stage {src} right after the compute producing it")
    elif k >= len(recv_slots):
        mark = send_slots[k]
        text = (f"{name}: stage {src} action #{send_slots[k][1]} {_at(schedule, send_slots[k])} "
                f"(message #{k}) is never received by stage {dst}; {lists}. Add the RECV/WAIT on "
                f"stage {dst}")
    else:
        wait = _wait_of(schedule, recv_slots[k])
        mark = [wait, send_slots[k]]
        recv, send = _at(schedule, wait), _at(schedule, send_slots[k])
        text = (f"{name}: stage {dst} would be stuck at action #{wait[1]} {recv} or compute on the "
                f"wrong data: it expects micro-batch {recv.mb} as message #{k} on the channel, but "
                f"the send matching it (FIFO) is stage {src} action #{send_slots[k][1]} {send}. "
                f"{lists}. Make both ends send and receive in one order (is a SEND missing?)")
    raise _error(schedule, mark, text)


@dataclass
class Played:
    """Start/end time of every action, per stage, in list order; and each SEND's time."""

    start: dict[int, list[float]]
    end: dict[int, list[float]]


Price = Union[Callable[[Action], float], Mapping[tuple, float]]
"""An action's time: a function of the action, or a table read without a call per action (the
planner's case), keyed ``(stage, op.value)`` for a compute and ``(stage, peer)`` for a send."""

_COMPUTE, _WAIT, _SEND, _RECV = range(4)


@dataclass(frozen=True, eq=False)
class Program:
    """A checked schedule in the form :func:`play` runs: per stage and action, what it is and
    which message it sends, waits for or posts (messages numbered by their SEND). Compiled once
    per schedule: the planner plays one schedule under hundreds of costs."""

    codes: dict[int, list[int]]
    message: dict[int, list[int]]
    """The message a SEND sends, a WAIT waits for, a RECV posts; -1 for a compute."""
    keys: dict[int, list[tuple[int, str]]]
    """Per action, ``(stage, op.value)``: a compute's key in a :data:`Price` table."""
    sends: list[Action]

    def own_times(self, schedule: Schedule, duration: Price,
                  local_time: Optional[Callable[[Action], float]]) -> dict[int, list[float]]:
        """Per action, the time it takes itself: a compute its ``duration``, the others their
        ``local_time`` (0 without)."""
        out = {}
        for stage, actions in schedule.items():
            codes, keys = self.codes[stage], self.keys[stage]
            if isinstance(duration, Mapping) and local_time is None:
                out[stage] = [duration[k] if c == _COMPUTE else 0 for c, k in zip(codes, keys)]
                continue
            price = duration.__getitem__ if isinstance(duration, Mapping) else None
            out[stage] = [(price(k) if price else duration(a)) if c == _COMPUTE  # type: ignore
                          else local_time(a) if local_time else 0
                          for a, c, k in zip(actions, codes, keys)]
        return out

    def transfer_times(self, comm_time: Price) -> list[float]:
        """Per message, its time on the wire (``comm_time`` of its SEND)."""
        if isinstance(comm_time, Mapping):
            return [comm_time[(a.stage, a.peer)] for a in self.sends]
        return [comm_time(a) for a in self.sends]


def compile_play(schedule: Schedule, matches: dict[Slot, Slot]) -> Program:
    """``schedule`` (checked, ``matches`` from :func:`match_messages`) as a :class:`Program`."""
    number = {slot: n for n, slot in enumerate(
        (stage, index) for stage, actions in schedule.items()
        for index, action in enumerate(actions) if action.op in SEND_OPS)}
    codes, message, keys = {}, {}, {}
    for stage, actions in schedule.items():
        codes[stage] = [_CODE[a.op] for a in actions]
        keys[stage] = [(stage, _VALUE[a.op]) for a in actions]
        message[stage] = msgs = [-1] * len(actions)
        posted: dict[tuple, int] = {}  # a RECV's (peer, direction, mb) -> its index, until its WAIT
        for index, (action, code) in enumerate(zip(actions, codes[stage])):
            if code == _WAIT:
                msgs[index] = number[matches[(stage, index)]]
                recv = posted.pop((action.peer, _VALUE[action.op][-1], action.mb), None)
                if recv is not None:
                    msgs[recv] = msgs[index]
            elif code == _SEND:
                msgs[index] = number[(stage, index)]
            elif code == _RECV:
                posted[(action.peer, _VALUE[action.op][-1], action.mb)] = index
    sends = [schedule[stage][index] for stage, index in number]
    return Program(codes, message, keys, sends)


_CODE = {op: _COMPUTE if op in COMPUTE_OPS else _WAIT if op in WAIT_OPS else
         _SEND if op in SEND_OPS else _RECV for op in Op}
_VALUE = {op: op.value for op in Op}  # an Enum's .value is a descriptor call


def play(
    schedule: Schedule,
    matches: dict[Slot, Slot],
    duration: Price = lambda a: 0,
    comm_time: Price = lambda a: 0,
    local_time: Optional[Callable[[Action], float]] = None,
    start_at: dict[int, float] | None = None,
    handshake: Callable[[Action], float] | None = None,
    program: Optional[Program] = None,
) -> Played:
    """Run all stages against each other; raise a deadlock report if they stop progressing.

    Each stage runs until a WAIT whose SEND has not run yet, then parks on that SEND; running the
    SEND wakes it. Linear in the number of actions. A compute takes ``duration(action)``; a SEND
    or RECV takes ``local_time(action)`` to post (the message leaves when the SEND starts); a WAIT
    ends ``local_time(wait)`` after ``max(now, send time + comm_time(send))`` (e.g. a TP>1
    stage's broadcast of what its leader received). Stage ``s`` starts at ``start_at[s]`` (0).
    ``handshake(recv)``: a rendezvous transport (gloo's TCP) sends a message only once the
    receiver's "ready" notice, sent when the RECV was posted, has reached the sender: the
    message leaves at ``max(send time, recv post + handshake(recv))``. None: eager messages.
    ``program``: the schedule compiled by :func:`compile_play` (compiled here if not given).
    """
    program = program or compile_play(schedule, matches)
    run = _Playing(schedule, program, program.own_times(schedule, duration, local_time),
                   program.transfer_times(comm_time), start_at or {}, handshake)
    ready = deque(sorted(schedule))
    while ready:  # a stage runs until it parks; the stages its sends woke run after it
        ready.extend(run.stage(ready.popleft()))
    stuck = [s for s in sorted(schedule) if len(run.start[s]) < len(schedule[s])]
    if stuck:
        _raise_deadlock(schedule, matches, {s: len(run.start[s]) for s in stuck})
    return Played(run.start, run.end)


class _Playing:
    """The clocks of :func:`play`: per stage the start and end of each action run so far, per
    message when it was sent and which stage is parked on it."""

    def __init__(self, schedule: Schedule, program: Program, own: dict, wire: list,
                 start_at: dict[int, float], handshake: Optional[Callable[[Action], float]]):
        self.schedule, self.program, self.own, self.wire = schedule, program, own, wire
        self.handshake = handshake
        self.start: dict[int, list[float]] = {s: [] for s in schedule}
        self.end: dict[int, list[float]] = {s: [] for s in schedule}
        self.clock: dict[int, float] = {s: start_at.get(s, 0) for s in schedule}
        self.sent_at: list[Optional[float]] = [None] * len(wire)
        self.posted: list[float] = [-inf] * len(wire)  # when a RECV's notice reaches the sender
        self.parked: dict[int, int] = {}  # message -> the stage waiting for it

    def stage(self, stage: int) -> list[int]:
        """Run ``stage`` from where it stopped until its end or a WAIT whose SEND has not run;
        returns the stages its SENDs woke. One loop, no call per action: the planner plays
        each schedule under hundreds of costs."""
        codes, message, times = self.program.codes[stage], self.program.message[stage], \
            self.own[stage]
        starts, ends, now = self.start[stage], self.end[stage], self.clock[stage]
        sent_at, posted, parked, handshake = self.sent_at, self.posted, self.parked, \
            self.handshake
        woken = []
        index, count = len(starts), len(codes)
        while index < count:
            code = codes[index]
            if code == _COMPUTE:
                starts.append(now)
                now = now + times[index]
                ends.append(now)
            elif code == _WAIT:
                msg = message[index]
                sent = sent_at[msg]
                if sent is None:
                    parked[msg] = stage
                    break
                starts.append(now)
                now = max(now, max(sent, posted[msg]) + self.wire[msg])
                now = now + times[index]
                ends.append(now)
            else:
                starts.append(now)
                if code == _RECV and handshake is not None and message[index] >= 0:
                    posted[message[index]] = now + handshake(self.schedule[stage][index])
                now = now + times[index]
                ends.append(now)
                if code == _SEND:
                    msg = message[index]
                    sent_at[msg] = starts[-1]
                    waiter = parked.pop(msg, None)
                    if waiter is not None:
                        woken.append(waiter)
            index += 1
        self.clock[stage] = now
        return woken


def _raise_deadlock(schedule: Schedule, matches: dict[Slot, Slot], at: dict[int, int]) -> None:
    lines = []
    for stage, index in at.items():
        action = schedule[stage][index]
        src, dst, direction = action.channel  # type: ignore[misc]
        send_stage, send_index = matches[(stage, index)]
        # the send has not run (else it would have woken this stage), so its stage is stuck too
        blocker = at[send_stage]
        why = f"stage {send_stage} is itself stuck at #{blocker} {schedule[send_stage][blocker]}"
        lines.append(f"deadlock: stage {stage} stuck at action #{index} {action} waiting for "
                     f"channel {src}->{dst} ({direction}) micro-batch {action.mb}, sent by stage "
                     f"{send_stage} at #{send_index} {schedule[send_stage][send_index]}; {why}")
    hint = ("Fix: reorder so that every stage posts/sends what its peer waits for before it "
            "waits itself (e.g. a send must not sit after a WAIT that depends on it).")
    raise _error(schedule, list(at.items()), "\n".join(lines) + "\n" + hint)


def _wait_of(schedule: Schedule, recv_slot: Slot) -> Slot:
    """The WAIT completing a posted RECV (pairing was checked before matching)."""
    stage, index = recv_slot
    recv = schedule[stage][index]
    for later in range(index + 1, len(schedule[stage])):
        action = schedule[stage][later]
        if action.op in WAIT_OPS and action.channel == recv.channel and action.mb == recv.mb:
            return (stage, later)
    return recv_slot


def _at(schedule: Schedule, slot: Slot) -> Action:
    return schedule[slot[0]][slot[1]]


def _error(schedule: Schedule, mark: Slot | list[Slot] | None, message: str) -> ScheduleError:
    context = 6 if mark else None
    return ScheduleError(f"{message}\n\n{format_grid(schedule, mark, context=context)}")
