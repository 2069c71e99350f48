"""Logging set-up of the daemon's processes (the daemon and its front ends)."""

from __future__ import annotations

import logging
import time
from typing import Callable, Hashable

# One line per finished request, at info level (``server.log_requests``).
REQUESTS_LOGGER = "hydrad.requests"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str, log_requests: bool = True, fmt: str = LOG_FORMAT) -> None:
    """Log at ``level`` to stderr (the journal, under systemd). Without ``log_requests`` the
    line per finished request is left out whatever the level; at hundreds of requests a
    second it would otherwise be most of the log, and past journald's rate limit (10,000
    lines in 30 s by default) the journal drops the service's other lines with it."""
    logging.basicConfig(level=level.upper(), format=fmt)
    logging.getLogger(REQUESTS_LOGGER).setLevel(logging.NOTSET if log_requests else logging.WARNING)


class RepeatedLines:
    """At most ``burst`` lines of one kind (a key) in ``window`` seconds; those past it are
    counted, and the next line of that kind logged after the window says how many were left
    out. Kinds must be few (an HTTP status and error code, not a path a client chose)."""

    def __init__(self, burst: int = 5, window: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.burst, self.window, self.clock = burst, window, clock
        self._kinds: dict[Hashable, list] = {}  # key -> [window start, lines logged in it, left out]

    def admit(self, key: Hashable) -> tuple[bool, int]:
        """(whether to log this line, how many lines of its kind were left out before it)."""
        now = self.clock()
        state = self._kinds.get(key)
        if state is None or now - state[0] >= self.window:
            left_out = state[2] if state is not None else 0
            self._kinds[key] = [now, 1, 0]
            return True, left_out
        if state[1] < self.burst:
            state[1] += 1
            return True, 0
        state[2] += 1
        return False, 0
