"""Server-sent events, as the OpenAI streaming API writes them."""

from __future__ import annotations

import json

from aiohttp import web


async def open_event_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            # Reverse proxies (nginx) must not buffer the stream.
            "X-Accel-Buffering": "no",
        }
    )
    await response.prepare(request)
    return response


async def send_event(response: web.StreamResponse, payload: dict) -> None:
    await response.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")


async def send_done(response: web.StreamResponse) -> None:
    await response.write(b"data: [DONE]\n\n")
