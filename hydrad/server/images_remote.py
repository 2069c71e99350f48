"""Fetching ``http(s)`` image URLs, when the config enables it.

Remote parts are replaced by the fetched bytes (``{"type": "image", "image":
EncodedImage}``) before the Request Processor sees the messages; they are decoded
when the request is processed, within the daemon's budgets. Each fetch is bounded
in bytes and time, and the pixel limit is checked on the image header.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import aiohttp

from hydrad.config_file import RemoteImageConfig
from hydrad.errors import RequestError
from hydrad.images import EncodedImage, peek_image_bytes


async def fetch_remote_images(
    messages: list[dict],
    session: aiohttp.ClientSession,
    config: RemoteImageConfig,
    *,
    max_pixels: int,
) -> list[dict]:
    """A copy of ``messages`` with every remote image part fetched and its header checked."""
    jobs = {}
    for i, j, part in _image_parts(messages):
        url = _remote_url(part)
        if url:
            param = f"messages[{i}].content[{j}]"
            jobs[(i, j)] = _fetch_one(url, session, config, max_pixels, param)
    images = dict(zip(jobs, await asyncio.gather(*jobs.values())))
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            content = [{"type": "image", "image": images[(i, j)]} if (i, j) in images else part
                       for j, part in enumerate(content)]
        out.append({**message, "content": content})
    return out


async def _fetch_one(url, session, config: RemoteImageConfig, max_pixels, param) -> EncodedImage:
    host = (urlsplit(url).hostname or "").lower()
    if config.allowed_domains and not any(host == d or host.endswith("." + d) for d in config.allowed_domains):
        raise RequestError(f"images from {host or url!r} are not allowed on this server", param)
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=config.timeout)) as resp:
            if resp.status != 200:
                raise RequestError(f"fetching the image at {url} failed with HTTP {resp.status}", param)
            if (resp.content_length or 0) > config.max_bytes:
                raise RequestError(f"the image at {url} is larger than {config.max_bytes} bytes", param)
            data = bytearray()
            async for chunk in resp.content.iter_chunked(1 << 16):
                data += chunk
                if len(data) > config.max_bytes:
                    raise RequestError(f"the image at {url} is larger than {config.max_bytes} bytes", param)
    except asyncio.TimeoutError:
        raise RequestError(f"fetching the image at {url} took longer than {config.timeout} s", param) from None
    except aiohttp.ClientError as e:
        raise RequestError(f"fetching the image at {url} failed: {e}", param) from None
    data = bytes(data)
    return EncodedImage(data, peek_image_bytes(data, max_pixels=max_pixels, param=param))


def _image_parts(messages: list[dict]):
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "image_url":
                    yield i, j, part


def _remote_url(part: dict) -> str | None:
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    return url if isinstance(url, str) and url.startswith(("http://", "https://")) else None
