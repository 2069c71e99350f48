"""The request table: where each request's outputs go, over the migration relay.

A request enters at one instance; each time a stage finishes on an instance that
does not hold the next one, that instance offers it and the relay hands it on
(``hydrad.cluster.relay``). Outputs (first token from the prefill instance, the rest
from the decode instance) all go to the request's one ``RequestSink``, called
synchronously while a step's columns are read, so a step reaches all its requests in
one pass. When the daemon stops at once (``fail_all``), every request in flight fails
and new ones are refused. When an instance dies, the table runs its requests again
from the tokens they had (``lost``): it keeps each request as sent, and its tokens, for
its whole life. A request that loses a second instance fails, and its content (prompt
tokens and images) is refused for a while (``Quarantine``): a client resending a request
that takes workers down would otherwise put them in a crash loop, and the daemon with
them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from array import array
from collections import OrderedDict
from typing import Protocol

from hydrad.cluster.relay import Instance, MigrationRelay
from hydrad.cluster.router import NoInstanceAvailable, Router, entry_stage
from hydrad.engine.inputs import EngineOutput, EngineRequest, TokenLogprobs
from hydrad.engine.migration import MigrationOffer, Pulled
from hydrad.errors import RequestError

logger = logging.getLogger("hydrad.migration")


class RequestSink(Protocol):
    """Where one request's outputs go. Called on the event loop, in step order; after
    ``on_finish`` or ``on_error`` nothing more comes."""

    def on_token(self, token_id: int, logprobs: TokenLogprobs | None) -> None: ...
    def on_finish(self, finish_reason: str, stage_times: dict[str, float] | None,
                  num_cached_tokens: int = 0) -> None: ...
    def on_error(self, error: Exception) -> None: ...


class ServiceStopping(RuntimeError):
    """The daemon is stopping at once: the request failed or was refused."""


class RequestCancelled(Exception):
    """The client cancelled the request (a background response's ``cancel``): it ends as an
    abort, not as a failure."""


class RequestQuarantined(RequestError):
    """The request's content was in flight when two workers died: refused for a while (400)."""


def content_digest(request: EngineRequest) -> bytes:
    """What a request asks the model: its prompt tokens and its images (their digests)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(array("q", request.prompt_token_ids).tobytes())
    for image in request.images:
        h.update(image.digest() or repr((image.num_patches, image.length)).encode())
    return h.digest()


class Quarantine:
    """Contents of requests that were in flight when two workers died (the one a request
    runs on, then the one it ran again on), refused for ``seconds`` since the second death;
    at most ``MAX_ENTRIES``, the oldest dropped first. Empty, it costs ``open`` one check."""

    MAX_ENTRIES = 1024

    def __init__(self, seconds: float, clock=time.monotonic):
        self.seconds = seconds
        self.clock = clock
        self._until: OrderedDict[bytes, float] = OrderedDict()
        self.num_refused = 0

    def __len__(self) -> int:
        self._expire()
        return len(self._until)

    def add(self, digest: bytes) -> None:
        if self.seconds <= 0:
            return
        self._until.pop(digest, None)
        self._until[digest] = self.clock() + self.seconds
        while len(self._until) > self.MAX_ENTRIES:
            self._until.popitem(last=False)

    def check(self, request: EngineRequest) -> None:
        """Raise ``RequestQuarantined`` if ``request``'s content is refused now."""
        if not self._until:
            return
        self._expire()
        until = self._until.get(content_digest(request))
        if until is not None:
            self.num_refused += 1
            raise RequestQuarantined(
                f"this request was being processed when two workers failed, one after the other; the same "
                f"request is refused for {until - self.clock():.0f} s more", code="request_quarantined")

    def _expire(self) -> None:
        now = self.clock()
        while self._until and next(iter(self._until.values())) <= now:
            self._until.popitem(last=False)


class _Death:
    """An instance's death, and the requests that lost it after losing another, until the
    supervisor has judged whether a request may have caused it (``RequestTable.judge``)."""

    __slots__ = ("instance_id", "by_request", "second_losses")

    def __init__(self, instance_id: int):
        self.instance_id = instance_id
        # False: killed from outside (an operator's SIGKILL or SIGTERM); None: not judged yet.
        self.by_request: bool | None = None
        # (request id, content digest, the death it lost first) of each request that lost two.
        self.second_losses: list[tuple[str, bytes, _Death]] = []


class _Kept:
    """A request as sent, and the tokens it has had since: enough to run it again."""

    __slots__ = ("request", "token_ids", "pixels")

    def __init__(self, request: EngineRequest, pixels: tuple[int, ...] | None):
        self.request = request
        self.token_ids: list[int] = []
        # The pixel tensors it holds a reference on in the table's count (``RequestTable._pixels``);
        # None: kept until its first token only (they did not fit).
        self.pixels = pixels


def pixel_tensors(request: EngineRequest) -> list[tuple[int, int]]:
    """(address, bytes) of each of a request's preprocessed images. The ``n`` choices of one
    HTTP request share their images' tensors: one address."""
    return [(pv.data_ptr(), pv.numel() * pv.element_size())
            for image in request.images if (pv := image.pixel_values) is not None]


def _token_range(counts: list[int]) -> str:
    if not counts:
        return ""
    low, high = min(counts), max(counts)
    return f" ({low} tokens)" if low == high else f" ({low}-{high} tokens)"


class RequestTable:
    def __init__(self, router: Router, rerun_image_bytes: int = 1 << 30, quarantine_seconds: float = 300.0):
        self.router = router
        self.relay = MigrationRelay(router)
        self.sinks: dict[str, RequestSink] = {}
        # The instances each request has been on: its entry, then each migration's target.
        self.routes: dict[str, list[int]] = {}
        self.stopping_reason: str | None = None
        # While an instance is being restarted (or a deployment changed), an offer whose next
        # stage has no live instance waits here instead of failing: (source, offer).
        self.hold_offers = False
        self._parked: list[tuple[Instance, MigrationOffer]] = []
        # New requests whose entry stage has no live instance while offers are held wait on
        # this (``wait_for_stage``); set, and replaced, whenever the parked offers are retried.
        self._restart_ended: asyncio.Future | None = None
        # Each request as sent and the tokens it has had (``_Kept``): if an instance holding it
        # dies, it runs again (once) on a live instance or on the restarted one, from the tokens
        # it had: its client sees a pause. A request's pixels are kept for its whole life only
        # while the kept ones total at most ``rerun_image_bytes``; past that, a request with
        # images is kept until its first token only (until then its pixels are held anyway).
        # A tensor shared by several requests (the ``n`` choices of one HTTP request) counts
        # once: address -> [bytes, requests holding it]. An address held here is a live
        # tensor (a kept request refers to it), so it cannot be reused meanwhile.
        self.rerun_image_bytes = rerun_image_bytes
        self.kept_image_bytes = 0
        self._pixels: dict[int, list[int]] = {}
        self._kept: dict[str, _Kept] = {}
        self._run_again: set[str] = set()
        # The requests running again: their content digest and the death they lost first,
        # refused for a while should they lose that instance too and neither death be a kill
        # from outside. The deaths the supervisor has not judged yet, by instance.
        self._suspects: dict[str, tuple[bytes, _Death]] = {}
        self._deaths: dict[int, _Death] = {}
        self.quarantine = Quarantine(quarantine_seconds)
        self._parked_requests: list[tuple[EngineRequest, RequestSink]] = []
        # Requests failed because the instance holding them died, and those run again instead.
        self.num_lost = 0
        self.num_run_again = 0

    def __len__(self) -> int:
        """Requests in flight (one migrating between instances counts once)."""
        return len(self.sinks)

    def held_by(self, instance: Instance) -> int:
        return self.relay.held_by(instance)

    def open(self, req_id: str, entry: Instance, sink: RequestSink, request: EngineRequest | None = None) -> None:
        """``request``: what was sent, kept (with the tokens that follow) to run it again
        should ``entry`` or an instance it goes on to die."""
        if self.stopping_reason is not None:
            raise ServiceStopping(self.stopping_reason)
        if request is not None and req_id not in self._run_again:
            self.quarantine.check(request)
            self._kept[req_id] = _Kept(request, self._hold_pixels(request))
        self.sinks[req_id] = sink
        self.routes[req_id] = [entry.instance_id]
        self.relay.open(req_id, entry)

    def deliver_output(self, output: EngineOutput) -> None:
        """Hand one step's columns to the requests' sinks, in one pass."""
        sinks = self.sinks
        logprobs = output.logprobs
        token_ids = output.token_ids
        kept = self._kept
        for i, req_id in enumerate(output.req_ids):
            sink = sinks.get(req_id)
            if sink is not None:  # else aborted by the daemon while the step ran
                token_id = token_ids[i]
                if kept and (k := kept.get(req_id)) is not None:
                    if k.pixels is None:
                        del kept[req_id]
                    else:
                        k.token_ids.append(token_id)
                sink.on_token(token_id, logprobs[i] if logprobs is not None else None)
        for end in output.finished:
            self._forget(end.req_id)
            sink = sinks.pop(end.req_id, None)
            if sink is not None:
                self.relay.close(end.req_id)
                sink.on_finish(end.finish_reason, end.stage_times, end.num_cached_tokens)
            self.routes.pop(end.req_id, None)  # after on_finish, which may read it

    def _hold_pixels(self, request: EngineRequest) -> tuple[int, ...] | None:
        """Count ``request``'s pixels as kept, those it shares with a kept request once; the
        addresses it holds, or None if the new ones do not fit in ``rerun_image_bytes``."""
        tensors = pixel_tensors(request)
        if not tensors:
            return ()
        pixels = self._pixels
        new = sum(size for address, size in dict(tensors).items() if address not in pixels)
        if new and self.kept_image_bytes + new > self.rerun_image_bytes:
            return None
        for address, size in tensors:
            held = pixels.get(address)
            if held is None:
                pixels[address] = [size, 1]
                self.kept_image_bytes += size
            else:
                held[1] += 1
        return tuple(address for address, _ in tensors)

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
        self._wake_waiters()
        self._parked_requests.clear()  # their sinks are in the table: they fail below
        req_ids = list(self.sinks)
        for req_id in req_ids:
            self.fail(req_id, ServiceStopping(reason))
        return len(req_ids)

    def abort(self, req_id: str) -> None:
        """End a request everywhere (client gone, stop string): no output follows."""
        self._forget(req_id)
        self.sinks.pop(req_id, None)
        self.routes.pop(req_id, None)
        self.relay.abort((req_id,))

    # -- migration, through the relay -------------------------------------------------------------
    def on_offer(self, source: Instance, offer: MigrationOffer) -> None:
        try:
            target = self.relay.on_offer(source, offer)
            route = self.routes.get(offer.req_id)
            if target is not None and route is not None:
                route.append(target.instance_id)
        except NoInstanceAvailable as e:
            if self.hold_offers:
                logger.info("request %s waits for an instance holding stage %s", offer.req_id, offer.next_stage)
                self._parked.append((source, offer))
                return
            logger.error("request %s: no target for stage %s: %s", offer.req_id, offer.next_stage, e)
            self.fail(offer.req_id, e)

    async def wait_for_stage(self, stage: str, timeout: float) -> None:
        """While an instance is being restarted (offers are held) and no live one takes
        ``stage``, wait for the restart, at most ``timeout`` seconds: a new request that would
        enter there then goes on instead of failing. Returns at once otherwise; the caller
        routes as usual (and fails if still no instance takes the stage)."""
        deadline = time.monotonic() + timeout
        while self.hold_offers and self.stopping_reason is None and not self.router.can_take(stage):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self._restart_ended is None or self._restart_ended.done():
                self._restart_ended = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(asyncio.shield(self._restart_ended), left)
            except asyncio.TimeoutError:
                return

    def _wake_waiters(self) -> None:
        if self._restart_ended is not None and not self._restart_ended.done():
            self._restart_ended.set_result(None)

    def _forget(self, req_id: str) -> None:
        """``req_id`` ended, or runs again (and is not run a second time)."""
        k = self._kept.pop(req_id, None)
        if k is not None and k.pixels:
            pixels = self._pixels
            for address in k.pixels:
                held = pixels[address]
                held[1] -= 1
                if not held[1]:
                    del pixels[address]
                    self.kept_image_bytes -= held[0]
        if self._run_again:
            self._run_again.discard(req_id)
            self._suspects.pop(req_id, None)

    def retry_parked(self) -> None:
        """Hand the waiting offers on again (an instance came back); those that still find
        no target fail unless offers are held. New requests waiting for a stage look again,
        and so do requests waiting to run again."""
        self._wake_waiters()
        waiting, self._parked_requests = self._parked_requests, []
        for request, sink in waiting:
            if self.sinks.get(request.req_id) is sink:  # else its client left meanwhile
                self._place_again(request, sink, NoInstanceAvailable(
                    f"no live instance can take stage {entry_stage(bool(request.images))}"))
        parked, self._parked = self._parked, []
        for source, offer in parked:
            if source.alive:
                self.on_offer(source, offer)
            else:  # the source died meanwhile: its requests have failed already
                self.fail(offer.req_id, NoInstanceAvailable(f"instance {source.instance_id} is gone"))

    def on_pulled(self, target: Instance, pulled: Pulled) -> None:
        self.relay.on_pulled(target, pulled)

    def lost(self, instance: Instance, error: Exception) -> None:
        """An instance died: every request it held runs again, once, from the tokens it had
        (a request that takes down a second instance fails, and its content is quarantined
        once ``judge`` says neither death was a kill from outside), on a live instance of its
        first stage or on the restarted one; the others drop their parts. Those it was about
        to pull go to another target (their source still has the blocks); a request not kept
        whole (its pixels past ``rerun_image_bytes``, streaming) fails."""
        again: list[int] = []  # the tokens each request run again had
        pulled_elsewhere = failed = 0
        death = _Death(instance.instance_id)
        if self.quarantine.seconds > 0:
            earlier = self._deaths.pop(instance.instance_id, None)
            if earlier is not None:  # never judged (its process outlived the wait): counted as possible
                self._judge(earlier, True, "not judged")
            self._deaths[instance.instance_id] = death
        for req_id in self.relay.requests_held_by(instance):
            handed_back = self.relay.take_back(req_id, instance)
            kept = self._kept.get(req_id)
            sink = self.sinks.get(req_id)
            if handed_back is not None:
                pulled_elsewhere += 1
                self.on_offer(*handed_back)
            elif kept is not None and sink is not None:
                self.relay.abort((req_id,))  # the live instances drop their parts
                self._forget(req_id)
                self._run_again.add(req_id)
                if self.quarantine.seconds > 0:
                    self._suspects[req_id] = (content_digest(kept.request), death)
                self.num_run_again += 1
                request = kept.request
                if kept.token_ids:
                    request = dataclasses.replace(request, output_token_ids=kept.token_ids)
                logger.info("request %s lost instance %d after %d tokens: running it again from there", req_id,
                            instance.instance_id, len(kept.token_ids))
                if self._place_again(request, sink, error):
                    again.append(len(kept.token_ids))
                else:
                    failed += 1
            else:
                suspect = self._suspects.pop(req_id, None)
                if suspect is not None and sink is not None:
                    death.second_losses.append((req_id, *suspect))
                    logger.warning("request %s lost a second instance (%d): failed", req_id, instance.instance_id)
                self.num_lost += sink is not None
                failed += sink is not None
                self.fail(req_id, error)
        if again or pulled_elsewhere or failed:
            # One line however many requests it held (each is named at info level).
            logger.warning(
                "instance %d held %d request(s) when it died: %d run again from the tokens they had%s, %d to be "
                "pulled by another instance, %d failed%s", instance.instance_id, len(again) + pulled_elsewhere + failed,
                len(again), _token_range(again), pulled_elsewhere, failed,
                f" ({len(death.second_losses)} of them after losing another)" if death.second_losses else "")

    def judge(self, instance_id: int, by_request: bool, how: str) -> None:
        """Whether a request may have caused instance ``instance_id``'s latest death (False: a
        kill from outside, ``how``). The requests that lost it after losing another are then
        quarantined, unless either death was such a kill: a request that crashes workers
        would otherwise crash-loop them as its client resends it, while one that merely was
        on two workers an operator killed is sent again as any other."""
        death = self._deaths.pop(instance_id, None)
        if death is not None:
            self._judge(death, by_request, how)

    def _judge(self, death: _Death, by_request: bool, how: str) -> None:
        instance_id = death.instance_id
        death.by_request = by_request
        refused = [(req_id, digest) for req_id, digest, first in death.second_losses
                   if by_request and first.by_request is not False]
        for _, digest in refused:
            self.quarantine.add(digest)
        if refused:
            logger.warning("%d request(s) lost instance %d (%s) after losing another: the same request(s) are "
                           "refused for %g s (%s)", len(refused), instance_id, how, self.quarantine.seconds,
                           ", ".join(req_id for req_id, _ in refused[:5]) + (", ..." if len(refused) > 5 else ""))
        spared = len(death.second_losses) - len(refused)
        if spared:
            logger.info("%d request(s) lost instance %d (%s) after losing another; not refused: %s", spared,
                        instance_id, how, "it was killed from outside" if not by_request
                        else "their first instance was killed from outside")

    def _place_again(self, request: EngineRequest, sink: RequestSink, error: Exception) -> bool:
        """Send a request that lost its instance to a live one; while one is being restarted
        and none takes its first stage, it waits for the restart; else it fails with ``error``
        (False)."""
        try:
            instance = self.router.select(has_images=bool(request.images), request=request)
            instance.add_request(request, sink)  # opens it here again
        except NoInstanceAvailable:
            if self.hold_offers and self.stopping_reason is None:
                self._parked_requests.append((request, sink))
                return True
            self._drop(request.req_id, sink, error)
            return False
        except Exception as e:  # the chosen worker just went, the daemon stopping
            self._drop(request.req_id, sink, e)
            return False
        return True

    def _drop(self, req_id: str, sink: RequestSink, error: Exception) -> None:
        self.num_lost += 1
        self.abort(req_id)
        sink.on_error(error)
