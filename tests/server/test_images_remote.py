import asyncio
import io

import aiohttp
import pytest
from aiohttp import web
from PIL import Image

from hydrad.config_file import RemoteImageConfig
from hydrad.errors import RequestError
from hydrad.server.images_remote import fetch_remote_images


def png(width, height) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (1, 2, 3)).save(buf, format="PNG")
    return buf.getvalue()


async def slow(request):
    await asyncio.sleep(2)
    return web.Response(body=png(4, 4))


def run(url_path, config=RemoteImageConfig(enabled=True), max_pixels=10_000, kind="image", video=b""):
    async def main():
        app = web.Application()
        app.router.add_get("/small.png", lambda r: web.Response(body=png(8, 6)))
        app.router.add_get("/huge.png", lambda r: web.Response(body=png(200, 200)))
        app.router.add_get("/slow.png", slow)
        app.router.add_get("/clip.mp4", lambda r: web.Response(body=video))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        messages = [{"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": f"{kind}_url", f"{kind}_url": {"url": f"http://127.0.0.1:{port}{url_path}"}},
        ]}]
        try:
            async with aiohttp.ClientSession() as session:
                return await fetch_remote_images(messages, session, config, max_pixels=max_pixels)
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def test_fetched_image_replaces_the_url():
    out = run("/small.png")
    part = out[0]["content"][1]
    assert part["type"] == "image" and part["image"].size == (8, 6)
    assert out[0]["content"][0] == {"type": "text", "text": "look"}


@pytest.mark.parametrize("path, config, message", [
    ("/small.png", RemoteImageConfig(enabled=True, max_bytes=10), "larger than 10 bytes"),
    ("/slow.png", RemoteImageConfig(enabled=True, timeout=0.2), "took longer than 0.2 s"),
    ("/missing.png", RemoteImageConfig(enabled=True), "HTTP 404"),
    ("/huge.png", RemoteImageConfig(enabled=True), "the limit is 10000"),
    ("/small.png", RemoteImageConfig(enabled=True, allowed_domains=["example.com"]), "not allowed"),
])
def test_limits(path, config, message):
    with pytest.raises(RequestError, match=message) as info:
        run(path, config)
    assert info.value.param == "messages[0].content[1]"


def test_fetched_video_replaces_the_url_and_its_header_is_checked():
    pytest.importorskip("av")
    from factories import mp4, photo_frames

    from hydrad.videos import EncodedVideo

    data = mp4(photo_frames(6, 48, 64, 0), fps=10)
    part = run("/clip.mp4", kind="video", video=data)[0]["content"][1]
    assert part == {"type": "video", "video": EncodedVideo(data)}
    with pytest.raises(RequestError, match="the limit is 1000") as info:
        run("/clip.mp4", kind="video", video=data, max_pixels=1000)
    assert info.value.param == "messages[0].content[1]"
    with pytest.raises(RequestError, match="not a video file that can be read"):
        run("/clip.mp4", kind="video", video=b"garbage" * 50)
    with pytest.raises(RequestError, match="fetching the video at .* failed with HTTP 404"):
        run("/missing.mp4", kind="video")
