"""Large inputs against a real daemon (cpu:1, tiny LLaVA): a small request sent meanwhile
completes within 2 s, and the daemon's memory stays within its budgets. The daemon runs
with ``log_requests = false``: no line per finished request; and ``responses_store_mb =
0``: no response of /v1/responses kept.

The bound asserted on the daemon's resident memory (its own process; the worker's is
not counted) is its peak over the test minus its size before: at most
``server.max_inflight_image_mb`` + 300 MiB while images are processed, 300 MiB for
a refused 20 MB prompt.
"""

from __future__ import annotations

import base64
import io
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from PIL import Image

from daemon_process import Daemon, http

pytestmark = pytest.mark.slow

JSON = {"Content-Type": "application/json"}
MiB = 1 << 20
# Room for one request of eight 6000x6000 images at a time: they take 8 bytes per pixel
# and the largest twice (8 * (288 + 36) Mpx = 2472 MiB); the budget must also hold
# the largest request allowed (max_request_pixels, its largest image at max_image_pixels).
IMAGE_MB = 2510
CONFIG = f"""
[server]
max_request_pixels = 288000000
max_inflight_image_mb = {IMAGE_MB}
queue_timeout = 2
log_requests = false
responses_store_mb = 0
"""
SMALL_SECONDS = 2.0
SLACK_MB = 300


@pytest.fixture(scope="module")
def daemon(tiny_llava_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("limits")
    (tmp / "hydrad.toml").write_text(CONFIG)
    d = Daemon(["--model", str(tiny_llava_dir), "--config", str(tmp / "hydrad.toml"), "--devices", "cpu:1"],
               tmp / "hydrad.log")
    yield d
    assert d.stop() == 0, d.log()


def chat(content, max_tokens: int = 4) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                       "temperature": 0}).encode()


def memory_mb(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # VmHWM starts again from the current size


def small_requests_while(daemon: Daemon, futures) -> list[float]:
    """Send one small request after another until ``futures`` are done; their latencies."""
    latencies = []
    while not all(f.done() for f in futures) or len(latencies) < 5:
        start = time.monotonic()
        reply = http("POST", daemon.url + "/v1/chat/completions", chat("hi"), JSON)
        latencies.append(time.monotonic() - start)
        assert reply.status_code == 200, reply.text
        time.sleep(0.1)
    return latencies


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_a_20mb_prompt_is_refused_before_tokenizing_while_small_requests_flow(daemon, route):
    pid = daemon.process.pid
    text = "the quick brown fox jumps over the lazy dog " * 460_000  # 20.2 MB
    body = chat(text) if "chat" in route else json.dumps({"prompt": text, "max_tokens": 4}).encode()
    before = memory_mb(pid, "VmRSS")
    reset_peak(pid)
    with ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        large = pool.submit(http, "POST", daemon.url + route, body, JSON)
        latencies = small_requests_while(daemon, [large])
        reply = large.result()
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["code"] == "context_length_exceeded", reply.text
    assert "characters of text" in error["message"]
    assert time.monotonic() - start < 10 and max(latencies) < SMALL_SECONDS, latencies
    assert memory_mb(pid, "VmHWM") - before < SLACK_MB


def test_small_requests_flow_while_eight_6000px_images_are_processed(daemon):
    buf = io.BytesIO()
    Image.new("RGB", (6000, 6000), (10, 120, 200)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    body = chat([{"type": "image_url", "image_url": {"url": url}}] * 8 + [{"type": "text", "text": "describe"}])
    pid = daemon.process.pid
    before = memory_mb(pid, "VmRSS")
    reset_peak(pid)
    with ThreadPoolExecutor(2) as pool:
        large = [pool.submit(http, "POST", daemon.url + "/v1/chat/completions", body, JSON, 300) for _ in range(2)]
        latencies = small_requests_while(daemon, large)
        replies = [f.result() for f in large]
    peak = memory_mb(pid, "VmHWM")
    # Each small request completed within SMALL_SECONDS while a large one was processed.
    assert max(latencies) < SMALL_SECONDS, latencies
    # One large request fits the image budget at a time: the other waited queue_timeout (2 s),
    # then was told to come back later.
    assert sorted(r.status_code for r in replies) == [200, 503], [r.text for r in replies]
    done = next(r for r in replies if r.status_code == 200).json()
    assert done["usage"]["prompt_tokens"] > 8 * 16 and done["usage"]["completion_tokens"] == 4
    busy = next(r for r in replies if r.status_code == 503)
    error = busy.json()["error"]
    assert error["code"] == "server_busy" and "server.max_inflight_image_mb" in error["message"], error
    assert int(busy.headers["Retry-After"]) >= 1
    assert peak - before < IMAGE_MB + SLACK_MB, (before, peak)
    # and the memory goes back: no 2 GB left behind once the images are processed
    time.sleep(1.0)
    assert memory_mb(pid, "VmRSS") - before < SLACK_MB


def test_without_log_requests_no_line_per_request(daemon):
    assert http("POST", daemon.url + "/v1/chat/completions", chat("hi"), JSON).status_code == 200
    log = daemon.log()
    assert "hydrad.daemon: serving" in log, log[-2000:]
    assert "hydrad.requests" not in log, log[-2000:]


def test_without_a_response_store_no_response_is_kept(daemon):
    """``store`` true and ``previous_response_id`` are refused by name, a response is answered
    without being kept (OpenAI's default ``store`` is not one a server without a store can
    take), and asking for a kept one says that none are."""
    body = {"input": "hi", "max_output_tokens": 2}
    for extra, param in (({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id")):
        reply = http("POST", daemon.url + "/v1/responses", json.dumps({**body, **extra}).encode(), JSON)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
        assert "responses_store_mb" in reply.json()["error"]["message"]
    reply = http("POST", daemon.url + "/v1/responses", json.dumps(body).encode(), JSON)
    assert reply.status_code == 200 and reply.json()["store"] is False, reply.text
    reply = http("GET", daemon.url + "/v1/responses/" + reply.json()["id"])
    assert reply.status_code == 404 and "keeps no responses" in reply.json()["error"]["message"], reply.text
