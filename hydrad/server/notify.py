"""systemd notifications (``Type=notify``): one datagram to $NOTIFY_SOCKET each; with
``WatchdogSec=`` in the unit, keep-alive pings (``WATCHDOG=1``) from the daemon's event
loop, so that a daemon whose loop hangs is killed and restarted by systemd."""

from __future__ import annotations

import asyncio
import logging
import os
import socket

logger = logging.getLogger("hydrad.daemon")


def sd_notify(state: str, warn: bool = True) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``); False when not started by systemd or the
    socket is unusable or full (a serving daemon must not die, nor wait, of a failed
    notification); ``warn``: log a warning then."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace socket
        address = "\0" + address[1:]
    try:
        # Non-blocking: a service manager that does not read must not stall the event loop.
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as e:
        if warn:
            logger.warning("cannot notify systemd at %s: %s", os.environ["NOTIFY_SOCKET"], e)
        return False
    return True


def watchdog_interval() -> float | None:
    """The seconds within which systemd expects a keep-alive ping from this process
    ($WATCHDOG_USEC, when $WATCHDOG_PID is unset or this process's), or None."""
    usec, pid = os.environ.get("WATCHDOG_USEC"), os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        seconds = int(usec) / 1e6
    except ValueError:
        logger.warning("WATCHDOG_USEC=%r is not a number of microseconds: no keep-alive pings", usec)
        return None
    return seconds if seconds > 0 else None


async def keep_alive(interval: float) -> None:
    """Ping systemd's watchdog four times per ``interval`` for as long as the loop runs
    (twice, as systemd recommends, would leave no room for a slow moment of a busy loop)."""
    failing = False
    while True:
        failing = not sd_notify("WATCHDOG=1", warn=not failing)  # one warning per run of failures
        await asyncio.sleep(interval / 4)
