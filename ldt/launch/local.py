"""Start a local world of processes (gloo on 127.0.0.1): it never hangs and never orphans.

Used by a bare ``ldt-train`` / ``python -m ldt.job.megatron`` on one machine and by the multi-process
tests. Children are forked from a forkserver that has already imported torch and megatron-core
(importing them costs ~5 s and ~360 MB per process here), rendezvous through a TCPStore owned
by the parent on a free port, and report back through one pipe each (pipes, unlike queues,
leave no semaphores behind). The first failure (exception, signal, non-zero exit) or the
timeout kills every child; the error names the rank that failed first and carries its
traceback, or, when every failure is a timeout, the rank the others were waiting for
(:mod:`ldt.launch.progress`).

Lifetimes. Every child watches a lifeline, the read end of a pipe whose only write end the
launcher holds: EOF means the launcher is gone, however it died (SIGKILL included), and the
child exits at once. multiprocessing hands every child the write end of the forkserver's own
"alive" pipe; children close it, so the forkserver ends with the launcher (not with the last
child), and PR_SET_PDEATHSIG then kills a child that cannot run its watcher (a stopped one).
The resource tracker ends when the last of them is gone.

Signals. SIGTERM, SIGINT and SIGHUP to the launcher are forwarded to every child; a child
that handles them (ldt-train's ranks stop together at the next step boundary) returns
normally. A second signal, or ``stop_grace_s`` without an end, stops the world at once.
"""

from __future__ import annotations

import atexit
import importlib
import math
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence, Union

from ldt.launch import progress as _progress
from ldt.launch.lifetime import die_with_parent

PRELOAD = ["ldt.launch.forkserver", "ldt.launch.quiet", "torch", "torch.distributed",
           "megatron.core.parallel_state", "megatron.core.models.gpt",
           "megatron.core.pipeline_parallel.schedules", "ldt",
           "matplotlib.pyplot"]  # a run's timeline.png: 0.34 s of imports on its reporting rank
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
EXIT_ORPHANED = 70  # a child whose launcher is gone

_CTX: Optional[mp.context.BaseContext] = None


class WorldError(RuntimeError):
    """A local world failed: ``rank`` failed first, or (``stalled``) stopped making progress
    while the others waited for it; None when nothing names one. ``stopped_by``: the signal
    the launcher received, when it was told to stop."""

    def __init__(self, message: str, rank: Optional[int] = None, tb: str = "", *,
                 stalled: bool = False, stopped_by: Optional[int] = None):
        super().__init__(message + (f"\n--- traceback of rank {rank} ---\n{tb}" if tb else ""))
        self.rank, self.tb, self.stalled, self.stopped_by = rank, tb, stalled, stopped_by
        self.message = message


@dataclass
class _Msg:
    rank: int
    ok: bool
    payload: Any


def start_method() -> str:
    """How this machine starts a local world's ranks: ``forkserver`` (each rank forked from one
    process that has imported torch and megatron-core: fast), or ``spawn`` (a fresh interpreter
    per rank) on a machine with an accelerator. CUDA refuses to start in a process forked from
    one that asked the driver anything ("Cannot re-initialize CUDA in forked subprocess"), and
    the preload asks it: on an H200 with torch 2.11, importing megatron.core.parallel_state
    reaches torch._inductor.runtime.benchmarking, whose import calls torch.cuda.is_available()
    (every CUDA rank of the first GPU run failed so). torch's own advice for CUDA is spawn. The launcher's own CUDA state never matters: no rank
    is forked from it. ``LDT_START_METHOD=forkserver|spawn`` overrides."""
    chosen = os.environ.get("LDT_START_METHOD", "")
    if chosen:
        if chosen not in ("forkserver", "spawn"):
            raise ValueError(f"LDT_START_METHOD={chosen!r}: use 'forkserver' or 'spawn'")
        return chosen
    import torch

    accelerator = getattr(torch, "accelerator", None)
    found = accelerator.is_available() if accelerator is not None else torch.cuda.is_available()
    return "spawn" if found else "forkserver"


# device nodes of an accelerator's driver (NVIDIA, AMD's ROCm, Ascend, Linux's accel class)
ACCELERATOR_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/davinci_manager", "/dev/accel")


def start_forkserver_early() -> None:
    """Start the forkserver now (its imports take ~3.4 s before a rank can fork), where the
    ranks will fork from it: the launcher's own work until its first world (torch's import,
    the memory estimate, the run folder) then overlaps them. Where ``LDT_START_METHOD`` says
    spawn, or the machine has an accelerator's device node, nothing: :func:`start_method`
    decides there, after importing torch."""
    if os.environ.get("LDT_START_METHOD", "forkserver") != "forkserver" or any(
            os.path.exists(node) for node in ACCELERATOR_NODES):
        return
    from multiprocessing import forkserver

    _context("forkserver")
    forkserver.ensure_running()


def _context(method: str) -> mp.context.BaseContext:
    global _CTX
    if method == "spawn":
        return mp.get_context("spawn")
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _CTX = ctx
    return _CTX


def entry(fn: Union[Callable, str]) -> Callable:
    """``fn`` itself, or the function a ``"module:function"`` name points to: a rank's work
    named so is imported in the rank only, and the launcher stays without what it loads."""
    if not isinstance(fn, str):
        return fn
    module, _, name = fn.partition(":")
    return getattr(importlib.import_module(module), name)


def _child(rank: int, world_size: int, port: int, fn: Union[Callable, str], args: tuple,
           env: dict, conn: Any, timeout_s: float, init_dist: bool, lifeline: Any,
           slots: Any) -> None:
    _detach_from_forkserver()
    die_with_parent()  # the forkserver's death: the backstop for a child that cannot watch
    atexit.unregister(os._exit)  # the forkserver's way out (ldt.launch.forkserver): not a rank's,
    # whose atexit handlers a script runner (ldt.job.megatron) calls before the rank reports
    for sig in (signal.SIGTERM, signal.SIGHUP):  # the forkserver ignores them (ldt.launch.forkserver)
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # and SIGINT: a rank's Ctrl-C
    record = _progress.attach(slots[rank])
    record.start(os.getpid())
    threading.Thread(target=_watch_lifeline, args=(lifeline, record), daemon=True,
                     name="ldt-lifeline").start()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        import torch.distributed as dist

        if init_dist:  # else fn joins itself (env://, as a script under torchrun does)
            record.begin("joining the world", waiting=True)
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                                  timeout=timedelta(seconds=timeout_s))
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout_s))
        record.begin("running")
        out = entry(fn)(rank, world_size, *args)
        record.finish()
        # Plain bytes: torch's queue reducers would share tensors through file descriptors
        # that die with this process before the parent reads them.
        conn.send(_Msg(rank, True, _dumps(out)))
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
    except BaseException:  # report everything, including KeyboardInterrupt / SystemExit
        try:
            conn.send(_Msg(rank, False, traceback.format_exc()))
        finally:
            os._exit(1)
    conn.close()
    os._exit(0)


def _watch_lifeline(lifeline, record: _progress.Progress) -> None:
    """Heartbeat until the lifeline reports EOF (the launcher is gone), then exit at once."""
    try:
        while not lifeline.poll(_progress.HEARTBEAT_S):
            record.beat()
    except (OSError, EOFError):
        pass
    os._exit(EXIT_ORPHANED)


def run_local_world(world_size: int, fn: Union[Callable, str], args: Sequence = (), *,
                    timeout_s: Optional[float] = 300.0,
                    comm_timeout_s: Optional[float] = None,
                    env: Optional[dict] = None, grace_s: float = 3.0,
                    init_dist: bool = True, stop_grace_s: float = 120.0,
                    start: Optional[str] = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes; return results.

    ``fn`` must be importable (module-level), or named ``"module:function"`` (imported in the
    ranks only, :func:`entry`). Raises :class:`WorldError` on the first failure,
    after ``timeout_s``, or when a stop signal did not end the world within ``stop_grace_s``;
    whatever happens, no child is left running. ``timeout_s=None``: no limit on the whole
    world (a training run: a hang is what ``comm_timeout_s``, every group's timeout, ends, and
    a healthy run may take any time). ``start``: ``forkserver`` or ``spawn`` (default:
    :func:`start_method`).
    """
    import torch.distributed as dist

    ctx = _context(start or start_method())
    comm_timeout_s = comm_timeout_s or timeout_s or 300.0
    store_timeout_s = timeout_s if timeout_s is not None else max(300.0, comm_timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=store_timeout_s))
    lifeline_r, lifeline_w = ctx.Pipe(duplex=False)
    slots = ctx.RawArray(_progress.ProgressSlot, world_size)
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
    procs = [
        ctx.Process(target=_child, name=f"ldt-rank{r}",
                    args=(r, world_size, store.port, fn, tuple(args), dict(env or {}),
                          pipes[r][1], comm_timeout_s, init_dist, lifeline_r, slots))
        for r in range(world_size)
    ]
    stop = _StopSignals(procs, stop_grace_s)
    try:
        with stop:
            for p in procs:
                p.start()
            stop.forward()
            lifeline_r.close()
            for _, writer in pipes:
                writer.close()  # the child holds its own end; EOF then means the child is gone
            return _wait(procs, pipes, slots, stop, timeout_s, grace_s)
    finally:
        lifeline_w.close()  # every child still running exits on its own
        _reap(procs)
        for reader, _ in pipes:
            reader.close()


def _wait(procs, pipes, slots, stop: "_StopSignals", timeout_s: Optional[float],
          grace_s: float):
    world_size = len(procs)
    readers = {pipes[r][0]: r for r in range(world_size)}
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s if timeout_s is not None else math.inf
    while len(out) < world_size:
        failures = _poll(readers, procs, out, timeout=0.2)
        if failures:
            # Read who did what before anyone else gives up; then, since a dead rank makes its
            # peers fail too (connection reset), collect what arrives in a short grace period
            # and blame the root cause, not a symptom.
            seen = _progress.snapshot(slots, [r in readers.values() for r in range(world_size)])
            end = time.monotonic() + grace_s
            while readers and time.monotonic() < end:
                failures += _poll(readers, procs, out, timeout=0.1)
            raise stop.explain(_root_cause(failures, seen))
        stop.check()
        if time.monotonic() > deadline:
            missing = sorted(set(range(world_size)) - set(out))
            seen = _progress.snapshot(slots, [r in missing for r in range(world_size)])
            found = _progress.blame(seen)
            why = f"; rank {found[0]}: {found[1]}" if found else ""
            raise stop.explain(WorldError(
                f"timeout after {timeout_s:.0f}s; ranks {missing} did not finish{why}",
                found[0] if found else None, stalled=found is not None))
    return [out[r] for r in range(world_size)]


class _StopSignals:
    """TERM/INT/HUP handling of the launcher while a world runs (main thread only)."""

    def __init__(self, procs, grace_s: float):
        self.procs, self.grace_s = procs, grace_s
        self.signum: Optional[int] = None
        self.deadline: Optional[float] = None
        self.again = False
        self._old: dict = {}
        self._told: set[int] = set()  # the ranks' pids the signal went to

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self._old.items():
            signal.signal(s, handler)

    def _on_signal(self, signum, frame) -> None:
        if self.signum is not None:
            self.again = True
            return
        self.signum, self.deadline = signum, time.monotonic() + self.grace_s
        self.forward()

    def forward(self) -> None:
        """Pass the stop signal on to every rank started and not told yet (a signal while the
        world starts reaches the ranks that start after it too)."""
        if self.signum is None:
            return
        for p in self.procs:
            if p.pid is not None and p.pid not in self._told:
                self._told.add(p.pid)
                try:
                    os.kill(p.pid, self.signum)
                except ProcessLookupError:
                    pass

    def check(self) -> None:
        if self.signum is None:
            return
        name = signal.Signals(self.signum).name
        if self.again:
            raise WorldError(f"stopped by {name}, then a second signal: stopped at once",
                             stopped_by=self.signum)
        if time.monotonic() > self.deadline:
            raise WorldError(f"stopped by {name}: the ranks did not stop within "
                             f"{self.grace_s:.0f}s", stopped_by=self.signum)

    def explain(self, exc: WorldError) -> WorldError:
        """A failure while stopping is the stop's doing, not a fault of the run."""
        if self.signum is not None and exc.stopped_by is None:
            exc.stopped_by = self.signum
        return exc


_SYMPTOMS = ("Connection reset", "Connection closed", "connection closed", "timed out",
             "Timed out", "Broken pipe", "ECONNRESET")


def is_peer_symptom(text: str) -> bool:
    """Does an error's text say that a peer went away or did not answer in time (a rank died
    or stalled, a link went down), rather than what went wrong in this rank?"""
    return any(s in text for s in _SYMPTOMS)


def _poll(readers: dict, procs, out: dict, timeout: float) -> list[WorldError]:
    """Read whatever the children said; return failures (results go into ``out``)."""
    failures = []
    for conn in mp_connection.wait(list(readers), timeout=timeout):
        r = readers.pop(conn)
        msg = _receive(conn)
        if msg is None:  # closed without a word: look at how the process ended
            procs[r].join(1.0)
            code = procs[r].exitcode
            failures.append(WorldError(f"rank {r} exited with code {code} "
                                       f"({_describe_exit(code)}) before reporting", r))
        elif not msg.ok:
            failures.append(WorldError(f"rank {msg.rank} failed", msg.rank, msg.payload))
        else:
            out[msg.rank] = _loads(msg.payload)
    return failures


def _root_cause(failures: list[WorldError],
                seen: Sequence[_progress.RankProgress] = ()) -> WorldError:
    """A rank that died without a word (signal, OOM) first; then an exception that is not a
    peer's lost connection or timeout; then, when every failure is such a symptom, the rank
    the progress records say the others were waiting for; then the first report."""
    silent = [f for f in failures if not f.tb]
    real = [f for f in failures if f.tb and not is_peer_symptom(f.tb)]
    if silent or real:
        return (silent or real)[0]
    found = _progress.blame(seen) if seen else None
    if found is not None:
        rank, why = found
        others = _progress.waiting_ranks(seen, rank)
        return WorldError(f"rank {rank} stopped making progress: {why}; ranks {others} "
                          f"timed out waiting\n{_progress.describe(seen)}", rank, stalled=True)
    return failures[0]


def _detach_from_forkserver() -> None:
    """Close this child's copy of the forkserver's "alive" pipe (multiprocessing gives one
    to every child so that they can start processes too): while any child held it, the
    forkserver outlived a killed launcher, and so did every child tied to it. A child that
    starts processes itself gets a forkserver of its own."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if isinstance(fd, int):
        try:
            os.close(fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None


def _dumps(obj: Any) -> bytes:
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    import io

    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _receive(conn) -> Optional[_Msg]:
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    if code == EXIT_ORPHANED:
        return "its launcher was gone"
    return "error" if code else "ok"


def _reap(procs) -> None:
    """Kill what is left (a rank that handles SIGTERM would not stop for it) and wait."""
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            p.kill()
    end = time.monotonic() + 5.0
    for p in procs:
        if p.pid is not None:
            p.join(max(0.0, end - time.monotonic()))
