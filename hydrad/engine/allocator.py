"""The C allocator of a process that runs CPU engines (glibc only).

A step's activations on a CPU are tensors of several MB (a 1,200-token prefill's MLP
intermediate is 15 MB), allocated and freed in every layer. glibc maps an allocation above
its mmap threshold anew each time (the threshold adapts, up to 32 MiB, as such blocks are
freed) and gives freed memory at the top of its heap back to the kernel above its trim
threshold: either way the next step's tensors start on fresh pages, and faulting them in
(the kernel zeroes each one) cost 10-15% of a multi-request prefill step on one thread.
``keep_freed_memory`` serves allocations up to 32 MiB from the heap and keeps what is freed
for the next step, as tcmalloc or jemalloc would: the process's resident memory stays at its
high-water mark instead.

That mark creeps: steps of every size leave free memory between live blocks, which no trim
threshold returns (glibc gives back only the top of its heap). Under 256 streams of mixed
requests an EP worker's memory grew by some 1 GiB an hour, 400 MiB of it free in its heap
(``bench/soak.py``, ``bench/RESULTS.md``). ``HeapTrimmer`` hands all free memory back
(``malloc_trim``) between steps, at most every ``TRIM_INTERVAL`` seconds: a few
milliseconds each, and the next steps fault their pages in once again, where every step
did before ``keep_freed_memory``.

The rest of that growth was live: oneDNN keeps every matmul it has built, one per weight
shape and number of rows, and PyTorch keeps its own objects for each (``ideep``), 1,024 of
each by default at about half a MiB apiece whatever the shapes. A decode instance sees few
row counts (its batch sizes); one that prefills sees a new one at almost every step, so its
caches fill for an hour and hold 300-500 MiB. ``bound_shape_caches`` keeps
``SHAPE_CACHE_ENTRIES`` of each (about 100 MiB); a step whose row count was evicted builds
its matmuls again (about a millisecond each).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import time

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2), and free memory at the top of
# the heap kept before any is returned.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 512 << 20
# Seconds between two hand-backs of all free memory (``HeapTrimmer``).
TRIM_INTERVAL = 30.0
# Entries of oneDNN's primitive cache and of PyTorch's cache of oneDNN computations, each.
SHAPE_CACHE_ENTRIES = 256
_SHAPE_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")

_done = False


def keep_freed_memory() -> bool:
    """Set this process's glibc allocator as the module says (once); False where the C
    library is not glibc or refuses."""
    global _done
    if _done:
        return True
    mallopt = _glibc("mallopt", (ctypes.c_int, ctypes.c_int))
    if mallopt is None:
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not ok:
        logger.warning("the C allocator refused its settings; CPU steps may be slower")
    _done = ok
    return ok


def bound_shape_caches() -> None:
    """Cap oneDNN's and PyTorch's caches of matmuls built per shape at ``SHAPE_CACHE_ENTRIES``
    each, unless the environment sets them. Both read their capacity when they build their
    first entry: call it before the process's first oneDNN operation."""
    for name in _SHAPE_CACHES:
        os.environ.setdefault(name, str(SHAPE_CACHE_ENTRIES))


def _glibc(name: str, argtypes: tuple):
    """glibc's function ``name`` (returning an int), or None where the C library is another."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = argtypes, ctypes.c_int
    return function


def resident_bytes() -> int:
    """This process's resident memory (``/proc/self/statm``; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class HeapTrimmer:
    """Hands the C heap's free memory back to the kernel, at most every ``interval`` seconds
    and only after steps (``maybe``, between them; an idle worker wakes for it: ``due_in``).
    Not at every pause: the pages it returns are faulted in again by the next step's
    tensors, which a request arriving at an idle worker would wait for."""

    def __init__(self, interval: float = TRIM_INTERVAL):
        self.interval = interval
        self._trim = _glibc("malloc_trim", (ctypes.c_size_t,))
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
        logger.debug("returned %d MiB of free heap to the kernel in %.1f ms", freed >> 20,
                     (time.perf_counter() - start) * 1e3)
        return True
