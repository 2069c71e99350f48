"""The heap of a serving process: the garbage collector, and the memory freed tensors leave.

A process that imported torch and transformers and loaded a model holds some 400,000
objects that live as long as it does. Python's full collections scan them all (160-310 ms
in the daemon here) whenever enough new objects have survived into the oldest generation: in the daemon, that
stalls every stream's tokens at once; in a worker, a step. ``freeze_startup_heap`` collects
once when start-up is over and moves what is alive then into the collector's permanent
generation (``gc.freeze``), so that later collections scan only what serving allocates.

On a CPU a worker's activations are malloc'd and freed every step, in sizes that change
with the batch. glibc serves them from its heap once a freed block has raised its mmap
threshold, and keeps what they free there: an EP worker under 256 streams grew by some
13 MiB a minute of memory it no longer used (``bench/soak.py``; a ``malloc_trim`` of it
returned 400 MiB at once). ``HeapTrimmer`` hands that memory back between steps, at most
every ``TRIM_INTERVAL`` seconds (a few milliseconds each). Elsewhere than glibc it does
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import time

TRIM_INTERVAL = 30.0


def freeze_startup_heap(logger: logging.Logger) -> int:
    """Collect, then freeze what is alive; returns how many objects were frozen. Call once
    the process is ready to serve (objects allocated before are never collected after)."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("froze the start-up heap (%d objects, %.0f ms): full collections skip it", frozen,
                (time.perf_counter() - start) * 1e3)
    return frozen


def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def resident_bytes() -> int:
    """This process's resident memory (``/proc/self/statm``; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class HeapTrimmer:
    """Returns the free memory of the C heap to the system, at most every ``interval``
    seconds and only after steps (``maybe``, between them; an idle worker wakes for it:
    ``due_in``). Not at every pause: the pages it returns are faulted in again by the next
    step's tensors, which a request arriving at an idle worker would wait for."""

    def __init__(self, logger: logging.Logger, interval: float = TRIM_INTERVAL):
        self.logger = logger
        self.interval = interval
        self._trim = _malloc_trim()
        self._last = time.monotonic()
        self._worked = False  # steps ran since the last trim
        self.released = 0  # bytes handed back so far (as resident memory fell)

    @property
    def available(self) -> bool:
        return self._trim is not None

    def stepped(self) -> None:
        self._worked = True

    def due_in(self, now: float) -> float | None:
        """Seconds until the next trim is due (None: none is, no step ran since the last):
        how long an idle worker may block before it trims."""
        if self._trim is None or not self._worked:
            return None
        return max(0.0, self._last + self.interval - now)

    def maybe(self, now: float) -> bool:
        """Trim where steps ran since the last trim and ``interval`` has passed since it;
        whether it did."""
        if self._trim is None or not self._worked or now - self._last < self.interval:
            return False
        self._last, self._worked = now, False
        before, start = resident_bytes(), time.perf_counter()
        self._trim(0)
        freed = max(0, before - resident_bytes())
        self.released += freed
        self.logger.debug("returned %d MiB of the heap to the system in %.1f ms", freed >> 20,
                          (time.perf_counter() - start) * 1e3)
        return True
