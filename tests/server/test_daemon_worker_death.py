"""A worker dies: while every stage keeps a live instance the daemon serves on, degraded
(``/health`` 503); when a stage loses its last one the daemon fails its requests, stops
its workers and exits non-zero, for its service manager to restart it."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from daemon_process import Daemon, assert_gone, http, open_stream, stream_events, wait_for
from test_daemon_shutdown import JSON, stream_body

pytestmark = pytest.mark.slow


def instances(daemon: Daemon) -> list[dict]:
    return http("GET", daemon.url + "/admin/status").json()["instances"]


def test_one_dead_instance_of_2epd_leaves_the_daemon_serving_degraded(tiny_llava_dir, tmp_path):
    daemon = Daemon(["--model", str(tiny_llava_dir), "--devices", "cpu:2", "--deploy", "2EPD"],
                    tmp_path / "hydrad.log")
    try:
        victim, survivor = instances(daemon)
        os.kill(victim["pid"], signal.SIGKILL)
        assert wait_for(lambda: "serving degraded" in daemon.log(), 10), daemon.log()
        health = http("GET", daemon.url + "/health")
        assert health.status_code == 503 and health.json()["instances_down"] == [victim["id"]]
        body = json.dumps({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
                           "temperature": 0}).encode()
        for _ in range(4):  # round-robin would have sent every other one to the dead instance
            reply = http("POST", daemon.url + "/v1/chat/completions", body, JSON)
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 8
        assert [i["state"] for i in instances(daemon)] == ["down", "ready"]
        assert daemon.process.poll() is None
        assert (f"worker {victim['id']} (cpu, EPD, pid {victim['pid']}) is down: pipe reached EOF; "
                "process killed by SIGKILL; serving degraded on 1 of 2 instance(s)") in daemon.log()
        assert daemon.stop() == 0, daemon.log()
        assert_gone([survivor["pid"]])
    finally:
        daemon.stop()


def test_a_stage_without_a_live_instance_stops_the_daemon(tiny_llava_dir, tmp_path):
    daemon = Daemon(["--model", str(tiny_llava_dir), "--devices", "cpu:2", "--deploy", "1E+1PD"],
                    tmp_path / "hydrad.log")
    try:
        workers = instances(daemon)
        pd = next(i for i in workers if i["role"] == "PD")
        conn, response = open_stream(daemon.url + "/v1/chat/completions", stream_body(1500), JSON)
        start = time.monotonic()
        os.kill(pd["pid"], signal.SIGKILL)
        events = stream_events(response.read().decode())
        assert json.loads(events[-3])["error"]["message"] == "worker 1 (cpu, PD) exited"
        conn.close()
        assert daemon.process.wait(15) != 0, daemon.log()
        assert time.monotonic() - start < 10
        assert_gone([i["pid"] for i in workers])
        assert (f"worker 1 (cpu, PD, pid {pd['pid']}) is down: pipe reached EOF; process killed by SIGKILL; "
                "no live instance holds stage P, D\n") in daemon.log()
        # The stream failed with the worker, before the daemon decided to stop: it is counted.
        assert "stopping now: 1 request(s) failed with the lost worker(s)" in daemon.log()
    finally:
        daemon.stop()
