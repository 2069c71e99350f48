"""Streamed response bodies, on a recording stand-in for aiohttp's StreamResponse."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from hydrad.cluster.requests import ServiceStopping
from hydrad.cluster.worker_client import WorkerLost
from hydrad.server import serving
from hydrad.server.engine_client import Output
from hydrad.server.protocol import parse_chat_request
from hydrad.server.serving import ResponseFormat, respond_stream


class RecordingResponse:
    """Keeps the SSE payloads written; after ``fail_after`` writes the client is gone."""

    def __init__(self, fail_after: int | None = None):
        self.events: list = []
        self.fail_after = fail_after
        self.headers: dict = {}

    async def write(self, data: bytes) -> None:
        if self.fail_after is not None and len(self.events) >= self.fail_after:
            raise ConnectionResetError("Cannot write to closing transport")
        for event in data.decode().split("\n\n"):
            payload = event.removeprefix("data: ").strip()
            if payload:
                self.events.append(payload if payload == "[DONE]" else json.loads(payload))


class Outputs:
    """A stand-in for ``RequestStream``: one completion, one output per batch."""

    def __init__(self, outs: list[Output], error: Exception | None = None):
        self.outs = outs
        self.error = error  # raised once the outputs are taken
        self.num_taken = 0
        self.choices = [None]
        self.num_prompt_tokens = 5
        self.num_cached_tokens = 4

    @property
    def num_output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outs[: self.num_taken])

    def __aiter__(self):
        return self

    async def __anext__(self) -> list[Output]:
        if self.num_taken == len(self.outs):
            if self.error is not None:
                raise self.error
            raise StopAsyncIteration
        self.num_taken += 1
        return [self.outs[self.num_taken - 1]]


def out(text, token, finish=None, n=0):
    return Output(0, text, [token], finish, None, n)


OUTS = [out("Hel", 1, None, 1), out("lo", 2, None, 2), out("!", 3, "length", 3)]


def stream(response: RecordingResponse, outputs: Outputs, monkeypatch, continuous_usage: bool = False):
    async def open_event_stream(request):
        return response

    monkeypatch.setattr(serving, "open_event_stream", open_event_stream)
    req = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "stream": True,
                              "stream_options": {"include_usage": True,
                                                 "continuous_usage_stats": continuous_usage}})
    fmt = ResponseFormat(True, "chatcmpl-1", "m", return_token_ids=False)
    # No transport: every output is written by the handler (the direct path: test_engine_client).
    return asyncio.run(respond_stream(SimpleNamespace(transport=None), fmt, req, outputs))


def test_chunk_shapes_usage_and_done(monkeypatch):
    response = RecordingResponse()
    assert stream(response, Outputs(OUTS), monkeypatch) is response
    *chunks, usage, done = response.events
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": "Hel"},
                                                          {"content": "lo"}, {"content": "!"}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 5, "completion_tokens": 3,
                                                         "total_tokens": 8,
                                                         "prompt_tokens_details": {"cached_tokens": 4}}
    assert done == "[DONE]"


@pytest.mark.parametrize("fail_after", [1, 3])  # mid-stream, at the end (the usage chunk and [DONE]: one write)
def test_client_gone_ends_the_handler_quietly(monkeypatch, fail_after):
    """No exception escapes to aiohttp (which would log a traceback and try a 500);
    the caller's ``generate`` context then aborts the request."""
    response, outputs = RecordingResponse(fail_after), Outputs(OUTS)
    assert stream(response, outputs, monkeypatch) is response
    assert len(response.events) == fail_after
    assert outputs.num_taken == min(fail_after + 1, len(OUTS))


def test_every_token_gets_a_chunk_even_without_text(monkeypatch):
    """A special token or part of a character has no text yet; its chunk still goes out, with
    empty content, so clients that time chunks see one chunk per token."""
    outs = [out("", 7, None, 1), out("a", 8, None, 2), out("", 9, None, 3), out("", 10, None, 4),
            out("\u00e9", 11, "length", 5)]
    response = RecordingResponse()
    stream(response, Outputs(outs), monkeypatch)
    chunks = [e for e in response.events if e != "[DONE]" and e["choices"]]
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": ""}, {"content": "a"}, {"content": ""}, {"content": ""},
        {"content": "\u00e9"}]


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(monkeypatch):
    response = RecordingResponse()
    stream(response, Outputs(OUTS), monkeypatch, continuous_usage=True)
    *chunks, final, done = response.events
    assert [c["usage"] for c in chunks] == [
        {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n,
         "prompt_tokens_details": {"cached_tokens": 4}} for n in (1, 2, 3)]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 3 and done == "[DONE]"


def test_a_chunks_usage_counts_the_tokens_up_to_it_when_several_are_written_at_once(monkeypatch):
    """A writer that falls behind takes several tokens in one batch; the stream has all of
    them by then, but each chunk counts only those up to it."""

    class AllAtOnce(Outputs):
        async def __anext__(self) -> list[Output]:
            if self.num_taken == len(self.outs):
                raise StopAsyncIteration
            self.num_taken = len(self.outs)
            return list(self.outs)

    response = RecordingResponse()
    stream(response, AllAtOnce(OUTS), monkeypatch, continuous_usage=True)
    *chunks, final, done = response.events
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3]
    assert final["usage"]["completion_tokens"] == 3


def test_text_that_some_readers_take_for_a_line_break_is_escaped(monkeypatch):
    """U+2028, U+0085, form feed and the like inside a token's text must not split the
    event: each ``data:`` line parses on its own even when split by ``str.splitlines``."""
    weird = "a\u2028b\x85c\x0cd\x1ce\u2029f\r"
    response = RecordingResponse()
    stream(response, Outputs([out(weird, 1, None, 1), out(weird, 2, "length", 2)]), monkeypatch)

    class Raw(RecordingResponse):
        async def write(self, data: bytes) -> None:
            self.events += [line for line in data.decode().splitlines() if line]

    raw = Raw()
    stream(raw, Outputs([out(weird, 1, None, 1), out(weird, 2, "length", 2)]), monkeypatch)
    for line in raw.events:
        assert line.startswith("data: ")
        payload = line.removeprefix("data: ")
        if payload != "[DONE]":
            json.loads(payload)
    assert [e["choices"][0]["delta"]["content"] for e in response.events[:2]] == [weird, weird]


@pytest.mark.parametrize("error, finish_reason, status", [
    (ServiceStopping("the daemon is shutting down: the request was still running after "
                     "server.shutdown_timeout (2 s)"), "abort", 503),
    (WorkerLost("worker 1 (cpu, PD) exited"), "error", 503),
])
def test_a_stream_ended_early_has_a_finish_reason_an_error_and_done(monkeypatch, error, finish_reason, status):
    """A stream the daemon aborts (the drain ran out, a worker died) is not cut short: its
    open completion gets a finish_reason, then the error, the usage and [DONE]."""
    response = RecordingResponse()
    stream(response, Outputs(OUTS[:2], error), monkeypatch)
    *chunks, finish, failure, usage, done = response.events
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": "Hel"}, {"content": "lo"}]
    assert finish["choices"] == [{"index": 0, "delta": {"content": ""}, "logprobs": None,
                                  "finish_reason": finish_reason}]
    assert failure["error"]["message"] == str(error) and failure["error"]["type"] == "service_unavailable"
    assert usage["usage"]["completion_tokens"] == 2 and done == "[DONE]"


def test_an_error_after_the_last_finish_adds_no_second_finish(monkeypatch):
    response = RecordingResponse()
    stream(response, Outputs(OUTS, ServiceStopping("stopping")), monkeypatch)
    finishes = [e["choices"][0]["finish_reason"] for e in response.events if isinstance(e, dict) and e.get("choices")]
    assert finishes == [None, None, "length"]
    assert response.events[-3]["error"]["message"] == "stopping" and response.events[-1] == "[DONE]"
