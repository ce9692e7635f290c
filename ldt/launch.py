"""Start a local world of processes (gloo on 127.0.0.1) and never hang doing it.

Used by a bare ``ldt-train`` / ``python -m ldt.run`` on one machine and by the multi-process
tests. Children are forked from a forkserver that has already imported torch and megatron-core
(importing them costs ~5 s and ~360 MB per process here), rendezvous through a TCPStore owned
by the parent on a free port, and report back through one pipe each (pipes, unlike queues,
leave no semaphores behind). The first failure (exception,
signal, non-zero exit) or the timeout kills every child; the error names the rank that failed
first and carries its traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import signal
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

PRELOAD = ["ldt.quiet", "torch", "torch.distributed", "megatron.core.parallel_state",
           "megatron.core.models.gpt", "megatron.core.pipeline_parallel.schedules", "ldt"]

_CTX: Optional[mp.context.BaseContext] = None


class WorldError(RuntimeError):
    """A local world failed: ``rank`` failed first (or None on a timeout)."""

    def __init__(self, message: str, rank: Optional[int] = None, tb: str = ""):
        super().__init__(message + (f"\n--- traceback of rank {rank} ---\n{tb}" if tb else ""))
        self.rank, self.tb = rank, tb


@dataclass
class _Msg:
    rank: int
    ok: bool
    payload: Any


def _context() -> mp.context.BaseContext:
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _CTX = ctx
    return _CTX


def _child(rank: int, world_size: int, port: int, fn: Callable, args: tuple,
           env: dict, conn: Any, timeout_s: float, init_dist: bool = True) -> None:
    _die_with_parent()
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
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                                  timeout=timedelta(seconds=timeout_s))
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout_s))
        out = fn(rank, world_size, *args)
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


def run_local_world(world_size: int, fn: Callable, args: Sequence = (), *,
                    timeout_s: float = 300.0, comm_timeout_s: Optional[float] = None,
                    env: Optional[dict] = None, grace_s: float = 3.0,
                    init_dist: bool = True) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes; return results.

    ``fn`` must be importable (module-level). Raises :class:`WorldError` on the first failure
    or after ``timeout_s``; either way no child is left running.
    """
    import torch.distributed as dist

    ctx = _context()
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
    procs = [
        ctx.Process(target=_child, name=f"ldt-rank{r}",
                    args=(r, world_size, store.port, fn, tuple(args), dict(env or {}),
                          pipes[r][1], comm_timeout_s or timeout_s, init_dist))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    for _, writer in pipes:
        writer.close()  # the child holds its own end; EOF then means the child is gone
    readers = {pipes[r][0]: r for r in range(world_size)}
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            failures = _poll(readers, procs, out, timeout=0.2)
            if failures:
                # A dead rank makes its peers fail too (connection reset); collect what
                # arrives in a short grace period and blame the root cause, not a symptom.
                end = time.monotonic() + grace_s
                while readers and time.monotonic() < end:
                    failures += _poll(readers, procs, out, timeout=0.1)
                raise _root_cause(failures)
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(out))
                raise WorldError(f"timeout after {timeout_s:.0f}s; ranks {missing} did not finish")
        return [out[r] for r in range(world_size)]
    finally:
        _reap(procs)
        for reader, _ in pipes:
            reader.close()


_SYMPTOMS = ("Connection reset", "Connection closed", "connection closed", "timed out",
             "Timed out", "Broken pipe", "ECONNRESET")


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


def _root_cause(failures: list[WorldError]) -> WorldError:
    """A rank that died without a word (signal, OOM) first; then an exception that is not a
    peer's lost connection or timeout; then the first report."""
    silent = [f for f in failures if not f.tb]
    real = [f for f in failures if f.tb and not any(s in f.tb for s in _SYMPTOMS)]
    return (silent or real or failures)[0]


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when its parent (the forkserver, which exits with the
    launcher) dies, so a launcher killed with SIGKILL leaves no orphans."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


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
    return "error" if code else "ok"


def _reap(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + 5.0
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(2.0)
