"""A streaming client of chat completions, or of OpenAI's Responses API, that timestamps
every server-sent event.

aiohttp rather than the openai package: each SSE line is timestamped as soon as it
is read from the socket, with no parsing layer in between.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import aiohttp

from hydrad.bench.metrics import StreamRecord
from hydrad.bench.workloads import RequestSpec
from hydrad.errors import ConfigError, HydradError

_MAX_ERROR_CHARS = 200


class ServerError(HydradError):
    """The server cannot be reached, or does not answer like an OpenAI-compatible server."""


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class Payload(bytes):
    """A request body that knows how many tokens its answer must have (it asks for exactly
    that many: ``max_tokens`` with ``ignore_eos``), which ``stream_chat`` checks, and whether
    it is a Responses API request (its answer streamed as that API's events)."""

    output_tokens: int | None = None
    responses: bool = False

    def __new__(cls, body: bytes, output_tokens: int | None, responses: bool = False):
        payload = super().__new__(cls, body)
        payload.output_tokens = output_tokens
        payload.responses = responses
        return payload


def chat_payload(model: str, spec: RequestSpec, image_urls: list[str], sampling: dict | None = None,
                 video_urls: list[str] = ()) -> Payload:
    """The request body: exactly ``spec.output_tokens`` tokens, greedy unless ``sampling``
    (body fields) says otherwise, usage and token ids in the stream. Images, then videos, then
    the prompt's text. A scoring request (``spec.prompt_logprobs``) asks for its prompt's
    log-probabilities as vLLM names them (``prompt_logprobs``: the top one at each position),
    which come only with a whole answer (vLLM and hydrad refuse them on a stream): it is
    sent unstreamed, and its answer's tokens all come at its end (``stream_chat``). So is a
    request for ``spec.n`` > 1 completions: its answer has ``n * output_tokens`` tokens."""
    if image_urls or video_urls:
        content: str | list[dict] = [{"type": "image_url", "image_url": {"url": url}} for url in image_urls]
        content += [{"type": "video_url", "video_url": {"url": url}} for url in video_urls]
        content.append({"type": "text", "text": spec.prompt})
    else:
        content = spec.prompt
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": spec.output_tokens,
        "temperature": 0.0,
        **(sampling or {}),
        "ignore_eos": True,
        # Exact token counts per chunk where the server supports it (vLLM, hydrad).
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if spec.prompt_logprobs:
        body.update(prompt_logprobs=1)
    if spec.n > 1:
        body.update(n=spec.n)
    if spec.prompt_logprobs or spec.n > 1:
        body["stream"] = False
        del body["stream_options"]
    return Payload(json.dumps(body).encode(), spec.output_tokens * spec.n)


def responses_payload(model: str, spec: RequestSpec, image_urls: list[str], sampling: dict | None = None) -> Payload:
    """The same request for OpenAI's Responses API (``/v1/responses``): the images and the
    prompt as one user message of ``input_image`` and ``input_text`` parts, exactly
    ``spec.output_tokens`` tokens (``max_output_tokens``, ``ignore_eos``: vLLM and hydrad take
    it there too), streamed, nothing kept (``store`` false). A structured output's
    ``response_format`` is the API's ``text.format``. Videos, ``n`` and prompt
    log-probabilities have no place in that API (``check_responses_workload``)."""
    content = [{"type": "input_image", "image_url": url} for url in image_urls]
    content.append({"type": "input_text", "text": spec.prompt})
    fields = dict(sampling or {})
    response_format = fields.pop("response_format", None)
    body = {
        "model": model,
        "input": [{"role": "user", "content": content}],
        "max_output_tokens": spec.output_tokens,
        "temperature": 0.0,
        **fields,
        "ignore_eos": True,
        "store": False,
        "stream": True,
    }
    if response_format is not None:
        schema = response_format.get("json_schema")
        body["text"] = {"format": {"type": "json_schema", **schema} if schema is not None else response_format}
    return Payload(json.dumps(body).encode(), spec.output_tokens, responses=True)


def check_responses_workload(spec: RequestSpec) -> None:
    """ConfigError for a request the Responses API cannot send."""
    for what, present in (("videos", bool(spec.videos)), ("n > 1", spec.n > 1),
                          ("prompt log-probabilities", spec.prompt_logprobs)):
        if present:
            raise ConfigError(f"the workload asks for {what}, which the Responses API (--api responses) does "
                              "not serve; use --api chat")


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + "..."


async def resolve_model(session: aiohttp.ClientSession, base_url: str, api_key: str | None, model: str | None) -> str:
    """Check that the server answers; return ``model``, or the first model it lists."""
    try:
        async with session.get(f"{base_url}/v1/models", headers=auth_headers(api_key)) as resp:
            if resp.status in (401, 403):
                raise ServerError(f"{base_url} rejected the request (HTTP {resp.status}); check --api-key")
            if resp.status != 200:
                if model is not None:
                    return model
                raise ServerError(f"{base_url}/v1/models answered HTTP {resp.status}; pass --model")
            listing = await resp.json(content_type=None)
    except aiohttp.ClientConnectorError as e:
        raise ServerError(f"cannot reach {base_url}: {e.os_error.strerror or e}") from None
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise ServerError(f"cannot reach {base_url}: {e or type(e).__name__}") from None
    if model is not None:
        return model
    try:
        return listing["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        raise ServerError(f"{base_url}/v1/models lists no model; pass --model") from None


@dataclass(frozen=True)
class Chunk:
    """One streamed chunk with choices, as read: when, and what it says about its tokens."""

    time: float
    # Judged from the delta alone (see carries_token); exact counts, when present, overrule it.
    carries_token: bool
    # Exact counts when the server sends them: the choice's ``token_ids`` (vLLM's and hydrad's
    # ``return_token_ids``), the chunk's cumulative ``usage.completion_tokens`` (vLLM's
    # ``continuous_usage_stats``).
    num_token_ids: int | None = None
    cumulative_tokens: int | None = None
    # Characters of generated text: what apportions a final usage over the chunks that lack counts.
    num_chars: int = 0


def text_of(choice: dict) -> str:
    """The generated text a chunk's choice carries (reasoning models stream part of it as reasoning)."""
    delta = choice.get("delta") or {}
    return "".join(delta.get(k) or "" for k in ("reasoning_content", "reasoning", "content")
                   if isinstance(delta.get(k), str))


def carries_token(choice: dict) -> bool:
    """Whether a chunk's choice carries a generated token, judged from its delta alone."""
    delta = choice.get("delta") or {}
    if text_of(choice):
        return True
    has_role, finishes = bool(delta.get("role")), choice.get("finish_reason") is not None
    if has_role:
        # An opening role chunk with empty content is a bare announcement (vLLM, SGLang,
        # OpenAI); a role with a finish reason is a one-token answer.
        return finishes
    # With a finish reason and no content at all: a closing chunk (SGLang's empty delta). Empty
    # content, or an empty delta mid-stream: a token without text of its own (a special token,
    # or bytes held back until a character completes).
    return not finishes or isinstance(delta.get("content"), str)


def _exact_counts(chunks: list[Chunk]) -> list[int] | None:
    """Tokens per chunk from ``token_ids`` or per-chunk usage, if every judged token chunk has them."""
    judged = [c for c in chunks if c.carries_token]
    if not judged:
        return None
    if all(c.num_token_ids is not None for c in judged):
        return [c.num_token_ids or 0 for c in chunks]
    if all(c.cumulative_tokens is not None for c in judged):
        counts, previous = [], 0
        for c in chunks:
            counts.append(0 if c.cumulative_tokens is None else c.cumulative_tokens - previous)
            previous = c.cumulative_tokens if c.cumulative_tokens is not None else previous
        return counts
    return None


def token_chunks(
    chunks: list[Chunk], completion_tokens: int | None
) -> tuple[list[float], list[int | None], list[int]]:
    """Arrival times, token counts (None: unknown) and text lengths of the chunks that carried
    generated tokens.

    Exact counts decide on their own: a role chunk with ``token_ids`` carries the first token
    (hydrad sends the role with it), one without carries none (vLLM sends it first). Otherwise
    the chunks judged by their deltas carry the tokens; a stream whose tokens all lacked text
    is timed by its role and closing chunks.
    """
    counts = _exact_counts(chunks)
    if counts is not None:
        kept = [(c, k) for c, k in zip(chunks, counts) if k > 0]
        return [c.time for c, _ in kept], [k for _, k in kept], [c.num_chars for c, _ in kept]
    judged = [c for c in chunks if c.carries_token]
    if not judged and completion_tokens:
        judged = chunks
    return [c.time for c in judged], [None] * len(judged), [c.num_chars for c in judged]


async def _read_stream(resp: aiohttp.ClientResponse, record: StreamRecord, output_tokens: int | None) -> None:
    chunks: list[Chunk] = []
    done = False
    async for raw in resp.content:
        now = time.perf_counter()
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[len(b"data:"):].strip()
        if data == b"[DONE]":
            done = True
            break
        body = json.loads(data)
        if body.get("error"):
            error = body["error"]
            record.error = _short(error.get("message", str(error)) if isinstance(error, dict) else str(error))
            break
        usage = body.get("usage") or {}
        cumulative = usage.get("completion_tokens")
        if isinstance(usage.get("prompt_tokens"), int):
            record.prompt_tokens = usage["prompt_tokens"]
        if body.get("choices"):
            choice = body["choices"][0]
            token_ids = choice.get("token_ids")
            num_token_ids = len(token_ids) if isinstance(token_ids, list) else None
            chunks.append(Chunk(now, carries_token(choice), num_token_ids, cumulative, len(text_of(choice))))
        if cumulative is not None:
            record.completion_tokens = cumulative
    record.chunk_times, record.chunk_tokens, record.chunk_chars = token_chunks(chunks, record.completion_tokens)
    if record.error is not None:
        return
    # The tokens the stream carried (token ids), and those its final usage counts.
    counts = [sum(record.chunk_tokens)] if all(k is not None for k in record.chunk_tokens) else []
    if record.completion_tokens is not None:
        counts.append(record.completion_tokens)
    if not done:  # the connection closed mid-answer: a server that went away, or cut it
        got = counts[0] if counts else len(record.chunk_times)
        record.error = f"the stream ended without [DONE] after {got} token(s)"
    elif output_tokens is not None and (wrong := [n for n in counts if n != output_tokens]):
        record.error = _wrong_length(wrong[0], output_tokens)


async def _read_responses_stream(resp: aiohttp.ClientResponse, record: StreamRecord,
                                 output_tokens: int | None) -> None:
    """A Responses API stream: each ``response.output_text.delta`` event a chunk of the answer
    (its tokens counted from the final usage, as chat chunks without token ids are: one per
    event where they agree), ``response.completed`` or ``response.incomplete`` its end with the
    usage, ``error`` or ``response.failed`` its failure."""
    chunks: list[Chunk] = []
    done = False
    async for raw in resp.content:
        now = time.perf_counter()
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        event = json.loads(line[len(b"data:"):].strip())
        kind = event.get("type")
        if kind == "response.output_text.delta":
            chunks.append(Chunk(now, True, None, None, len(event.get("delta") or "")))
        elif kind in ("response.completed", "response.incomplete"):
            usage = (event.get("response") or {}).get("usage") or {}
            if isinstance(usage.get("input_tokens"), int):
                record.prompt_tokens = usage["input_tokens"]
            if isinstance(usage.get("output_tokens"), int):
                record.completion_tokens = usage["output_tokens"]
            done = True
            break
        elif kind in ("error", "response.failed"):
            error = event.get("message") or ((event.get("response") or {}).get("error") or {}).get("message")
            record.error = _short(str(error or kind))
            break
    record.chunk_times, record.chunk_tokens, record.chunk_chars = token_chunks(chunks, record.completion_tokens)
    if record.error is not None:
        return
    if not done:
        record.error = f"the stream ended without response.completed after {len(chunks)} text event(s)"
    elif output_tokens is not None and record.completion_tokens != output_tokens:
        record.error = _wrong_length(record.completion_tokens or 0, output_tokens)


def _wrong_length(got: int, output_tokens: int) -> str:
    # Asked for exactly that many (ignore_eos): more or fewer is the server's fault.
    return f"the answer had {got} token(s) for max_tokens {output_tokens} with ignore_eos"


async def _read_whole(resp: aiohttp.ClientResponse, record: StreamRecord, output_tokens: int | None) -> None:
    """An answer sent whole (a scoring request's): every token arrives with it, its TTFT is
    its end-to-end time (both the moment the body was read) and it has no gaps."""
    body = await resp.json(content_type=None)
    now = record.end = time.perf_counter()
    usage = body.get("usage") or {}
    if isinstance(usage.get("prompt_tokens"), int):
        record.prompt_tokens = usage["prompt_tokens"]
    tokens = usage.get("completion_tokens")
    if not isinstance(tokens, int) or tokens < 1:
        record.error = "the answer had no usage.completion_tokens"
        return
    record.completion_tokens, record.whole = tokens, True
    record.chunk_times, record.chunk_tokens = [now], [tokens]
    record.chunk_chars = [sum(len((choice.get("message") or {}).get("content") or "")
                              for choice in body.get("choices") or ())]
    if output_tokens is not None and tokens != output_tokens:
        record.error = _wrong_length(tokens, output_tokens)


async def stream_chat(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str], timeout: float
) -> StreamRecord:
    """Send one streaming request (or one whose answer comes whole, where the body asks for it:
    ``chat_payload``'s scoring requests); failures are recorded in the result, never raised (an
    answer cut short, or of another length than a ``Payload`` asks for, among them)."""
    record = StreamRecord(start=time.perf_counter())
    try:
        async with session.post(
            url, data=body, headers=headers, timeout=aiohttp.ClientTimeout(total=None, sock_read=timeout)
        ) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {_short(await resp.text())}"
            elif resp.content_type == "application/json":
                await _read_whole(resp, record, getattr(body, "output_tokens", None))
            elif getattr(body, "responses", False):
                await _read_responses_stream(resp, record, body.output_tokens)
            else:
                await _read_stream(resp, record, getattr(body, "output_tokens", None))
                if record.error is None and not record.chunk_times:
                    record.error = "the stream ended without any generated text"
    except asyncio.TimeoutError:
        record.error = f"no data from the server for {timeout:g} s"
    except aiohttp.ClientError as e:
        record.error = _short(f"{type(e).__name__}: {e}")
    except (ValueError, TypeError, AttributeError) as e:
        record.error = _short(f"malformed stream: {e}")
    finally:
        record.end = record.end or time.perf_counter()
    return record
