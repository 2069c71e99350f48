"""The daemon's end of one worker pipe, as an asyncio protocol.

The worker keeps its end as a plain blocking ``multiprocessing.Connection``. The
daemon hands its end to the event loop as a stream transport: bytes are read
whenever they arrive and cut into frames (``framing.FrameDecoder``), and writes are
buffered by the transport and never block the loop. Nothing here depends on the
descriptor's blocking mode, which uvloop changes; a message that arrives in
several pieces simply waits for its last piece. The link is closed only when the
pipe reaches EOF (the worker exited) or the socket fails, and says which.

Front-end processes use the same link to the daemon, on both ends (``peer`` names
the other end in the log).
"""

from __future__ import annotations

import asyncio
import fcntl
import io
import logging
import os
import pickle
import socket
import struct
import termios
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Callable

from hydrad.transport.framing import FrameDecoder, encode_frame
from hydrad.transport.sharing import HandleLedger, RecordingPickler, quiet_taker_resets

logger = logging.getLogger("hydrad.link")

# ``WorkerLink.close_reason`` when the worker closed its end (it exited, or is exiting).
EOF = "pipe reached EOF"


class LinkClosed(RuntimeError):
    """The link to the worker is closed: nothing more can be sent."""


class WorkerLink(asyncio.Protocol):
    """Typed messages to and from one worker over its pipe.

    ``on_message(msg)`` is called for every message in arrival order;
    ``on_closed(reason)`` once, when the pipe reaches EOF or fails.
    """

    def __init__(self, on_message: Callable[[object], None], on_closed: Callable[[str], None],
                 peer: str = "worker"):
        self.peer = peer  # who is at the other end, for the log: "worker", "front end 1", "daemon"
        self._on_message = on_message
        self._on_closed = on_closed
        self._decoder = FrameDecoder()
        self._transport: asyncio.Transport | None = None
        self.close_reason: str | None = None
        # Counters for the daemon's own metrics.
        self.num_messages_received = 0
        self.num_bytes_received = 0
        # Messages sent: the other end takes them in this order, one frame each.
        self.num_messages_sent = 0
        # One pickler for every message sent, its buffer reused (``ForkingPickler.dumps`` builds
        # both, and copies the reducers' table, per message); built again if reducers were
        # registered since (torch's for shared tensors register on import).
        self._pickling: tuple[io.BytesIO, ForkingPickler] | None = None
        self._num_reducers = -1
        # The shared-memory descriptors sent to the other end that it has not fetched yet.
        self.handles = HandleLedger()

    @classmethod
    async def open(
        cls, conn: Connection, on_message: Callable[[object], None], on_closed: Callable[[str], None],
        peer: str = "worker",
    ) -> WorkerLink:
        """Take over the daemon's end ``conn`` (it is closed here; the link owns a copy)."""
        import torch.multiprocessing  # noqa: F401  (registers torch's reductions for shared tensors)

        quiet_taker_resets()
        sock = socket.socket(fileno=os.dup(conn.fileno()))
        conn.close()
        link = cls(on_message, on_closed, peer)
        await asyncio.get_running_loop().connect_accepted_socket(lambda: link, sock)
        return link

    # -- sending ---------------------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self._transport is not None and self.close_reason is None

    def send(self, msg: object) -> None:
        """Queue ``msg`` for the worker; never blocks. Raises ``LinkClosed`` once closed."""
        if not self.is_open:
            raise LinkClosed(self.close_reason or "not connected")
        if self._num_reducers != len(ForkingPickler._extra_reducers):
            self._num_reducers = len(ForkingPickler._extra_reducers)
            buffer = io.BytesIO()
            self._pickling = (buffer, RecordingPickler(buffer, self.handles))
        buffer, pickler = self._pickling
        buffer.seek(0)
        buffer.truncate()
        try:
            pickler.dump(msg)
        finally:
            # The memo refers to every object pickled: cleared now, not before the next send,
            # or the last message (a request's pixels) would live on until then.
            pickler.clear_memo()
        self._transport.write(encode_frame(buffer.getvalue()))
        self.num_messages_sent += 1

    def send_if_open(self, msg: object) -> bool:
        """Send ``msg`` unless the link is closed (the other end is gone: nothing to tell it)."""
        try:
            self.send(msg)
            return True
        except LinkClosed:
            return False

    @property
    def num_bytes_unread(self) -> int:
        """Bytes in the socket not read yet, and the part of a frame read so far."""
        unread = self._decoder.num_buffered_bytes
        sock = self._transport.get_extra_info("socket") if self._transport is not None else None
        if sock is not None and self.close_reason is None:
            try:
                unread += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
            except OSError:
                pass
        return unread

    @property
    def num_bytes_unsent(self) -> int:
        return self._transport.get_write_buffer_size() if self._transport is not None else 0

    def release_handles(self) -> int:
        """Close the shared-memory descriptors sent that the other end never fetched (it died
        with them unread); returns how many. Only once the other end's process is gone."""
        return self.handles.release()

    def close(self) -> None:
        """Close from this side; ``on_closed`` is not called."""
        if self.close_reason is None:
            self.close_reason = "closed by the daemon"
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.num_bytes_received += len(data)
        try:
            frames = self._decoder.feed(data)
        except ValueError as e:
            self._fail(f"corrupt data on the pipe: {e}")
            return
        for frame in frames:
            try:
                msg = pickle.loads(frame)
            except Exception as e:  # a frame that does not unpickle: the stream is broken
                self._fail(f"undecodable message on the pipe: {type(e).__name__}: {e}")
                return
            self.num_messages_received += 1
            try:
                self._on_message(msg)
            except Exception:
                # A bug in handling one message must not take the worker down with it.
                logger.exception("handling a %s from the %s failed", type(msg).__name__, self.peer)

    def eof_received(self) -> bool:
        self._closed(EOF)
        return False  # let the transport close itself

    def connection_lost(self, exc: Exception | None) -> None:
        # A worker killed with bytes unread in its socket resets it instead of closing it
        # cleanly: its end is gone either way.
        gone = exc is None or isinstance(exc, (ConnectionResetError, BrokenPipeError))
        self._closed(EOF if gone else f"pipe failed: {exc}")

    def _fail(self, reason: str) -> None:
        logger.error("%s pipe: %s", self.peer, reason)
        self._closed(reason)
        if self._transport is not None:
            self._transport.close()

    def _closed(self, reason: str) -> None:
        if self.close_reason is None:
            self.close_reason = reason
            self._on_closed(reason)
