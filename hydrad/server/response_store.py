"""Kept responses of the Responses API (``store``, ``previous_response_id``).

A response is kept when its request asked for it (``store``, true unless sent false, as
OpenAI's default) and it ended with an answer (completed, or incomplete at
``max_output_tokens``): the response object as answered, the input items of its own
request, and the id of the response it followed. A request naming a
``previous_response_id`` continues that conversation: the items of every response of
the chain, oldest first (its input items, then its output items), come before its own
input. ``GET /v1/responses/{id}`` answers the object, ``.../input_items`` the items it
was generated from, and ``DELETE`` forgets it.

A ``background`` response is kept from the moment it is created (``start``: status
``queued``, then ``in_progress`` once it runs) and answered in place when it ends
(``finish``). While it runs it is never evicted, and ``cancel`` (or ``DELETE``) ends it:
the store marks it ``cancelled`` at once and calls ``abort`` with its engine requests'
ids (the daemon fails them in its request table, wherever the process that runs it is).
One created with ``stream`` keeps its stream's events as well (``add_events``, one entry
per event, its index the event's ``sequence_number``), counted in its size, for
``GET /v1/responses/{id}?stream=true`` from any process (``events``).

What is kept lives in the daemon's memory, bounded by ``[server] responses_store_mb``
(``ResponseStore``): past it the least recently used responses go first (a chain in use
is read whole at each turn, so its turns stay). A restart keeps none. The daemon holds
the store; front-end processes reach it over their link (``KeptQuery``), so every
process answers the same.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import OrderedDict
from dataclasses import dataclass

from hydrad.transport.messages import KeptQuery


@dataclass(frozen=True)
class KeptResponse:
    response: dict  # the response object as it was answered
    input_items: list  # the items of its own request's ``input`` (each with an id)
    previous_id: str | None  # the response it continued
    nbytes: int  # its size as JSON, what the bound counts

    @classmethod
    def of(cls, response: dict, input_items: list, previous_id: str | None) -> "KeptResponse":
        nbytes = len(json.dumps(response)) + len(json.dumps(input_items))
        return cls(response, input_items, previous_id, nbytes)


class ResponseGone(LookupError):
    """A response of the chain asked for is not kept (never was, deleted, or evicted)."""

    def __init__(self, response_id: str):
        super().__init__(response_id)
        self.response_id = response_id


class ResponseRunning(LookupError):
    """A response asked for as a finished one is a background response still running."""

    def __init__(self, response_id: str):
        super().__init__(response_id)
        self.response_id = response_id


class CannotCancel(ValueError):
    """``cancel`` of a response that is not a running background response (the message says why)."""


class NotStreamed(LookupError):
    """The events of a response asked for that was not created ``background`` with ``stream``."""

    def __init__(self, response_id: str):
        super().__init__(response_id)
        self.response_id = response_id


class ResponseStore:
    """Kept responses by id, least recently used first out past ``max_bytes`` (background
    responses still running excepted). ``abort(req_ids)`` ends a running background
    response's engine requests (set by the daemon once its request table exists)."""

    def __init__(self, max_bytes: int, abort=None):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.abort = abort
        self._kept: OrderedDict[str, KeptResponse] = OrderedDict()
        # Background responses running: id -> (their engine requests' ids, the front-end
        # process that runs them: None for the daemon's own); and their bytes.
        self._running: dict[str, tuple[tuple[str, ...], int | None]] = {}
        self._running_bytes = 0
        # The stream events of background responses created with ``stream``, and their bytes
        # (in ``nbytes``, and in ``_running_bytes`` while they run).
        self._events: dict[str, list[bytes]] = {}
        self._events_bytes: dict[str, int] = {}
        self._followed: set[str] = set()  # running ones whose events a process read here

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def keep(self, kept: KeptResponse) -> bool:
        """Keep ``kept`` (false: it does not fit, even once every response that may go has
        gone; nothing is evicted then)."""
        response_id = kept.response["id"]
        self._stop_running(response_id)
        events = self._events.pop(response_id, None)  # a streamed one's answer keeps its events
        events_bytes = self._events_bytes.pop(response_id, 0)
        self.nbytes -= events_bytes
        self._forget(response_id)
        if self._running_bytes + kept.nbytes + events_bytes > self.max_bytes:
            return False
        self._evict(kept.nbytes + events_bytes)
        self._kept[response_id] = kept
        self.nbytes += kept.nbytes
        if events is not None:
            self._events[response_id], self._events_bytes[response_id] = events, events_bytes
            self.nbytes += events_bytes
        return True

    def get(self, response_id: str) -> KeptResponse | None:
        kept = self._kept.get(response_id)
        if kept is not None:
            self._kept.move_to_end(response_id)
        return kept

    def delete(self, response_id: str) -> bool:
        """Forget a response (a background one still running is ended first)."""
        self._end_running(response_id)
        return self._forget(response_id)

    def _forget(self, response_id: str) -> bool:
        self._stop_running(response_id)
        self._events.pop(response_id, None)
        self.nbytes -= self._events_bytes.pop(response_id, 0)
        kept = self._kept.pop(response_id, None)
        if kept is None:
            return False
        self.nbytes -= kept.nbytes
        return True

    def _evict(self, room: int) -> None:
        """Forget the least recently used responses that may go until ``room`` more bytes fit
        (as many as there are, where the running ones leave too little)."""
        while self.nbytes + room > self.max_bytes:
            old_id = next((i for i in self._kept if i not in self._running), None)
            if old_id is None:
                return
            self._forget(old_id)

    # -- background responses -----------------------------------------------------------------
    def start(self, kept: KeptResponse, req_ids: tuple[str, ...], owner: int | None = None,
              streamed: bool = False) -> bool:
        """Keep a background response as created (``queued``) and running, its engine requests
        ``req_ids``, run by front end ``owner`` (false: it does not fit beside those running).
        ``streamed``: it keeps its stream's events (``add_events``)."""
        if not self.keep(kept):
            return False
        response_id = kept.response["id"]
        self._running[response_id] = (tuple(req_ids), owner)
        self._running_bytes += kept.nbytes
        if streamed:
            self._events[response_id], self._events_bytes[response_id] = [], 0
        return True

    def add_events(self, response_id: str, events: list[bytes]) -> bool | None:
        """Append a running streamed response's next events; whether a process has read its
        events here while it runs (the one that runs it serves its own followers from its
        own log: these readers are the others). None: it no longer runs (cancelled or
        deleted meanwhile), and nothing is taken. Finished responses make room for them;
        running ones are never evicted, so a store full of running ones holds their events
        past its bound."""
        log = self._events.get(response_id)
        if log is None or response_id not in self._running:
            return None
        size = sum(map(len, events))
        self._evict(size)
        log += events
        self._events_bytes[response_id] += size
        self.nbytes += size
        self._running_bytes += size
        return response_id in self._followed

    def events(self, response_id: str, after: int) -> tuple[list[bytes], bool] | None:
        """A streamed response's events after sequence number ``after``, and whether it has
        ended (no event follows). None: not kept; NotStreamed: not created with ``stream``."""
        if self.get(response_id) is None:
            return None
        log = self._events.get(response_id)
        if log is None:
            raise NotStreamed(response_id)
        running = response_id in self._running
        if running:
            self._followed.add(response_id)
        return log[max(after + 1, 0):], not running

    def progress(self, response_id: str) -> bool:
        """A running background response has started generating: ``in_progress``. False: it
        no longer runs (cancelled or deleted meanwhile), and its generation should stop."""
        if response_id not in self._running:
            return False
        kept = self._kept[response_id]
        self._replace(kept, {**kept.response, "status": "in_progress"})
        return True

    def finish(self, kept: KeptResponse) -> bool:
        """A running background response ended: ``kept`` is its answer. False (dropped): it had
        been cancelled or deleted."""
        if self._stop_running(kept.response["id"]) is None:
            return False
        return self.keep(kept)

    def cancel(self, response_id: str) -> dict | None:
        """End a running background response: it is kept ``cancelled`` (returned), and its
        engine requests are aborted. None: no such response; CannotCancel: not one that runs."""
        kept = self.get(response_id)
        if kept is None:
            return None
        if response_id not in self._running:
            status = kept.response.get("status")
            if not kept.response.get("background"):
                raise CannotCancel("Cannot cancel a synchronous response: only background responses can be "
                                   "cancelled")
            if status == "cancelled":
                return kept.response  # cancelled twice: the same answer
            raise CannotCancel(f"Cannot cancel a response that is already {status}")
        self._end_running(response_id)
        self._replace(kept, {**kept.response, "status": "cancelled"})
        return self._kept[response_id].response

    def orphaned(self, owner: int, reason: str) -> int:
        """Front end ``owner`` is gone, and the background responses it ran with it: each is
        kept ``failed``, saying why. Returns how many."""
        gone = [response_id for response_id, (_, runner) in self._running.items() if runner == owner]
        error = {"code": "server_error", "message": f"the process that ran it exited ({reason})"}
        for response_id in gone:
            self._stop_running(response_id)
            kept = self._kept[response_id]
            self._replace(kept, {**kept.response, "status": "failed", "error": error})
        return len(gone)

    def _end_running(self, response_id: str) -> None:
        """Stop running ``response_id`` and abort its engine requests."""
        req_ids = self._stop_running(response_id)
        if req_ids is not None and self.abort is not None:
            self.abort(req_ids)

    def _stop_running(self, response_id: str) -> tuple[str, ...] | None:
        """No longer count ``response_id`` as running; its engine requests' ids (None: it was not)."""
        running = self._running.pop(response_id, None)
        if running is None:
            return None
        self._followed.discard(response_id)
        self._running_bytes -= self._kept[response_id].nbytes + self._events_bytes.get(response_id, 0)
        return running[0]

    def _replace(self, kept: KeptResponse, response: dict) -> None:
        """The same entry with another response object (its status changed: same size bar a
        few bytes, so counted as before)."""
        self._kept[response["id"]] = KeptResponse(response, kept.input_items, kept.previous_id, kept.nbytes)

    def items(self, response_id: str, with_output: bool) -> list[dict]:
        """The items of the conversation up to ``response_id``: every earlier response's input
        and output items, oldest first, then its own input items, and its output items where
        ``with_output``. ResponseGone names the first response of the chain not kept;
        ResponseRunning says ``response_id`` (with its output asked for) has not ended."""
        if with_output and response_id in self._running:
            raise ResponseRunning(response_id)
        chain = []
        current: str | None = response_id
        while current is not None:
            kept = self.get(current)
            if kept is None or len(chain) > len(self._kept):
                raise ResponseGone(current)
            chain.append(kept)
            current = kept.previous_id
        items: list[dict] = []
        for i, kept in enumerate(reversed(chain)):
            items += kept.input_items
            if with_output or i < len(chain) - 1:
                items += output_as_input(kept.response)
        return items

    # One entry point for the calls of front-end processes (``KeptQuery``; ``owner``: which).
    def answer(self, op: str, arg, owner: int | None = None):
        if op == "keep":
            return self.keep(arg)
        if op == "get":
            kept = self.get(arg)
            return None if kept is None else kept.response
        if op == "delete":
            return self.delete(arg)
        if op == "start":
            kept, req_ids, streamed = arg
            return self.start(kept, req_ids, owner=owner, streamed=streamed)
        if op == "add_events":
            return self.add_events(*arg)
        if op == "progress":
            return self.progress(arg)
        if op == "finish":
            return self.finish(arg)
        try:
            if op in ("items", "inputs"):
                return self.items(arg, with_output=op == "items")
            if op == "cancel":
                return self.cancel(arg)
            if op == "events":
                return self.events(*arg)
        except (ResponseGone, ResponseRunning, CannotCancel, NotStreamed) as e:
            return e  # raised again by the caller's face (it crosses a front end's pipe)
        raise ValueError(f"unknown query {op!r}")


def output_as_input(response: dict) -> list[dict]:
    """A response's output items as the input items of a later turn (messages and calls
    are taken back as they were answered)."""
    return [item for item in response.get("output") or () if item.get("type") in ("message", "function_call")]


class LocalStore:
    """The daemon's own store, behind the interface the API handlers use (``RemoteStore``'s)."""

    def __init__(self, store: ResponseStore):
        self.store = store

    async def call(self, op: str, arg):
        result = self.store.answer(op, arg)
        if isinstance(result, Exception):
            raise result
        return result


class RemoteStore:
    """The daemon's store from a front-end process: ``send`` takes a message to the daemon,
    whose ``KeptAnswer`` comes back through ``answered``."""

    def __init__(self, send, timeout: float = 10.0):
        self._send = send
        self._timeout = timeout
        self._seq = itertools.count()
        self._waiting: dict[int, asyncio.Future] = {}

    async def call(self, op: str, arg):
        seq = next(self._seq)
        waiter = self._waiting[seq] = asyncio.get_running_loop().create_future()
        try:
            self._send(KeptQuery(seq, op, arg))
            result = await asyncio.wait_for(waiter, self._timeout)
        finally:
            self._waiting.pop(seq, None)
        if isinstance(result, Exception):  # ResponseGone, or what failed in the daemon
            raise result
        return result

    def answered(self, seq: int, result) -> None:
        waiter = self._waiting.get(seq)
        if waiter is not None and not waiter.done():
            waiter.set_result(result)

    def fail_all(self, error: Exception) -> None:
        for waiter in self._waiting.values():
            if not waiter.done():
                waiter.set_exception(error)
