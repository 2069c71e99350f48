"""Shared tensors' file descriptors, handed over by multiprocessing's resource sharer.

A tensor in shared memory crosses a pipe as a handle: the taking process connects back to
the sending one's resource sharer (a thread of multiprocessing) and receives a duplicate
of the descriptor. When the taker dies during that handshake (a worker killed while it
takes a request), the sharer's thread reports the reset connection through
``sys.excepthook``: a traceback in the daemon's log for what is part of a worker's death,
which the supervisor reports anyway. ``quiet_taker_resets`` makes that one line.

The sharer forgets a descriptor only when a taker fetches it. One that is never fetched (the
taker died with the message unread in its pipe, or mid-handshake) stays open for the life of
the sending process, and so does the shared memory it names: a request's pixels, a peer's
pools. ``HandleLedger`` records the descriptors pickled for one taker (``RecordingPickler``)
and closes those still unfetched once that taker is gone.
"""

from __future__ import annotations

import io
import logging
import os
import sys
from multiprocessing import resource_sharer
from multiprocessing.reduction import ForkingPickler

logger = logging.getLogger("hydrad.link")

_SHARER = os.path.join("multiprocessing", "resource_sharer.py")


def quiet_taker_resets() -> None:
    """From now on, a connection reset or closed mid-handshake in this process's resource
    sharer is logged as one warning; every other exception reaches the previous hook."""
    previous = sys.excepthook
    if getattr(previous, "quiets_taker_resets", False):
        return

    def hook(kind, value, tb) -> None:
        if issubclass(kind, (ConnectionError, EOFError)) and _raised_in_sharer(tb):
            logger.warning("a process went away while taking a shared tensor from this one: %s", value or kind.__name__)
            return
        if issubclass(kind, KeyError) and _raised_in_sharer(tb):
            # A taker asked for a descriptor released when its link was lost (``HandleLedger``).
            logger.warning("a process asked for a shared tensor released when it was counted as gone")
            return
        previous(kind, value, tb)

    hook.quiets_taker_resets = True
    sys.excepthook = hook


def _raised_in_sharer(tb) -> bool:
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(_SHARER):
            return True
        tb = tb.tb_next
    return False


class HandleLedger:
    """The descriptors this process's resource sharer holds for one taker until it fetches
    them: the process at the other end of a link, or a peer a pool was exported to.

    ``record`` is called by ``RecordingPickler`` for every descriptor it pickles; ``release``,
    once the taker is gone (it will fetch nothing more), closes those it never fetched. The
    record is pruned of fetched descriptors as it grows: its length stays within twice the
    number unfetched, plus 64.
    """

    def __init__(self) -> None:
        self._keys: list[int] = []
        self._prune_at = 64

    def record(self, key: int) -> None:
        self._keys.append(key)
        if len(self._keys) >= self._prune_at:
            held = _held()
            self._keys = [k for k in self._keys if k in held]
            self._prune_at = 2 * len(self._keys) + 64

    @property
    def num_held(self) -> int:
        """Descriptors pickled for the taker that it has not fetched yet."""
        held = _held()
        return sum(1 for k in self._keys if k in held)

    def release(self) -> int:
        """Close the descriptors the taker never fetched; returns how many. Call only once it
        can fetch nothing more (its process is gone)."""
        held = _held()
        released = 0
        for key in self._keys:
            entry = held.pop(key, None)  # atomic: the sharer's thread pops a fetched one the same way
            if entry is not None:
                _send, close = entry
                close()
                released += 1
        self._keys = []
        self._prune_at = 64
        return released


class RecordingPickler(ForkingPickler):
    """multiprocessing's pickler (torch's reductions for shared tensors included) that records
    in ``ledger`` every descriptor it hands to the sharer (CUDA IPC handles need no record)."""

    def __init__(self, file: io.BytesIO, ledger: HandleLedger):
        super().__init__(file)
        self.ledger = ledger

    def reducer_override(self, obj):
        if type(obj) is _DUP_FD:
            ident = getattr(obj, "_id", None)  # (the sharer's address, its key)
            if ident is not None:
                self.ledger.record(ident[1])
        return NotImplemented  # pickled as it would be without this


def dumps_recording(obj: object, ledger: HandleLedger) -> bytes:
    """``ForkingPickler.dumps`` with the descriptors handed out recorded in ``ledger``."""
    buffer = io.BytesIO()
    RecordingPickler(buffer, ledger).dump(obj)
    return buffer.getvalue()


# multiprocessing keeps no public view of its sharer: these are its internals (the same since
# Python 3.4). Should they change, nothing is recorded or released (the behaviour before the
# ledger), and nothing else changes.
_DUP_FD = getattr(resource_sharer, "DupFd", None)


def _held() -> dict:
    """The sharer's unfetched descriptors by key."""
    cache = getattr(getattr(resource_sharer, "_resource_sharer", None), "_cache", None)
    return cache if isinstance(cache, dict) else {}
