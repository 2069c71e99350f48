"""The locks that keep timed probes on a machine's CPU cores from timing each other.

Latency-model probes (``profiler``) and speed checks (``machine_speed``) on a CPU time what
the cores do: two probes on the same cores would time each other's work, not their own.
Each core is a slot (a file lock in the cache, ``.cpu-probes.<i>.lock``, one per usable CPU:
``cores.usable_cpus``) and probes on ``n`` threads take ``n`` slots while they run, so
probes of workers that share the machine's cores between them (``1EP+1D`` on two cores: one
thread each) run side by side, and a probe on every core waits for all of them. Workers are
not pinned; the kernel spreads threads that do not outnumber the cores over them, and on
the 2-core machine this was built on two single-threaded matrix products side by side ran
as fast as one alone. A daemon starting holds every slot while it loads its own stack and
Request Processor beside its workers (``StartupHold``), so a first start's probes begin on
cores the daemon has left (its loading ran into the first probes and made them measure
again). Light to import: the daemon takes it before it imports torch.

Probes on every core take the slots in order, waiting for each (two of them cannot hold
each other up); probes on fewer take free ones without waiting and, where too few are free,
let go of those they took and look again every ``POLL_SECONDS``: they never wait holding one.
"""

from __future__ import annotations

import fcntl
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import IO

from hydrad.engine.cores import usable_cpus
from hydrad.errors import HydradError
from hydrad.paths import cache_dir

logger = logging.getLogger("hydrad.engine.profiler")

# How often probes on fewer threads than the cores look for free slots while too few are.
POLL_SECONDS = 0.02


class ProbingElsewhere(HydradError):
    """Another process is timing its probes on these cores (``cpu_probes``, not blocking)."""


def _open(slot: int) -> IO | None:
    """A slot's lock file, open; None where the cache cannot be written (nothing is cached
    either)."""
    path = cache_dir() / "latency" / f".cpu-probes.{slot}.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "a")
    except OSError as e:
        logger.warning("cannot lock %s (probes may overlap other work on these cores): %s", path, e)
        return None


def _try(f: IO) -> bool:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _take(threads: int | None, block: bool) -> list[IO]:
    """The open, locked files of ``threads`` slots (every slot where None or more than there
    are); closing them unlocks them. None free enough and not ``block``: ``ProbingElsewhere``."""
    cores = usable_cpus()
    want = cores if threads is None else max(1, min(threads, cores))
    files = [_open(i) for i in range(cores)]
    if None in files:  # a slot cannot be locked: probes run unlocked
        for f in files:
            if f is not None:
                f.close()
        return []
    held: list[IO] = []
    try:
        if want == cores and block:
            for f in files:  # in order: every waiter for all of them queues on the first
                fcntl.flock(f, fcntl.LOCK_EX)
                held.append(f)
            return held
        while True:
            for f in files:
                if len(held) < want and _try(f):
                    held.append(f)
            if len(held) == want:
                return held
            for f in held:
                fcntl.flock(f, fcntl.LOCK_UN)
            held = []
            if not block:
                raise ProbingElsewhere("another worker is measuring its latency model on these cores")
            time.sleep(POLL_SECONDS)
    except BaseException:
        held = []
        raise
    finally:
        for f in files:
            if f not in held:
                f.close()  # closing a descriptor unlocks what it held


@contextmanager
def cpu_probes(block: bool = True, threads: int | None = None) -> Iterator[None]:
    """Held while probes on ``threads`` threads run (every core where None). ``block``: wait
    for the slots, else ``ProbingElsewhere`` where too few are free."""
    with ExitStack() as stack:
        for f in _take(threads, block):
            stack.enter_context(f)
        yield


class StartupHold:
    """Every slot, held by a starting daemon until ``release`` (from any thread; again:
    nothing). Not taken where another process holds one (probes already run: the workers
    wait for those anyway)."""

    def __init__(self):
        self._lock = threading.Lock()
        try:
            self._files = _take(None, block=False)
        except ProbingElsewhere:
            self._files = []
        self._held = bool(self._files)

    @property
    def held(self) -> bool:
        return self._held

    def release(self) -> None:
        with self._lock:
            for f in self._files:
                f.close()  # closing the only descriptor unlocks it
            self._files, self._held = [], False
