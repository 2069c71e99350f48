"""Thousands of concurrent streams: 1,024 at once through one CPU worker and through
1E+1P+1D, greedy and sampled, with and without images. Every one finishes with all
its tokens, none fails, and no instance holds a block afterwards.

Step outputs for hundreds of requests are far larger than a socket takes in one
write, so this is also the end-to-end test of the daemon's frame reader.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from daemon_process import Daemon, blocks_held_once_freed, http
from test_daemon_deployments import PNG, data_url

pytestmark = pytest.mark.slow

NUM_STREAMS = 1024
MAX_TOKENS = 8
CONFIG = """
[slo]
ttft = 60
tbt = 5

[scheduler]
derive_budgets = false
token_budget = 4096
image_budget = 16
max_num_seqs = 512
"""


def body(i: int, with_image: bool) -> dict:
    text = f"Request {i}: tell me something about the number {i}."
    content = ([{"type": "image_url", "image_url": {"url": data_url(PNG, "png")}}, {"type": "text", "text": text}]
               if with_image else text)
    sampled = i % 2 == 0  # half the API defaults (temperature 1), half greedy
    return {"messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
            **({} if sampled else {"temperature": 0})}


async def stream_all(url: str, bodies: list[dict]) -> list[tuple[int, int, str | None]]:
    """(status, tokens received, error) per request, all sent at once."""

    async def one(session: aiohttp.ClientSession, payload: dict):
        async with session.post(url + "/v1/chat/completions", json=payload) as response:
            if response.status != 200:
                return response.status, 0, await response.text()
            tokens, usage, error, done = 0, None, None, False
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                if line.startswith(b"data: [DONE]"):
                    done = True
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]["message"]
                elif chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
                elif chunk["choices"]:
                    tokens += len(chunk["choices"][0].get("token_ids") or [])
            if not done:
                error = error or "stream ended without [DONE]"
            if error is None and usage != tokens:
                error = f"usage says {usage} tokens, the stream carried {tokens}"
            return response.status, tokens, error

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        return await asyncio.gather(*(one(session, b) for b in bodies))


@pytest.mark.parametrize("deploy, devices, image_every", [("1EPD", "cpu:1", 0), ("1E+1P+1D", "cpu:3", 8)])
def test_1024_concurrent_streams_all_finish(tiny_llava_dir, tmp_path, deploy, devices, image_every):
    config = tmp_path / "hydrad.toml"
    config.write_text(CONFIG)
    daemon = Daemon(["--model", str(tiny_llava_dir), "--config", str(config), "--devices", devices,
                     "--deploy", deploy], tmp_path / "hydrad.log")
    try:
        bodies = [body(i, image_every and i % image_every == 0) for i in range(NUM_STREAMS)]
        results = asyncio.run(stream_all(daemon.url, bodies))
        failed = [r for r in results if r[0] != 200 or r[2] is not None]
        assert not failed, (len(failed), failed[:3], daemon.log()[-3000:])
        assert all(tokens == MAX_TOKENS for _, tokens, _ in results)
        status = http("GET", daemon.url + "/admin/status").json()
        assert all(i["state"] == "ready" for i in status["instances"])
        # The last release may still be on its way when the last response arrives.
        assert blocks_held_once_freed(daemon, 5) == [(0, 0)] * len(status["instances"])
        assert status["requests"]["num_inflight"] == 0
    finally:
        assert daemon.stop() == 0, daemon.log()[-3000:]
