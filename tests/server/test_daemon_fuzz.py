"""Random traffic against a live daemon with small caches (tiny LLaVA, ``1EP+1EPD``), redeployed
while it serves, then one of its workers killed: every valid request gets a well-formed
answer (those on the killed worker run again), every invalid one an OpenAI-style 4xx, none a
5xx, clients that leave change nothing for the others, and once the traffic ends no instance
holds a block.

The requests come from a seeded generator (the same ones every run): 0-2 images of 16-640 px,
system prompts and earlier turns, ``n`` up to 3, log-probabilities, stop strings, penalties,
logit bias, seeds, ``min_tokens``, ``ignore_eos``, streamed or not; some are abandoned after
a few chunks or a short timeout; about one in seven is invalid (bad JSON, a missing field, an
undecodable image, out-of-range parameters, an unknown model, too many images, too long).
Where each abandoned one is when its client leaves depends on timing; what is checked does
not.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import random
import re
import signal

import aiohttp
import numpy as np
import pytest
from PIL import Image

from daemon_process import Daemon, blocks_held_once_freed, http, wait_for

pytestmark = pytest.mark.slow

CLIENTS = 16
REQUESTS_PER_CLIENT = 12
WORDS = "the a cat dog sat on mat and ran far away from home to see red blue green sky".split()
# 60 blocks of 4 tokens: contexts of 240 tokens (longer requests are refused before streaming).
CONFIG = """
[slo]
ttft = 5.0
tbt = 0.5

[cache]
kv_block_size = 4
num_kv_blocks = 60
num_image_blocks = 3

[scheduler]
token_budget = 32
"""


@pytest.fixture(scope="module")
def daemon(tiny_llava_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    (tmp / "hydrad.toml").write_text(CONFIG)
    d = Daemon(["--model", str(tiny_llava_dir), "--config", str(tmp / "hydrad.toml"), "--devices", "cpu:2",
                "--deploy", "1EP+1EPD"], tmp / "hydrad.log")
    yield d
    assert d.stop() == 0, d.log()


def _text(rng: random.Random, words: int | None = None) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words or rng.randint(1, 30)))


def _image_url(rng: random.Random) -> str:
    w, h = rng.randint(16, 640), rng.randint(16, 640)
    pixels = np.random.default_rng(rng.randrange(1 << 30)).integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf, kind = io.BytesIO(), rng.choice(["JPEG", "PNG"])
    Image.fromarray(pixels).save(buf, kind)
    return f"data:image/{kind.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def _sampling(rng: random.Random, body: dict, chat: bool) -> None:
    for key, p, values in [("temperature", 0.5, [0.0, 0.5, 1.0, 1.5]), ("top_p", 0.3, [0.1, 0.9]),
                           ("top_k", 0.3, [-1, 1, 5, 50]), ("min_p", 0.2, [0.05]), ("n", 0.3, [1, 2, 3]),
                           ("stop", 0.2, ["a", ["the", "dog"], "\n"]), ("presence_penalty", 0.2, [-1.0, 2.0]),
                           ("frequency_penalty", 0.2, [-0.5, 1.0]), ("repetition_penalty", 0.1, [1.3]),
                           ("ignore_eos", 0.3, [True]), ("return_token_ids", 0.5, [True])]:
        if rng.random() < p:
            body[key] = rng.choice(values)
    if rng.random() < 0.3:
        body["seed"] = rng.randrange(1 << 31)
    if rng.random() < 0.1:
        body["logit_bias"] = {str(rng.randrange(500)): rng.choice([-100, 5, 100])}
    if rng.random() < 0.2:
        body["min_tokens"] = rng.randint(0, body["max_tokens"])
    if rng.random() < 0.3:
        if chat:
            body["logprobs"] = True
            if rng.random() < 0.5:
                body["top_logprobs"] = rng.randint(0, 5)
        else:
            body["logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.5:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}


def _valid(rng: random.Random) -> tuple[str, dict]:
    if rng.random() < 0.2:
        body = {"prompt": _text(rng), "max_tokens": rng.randint(1, 40)}
        _sampling(rng, body, chat=False)
        return "/v1/completions", body
    content = [{"type": "image_url", "image_url": {"url": _image_url(rng)}} for _ in range(rng.randint(0, 2))]
    content.append({"type": "text", "text": _text(rng)})
    rng.shuffle(content)
    messages = [{"role": "system", "content": _text(rng)}] if rng.random() < 0.3 else []
    if rng.random() < 0.3:
        messages += [{"role": "user", "content": _text(rng)}, {"role": "assistant", "content": _text(rng)}]
    body = {"messages": messages + [{"role": "user", "content": content}], "max_tokens": rng.randint(1, 40)}
    _sampling(rng, body, chat=True)
    if rng.random() < 0.2:
        body = _as_responses(body)
        if rng.random() < 0.4:
            # Answered queued, then polled; streamed, its events (or cancelled: ``leave``).
            body["background"] = True
        return "/v1/responses", body
    return "/v1/chat/completions", body


def _as_responses(chat: dict) -> dict:
    """A chat request as the Responses API says it (one completion, no log-probabilities)."""
    messages = chat["messages"]
    body = {k: v for k, v in chat.items() if k not in ("messages", "max_tokens", "n", "logprobs", "top_logprobs",
                                                        "return_token_ids", "stream_options")}
    if messages[0]["role"] == "system":
        body["instructions"] = messages[0]["content"]
        messages = messages[1:]

    def part(p: dict) -> dict:
        if p["type"] == "text":
            return {"type": "input_text", "text": p["text"]}
        return {"type": "input_image", "image_url": p["image_url"]["url"]}

    body["input"] = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                      else [part(p) for p in m["content"]]} for m in messages]
    body["max_output_tokens"] = chat["max_tokens"]
    return body


def _invalid(rng: random.Random) -> tuple[str, dict | bytes]:
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    garbage = "data:image/png;base64," + base64.b64encode(b"garbage" * 10).decode()
    return rng.choice([
        ("/v1/chat/completions", b"{not json"),
        ("/v1/chat/completions", {"max_tokens": 3}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": garbage}}]}]}),
        ("/v1/chat/completions", {**base, "temperature": -1}),
        ("/v1/chat/completions", {**base, "n": 0}),
        ("/v1/chat/completions", {**base, "max_tokens": 10 ** 6}),
        ("/v1/chat/completions", {**base, "model": "nope"}),
        ("/v1/chat/completions", {**base, "logprobs": True, "top_logprobs": 99}),
        ("/v1/chat/completions", {**base, "messages": [{"role": "wizard", "content": "x"}]}),
        ("/v1/chat/completions", {**base, "bogus_field": 1}),
        ("/v1/completions", {"prompt": "", "max_tokens": 3}),
        ("/v1/chat/completions", {**base, "messages": [{"role": "user", "content": _text(rng, 3000)}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": garbage}}] * 40}], "max_tokens": 2}),
        ("/v1/chat/completions", {**base, "stop": ["x"] * 100}),
        ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": garbage}]}]}),
        ("/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}),
        ("/v1/responses", {"input": [{"type": "function_call"}]}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 0}),
    ])


def _check_error(status: int, data, what: str, problems: list[str]) -> None:
    if not 400 <= status < 500:
        problems.append(f"{what}: status {status}: {str(data)[:200]}")
    elif not (isinstance(data, dict) and isinstance(data.get("error"), dict) and data["error"].get("message")):
        problems.append(f"{what}: not an OpenAI error body: {str(data)[:200]}")


def _check_choice(body: dict, finish: str | None, ids: list[int] | None, problems: list[str]) -> int:
    """Checks one completion; returns its token count (0 without ``return_token_ids``)."""
    if finish not in ("stop", "length"):
        problems.append(f"finish_reason {finish!r}: {json.dumps(body)[:200]}")
    if not body.get("return_token_ids"):
        return 0
    if ids is None:
        problems.append("no token_ids")
        return 0
    limit = body["max_tokens"]
    if len(ids) > limit or (finish == "length" and len(ids) != limit):
        problems.append(f"{len(ids)} tokens, finish {finish}, max_tokens {limit}")
    if body.get("ignore_eos") and not body.get("stop") and finish != "length":
        problems.append(f"ignore_eos without stop strings ended with {finish}")
    if finish != "stop" and len(ids) < body.get("min_tokens", 0):
        problems.append(f"{len(ids)} tokens under min_tokens {body['min_tokens']}")
    return len(ids)


async def _one(session: aiohttp.ClientSession, url: str, rng: random.Random, problems: list[str],
               counts: dict[str, int]) -> None:
    def count(kind: str) -> None:
        counts[kind] = counts.get(kind, 0) + 1

    if rng.random() < 0.15:
        path, body = _invalid(rng)
        send = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) \
            else {"json": body}
        async with session.post(url + path, **send) as response:
            text = await response.text()
            try:
                data = json.loads(text)
            except ValueError:
                data = text
            _check_error(response.status, data, f"invalid {str(body)[:60]}", problems)
        return count("invalid")
    path, body = _valid(rng)
    leave = rng.random() < 0.15
    # A client that leaves a whole answer gives up after a short timeout; one that leaves a
    # stream, after a few chunks; one that leaves a background response cancels it. An
    # answer that comes first is checked as any other.
    timeout = aiohttp.ClientTimeout(total=rng.uniform(0.01, 0.3)) \
        if leave and not body.get("stream") and not body.get("background") else None
    chunks_before_leaving = rng.randint(1, 4)
    try:
        await _answer(session, url + path, body, timeout, leave, chunks_before_leaving, problems, count)
    except asyncio.TimeoutError:
        if timeout is None:  # the session's 300 s: no answer at all
            problems.append(f"no answer: {json.dumps(body)[:200]}")
        else:
            count("left")


async def _answer(session: aiohttp.ClientSession, url: str, body: dict, timeout, leave: bool,
                  chunks_before_leaving: int, problems: list[str], count) -> None:
    async with session.post(url, json=body, **({"timeout": timeout} if timeout else {})) as response:
        if response.status != 200:
            text = await response.text()
            if response.status == 400 and "maximum context length" in text:
                return count("too long")  # prompt + max_tokens over the caches' 240 tokens
            problems.append(f"valid request got {response.status}: {text[:200]} {json.dumps(body)[:200]}")
            return
        if "input" in body:
            return await _responses_answer(session, url, response, body, leave, chunks_before_leaving, problems,
                                           count)
        n = body.get("n", 1)
        if not body.get("stream"):
            data = await response.json()
            if len(data["choices"]) != n:
                problems.append(f"{len(data['choices'])} choices for n={n}")
            total = sum(_check_choice(body, c["finish_reason"], c.get("token_ids"), problems) for c in data["choices"])
            if body.get("return_token_ids") and data["usage"]["completion_tokens"] != total:
                problems.append(f"usage {data['usage']['completion_tokens']} != {total} tokens")
            return count("whole")
        finish, ids, done, chunks = {}, {}, False, 0
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                problems.append(f"error event {event['error']}")
                return
            for c in event.get("choices", []):
                finish[c["index"]] = c.get("finish_reason") or finish.get(c["index"])
                ids.setdefault(c["index"], []).extend(c.get("token_ids") or [])
            chunks += 1
            if leave and chunks >= chunks_before_leaving:
                return count("left")  # closing the response drops the connection mid-stream
        if not done or len(finish) != n:
            problems.append(f"stream ended without [DONE] or with {len(finish)} of {n} completions")
        for index, reason in finish.items():
            _check_choice(body, reason, ids.get(index) if body.get("return_token_ids") else None, problems)
        count("streamed")


async def _responses_answer(session, url: str, response, body: dict, leave: bool, chunks_before_leaving: int,
                            problems: list[str], count) -> None:
    """A Responses API answer: a response that completed, or stopped at ``max_output_tokens``,
    with at most that many tokens; streamed, its events numbered from 0 and ending with it. A
    background one: queued, then polled until it ends so, or (``leave``) cancelled: answered
    cancelled, or refused as already ended."""
    limit = body["max_output_tokens"]
    streamed = body.get("stream")
    if body.get("background"):
        events = []
        if streamed:
            async for raw in response.content:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if leave and len(events) >= chunks_before_leaving:
                        break
            created = events[0]["response"] if events else {}
        else:
            created = await response.json()
        if created.get("status") != "queued":
            problems.append(f"background response created {created.get('status')}")
            return
        where = f"{url}/{created['id']}"
        if leave:
            await asyncio.sleep(0.01 * chunks_before_leaving)
            async with session.post(where + "/cancel") as cancelled:
                answer = await cancelled.json()
                if not (cancelled.status == 200 and answer["status"] == "cancelled"
                        or cancelled.status == 400 and "already" in answer["error"]["message"]):
                    problems.append(f"cancel answered {cancelled.status}: {answer}")
            return count("cancelled")
        for _ in range(0 if streamed else 600):
            async with session.get(where) as polled:
                final = await polled.json()
            if final.get("status") not in ("queued", "in_progress"):
                break
            await asyncio.sleep(0.05)
    elif not streamed:
        data = await response.json()
        final = data
    else:
        events = []
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if leave and len(events) >= chunks_before_leaving:
                    return count("left")
    if streamed:
        if [e.get("sequence_number") for e in events] != list(range(len(events))):
            problems.append(f"responses events out of order: {[e.get('type') for e in events][:20]}")
        if not events or events[-1]["type"] not in ("response.completed", "response.incomplete"):
            problems.append(f"responses stream ended with {events[-1] if events else None}")
            return
        final = events[-1]["response"]
    usage = final.get("usage") or {}
    if final.get("status") not in ("completed", "incomplete") or not 0 < usage.get("output_tokens", 0) <= limit:
        problems.append(f"response {final.get('status')} with usage {usage}, max_output_tokens {limit}")
    elif final["status"] == "incomplete" and usage["output_tokens"] != limit:
        problems.append(f"incomplete after {usage['output_tokens']} of {limit} tokens")
    count("responses")


async def _client(url: str, seed: int, problems: list[str], counts: dict[str, int]) -> None:
    rng = random.Random(seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        for _ in range(REQUESTS_PER_CLIENT):
            try:
                await _one(session, url, rng, problems, counts)
            except aiohttp.ClientError as e:
                problems.append(f"client error {type(e).__name__}: {e}")


def test_random_traffic_through_a_redeploy_and_a_killed_worker_gets_well_formed_answers(daemon):
    problems: list[str] = []
    counts: dict[str, int] = {}
    redeploys: list[int] = []

    def redeploy() -> None:  # 1EP+1EPD -> 1EP+1D -> back, while the clients send
        for deploy in ("1EP+1D", "1EP+1EPD"):
            reply = http("POST", daemon.url + "/admin/redeploy", json.dumps({"deploy": deploy}).encode(),
                         {"Content-Type": "application/json"}, timeout=120)
            redeploys.append(reply.status_code)

    def kill_a_worker() -> int:
        pid = http("GET", daemon.url + "/admin/status").json()["instances"][0]["pid"]
        os.kill(pid, signal.SIGKILL)
        return pid

    async def main() -> int:
        clients = [asyncio.ensure_future(_client(daemon.url, seed, problems, counts)) for seed in range(CLIENTS)]
        loop = asyncio.get_running_loop()
        await asyncio.sleep(2.0)
        await loop.run_in_executor(None, redeploy)
        await asyncio.sleep(1.0)
        killed = await loop.run_in_executor(None, kill_a_worker)
        await asyncio.gather(*clients)
        return killed

    killed = asyncio.run(main())
    assert problems == [], problems[:10]
    assert redeploys == [200, 200]
    # The supervisor notices the death on its own (the clients may all have finished before).
    assert wait_for(lambda: f"pid {killed}) is down" in daemon.log(), 30), daemon.log()
    assert wait_for(lambda: http("GET", daemon.url + "/health").status_code == 200, 30), daemon.log()
    metrics = http("GET", daemon.url + "/metrics").text
    assert re.search(r'^hydrad_requests_lost_total\{model_name="[^"]+"\} 0\.0$', metrics, re.M), metrics
    assert sum(counts.values()) == CLIENTS * REQUESTS_PER_CLIENT
    # Each kind of outcome came up (the generator is seeded: these are not left to chance).
    assert all(counts.get(kind, 0) >= 5 for kind in ("invalid", "left", "whole", "streamed", "responses")), counts
    assert counts.get("cancelled", 0) >= 1, counts
    assert blocks_held_once_freed(daemon, 10) == [(0, 0)] * 2
    status = http("GET", daemon.url + "/admin/status").json()
    assert all(i["num_running"] == 0 and i["num_waiting"] == 0 for i in status["instances"])

    # Once every request has ended (an abandoned one's handler only learns it when it writes),
    # the request path's memory budgets hold nothing: kept responses, refused and abandoned
    # requests included.
    def budgets_free() -> bool:
        text = http("GET", daemon.url + "/metrics").text
        return all(re.search(rf'^{budget}\{{model_name="[^"]+"\}} 0\.0$', text, re.M)
                   for budget in ("hydrad_request_body_bytes_in_use", "hydrad_decoded_image_bytes_in_use"))

    assert status["responses"]["background_running"] == 0  # each ended: answered, failed or cancelled
    assert wait_for(budgets_free, 10), [line for line in http("GET", daemon.url + "/metrics").text.splitlines()
                                        if "_in_use" in line]
    assert "Traceback" not in daemon.log()
