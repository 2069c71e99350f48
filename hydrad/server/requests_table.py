"""Daemon-wide request table: where outputs go, which instances hold each request,
and the relay of pull-based migration between instances.

A request enters at one instance; each time a stage finishes on an instance that
does not hold the next one, that instance offers it (``StepOutput.offers``). The
router picks a target holding the next stage, which is sent ``Migrate``; once the
target has pulled the blocks (``StepOutput.pulled``) the source is sent
``Release``. Outputs (first token from the prefill instance, the rest from the
decode instance) all go to the request's one ``RequestSink``, called synchronously
while a step's columns are read, so a step reaches all its requests in one pass. An
abort reaches every instance that may hold a part of the request. When the daemon
stops at once (``fail_all``), every request in flight fails and new ones are refused.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from hydrad.engine.inputs import EngineOutput, MigrationOffer, TokenLogprobs
from hydrad.transport.messages import Abort, Migrate, Release

if TYPE_CHECKING:
    from hydrad.server.client import WorkerClient
    from hydrad.server.router import Router

logger = logging.getLogger("hydrad.migration")


class RequestSink(Protocol):
    """Where one request's outputs go. Called on the event loop, in step order; after
    ``on_finish`` or ``on_error`` nothing more comes."""

    def on_token(self, token_id: int, logprobs: TokenLogprobs | None) -> None: ...
    def on_finish(self, finish_reason: str, stage_times: dict[str, float] | None) -> None: ...
    def on_error(self, error: Exception) -> None: ...


class ServiceStopping(RuntimeError):
    """The daemon is stopping at once: the request failed or was refused."""


class RequestTable:
    def __init__(self) -> None:
        self.sinks: dict[str, RequestSink] = {}
        self.holders: dict[str, set[WorkerClient]] = {}
        self.router: Router | None = None
        self.stopping_reason: str | None = None

    def __len__(self) -> int:
        """Requests in flight (one migrating between instances counts once)."""
        return len(self.sinks)

    def held_by(self, client: WorkerClient) -> int:
        return sum(1 for holders in self.holders.values() if client in holders)

    def open(self, req_id: str, entry: WorkerClient, sink: RequestSink) -> None:
        if self.stopping_reason is not None:
            raise ServiceStopping(self.stopping_reason)
        self.sinks[req_id] = sink
        self.holders[req_id] = {entry}

    def deliver_output(self, output: EngineOutput) -> None:
        """Hand one step's columns to the requests' sinks, in one pass."""
        sinks = self.sinks
        logprobs = output.logprobs
        token_ids = output.token_ids
        for i, req_id in enumerate(output.req_ids):
            sink = sinks.get(req_id)
            if sink is not None:  # else aborted by the daemon while the step ran
                sink.on_token(token_ids[i], logprobs[i] if logprobs is not None else None)
        for end in output.finished:
            sink = sinks.get(end.req_id)
            if sink is not None:
                self._close(end.req_id)
                sink.on_finish(end.finish_reason, end.stage_times)

    def fail(self, req_id: str, error: Exception) -> None:
        """End a request with an error; the instances still holding it drop it."""
        sink = self.sinks.get(req_id)
        if sink is not None:
            self.abort(req_id)
            sink.on_error(error)

    def fail_all(self, reason: str) -> int:
        """Fail every request in flight with ``ServiceStopping(reason)`` and refuse new
        ones from now on; returns how many failed."""
        self.stopping_reason = reason
        req_ids = list(self.sinks)
        for req_id in req_ids:
            self.fail(req_id, ServiceStopping(reason))
        return len(req_ids)

    def abort(self, req_id: str) -> None:
        self.sinks.pop(req_id, None)
        for client in self.holders.pop(req_id, ()):
            client.send_quietly(Abort((req_id,)))

    def _close(self, req_id: str) -> None:
        del self.sinks[req_id]
        self.holders.pop(req_id, None)

    # -- migration relay -----------------------------------------------------------------
    def on_offer(self, source: WorkerClient, offer: MigrationOffer) -> None:
        if offer.req_id not in self.sinks:  # gone meanwhile: the source must not keep it
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
