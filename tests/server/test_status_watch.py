"""``hydractl status --watch`` against a stand-in daemon that answers /admin/status."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time

import pytest
from rich.console import Console

from daemon_process import HYDRACTL, REPO
from factories import http_get_stub
from hydrad.cli.status import watch_status
from hydrad.engine.cores import CpuThreads
from hydrad.errors import HydradError


def captured_status(n: int) -> dict:
    """What /admin/status answered on a 1E+1P+1D daemon, with minute ``n`` of uptime."""
    instance = {"device": "cpu", "num_inflight": 0, "num_running": n, "num_waiting": 0, "kv_usage": 0.1,
                "image_usage": 0.0, "tokens_per_second": 12.5, "pid": 100}
    model = "encode 4.0 ms + 2.0 ms/image; step 1.5 ms + 30 us/prefill token + 250 us/decode + 9.0 us/1k ctx"
    return {
        "model": "tiny-llava", "max_model_len": 512, "uptime_seconds": 60.0 * n,
        "instances": [{**instance, "id": i, "role": role, "state": "ready", "latency_model": model,
                       "latency_bound": 0.1}
                      for i, role in enumerate(("E", "P", "D"))],
        "requests": {"num_inflight": n, "window_seconds": 60.0, "request_rate": 0.5, "ttft_p50": 0.2,
                     "ttft_p90": 0.4, "tbt_p50": 0.02, "tbt_p90": 0.05},
    }


@pytest.fixture
def status_server():
    served = []

    def answer(path: str) -> bytes:
        served.append(path)
        return json.dumps(captured_status(len(served))).encode()

    with http_get_stub(answer) as url:
        yield url, served


def ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


# A shell without job control starts background commands with SIGINT ignored (a CI
# script's `cmd &`); Ctrl-C must stop the watch all the same.
@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_watch_prints_a_snapshot_per_interval_into_a_pipe(status_server, inherited):
    url, served = status_server
    process = subprocess.Popen([sys.executable, *HYDRACTL, "status", "--watch", "--interval", "0.2", "--url", url],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                               env={"PYTHONPATH": str(REPO), "COLUMNS": "120", "PATH": "/usr/bin:/bin"},
                               preexec_fn=ignore_sigint if inherited == "ignored" else None)
    try:
        deadline = time.monotonic() + 60
        while len(served) < 4 and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, err
    assert served[0] == "/admin/status" and len(served) >= 4
    # one whole snapshot per refresh (the last answer may have come in as the signal did)
    assert len(served) - 1 <= out.count("hydrad: tiny-llava") <= len(served), out
    for n in (1, 2, 3):
        assert f"up {n}m00s" in out
    assert out.count("steps up to 100.0 ms; encode 4.0 ms") == 3 * out.count("hydrad: tiny-llava")


def test_watch_redraws_in_place_on_a_terminal_and_survives_a_restart():
    answers = [captured_status(1), HydradError("cannot reach the daemon at http://x: refused"), captured_status(2)]

    def fetch():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def sleep(_):
        if not answers:
            raise KeyboardInterrupt

    buf = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        watch_status(fetch, Console(file=buf, force_terminal=True, width=120), 0.1, sleep=sleep)
    out = buf.getvalue()
    assert "up 1m00s" in out and "cannot reach the daemon" in out and "up 2m00s" in out
    assert out.count("\x1b[2K") >= 2  # earlier frames were erased, not scrolled
    assert out.index("up 1m00s") < out.index("cannot reach") < out.index("up 2m00s")


def test_a_worker_that_is_down_shows_no_tokens_per_second():
    """Its last seconds' rate would read as if it were still producing."""
    from types import SimpleNamespace

    from hydrad.cli.status import render
    from hydrad.server.admin import status_body

    def client(instance_id, alive):
        return SimpleNamespace(instance_id=instance_id, device="cpu", role="EPD", ready=None, alive=alive,
                               accepting=alive, num_inflight=0, tokens_per_second=lambda: 37.5)

    supervisor = SimpleNamespace(clients=[client(0, False), client(1, True)], crash_loops={}, restarting=set(),
                                 num_restarts={}, specs=[SimpleNamespace(threads=CpuThreads(1))] * 2)
    body = status_body(supervisor, [None, None], model="m", max_model_len=64,
                       started=time.monotonic(), num_requests=0, window=captured_status(1)["requests"])
    assert [i["tokens_per_second"] for i in body["instances"]] == [None, 37.5]
    assert [i["state"] for i in body["instances"]] == ["down", "unresponsive"]
    buf = io.StringIO()
    Console(file=buf, width=120).print(render(body))
    rows = [line for line in buf.getvalue().splitlines() if "EPD" in line]
    assert rows[0].rstrip(" │").endswith("-") and rows[1].rstrip(" │").endswith("37.5"), rows


def test_status_shows_how_each_instance_runs_against_its_model_by_kind():
    from hydrad.cli.status import render

    body = captured_status(1)
    body["instances"][0]["live_speed"] = {"images": 1.31}
    body["instances"][1]["live_speed"] = {"prefills": 1.42, "decodes": 1.18}
    buf = io.StringIO()
    Console(file=buf, width=200).print(render(body))
    out = buf.getvalue()
    assert "#0 E: steps up to 100.0 ms; its steps run images 1.31x their prediction; encode" in out, out
    assert "#1 P: steps up to 100.0 ms; its steps run prefills 1.42x, decodes 1.18x their prediction" in out, out
    assert "#2 D: steps up to 100.0 ms; encode" in out  # nothing measured yet: nothing said
