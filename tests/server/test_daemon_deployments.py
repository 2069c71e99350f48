"""End to end over HTTP: every deployment of roles, stages migrating between worker
processes through shared memory, gives transformers' greedy tokens and leaks no block."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from factories import DEPLOYMENTS

from daemon_process import Daemon, blocks_held_once_freed, http
from test_daemon_api import JPEG, PNG, data_url, reference_tokens

pytestmark = pytest.mark.slow

MAX_TOKENS = 10



def _requests():
    """(OpenAI messages, transformers messages, images): with images, text-only, two images."""
    from io import BytesIO

    from PIL import Image

    png, jpeg = (Image.open(BytesIO(b)).convert("RGB") for b in (PNG, JPEG))
    image_part = lambda raw, media: {"type": "image_url", "image_url": {"url": data_url(raw, media)}}  # noqa: E731
    text = lambda t: {"type": "text", "text": t}  # noqa: E731
    return [
        ([{"role": "user", "content": [image_part(PNG, "png"), text("What is this?")]}],
         [{"role": "user", "content": [{"type": "image"}, text("What is this?")]}], [png]),
        ([{"role": "user", "content": "Write a short poem about the sea."}],
         [{"role": "user", "content": [text("Write a short poem about the sea.")]}], []),
        ([{"role": "user", "content": [text("Compare:"), image_part(JPEG, "jpeg"), image_part(PNG, "png")]}],
         [{"role": "user", "content": [text("Compare:"), {"type": "image"}, {"type": "image"}]}], [jpeg, png]),
        ([{"role": "user", "content": "Hello there"}],
         [{"role": "user", "content": [text("Hello there")]}], []),
        ([{"role": "user", "content": [image_part(JPEG, "jpeg"), text("Describe it in detail.")]}],
         [{"role": "user", "content": [{"type": "image"}, text("Describe it in detail.")]}], [jpeg]),
    ]


@pytest.fixture(scope="module")
def reference(tiny_llava_dir):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir).eval()
    ref = (model, AutoProcessor.from_pretrained(tiny_llava_dir))
    return [reference_tokens(ref, hf, images, MAX_TOKENS)[1] for _, hf, images in _requests()]


@pytest.mark.parametrize("deploy, devices", DEPLOYMENTS)
def test_deployment_over_http_matches_transformers(tiny_llava_dir, tmp_path, reference, deploy, devices):
    daemon = Daemon(["--model", str(tiny_llava_dir), "--devices", devices, "--deploy", deploy], tmp_path / "log")
    try:
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        requests = _requests() * 2

        def ask(api_messages):
            resp = client.chat.completions.create(model=model, messages=api_messages, max_tokens=MAX_TOKENS,
                                                  temperature=0, extra_body={"return_token_ids": True})
            return resp.choices[0].token_ids

        with ThreadPoolExecutor(len(requests)) as pool:
            got = list(pool.map(ask, [api for api, _, _ in requests]))
        for i, tokens in enumerate(got):
            assert tokens == reference[i % len(reference)], f"{deploy}: request {i}"
        held = blocks_held_once_freed(daemon, 5)
        assert held == [(0, 0)] * len(held)
        if deploy != "2EPD":
            metrics = http("GET", daemon.url + "/metrics").text
            assert "hydrad_migration_time_seconds_count" in metrics
    finally:
        assert daemon.stop() == 0, daemon.log()
