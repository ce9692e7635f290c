"""A process's memory peak as the operating system or the device's allocator counts it: the
independent reference bench_memory holds ``ldt.memory.estimate`` to.

It shares no code with the estimate or with torch's MemTracker (``ldt.memory.measure.LivePeak``,
which the estimate itself runs on fake tensors): it counts pages, not tensor storages.

- :class:`ResidentPeak` (a cpu stage): the peak of the process's anonymous resident memory
  above a baseline, sampled from the kernel's counters (``/proc/self/statm``: resident minus
  file-backed and shared pages, so the code pages of libtorch a first backward faults in are
  not counted). glibc keeps freed blocks in its heap and returns them to the system only at
  the heap's top, so a freed tensor would stay resident; the process must start with
  :data:`MALLOC_ENV` (read by glibc once, at start) so that every block of a page or more is
  its own mapping, unmapped when freed. It counts what a tensor census leaves out: Python's
  objects (modules, autograd's graph, megatron's bookkeeping), gloo's buffers and threads'
  stacks, and the allocator's rounding (a block of ``n`` bytes takes whole pages plus a
  header: a 16 KiB tensor, 64-byte aligned, maps 20 KiB). ``VmHWM`` (reset through
  ``/proc/self/clear_refs``) was the first choice: on this machine's kernel (6.18) it read up
  to 2.9x below what sampling saw in the same process (cpu_demo at h 256: 35 MiB against 105
  MiB), so the peak is sampled.
- :class:`DevicePeak` (a cuda stage): the caching allocator's own peaks,
  ``torch.cuda.max_memory_allocated`` (live blocks, rounded to its 512-byte granules) and
  ``max_memory_reserved`` (the segments it holds from the driver, fragmentation included),
  above their values at the baseline; what neither counts is the CUDA context and the
  libraries' workspaces outside the allocator (NCCL's buffers, cuBLAS handles), which
  ``reserved_gib`` of an inventory kind stands for. Not run on this machine (no GPU).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Optional

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "4096", "MALLOC_TRIM_THRESHOLD_": "0",
              "MALLOC_TOP_PAD_": "0"}
"""glibc's settings for :class:`ResidentPeak`: every block of a page or more is its own
mapping (returned to the system when freed), the heap's top is trimmed at once and grows by
no more than a request. glibc maps a block only when the heap's free top cannot hold it, so
with the default top pad (128 KiB added at each growth) large blocks still land in the heap
between small objects and stay resident when freed: 2000 tensors of 16 KiB, freed, left 19.4
MiB resident with the first two settings alone and 0.8 MiB with all three."""


def anonymous_resident() -> int:
    """Bytes of this process's anonymous resident pages now (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")


class ResidentPeak:
    """The peak of :func:`anonymous_resident` above its value at :meth:`start`, sampled every
    ``period_s`` by a thread until :meth:`stop` (see the module docstring)."""

    def __init__(self, period_s: float = 0.0005) -> None:
        self.period_s = period_s
        self.base: Optional[int] = None
        self.highest = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def pinned(self) -> bool:
        """Whether this process started with :data:`MALLOC_ENV` (else freed tensors stay)."""
        return all(os.environ.get(k) == v for k, v in MALLOC_ENV.items())

    def start(self) -> None:
        self.base = self.highest = anonymous_resident()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="resident-peak")
        self._thread.start()

    def _sample(self) -> None:
        with open("/proc/self/statm") as f:
            page = os.sysconf("SC_PAGE_SIZE")
            while not self._stop.is_set():
                f.seek(0)
                fields = f.read().split()
                self.highest = max(self.highest, (int(fields[1]) - int(fields[2])) * page)
                self.samples += 1
                time.sleep(self.period_s)

    def stop(self) -> dict:
        """``{"peak": bytes above the baseline, "samples": n}``; sampling ends."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.highest = max(self.highest, anonymous_resident())
        return {"peak": self.highest - self.base, "samples": self.samples}


class DevicePeak:
    """The CUDA caching allocator's peaks above their values at :meth:`start`."""

    def start(self) -> None:
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.base = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())

    def stop(self) -> dict:
        import torch

        torch.cuda.synchronize()
        return {"peak": torch.cuda.max_memory_allocated() - self.base[0],
                "reserved": torch.cuda.max_memory_reserved() - self.base[1]}


def for_device(device: str):
    """The reference for a stage on ``device``: the allocator's on cuda, the process's
    resident memory on cpu; None where neither applies (npu: torch_npu's ``npu.max_memory_*``
    would be its counterpart)."""
    return {"cuda": DevicePeak, "cpu": ResidentPeak}.get(device, lambda: None)()
