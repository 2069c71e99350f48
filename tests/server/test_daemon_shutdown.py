"""SIGTERM with requests in flight: they complete, the daemon exits 0, no worker is left."""

from __future__ import annotations

import json
import time

import pytest

from daemon_process import Daemon, http, open_stream, pid_exists

pytestmark = pytest.mark.slow


def test_sigterm_drains_in_flight_requests(tiny_llava_dir, tmp_path):
    daemon = Daemon(["--model", str(tiny_llava_dir), "--devices", "cpu:2", "--deploy", "2EPD"],
                    tmp_path / "hydrad.log")
    try:
        pids = [i["pid"] for i in http("GET", daemon.url + "/admin/status").json()["instances"]]
        assert len(pids) == 2 and all(pid_exists(p) for p in pids)
        body = json.dumps({"messages": [{"role": "user", "content": "go on"}], "max_tokens": 400,
                           "temperature": 0, "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        streams = [open_stream(daemon.url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
                   for _ in range(3)]
        daemon.terminate()
        for conn, response in streams:
            events = [line[6:] for line in response.read().decode().splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["usage"]["completion_tokens"] == 400
            conn.close()
        assert daemon.process.wait(60) == 0, daemon.log()
        deadline = time.monotonic() + 10
        while any(pid_exists(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(pid_exists(p) for p in pids)
        assert "shutting down: 3 request(s) in flight" in daemon.log()
    finally:
        daemon.stop()
