"""The lock that keeps timed probes on a machine's CPU cores one at a time.

Latency-model probes (``profiler``) and speed checks (``machine_speed``) on a CPU time what
the cores do: two workers probing at once would time each other's work, not their own.
They take this lock (a file lock in the cache) while they run. A daemon starting holds it
too while it loads its own stack and Request Processor beside its workers
(``hold_cpu_probes``), so a first start's probes begin on cores the daemon has left (its
loading ran into the first probes and made them measure again). Light to import: the
daemon takes it before it imports torch.
"""

from __future__ import annotations

import fcntl
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from hydrad.errors import HydradError
from hydrad.paths import cache_dir

logger = logging.getLogger("hydrad.engine.profiler")


class ProbingElsewhere(HydradError):
    """Another process is timing its probes on these cores (``cpu_probes``, not blocking)."""


def _open():
    """The lock file, open; None where the cache cannot be written (nothing is cached either)."""
    path = cache_dir() / "latency" / ".cpu-probes.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "a")
    except OSError as e:
        logger.warning("cannot lock %s (probes may overlap other work on these cores): %s", path, e)
        return None


@contextmanager
def cpu_probes(block: bool = True) -> Iterator[None]:
    """Held while probes run. ``block``: wait for the lock, else ``ProbingElsewhere`` where
    another process holds it."""
    f = _open()
    if f is None:
        yield
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
        except BlockingIOError:
            raise ProbingElsewhere("another worker is measuring its latency model on these cores") from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class StartupHold:
    """The lock, held by a starting daemon until ``release`` (from any thread; again: nothing).
    Not taken where another process holds it (probes already run: the workers wait for
    those anyway)."""

    def __init__(self):
        self._file = _open()
        self._lock = threading.Lock()
        if self._file is None:
            return
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            self._file = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def release(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()  # closing the only descriptor unlocks it
                self._file = None
