"""What the daemon lets in: memory budgets, the Request Processor's lanes, the drain.

A request's cost is known before the expensive work starts: its body's size from
``Content-Length`` before the body is read, its images' pixels from their headers
(``InputProcessor.inspect_chat``) before they are decoded. Two budgets bound what
requests hold at once:

* ``bodies``: request bodies, from before they are read until they are processed
  (``server.max_inflight_body_mb``);
* ``images``: decoded images while they are processed, estimated from their
  headers (``server.max_inflight_image_mb``, ``config_file.image_memory_bytes``).

Bodies are reserved before images, and whoever holds images never waits for
bodies, so two requests can never wait for each other. A request that does not fit
waits, in order of arrival, up to ``server.queue_timeout`` seconds, then gets 503
with ``Retry-After``. Small requests (a body of at most ``SMALL_BODY_BYTES``, images
estimated at most ``SMALL_IMAGE_BYTES``) never wait: they are counted, and may
take the budgets a little over their capacity.

The Request Processor runs on ``server.processor_threads`` + 1 threads. Large
requests take at most ``processor_threads`` of them, so a small request always
finds one free, however many large ones are being processed. A short text-only
request (a body of at most ``INLINE_BODY_BYTES``, no image) is processed on the
event loop itself: its template and tokens cost less than the hand-off to a thread. A reservation lasts
until the processing thread is done with the request, even if its client has gone.

The drain: once the daemon stops, ``start_draining`` makes new requests and
``/health`` answer 503, while requests in flight (``track``) go on;
``abort_all`` ends what is still waiting for a budget or being processed.
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

from aiohttp import web

from hydrad.cluster.requests import ServiceStopping
from hydrad.config_file import ServerConfig, image_memory_bytes
from hydrad.processor import PromptSize
from hydrad.server.errors import APIError

T = TypeVar("T")

# A request below both is small: its processing takes milliseconds (a text of up to
# 1 MiB, images of up to about 2 megapixels in all).
SMALL_BODY_BYTES = 1 << 20
# Text-only requests with a body up to this size are processed on the event loop itself.
INLINE_BODY_BYTES = 16 << 10
SMALL_IMAGE_BYTES = 32 << 20


def _find_malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (AttributeError, OSError):
        return None


_malloc_trim = _find_malloc_trim()


def _return_freed_memory() -> None:
    """Give the memory a large request's processing freed back to the system. glibc keeps
    freed blocks below its mmap threshold (which grows up to 32 MiB as large blocks are
    freed) in its heaps, one per thread: measured, 1.2 GB of 6000x6000 images stayed
    resident after their request. Trimming takes about 0.1 s for that much."""
    if _malloc_trim is not None:
        _malloc_trim(0)


class ServerBusy(APIError):
    """No room for the request within ``server.queue_timeout``: 503 with ``Retry-After``."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(503, message, code="server_busy")
        self.headers["Retry-After"] = str(retry_after)


class Reservation:
    """Units held from a budget until ``release`` (idempotent)."""

    def __init__(self, budget: Budget, amount: int):
        self.budget = budget
        self.amount = amount
        self._frees = True  # False once ``keep`` moved its units elsewhere

    def release(self) -> None:
        if self.amount:
            amount, self.amount = self.amount, 0
            if self._frees:
                self.budget._release(amount)

    def take(self) -> Reservation:
        """The same units in a new reservation, for whoever ends up releasing them; this one
        holds nothing from now on."""
        taken, self.amount = Reservation(self.budget, self.amount), 0
        taken._frees = self._frees
        return taken

    def keep(self) -> Reservation:
        """The units, moved to a new reservation that the caller releases once it no longer
        keeps what they account for (a kept response's input, until its answer ends). This
        one still says its amount (the Request Processor sizes the request by it) and frees
        nothing when released."""
        kept = Reservation(self.budget, self.amount)
        self._frees = False
        return kept

    def shrink(self, amount: int) -> None:
        """Keep only ``amount`` of it (a body smaller than reserved)."""
        if amount < self.amount:
            extra, self.amount = self.amount - amount, amount
            self.budget._release(extra)


class Budget:
    """Units (bytes, threads) that requests hold at once. Reservations above ``small`` wait
    until they fit, first come first served; those up to ``small`` never wait."""

    def __init__(self, capacity: int, small: int = 0):
        self.capacity = capacity
        self.small = small
        self.in_use = 0
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    async def reserve(self, amount: int, deadline: float) -> Reservation:
        """Raises ``asyncio.TimeoutError`` at ``deadline`` (``time.monotonic``) if it does not fit by then."""
        if amount <= self.small or (not self._waiters and self.in_use + amount <= self.capacity):
            self.in_use += amount
            return Reservation(self, amount)
        waiter = asyncio.get_running_loop().create_future()
        entry = (amount, waiter)
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), max(0.0, deadline - time.monotonic()))
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._release(amount)  # granted just as the wait ended: give it back
            else:
                if entry in self._waiters:
                    self._waiters.remove(entry)
                waiter.cancel()
                self._grant()  # those behind it may fit now
            raise
        return Reservation(self, amount)

    def fail_waiters(self, error: Exception) -> None:
        while self._waiters:
            _, waiter = self._waiters.popleft()
            waiter.set_exception(error)

    def _release(self, amount: int) -> None:
        self.in_use -= amount
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self.in_use + self._waiters[0][0] <= self.capacity:
            amount, waiter = self._waiters.popleft()
            self.in_use += amount
            waiter.set_result(None)


@dataclass(eq=False)  # hashed by identity, in the set of requests in flight
class Inflight:
    """One generation request between its arrival and its response's end."""

    req_id: str | None = None
    started: float = field(default_factory=time.monotonic)


class Admission:
    def __init__(self, config: ServerConfig, executor: Executor):
        self.config = config
        self.executor = executor
        self.bodies = Budget(config.max_inflight_body_mb << 20, SMALL_BODY_BYTES)
        self.images = Budget(config.max_inflight_image_mb << 20, SMALL_IMAGE_BYTES)
        self.large = Budget(config.processor_threads)  # threads processing large requests
        self.inflight: set[Inflight] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.draining: str | None = None
        self.stopped: str | None = None
        self._stop = asyncio.Event()
        # Recent processing time of a large request, for Retry-After.
        self._large_seconds = 1.0

    # -- the drain -------------------------------------------------------------------------------
    @contextmanager
    def track(self) -> Iterator[Inflight]:
        """A generation request in flight; refused with 503 once the daemon is draining."""
        if self.draining is not None:
            raise APIError(503, f"the daemon is shutting down ({self.draining})", code="shutting_down")
        entry = Inflight()
        self.inflight.add(entry)
        self._idle.clear()
        try:
            yield entry
        finally:
            self.inflight.discard(entry)
            if not self.inflight:
                self._idle.set()

    def start_draining(self, reason: str) -> None:
        self.draining = reason

    async def wait_idle(self, timeout: float) -> bool:
        """True once no request is in flight, False if ``timeout`` seconds pass first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def abort_all(self, reason: str) -> None:
        """End every request still waiting for a budget or for its processing with
        ``ServiceStopping(reason)`` (those on workers are failed by the request table)."""
        self.stopped = reason
        self._stop.set()
        error = ServiceStopping(reason)
        for budget in (self.bodies, self.images, self.large):
            budget.fail_waiters(error)

    # -- bodies ------------------------------------------------------------------------------------
    async def read_body(self, request: web.Request, arrival: float) -> tuple[bytes, Reservation]:
        """The request's body, its bytes reserved before it is read (all of ``max_body_mb``
        when the client sends no ``Content-Length``)."""
        limit = self.config.max_body_mb << 20
        declared = request.content_length
        if declared is not None and declared > limit:
            raise _too_large(declared, limit)
        reservation = await self._reserve(self.bodies, limit if declared is None else declared, arrival,
                                          "request bodies", "max_inflight_body_mb")
        try:
            body = bytearray()
            while chunk := await request.content.readany():
                body += chunk
                if len(body) > limit:
                    raise _too_large(len(body), limit)
        except BaseException:
            reservation.release()
            raise
        reservation.shrink(len(body))
        return bytes(body), reservation

    # -- processing --------------------------------------------------------------------------------
    async def process(self, fn: Callable[[], T], size: PromptSize, body: Reservation, arrival: float) -> T:
        """Run ``fn`` (the Request Processor's work on one request) in the pool once its decoded
        images fit and, for a large request, one of the large requests' threads is free.
        ``body`` and the images' reservation are released when ``fn`` ends, even if the
        caller has stopped waiting for it (client gone)."""
        if not size.image_sizes and body.amount <= INLINE_BODY_BYTES:
            # A short text prompt: the chat template and the tokenizer take well under a
            # millisecond, less than handing it to a thread and back.
            self._check_stopped()
            try:
                return fn()
            finally:
                body.release()
        largest = max((w * h for w, h in size.image_sizes), default=0)
        image_bytes = image_memory_bytes(size.num_pixels, largest) if size.image_sizes else 0
        is_large = body.amount > SMALL_BODY_BYTES or image_bytes > SMALL_IMAGE_BYTES
        held: list[Reservation] = []
        try:
            held.append(await self._reserve(self.images, image_bytes, arrival, "decoded images",
                                            "max_inflight_image_mb"))
            if is_large:
                held.append(await self._reserve(self.large, 1, arrival, "large requests", "processor_threads"))
            self._check_stopped()
            start = time.monotonic()
            future = self.executor.submit(_then_return_memory(fn) if is_large else fn)
            body = body.take()  # released with the others when fn ends
        except BaseException:
            for reservation in held:
                reservation.release()
            raise
        loop = asyncio.get_running_loop()

        def finished() -> None:
            for reservation in (*held, body):
                reservation.release()
            if is_large:
                self._large_seconds = 0.7 * self._large_seconds + 0.3 * (time.monotonic() - start)

        # Called on the pool's thread, or on this one when cancelled before it started.
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(finished))
        result = asyncio.wrap_future(future)
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait([result, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not result.done():
                # Not started yet: dropped. Running: it finishes and its result is dropped.
                result.cancel()
            elif not result.cancelled():
                # Done as the caller left (client gone): its error, e.g. a request refused, is
                # dropped here, not logged by asyncio as never retrieved.
                result.exception()
        if result.cancelled():
            self._check_stopped()
        return result.result()

    async def _reserve(self, budget: Budget, amount: int, arrival: float, what: str, key: str) -> Reservation:
        self._check_stopped()
        try:
            return await budget.reserve(amount, arrival + self.config.queue_timeout)
        except asyncio.TimeoutError:
            retry_after = max(1, math.ceil(self._large_seconds))
            unit = (lambda n: f"{n >> 20} MiB") if budget is not self.large else str
            raise ServerBusy(
                f"the server is busy: {unit(budget.in_use)} of {what} in process (server.{key} = "
                f"{self.config.__dict__[key]}) and no room for this request within server.queue_timeout "
                f"({self.config.queue_timeout:g} s); retry after {retry_after} s", retry_after) from None

    def _check_stopped(self) -> None:
        if self.stopped is not None:
            raise ServiceStopping(self.stopped)


def _then_return_memory(fn: Callable[[], T]) -> Callable[[], T]:
    def run() -> T:
        try:
            return fn()
        finally:
            _return_freed_memory()

    return run


def _too_large(nbytes: int, limit: int) -> APIError:
    return APIError(413, f"the request body is {nbytes} bytes; the limit is {limit} bytes "
                         f"(server.max_body_mb = {limit >> 20})", code="request_too_large")
