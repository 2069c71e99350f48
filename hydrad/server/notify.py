"""systemd readiness notification (``Type=notify``): one datagram to $NOTIFY_SOCKET."""

from __future__ import annotations

import logging
import os
import socket

logger = logging.getLogger("hydrad.daemon")


def sd_notify(state: str) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``); False when not started by systemd or the
    socket is unusable (a serving daemon must not die of a failed notification)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as e:
        logger.warning("cannot notify systemd at %s: %s", os.environ["NOTIFY_SOCKET"], e)
        return False
    return True
