"""Shared tensors' file descriptors, handed over by multiprocessing's resource sharer.

A tensor in shared memory crosses a pipe as a handle: the taking process connects back to
the sending one's resource sharer (a thread of multiprocessing) and receives a duplicate
of the descriptor. When the taker dies during that handshake (a worker killed while it
takes a request), the sharer's thread reports the reset connection through
``sys.excepthook``: a traceback in the daemon's log for what is part of a worker's death,
which the supervisor reports anyway. ``quiet_taker_resets`` makes that one line.
"""

from __future__ import annotations

import logging
import os
import sys

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
        previous(kind, value, tb)

    hook.quiets_taker_resets = True
    sys.excepthook = hook


def _raised_in_sharer(tb) -> bool:
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(_SHARER):
            return True
        tb = tb.tb_next
    return False
