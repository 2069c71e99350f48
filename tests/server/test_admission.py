"""Admission: memory budgets, the large requests' lane, the drain, on a real thread pool
with jobs that block until released."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from hydrad.cluster.requests import ServiceStopping
from hydrad.config_file import ServerConfig
from hydrad.processor import PromptSize
from hydrad.server.admission import Admission, Budget, ServerBusy
from hydrad.server.errors import APIError

MiB = 1 << 20


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


# -- Budget ------------------------------------------------------------------------------------------


def test_budget_waits_in_order_and_small_ones_never_wait():
    async def main():
        budget = Budget(10, small=1)
        far = time.monotonic() + 10
        held = await budget.reserve(8, far)
        first = asyncio.ensure_future(budget.reserve(5, far))
        second = asyncio.ensure_future(budget.reserve(2, far))  # would fit now, but comes later
        await asyncio.sleep(0.01)
        assert not first.done() and not second.done() and budget.num_waiting == 2
        tiny = await budget.reserve(1, far)  # small: through at once, over the capacity
        assert budget.in_use == 9
        tiny.release()
        held.release()
        await asyncio.sleep(0.01)
        assert first.done() and second.done() and budget.in_use == 7
        first.result().release()
        second.result().release()
        assert budget.in_use == 0

    run(main())


def test_a_wait_that_times_out_or_is_cancelled_lets_the_next_one_in():
    async def main():
        budget = Budget(10)
        held = await budget.reserve(6, time.monotonic() + 10)
        with pytest.raises(asyncio.TimeoutError):
            await budget.reserve(8, time.monotonic() + 0.05)
        cancelled = asyncio.ensure_future(budget.reserve(9, time.monotonic() + 10))
        behind = asyncio.ensure_future(budget.reserve(4, time.monotonic() + 10))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        await asyncio.sleep(0.01)
        assert behind.done() and budget.in_use == 10 and budget.num_waiting == 0
        held.release()
        behind.result().release()
        assert budget.in_use == 0

    run(main())


def test_a_kept_body_is_held_past_its_processing_until_its_keeper_releases_it():
    """``Reservation.keep`` (a kept response's input): the reservation the Request Processor
    gets still says its amount, and neither taking nor releasing it frees the units; the
    kept one does."""
    async def main():
        budget = Budget(10)
        body = await budget.reserve(6, time.monotonic() + 10)
        kept = body.keep()
        assert body.amount == 6 and budget.in_use == 6
        taken = body.take()  # as Admission.process does
        taken.release()
        body.release()
        assert budget.in_use == 6
        kept.release()
        kept.release()
        assert budget.in_use == 0

    run(main())


# -- Admission.process ----------------------------------------------------------------------------------


class Job:
    """A stand-in for the Request Processor's work on one request: runs until released."""

    def __init__(self, result):
        self.result = result
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self):
        self.started.set()
        assert self.release.wait(10)
        return self.result


def make_admission(**server) -> tuple[Admission, ThreadPoolExecutor]:
    config = ServerConfig(**{"processor_threads": 1, "queue_timeout": 0.3, **server})
    executor = ThreadPoolExecutor(config.processor_threads + 1)
    return Admission(config, executor), executor


async def body(admission: Admission, nbytes: int):
    return await admission.bodies.reserve(nbytes, time.monotonic() + 10)


TEXT = PromptSize(5)


def test_small_requests_are_processed_while_large_ones_take_every_large_thread():
    async def main():
        admission, executor = make_admission()
        large = Job("large")
        first = asyncio.ensure_future(admission.process(large, TEXT, await body(admission, 2 * MiB), time.monotonic()))
        await asyncio.get_running_loop().run_in_executor(None, large.started.wait)
        # A small request gets the spare thread at once.
        start = time.monotonic()
        assert await admission.process(lambda: "small", TEXT, await body(admission, 1000), start) == "small"
        assert time.monotonic() - start < 0.2
        # Another large one waits for the lane, then is refused with Retry-After.
        late = await body(admission, 2 * MiB)
        with pytest.raises(ServerBusy) as info:
            await admission.process(lambda: "late", TEXT, late, time.monotonic())
        late.release()  # as the handler does when its request was not processed
        assert info.value.status == 503 and info.value.headers["Retry-After"].isdigit()
        assert "server.queue_timeout (0.3 s)" in str(info.value) and "processor_threads" in str(info.value)
        large.release.set()
        assert await first == "large"
        await asyncio.sleep(0.01)
        assert admission.bodies.in_use == admission.images.in_use == admission.large.in_use == 0
        executor.shutdown()

    run(main())


def test_decoded_images_wait_for_room_and_their_memory_is_held_until_processed():
    async def main():
        # Room for one request of 8 images of 6000x6000 (8 bytes per pixel, the largest twice).
        admission, executor = make_admission(processor_threads=2, max_request_pixels=300_000_000,
                                             max_inflight_image_mb=2600, queue_timeout=10.0)
        images = PromptSize(1, ((6000, 6000),) * 8)
        first_job = Job("first")
        first = asyncio.ensure_future(admission.process(first_job, images, await body(admission, 100),
                                                        time.monotonic()))
        await asyncio.get_running_loop().run_in_executor(None, first_job.started.wait)
        assert admission.images.in_use == 8 * (8 + 1) * 36_000_000
        second = asyncio.ensure_future(admission.process(lambda: "second", images, await body(admission, 100),
                                                         time.monotonic()))
        await asyncio.sleep(0.1)
        assert not second.done() and admission.images.num_waiting == 1
        first_job.release.set()
        assert (await first, await second) == ("first", "second")
        executor.shutdown()

    run(main())


def test_a_caller_gone_leaves_the_reservations_until_its_thread_is_done():
    """A client that disconnects does not free memory its request's processing still uses."""
    async def main():
        admission, executor = make_admission()
        job = Job("x")
        task = asyncio.ensure_future(admission.process(job, TEXT, await body(admission, 2 * MiB), time.monotonic()))
        await asyncio.get_running_loop().run_in_executor(None, job.started.wait)
        task.cancel()
        await asyncio.sleep(0.05)
        assert admission.bodies.in_use == 2 * MiB and admission.large.in_use == 1
        job.release.set()
        await asyncio.sleep(0.1)
        assert admission.bodies.in_use == admission.large.in_use == 0
        executor.shutdown()

    run(main())


def test_a_caller_gone_as_its_processing_fails_leaves_no_unretrieved_error():
    """A request refused by its processing (e.g. over the context length) whose client left
    just as it failed: the error is dropped quietly. asyncio used to log it with a traceback
    ("Future exception was never retrieved") when the handler was cancelled between the
    error's arrival on the loop and the handler's wake-up."""
    import gc

    class Failing(Job):
        def __call__(self):
            super().__call__()
            raise ValueError("refused")

    async def attempt(admission, yields: int) -> None:
        job = Failing(None)
        task = asyncio.ensure_future(admission.process(job, TEXT, await body(admission, 2 * MiB), time.monotonic()))
        await asyncio.get_running_loop().run_in_executor(None, job.started.wait)
        job.release.set()
        while admission.large.in_use:  # released on the loop once the job has ended, as its error arrives
            await asyncio.sleep(0)
        for _ in range(yields):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises((asyncio.CancelledError, ValueError)):
            await task

    async def main():
        unretrieved = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unretrieved.append(context))
        admission, executor = make_admission()
        # Cancelled after 0-3 turns of the loop: one of them falls between the error's
        # arrival and the handler's wake-up.
        for yields in range(4):
            await attempt(admission, yields)
        gc.collect()
        await asyncio.sleep(0)
        executor.shutdown()
        return unretrieved

    assert run(main()) == []


def test_abort_all_ends_waiting_and_processing_requests():
    async def main():
        admission, executor = make_admission(queue_timeout=10.0)
        job = Job("x")
        processing = asyncio.ensure_future(admission.process(job, TEXT, await body(admission, 2 * MiB),
                                                             time.monotonic()))
        await asyncio.get_running_loop().run_in_executor(None, job.started.wait)
        waiting = asyncio.ensure_future(admission.process(lambda: "y", TEXT, await body(admission, 2 * MiB),
                                                          time.monotonic()))
        await asyncio.sleep(0.05)
        admission.abort_all("the daemon is shutting down")
        for task in (processing, waiting):
            with pytest.raises(ServiceStopping, match="shutting down"):
                await task
        with pytest.raises(ServiceStopping):
            await admission.process(lambda: "z", TEXT, await body(admission, 10), time.monotonic())
        job.release.set()
        executor.shutdown()

    run(main())


def test_draining_refuses_new_requests_and_waits_for_those_in_flight():
    async def main():
        admission, executor = make_admission()
        with admission.track() as entry:
            entry.req_id = "chatcmpl-1"
            admission.start_draining("SIGTERM received")
            with pytest.raises(APIError) as info:
                with admission.track():
                    pass
            assert info.value.status == 503 and "shutting down" in str(info.value)
            assert not await admission.wait_idle(0.05)
        assert await admission.wait_idle(0.05)
        executor.shutdown()

    run(main())


def test_a_body_is_reserved_before_it_is_read_and_one_too_large_is_refused_unread():
    class Content:
        def __init__(self, chunks):
            self.chunks = list(chunks)

        async def readany(self):
            return self.chunks.pop(0) if self.chunks else b""

    class Request:
        def __init__(self, content_length, chunks):
            self.content_length = content_length
            self.content = Content(chunks)

    async def main():
        admission, executor = make_admission(max_body_mb=1, max_inflight_body_mb=2)
        data, reservation = await admission.read_body(Request(None, [b"ab", b"cd"]), time.monotonic())
        assert data == b"abcd" and reservation.amount == 4 == admission.bodies.in_use  # shrunk to what came
        reservation.release()
        unread = Request(2 * MiB, [b"x"])
        with pytest.raises(APIError) as info:
            await admission.read_body(unread, time.monotonic())
        assert info.value.status == 413 and unread.content.chunks == [b"x"]
        with pytest.raises(APIError, match="the limit is 1048576 bytes"):  # no Content-Length, too long
            await admission.read_body(Request(None, [b"x" * MiB, b"y"]), time.monotonic())
        assert admission.bodies.in_use == 0
        executor.shutdown()

    run(main())
