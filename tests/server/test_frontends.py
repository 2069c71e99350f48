"""Two front-end processes on one port (``--frontend-processes 2``): requests served by
both, ``/metrics`` and ``/admin/status`` whole from either, a killed front end restarted
without touching the other's requests, and a SIGTERM drain that finishes the streams
of both processes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import aiohttp
import pytest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import generate_latest

from daemon_process import Daemon, assert_gone, http, wait_for
from hydrad.server.metrics import MergedRegistry
from hydrad.server.monitor import combined_cpu_per_token, frontend_status

pytestmark = pytest.mark.slow


# -- merging the processes' numbers (no daemon) ---------------------------------------------------


def _process_families(tokens: float, ttft: list[float], cpu: float, created: float, start: float):
    counter = CounterMetricFamily("hydrad_generation_tokens", "t", labels=["model_name"], created=created)
    counter.add_metric(["m"], tokens, created=created)
    hist = HistogramMetricFamily("hydrad_time_to_first_token_seconds", "h", labels=["model_name"])
    hist.add_metric(["m"], [("0.1", sum(v <= 0.1 for v in ttft)), ("+Inf", len(ttft))], sum(ttft))
    per_token = GaugeMetricFamily("hydrad_daemon_cpu_seconds_per_token", "g", labels=["model_name"])
    per_token.add_metric(["m"], cpu)
    started = GaugeMetricFamily("process_start_time_seconds", "s")
    started.add_metric([], start)
    return [counter, hist, per_token, started]


def test_merged_registry_adds_counts_keeps_earliest_times_and_overrides_ratios():
    a = _process_families(100, [0.05, 0.2], 1e-4, created=50.0, start=10.0)
    b = _process_families(40, [0.01], 3e-4, created=20.0, start=12.0)
    text = generate_latest(MergedRegistry([a, b], {"hydrad_daemon_cpu_seconds_per_token": 2e-4})).decode()
    assert 'hydrad_generation_tokens_total{model_name="m"} 140.0' in text
    assert 'hydrad_generation_tokens_created{model_name="m"} 20.0' in text
    assert 'hydrad_time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 2.0' in text
    assert 'hydrad_time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 3.0' in text
    assert 'hydrad_time_to_first_token_seconds_count{model_name="m"} 3.0' in text
    assert 'hydrad_daemon_cpu_seconds_per_token{model_name="m"} 0.0002' in text
    assert "process_start_time_seconds 10.0" in text
    # A ratio with nothing to report is left out rather than summed.
    text = generate_latest(MergedRegistry([a, b], {"hydrad_daemon_cpu_seconds_per_token": None})).decode()
    assert "hydrad_daemon_cpu_seconds_per_token{" not in text


def test_frontend_status_sums_cpu_and_takes_the_worst_lag():
    own = {"pid": 1, "window_seconds": 10.0, "cpu_per_token": 1e-4, "cpu_share": 0.2, "tokens_per_second": 2000.0,
           "loop_lag_p99": 0.002, "loop_lag_max": 0.01}
    other = {**own, "pid": 2, "cpu_share": 0.3, "tokens_per_second": 500.0, "loop_lag_p99": 0.02, "loop_lag_max": 0.03}
    assert frontend_status(own, []) is own
    status = frontend_status(own, [other])
    assert status["cpu_share"] == pytest.approx(0.5) and status["tokens_per_second"] == pytest.approx(2500.0)
    assert status["cpu_per_token"] == pytest.approx(0.5 / 2500.0) == combined_cpu_per_token([own, other])
    assert (status["loop_lag_p99"], status["loop_lag_max"]) == (0.02, 0.03)
    assert [p["pid"] for p in status["processes"]] == [1, 2]
    assert combined_cpu_per_token([{**own, "tokens_per_second": 0.0}]) is None


# -- a live daemon ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(tiny_llava_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("frontends")
    config = tmp / "hydrad.toml"
    config.write_text(f"""
[server]
frontend_processes = 2
shutdown_timeout = 60

[cache]
num_image_blocks = 2

[trace]
dir = "{tmp / 'trace'}"
""")
    d = Daemon(["--model", str(tiny_llava_dir), "--config", str(config), "--devices", "cpu:1"], tmp / "hydrad.log")
    yield d
    d.stop()


async def _stream(session: aiohttp.ClientSession, url: str, i: int, max_tokens: int) -> tuple[int, int, str | None]:
    """(chunks with a token, completion tokens in the usage, finish_reason) of one stream."""
    body = {"messages": [{"role": "user", "content": f"count to {i}"}], "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if i % 2:
        body.update(temperature=0.8, top_p=0.9, seed=i)
    else:
        body["temperature"] = 0
    chunks, usage, finish = 0, None, None
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event.get("choices"):
                chunks += 1
                finish = event["choices"][0]["finish_reason"] or finish
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
    return chunks, usage, finish


def _run_streams(url: str, n: int, max_tokens: int):
    async def main():
        connector = aiohttp.TCPConnector(limit=0, force_close=True)  # a connection each: spread by the kernel
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
            return await asyncio.gather(*(_stream(session, url, i, max_tokens) for i in range(n)))

    return asyncio.run(main())


def _metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_both_processes_serve_and_report_one_whole_view(daemon):
    before = _metric(http("GET", daemon.url + "/metrics").text, "hydrad_generation_tokens_total")
    results = _run_streams(daemon.url, 256, 12)
    assert all(r == (12, 12, "length") for r in results), results[:4]
    log = daemon.log()
    # Each process logs the requests it served; the front end's lines carry its name.
    assert re.search(r"^\S+ \S+ INFO frontend1 hydrad.requests: finished", log, re.M), "front end 1 served none"
    assert re.search(r"^\S+ \S+ INFO hydrad.requests: finished", log, re.M), "the daemon served none"
    # Every process froze what start-up left alive: full collections no longer scan it.
    for who in (r"INFO hydrad\.daemon", r"INFO frontend1 hydrad\.frontend", r"INFO worker0"):
        assert re.search(rf"^\S+ \S+ {who}: froze the start-up heap \(\d{{5,}} objects", log, re.M), who
    # Any connection may land on either process: every answer counts all 256 requests.
    for _ in range(8):
        text = http("GET", daemon.url + "/metrics").text
        assert _metric(text, "hydrad_generation_tokens_total") - before == 256 * 12
        assert _metric(text, 'hydrad_requests_finished_total') >= 256
    status = http("GET", daemon.url + "/admin/status").json()
    assert len(status["frontend"]["processes"]) == 2
    assert len({p["pid"] for p in status["frontend"]["processes"]}) == 2
    # The front end's finished requests are in the daemon's trace.
    trace = http("GET", daemon.url + "/admin/trace?limit=1000").text.splitlines()
    assert len(trace) >= 256
    assert all(0 < json.loads(line)["processing"] <= json.loads(line)["preprocess"] for line in trace)


def test_a_conversation_of_kept_responses_goes_on_in_any_process(daemon):
    """16 conversations of 3 turns on /v1/responses, each turn on a connection of its own
    (either process takes it) continuing the turn before by ``previous_response_id``: the
    daemon keeps what every process answers, so each turn finds the one before, and the last
    lists the whole conversation from any process."""

    async def turn(session: aiohttp.ClientSession, body: dict) -> str:
        async with session.post(daemon.url + "/v1/responses", json=body) as response:
            assert response.status == 200, await response.text()
            if not body["stream"]:
                return (await response.json())["id"]
            data = [line[6:] async for line in response.content if line.startswith(b"data: ")]
            return json.loads(data[-1])["response"]["id"]  # response.incomplete: cut at 3 tokens

    async def conversation(session: aiohttp.ClientSession, i: int) -> list[dict]:
        previous = None
        for k in range(3):
            body = {"input": f"conversation {i} turn {k}", "max_output_tokens": 3, "temperature": 0,
                    "stream": k == 1, "previous_response_id": previous}
            previous = await turn(session, body)
        async with session.get(f"{daemon.url}/v1/responses/{previous}/input_items?order=asc&limit=100") as response:
            assert response.status == 200, await response.text()
            return (await response.json())["data"]

    async def main():
        connector = aiohttp.TCPConnector(limit=0, force_close=True)  # a connection each: spread by the kernel
        async with aiohttp.ClientSession(connector=connector) as session:
            return await asyncio.gather(*(conversation(session, i) for i in range(16)))

    for i, items in enumerate(asyncio.run(main())):
        assert [item["role"] for item in items] == ["user", "assistant", "user", "assistant", "user"], items
        assert [items[k]["content"][0]["text"] for k in (0, 2, 4)] == [f"conversation {i} turn {k}" for k in range(3)]
    log = daemon.log()
    assert re.search(r"^\S+ \S+ INFO frontend1 hydrad.requests: finished resp_", log, re.M), "front end 1 served none"
    assert re.search(r"^\S+ \S+ INFO hydrad.requests: finished resp_", log, re.M), "the daemon served none"
    # Kept once, in the daemon, whichever process answered; what held their bodies is free
    # once each handler has ended (a stream's just after its last bytes).
    assert _metric(http("GET", daemon.url + "/metrics").text, "hydrad_responses_kept") == 48
    assert http("GET", daemon.url + "/admin/status").json()["responses"]["kept"] == 48
    assert wait_for(lambda: _metric(http("GET", daemon.url + "/metrics").text,
                                    "hydrad_request_body_bytes_in_use") == 0, 10)


def test_background_responses_are_polled_and_cancelled_from_any_process(daemon):
    """32 background responses made on connections of their own (either process takes each),
    polled from any: the short ones reach their answer; the long ones, cancelled from any
    process once they run, end as aborts in the process that runs them (the daemon fails
    their requests), and none runs on."""

    async def call(session: aiohttp.ClientSession, method: str, path: str, body: dict | None = None) -> dict:
        async with session.request(method, daemon.url + path, json=body) as response:
            assert response.status == 200, await response.text()
            return await response.json()

    async def background(session: aiohttp.ClientSession, i: int) -> tuple[str, dict]:
        long = i % 2 == 0
        created = await call(session, "POST", "/v1/responses", {
            "input": f"background {i}", "max_output_tokens": 1500 if long else 4, "ignore_eos": True,
            "background": True})
        assert created["status"] == "queued"
        response_id = created["id"]
        deadline = time.monotonic() + 60
        while True:
            polled = await call(session, "GET", f"/v1/responses/{response_id}")
            if polled["status"] not in ("queued", "in_progress") or (long and polled["status"] == "in_progress"):
                break
            assert time.monotonic() < deadline, polled
            await asyncio.sleep(0.05)
        if long:
            assert (await call(session, "POST", f"/v1/responses/{response_id}/cancel"))["status"] == "cancelled"
        return response_id, polled

    async def main():
        connector = aiohttp.TCPConnector(limit=0, force_close=True)  # a connection each: spread by the kernel
        async with aiohttp.ClientSession(connector=connector) as session:
            return await asyncio.gather(*(background(session, i) for i in range(32)))

    results = asyncio.run(main())
    log = daemon.log()
    for i, (response_id, polled) in enumerate(results):
        if i % 2:
            assert polled["status"] == "incomplete" and polled["usage"]["output_tokens"] == 4, polled
        else:
            assert re.search(rf"finished {response_id} .* finish=abort", log), f"{response_id} ran on"
            assert http("GET", f"{daemon.url}/v1/responses/{response_id}").json()["status"] == "cancelled"
    served = {m.group(1) for m in re.finditer(r"^\S+ \S+ INFO (frontend1 )?hydrad.requests: finished resp_.* "
                                               r"finish=abort", log, re.M)}
    assert served == {None, "frontend1 "}, "cancelled in one process only"
    assert http("GET", daemon.url + "/admin/status").json()["responses"]["background_running"] == 0
    assert _metric(http("GET", daemon.url + "/metrics").text, "hydrad_responses_background_running") == 0


def test_streamed_background_responses_are_followed_again_from_any_process(daemon):
    """16 streamed background responses, each left by its client at its first text delta and
    followed again on a connection of its own (either process takes it: the one that runs it
    reads its own log, the other the daemon's store): every event once, in order, to the
    answer whose text the deltas make."""

    async def events_of(response: aiohttp.ClientResponse, stop_at_delta: bool) -> list[dict]:
        assert response.status == 200, await response.text()
        events = []
        async for line in response.content:
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
                if stop_at_delta and events[-1]["type"] == "response.output_text.delta":
                    break
        return events

    async def streamed(session: aiohttp.ClientSession, i: int) -> list[dict]:
        async with session.post(daemon.url + "/v1/responses", json={
                "input": f"streamed {i}", "max_output_tokens": 24, "ignore_eos": True, "background": True,
                "stream": True}) as response:
            first = await events_of(response, stop_at_delta=True)
        response_id = first[0]["response"]["id"]
        async with session.get(f"{daemon.url}/v1/responses/{response_id}",
                               params={"stream": "true", "starting_after": str(first[-1]["sequence_number"])}) as r:
            return first + await events_of(r, stop_at_delta=False)

    async def main():
        connector = aiohttp.TCPConnector(limit=0, force_close=True)  # a connection each: spread by the kernel
        async with aiohttp.ClientSession(connector=connector) as session:
            return await asyncio.gather(*(streamed(session, i) for i in range(16)))

    for events in asyncio.run(main()):
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        final = events[-1]["response"]
        assert events[-1]["type"] == "response.incomplete" and final["usage"]["output_tokens"] == 24
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert text == final["output"][0]["content"][0]["text"]
        assert http("GET", f"{daemon.url}/v1/responses/{final['id']}").json() == final
    assert http("GET", daemon.url + "/admin/status").json()["responses"]["background_running"] == 0


def test_every_process_refuses_images_the_image_cache_could_never_hold(daemon):
    """Two image blocks, one tiny LLaVA image each: three images are refused by whichever
    process takes the connection (the daemon tells the others its caches), before a stream."""
    from test_daemon_api import PNG, data_url

    image = {"type": "image_url", "image_url": {"url": data_url(PNG, "png")}}
    body = {"messages": [{"role": "user", "content": [image] * 3}], "max_tokens": 2, "stream": True}

    async def main():
        connector = aiohttp.TCPConnector(limit=0, force_close=True)  # a connection each: spread by the kernel
        async with aiohttp.ClientSession(connector=connector) as session:
            async def one():
                async with session.post(daemon.url + "/v1/chat/completions", json=body) as response:
                    return response.status, (await response.json())["error"]["message"]
            return await asyncio.gather(*(one() for _ in range(16)))

    for status, message in asyncio.run(main()):
        assert status == 400 and "image cache holds 2" in message, (status, message)


def test_every_process_serves_prompt_logprobs_and_the_tokenizer_routes(daemon):
    """Whichever process takes the connection: a batch of token-id prompts with ``echo`` and
    ``logprobs`` (the prompt's log-probabilities come from the worker with the first token,
    through the daemon to the front end) and ``/tokenize`` give the same answers."""
    ids = http("POST", daemon.url + "/tokenize", json.dumps({"prompt": "Once upon a time"}).encode(),
               {"Content-Type": "application/json"}).json()["tokens"]
    body = {"prompt": [ids, ids[:3]], "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1}

    async def main():
        connector = aiohttp.TCPConnector(limit=0, force_close=True)  # a connection each: spread by the kernel
        async with aiohttp.ClientSession(connector=connector) as session:
            async def one():
                async with session.post(daemon.url + "/v1/completions", json=body) as response:
                    assert response.status == 200, await response.text()
                    choices = sorted((await response.json())["choices"], key=lambda c: c["index"])
                async with session.post(daemon.url + "/tokenize", json={"prompt": "Once upon a time"}) as response:
                    tokens = (await response.json())["tokens"]
                return [c["logprobs"]["token_logprobs"] for c in choices], tokens
            return await asyncio.gather(*(one() for _ in range(16)))

    answers = asyncio.run(main())
    logprobs, tokens = answers[0]
    assert [len(x) for x in logprobs] == [len(ids) + 2, 3 + 2] and logprobs[0][0] is None
    assert logprobs[1][1:3] == pytest.approx(logprobs[0][1:3], abs=1e-5)  # the same prefix, the same prices
    for got, got_tokens in answers:  # the same in every process, up to a batch's float rounding
        assert got_tokens == tokens == ids
        assert [len(x) for x in got] == [len(x) for x in logprobs]
        assert [v for x in got for v in x[1:]] == pytest.approx([v for x in logprobs for v in x[1:]], abs=1e-4)


def test_the_choices_of_one_request_count_its_pixels_once(daemon):
    """The ``n`` choices of an image request share its pixels: the daemon keeps them (to run
    the request again should its worker die) once, whichever process took the request; a
    front end sends each choice on its own, and the daemon finds the one tensor again."""
    from test_daemon_api import PNG, data_url

    image = {"type": "image_url", "image_url": {"url": data_url(PNG, "png")}}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}]

    async def kept_while_streaming(session: aiohttp.ClientSession, n: int) -> int:
        body = {"messages": messages, "n": n, "max_tokens": 400, "ignore_eos": True, "stream": True,
                "temperature": 0.8}
        async with session.post(daemon.url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200, await response.text()
            async for line in response.content:
                if line.startswith(b"data: {") and json.loads(line[6:]).get("choices"):
                    break
            async with session.get(daemon.url + "/admin/status") as r:
                kept = (await r.json())["failures"]["rerun_image_bytes"]
        # its end (the client left) gives them back
        for _ in range(500):
            async with session.get(daemon.url + "/admin/status") as r:
                if (await r.json())["failures"]["rerun_image_bytes"] == 0:
                    return kept
            await asyncio.sleep(0.02)
        raise AssertionError("the pixels were still kept after the request ended")

    def served_by(log: str) -> set[str]:
        return {m or "daemon" for m in re.findall(r"^\S+ \S+ INFO (frontend\d+ )?hydrad\.requests: finished "
                                                   r"\S+-2 .*images=1 .*finish=abort", log, re.M)}

    async def main():
        connector = aiohttp.TCPConnector(limit=0, force_close=True)  # a connection each: spread by the kernel
        async with aiohttp.ClientSession(connector=connector) as session:
            one = await kept_while_streaming(session, 1)
            assert one > 0
            for _ in range(32):  # until each process has taken one
                assert await kept_while_streaming(session, 3) == one
                if len(served_by(daemon.log())) == 2:
                    return
            raise AssertionError(f"served by {served_by(daemon.log())} only")

    asyncio.run(main())


def test_a_killed_front_end_is_restarted_and_the_other_keeps_serving(daemon):
    pids = {p["pid"] for p in http("GET", daemon.url + "/admin/status").json()["frontend"]["processes"]}
    frontend = next(p for p in pids if p != daemon.process.pid)
    os.kill(frontend, signal.SIGKILL)
    assert wait_for(lambda: "front end 1 restarted" in daemon.log(), 120), daemon.log()[-3000:]
    assert http("GET", daemon.url + "/health").status_code == 200
    results = _run_streams(daemon.url, 64, 4)
    assert all(r == (4, 4, "length") for r in results)
    new = {p["pid"] for p in http("GET", daemon.url + "/admin/status").json()["frontend"]["processes"]}
    assert len(new) == 2 and frontend not in new


def test_sigterm_drains_the_streams_of_every_process(daemon):
    pids = [p["pid"] for p in http("GET", daemon.url + "/admin/status").json()["frontend"]["processes"]]

    async def main():
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            streams = [asyncio.ensure_future(_stream(session, daemon.url, i, 150)) for i in range(48)]
            await asyncio.sleep(2.0)
            daemon.terminate()
            return await asyncio.gather(*streams)

    started = time.monotonic()
    results = asyncio.run(main())
    assert all(r == (150, 150, "length") for r in results), [r for r in results if r != (150, 150, "length")][:4]
    assert daemon.process.wait(60) == 0
    assert time.monotonic() - started < 60
    log = daemon.log()
    assert "frontend1" in log and "aborted" not in log
    assert_gone(pids)
