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


def test_a_borrower_serves_on_its_own_core_before_its_model_on_borrowed_cores_is_measured(
        tiny_llava_dir, tmp_path, reference, monkeypatch):
    """A first start of ``1EP+1D``: each instance measures its model on its own core, side by
    side, and serves; EP measures its model on both cores (D's idle one borrowed) between
    its steps afterwards, reports it, and caches it (its lender stayed idle; unless the
    machine's speed moved meanwhile, which the tiny model's millisecond probes on a shared
    machine do now and then); a restart takes every model from the cache, the borrowed one
    in EP's ready message."""
    from daemon_process import wait_for

    from hydrad.engine.cores import usable_cpus

    if usable_cpus() < 2:
        pytest.skip("needs two cores to borrow one")
    monkeypatch.setenv("HYDRAD_CACHE_DIR", str(tmp_path / "cache"))
    args = ["--model", str(tiny_llava_dir), "--devices", "cpu:2", "--deploy", "1EP+1D"]

    def borrow_models(daemon):
        return [i["borrow_latency_model"] for i in http("GET", daemon.url + "/admin/status").json()["instances"]]

    daemon = Daemon(args, tmp_path / "first.log")
    try:
        assert wait_for(lambda: borrow_models(daemon)[0] is not None, 120, interval=0.2), daemon.log()
        assert borrow_models(daemon)[1] is None  # D lends its core, borrows none
        log = daemon.log()
        ready, measured = log.index("2 worker(s) ready"), log.index("fitted in")
        later = log.index("between steps")
        assert measured < ready < later and "worker 0 measured its latency model on 2 threads" in log[later:]
        cached = "(not cached)" not in log[later:].splitlines()[0]
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)
        api, _, _ = _requests()[0]
        resp = client.chat.completions.create(model=client.models.list().data[0].id, messages=api,
                                              max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body={"return_token_ids": True})
        assert resp.choices[0].token_ids == reference[0]
    finally:
        assert daemon.stop() == 0, daemon.log()
    assert len(list((tmp_path / "cache" / "latency").glob("*.json"))) == 2 + cached  # EP's own, D's, EP's borrowed
    daemon = Daemon(args, tmp_path / "restart.log")
    try:
        if cached:
            assert borrow_models(daemon)[0] is not None and "fitted in" not in daemon.log()
        else:  # measured again, after it is ready
            assert wait_for(lambda: borrow_models(daemon)[0] is not None, 120, interval=0.2), daemon.log()
            assert daemon.log().count("fitted in") == 1
        assert borrow_models(daemon)[1] is None
    finally:
        assert daemon.stop() == 0, daemon.log()
