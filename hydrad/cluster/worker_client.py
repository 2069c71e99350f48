"""The daemon's end of one worker pipe.

Messages travel over a ``WorkerLink`` (``hydrad.transport.link``): an asyncio
protocol that reads whatever bytes arrive, cuts them into whole frames, and
buffers writes in the transport, so neither direction ever blocks the event
loop and a message that arrives in pieces is never mistaken for a dead worker.
A worker in a long step reads nothing; a burst of requests then waits in the
transport's buffer instead of stalling every other stream. Each request gets
a sink (in the daemon-wide ``RequestTable``) that receives its tokens from
whichever instance runs its current stage, or an exception when a worker
refuses the request or dies. A worker is lost when its
pipe reaches EOF (it exited) or fails, or when it reports ``WorkerFailed``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections import deque
from multiprocessing.connection import Connection
from typing import Callable

from hydrad.engine.cores import CpuThreads
from hydrad.engine.inputs import EngineRequest, EngineStats
from hydrad.errors import RequestError
from hydrad.cluster.requests import RequestSink, RequestTable
from hydrad.engine.migration import MigrationOffer
from hydrad.transport.messages import (
    Abort,
    AddRequest,
    AttachPeers,
    DetachPeer,
    ExportPools,
    GetStats,
    Migrate,
    ModelMeasured,
    PoolsExported,
    Reconfigure,
    Reconfigured,
    Release,
    RequestRejected,
    Retire,
    Retired,
    Shutdown,
    StatsReply,
    StepOutput,
    WorkerFailed,
    WorkerReady,
)
from hydrad.transport.link import EOF, LinkClosed, WorkerLink

logger = logging.getLogger("hydrad.client")


# ``WorkerClient.failure`` when the pipe reached EOF without a ``WorkerFailed`` first.
EXITED = "exited"


class WorkerLost(RuntimeError):
    """The worker serving a request exited or failed."""


class WorkerClient:
    def __init__(self, instance_id: int, role: str, device: str, table: RequestTable):
        self.instance_id = instance_id
        self.role = role
        self.device = device
        self.alive = True
        self.ready: WorkerReady | None = None
        self.failure: str | None = None
        self.on_lost: Callable[[WorkerClient], None] | None = None
        # Called with every step output's timing (predicted and measured times; None when the
        # worker sent none) and how long it waited to be read (for the metrics).
        self.on_step: Callable[[WorkerClient, object, float | None], None] | None = None
        self._loop = asyncio.get_running_loop()
        self._ready_future: asyncio.Future[WorkerReady] = self._loop.create_future()
        self.table = table
        self._stats_waiters: dict[int, asyncio.Future[EngineStats]] = {}
        self._pool_waiters: dict[int, asyncio.Future[bytes]] = {}
        # The answers of a role change under way (one of each at a time).
        self._reconfigured: asyncio.Future[Reconfigured] | None = None
        self._retired: asyncio.Future[Retired] | None = None
        self._seq = itertools.count()
        self._token_times: deque[tuple[float, int]] = deque()
        self.link: WorkerLink | None = None
        # Set by the supervisor while a restarted worker is ready but its peers' pools are not
        # attached yet: a migration to it then would be refused, so the router sends it nothing.
        self.held_back = False
        # When the worker last sent anything (the supervisor's stall watchdog reads it).
        self.last_heard = time.monotonic()
        # Requests aborted on the worker -> the number of messages sent up to that abort: what
        # it sends about them while it has taken fewer is from before the abort (``abort``).
        self._fences: dict[str, int] = {}

    async def connect(self, conn: Connection) -> None:
        """Take over the daemon's end of the worker's pipe."""
        self.link = await WorkerLink.open(conn, self._dispatch, self._on_link_closed)

    # -- load, for the router --------------------------------------------------------------
    @property
    def accepting(self) -> bool:
        """Takes new work: alive, started (a restarting worker is alive before it is ready) and
        attached to its peers."""
        return self.alive and self.ready is not None and not self.held_back

    @property
    def num_bytes_unread(self) -> int:
        """What the worker sent that the daemon has not read yet."""
        return self.link.num_bytes_unread if self.link is not None else 0

    @property
    def num_inflight(self) -> int:
        return self.table.held_by(self)

    def tokens_per_second(self, window: float = 10.0) -> float:
        self._trim_token_times(time.monotonic() - window)
        return sum(n for _, n in self._token_times) / window

    # -- daemon -> worker ------------------------------------------------------------------
    async def wait_ready(self) -> WorkerReady:
        return await asyncio.shield(self._ready_future)

    def add_request(self, request: EngineRequest, sink: RequestSink) -> None:
        """Send ``request``; its outputs go to ``sink`` from whichever instance runs it."""
        if not self.alive:
            raise WorkerLost(f"worker {self.instance_id} is down")
        self.table.open(request.req_id, self, sink, request)
        self._send(AddRequest(request))

    # -- the relay's Instance interface ------------------------------------------------------
    def migrate(self, offer: MigrationOffer) -> None:
        self.send_quietly(Migrate(offer))

    def release(self, req_ids: tuple[str, ...]) -> None:
        self.send_quietly(Release(tuple(req_ids)))

    def abort(self, req_ids: tuple[str, ...]) -> None:
        """Drop these requests on this worker (the table aborts a request everywhere). What
        the worker sends of them before it reads this is dropped here: a request run again
        after another instance died may be given to this worker again under the same id,
        and the old run's last tokens, finish, offers or refusal must not reach it."""
        if self.send_quietly(Abort(tuple(req_ids))):
            fences, seq = self._fences, self.link.num_messages_sent
            for req_id in req_ids:
                fences.pop(req_id, None)  # the dict stays in the order of the aborts
                fences[req_id] = seq

    def send_quietly(self, msg) -> bool:
        """Send unless the worker is gone (its requests have failed already); whether sent."""
        if self.alive:
            try:
                self._send(msg)
                return True
            except WorkerLost:
                pass
        return False

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

    async def export_pools_for(self, peer_id: int, timeout: float = 30.0) -> bytes:
        """This worker's pools pickled for ``peer_id`` alone (to hand to that peer)."""
        if not self.alive:
            raise WorkerLost(f"worker {self.instance_id} is down")
        waiter = self._pool_waiters[peer_id] = self._loop.create_future()
        self._send(ExportPools(peer_id))
        try:
            return await asyncio.wait_for(waiter, timeout)
        finally:
            self._pool_waiters.pop(peer_id, None)

    async def reconfigure(self, role: str, timeout: float, threads: CpuThreads | None = None,
                          borrowed: bool = True) -> Reconfigured:
        """Take on ``role``'s stages too (see ``hydrad.cluster.redeploy``); ``threads``: run on
        these from now on (``engine.cores``). The worker measures the latency models it has
        not cached between its steps, within half of ``timeout`` (``Reconfigure.wait``);
        ``borrowed``: on its borrowed cores too (``Reconfigure.borrowed``)."""
        self._reconfigured = self._loop.create_future()
        self._send(Reconfigure(role, threads, wait=timeout / 2, borrowed=borrowed))
        return await asyncio.wait_for(self._reconfigured, timeout)

    async def retire(self, stages: str, timeout: float) -> Retired:
        """Hand ``stages`` over; returns once the worker has dropped them."""
        self._retired = self._loop.create_future()
        self._send(Retire(stages))
        return await asyncio.wait_for(self._retired, timeout)

    def attach_peers(self, pools: dict[int, bytes]) -> None:
        self.send_quietly(AttachPeers(pools))

    def detach_peer(self, peer_id: int) -> None:
        self.send_quietly(DetachPeer(peer_id))

    def shutdown(self, finish_running: bool = False) -> None:
        if self.alive:
            try:
                self._send(Shutdown(finish_running))
            except WorkerLost:
                pass  # already gone: nothing to stop

    def close(self) -> None:
        if self.link is not None:
            self.link.close()

    def _send(self, msg) -> None:
        if not self.alive or self.link is None:
            raise WorkerLost(f"worker {self.instance_id} is down")
        try:
            self.link.send(msg)
        except LinkClosed:
            raise WorkerLost(f"worker {self.instance_id} is down") from None

    # -- worker -> daemon ------------------------------------------------------------------
    def _on_link_closed(self, reason: str) -> None:
        self._lost(EXITED if reason == EOF else reason)

    def _dispatch(self, msg) -> None:
        if not self.alive:  # its requests have run again or failed: nothing it says counts now
            return
        self.last_heard = now = time.monotonic()
        if isinstance(msg, StepOutput):
            if self._fences:
                msg = self._without_aborted(msg)
            self._token_times.append((now, len(msg.output.token_ids)))
            self._trim_token_times(now - 60.0)
            if self.on_step is not None:
                self.on_step(self, msg.output.timing, now - msg.sent_at if msg.sent_at else None)
            self.table.deliver_output(msg.output)
            # Releases first: the source may be the target of this step's offers (ED+P).
            for pulled in msg.pulled:
                self.table.on_pulled(self, pulled)
            for offer in msg.offers:
                self.table.on_offer(self, offer)
        elif isinstance(msg, StatsReply):
            waiter = self._stats_waiters.get(msg.seq)
            if waiter is not None and not waiter.done():
                waiter.set_result(msg.stats)
        elif isinstance(msg, Reconfigured):
            if self._reconfigured is not None and not self._reconfigured.done():
                self._reconfigured.set_result(msg)
        elif isinstance(msg, Retired):
            if self._retired is not None and not self._retired.done():
                self._retired.set_result(msg)
        elif isinstance(msg, PoolsExported):
            waiter = self._pool_waiters.get(msg.peer_id)
            if waiter is not None and not waiter.done():
                waiter.set_result(msg.blob)
        elif isinstance(msg, RequestRejected):
            if self._fences.get(msg.req_id, 0) <= msg.received:  # else it refused a run since aborted
                self.table.fail(msg.req_id, RequestError(msg.message, msg.param))
        elif isinstance(msg, ModelMeasured):
            if self.ready is not None:
                self.ready = dataclasses.replace(self.ready, **{
                    "borrow_model" if msg.borrowed else "latency_model": msg.model})
            logger.info("worker %d measured its latency model on %d threads%s", self.instance_id, msg.threads,
                        " (borrowing idle cores)" if msg.borrowed else " again")
        elif isinstance(msg, WorkerReady):
            self.ready = msg
            self._ready_future.set_result(msg)
        elif isinstance(msg, WorkerFailed):
            logger.error("worker %d failed: %s\n%s", self.instance_id, msg.message, msg.traceback)
            self._lost(msg.message)
        else:
            logger.error("worker %d sent an unexpected %s", self.instance_id, type(msg).__name__)

    def _without_aborted(self, msg: StepOutput) -> StepOutput:
        """``msg`` without what it says of requests aborted after its step began (the worker
        had not read the abort yet); the aborts it had read are forgotten."""
        fences, received = self._fences, msg.received
        while fences:  # in the order sent: drop those the worker had read
            req_id = next(iter(fences))
            if fences[req_id] > received:
                break
            del fences[req_id]
        if not fences:
            return msg
        out = msg.output
        if not any(item.req_id in fences for item in (*out.finished, *msg.offers, *msg.pulled)) \
                and not any(req_id in fences for req_id in out.req_ids):
            return msg
        rows = [i for i, req_id in enumerate(out.req_ids) if req_id not in fences]
        logger.debug("worker %d: dropped what a step said of requests aborted since", self.instance_id)
        out = dataclasses.replace(
            out, req_ids=[out.req_ids[i] for i in rows], token_ids=[out.token_ids[i] for i in rows],
            logprobs=None if out.logprobs is None else [out.logprobs[i] for i in rows],
            finished=[f for f in out.finished if f.req_id not in fences])
        return dataclasses.replace(msg, output=out, offers=[o for o in msg.offers if o.req_id not in fences],
                                   pulled=[p for p in msg.pulled if p.req_id not in fences])

    def give_up(self, reason: str) -> None:
        """Treat the worker as dead (the supervisor kills a stalled one): as if its pipe had
        closed, with ``reason`` as how it ended."""
        self._lost(reason)

    def _lost(self, reason: str) -> None:
        if not self.alive:
            return
        self.alive = False
        self.failure = reason
        self.close()
        if self.link is not None:
            released = self.link.release_handles()  # the requests' pixels it never took
            if released:
                logger.info("worker %d: closed %d shared-memory descriptor(s) it never took", self.instance_id,
                            released)
        error = WorkerLost(f"worker {self.instance_id} ({self.device}, {self.role}) {reason}")
        if not self._ready_future.done():
            self._ready_future.set_exception(error)
            self._ready_future.exception()  # retrieved here; wait_ready() re-raises it
        # The supervisor first (it decides whether offers wait for a restart), then the requests.
        if self.on_lost is not None:
            self.on_lost(self)
        self.table.lost(self, error)
        for waiter in [*self._stats_waiters.values(), *self._pool_waiters.values(), self._reconfigured,
                       self._retired]:
            if waiter is None:
                continue
            if not waiter.done():
                waiter.set_exception(error)

    def _trim_token_times(self, since: float) -> None:
        while self._token_times and self._token_times[0][0] < since:
            self._token_times.popleft()

