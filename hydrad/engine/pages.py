"""Backing a shared CPU pool's pages ahead of use, off the start's critical path.

A cache pool in shared memory (``/dev/shm``) is backed page by page as it is first
written. Backing it all before the worker is ready spares the first steps the page faults,
but it takes time: a worker's two pools are gigabytes, and on a virtual machine whose
memory the host backs lazily two workers backing 3 GiB between them took 6-9 s here (one
worker's 1.5 GiB alone: half a second), most of a restart.

So a pool's first page is backed at once (an error there fails the start, one clear line;
the daemon's preflight has checked that ``/dev/shm`` holds every pool) and the rest on a
thread of its own at idle priority (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14 and
later: the kernel backs the pages without touching their contents, so steps may write the
pool meanwhile, and what the start waits for runs first). Where the kernel lacks it the
pool is zeroed in place before it is used, as it always was. ``wait`` joins the threads
(raised to normal priority): what times the instance's steps (its latency-model probes,
the copy bandwidth) waits for them, so that no probe runs beside them.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading

logger = logging.getLogger("hydrad.engine")

MADV_POPULATE_WRITE = 23  # <sys/mman.h>, Linux 5.14


def _madvise():
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


_MADVISE = _madvise()


def populate(address: int, nbytes: int) -> int:
    """Back the pages of ``[address, address + nbytes)`` for writing; 0, or the errno."""
    if _MADVISE is None:
        return errno.ENOSYS
    start = address - address % mmap.PAGESIZE
    if _MADVISE(start, nbytes + (address - start), MADV_POPULATE_WRITE) == 0:
        return 0
    return ctypes.get_errno()


class PoolBacking:
    """The threads backing an instance's shared pools."""

    def __init__(self):
        self._threads: list[threading.Thread] = []

    def back(self, storage, what: str) -> None:
        """Back ``storage`` (a new ``UntypedStorage`` in shared memory): its first page now,
        the rest on a thread (or all of it now, zeroed, where the kernel cannot populate)."""
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        first = populate(storage.data_ptr(), min(nbytes, mmap.PAGESIZE))
        if first in (errno.EINVAL, errno.ENOSYS):  # no MADV_POPULATE_WRITE here
            storage.fill_(0)
            return
        if first:
            raise RuntimeError(f"cannot back the {what} ({nbytes >> 20} MiB) in shared memory: {os.strerror(first)}")
        thread = threading.Thread(target=self._populate, args=(storage, nbytes, what), daemon=True,
                                  name=f"hydrad-back-{what.replace(' ', '-')}")
        thread.start()
        self._threads.append(thread)

    def _populate(self, storage, nbytes: int, what: str) -> None:
        # ``storage`` is held until its pages are backed: the mapping stays meanwhile. At idle
        # priority (this thread only): what the start waits for runs first.
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):
            pass  # not on this platform: backed at the thread's normal priority instead
        error = populate(storage.data_ptr(), nbytes)
        if error:
            logger.error("shared memory ran out while backing the %s (%d MiB): %s; a step that reaches a page not "
                         "backed will fail", what, nbytes >> 20, os.strerror(error))

    def wait(self) -> None:
        """Until every pool is backed; the threads still at it run at normal priority from now
        (at idle priority they would wait for idle cores, which a busy instance has none of)."""
        for thread in self._threads:
            if thread.is_alive() and thread.native_id is not None:
                try:
                    os.sched_setscheduler(thread.native_id, os.SCHED_OTHER, os.sched_param(0))
                except (AttributeError, OSError):
                    pass  # not allowed here: waited for at the priority it has
            thread.join()
        self._threads.clear()

    @property
    def pending(self) -> int:
        return sum(t.is_alive() for t in self._threads)
