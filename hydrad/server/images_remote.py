"""Fetching ``http(s)`` image and video URLs, when the config enables it.

Remote parts are replaced by the fetched bytes (``{"type": "image", "image":
EncodedImage}``, ``{"type": "video", "video": EncodedVideo}``) before the Request
Processor sees the messages; they are decoded when the request is processed, within the
daemon's budgets. Each fetch is bounded in bytes and time, and the pixel limit is checked
on the image's (or the video's) header.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import aiohttp

from hydrad.config_file import RemoteImageConfig
from hydrad.errors import RequestError
from hydrad.images import EncodedImage, peek_image_bytes
from hydrad.videos import EncodedVideo, read_header


async def fetch_remote_images(
    messages: list[dict],
    session: aiohttp.ClientSession,
    config: RemoteImageConfig,
    *,
    max_pixels: int,
) -> list[dict]:
    """A copy of ``messages`` with every remote image and video part fetched and its header
    checked."""
    jobs = {}
    for i, j, kind, url in _remote_parts(messages):
        param = f"messages[{i}].content[{j}]"
        jobs[(i, j)] = _fetch_one(url, kind, session, config, max_pixels, param)
    fetched = dict(zip(jobs, await asyncio.gather(*jobs.values())))
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            content = [_fetched_part(fetched[(i, j)]) if (i, j) in fetched else part
                       for j, part in enumerate(content)]
        out.append({**message, "content": content})
    return out


def _fetched_part(item: EncodedImage | EncodedVideo) -> dict:
    if isinstance(item, EncodedVideo):
        return {"type": "video", "video": item}
    return {"type": "image", "image": item}


async def _fetch_one(url, kind: str, session, config: RemoteImageConfig, max_pixels,
                     param) -> EncodedImage | EncodedVideo:
    host = (urlsplit(url).hostname or "").lower()
    if config.allowed_domains and not any(host == d or host.endswith("." + d) for d in config.allowed_domains):
        raise RequestError(f"{kind}s from {host or url!r} are not allowed on this server", param)
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=config.timeout)) as resp:
            if resp.status != 200:
                raise RequestError(f"fetching the {kind} at {url} failed with HTTP {resp.status}", param)
            if (resp.content_length or 0) > config.max_bytes:
                raise RequestError(f"the {kind} at {url} is larger than {config.max_bytes} bytes", param)
            data = bytearray()
            async for chunk in resp.content.iter_chunked(1 << 16):
                data += chunk
                if len(data) > config.max_bytes:
                    raise RequestError(f"the {kind} at {url} is larger than {config.max_bytes} bytes", param)
    except asyncio.TimeoutError:
        raise RequestError(f"fetching the {kind} at {url} took longer than {config.timeout} s", param) from None
    except aiohttp.ClientError as e:
        raise RequestError(f"fetching the {kind} at {url} failed: {e}", param) from None
    data = bytes(data)
    if kind == "video":
        # The container's header, off the event loop (it may sit at the end of the file).
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: read_header(data, max_pixels=max_pixels, param=param))
        return EncodedVideo(data)
    return EncodedImage(data, peek_image_bytes(data, max_pixels=max_pixels, param=param))


def _remote_parts(messages: list[dict]):
    """(message, part, "image" or "video", URL) of every http(s) image or video part."""
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = {"image_url": "image", "video_url": "video"}.get(part.get("type")) if isinstance(part, dict) \
                else None
            if kind is None:
                continue
            field = part.get(part["type"])
            url = field.get("url") if isinstance(field, dict) else field
            if isinstance(url, str) and url.startswith(("http://", "https://")):
                yield i, j, kind, url
