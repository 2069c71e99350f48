"""Logging set-up of the daemon's processes (the daemon and its front ends)."""

from __future__ import annotations

import logging

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
