"""CPU workers that share the cores: each one's torch threads, and lending idle cores.

On a CPU every worker of a deployment runs on the same cores. Each gets its share of
them, ``cores // N`` torch threads. A decode-only instance's steps are short and
memory-bound, and its cores idle between requests; the instances that encode or
prefill and do not decode (E, P, EP: compute-bound) borrow them. A borrower runs on its
share plus the lent threads only while every instance it borrows from is idle, and on
its share alone while one of them has work, so a lone request is still encoded and
prefilled on every core. The count is picked as each step starts, with the latency model
the step is filled by, and picked again before every layer of the model and every
operation in it (``worker.StepThreads``): a borrower hands the lent threads back within
an operation when a lender gets work, and takes them again when the lender is idle, so a long prefill that
starts while a decode instance has 0.2 s of decodes left borrows its core for the rest.
(Under load a borrower seldom starts a step borrowing: the KV its step hands to a D
instance reaches that instance, through the daemon in about a millisecond, before the
borrower, taking its own new requests first, picks its next step's threads.) The planner's
simulator models both.

Whether an instance has work is a byte in a small block of shared memory (``CoreBoard``,
one byte per instance id) that every CPU worker of the deployment maps: the lender
writes its own byte when its state changes, and a borrower reads its lenders' bytes
before each step and each operation. No message goes through the daemon, so a borrower
sees a lender's new request within one operation of its step.

The cores are those this process may use (``usable_cpus``): the CPUs it may run on (a
cpuset, ``taskset``, systemd's ``AllowedCPUs=``), and no more than its cgroup's CPU quota
(``docker run --cpus``, systemd's ``CPUQuota=``), not every CPU of the host.

Plain Python (no torch): the planner's simulator uses ``cpu_threads`` too.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from hydrad.errors import HydradError

logger = logging.getLogger("hydrad.worker")


@dataclass(frozen=True)
class CpuThreads:
    """A CPU instance's torch threads: ``own`` always; ``own + borrow`` while every one of
    ``lenders`` (instance ids, or positions in a list of roles) is idle."""

    own: int
    borrow: int = 0
    lenders: tuple[int, ...] = ()

    def __post_init__(self):
        if self.own < 1 or self.borrow < 0:
            raise ValueError(f"threads: own {self.own} must be >= 1 and borrow {self.borrow} >= 0")
        if self.borrow and not self.lenders:
            raise ValueError("threads to borrow need instances to borrow them from")

    @property
    def most(self) -> int:
        return self.own + self.borrow

    def __str__(self) -> str:
        return f"{self.own}" if not self.borrow else f"{self.own} (+{self.borrow} while idle: {self.lenders})"


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """CPUs' worth of time this process's cgroup (or one above it) may use, or None if
    unbounded or unknown: cgroup v2's ``cpu.max``, v1's ``cpu.cfs_quota_us`` over its period."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            dirs = [Path(root)]
            read = _cpu_max
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's hierarchy
            dirs = [Path(root) / name for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu")]
            read = _cfs_quota
        else:
            continue
        for base in dirs:
            if not base.is_dir():
                continue
            # The process's own group and every group above it (a container sees its own
            # group as the root: its path then does not exist below, and the root is read).
            here = base / path.strip("/")
            while True:
                if here.is_dir() and (limit := read(here)) is not None:
                    limits.append(limit)
                if here == base:
                    break
                here = here.parent
            break
    return min(limits) if limits else None


def _cpu_max(group: Path) -> float | None:
    try:
        quota, _, period = (group / "cpu.max").read_text().strip().partition(" ")
        return None if quota == "max" else int(quota) / int(period or 100000)
    except (OSError, ValueError):
        return None


def _cfs_quota(group: Path) -> float | None:
    try:
        quota = int((group / "cpu.cfs_quota_us").read_text())
        period = int((group / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cpus() -> int:
    """The CPUs this process may use: those it may run on, at most its cgroup's CPU quota
    (rounded down: threads beyond it are throttled, and spinning ones waste it)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, int(quota))
    return max(1, cpus)


def cpu_threads(roles: list[str], cores: int, share: int | None = None) -> list[CpuThreads]:
    """The threads of each instance of ``roles`` when all run on the same ``cores`` CPU cores.

    Each instance's share is ``cores // len(roles)`` (at least 1; ``share`` when given). A
    decode-only instance lends its share; the instances that encode or prefill and do not
    decode borrow the lent threads, split evenly among them (up to ``cores`` each), while
    every decode-only instance is idle. Every other instance has its share."""
    share = share or max(1, cores // max(1, len(roles)))
    lenders = tuple(i for i, role in enumerate(roles) if role == "D")
    borrowers = [i for i, role in enumerate(roles) if "D" not in role]
    extra = share * len(lenders) // len(borrowers) if borrowers else 0
    borrow = max(0, min(extra, cores - share))
    return [CpuThreads(share, borrow, lenders) if i in borrowers and borrow else CpuThreads(share)
            for i in range(len(roles))]


class CoreBoard:
    """One byte per instance id in memory shared with the workers: 1 while it has work.
    Made by the daemon (``new``), handed to each worker when it starts (it pickles only
    while a process is being started), and read and written without locks: each byte has
    one writer."""

    SIZE = 256  # instance ids

    def __init__(self, flags):
        self.flags = flags

    @classmethod
    def new(cls) -> CoreBoard:
        from multiprocessing.sharedctypes import RawArray

        return cls(RawArray("b", cls.SIZE))

    def busy(self, instance_id: int) -> bool:
        return bool(self.flags[instance_id])


class LendersBusy(HydradError):
    """A borrower's probes at its borrowed count wait: a lender has work on those cores."""


class CoreLending:
    """A worker's part in lending cores: it publishes whether it has work, and a borrower
    asks how many threads it may run its next step on."""

    def __init__(self, board: CoreBoard | None, instance_id: int, threads: CpuThreads, busy: bool = False):
        """``busy``: what it publishes until it says otherwise (a starting worker lends
        nothing: a borrower's probes beside its start slowed it)."""
        self.board = board if board is not None and instance_id < CoreBoard.SIZE else None
        self.instance_id = instance_id
        self.threads = self.usable(threads)
        self._busy = busy
        if self.board is not None:
            self.board.flags[instance_id] = int(busy)

    def usable(self, threads: CpuThreads) -> CpuThreads:
        """``threads`` as this worker can run them: without a board, nothing is borrowed."""
        return threads if self.board is not None else CpuThreads(threads.own)

    def publish(self, busy: bool) -> None:
        if busy != self._busy and self.board is not None:
            logger.debug("has work: %s", busy)
            self._busy = busy
            self.board.flags[self.instance_id] = int(busy)

    def threads_now(self) -> int:
        t = self.threads
        return t.most if t.borrow and self.lenders_idle(t) else t.own

    def lenders_idle(self, threads: CpuThreads) -> bool:
        """Whether every instance ``threads`` borrows from is idle now."""
        return self.board is not None and not any(self.board.flags[i] for i in threads.lenders)

    def set(self, threads: CpuThreads) -> None:
        """The deployment changed: lend and borrow as ``threads`` says from now on."""
        self.threads = self.usable(threads)
