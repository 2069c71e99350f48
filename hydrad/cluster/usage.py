"""What each worker process takes of the machine: CPU time and resident memory, read from
``/proc`` by the daemon (the workers are its children on the same host), so ``hydractl
status`` and ``/metrics`` show them beside the daemon's own.

``read_usage`` reads one process; ``UsageWindow`` keeps a few seconds of samples per process
and gives its share of a core over them. Linux only: elsewhere nothing is read and the
figures are None. Plain Python: nothing here imports torch.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class ProcessUsage:
    cpu_seconds: float  # user + system time since the process started
    rss_bytes: int  # resident memory now
    # Of that, pages of shared memory (``RssShmem``): cache pools in /dev/shm, which every
    # process that maps them counts again; None where the kernel does not say.
    shared_bytes: int | None = None


def read_usage(pid: int, proc: str = "/proc") -> ProcessUsage | None:
    """The CPU time and resident memory of process ``pid``; None when it is gone or where
    there is no ``/proc``."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    # The second field, the command in parentheses, may hold spaces and parentheses itself.
    fields = stat[stat.rfind(")") + 2:].split()
    try:
        # Fields 14 and 15 of proc(5) (utime, stime) and 24 (rss, in pages); fields[0] is field 3.
        cpu, rss = (int(fields[11]) + int(fields[12])) / _TICKS, int(fields[21]) * _PAGE
    except (IndexError, ValueError):
        return None
    return ProcessUsage(cpu, rss, _shared_bytes(f"{proc}/{pid}/status"))


def _shared_bytes(path: str) -> int | None:
    """``RssShmem`` of a ``/proc/<pid>/status`` file; None where it is missing or unreadable
    (the process gone in between, a kernel without the line)."""
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.startswith(b"RssShmem:"):
                    return int(line.split()[1]) * 1024  # in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


class UsageWindow:
    """Samples of several processes' CPU time over the last ``window`` seconds: each one's
    share of a core (1.0: one core busy) over them, and its latest reading."""

    def __init__(self, window: float = 10.0, proc: str = "/proc"):
        self.window = window
        self.proc = proc
        self._samples: dict[int, deque[tuple[float, float]]] = {}
        self._latest: dict[int, ProcessUsage] = {}

    def sample(self, pids, now: float) -> None:
        """Read every process of ``pids`` now; processes not among them are forgotten."""
        pids = set(pids)
        for pid in list(self._samples):
            if pid not in pids:
                del self._samples[pid]
                self._latest.pop(pid, None)
        for pid in pids:
            usage = read_usage(pid, self.proc)
            if usage is None:
                self._samples.pop(pid, None)
                self._latest.pop(pid, None)
                continue
            samples = self._samples.setdefault(pid, deque())
            samples.append((now, usage.cpu_seconds))
            while len(samples) > 2 and samples[1][0] <= now - self.window:
                samples.popleft()
            self._latest[pid] = usage

    def cpu_share(self, pid: int) -> float | None:
        """CPU seconds per second of ``pid`` between its oldest and newest sample in the
        window; None before two samples."""
        samples = self._samples.get(pid)
        if not samples or len(samples) < 2:
            return None
        (t0, cpu0), (t1, cpu1) = samples[0], samples[-1]
        return (cpu1 - cpu0) / (t1 - t0) if t1 > t0 else None

    def latest(self, pid: int) -> ProcessUsage | None:
        """What ``pid``'s last sample read (None: never read, or gone since)."""
        return self._latest.get(pid)
