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
"""

from __future__ import annotations

import ctypes
import logging
import platform

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2), and free memory at the top of
# the heap kept before any is returned.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 512 << 20

_done = False


def keep_freed_memory() -> bool:
    """Set this process's glibc allocator as the module says (once); False where the C
    library is not glibc or refuses."""
    global _done
    if _done:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not ok:
        logger.warning("the C allocator refused its settings; CPU steps may be slower")
    _done = ok
    return ok
