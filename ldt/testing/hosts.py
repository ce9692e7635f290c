"""Several hosts on one Linux machine: network namespaces joined by veth links.

For tests and benchmarks of what ldt does across a real network (a link's bandwidth, a link
that goes down) without several machines. Needs root (CAP_NET_ADMIN) and iproute2;
:func:`unavailable` says why it cannot work where it cannot.

Layout, a star::

    host i   namespace <name>-h<i>, interface eth0, address 10.77.0.<i+1>/24
    switch   namespace <name>-sw, bridge br0; its port h<i> is the veth peer of host i's eth0

Why a star through a bridge: gloo connects every pair of ranks of a group (the default group
is a full mesh), so every host must reach every other one; a bridge does that without routes.
A host's veth pair is its link to the rest: ``tbf`` on both ends limits the host's bandwidth
each way, ``set_link(i, up=False)`` cuts the host off. Ranks of one host (a stage's TP group)
talk over that namespace's loopback, unshaped, like NVLink/HCCS next to a network. Latency is
not emulated here (``netem`` is missing from some kernels, this one included): ldt's transport
has ``cluster.link_delay_ms`` for that.

Nothing is created in the machine's own namespace (interfaces are created inside the
namespaces, so their names cannot collide with the machine's or another harness's). Every
namespace and cgroup is named ``ldtnet-<pid>-<n>...`` (this process, a counter);
:meth:`Hosts.up` first removes what harnesses of processes that no longer exist left behind
(a crashed run), and nothing else.

``cpus`` gives each host its own CPU budget (a cgroup CPU quota), so that N hosts on a machine
with fewer cores behave like N slower machines instead of taking turns on the same cores:
without it a stage that waits on the network lends its core to the others, which hides the
very bubbles a latency benchmark looks for. A quota is a cap; so that it is also what the host
gets while other work runs on the machine, the host's cgroup weighs ``CPU_WEIGHT`` times a
process's share (cgroup v1 ``cpu.shares``, v2 ``cpu.weight``): measured on this machine (cgroup
v1, other sessions' processes at load 4-6), hosts of the default weight got less than their
quota, and a calibration predicted from one run missed the next by -13.6% / +11.5%.

Ranks start the way torchrun starts them: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` (host 0), ``MASTER_PORT``, plus ``GLOO_SOCKET_IFNAME=eth0``
so gloo uses the host's link, and ``OMP_NUM_THREADS=1`` unless given.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence, Union

PREFIX = "ldtnet"
SUBNET = "10.77.0"
IFNAME = "eth0"
CFS_PERIOD_US = 5000  # short, so a throttled host stalls for at most a few ms at a time
CPU_WEIGHT = 8  # a host's cgroup against one process of default weight
_LEFTOVER = re.compile(rf"^{PREFIX}-(\d+)-")
_counter = itertools.count()


class HostsError(RuntimeError):
    """A namespace, link or cgroup could not be set up; the message has the command's error."""


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise HostsError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


@lru_cache(maxsize=1)
def unavailable() -> Optional[str]:
    """None where namespaces work here; else why not (for ``pytest.skip``)."""
    if os.geteuid() != 0:
        return f"network namespaces need root (CAP_NET_ADMIN); running as uid {os.geteuid()}"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"iproute2's `{tool}` is not installed"
    # What a harness needs, tried in a throw-away namespace (deleting it deletes the pair):
    # a namespace, a veth pair, a tbf qdisc. Any failure is a reason to skip, not an error.
    probe = f"{PREFIX}-{os.getpid()}-probe"
    steps = (["ip", "netns", "add", probe],
             ["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"],
             ["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "p0", "root", "tbf",
              "rate", "100mbit", "burst", "32kbit", "latency", "400ms"])
    try:
        for argv in steps:
            proc = _run(argv, check=False)
            if proc.returncode != 0:
                return f"`{' '.join(argv[:4])} ...` failed: {proc.stderr.strip()}"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"`ip netns` probe failed: {exc}"
    finally:
        try:
            _run(["ip", "netns", "del", probe], check=False)
        except (OSError, subprocess.SubprocessError):
            pass
    return None


@dataclass
class RankResult:
    rank: int
    host: int
    returncode: Optional[int]
    """None: still running when the wait timed out (it was killed then)."""
    stdout: str
    stderr: str
    exited_at: Optional[float]
    """time.monotonic() when the harness saw it exit."""


class Job:
    """Processes started on the hosts (one per rank); :meth:`wait` collects them."""

    def __init__(self, procs: list[tuple[int, int, subprocess.Popen, str, str]]):
        self._procs = procs  # (rank, host, popen, stdout path, stderr path)
        self._exited: dict[int, float] = {}

    @property
    def pids(self) -> list[int]:
        return [p.pid for _, _, p, _, _ in self._procs]

    def poll(self) -> bool:
        """Record exits; True once every process has exited."""
        now = time.monotonic()
        for rank, _, proc, _, _ in self._procs:
            if rank not in self._exited and proc.poll() is not None:
                self._exited[rank] = now
        return len(self._exited) == len(self._procs)

    def wait(self, timeout: float) -> list[RankResult]:
        """Wait for every process, at most ``timeout`` s (then kill what is left)."""
        deadline = time.monotonic() + timeout
        while not self.poll() and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = {rank for rank, _, p, _, _ in self._procs if p.poll() is None}
        self.kill()
        out = []
        for rank, host, proc, out_path, err_path in self._procs:
            out.append(RankResult(rank, host, None if rank in alive else proc.returncode,
                                  _read(out_path), _read(err_path), self._exited.get(rank)))
        return out

    def kill(self) -> None:
        """SIGKILL every process this job started (each leads its own process group)."""
        for _, _, proc, _, _ in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for _, _, proc, _, _ in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


Number = Union[int, float]


class Hosts:
    """``n`` hosts in a star (see the module docstring); a context manager.

    ``rate_mbit``: each host's link bandwidth in Mbit/s, both ways (a number for every host, a
    list per host, None entries unlimited). ``cpus``: each host's CPU budget in cores (number
    or list; None: no limit).
    """

    def __init__(self, n: int, *, rate_mbit: Union[None, Number, Sequence[Optional[Number]]] = None,
                 cpus: Union[None, Number, Sequence[Optional[Number]]] = None,
                 workdir: Optional[str] = None):
        if n < 1:
            raise ValueError(f"Hosts(n={n}): need at least one host")
        self.n = n
        self.rates = _per_host(rate_mbit, n, "rate_mbit")
        self.cpus = _per_host(cpus, n, "cpus")
        self.name = f"{PREFIX}-{os.getpid()}-{next(_counter)}"
        self._own_workdir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix=f"{self.name}-")
        self._jobs: list[Job] = []
        self._made: list[str] = []  # namespaces created, for teardown
        self._cgroups: list[str] = []
        self._ports = itertools.count(29500)

    # ---- names -------------------------------------------------------------------------------
    def namespace(self, host: int) -> str:
        return f"{self.name}-h{host}"

    @property
    def switch(self) -> str:
        return f"{self.name}-sw"

    def address(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    # ---- life cycle --------------------------------------------------------------------------
    def __enter__(self) -> "Hosts":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        reason = unavailable()
        if reason:
            raise HostsError(reason)
        remove_leftovers()
        try:
            self._add_namespace(self.switch)
            _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
            for i in range(self.n):
                ns = self.namespace(i)
                self._add_namespace(ns)
                _run(["ip", "-n", self.switch, "link", "add", f"h{i}", "type", "veth",
                      "peer", "name", IFNAME, "netns", ns])
                _run(["ip", "-n", self.switch, "link", "set", f"h{i}", "master", "br0", "up"])
                _run(["ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", IFNAME])
                _run(["ip", "-n", ns, "link", "set", IFNAME, "up"])
                if self.rates[i] is not None:
                    self.shape(i, self.rates[i])
                if self.cpus[i] is not None:
                    self._cgroups.append(_make_cgroup(f"{ns}", self.cpus[i]))
                else:
                    self._cgroups.append("")
        except BaseException:
            self.down()
            raise

    def down(self) -> None:
        """Kill every process started here, delete the namespaces and cgroups (idempotent)."""
        for job in self._jobs:
            job.kill()
        for ns in reversed(self._made):
            _remove_namespace(ns)
        self._made.clear()
        for path in self._cgroups:
            if path:
                _remove_cgroup(path)
        self._cgroups.clear()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _add_namespace(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._made.append(ns)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    # ---- links -------------------------------------------------------------------------------
    def shape(self, host: int, rate_mbit: Optional[Number]) -> None:
        """Limit host ``host``'s link to ``rate_mbit`` each way (None: unlimited)."""
        for ns, dev in ((self.namespace(host), IFNAME), (self.switch, f"h{host}")):
            if rate_mbit is None:
                _run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                     check=False)
                continue
            rate_bytes = rate_mbit * 1e6 / 8
            burst = max(64 * 1024, int(rate_bytes / 250))  # >= one GSO packet, >= 4 ms of data
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                  "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "100ms"])
        self.rates[host] = rate_mbit

    def set_link(self, host: int, up: bool) -> None:
        """Bring host ``host``'s link down (cut off from every other host) or back up."""
        _run(["ip", "-n", self.namespace(host), "link", "set", IFNAME, "up" if up else "down"])

    def kill_host(self, host: int) -> None:
        """SIGKILL every process running inside host ``host``: the machine is lost."""
        for pid in _run(["ip", "netns", "pids", self.namespace(host)], check=False).stdout.split():
            _kill(int(pid))

    # ---- processes ---------------------------------------------------------------------------
    def popen(self, host: int, argv: Sequence[str], *, env: Optional[dict] = None,
              stdout=None, stderr=None, cwd: Optional[str] = None) -> subprocess.Popen:
        """Start ``argv`` inside host ``host`` (own session; in its cgroup if it has one)."""
        cgroup = self._cgroups[host] if host < len(self._cgroups) else ""

        def enter_cgroup() -> None:  # in the child, before exec: children inherit it
            if cgroup:
                with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))

        return subprocess.Popen(["ip", "netns", "exec", self.namespace(host), *argv], env=env,
                                stdout=stdout, stderr=stderr, cwd=cwd, start_new_session=True,
                                preexec_fn=enter_cgroup)

    def start(self, argv: Sequence[str], ranks_per_host: Sequence[int], *,
              env: Optional[dict] = None, cwd: Optional[str] = None) -> Job:
        """Start one process per rank, ranks contiguous per host (host 0: ranks 0..k0-1, ...),
        with torchrun's environment; rendezvous on host 0."""
        if len(ranks_per_host) > self.n:
            raise ValueError(f"{len(ranks_per_host)} hosts' ranks given, only {self.n} hosts")
        world, port = sum(ranks_per_host), next(self._ports)
        base = {k: v for k, v in os.environ.items()
                if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                             "MASTER_ADDR", "MASTER_PORT")}
        base.setdefault("OMP_NUM_THREADS", "1")
        base.update(env or {})
        procs, rank = [], 0
        job_dir = tempfile.mkdtemp(prefix="job-", dir=self.workdir)
        for host, count in enumerate(ranks_per_host):
            for local in range(count):
                e = dict(base, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local),
                         LOCAL_WORLD_SIZE=str(count), GROUP_RANK=str(host),
                         MASTER_ADDR=self.address(0), MASTER_PORT=str(port),
                         GLOO_SOCKET_IFNAME=IFNAME)
                out, err = (os.path.join(job_dir, f"rank{rank}.{s}") for s in ("out", "err"))
                with open(out, "w") as fo, open(err, "w") as fe:
                    proc = self.popen(host, argv, env=e, stdout=fo, stderr=fe, cwd=cwd)
                procs.append((rank, host, proc, out, err))
                rank += 1
        job = Job(procs)
        self._jobs.append(job)
        return job


def _per_host(value, n: int, name: str) -> list:
    if value is None or isinstance(value, (int, float)):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"{name}={values!r}: give one value per host ({n}) or one number")
    return values


# ---- cgroups (CPU budget per host) -----------------------------------------------------------
def _cgroup_root() -> tuple[str, str]:
    v1 = "/sys/fs/cgroup/cpu"
    if os.path.exists(os.path.join(v1, "cpu.cfs_quota_us")):
        return v1, "v1"
    v2 = "/sys/fs/cgroup"
    try:
        with open(os.path.join(v2, "cgroup.subtree_control")) as f:
            if "cpu" in f.read().split():
                return v2, "v2"
    except OSError:
        pass
    raise HostsError("no cgroup CPU controller found (cgroup v1 cpu or v2 with +cpu); "
                     "run without cpus=")


def _make_cgroup(name: str, cpus: float) -> str:
    root, version = _cgroup_root()
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    quota = int(cpus * CFS_PERIOD_US)
    if version == "v1":
        _write(os.path.join(path, "cpu.cfs_period_us"), str(CFS_PERIOD_US))
        _write(os.path.join(path, "cpu.cfs_quota_us"), str(quota))
        _write(os.path.join(path, "cpu.shares"), str(1024 * CPU_WEIGHT))
    else:
        _write(os.path.join(path, "cpu.max"), f"{quota} {CFS_PERIOD_US}")
        _write(os.path.join(path, "cpu.weight"), str(100 * CPU_WEIGHT))
    return path


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as exc:
        raise HostsError(f"cannot write {text!r} to {path}: {exc}") from None


def _remove_cgroup(path: str) -> None:
    for _ in range(50):  # its processes were killed; the kernel may take a moment
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = [int(x) for x in f.read().split()]
        except OSError:
            return
        for pid in pids:
            _kill(pid)
        try:
            os.rmdir(path)
            return
        except OSError:
            time.sleep(0.1)


# ---- teardown and leftovers ------------------------------------------------------------------
def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _remove_namespace(ns: str) -> None:
    """Kill what still runs inside (only processes a harness started live there), delete it."""
    proc = _run(["ip", "netns", "pids", ns], check=False)
    for pid in proc.stdout.split():
        _kill(int(pid))
    _run(["ip", "netns", "del", ns], check=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> list[str]:
    """Remove namespaces and cgroups of harnesses whose process is gone; return their names."""
    removed = []
    listing = _run(["ip", "netns", "list"], check=False).stdout.splitlines()
    for line in listing:
        name = line.split()[0] if line.split() else ""
        match = _LEFTOVER.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _remove_namespace(name)
            removed.append(name)
    try:
        root, _ = _cgroup_root()
        for name in os.listdir(root):
            match = _LEFTOVER.match(name)
            if match and not _pid_alive(int(match.group(1))):
                _remove_cgroup(os.path.join(root, name))
                removed.append(name)
    except HostsError:
        pass
    return removed
