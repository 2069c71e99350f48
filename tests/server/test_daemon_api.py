"""End to end: the real daemon (2 CPU workers, 2EPD) and the official OpenAI client."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import subprocess
import sys
import time

import numpy as np
import openai
import pytest
from PIL import Image

from daemon_process import HYDRACTL, REPO, Daemon, http, open_stream

pytestmark = pytest.mark.slow

API_KEY = "test-key"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def daemon(tiny_llava_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("daemon")
    config = tmp / "hydrad.toml"
    config.write_text("""
[server]
max_body_mb = 1
max_images_per_request = 2
max_image_pixels = 1000000
shutdown_timeout = 10
""")
    d = Daemon(["--model", str(tiny_llava_dir), "--config", str(config), "--devices", "cpu:2", "--deploy", "2EPD",
                "--api-key", API_KEY], tmp / "hydrad.log")
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def reference(tiny_llava_dir):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir).eval()
    return model, AutoProcessor.from_pretrained(tiny_llava_dir)


def reference_tokens(reference, messages, images, max_new_tokens):
    import torch

    model, processor = reference
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    num_prompt = inputs["input_ids"].shape[1]
    return num_prompt, out[0, num_prompt:].tolist()


def image_bytes(seed: int, size: tuple[int, int], fmt: str) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, media: str) -> str:
    return f"data:image/{media};base64," + base64.b64encode(data).decode()


PNG = image_bytes(0, (40, 30), "PNG")
JPEG = image_bytes(1, (64, 64), "JPEG")


def conversation():
    """(OpenAI messages, transformers messages, PIL images): multi-turn, two images."""
    api = [
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(PNG, "png")}},
            {"type": "text", "text": "What is in the picture?"},
        ]},
        {"role": "assistant", "content": "A cat on a mat."},
        {"role": "user", "content": [
            {"type": "text", "text": "And in this one?"},
            {"type": "image_url", "image_url": {"url": data_url(JPEG, "jpeg")}},
        ]},
    ]
    hf = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat on a mat."}]},
        {"role": "user", "content": [{"type": "text", "text": "And in this one?"}, {"type": "image"}]},
    ]
    images = [Image.open(io.BytesIO(PNG)).convert("RGB"), Image.open(io.BytesIO(JPEG)).convert("RGB")]
    return api, hf, images


def expected_finish(tokens, max_new_tokens):
    return "length" if len(tokens) == max_new_tokens else "stop"


def test_models(client, model_name, tiny_llava_dir):
    card = client.models.list().data[0]
    assert card.id == tiny_llava_dir.name == model_name
    assert card.root == str(tiny_llava_dir)
    assert card.max_model_len > MAX_TOKENS
    assert (card.architecture, card.model_type) == ("LlavaForConditionalGeneration", "llava")


def test_chat_greedy_matches_transformers(client, model_name, reference):
    api, hf, images = conversation()
    num_prompt, expected = reference_tokens(reference, hf, images, MAX_TOKENS)
    resp = client.chat.completions.create(model=model_name, messages=api, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"return_token_ids": True})
    choice = resp.choices[0]
    assert choice.token_ids == expected
    assert choice.finish_reason == expected_finish(expected, MAX_TOKENS)
    assert choice.message.role == "assistant"
    assert choice.message.content == reference[1].tokenizer.decode(expected, skip_special_tokens=True)
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (num_prompt, len(expected))
    assert resp.usage.total_tokens == num_prompt + len(expected)


def test_chat_stream_matches_transformers(client, model_name, reference):
    api, hf, images = conversation()
    num_prompt, expected = reference_tokens(reference, hf, images[:1] + images[1:], MAX_TOKENS)
    stream = client.chat.completions.create(
        model=model_name, messages=api, max_completion_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True},
    )
    chunks = list(stream)
    content = [c for c in chunks if c.choices]
    # The role goes out with the first token, not in a chunk of its own.
    assert content[0].choices[0].delta.role == "assistant" and content[0].choices[0].token_ids
    assert all(c.choices[0].delta.role is None for c in content[1:])
    assert [t for c in content for t in c.choices[0].token_ids] == expected
    assert [c.choices[0].finish_reason for c in content][-1] == expected_finish(expected, MAX_TOKENS)
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert text == reference[1].tokenizer.decode(expected, skip_special_tokens=True)
    usage = chunks[-1].usage
    assert not chunks[-1].choices and (usage.prompt_tokens, usage.completion_tokens) == (num_prompt, len(expected))


def test_completions_greedy_matches_transformers(client, model_name, reference):
    import torch

    model, processor = reference
    prompt = "The quick brown fox"
    inputs = processor.tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS)
    expected = out[0, inputs["input_ids"].shape[1]:].tolist()
    resp = client.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"return_token_ids": True})
    assert resp.choices[0].token_ids == expected
    assert resp.usage.prompt_tokens == inputs["input_ids"].shape[1]
    stream = client.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream) == resp.choices[0].text


def test_stop_string_truncates(client, model_name):
    base = client.completions.create(model=model_name, prompt="hello", max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = text[len(text) // 2:][:2]
    assert stop.strip(), f"no usable stop string in {text!r}"
    resp = client.completions.create(model=model_name, prompt="hello", max_tokens=MAX_TOKENS, temperature=0,
                                     stop=[stop], extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].text == text[: text.index(stop)]


def test_16_concurrent_streams(daemon, model_name):
    async def one(client, i):
        stream = await client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": f"story number {i}"}], max_tokens=20,
            temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream]
        return chunks[-2].choices[0].finish_reason, chunks[-1].usage.completion_tokens

    async def main():
        client = openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key=API_KEY, max_retries=0)
        return await asyncio.gather(*(one(client, i) for i in range(16)))

    assert asyncio.run(main()) == [("length", 20)] * 16


def status(daemon) -> dict:
    return http("GET", daemon.url + "/admin/status").json()


def test_disconnect_mid_stream_frees_kv(daemon, model_name):
    body = {"model": model_name, "messages": [{"role": "user", "content": "tell me everything"}], "stream": True,
            "temperature": 0, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    body["max_tokens"] = status(daemon)["max_model_len"] - 64
    streams = [open_stream(daemon.url + "/v1/chat/completions", json.dumps(body).encode(), headers)
               for _ in range(4)]
    busy = status(daemon)["instances"]
    assert sum(i["num_kv_blocks_used"] for i in busy) > 0
    assert sum(i["num_running"] + i["num_waiting"] for i in busy) == 4
    for conn, response in streams:
        response.close()
        conn.close()
    disconnected = time.monotonic()
    # The requests would run for thousands more tokens; aborted, their blocks are freed at once.
    while True:
        instances = status(daemon)["instances"]
        if all(i["num_kv_blocks_used"] == 0 and i["kv_usage"] == 0 for i in instances):
            break
        assert time.monotonic() - disconnected < 2.0, instances
        time.sleep(0.05)
    assert all(i["num_running"] == 0 and i["num_waiting"] == 0 for i in instances)


def test_metrics(daemon, client, model_name):
    client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    text = http("GET", daemon.url + "/metrics").text
    for name in ("hydrad_time_to_first_token_seconds_bucket", "hydrad_inter_token_latency_seconds_bucket",
                 "hydrad_e2e_request_latency_seconds_bucket", 'hydrad_stage_queue_time_seconds_count{model_name',
                 'hydrad_stage_exec_time_seconds_count{model_name', 'finish_reason="length"'):
        assert name in text, name
    for stage in ("prefill", "decode"):
        assert f'stage="{stage}"' in text
    for instance in ("0", "1"):
        assert f'hydrad_kv_cache_usage_ratio{{device="cpu",instance="{instance}"' in text
        assert f'hydrad_num_requests_running{{device="cpu",instance="{instance}"' in text
        assert f'hydrad_image_cache_usage_ratio{{device="cpu",instance="{instance}"' in text


def test_health(daemon):
    assert http("GET", daemon.url + "/health").status_code == 200


def test_hydractl_status_shows_both_instances(daemon):
    out = subprocess.run([sys.executable, *HYDRACTL, "status", "--url", daemon.url], capture_output=True,
                         text=True, timeout=60, cwd=REPO, env={"PYTHONPATH": str(REPO), "COLUMNS": "120",
                                                               "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if "EPD" in line and "│" in line]
    assert len(rows) == 2 and all("cpu" in r and "ready" in r for r in rows), out.stdout
    assert "TTFT p50" in out.stdout and "TBT p90" in out.stdout
    # each instance fitted its latency model at start, and says so with its bound and error
    assert out.stdout.count("steps up to 200.0 ms") == 2, out.stdout
    assert out.stdout.count("held-out probes") == 2 and out.stdout.count("/image") == 2, out.stdout


# -- bad input: right status and error shape, then a good request still succeeds -----------------

def good_body(model_name):
    return {"model": model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def image_message(*urls):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in urls]
             + [{"type": "text", "text": "describe"}]}]


def big_png(width, height) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


BAD = {
    "malformed_json": (400, None, b"{\"messages\": [", {}),
    "missing_messages": (400, "messages", {"messages": None}, {}),
    "empty_messages": (400, "messages", {"messages": []}, {}),
    "bad_role": (400, "messages[0].role", {"messages": [{"role": "robot", "content": "hi"}]}, {}),
    "bad_content_type": (400, "messages[0].content[0]",
                         {"messages": [{"role": "user", "content": [{"type": "audio", "audio": "x"}]}]}, {}),
    "invalid_base64": (400, "messages[0].content[0]", {"messages": image_message("data:image/png;base64,@@@")}, {}),
    "undecodable_image": (400, "messages[0].content[0]",
                          {"messages": image_message(data_url(b"not an image at all", "png"))}, {}),
    "unsupported_image": (400, "messages[0].content[0]",
                          {"messages": image_message(data_url(image_bytes(2, (8, 8), "BMP"), "png"))}, {}),
    "too_many_images": (400, "messages", {"messages": image_message(*[data_url(PNG, "png")] * 3)}, {}),
    "too_many_pixels": (400, "messages[0].content[0]",
                        {"messages": image_message(data_url(big_png(1100, 1000), "png"))}, {}),
    "remote_url_disabled": (400, "messages[0].content[0]",
                            {"messages": image_message("http://127.0.0.1:9/cat.png")}, {}),
    "beyond_context": (400, "max_tokens", {"max_tokens": 10**6}, {}),
    "max_tokens_zero": (400, "max_tokens", {"max_tokens": 0}, {}),
    "max_tokens_negative": (400, "max_completion_tokens", {"max_completion_tokens": -3}, {}),
    "temperature_high": (400, "temperature", {"temperature": 2.5}, {}),
    "temperature_negative": (400, "temperature", {"temperature": -0.1}, {}),
    "top_p_zero": (400, "top_p", {"top_p": 0}, {}),
    "top_p_high": (400, "top_p", {"top_p": 1.01}, {}),
    "seed_beyond_64_bits": (400, "seed", {"seed": 2**64, "temperature": 1.0}, {}),
    "unknown_model": (404, "model", {"model": "no-such-model"}, {}),
    "missing_api_key": (401, None, {}, {"Authorization": None}),
    "wrong_api_key": (401, None, {}, {"Authorization": "Bearer nope"}),
    "oversize_body": (413, None, {"messages": [{"role": "user", "content": "x" * (2 << 20)}]}, {}),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input(daemon, model_name, case):
    status_code, param, body, headers = BAD[case]
    all_headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    all_headers.update(headers)
    all_headers = {k: v for k, v in all_headers.items() if v is not None}
    if not isinstance(body, bytes):  # fields of a good request, replaced (or removed: None)
        body = {k: v for k, v in {**good_body(model_name), **body}.items() if v is not None}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = http("POST", daemon.url + "/v1/chat/completions", content, all_headers)
    assert resp.status_code == status_code, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"] and "\n" not in error["message"]
    assert error["param"] == param, error
    ok = http("POST", daemon.url + "/v1/chat/completions", json.dumps(good_body(model_name)).encode(),
              {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_unknown_route_is_json_404(daemon):
    resp = http("GET", daemon.url + "/v1/nothing-here", headers={"Authorization": f"Bearer {API_KEY}"})
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found_error"


def test_openai_client_sees_typed_errors(client, model_name):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_name, messages=[], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0).models.list()
