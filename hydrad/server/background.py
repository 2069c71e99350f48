"""Background responses of the Responses API (``background: true``).

The request is checked and prepared as any other; then, instead of waiting for its
answer, the client gets the response object at once, ``queued``, and polls
``GET /v1/responses/{id}``. The response is kept from that moment (the store's ``start``:
while it runs it is never evicted), ``in_progress`` once it is admitted on an instance,
and answered in place when it ends: ``completed`` or ``incomplete`` with its output, or
``failed`` with the error that ended it. ``POST /v1/responses/{id}/cancel`` marks it
``cancelled`` in the store, which fails its engine requests in the daemon's request table
with ``RequestCancelled`` (an abort): the process that runs it may be another front end,
and the abort reaches it as any request's end does. A cancel that comes before the
request is admitted is seen when the task asks to go ``in_progress``.

With ``stream`` true as well, the answer is the response's stream of events as they come
(``response.created`` and ``response.queued`` with the response ``queued``,
``response.in_progress`` once it runs, then a streamed response's events); the client that
leaves it ends nothing.
``GET /v1/responses/{id}?stream=true&starting_after=N`` follows such a response again from
any process, from the event after sequence number N: the process that runs it keeps its
events (``EventLog``) and writes them to its own followers as they come, and hands them to
the store (see ``FLUSH_SECONDS``; all of them before its answer), where followers in other
processes (and every follower once it has ended) read them every ``FOLLOW_POLL_SECONDS``.

The task runs in the process that took the request and holds what the request held (a
kept input's share of the body budget) until it ends. A drain does not wait for it: what
it would answer is kept in the daemon's memory, which the stop loses; it fails with the
daemon's other requests when the workers stop. A front end that dies takes its tasks with
it: the daemon answers their responses ``failed`` (``ResponseStore.orphaned``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from hydrad.cluster.requests import RequestCancelled
from hydrad.server.errors import APIError, exception_status
from hydrad.server.responses import ResponsesFormat, ResponsesRequest, kept_response_of
from hydrad.server.serving import usage_of, whole_body

logger = logging.getLogger("hydrad.server")

# A streamed background response's new events go to the store at most every
# FLUSH_SECONDS while a process other than the one that runs it follows it there (and
# followers there look again as often), else every UNFOLLOWED_FLUSH_SECONDS (one round trip
# each from a front-end process: at 256 such responses, every 50 ms took a second front
# end's CPU per token from 45 to 76-92 us here). A follower in another process sees them up
# to about FLUSH_SECONDS later, after its first second.
FLUSH_SECONDS = 0.05
UNFOLLOWED_FLUSH_SECONDS = 1.0
FOLLOW_POLL_SECONDS = 0.05


class _DirectFollower:
    """A follower whose events ``add`` writes itself (``write(data) -> bool``) until the
    connection cannot take them; then ``woken``, with where it is (``position``)."""

    def __init__(self, write):
        self.write = write
        self.position = 0
        self.woken = asyncio.get_running_loop().create_future()

    def wake(self, position: int) -> None:
        self.position = position
        if not self.woken.done():
            self.woken.set_result(None)


class EventLog:
    """A streamed background response's events, in the process that runs it: one entry per
    event (its index, the event's ``sequence_number``), followed by any number of readers.
    A reader that can write to its connection from outside its handler is written to as
    events come (the streamed routes' ``DirectWriter``), without waking its handler."""

    def __init__(self):
        self.events: list[bytes] = []
        self.ended = False
        self.flushed = 0  # the events handed to the store so far
        self.flushed_at = 0.0
        self.followed = False  # by a process other than this one, as the store last said
        self._changed = asyncio.Event()
        self._direct: list[_DirectFollower] = []

    def add(self, data: bytes) -> None:
        """Events as the response's format writes them (several at once, each ending in a
        blank line; their data is JSON on one line)."""
        if not data:
            return
        start = len(self.events)
        self.events += [event + b"\n\n" for event in data.split(b"\n\n")[:-1]]
        for follower in [f for f in self._direct if not f.write(data)]:
            self._direct.remove(follower)  # its connection is full: its handler writes from here
            follower.wake(start)
        self._changed.set()

    def end(self) -> None:
        self.ended = True
        for follower in self._direct:
            follower.wake(len(self.events))
        self._direct = []
        self._changed.set()

    async def follow(self, after: int, direct=None) -> AsyncIterator[bytes]:
        """The events after sequence number ``after``, as they come, until the response ends.
        ``direct(data) -> bool``: once one has been yielded (and written: the response's
        headers have gone out), the next are written by ``add`` with it while it takes them."""
        i = max(after + 1, 0)
        written = False
        while True:
            if i < len(self.events):
                data, i = b"".join(self.events[i:]), len(self.events)
                yield data
                written = True
            elif self.ended:
                return
            elif direct is not None and written:
                follower = _DirectFollower(direct)
                self._direct.append(follower)
                try:
                    await follower.woken
                finally:
                    if follower in self._direct:  # its handler was cancelled: the client left
                        self._direct.remove(follower)
                i = follower.position
            else:
                self._changed.clear()
                await self._changed.wait()


async def follow_kept(kept, response_id: str, after: int, first: list[bytes]) -> AsyncIterator[bytes]:
    """A streamed response's events after ``after`` as the store has them (``first``: its
    first answer), looked for again every ``FOLLOW_POLL_SECONDS`` until it has ended."""
    answer: tuple[list[bytes], bool] | None = first
    while answer is not None:
        events, ended = answer
        if events:
            after += len(events)
            yield b"".join(events)
        if ended:
            return
        await asyncio.sleep(FOLLOW_POLL_SECONDS)
        answer = await kept.call("events", (response_id, after))  # None: deleted meanwhile


class BackgroundResponses:
    """The background responses this process runs."""

    def __init__(self, kept):
        self.kept = kept  # the store's face here (``LocalStore`` or ``RemoteStore``)
        self.tasks: set[asyncio.Task] = set()
        self.logs: dict[str, EventLog] = {}  # of the streamed ones running here, by id

    async def start(self, engine, req: ResponsesRequest, fmt: ResponsesFormat, prepared, arrival: float,
                    held: contextlib.ExitStack) -> tuple[dict, EventLog | None]:
        """Keep the response as created and start generating it; returns the response object
        to answer now, and with ``stream`` the log of its events to answer instead. ``held``:
        what the request holds until its answer ends (taken over once the response is kept)."""
        created = fmt.response("queued", [], None)
        req_ids = tuple(request.req_id for request in prepared.requests)
        if not await self.kept.call("start", (kept_response_of(req, created), req_ids, req.stream)):
            raise APIError(503, "background responses still running fill the response store "
                           "(server.responses_store_mb): retry once some have ended", "background",
                           "responses_store_full")
        log = None
        if req.stream:
            log = self.logs[fmt.req_id] = EventLog()
            log.add(fmt.stream_queued())
        task = asyncio.create_task(self._run(engine, req, fmt, prepared, arrival, held.pop_all(), log),
                                   name=f"background {fmt.req_id}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return created, log

    async def _run(self, engine, req: ResponsesRequest, fmt: ResponsesFormat, prepared, arrival: float,
                   held: contextlib.ExitStack, log: EventLog | None) -> None:
        """Generate, then answer in the store whatever ended it (the store drops the answer of
        a response cancelled or deleted meanwhile)."""
        final = None
        with held:
            try:
                try:
                    await engine.wait_for_entry(prepared.requests, arrival)
                    async with engine.generate(prepared, arrival, req.user) as outputs:
                        if not await self.kept.call("progress", fmt.req_id):
                            return  # cancelled or deleted before it ran: leaving aborts it
                        final = await (whole_body(fmt, outputs) if log is None else
                                       self._stream(fmt, outputs, log))
                except asyncio.CancelledError:  # the process stops: the store goes with the daemon
                    raise
                except RequestCancelled:
                    return  # the store has it cancelled already
                except Exception as e:
                    status = exception_status(e)
                    if status >= 500:
                        logger.warning("background response %s failed: %s", fmt.req_id, e)
                    final = fmt.failed(status, e, [])
                    if log is not None:
                        log.add(fmt.stream_error(status, e, [], [], None, False))
                try:
                    if log is not None:
                        await self._flush(fmt.req_id, log, force=True)  # before the answer: followers see all
                    await self.kept.call("finish", kept_response_of(req, final))
                except Exception as e:
                    logger.warning("background response %s: its answer was not kept: %s", fmt.req_id, e)
            finally:
                if log is not None:  # its followers here end; later ones read the store
                    log.end()
                    self.logs.pop(fmt.req_id, None)

    async def _stream(self, fmt: ResponsesFormat, outputs, log: EventLog) -> dict:
        """The response's events into ``log`` as it is generated; its answer. Each step's
        outputs go in from the step's delivery pass (``RequestStream.direct``): this task
        wakes only for its end."""
        log.add(fmt.stream_running())

        def direct(batch) -> bool:
            for out in batch:
                log.add(fmt.chunk_bytes(out, False, None, False))
            if self._flush_due(log):
                task = asyncio.ensure_future(self._flush(fmt.req_id, log))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
            return True

        outputs.direct = direct
        try:
            async for batch in outputs:  # what came before, and the end
                direct(batch)
        finally:
            outputs.direct = None
        log.add(fmt.stream_end(usage_of(outputs), False, False))
        return fmt.final

    @staticmethod
    def _flush_due(log: EventLog) -> bool:
        """Whether the log has new events and its last hand-over is ``FLUSH_SECONDS`` old
        (``UNFOLLOWED_FLUSH_SECONDS`` while no other process follows it)."""
        every = FLUSH_SECONDS if log.followed else UNFOLLOWED_FLUSH_SECONDS
        return log.flushed < len(log.events) and asyncio.get_running_loop().time() - log.flushed_at >= every

    async def _flush(self, response_id: str, log: EventLog, force: bool = False) -> None:
        """Hand the log's new events to the store (where due, or with ``force`` at once).
        Hand-overs leave in the order they are made (the slice is taken before the call)."""
        if not (force and log.flushed < len(log.events) or self._flush_due(log)):
            return
        events, log.flushed = log.events[log.flushed:], len(log.events)
        log.flushed_at = asyncio.get_running_loop().time()
        try:
            # None: cancelled (its requests are aborted, which ends the task).
            log.followed = bool(await self.kept.call("add_events", (response_id, events)))
        except Exception as e:
            if force:
                raise
            logger.warning("background response %s: its events did not reach the store: %s", response_id, e)

    async def stop(self) -> None:
        """End every task still running (the process stops; a drain does not wait for them)."""
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
