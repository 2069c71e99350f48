"""Kept responses of the Responses API (``store``, ``previous_response_id``).

A response is kept when its request asked for it (``store``, true unless sent false, as
OpenAI's default) and it ended with an answer (completed, or incomplete at
``max_output_tokens``): the response object as answered, the input items of its own
request, and the id of the response it followed. A request naming a
``previous_response_id`` continues that conversation: the items of every response of
the chain, oldest first (its input items, then its output items), come before its own
input. ``GET /v1/responses/{id}`` answers the object, ``.../input_items`` the items it
was generated from, and ``DELETE`` forgets it.

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


class ResponseStore:
    """Kept responses by id, least recently used first out past ``max_bytes``."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._kept: OrderedDict[str, KeptResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, kept: KeptResponse) -> bool:
        """Keep ``kept`` (false: larger than the whole bound, not kept)."""
        response_id = kept.response["id"]
        self.delete(response_id)
        if kept.nbytes > self.max_bytes:
            return False
        while self.nbytes + kept.nbytes > self.max_bytes:
            _, old = self._kept.popitem(last=False)
            self.nbytes -= old.nbytes
        self._kept[response_id] = kept
        self.nbytes += kept.nbytes
        return True

    def get(self, response_id: str) -> KeptResponse | None:
        kept = self._kept.get(response_id)
        if kept is not None:
            self._kept.move_to_end(response_id)
        return kept

    def delete(self, response_id: str) -> bool:
        kept = self._kept.pop(response_id, None)
        if kept is None:
            return False
        self.nbytes -= kept.nbytes
        return True

    def items(self, response_id: str, with_output: bool) -> list[dict]:
        """The items of the conversation up to ``response_id``: every earlier response's input
        and output items, oldest first, then its own input items, and its output items where
        ``with_output``. ResponseGone names the first response of the chain not kept."""
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

    # One entry point for the calls of front-end processes (``KeptQuery``).
    def answer(self, op: str, arg):
        if op == "keep":
            return self.keep(arg)
        if op == "get":
            kept = self.get(arg)
            return None if kept is None else kept.response
        if op == "delete":
            return self.delete(arg)
        if op in ("items", "inputs"):
            try:
                return self.items(arg, with_output=op == "items")
            except ResponseGone as e:
                return e
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
        if isinstance(result, ResponseGone):
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
