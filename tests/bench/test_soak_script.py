"""``bench/soak.py``: what it reads of a process, the growth it reports, the requests it
counts as lost (against a fake server that misbehaves on demand), and one short soak of a
real daemon of two workers that must lose nothing and drain."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def script(bench_script):
    return bench_script("soak")


SMAPS = """55d0c000-7ffd1000 ---p 00000000 00:00 0                          [rollup]
Rss:              204800 kB
Pss:              102400 kB
Pss_Anon:          51200 kB
Pss_File:          40960 kB
Pss_Shmem:         10240 kB
Shared_Clean:          0 kB
Private_Clean:      1024 kB
Private_Dirty:     49152 kB
Swap:                  0 kB
"""


def test_process_figures(script):
    figures = script.parse_smaps_rollup(SMAPS)
    assert figures == {"rss_mib": 200.0, "pss_mib": 100.0, "pss_anon_mib": 50.0, "private_mib": 49.0}
    own = script.read_process(os.getpid())
    assert own["rss_mib"] > 10 and own["fds"] >= 3 and own["threads"] >= 1
    assert script.read_process(2 ** 22 + 7) is None  # no such process


def test_descendants_and_labels(script):
    parents = {10: 1, 11: 10, 12: 10, 13: 11, 20: 1}
    assert script.descendants(10, parents) == [10, 11, 12, 13]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        labels = script.label_processes(os.getpid(), {})
        assert labels["daemon"] == os.getpid() and child.pid in labels.values()
        assert script.label_processes(None, {child.pid: "worker 0 (EPD)"}) == {"worker 0 (EPD)": child.pid}
    finally:
        child.kill()
        child.wait()


def test_growth_per_hour(script):
    assert script.growth_per_hour([(0, 100.0), (1800, 101.0), (3600, 102.0)]) == pytest.approx(2.0)
    assert script.growth_per_hour([(0, 5.0), (60, 4.0), (120, 5.0), (180, 4.0)]) == pytest.approx(-12.0)
    assert script.growth_per_hour([(0, 1.0), (1, 2.0)]) is None
    samples = [{"t": t, "processes": {"w": {"pid": 3, "pss_mib": 100 + t / 36, "fds": 9}}} for t in (0, 100, 3600, 7200)]
    growth = script.summarize(samples, settle=100)
    assert growth["w"]["samples"] == 3 and growth["w"]["pss_mib"]["first"] == pytest.approx(100 + 100 / 36)
    assert growth["w"]["pss_mib"]["per_hour"] == pytest.approx(100.0) and growth["w"]["fds"]["per_hour"] == 0
    assert "| w | 3 |" in script.table(growth)


def test_drained(script):
    idle = {"num_inflight": 0, "num_running": 0, "num_waiting": 0, "num_kv_blocks_used": 0}
    assert script.drained({"instances": [idle, idle]})
    assert not script.drained({"instances": [idle, {**idle, "num_kv_blocks_used": 3}]})
    assert not script.drained({"instances": [{**idle, "num_inflight": 1}]})


def test_bodies_of_each_kind(script):
    traffic = script.Traffic("http://x", "m", ["data:image/jpeg;base64,AA"], 16, 0.0, 0)
    bad_ones = set()
    for index in range(40):
        kind = script.KINDS[index % len(script.KINDS)]
        body, tokens = traffic.body(kind, index)
        assert 8 <= tokens <= 16 and body["ignore_eos"] is True
        assert body["stream"] is (kind != "text-sampled")
        images = [p for p in body["messages"][0]["content"] if isinstance(p, dict) and p["type"] == "image_url"] \
            if isinstance(body["messages"][0]["content"], list) else []
        assert len(images) == (0 if kind == "text-sampled" else 1)
        if kind == "image-sampled":
            assert body["temperature"] == 0.8 and ("seed" in body) == bool(index % 2)
        wrong = {"not an image": "aGVsbG8" in json.dumps(body), "top_p": body.get("top_p") == 2,
                 "max_tokens": body["max_tokens"] < 0, "unknown field": "frobnicate" in body}
        assert sum(wrong.values()) == (kind == "bad"), (kind, wrong)
        if kind == "bad":
            bad_ones.add(next(name for name, is_wrong in wrong.items() if is_wrong))
    assert len(bad_ones) == 4  # each bad body in turn


def _one(script, url: str, kind: str, index: int, directive: str) -> str | None:
    """The soak's verdict on one request to the fake server, with ``directive`` in its prompt."""
    traffic = script.Traffic(url, "fake-model", ["data:image/jpeg;base64,AA"], 12, 0.0, 0)
    made = traffic.body

    def body(kind, index):
        body, tokens = made(kind, index)
        content = body["messages"][0]["content"]
        content[-1]["text"] += " " + directive
        return body, tokens

    traffic.body = body

    async def run():
        async with aiohttp.ClientSession() as session:
            return await traffic.one(session, kind, index)

    return asyncio.run(run())


def test_what_counts_as_lost(script, server_url):
    assert _one(script, server_url, "image-greedy", 0, "tbt=0.001") is None
    assert "token(s) for max_tokens" in _one(script, server_url, "image-greedy", 0, "tbt=0.001 extra=1")
    assert "without [DONE]" in _one(script, server_url, "image-sampled", 1, "tbt=0.001 cut=3")
    assert "HTTP 503" in _one(script, server_url, "image-greedy", 0, "fail=503")
    assert _one(script, server_url, "cut", 3, "tbt=0.001 cut=3") is None  # the client went first
    # A bad body: refused with a 4xx and OpenAI's error shape, or lost.
    assert _one(script, server_url, "bad", 4, "fail=400") is None
    assert "got HTTP 200" in _one(script, server_url, "bad", 4, "tbt=0.001")
    assert "got HTTP 500" in _one(script, server_url, "bad", 4, "fail=500")


def test_a_short_soak_with_kills_and_a_redeploy_loses_nothing_and_drains(tiny_llava_dir, tmp_path):
    """Two workers under traffic of every kind; a worker killed every 6 s (each restarted, its
    requests run again: EP's, then an EPD instance's) and a live redeploy to 2EPD at 9 s; once
    two kills and the redeploy have happened (at 12 s, later on a busy machine: the next kill
    waits for the redeploy to end) a SIGTERM stops the traffic (as a service manager or a
    shell's background job would), and the soak still drains and reports."""
    out = tmp_path / "soak.json"
    soak = subprocess.Popen(
        [sys.executable, str(BENCH / "soak.py"), "--model", tiny_llava_dir, "--devices", "cpu:2", "--deploy",
         "1EP+1D", "--minutes", "2", "--streams", "12", "--max-tokens", "12", "--images", "4",
         "--sample-every", "3", "--settle-minutes", "0", "--kill-every", "0.1", "--redeploy-every", "0.15",
         "--redeploy", "2EPD", "1EP+1D", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=BENCH,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # as a background job starts
    lines = []
    try:
        for line in soak.stdout:  # the traffic starts once the daemon is healthy
            lines.append(line)
            if line.startswith("soaking "):
                break
        deadline = time.monotonic() + 60
        for line in soak.stdout:  # a line every 3 s at least (the samples)
            lines.append(line)
            kills = sum(" killed worker " in seen for seen in lines)
            if kills >= 2 and any(" redeploy 2EPD" in seen for seen in lines) or time.monotonic() > deadline:
                break
        soak.terminate()
        stdout = "".join(lines) + soak.communicate(timeout=120)[0]
    finally:
        soak.kill()
    assert soak.returncode == 0, stdout[-5000:]
    result = json.loads(out.read_text())
    assert all(k["served"] > 0 and k["lost"] == 0 for k in result["requests"].values()), result["requests"]
    assert result["drained"] and result["kills"] >= 2 and sum(result["restarts"].values()) == result["kills"]
    redeploy = next(e for e in result["events"] if "redeploy" in e)
    assert redeploy["redeploy"] == "2EPD" and "seconds" in redeploy
    labels = set(result["growth"])
    assert {"daemon", "worker 0", "worker 1"} <= labels
    assert len(result["samples"]) >= 3
    assert result["interrupted"] and 12 < result["seconds"] < 90
    assert "| worker 1 |" in stdout
