"""A streaming chat-completions client that timestamps every server-sent event.

aiohttp rather than the openai package: each SSE line is timestamped as soon as it
is read from the socket, with no parsing layer in between.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from hydrad.bench.metrics import StreamRecord
from hydrad.bench.workloads import RequestSpec
from hydrad.errors import HydradError

_MAX_ERROR_CHARS = 200


class ServerError(HydradError):
    """The server cannot be reached, or does not answer like an OpenAI-compatible server."""


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def chat_payload(model: str, spec: RequestSpec, image_urls: list[str]) -> bytes:
    """The request body: greedy, exactly ``spec.output_tokens`` tokens, usage in the stream."""
    if image_urls:
        content: str | list[dict] = [{"type": "image_url", "image_url": {"url": url}} for url in image_urls]
        content.append({"type": "text", "text": spec.prompt})
    else:
        content = spec.prompt
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": spec.output_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return json.dumps(body).encode()


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


def _carries_token(chunk: dict) -> bool:
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        # Reasoning models stream part of their tokens as reasoning_content.
        if delta.get("content") or delta.get("reasoning_content"):
            return True
        # Without text, a chunk still carries a token (a special token, or bytes held back until a
        # character completes) unless it is a bare role announcement (role, no finish_reason) or
        # a closing finish_reason (no role). A role with a finish_reason is a one-token answer.
        if ("role" in delta) == (choice.get("finish_reason") is not None):
            return True
    return False


async def _read_stream(resp: aiohttp.ClientResponse, record: StreamRecord) -> None:
    completed = 0
    choice_times: list[float] = []
    async for raw in resp.content:
        now = time.perf_counter()
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[len(b"data:"):].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("error"):
            error = chunk["error"]
            record.error = _short(error.get("message", str(error)) if isinstance(error, dict) else str(error))
            return
        usage = chunk.get("usage") or {}
        cumulative = usage.get("completion_tokens")
        if chunk.get("choices"):
            choice_times.append(now)
        if _carries_token(chunk):
            record.chunk_times.append(now)
            record.chunk_tokens.append(cumulative - completed if cumulative is not None else None)
        if cumulative is not None:
            completed = cumulative
            record.completion_tokens = cumulative
    if not record.chunk_times and record.completion_tokens:
        # Tokens were generated but none had text, and the server sent only the role and
        # closing chunks for them: those chunks are the only timing there is.
        record.chunk_times = choice_times
        record.chunk_tokens = [None] * len(choice_times)


async def stream_chat(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str], timeout: float
) -> StreamRecord:
    """Send one streaming request; failures are recorded in the result, never raised."""
    record = StreamRecord(start=time.perf_counter())
    try:
        async with session.post(
            url, data=body, headers=headers, timeout=aiohttp.ClientTimeout(total=None, sock_read=timeout)
        ) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {_short(await resp.text())}"
            else:
                await _read_stream(resp, record)
                if record.error is None and not record.chunk_times:
                    record.error = "the stream ended without any generated text"
    except asyncio.TimeoutError:
        record.error = f"no data from the server for {timeout:g} s"
    except aiohttp.ClientError as e:
        record.error = _short(f"{type(e).__name__}: {e}")
    except (ValueError, TypeError, AttributeError) as e:
        record.error = _short(f"malformed stream: {e}")
    finally:
        record.end = time.perf_counter()
    return record
