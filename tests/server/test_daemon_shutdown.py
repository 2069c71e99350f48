"""SIGTERM with requests in flight: they complete, the daemon exits 0, no worker is left.
A second signal while draining stops at once: requests fail, the daemon exits 1."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from daemon_process import Daemon, assert_gone, http, open_stream, pid_exists, stream_events, wait_for
from test_daemon_api import PNG, data_url

pytestmark = pytest.mark.slow

JSON = {"Content-Type": "application/json"}
# Small fixed budgets: a request takes many steps at each stage, so stages overlap.
SLOW_STAGES = """
[scheduler]
derive_budgets = false
token_budget = 32
image_budget = 1
[cache]
prefix_caching = false
"""


def stream_body(max_tokens: int, num_images: int = 0, text: str = "go on") -> bytes:
    content = [{"type": "image_url", "image_url": {"url": data_url(PNG, "png")}}] * num_images
    content.append({"type": "text", "text": text})
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()


def worker_pids(daemon: Daemon) -> list[int]:
    pids = [i["pid"] for i in http("GET", daemon.url + "/admin/status").json()["instances"]]
    assert all(pid_exists(p) for p in pids)
    return pids


def test_sigterm_drains_in_flight_requests(tiny_llava_dir, tmp_path):
    daemon = Daemon(["--model", str(tiny_llava_dir), "--devices", "cpu:2", "--deploy", "2EPD"],
                    tmp_path / "hydrad.log")
    try:
        pids = worker_pids(daemon)
        assert len(pids) == 2
        streams = [open_stream(daemon.url + "/v1/chat/completions", stream_body(400), JSON) for _ in range(3)]
        daemon.terminate()
        for conn, response in streams:
            events = stream_events(response.read().decode())
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["usage"]["completion_tokens"] == 400
            conn.close()
        assert daemon.process.wait(60) == 0, daemon.log()
        assert_gone(pids)
        assert "shutting down: 3 request(s) in flight" in daemon.log()
    finally:
        daemon.stop()


def test_sigterm_drains_a_split_deployment_with_requests_at_every_stage(tiny_llava_dir, tmp_path):
    config = tmp_path / "hydrad.toml"
    config.write_text(SLOW_STAGES)
    daemon = Daemon(["--model", str(tiny_llava_dir), "--config", str(config), "--devices", "cpu:3",
                     "--deploy", "1E+1P+1D"], tmp_path / "hydrad.log")
    try:
        pids = worker_pids(daemon)
        # Two requests decoding (their first token is out), then bursts of requests
        # with eight images and a long prompt each until a snapshot finds E, P and D
        # all busy (E encodes a burst within a few tens of milliseconds).
        decoding = [open_stream(daemon.url + "/v1/chat/completions", stream_body(1800, 1), JSON)
                    for _ in range(2)]
        burst_body = stream_body(100, 8, "go on " * 400)
        pool = ThreadPoolExecutor(40)
        burst = []

        def every_stage_busy() -> bool:
            # Counted first: the daemon's table holds a subset of these (the decoding
            # two are still running), so equality means none is still on its way.
            num_unanswered = len(decoding) + sum(not f.done() for f in burst)
            status = http("GET", daemon.url + "/admin/status").json()
            return (status["requests"]["num_inflight"] == num_unanswered
                    and all((i["num_running"] or 0) + (i["num_waiting"] or 0) > 0 for i in status["instances"]))

        while not wait_for(every_stage_busy, 0.5, interval=0):
            assert len(burst) < 40, daemon.log()
            burst += [pool.submit(http, "POST", daemon.url + "/v1/chat/completions", burst_body, JSON, 120)
                      for _ in range(4)]
        daemon.terminate()
        for conn, response in decoding:
            events = stream_events(response.read().decode())
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["usage"]["completion_tokens"] == 1800
            conn.close()
        for future in burst:
            assert future.result().status_code == 200, future.result().text
            events = stream_events(future.result().text)
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["usage"]["completion_tokens"] == 100
        pool.shutdown()
        assert daemon.process.wait(60) == 0, daemon.log()
        assert_gone(pids)
        assert f"shutting down: {len(decoding) + len(burst)} request(s) in flight" in daemon.log()
    finally:
        daemon.stop()


def test_a_second_signal_while_draining_stops_at_once(tiny_llava_dir, tmp_path):
    config = tmp_path / "hydrad.toml"
    config.write_text(SLOW_STAGES)
    daemon = Daemon(["--model", str(tiny_llava_dir), "--config", str(config), "--devices", "cpu:1",
                     "--deploy", "1EPD"], tmp_path / "hydrad.log")
    try:
        pids = worker_pids(daemon)
        streams = [open_stream(daemon.url + "/v1/chat/completions", stream_body(1800), JSON) for _ in range(3)]
        daemon.terminate()
        assert wait_for(lambda: "shutting down" in daemon.log(), 10), daemon.log()
        daemon.process.send_signal(signal.SIGINT)
        for conn, response in streams:
            events = stream_events(response.read().decode())
            assert events[-1] == "[DONE]"
            error = json.loads(events[-3])["error"]  # then the usage chunk
            assert error["message"].startswith("the daemon is stopping: second SIGINT while draining")
            assert json.loads(events[-2])["usage"]["completion_tokens"] < 1800
            conn.close()
        assert daemon.process.wait(30) == 1, daemon.log()
        assert_gone(pids)
        assert "second SIGINT while draining: aborting 3 request(s) and stopping now" in daemon.log()
    finally:
        daemon.stop()


def test_sigterm_aborts_what_outlasts_shutdown_timeout_once_and_ends_every_stream(tiny_llava_dir, tmp_path):
    """shutdown_timeout is granted once, counted from the signal; meanwhile /health and new
    requests answer 503; then every open stream ends with a finish_reason, an error event and
    [DONE], the aborted requests are logged, and the daemon exits 0."""
    config = tmp_path / "hydrad.toml"
    config.write_text(SLOW_STAGES + "\n[server]\nshutdown_timeout = 2\n")
    daemon = Daemon(["--model", str(tiny_llava_dir), "--config", str(config), "--devices", "cpu:1",
                     "--deploy", "1EPD"], tmp_path / "hydrad.log")
    try:
        pids = worker_pids(daemon)
        streams = [open_stream(daemon.url + "/v1/chat/completions", stream_body(1800), JSON) for _ in range(3)]
        signalled = time.monotonic()
        daemon.terminate()
        assert wait_for(lambda: "shutting down" in daemon.log(), 5), daemon.log()
        health = http("GET", daemon.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "draining", health.text
        refused = http("POST", daemon.url + "/v1/chat/completions", stream_body(4), JSON)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        ids = []
        for conn, response in streams:
            events = stream_events(response.read().decode())
            ended = time.monotonic() - signalled
            assert 2.0 <= ended < 2.0 + 1.5, ended  # the drain's end, not twice it
            finish, error, usage, done = events[-4:]
            assert json.loads(finish)["choices"][0]["finish_reason"] == "abort"
            assert json.loads(error)["error"]["message"] == ("the daemon is shutting down: the request was still "
                                                            "running after server.shutdown_timeout (2 s)")
            assert json.loads(usage)["usage"]["completion_tokens"] < 1800 and done == "[DONE]"
            ids.append(json.loads(finish)["id"])
            conn.close()
        assert daemon.process.wait(20) == 0, daemon.log()
        # the drain, then the workers' exit (a fraction of a second here; up to 15 s allowed)
        assert time.monotonic() - signalled < 2.0 + 8, daemon.log()
        assert_gone(pids)
        assert (f"shutting down: 3 request(s) still running after 2 s (server.shutdown_timeout), aborted: "
                f"{', '.join(sorted(ids))}") in daemon.log()
    finally:
        daemon.stop()
