"""OpenAI response bodies for chat and text completions, whole or streamed.

Streaming follows OpenAI and vLLM: one chunk per generated token (empty
content while its text is incomplete), the assistant ``role`` with a
completion's first token, ``finish_reason`` with its last, then (with
``stream_options.include_usage``) a usage chunk with no choices, then
``data: [DONE]``. With ``continuous_usage_stats`` as well, every chunk carries
the usage so far (vLLM's extension). ``return_token_ids`` adds each choice's
output token ids (vLLM's extension), which lets clients check tokens exactly.
With ``n`` > 1 the completions' chunks interleave, told apart by ``index``.

Log-probabilities are those of the model's raw distribution (before penalties,
temperature and filters), as vLLM reports them by default; each token is named
by its own decoded text, with its UTF-8 bytes. A text completion with ``echo`` and
``logprobs`` has its prompt's tokens first in its ``logprobs``, each token's given the
ones before it (``null`` for the first), as OpenAI's and vLLM's legacy completions do.

A stream's first outputs are written by its handler (with the status line and
headers); after that, everything a step produced for the request is written in one
write right after the step's outputs were delivered, without waking the handler,
while the connection keeps up (``DIRECT_WRITE_LIMIT``). The handler wakes to end
the stream, on an error, or to write and wait when the client reads slowly. The
common chunk (text only) is framed from prebuilt bytes.
"""

from __future__ import annotations

import json
import logging
import time

from aiohttp import web

from hydrad.engine.inputs import PromptLogprobs, TokenLogprobs
from hydrad.server.engine_client import Output, RequestStream
from hydrad.server.errors import error_body, exception_status
from hydrad.server.protocol import GenerateRequest
from hydrad.cluster.requests import ServiceStopping
from hydrad.server.sse import open_event_stream
from hydrad.tool_calls import HermesCalls
from hydrad.server.tools import ToolCallStream, ToolChoice

logger = logging.getLogger("hydrad.server")

# A stream's outputs are written from the delivery pass while its connection buffers at
# most this much; beyond it the handler writes them and waits for the client to read.
DIRECT_WRITE_LIMIT = 64 << 10

# Non-ASCII is escaped: a raw U+2028, U+0085 or the like inside a JSON line is a line
# break to clients that split SSE streams with str.splitlines.
dumps = json.JSONEncoder(separators=(",", ":")).encode

# A token's text as a JSON string, by text: most chunks carry a text seen before.
_JSON_TEXT: dict[str, bytes] = {}
_JSON_TEXT_MAX = 1 << 16


def json_text(text: str) -> bytes:
    """``text`` as the bytes of a JSON string (escaped as ``dumps`` escapes it)."""
    encoded = _JSON_TEXT.get(text)
    if encoded is None:
        if len(_JSON_TEXT) >= _JSON_TEXT_MAX:
            _JSON_TEXT.clear()
        encoded = _JSON_TEXT[text] = dumps(text).encode()
    return encoded


def _prompt_of(entries: list[TokenLogprobs] | None) -> PromptLogprobs | None:
    """The prompt's log-probabilities a completion's first token carries, if any."""
    return entries[0].prompt if entries else None


class ResponseFormat:
    """The shape of one request's response: chat or text completion."""

    def __init__(self, chat: bool, req_id: str, model: str, return_token_ids: bool, token_text=None,
                 tools: ToolChoice | None = None, echo: list[str] | None = None, token_logprobs: bool = True,
                 prompt_logprobs: bool = False, n: int = 1):
        """``echo``: per completion, the text its answer begins with (a text completion's
        ``echo``: its prompt); ``token_logprobs``: the request asked for its tokens' logprobs
        (those that come without, with vLLM's ``prompt_logprobs`` alone, are left out);
        ``prompt_logprobs``: the answer carries vLLM's ``prompt_logprobs``; ``n``: completions
        per prompt (in a whole answer, the first of each prompt's carries its log-probabilities
        for all: ``split_choices(price_once=True)``)."""
        self.chat = chat
        self.echo = echo
        self.token_logprobs = token_logprobs
        self.prompt_logprobs = prompt_logprobs
        self.n = n
        # A chat answer with tools (``tools.ToolChoice``): its text goes out as calls, and content.
        self.tools = tools
        self._tool_streams: dict[int, ToolCallStream | HermesCalls] = {}
        self.req_id = req_id
        self.model = model
        self.return_token_ids = return_token_ids
        # token id -> its own text, for log-probabilities
        self.token_text = token_text or (lambda token_id: str(token_id))
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if chat else "text_completion"
        envelope = dumps({"id": req_id, "object": self.object, "created": self.created, "model": model})
        # b'data: {"id":...,"model":"...","choices":[{"index":' — then the index and the rest.
        self._prefix = ("data: " + envelope[:-1] + ',"choices":[{"index":').encode()
        self._text_key = (',"delta":{"content":' if chat else ',"text":').encode()
        self._suffix = (b'},"logprobs":null,"finish_reason":null}]}\n\n' if chat else
                        b',"logprobs":null,"finish_reason":null}]}\n\n')
        # Per completion index: the bytes of a text chunk up to its text.
        self._heads: dict[int, bytes] = {}

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.req_id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def chunk_bytes(self, out: Output, first: bool, usage: dict | None, include_usage: bool) -> bytes:
        """The SSE event of one output; plain text chunks are framed from prebuilt bytes."""
        if not first and out.finish_reason is None and out.logprobs is None and not self.return_token_ids \
                and not include_usage and self.tools is None:
            head = self._heads.get(out.index)
            if head is None:
                head = self._heads[out.index] = self._prefix + str(out.index).encode() + self._text_key
            return head + json_text(out.text) + self._suffix
        chunk = self.chunk(out, first)
        if include_usage:
            chunk["usage"] = usage
        return b"data: " + dumps(chunk).encode() + b"\n\n"

    def chunk(self, out: Output, first: bool) -> dict:
        logprobs = self.logprobs([out.logprobs], out.text) if out.logprobs is not None else None
        if self.chat and self.tools is not None:
            # A chunk per token still; its text goes to the calls' arguments (constrained), or
            # to the calls and the content (auto).
            stream = self._tool_streams.get(out.index)
            if stream is None:
                stream = self._tool_streams[out.index] = self.tools.stream()
            content, calls = stream.take(out.text, out.finish_reason is not None)
            delta = {"role": "assistant"} if first else {}
            if first or content is not None:
                delta["content"] = content
            if calls:
                delta["tool_calls"] = calls
            choice = {"index": out.index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": stream.finish_reason(out.finish_reason)}
        elif self.chat:
            # Every token chunk carries "content", empty or not, so clients can time each token.
            delta = {"role": "assistant", "content": out.text} if first else {"content": out.text}
            choice = {"index": out.index, "delta": delta, "logprobs": logprobs, "finish_reason": out.finish_reason}
        else:
            text = self.echo[out.index] + out.text if first and self.echo is not None else out.text
            choice = {"index": out.index, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = out.token_ids
        return self._envelope(self.object, [choice])

    def stream_start(self) -> bytes:
        """What a stream opens with, before its first token: nothing here."""
        return b""

    def stream_error(self, status: int, e: BaseException, unended: list[int], started: list[bool],
                     usage: dict | None, include_usage: bool) -> bytes:
        """A stream that failed after its status line: every completion still open (``unended``)
        ends with a finish_reason, as vLLM ends them ("abort" when the daemon stopped it,
        "error" when it failed), then the error as an event."""
        finish_reason = "abort" if isinstance(e, ServiceStopping) else "error"
        return b"".join(self.chunk_bytes(Output(index, "", [], finish_reason), not started[index], usage,
                                         include_usage) for index in unended) \
            + b"data: " + dumps(error_body(status, e)).encode() + b"\n\n"

    def stream_end(self, usage: dict, include_usage: bool, failed: bool) -> bytes:
        """What a stream ends with: the usage chunk (``stream_options.include_usage``), then
        ``[DONE]`` (after a failure too, as vLLM ends it)."""
        end = b"data: [DONE]\n\n"
        if include_usage:
            body = self._envelope(self.object, [])
            body["usage"] = usage
            end = b"data: " + dumps(body).encode() + b"\n\n" + end
        return end

    async def ended(self, failed: bool) -> None:
        """Called once the answer is complete, before its last bytes are written (a
        Responses answer is kept then); nothing for a chat or text completion."""

    def whole(self, choices: list[dict], usage: dict) -> dict:
        """``choices``: one ``{"text", "token_ids", "finish_reason", "logprobs"}`` per completion."""
        out = []
        for index, c in enumerate(choices):
            # Its prompt's log-probabilities: its own, or those of its prompt's first completion.
            prompt = _prompt_of(c["logprobs"]) or _prompt_of(choices[index - index % self.n]["logprobs"])
            logprobs = self.logprobs(c["logprobs"], c["text"], prompt) \
                if c["logprobs"] is not None and self.token_logprobs else None
            if self.chat and self.tools is not None:
                content, calls = self.tools.answer(c["text"])
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                choice = {"index": index, "message": message, "logprobs": logprobs,
                          "finish_reason": self.tools.finish_reason(c["finish_reason"], calls)}
            elif self.chat:
                choice = {"index": index, "message": {"role": "assistant", "content": c["text"]},
                          "logprobs": logprobs, "finish_reason": c["finish_reason"]}
            else:
                text = c["text"] if self.echo is None else self.echo[index] + c["text"]
                choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c["finish_reason"]}
            if self.return_token_ids:
                choice["token_ids"] = c["token_ids"]
            if self.prompt_logprobs and not self.chat:
                choice["prompt_logprobs"] = self.vllm_prompt_logprobs(prompt)
            out.append(choice)
        body = self._envelope("chat.completion" if self.chat else "text_completion", out)
        if self.prompt_logprobs and self.chat:  # vLLM's: the request's, beside its choices
            first = _prompt_of(choices[0]["logprobs"]) if choices else None
            body["prompt_logprobs"] = self.vllm_prompt_logprobs(first)
        body["usage"] = usage
        return body

    def vllm_prompt_logprobs(self, prompt: PromptLogprobs | None) -> list | None:
        """vLLM's ``prompt_logprobs``: per prompt token, None for the first, then a map from
        token id (the prompt's token and the most likely there) to its ``logprob``, ``rank``
        and ``decoded_token``. None where the answer has none (it ended before a token)."""
        if prompt is None:
            return None
        name = self.token_text
        out: list = [None]
        for e in prompt.entries:
            position = {str(t): {"logprob": lp, "rank": rank, "decoded_token": name(t)}
                        for rank, (t, lp) in enumerate(zip(e.top_token_ids, e.top_logprobs), start=1)}
            position[str(e.token_id)] = {"logprob": e.logprob, "rank": e.rank, "decoded_token": name(e.token_id)}
            out.append(position)
        return out

    def logprobs(self, entries: list[TokenLogprobs], text: str, prompt: PromptLogprobs | None = None) -> dict:
        """The ``logprobs`` of a choice: OpenAI's chat shape (``content``) or the legacy
        completions shape (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``),
        with ``echo`` its prompt's first (``prompt``, else its first token's)."""
        name = self.token_text
        if self.chat:
            def item(token_id: int, logprob: float) -> dict:
                token = name(token_id)
                return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

            return {"content": [
                {**item(e.token_id, e.logprob),
                 "top_logprobs": [item(t, lp) for t, lp in zip(e.top_token_ids, e.top_logprobs)]}
                for e in entries
            ]}
        if self.echo is None:
            prompt = None
        elif prompt is None:
            prompt = _prompt_of(entries)
        tokens = [name(e.token_id) for e in entries]
        token_logprobs = [e.logprob for e in entries]
        top_logprobs = [{name(t): lp for t, lp in zip(e.top_token_ids, e.top_logprobs)} for e in entries]
        if prompt is not None:  # echo: the prompt's tokens first, the first of them unpriced
            tokens = [name(prompt.first_token_id), *(name(e.token_id) for e in prompt.entries), *tokens]
            token_logprobs = [None, *(e.logprob for e in prompt.entries), *token_logprobs]
            top_logprobs = [None, *({name(t): lp for t, lp in zip(e.top_token_ids, e.top_logprobs)}
                                    for e in prompt.entries), *top_logprobs]
        offsets, offset = [], 0
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}


def usage_of(stream: RequestStream, completion: int | None = None) -> dict:
    """``completion``: the output tokens to count (default: all so far)."""
    prompt = stream.num_prompt_tokens
    if completion is None:
        completion = stream.num_output_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            # Known once a completion has finished (0 in a continuous-usage chunk before that).
            "prompt_tokens_details": {"cached_tokens": stream.num_cached_tokens}}


async def respond_whole(fmt: ResponseFormat, stream: RequestStream) -> web.Response:
    return web.json_response(await whole_body(fmt, stream), dumps=dumps)


async def whole_body(fmt: ResponseFormat, stream: RequestStream) -> dict:
    """The answer of every completion of ``stream``, taken to its end, as one object."""
    choices = [{"text": [], "token_ids": [], "finish_reason": None, "logprobs": None} for _ in stream.choices]
    async for batch in stream:
        for out in batch:
            c = choices[out.index]
            c["text"].append(out.text)
            c["token_ids"] += out.token_ids
            if out.logprobs is not None:
                c["logprobs"] = (c["logprobs"] or []) + [out.logprobs]
            if out.finish_reason is not None:
                c["finish_reason"] = out.finish_reason
    for c in choices:
        c["text"] = "".join(c["text"])
    body = fmt.whole(choices, usage_of(stream))
    await fmt.ended(False)
    return body


class DirectWriter:
    """Writes a streamed response's next bytes to the connection itself, as aiohttp frames
    its body (HTTP/1.1 chunks; else, HTTP/1.0, raw until close), from outside the handler
    (a step's delivery pass). Only once the handler has written the response's first bytes
    (the status line and headers go out with them), where ``possible``, and while
    ``ready``: the connection open and its buffer under ``DIRECT_WRITE_LIMIT``."""

    def __init__(self, request: web.Request, response: web.StreamResponse):
        self.transport = request.transport
        self.chunked = response.headers.get("Transfer-Encoding") == "chunked"
        self.possible = self.transport is not None and "Content-Encoding" not in response.headers

    def ready(self) -> bool:
        transport = self.transport
        return not (transport is None or transport.is_closing()
                    or transport.get_write_buffer_size() > DIRECT_WRITE_LIMIT)

    def write(self, data: bytes) -> None:
        if data:  # an empty HTTP/1.1 chunk would end the body
            self.transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)

    def offer(self, data: bytes) -> bool:
        """Write ``data`` if the connection can take it now; whether it did."""
        if not self.ready():
            return False
        self.write(data)
        return True


async def respond_stream(
    request: web.Request, fmt: ResponseFormat, req: GenerateRequest, stream: RequestStream
) -> web.StreamResponse:
    response = await open_event_stream(request)
    started = [False] * len(stream.choices)
    ended = [False] * len(stream.choices)
    # Each completion's tokens up to the chunk being written: a chunk's usage counts the
    # tokens up to it, even when the stream has produced more by the time it is written.
    counted = [0] * len(stream.choices)

    chunk_bytes, continuous, include_usage = fmt.chunk_bytes, req.continuous_usage, req.include_usage

    def events(batch: list[Output]) -> bytes:
        # One chunk per token, even one without text yet (a special token, part of a
        # character): clients that time chunks (vllm bench serve) count on it.
        out_events = []
        for out in batch:
            index = out.index
            if out.num_output_tokens > counted[index]:
                counted[index] = out.num_output_tokens
            usage = usage_of(stream, sum(counted)) if continuous else None
            out_events.append(chunk_bytes(out, not started[index], usage, include_usage))
            started[index] = True
            ended[index] = out.finish_reason is not None
        return out_events[0] if len(out_events) == 1 else b"".join(out_events)

    writer = DirectWriter(request, response)

    def direct(batch: list[Output]) -> bool:
        """Write a step's outputs from the delivery pass, unless the connection cannot take
        them now (``DirectWriter``)."""
        if not writer.ready():
            return False
        writer.write(events(batch))
        return True

    try:
        start = fmt.stream_start()
        if start:
            await response.write(start)
        failed = False
        try:
            async for batch in stream:
                data = events(batch)
                if data:
                    await response.write(data)
                if writer.possible:
                    # The status line and headers have gone out with the first write: from now
                    # on the steps' outputs are written as they are delivered, without this task.
                    stream.direct = direct
        except ConnectionError:
            raise
        except Exception as e:  # the status line has gone out: report in the stream
            stream.direct = None
            status = exception_status(e)
            if status >= 500 and not isinstance(e, ServiceStopping):  # the daemon logged why it stops
                logger.error("request %s failed mid-stream: %s", fmt.req_id, e)
            usage = usage_of(stream) if req.continuous_usage else None
            await response.write(fmt.stream_error(status, e, [i for i, done in enumerate(ended) if not done],
                                                  started, usage, req.include_usage))
            failed = True
        finally:
            stream.direct = None  # what follows is written by this task
        end = fmt.stream_end(usage_of(stream), req.include_usage, failed)
        await fmt.ended(failed)
        if end:
            await response.write(end)
    except ConnectionError:
        # The client went away between two chunks. Raising would make aiohttp log a
        # traceback and try to send a 500 on a dead connection; the caller's
        # ``generate`` context aborts the request either way.
        logger.debug("request %s: client disconnected mid-stream", fmt.req_id)
    return response
