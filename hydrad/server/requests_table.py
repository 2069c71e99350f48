"""Daemon-wide request table: where outputs go, which instances hold each request,
and the relay of pull-based migration between instances.

A request enters at one instance; each time a stage finishes on an instance that
does not hold the next one, that instance offers it (``StepOutput.offers``). The
router picks a target holding the next stage, which is sent ``Migrate``; once the
target has pulled the blocks (``StepOutput.pulled``) the source is sent
``Release``. Outputs (first token from the prefill instance, the rest from the
decode instance) all land in the request's one queue. An abort reaches every
instance that may hold a part of the request. When the daemon stops at once
(``fail_all``), every request in flight fails and new ones are refused.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from hydrad.engine.inputs import EngineOutput, MigrationOffer, RequestDelta
from hydrad.transport.messages import Abort, Migrate, Release

if TYPE_CHECKING:
    from hydrad.server.client import WorkerClient
    from hydrad.server.router import Router

logger = logging.getLogger("hydrad.migration")

RequestQueue = asyncio.Queue  # items: RequestDelta, or the exception that ended the request


class ServiceStopping(RuntimeError):
    """The daemon is stopping at once: the request failed or was refused."""


class RequestTable:
    def __init__(self) -> None:
        self.queues: dict[str, RequestQueue] = {}
        self.holders: dict[str, set[WorkerClient]] = {}
        self.router: Router | None = None
        self.stopping_reason: str | None = None

    def __len__(self) -> int:
        """Requests in flight (one migrating between instances counts once)."""
        return len(self.queues)

    def held_by(self, client: WorkerClient) -> int:
        return sum(1 for holders in self.holders.values() if client in holders)

    def open(self, req_id: str, entry: WorkerClient) -> RequestQueue:
        if self.stopping_reason is not None:
            raise ServiceStopping(self.stopping_reason)
        queue: RequestQueue = asyncio.Queue()
        self.queues[req_id] = queue
        self.holders[req_id] = {entry}
        return queue

    def deliver(self, delta: RequestDelta) -> None:
        queue = self.queues.get(delta.req_id)
        if queue is None:  # aborted by the daemon while the step ran
            return
        if delta.finish_reason is not None:
            self._close(delta.req_id)
        queue.put_nowait(delta)

    def deliver_output(self, output: EngineOutput) -> None:
        """Hand one step's columns to the requests' queues."""
        finished = {f.req_id: f for f in output.finished} if output.finished else {}
        logprobs = output.logprobs
        for i, req_id in enumerate(output.req_ids):
            end = finished.pop(req_id, None) if finished else None
            self.deliver(RequestDelta(
                req_id, [output.token_ids[i]], end.finish_reason if end else None,
                [logprobs[i]] if logprobs is not None and logprobs[i] is not None else None,
                end.stage_times if end else None,
            ))
        for end in finished.values():  # ended without a new token (aborted)
            self.deliver(RequestDelta(end.req_id, [], end.finish_reason, None, end.stage_times))

    def fail(self, req_id: str, error: Exception) -> None:
        """End a request with an error; the instances still holding it drop it."""
        queue = self.queues.get(req_id)
        if queue is not None:
            self.abort(req_id)
            queue.put_nowait(error)

    def fail_all(self, reason: str) -> int:
        """Fail every request in flight with ``ServiceStopping(reason)`` and refuse new
        ones from now on; returns how many failed."""
        self.stopping_reason = reason
        req_ids = list(self.queues)
        for req_id in req_ids:
            self.fail(req_id, ServiceStopping(reason))
        return len(req_ids)

    def abort(self, req_id: str) -> None:
        self.queues.pop(req_id, None)
        for client in self.holders.pop(req_id, ()):
            client.send_quietly(Abort((req_id,)))

    def _close(self, req_id: str) -> None:
        del self.queues[req_id]
        self.holders.pop(req_id, None)

    # -- migration relay -----------------------------------------------------------------
    def on_offer(self, source: WorkerClient, offer: MigrationOffer) -> None:
        if offer.req_id not in self.queues:  # gone meanwhile: the source must not keep it
            source.send_quietly(Release((offer.req_id,)))
            return
        try:
            target = self.router.select_stage(offer.next_stage)
        except Exception as e:  # no live instance holds the next stage
            logger.error("request %s: no target for stage %s: %s", offer.req_id, offer.next_stage, e)
            self.fail(offer.req_id, e)
            return
        self.holders[offer.req_id].add(target)
        target.send_quietly(Migrate(offer))

    def on_pulled(self, target: WorkerClient, req_id: str, source_id: int) -> None:
        holders = self.holders.get(req_id)
        source = next((c for c in self.router.instances if c.instance_id == source_id), None)
        if source is None:
            return
        if holders is not None:
            holders.discard(source)
        source.send_quietly(Release((req_id,)))

    def lost(self, client: WorkerClient, error: Exception) -> None:
        """A worker died: every request it held fails."""
        for req_id in [r for r, holders in self.holders.items() if client in holders]:
            self.fail(req_id, error)
