"""Boundary observers: the communication audit and the non-finite check.

Both see every tensor that crosses a stage boundary
(:class:`ldt.boundary.communicator.BoundaryObserver`):
the audit records what left each stage (``comm_audit.jsonl``: what a data owner checks), the
finite check stops training on a NaN/Inf activation or gradient and says where it came from.

The audit also records what is *not* an activation or a gradient (:class:`MessageTap`, in
``comm_audit_messages.jsonl``): every ``torch.distributed`` call made outside the boundary
transport (:mod:`ldt.boundary`) whose group spans more than one stage or holds a rank of a
stage that
owns no data (the cloud), with its caller, group, stages and payload (dtypes and shapes, or the
types of the objects), and, on cloud ranks, every file opened outside the Python installation
and the run folder, and every tokenizer it loads (a cloud rank that read a data file or built
a tokenizer would show here).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import os
import sys
import threading
from collections import Counter
from typing import Optional

import torch

from ldt.groups.parallel_state import get_vtp_state, is_vtp_initialized

KIND = {"F": "activation", "B": "gradient"}


class CommAudit:
    """Appends one JSON line per tensor a stage leader sends across a boundary."""

    def __init__(self, path: str, rank: int):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path, self.rank, self.step = path, rank, 0
        self._file = open(path, "a", buffering=1)
        self.tap = None
        if is_vtp_initialized():  # what is not an activation: see the module docstring
            self.tap = MessageTap(path.removesuffix(".jsonl") + "_messages.jsonl",
                                  get_vtp_state().topology, rank,
                                  ignore_files_under=[os.path.dirname(os.path.abspath(path))])

    def new_step(self, step: int) -> None:
        self.step = step
        if self.tap is not None:
            self.tap.step = step

    def on_send(self, src: int, dst: int, direction: str, tensor: torch.Tensor) -> None:
        self._file.write(json.dumps({
            "step": self.step, "rank": self.rank, "src_stage": src, "dst_stage": dst,
            "direction": KIND[direction], "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape), "bytes": tensor.numel() * tensor.element_size(),
        }) + "\n")

    def on_recv(self, src: int, dst: int, direction: str, tensor: torch.Tensor) -> None:
        pass

    def close(self) -> None:
        if self.tap is not None:
            self.tap.close()
        self._file.close()


class NonFiniteError(FloatingPointError):
    pass


class FiniteCheck:
    """Raises on a received tensor with NaN/Inf, naming stage, direction and micro-batch.

    Messages on one channel arrive in micro-batch order (one per micro-batch and step under
    1F1B and the U-shape), so the k-th message of a step is micro-batch k.
    """

    def __init__(self):
        self.step: Optional[int] = None
        self._seen: Counter = Counter()

    def new_step(self, step: int) -> None:
        self.step, self._seen = step, Counter()

    def on_send(self, src, dst, direction, tensor) -> None:
        pass

    def on_recv(self, src: int, dst: int, direction: str, tensor: torch.Tensor) -> None:
        key = (src, dst, direction)
        index = self._seen[key]
        self._seen[key] += 1
        finite = torch.isfinite(tensor.detach())
        if not bool(finite.all()):
            bad = int((~finite).sum())
            raise NonFiniteError(
                f"non-finite {KIND[direction]} received by stage {dst} from stage {src}: "
                f"{bad} of {tensor.numel()} values are NaN/Inf (step {self.step}, micro-batch "
                f"{index}; message #{index} on this boundary under interleaving). The "
                f"{'forward pass of stage ' + str(src) if direction == 'F' else 'backward pass'} "
                "produced it: lower the learning rate, check the data, or enable grad clipping")


# torch.distributed calls that move data between processes (an object collective is recorded
# once: the tensor calls it makes internally are not)
MESSAGE_CALLS = (
    "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "gather",
    "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
    "send_object_list", "recv_object_list")
# the boundary transport (the leader link; the TP broadcast / sequence gather and scatter of
# the same tensors): its tensors are CommAudit's activations and gradients
TRANSPORT = ("ldt.boundary.communicator", "ldt.boundary.sequence", "ldt.boundary.relay")
# a stage's own tensor-parallel math (inside one stage's TP group): activations and gradients
# that never leave the stage, hundreds per step; not recorded
STAGE_COMPUTE = "megatron.core.tensor_parallel."
_TAP: Optional["MessageTap"] = None  # audit hooks cannot be removed: they consult this
# raised by ldt.data.tokenizer (the Rust tokenizers library opens files unseen by "open")
TOKENIZER_EVENT = "ldt.tokenizer.load"


class MessageTap:
    """Records non-activation messages that cross a stage boundary or reach a cloud rank.

    Wraps the ``torch.distributed`` functions in :data:`MESSAGE_CALLS` (callers look them up
    as ``torch.distributed.NAME`` / ``dist.NAME`` at call time, megatron-core included) until
    :meth:`close`. A call from a :data:`TRANSPORT` module is the boundary transport, left to
    :class:`CommAudit`'s boundary records. On a cloud rank, an audit hook records files opened
    outside the Python installation, the code on ``sys.path``, ``/proc``, ``/sys``, ``/dev``
    and ``ignore_files_under`` (the run folder), and every tokenizer ldt loads.
    """

    def __init__(self, path: str, topology, rank: int, ignore_files_under=()):
        global _TAP
        self.topology, self.rank, self.step = topology, rank, None
        self.stage = topology.rank_info(rank).stage
        self.cloud = set(range(topology.num_stages)) - set(topology.data_stages())
        self._file = open(path, "a", buffering=1)
        self._local = threading.local()
        self._signatures: dict = {}
        self._undo = [self._wrap(n) for n in MESSAGE_CALLS if hasattr(torch.distributed, n)]
        code = [os.path.dirname(importlib.util.find_spec(p).origin)
                for p in ("ldt", "ldt.patches", "ldt.tools", "ldt.conf")]
        roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path, *code,
                 *ignore_files_under, "/proc", "/sys", "/dev"}
        self._known = tuple(os.path.join(os.path.abspath(r), "") for r in roots if r)
        _TAP = self
        if self.stage in self.cloud:
            _install_open_hook()

    def close(self) -> None:
        global _TAP
        for undo in reversed(self._undo):
            undo()
        self._undo = []
        if _TAP is self:
            _TAP = None
        self._file.close()

    # ---- torch.distributed ----------------------------------------------------------------
    def _wrap(self, name: str):
        fn = getattr(torch.distributed, name)
        self._signatures[name] = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            caller = sys._getframe(1)
            module = caller.f_globals.get("__name__", "?")
            if getattr(self._local, "inside", False) or module in TRANSPORT:
                return fn(*args, **kwargs)
            self._local.inside = True
            try:
                self._record(name, f"{module}:{caller.f_code.co_name}", args, kwargs)
                return fn(*args, **kwargs)
            finally:
                self._local.inside = False

        setattr(torch.distributed, name, call)
        return lambda: setattr(torch.distributed, name, fn)

    def _record(self, name: str, site: str, args, kwargs) -> None:
        try:
            bound = self._signatures[name].bind(*args, **kwargs).arguments
        except TypeError:
            bound = {}
        try:
            ranks = self._ranks(name, bound)
            stages = sorted({self.topology.rank_info(r).stage for r in ranks})
        except Exception:  # a group torch cannot name: recorded as reaching everyone
            ranks, stages = None, list(range(self.topology.num_stages))
        crosses, cloud = len(stages) > 1, bool(self.cloud.intersection(stages))
        if not (crosses or cloud) or (not crosses and site.startswith(STAGE_COMPUTE)):
            return
        tensors = [t for v in bound.values() for t in _tensors(v)]
        record = {"step": self.step, "kind": "message", "rank": self.rank, "stage": self.stage,
                  "op": name, "site": site, "group_ranks": ranks, "group_stages": stages,
                  "crosses_boundary": crosses, "reaches_cloud": cloud,
                  "tensors": [{"dtype": str(t.dtype).removeprefix("torch."),
                               "shape": list(t.shape)} for t in tensors],
                  "bytes": sum(t.numel() * t.element_size() for t in tensors)}
        if name.endswith("_object") or name.endswith("_object_list"):
            objects = next((bound[k] for k in ("obj", "object_list", "scatter_object_input_list")
                            if k in bound), None)
            items = objects if isinstance(objects, list) else [objects]
            record["objects"] = [type(o).__name__ for o in items]
        self._file.write(json.dumps(record) + "\n")

    def _ranks(self, name: str, bound: dict) -> list[int]:
        if name == "batch_isend_irecv":
            peers = {op.peer for op in bound.get("p2p_op_list", [])}
            return sorted(peers | {self.rank})
        for key in ("dst", "src"):
            if name in ("send", "recv", "isend", "irecv", "send_object_list",
                        "recv_object_list") and bound.get(key) is not None:
                return sorted({self.rank, int(bound[key])})
        group = bound.get("group")
        if group is None:
            return list(range(self.topology.world_size))
        return sorted(torch.distributed.get_process_group_ranks(group))

    # ---- files (cloud ranks) ----------------------------------------------------------------
    def on_open(self, path, mode, kind: str = "file_open") -> None:
        if isinstance(path, int) or self._file.closed:
            return
        full = os.path.abspath(os.fsdecode(path))
        if kind == "file_open" and full.startswith(self._known):
            return
        self._file.write(json.dumps({"step": self.step, "kind": kind, "rank": self.rank,
                                     "stage": self.stage, "path": full,
                                     "mode": str(mode)}) + "\n")


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


_HOOKED = False


def _install_open_hook() -> None:
    """One process-wide audit hook (they cannot be removed), forwarding to the live tap."""
    global _HOOKED
    if _HOOKED:
        return

    def hook(event: str, args) -> None:
        if _TAP is None or event not in ("open", TOKENIZER_EVENT):
            return
        try:
            if event == "open":
                _TAP.on_open(args[0], args[1] if len(args) > 1 else None)
            else:
                _TAP.on_open(args[0], None, kind="tokenizer_load")
        except Exception:  # an audit hook must never break the call it watches
            pass

    sys.addaudithook(hook)
    _HOOKED = True
