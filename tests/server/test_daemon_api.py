"""End to end: the real daemon (2 CPU workers, 2EPD) and the official OpenAI client."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import openai
import pytest
from PIL import Image

from daemon_process import HYDRACTL, REPO, Daemon, http, open_stream, shared_memory_descriptors, wait_for

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
    # OpenAI's retrieve: the same card by its id, a 404 for another.
    one = client.models.retrieve(model_name)
    assert (one.id, one.root, one.max_model_len) == (card.id, card.root, card.max_model_len)
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("nope")
    assert info.value.body["code"] == "model_not_found"


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


def processed_image_lookups(daemon) -> dict[str, float]:
    """The daemon's ``hydrad_processed_image_lookups_total`` by ``found``."""
    counts = {"true": 0.0, "false": 0.0}
    for line in http("GET", daemon.url + "/metrics").text.splitlines():
        if line.startswith("hydrad_processed_image_lookups_total{"):
            counts[line.split('found="')[1].split('"')[0]] += float(line.split()[-1])
    return counts


def test_a_repeated_chat_starts_from_its_cached_prefix(daemon, client, model_name, reference):
    """Asked again on the same instance, a conversation prefills only its last tokens and encodes
    none of its images, and still gives transformers' tokens; status and metrics count it."""
    api, hf, images = conversation()
    _, expected = reference_tokens(reference, hf, images, MAX_TOKENS)
    before = {i["id"]: (i["prefix_cache_hits"], i["prefix_cache_images"]) for i in status(daemon)["instances"]}
    found_before = processed_image_lookups(daemon)
    cached = []
    for _ in range(4):  # every instance serves it twice, whatever the router picks
        resp = client.chat.completions.create(model=model_name, messages=api, max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body={"return_token_ids": True})
        assert resp.choices[0].token_ids == expected
        cached.append(resp.usage.prompt_tokens_details.cached_tokens)
    # The usage says how much of the prompt was found cached: all but the last block, the second time.
    assert max(cached) >= resp.usage.prompt_tokens - 16 and max(cached) < resp.usage.prompt_tokens
    instances = status(daemon)["instances"]
    assert sum(i["prefix_cache_hits"] - before[i["id"]][0] for i in instances) >= resp.usage.prompt_tokens - 16
    assert sum(i["prefix_cache_images"] - before[i["id"]][1] for i in instances) >= 2
    assert all(i["num_kv_blocks_cached"] > 0 for i in instances if i["prefix_cache_hits"] > before[i["id"]][0])
    # The Request Processor found both images preprocessed in every send after the first.
    assert processed_image_lookups(daemon)["true"] - found_before["true"] >= 3 * len(images)
    text = http("GET", daemon.url + "/metrics").text
    hits = [float(line.split()[-1]) for line in text.splitlines() if line.startswith("hydrad_prefix_cache_hits_total{")]
    assert len(hits) == 2 and sum(hits) > 0
    # The request trace keeps it for the planner's replays.
    traced = [json.loads(line) for line in http("GET", daemon.url + "/admin/trace?limit=4").text.splitlines()]
    assert sorted(r["cached_tokens"] for r in traced) == sorted(cached)
    # and the Request Processor's own time on each (its images decoded and processed), apart
    # from the waits before it: what the planner replays as its service time
    assert all(0 < r["processing"] <= r["preprocess"] for r in traced), traced
    # and how many of its images the Request Processor found preprocessed (the planner replays
    # those turns at their own, cheaper, service time)
    assert sum(r.get("images_found", 0) for r in traced) >= 3 * len(images), traced
    # A request's completions are one group there (the planner replays them together); a
    # prompt's only completion has none.
    client.chat.completions.create(model=model_name, messages=api, max_tokens=2, n=3, temperature=1.0)
    traced = [json.loads(line) for line in http("GET", daemon.url + "/admin/trace?limit=4").text.splitlines()]
    groups = sorted((r.get("group") or "" for r in traced))
    assert groups[0] == "" and groups[1] and len(set(groups[1:])) == 1, traced


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


def test_completions_of_several_prompts_and_of_token_ids_match_transformers(client, model_name, reference):
    """``prompt`` as texts and token ids together, ``n`` completions of each, ``echo``: each
    completion's greedy tokens are transformers' for its prompt, its text begins with its
    prompt's, and the usage counts every prompt once."""
    import openai
    import torch

    model, processor = reference
    texts = ["The quick brown fox", "Once upon a time there"]
    ids = [processor.tokenizer(text)["input_ids"] for text in texts]
    expected = []
    for prompt_ids in ids:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=MAX_TOKENS)
        expected.append(out[0, len(prompt_ids):].tolist())
    prompts = [texts[0], ids[1]]  # a text and a prompt of token ids
    echoes = [texts[0], processor.tokenizer.decode(ids[1])]
    kwargs = dict(model=model_name, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0, n=2, echo=True)
    resp = client.completions.create(**kwargs, extra_body={"return_token_ids": True})
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    for c in resp.choices:
        assert c.token_ids == expected[c.index // 2], c.index
        assert c.text.startswith(echoes[c.index // 2]) and len(c.text) > len(echoes[c.index // 2])
    assert resp.usage.prompt_tokens == sum(len(i) for i in ids)
    assert resp.usage.completion_tokens == 2 * sum(len(e) for e in expected)
    streamed = ["", "", "", ""]
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in resp.choices]
    # Without echo, the answer alone; a token id past the vocabulary is refused by name.
    plain = client.completions.create(model=model_name, prompt=ids[1], max_tokens=MAX_TOKENS, temperature=0)
    assert resp.choices[2].text == echoes[1] + plain.choices[0].text
    with pytest.raises(openai.BadRequestError, match="outside the model's vocabulary") as info:
        client.completions.create(model=model_name, prompt=[ids[0], [10**6]], max_tokens=2)
    assert info.value.body["param"] == "prompt"


def test_tokenizer_routes_give_what_the_model_sees(daemon, client, model_name, reference):
    """vLLM's ``/tokenize``, ``/detokenize`` and ``/tokenizer_info``: a prompt's ids are the
    tokenizer's, messages' ids those a chat request is prefilled with (images as their
    placeholder runs: the chat's usage counts the same), ids decode back; bad bodies get a
    400 naming the field, and the API key guards them as it guards /v1."""
    _, processor = reference
    tokenizer = processor.tokenizer
    auth = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}

    def post(path, body, headers=auth):
        return http("POST", daemon.url + path, json.dumps(body).encode(), headers)

    text = "The quick brown fox"
    got = post("/tokenize", {"model": model_name, "prompt": text, "return_token_strs": True}).json()
    assert got["tokens"] == tokenizer(text)["input_ids"] and got["count"] == len(got["tokens"])
    assert got["token_strs"] == tokenizer.convert_ids_to_tokens(got["tokens"]) and got["max_model_len"] > 0
    bare = post("/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"] and bare["token_strs"] is None
    api, hf, images = conversation()
    chat_ids = post("/tokenize", {"messages": api}).json()["tokens"]
    template = processor.apply_chat_template(hf, add_generation_prompt=True)
    assert chat_ids == processor(text=template, images=images, return_tensors="pt")["input_ids"][0].tolist()
    reply = client.chat.completions.create(model=model_name, messages=api, max_tokens=1)
    assert reply.usage.prompt_tokens == len(chat_ids)
    assert post("/detokenize", {"tokens": bare["tokens"]}).json() == {"prompt": tokenizer.decode(bare["tokens"])}
    info = http("GET", daemon.url + "/tokenizer_info", headers=auth).json()
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == processor.chat_template
    for path, body, param in [("/tokenize", {"prompt": text, "messages": api}, "prompt"),
                              ("/tokenize", {"prompt": text, "truncate": 3}, "truncate"),
                              ("/tokenize", {"messages": api, "add_special_tokens": True}, "add_special_tokens"),
                              ("/tokenize", {"prompt": text, "model": "nope"}, "model"),
                              ("/detokenize", {"tokens": [10**6]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens")]:
        resp = post(path, body)
        assert resp.status_code in (400, 404) and resp.json()["error"]["param"] == param, (path, body, resp.json())
    assert post("/tokenize", {"prompt": text}, {"Content-Type": "application/json"}).status_code == 401
    assert http("GET", daemon.url + "/tokenizer_info").status_code == 401


def test_a_final_message_continued_and_the_templates_options(daemon, client, model_name, reference):
    """vLLM's chat template options on both routes that take messages: with
    ``continue_final_message`` the model continues an answer begun for it (greedy tokens as
    transformers' generate over the prompt the HF processor renders so), without the
    generation prompt the template adds no header; ``chat_template_kwargs`` the template does
    not read change nothing; options that cannot hold get a 400 naming the field."""
    import torch

    model, processor = reference
    auth = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}

    def post(path, body):
        return http("POST", daemon.url + path, json.dumps({"model": model_name, **body}).encode(), auth)

    begun = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    hf = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in begun]
    text = processor.apply_chat_template(hf, continue_final_message=True, tokenize=False)
    ids = processor(text=text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = model.generate(input_ids=ids, do_sample=False, max_new_tokens=6, min_new_tokens=6)[0, ids.shape[1]:]
    options = {"add_generation_prompt": False, "continue_final_message": True,
               "chat_template_kwargs": {"enable_thinking": False}}  # (a variable LLaVA's template does not read)
    got = post("/tokenize", {"messages": begun, **options}).json()
    assert got["tokens"] == ids[0].tolist()
    reply = post("/v1/chat/completions", {"messages": begun, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                          "return_token_ids": True, **options}).json()
    assert reply["choices"][0]["token_ids"] == expected.tolist() and reply["usage"]["prompt_tokens"] == ids.shape[1]
    # continue_final_message alone: no generation prompt unless asked for.
    assert post("/tokenize", {"messages": begun, "continue_final_message": True}).json()["tokens"] == got["tokens"]
    bare = post("/tokenize", {"messages": begun[:1], "add_generation_prompt": False}).json()["tokens"]
    assert bare == processor(text=processor.apply_chat_template(hf[:1], add_generation_prompt=False, tokenize=False),
                             return_tensors="pt")["input_ids"][0].tolist()
    for path, body, param in [
            ("/v1/chat/completions", {"messages": begun, "add_generation_prompt": True, "continue_final_message": True},
             "continue_final_message"),
            ("/v1/chat/completions", {"messages": begun[:1], "continue_final_message": True}, "messages"),
            ("/v1/chat/completions", {"messages": begun[:1], "chat_template_kwargs": {"tools": []}},
             "chat_template_kwargs"),
            ("/v1/chat/completions", {"messages": begun[:1], "chat_template_kwargs": [1]}, "chat_template_kwargs"),
            ("/tokenize", {"prompt": "hi", "continue_final_message": True}, "continue_final_message"),
            ("/tokenize", {"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
            ("/tokenize", {"messages": begun, "tools": [{"type": "function"}]}, "tools[0]")]:
        resp = post(path, body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (path, body, resp.json())


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


@pytest.fixture(scope="module")
def tokenizer(tiny_llava_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llava_dir)


def token_chunks(stream) -> list:
    """The choices of the chunks that carry tokens (not the usage chunk)."""
    return [c.choices[0] for c in stream if c.choices]


@pytest.mark.parametrize("chat", [True, False])
def test_forced_stream_has_one_chunk_per_token(client, model_name, chat):
    """Tokens without text of their own (special tokens, part of a character) still get a
    chunk, with empty content: 16 tokens, 16 chunks, as vLLM sends them."""
    common = dict(model=model_name, max_tokens=16, temperature=0, stream=True, extra_body={"ignore_eos": True})
    for i in range(3):
        if chat:
            choices = token_chunks(client.chat.completions.create(
                messages=[{"role": "user", "content": f"count {i}"}], **common))
            texts = [c.delta.content for c in choices]
        else:
            choices = token_chunks(client.completions.create(prompt=f"count {i}", **common))
            texts = [c.text for c in choices]
        assert len(choices) == 16 and all(isinstance(t, str) for t in texts), texts
        assert [c.finish_reason for c in choices] == [None] * 15 + ["length"]


def unfinished_character_case(client, model_name, tokenizer) -> tuple[str, list[int]]:
    """A prompt and a greedy output length whose last token stops inside a UTF-8 character."""
    for i in range(20):
        prompt = f"story {i}"
        resp = client.completions.create(model=model_name, prompt=prompt, max_tokens=48, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
        ids = resp.choices[0].token_ids
        for n in range(1, len(ids) + 1):
            if tokenizer.decode(ids[:n], skip_special_tokens=True).endswith("\ufffd"):
                return prompt, ids[:n]
    pytest.fail("no greedy output of the tiny model ends inside a character")


def test_text_is_the_decode_of_the_tokens_when_the_last_character_is_unfinished(client, model_name, tokenizer):
    prompt, ids = unfinished_character_case(client, model_name, tokenizer)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert expected.endswith("\ufffd")
    common = dict(model=model_name, prompt=prompt, max_tokens=len(ids), temperature=0,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
    whole = client.completions.create(**common).choices[0]
    assert whole.token_ids == ids and whole.text == expected
    choices = token_chunks(client.completions.create(stream=True, **common))
    assert [t for c in choices for t in c.token_ids] == ids
    assert "".join(c.text for c in choices) == expected


def test_continuous_usage_stats_count_tokens_per_chunk(client, model_name):
    stream = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert [c.usage.completion_tokens for c in chunks if c.choices] == [1, 2, 3, 4, 5, 6]
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 6
    assert len({c.usage.prompt_tokens for c in chunks}) == 1


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


def test_image_requests_leave_no_shared_memory_behind(daemon, client, model_name):
    """Each request's pixels are shared memory (a descriptor in the daemon); once it ends,
    whole, streamed, with n choices or its client gone, they are freed at once. They used to
    stay until a full garbage collection, hundreds of requests later (a request's stream and
    its completions refer to each other), and the last request's until the next message."""
    before = shared_memory_descriptors(daemon.process.pid)
    content = [{"type": "image_url", "image_url": {"url": data_url(PNG, "png")}},
               {"type": "text", "text": "What is it?"}]
    messages = [{"role": "user", "content": content}]
    for i in range(3):
        client.chat.completions.create(model=model_name, messages=messages, max_tokens=4, seed=i)
    client.chat.completions.create(model=model_name, messages=messages, max_tokens=4, n=2, seed=3)
    for i in range(2):
        assert [c for c in client.chat.completions.create(model=model_name, messages=messages, max_tokens=4,
                                                          stream=True)][-1].choices[0].finish_reason
    body = {"model": model_name, "messages": messages, "stream": True, "max_tokens": 400, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    conn, response = open_stream(daemon.url + "/v1/chat/completions", json.dumps(body).encode(), headers)
    response.close()
    conn.close()
    assert wait_for(lambda: shared_memory_descriptors(daemon.process.pid) == before, 10), \
        (shared_memory_descriptors(daemon.process.pid), before)


def test_rejections_are_counted_and_a_burst_of_them_logs_a_few_lines(daemon):
    """Every error answer counts in ``hydrad_requests_rejected_total`` by status and code; the
    log keeps a few lines of each kind per 10 s (an overload or a drain refuses every request,
    and each line would otherwise be one more in the journal's rate limit)."""
    import re

    def rejected() -> float:
        text = http("GET", daemon.url + "/metrics").text
        found = re.search(r'^hydrad_requests_rejected_total\{code="model_not_found",model_name="[^"]+",'
                          r'status="404"\} (\S+)$', text, re.M)
        return float(found.group(1)) if found else 0.0

    line = "POST /v1/chat/completions -> 404: The model `no-such-model-in-a-burst` does not exist."
    before, lines_before = rejected(), daemon.log().count(line)
    body = json.dumps({"model": "no-such-model-in-a-burst", "messages": [{"role": "user", "content": "hi"}]}).encode()
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    for _ in range(12):
        assert http("POST", daemon.url + "/v1/chat/completions", body, headers).status_code == 404
    assert rejected() == before + 12
    assert 1 <= daemon.log().count(line) - lines_before <= 5, daemon.log()[-3000:]


def test_metrics(daemon, client, model_name):
    client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    text = http("GET", daemon.url + "/metrics").text
    for name in ("hydrad_time_to_first_token_seconds_bucket", "hydrad_inter_token_latency_seconds_bucket",
                 "hydrad_e2e_request_latency_seconds_bucket", 'hydrad_stage_queue_time_seconds_count{model_name',
                 'hydrad_stage_exec_time_seconds_count{model_name', 'finish_reason="length"'):
        assert name in text, name
    for stage in ("prefill", "decode"):
        assert f'stage="{stage}"' in text
    # the daemon's own load: CPU per token, event-loop lag, step outputs waiting to be read
    for name in ("hydrad_daemon_cpu_seconds_per_token{", "hydrad_event_loop_lag_seconds_count{",
                 'hydrad_step_output_delay_seconds_count{instance="0"', 'hydrad_worker_link_unread_bytes{instance="1"',
                 "process_cpu_seconds_total"):
        assert name in text, name
    # the latency model's prediction against each step's measured time, per instance and stage
    assert 'hydrad_step_prediction_ratio_count{instance="' in text and 'stage="language"' in text
    counts = [float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("hydrad_step_prediction_ratio_count") and 'stage="language"' in line]
    assert counts and sum(counts) > 0
    # what each worker measured of its own steps against its model, by kind, as --validate reads it
    from hydrad.planner.validate import workers_speed

    reports = workers_speed(daemon.url)
    assert len(reports) == 2 and all(set(steps) == {"images", "prefills", "decodes"} for _, steps, _ in reports)
    assert all(set(factors) <= set(steps) and spread >= 0 for factors, steps, spread in reports)
    # each worker process's CPU time and memory, read by the daemon; the status says the same
    pids = {i["id"]: i["pid"] for i in status(daemon)["instances"]}
    for instance, pid in pids.items():
        cpu = metric_value(text, "hydrad_worker_cpu_seconds_total", instance)
        rss = metric_value(text, "hydrad_worker_resident_memory_bytes", instance)
        stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        assert 0 < cpu <= (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")  # the worker ran, and counts on
        assert 50 << 20 < rss < 8 << 30  # torch and the tiny model's weights, no more than a few GiB
        assert 0 <= metric_value(text, "hydrad_worker_shared_memory_bytes", instance) <= rss
    for i in status(daemon)["instances"]:
        assert i["rss_bytes"] > 50 << 20 and (i["cpu_share"] is None or 0 <= i["cpu_share"] < 8), i
        assert 0 <= i["shared_bytes"] <= i["rss_bytes"]
    for instance in ("0", "1"):
        assert f'hydrad_kv_cache_usage_ratio{{device="cpu",instance="{instance}"' in text
        assert f'hydrad_num_requests_running{{device="cpu",instance="{instance}"' in text
        assert f'hydrad_image_cache_usage_ratio{{device="cpu",instance="{instance}"' in text


def metric_value(text: str, name: str, instance: int) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name + "{") and f'instance="{instance}"' in line)
    return float(line.split()[-1])


def test_health(daemon):
    assert http("GET", daemon.url + "/health").status_code == 200


def test_hydractl_status_shows_both_instances(daemon):
    out = subprocess.run([sys.executable, *HYDRACTL, "status", "--url", daemon.url], capture_output=True,
                         text=True, timeout=60, cwd=REPO, env={"PYTHONPATH": str(REPO), "COLUMNS": "120",
                                                               "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    rows = [cells for cells in map(str.split, out.stdout.splitlines()) if len(cells) == 10 and cells[2] == "EPD"]
    assert [cells[:4] for cells in rows] == [["0", "cpu", "EPD", "ready"], ["1", "cpu", "EPD", "ready"]], out.stdout
    assert "TTFT p50" in out.stdout and "TBT p90" in out.stdout
    # the precision the models run in: the tiny checkpoint is stored in float32
    assert [i["dtype"] for i in status(daemon)["instances"]] == ["float32", "float32"]
    assert ", float32 (max_model_len" in out.stdout, out.stdout
    # each instance fitted its latency model at start, and says so with its bound and error
    text = " ".join(out.stdout.split())  # the instance lines as words: where they wrap does not matter
    assert text.count("steps up to 180.0 ms") == 2  # the TBT (0.2 s) less the 10% headroom, out.stdout
    assert text.count("held-out probes") == 2 and text.count("/image") == 2, out.stdout
    assert "daemon: " in text and "event-loop lag p99" in text, out.stdout
    # each worker process's CPU and memory (a status call samples them: two samples at least by now)
    assert len(re.findall(r"#\d EPD on 1 thread, \d+% of a core, [\d.]+ GiB resident", text)) == 2, out.stdout


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
    "empty_image_url": (400, "messages[0].content[0]", {"messages": image_message("")}, {}),
    "truncated_image": (400, "messages[0].content[0]", {"messages": image_message(data_url(PNG[:40], "png"))}, {}),
    "assistant_tool_calls": (400, "messages[1].tool_calls", {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    ]}, {}),
    # more text than 2048 tokens of this tokenizer can hold: refused before tokenizing
    "prompt_longer_than_the_context_holds": (400, "messages", {"messages": [{"role": "user", "content": "x" * 20000}]},
                                             {}),
    "beyond_context": (400, "max_tokens", {"max_tokens": 10**6}, {}),
    "max_tokens_zero": (400, "max_tokens", {"max_tokens": 0}, {}),
    "max_tokens_negative": (400, "max_completion_tokens", {"max_completion_tokens": -3}, {}),
    "temperature_high": (400, "temperature", {"temperature": 2.5}, {}),
    "temperature_negative": (400, "temperature", {"temperature": -0.1}, {}),
    "top_p_zero": (400, "top_p", {"top_p": 0}, {}),
    "top_p_high": (400, "top_p", {"top_p": 1.01}, {}),
    "seed_beyond_64_bits": (400, "seed", {"seed": 2**64, "temperature": 1.0}, {}),
    "n_zero": (400, "n", {"n": 0}, {}),
    "n_too_many": (400, "n", {"n": 17}, {}),
    "min_p_high": (400, "min_p", {"min_p": 1.5}, {}),
    "repetition_penalty_zero": (400, "repetition_penalty", {"repetition_penalty": 0}, {}),
    "presence_penalty_high": (400, "presence_penalty", {"presence_penalty": 2.5}, {}),
    "frequency_penalty_low": (400, "frequency_penalty", {"frequency_penalty": -2.5}, {}),
    "logit_bias_value": (400, "logit_bias", {"logit_bias": {"5": 150}}, {}),
    "logit_bias_token_outside_vocab": (400, "logit_bias", {"logit_bias": {"99999999": 1}}, {}),
    "min_tokens_over_max": (400, "min_tokens", {"min_tokens": 5}, {}),
    "top_logprobs_high": (400, "top_logprobs", {"logprobs": True, "top_logprobs": 21}, {}),
    "top_logprobs_without_logprobs": (400, "top_logprobs", {"top_logprobs": 2}, {}),
    "response_format_xml": (400, "response_format", {"response_format": {"type": "xml"}}, {}),
    "json_schema_invalid": (400, "response_format", {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}}, {}),
    "regex_invalid": (400, "structured_outputs", {"structured_outputs": {"regex": "a(b"}}, {}),
    # Compiles without a tokenizer; the worker's matcher, built with the model's, refuses it.
    "grammar_unknown_special_token": (400, "structured_outputs",
                                      {"structured_outputs": {"grammar": 'start: <|no_such_token|> "a"'}}, {}),
    # Tools without a tool_choice: "auto", which needs a model whose chat template asks for tool
    # calls in a format they can be read back in (the default model's has none).
    "tools_auto": (400, "tool_choice", {"tools": [{"type": "function", "function": {"name": "f"}}]}, {}),
    "tool_choice_unknown_function": (400, "tool_choice", {
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": {"type": "function", "function": {"name": "g"}}}, {}),
    "tool_parameters_invalid": (400, "tools", {
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
        "tool_choice": "required"}, {}),
    "tool_message": (400, "messages[1].role", {"messages": [
        {"role": "user", "content": "hi"}, {"role": "tool", "content": "42", "tool_call_id": "call_1"}]}, {}),
    "unknown_field": (400, "frobnicate", {"frobnicate": 1}, {}),
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
    assert " at 0x" not in error["message"]  # no Python object in a message
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


# -- sampling options over HTTP -----------------------------------------------------------------


def test_structured_outputs_over_http_are_the_engines_and_in_their_language(client, model_name, tiny_llava_dir):
    """response_format (json_schema, json_object) and vLLM's structured_outputs (choice, regex):
    greedy tokens equal the offline engine's (whose tokens equal transformers' masked by the
    same grammar, tests/engine/test_structured_outputs.py), whole and streamed; sampled
    answers stay in their language."""
    from hydrad import LLM, SamplingParams

    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}, {"json": schema},
         lambda text: json.loads(text)["answer"] in ("yes", "no")),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}, None),
        ({"structured_outputs": {"choice": ["red", "green"]}}, {"choice": ["red", "green"]},
         lambda text: text in ("red", "green")),
        ({"structured_outputs": {"regex": "[0-9]{2}-[a-z]"}}, {"regex": "[0-9]{2}-[a-z]"},
         lambda text: re.fullmatch("[0-9]{2}-[a-z]", text) is not None),
    ]
    messages = [{"role": "user", "content": "Answer in the format asked."}]
    llm = LLM(str(tiny_llava_dir), worker_processes=False)
    for body, language, check in cases:
        offline = llm.chat(messages, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                    structured_outputs=language))[0]
        reply = client.chat.completions.create(model=model_name, messages=messages, max_tokens=MAX_TOKENS,
                                               temperature=0, extra_body={**body, "return_token_ids": True})
        assert reply.choices[0].token_ids == offline.token_ids, body
        streamed = client.chat.completions.create(model=model_name, messages=messages, max_tokens=MAX_TOKENS,
                                                  temperature=0, stream=True, extra_body=body)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) \
            == reply.choices[0].message.content
        if check is not None:
            assert reply.choices[0].finish_reason == "stop" and check(reply.choices[0].message.content), body
            sampled = client.chat.completions.create(model=model_name, messages=messages, max_tokens=40,
                                                     temperature=1.0, n=4, seed=3, extra_body=body)
            for choice in sampled.choices:
                assert choice.finish_reason != "stop" or check(choice.message.content), (body, choice)
    completion = client.completions.create(model=model_name, prompt="Pick one:", max_tokens=MAX_TOKENS,
                                           temperature=0, extra_body={"structured_outputs": {"choice": ["a", "b"]}})
    assert completion.choices[0].text in ("a", "b")


def test_tool_calls_over_http_are_the_engines_answer_as_calls(client, model_name, tiny_llava_dir, tokenizer):
    """A named function's arguments and "required"'s calls are the offline engine's greedy answer
    in the language the tool choice makes (tokens equal), whole and streamed (the arguments
    streamed piece by piece add up to the whole answer's); sampled calls name the tools.
    Whitespace tokens are biased away (a random model, free to put whitespace between a JSON
    array's items, may put nothing else)."""
    from hydrad import LLM, SamplingParams
    from hydrad.server.tools import parse_tools

    no_space = {i: -100.0 for i in range(len(tokenizer)) if tokenizer.decode([i]) and not tokenizer.decode([i]).strip()}
    assert no_space

    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
            "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
    tools = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city.",
                                               "parameters": city}},
             {"type": "function", "function": {"name": "now", "parameters": {
                 "type": "object", "properties": {}, "additionalProperties": False}}}]
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    llm = LLM(str(tiny_llava_dir), worker_processes=False)
    # One call at most: the array then closes (a random model may repeat calls to max_tokens).
    single = {"parallel_tool_calls": False}
    for choice, max_tokens in (({"type": "function", "function": {"name": "weather"}}, 24), ("required", 64)):
        body = {"tools": tools, "tool_choice": choice, **single}
        language = parse_tools(body).language()
        offline = llm.chat(messages, SamplingParams(max_tokens=max_tokens, temperature=0.0, logit_bias=no_space,
                                                    structured_outputs=language))[0]
        reply = client.chat.completions.create(model=model_name, messages=messages, max_tokens=max_tokens,
                                               temperature=0, tools=tools, tool_choice=choice, logit_bias=no_space,
                                               parallel_tool_calls=False, extra_body={"return_token_ids": True})
        answer = reply.choices[0]
        assert answer.token_ids == offline.token_ids, choice
        calls = answer.message.tool_calls
        assert answer.message.content is None and calls, (choice, answer)
        if choice == "required":
            assert answer.finish_reason == "tool_calls" and offline.finish_reason == "stop"
            assert [{"name": c.function.name, "parameters": json.loads(c.function.arguments)} for c in calls] \
                == json.loads(offline.text)
            assert all(c.function.arguments in offline.text for c in calls)
        else:
            assert [c.function.name for c in calls] == ["weather"] and calls[0].function.arguments == offline.text
            assert answer.finish_reason == offline.finish_reason
        streamed = client.chat.completions.create(model=model_name, messages=messages, max_tokens=max_tokens,
                                                  temperature=0, tools=tools, tool_choice=choice, stream=True,
                                                  logit_bias=no_space, parallel_tool_calls=False)
        got, finish = {}, None
        for chunk in streamed:
            for delta_call in chunk.choices[0].delta.tool_calls or []:
                if delta_call.id is not None:
                    got[delta_call.index] = [delta_call.id, delta_call.function.name, ""]
                got[delta_call.index][2] += delta_call.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert [(name, args) for _, name, args in got.values()] == [(c.function.name, c.function.arguments)
                                                                   for c in calls]
        assert finish == answer.finish_reason
    sampled = client.chat.completions.create(model=model_name, messages=messages, max_tokens=64, temperature=1.0,
                                             n=4, seed=5, tools=tools, tool_choice="required", logit_bias=no_space,
                                             parallel_tool_calls=False)
    for answer in sampled.choices:
        assert answer.finish_reason == "tool_calls", answer
        (call,) = answer.message.tool_calls
        assert call.function.name in ("weather", "now") and isinstance(json.loads(call.function.arguments), dict)


def test_n_completions_whole_and_streamed(client, model_name):
    messages = [{"role": "user", "content": "Tell me a story."}]
    reply = client.chat.completions.create(model=model_name, messages=messages, max_tokens=6, n=3, seed=11,
                                           extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.message.content for c in reply.choices}) > 1  # independent samples
    assert reply.usage.completion_tokens == 18 and reply.usage.prompt_tokens > 0
    stream = client.chat.completions.create(model=model_name, messages=messages, max_tokens=6, n=3, seed=11,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
    tokens, finishes, usage = {0: [], 1: [], 2: []}, {}, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            tokens[c.index] += c.model_extra.get("token_ids") or []
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert {i: len(t) for i, t in tokens.items()} == {0: 6, 1: 6, 2: 6}
    assert finishes == {0: "length", 1: "length", 2: "length"} and usage.completion_tokens == 18


def test_chat_logprobs_whole_and_streamed(client, model_name, reference):
    messages = [{"role": "user", "content": "Name three colours."}]
    reply = client.chat.completions.create(model=model_name, messages=messages, max_tokens=5, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        # greedy: the sampled token is the most likely one
        assert entry.token == entry.top_logprobs[0].token and entry.logprob == entry.top_logprobs[0].logprob
        assert entry.bytes == list(entry.token.encode())
    stream = client.chat.completions.create(model=model_name, messages=messages, max_tokens=5, temperature=0,
                                            logprobs=True, stream=True)
    streamed = [lp for chunk in stream for c in chunk.choices if c.logprobs for lp in c.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(e.top_logprobs == [] for e in streamed)


def test_echo_with_logprobs_prices_the_prompt_as_transformers_does(client, daemon, model_name, reference):
    """``echo`` and ``logprobs``: the prompt's tokens come first in the legacy ``logprobs``,
    each with its log-probability given the ones before it (transformers' forward over the
    prompt), the first with none; then the generated tokens'. Whole and streamed alike."""
    import torch

    model, processor = reference
    prompt = "Once upon a time there was"
    ids = processor.tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        raw = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    name = processor.tokenizer.decode
    kwargs = dict(model=model_name, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    reply = client.completions.create(**kwargs)
    lp = reply.choices[0].logprobs
    assert lp.tokens[:len(ids)] == [name([t]) for t in ids] and len(lp.tokens) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for position in range(1, len(ids)):
        assert lp.token_logprobs[position] == pytest.approx(raw[position - 1, ids[position]].item(), abs=1e-4)
        top = raw[position - 1].topk(2)
        assert lp.top_logprobs[position] == pytest.approx({name([t]): v for t, v in
                                                           zip(top.indices.tolist(), top.values.tolist())}, abs=1e-4)
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[len(ids):])
    assert reply.choices[0].text.startswith(prompt)
    streamed = [c.choices[0].logprobs for c in client.completions.create(**kwargs, stream=True) if c.choices[0].logprobs]
    assert [t for chunk in streamed for t in chunk.tokens] == lp.tokens
    assert [v for chunk in streamed for v in chunk.token_logprobs] == lp.token_logprobs
    # As evaluation harnesses ask for a text's log-likelihood: several prompts of token ids,
    # one token each, the prompt's log-probabilities read back by position.
    batch = client.completions.create(model=model_name, prompt=[ids[:4], ids], max_tokens=1, temperature=0,
                                      echo=True, logprobs=1)
    assert [len(c.logprobs.token_logprobs) for c in sorted(batch.choices, key=lambda c: c.index)] == [5, len(ids) + 1]
    assert batch.choices[1].logprobs.token_logprobs[:len(ids)] == pytest.approx(lp.token_logprobs[:len(ids)], abs=1e-5)
    # The trace marks them as scoring requests: the planner replays their priced prefills.
    traced = [json.loads(line) for line in http("GET", daemon.url + "/admin/trace?limit=3").text.splitlines()]
    assert [r.get("prompt_logprobs", False) for r in traced] == [True] * 3, traced
    # n completions of a prompt: each begins with the prompt's log-probabilities; in a whole
    # answer one completion computed them (the trace marks one of the two), streamed each did.
    pair = client.completions.create(**kwargs, n=2)
    for c in pair.choices:
        assert c.logprobs.token_logprobs[:len(ids)] == pytest.approx(lp.token_logprobs[:len(ids)], abs=1e-5)
    traced = [json.loads(line) for line in http("GET", daemon.url + "/admin/trace?limit=2").text.splitlines()]
    assert sorted(r.get("prompt_logprobs", False) for r in traced) == [False, True], traced
    streamed = {}
    for chunk in client.completions.create(**kwargs, n=2, stream=True):
        for c in chunk.choices:
            if c.logprobs:
                streamed.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
    for i in (0, 1):
        assert streamed[i][:len(ids)] == pytest.approx(lp.token_logprobs[:len(ids)], abs=1e-5)
    client.completions.create(model=model_name, prompt=prompt, max_tokens=1, temperature=0)
    (plain,) = [json.loads(line) for line in http("GET", daemon.url + "/admin/trace?limit=1").text.splitlines()]
    assert "prompt_logprobs" not in plain


def test_vllms_prompt_logprobs_on_both_routes(daemon, model_name, reference):
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, then its id and the
    most likely ids mapped to their log-probability, rank and text; on a text completion's
    choices, and beside a chat answer's choices. The tokens' own logprobs only where asked;
    refused with a stream, as vLLM refuses it."""
    import torch

    model, processor = reference
    auth = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}

    def post(path, body):
        return http("POST", daemon.url + path, json.dumps({"model": model_name, **body}).encode(), auth)

    def check(prompt_logprobs, ids):
        with torch.no_grad():
            raw = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
        assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
        for position, entry in enumerate(prompt_logprobs[1:], start=1):
            row, token = raw[position - 1], ids[position]
            assert entry[str(token)]["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
            assert entry[str(token)]["rank"] == int((row > row[token]).sum()) + 1
            assert entry[str(token)]["decoded_token"] == processor.tokenizer.decode([token])
            top = row.topk(2)
            for rank, (t, value) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
                assert entry[str(t)]["rank"] == rank and entry[str(t)]["logprob"] == pytest.approx(value, abs=1e-4)

    prompt = "Once upon a time there was"
    ids = processor.tokenizer(prompt)["input_ids"]
    reply = post("/v1/completions", {"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2}).json()
    choice = reply["choices"][0]
    assert choice["logprobs"] is None  # not asked for
    check(choice["prompt_logprobs"], ids)
    # Each of n completions carries them (one computed them for both).
    pair = post("/v1/completions", {"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2, "n": 2}).json()
    assert len(pair["choices"]) == 2
    for c in pair["choices"]:
        check(c["prompt_logprobs"], ids)
    messages = [{"role": "user", "content": "Name three colours."}]
    chat = post("/v1/chat/completions", {"messages": messages, "max_tokens": 2, "prompt_logprobs": 2,
                                         "logprobs": True}).json()
    template = processor.apply_chat_template(messages, add_generation_prompt=True)
    check(chat["prompt_logprobs"], processor(text=template, return_tensors="pt")["input_ids"][0].tolist())
    assert len(chat["choices"][0]["logprobs"]["content"]) == chat["usage"]["completion_tokens"]
    streamed = post("/v1/completions", {"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 1, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
    too_many = post("/v1/completions", {"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 21})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt_logprobs"


def test_completion_logprobs_in_the_legacy_shape(client, model_name):
    reply = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=4, temperature=0,
                                      logprobs=2)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    assert "".join(lp.tokens).startswith(reply.choices[0].text[:1]) or reply.choices[0].text == ""
