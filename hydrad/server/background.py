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

from hydrad.cluster.requests import RequestCancelled
from hydrad.server.errors import APIError, exception_status
from hydrad.server.responses import ResponsesFormat, ResponsesRequest, kept_response_of
from hydrad.server.serving import whole_body

logger = logging.getLogger("hydrad.server")


class BackgroundResponses:
    """The background responses this process runs."""

    def __init__(self, kept):
        self.kept = kept  # the store's face here (``LocalStore`` or ``RemoteStore``)
        self.tasks: set[asyncio.Task] = set()

    async def start(self, engine, req: ResponsesRequest, fmt: ResponsesFormat, prepared, arrival: float,
                    held: contextlib.ExitStack) -> dict:
        """Keep the response as created and start generating it; returns the response object
        to answer now. ``held``: what the request holds until its answer ends (taken over once
        the response is kept)."""
        created = fmt.response("queued", [], None)
        req_ids = tuple(request.req_id for request in prepared.requests)
        if not await self.kept.call("start", (kept_response_of(req, created), req_ids)):
            raise APIError(503, "background responses still running fill the response store "
                           "(server.responses_store_mb): retry once some have ended", "background",
                           "responses_store_full")
        task = asyncio.create_task(self._run(engine, req, fmt, prepared, arrival, held.pop_all()),
                                   name=f"background {fmt.req_id}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return created

    async def _run(self, engine, req: ResponsesRequest, fmt: ResponsesFormat, prepared, arrival: float,
                   held: contextlib.ExitStack) -> None:
        """Generate, then answer in the store whatever ended it (the store drops the answer of
        a response cancelled or deleted meanwhile)."""
        final = None
        with held:
            try:
                await engine.wait_for_entry(prepared.requests, arrival)
                async with engine.generate(prepared, arrival, req.user) as outputs:
                    if not await self.kept.call("progress", fmt.req_id):
                        return  # cancelled or deleted before it ran: leaving aborts it
                    final = await whole_body(fmt, outputs)
            except asyncio.CancelledError:  # the process stops: the store goes with the daemon
                raise
            except RequestCancelled:
                return  # the store has it cancelled already
            except Exception as e:
                status = exception_status(e)
                if status >= 500:
                    logger.warning("background response %s failed: %s", fmt.req_id, e)
                final = fmt.failed(status, e, [])
            try:
                await self.kept.call("finish", kept_response_of(req, final))
            except Exception as e:
                logger.warning("background response %s: its answer was not kept: %s", fmt.req_id, e)

    async def stop(self) -> None:
        """End every task still running (the process stops; a drain does not wait for them)."""
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
