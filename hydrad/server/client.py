"""The daemon's end of one worker pipe.

Neither direction blocks the event loop: the pipe's file descriptor is
registered with ``loop.add_reader`` and drained whenever it is readable, and
messages to the worker are framed as ``Connection.send`` frames them but written
without blocking, the rest queued until the socket takes it. A worker in a long
step reads nothing; a burst of requests must then wait in the daemon's buffer,
not stall every other stream (or deadlock against a worker blocked on sending
its own output). Each request gets
an ``asyncio.Queue`` (in the daemon-wide ``RequestTable``) that receives its
``RequestDelta``s from whichever instance runs its current stage, or an
exception when a worker refuses the request or dies.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import struct
import time
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Callable

from hydrad.engine.inputs import EngineRequest, EngineStats
from hydrad.errors import RequestError
from hydrad.server.requests_table import RequestQueue, RequestTable
from hydrad.transport.messages import (
    AddRequest,
    GetStats,
    RequestRejected,
    Shutdown,
    StatsReply,
    StepOutput,
    WorkerFailed,
    WorkerReady,
)

logger = logging.getLogger("hydrad.client")


# ``WorkerClient.failure`` when the pipe reached EOF without a ``WorkerFailed`` first.
EXITED = "exited"


class WorkerLost(RuntimeError):
    """The worker serving a request exited or failed."""


class WorkerClient:
    def __init__(self, instance_id: int, role: str, device: str, conn: Connection, table: RequestTable):
        self.instance_id = instance_id
        self.role = role
        self.device = device
        self.conn = conn
        self.alive = True
        self.ready: WorkerReady | None = None
        self.failure: str | None = None
        self.on_lost: Callable[[WorkerClient], None] | None = None
        self._loop = asyncio.get_running_loop()
        self._ready_future: asyncio.Future[WorkerReady] = self._loop.create_future()
        self.table = table
        self._stats_waiters: dict[int, asyncio.Future[EngineStats]] = {}
        self._seq = itertools.count()
        self._token_times: deque[tuple[float, int]] = deque()
        # A second handle on the pipe's socket, for MSG_DONTWAIT writes: making the
        # descriptor itself non-blocking would break Connection.recv on the read side.
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        self._outbox = bytearray()
        self._writing = False
        self._loop.add_reader(conn.fileno(), self._on_readable)

    # -- load, for the router --------------------------------------------------------------
    @property
    def num_inflight(self) -> int:
        return self.table.held_by(self)

    def tokens_per_second(self, window: float = 10.0) -> float:
        self._trim_token_times(time.monotonic() - window)
        return sum(n for _, n in self._token_times) / window

    # -- daemon -> worker ------------------------------------------------------------------
    async def wait_ready(self) -> WorkerReady:
        return await asyncio.shield(self._ready_future)

    def add_request(self, request: EngineRequest) -> RequestQueue:
        if not self.alive:
            raise WorkerLost(f"worker {self.instance_id} is down")
        queue = self.table.open(request.req_id, self)
        self._send(AddRequest(request))
        return queue

    def abort(self, req_id: str) -> None:
        """Abort the request on every instance that holds a part of it."""
        self.table.abort(req_id)

    def send_quietly(self, msg) -> None:
        """Send unless the worker is gone (its requests have failed already)."""
        if self.alive:
            try:
                self._send(msg)
            except WorkerLost:
                pass

    async def get_stats(self, timeout: float = 2.0) -> EngineStats:
        if not self.alive:
            raise WorkerLost(f"worker {self.instance_id} is down")
        seq = next(self._seq)
        waiter = self._stats_waiters[seq] = self._loop.create_future()
        self._send(GetStats(seq))
        try:
            return await asyncio.wait_for(waiter, timeout)
        finally:
            self._stats_waiters.pop(seq, None)

    def shutdown(self, finish_running: bool = False) -> None:
        if self.alive:
            try:
                self._send(Shutdown(finish_running))
            except WorkerLost:
                pass  # already gone: nothing to stop

    def close(self) -> None:
        if not self.conn.closed:
            self._loop.remove_reader(self.conn.fileno())
            self.conn.close()
        if self._sock.fileno() != -1:
            self._loop.remove_writer(self._sock.fileno())
            self._sock.close()
        self._outbox.clear()
        self._writing = False

    def _send(self, msg) -> None:
        if not self.alive:
            raise WorkerLost(f"worker {self.instance_id} is down")
        self._outbox += _frame(ForkingPickler.dumps(msg))
        if not self._writing:
            self._flush()
        if not self.alive:  # broken pipe: the worker is gone
            raise WorkerLost(f"worker {self.instance_id} is down")

    def _flush(self) -> None:
        """Write what the socket takes now; the writer callback does the rest."""
        try:
            while self._outbox:
                del self._outbox[: self._sock.send(self._outbox, socket.MSG_DONTWAIT)]
        except BlockingIOError:
            if not self._writing:
                self._loop.add_writer(self._sock.fileno(), self._flush)
                self._writing = True
            return
        except OSError as e:
            self._lost(f"pipe closed ({e})")
            return
        if self._writing:
            self._loop.remove_writer(self._sock.fileno())
            self._writing = False

    # -- worker -> daemon ------------------------------------------------------------------
    def _on_readable(self) -> None:
        try:
            while self.conn.poll():
                self._dispatch(self.conn.recv())
        except (EOFError, OSError):
            self._lost(EXITED)

    def _dispatch(self, msg) -> None:
        if isinstance(msg, StepOutput):
            now = time.monotonic()
            self._token_times.append((now, sum(len(d.new_token_ids) for d in msg.deltas)))
            self._trim_token_times(now - 60.0)
            for delta in msg.deltas:
                self.table.deliver(delta)
            # Releases first: the source may be the target of this step's offers (ED+P).
            for req_id, source_id in msg.pulled:
                self.table.on_pulled(self, req_id, source_id)
            for offer in msg.offers:
                self.table.on_offer(self, offer)
        elif isinstance(msg, StatsReply):
            waiter = self._stats_waiters.get(msg.seq)
            if waiter is not None and not waiter.done():
                waiter.set_result(msg.stats)
        elif isinstance(msg, RequestRejected):
            self.table.fail(msg.req_id, RequestError(msg.message))
        elif isinstance(msg, WorkerReady):
            self.ready = msg
            self._ready_future.set_result(msg)
        elif isinstance(msg, WorkerFailed):
            logger.error("worker %d failed: %s\n%s", self.instance_id, msg.message, msg.traceback)
            self._lost(msg.message)
        else:
            logger.error("worker %d sent an unexpected %s", self.instance_id, type(msg).__name__)

    def _lost(self, reason: str) -> None:
        if not self.alive:
            return
        self.alive = False
        self.failure = reason
        self.close()
        error = WorkerLost(f"worker {self.instance_id} ({self.device}, {self.role}) {reason}")
        if not self._ready_future.done():
            self._ready_future.set_exception(error)
            self._ready_future.exception()  # retrieved here; wait_ready() re-raises it
        self.table.lost(self, error)
        for waiter in self._stats_waiters.values():
            if not waiter.done():
                waiter.set_exception(error)
        if self.on_lost is not None:
            self.on_lost(self)

    def _trim_token_times(self, since: float) -> None:
        while self._token_times and self._token_times[0][0] < since:
            self._token_times.popleft()


def _frame(payload: bytes) -> bytes:
    """``payload`` with the length header ``multiprocessing.Connection.recv`` expects."""
    if len(payload) > 0x7FFFFFFF:
        return struct.pack("!i", -1) + struct.pack("!Q", len(payload)) + payload
    return struct.pack("!i", len(payload)) + payload
