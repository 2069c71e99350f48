"""End to end under load: 64 concurrent requests through 1E+1P+1D worker processes with
small caches everywhere all finish right and leave no block held; ``hydractl bench``'s
library runs against the same live daemon."""

from __future__ import annotations

import asyncio

import openai
import pytest

from daemon_process import Daemon, blocks_held_once_freed, http
from test_daemon_api import PNG, data_url
from test_daemon_deployments import MAX_TOKENS, _requests
from test_daemon_deployments import reference  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def daemon(tiny_llava_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stress")
    config = tmp / "hydrad.toml"
    # Caches a few requests wide: the load only fits by queueing, pulling late and preempting.
    config.write_text("""
[cache]
kv_block_size = 4
num_kv_blocks = 64
num_image_blocks = 3

[scheduler]
derive_budgets = false
token_budget = 32
image_budget = 2
""")
    d = Daemon(["--model", str(tiny_llava_dir), "--config", str(config), "--devices", "cpu:3",
                "--deploy", "1E+1P+1D"], tmp / "hydrad.log")
    yield d
    assert d.stop() == 0, d.log()


def test_64_concurrent_requests_through_small_caches(daemon, reference):  # noqa: F811
    client = openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0, timeout=300)
    requests = (_requests() * 13)[:64]

    async def ask(messages):
        stream = await client.chat.completions.create(
            model=(await client.models.list()).data[0].id, messages=messages, max_tokens=MAX_TOKENS,
            temperature=0, stream=True, extra_body={"return_token_ids": True},
        )
        tokens = []
        async for chunk in stream:
            if chunk.choices:
                tokens += chunk.choices[0].model_extra.get("token_ids") or []
        return tokens

    async def main():
        return await asyncio.gather(*(ask(api) for api, _, _ in requests))

    got = asyncio.run(main())
    for i, tokens in enumerate(got):
        assert tokens == reference[i % len(reference)], f"request {i}"
    assert blocks_held_once_freed(daemon, 5) == [(0, 0)] * 3


def test_bench_library_against_live_daemon(daemon):
    from hydrad.bench.config import SLO, BenchConfig
    from hydrad.bench.runner import run_bench

    result = run_bench(BenchConfig(url=daemon.url, slo=SLO(ttft=30.0, tbt=5.0), workload="pope",
                                   num_requests=8, rates=(8.0,), seed=1))
    summary = result.summary
    assert summary.errors == 0 and summary.num_requests == 8
    assert summary.attainment == 1.0  # generous SLO: every request must meet it
    assert all(r.output_tokens >= 1 and r.ttft is not None and r.ttft <= r.e2e for r in result.runs[0].results)
    body = result.to_dict()
    assert set(body["summary"]) >= {"ttft_p50", "tbt_p90", "e2e_p99", "attainment", "goodput_rps", "errors"}
    # the daemon counted what the bench sent
    assert 'finish_reason="length"' in http("GET", daemon.url + "/metrics").text


def test_bench_library_sends_a_scoring_line_whole_beside_streams(daemon, tmp_path):
    """A workload line with ``prompt_logprobs`` (a trace's scoring request) goes out as one:
    unstreamed (the daemon, as vLLM, refuses prompt log-probabilities on a stream), its one
    token counted, its TTFT its end-to-end time; the streamed lines beside it keep their gaps.
    A line with ``n`` goes out whole too, every completion's tokens counted."""
    import json

    from hydrad.bench.config import SLO, BenchConfig
    from hydrad.bench.runner import run_bench

    workload = tmp_path / "scoring.jsonl"
    workload.write_text("\n".join(json.dumps(line) for line in [
        {"prompt_tokens": 40, "output_tokens": 1, "prompt_logprobs": True},
        {"prompt_tokens": 12, "images": [{"width": 64, "height": 48}], "output_tokens": 3},
        {"prompt_tokens": 12, "images": [{"width": 64, "height": 48}], "output_tokens": 2, "n": 4},
    ]) + "\n")
    result = run_bench(BenchConfig(url=daemon.url, slo=SLO(ttft=30.0, tbt=5.0), workload=str(workload),
                                   num_requests=9, rates=(8.0,), seed=1))
    results = result.runs[0].results
    assert result.summary.errors == 0, [r.error for r in results]
    scoring = [r for r in results if r.output_tokens == 1]
    streamed = [r for r in results if r.output_tokens == 3]
    several = [r for r in results if r.output_tokens == 8]
    assert len(scoring) == len(streamed) == len(several) == 3
    assert all(r.tbts == () and r.ttft == r.e2e for r in scoring + several), [(r.tbts, r.ttft, r.e2e) for r in scoring + several]
    assert all(len(r.tbts) == 2 for r in streamed)


def test_disconnects_at_every_stage_free_every_instance(daemon):
    """Clients that leave before the first token (encode, E->P, prefill), right after it
    (P->D) or mid-decode: every instance ends up holding no block."""
    import aiohttp

    api = [m for m, _, _ in _requests()]

    async def leave_after(session, messages, num_chunks, delay):
        # Long enough to be mid-decode after 20 chunks, within the 256 tokens the caches hold.
        body = {"model": "x", "messages": messages, "max_tokens": 120, "ignore_eos": True, "stream": True,
                "temperature": 0}
        models = await (await session.get(daemon.url + "/v1/models")).json()
        body["model"] = models["data"][0]["id"]
        async with session.post(daemon.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            seen = 0
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    seen += 1
                if seen >= num_chunks:
                    break
            assert seen >= num_chunks  # the stream ran until the client left (no error event ended it)
            await asyncio.sleep(delay)
        # leaving the block closes the connection mid-stream

    async def main():
        async with aiohttp.ClientSession() as session:
            jobs = [leave_after(session, api[i % len(api)], n, d)
                    for i, (n, d) in enumerate([(0, 0.0), (0, 0.05), (1, 0.0), (1, 0.02), (5, 0.0), (20, 0.0)] * 3)]
            await asyncio.gather(*jobs)

    asyncio.run(main())
    assert blocks_held_once_freed(daemon, 10) == [(0, 0)] * 3
    status = http("GET", daemon.url + "/admin/status").json()
    assert all(i["num_running"] == 0 and i["num_waiting"] == 0 for i in status["instances"])


def test_the_context_is_what_the_kv_caches_hold_and_longer_streams_are_refused_before_they_open(daemon):
    """64 KV blocks of 4 tokens hold 256 tokens, fewer than the model's context: the daemon
    serves 256 and refuses a longer request, streamed or not, with a 400 before any event
    (it used to open the stream and fail it from the worker), as it refuses images that its
    image caches could never hold; a request that fits still runs."""
    import json

    card = http("GET", daemon.url + "/v1/models").json()["data"][0]
    assert card["max_model_len"] == 64 * 4
    assert http("GET", daemon.url + "/admin/status").json()["max_model_len"] == 64 * 4
    headers = {"Content-Type": "application/json"}
    messages = [{"role": "user", "content": "say something"}]
    for stream in (True, False):
        body = {"model": card["id"], "messages": messages, "max_tokens": 250, "stream": stream}
        response = http("POST", daemon.url + "/v1/chat/completions", json.dumps(body).encode(), headers)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert "maximum context length is 256 tokens" in error["message"] and error["param"] == "max_tokens"
    # Three image blocks, one LLaVA image each: four images could never be held at once.
    image = {"type": "image_url", "image_url": {"url": data_url(PNG, "png")}}
    body = {"model": card["id"], "messages": [{"role": "user", "content": [image] * 4}], "max_tokens": 4,
            "stream": True}
    response = http("POST", daemon.url + "/v1/chat/completions", json.dumps(body).encode(), headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "image cache holds 3" in error["message"] and error["param"] == "messages", error
    body = {"model": card["id"], "messages": messages, "max_tokens": 8, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    response = http("POST", daemon.url + "/v1/chat/completions", json.dumps(body).encode(), headers)
    assert response.status_code == 200 and response.text.rstrip().endswith("data: [DONE]")
    assert '"completion_tokens":8' in response.text.replace(" ", "")
