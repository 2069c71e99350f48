"""Server-sent events, as the OpenAI streaming API writes them."""

from __future__ import annotations

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
