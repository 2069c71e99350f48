"""Live redeploy through a real daemon: under a steady stream of requests (with images and
text-only, streamed and whole), the deployment goes through a chain that covers every kind
of role change; no request fails, every greedy output equals transformers' tokens, and no
block is held anywhere at the end."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest

from hydrad.engine.cores import cpu_threads, usable_cpus

from daemon_process import HYDRACTL, REPO, Daemon, blocks_held_once_freed, http
from test_daemon_deployments import MAX_TOKENS, _requests
from test_daemon_deployments import reference  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow


async def ask(session: aiohttp.ClientSession, url: str, messages: list, stream: bool) -> list[int]:
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True,
            "stream": stream}
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        if not stream:
            return (await response.json())["choices"][0]["token_ids"]
        tokens = []
        async for line in response.content:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if chunk["choices"]:
                    tokens += chunk["choices"][0].get("token_ids") or []
        return tokens


def steady_stream(url: str, stop: threading.Event, results: list) -> None:
    """Requests back to back, 6 at a time, until ``stop``: (request index, tokens or error)."""
    requests = _requests()

    async def worker(session, k):
        i = k
        while not stop.is_set():
            index = i % len(requests)
            try:
                results.append((index, await ask(session, url, requests[index][0], stream=i % 2 == 0)))
            except Exception as e:  # recorded: the test fails on any
                results.append((index, repr(e)))
            i += 6

    async def main():
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(worker(session, k) for k in range(6)))

    asyncio.run(main())


def redeploy(daemon: Daemon, spec: str) -> dict:
    """``hydractl redeploy`` as an operator runs it; the daemon's answer afterwards."""
    out = subprocess.run([sys.executable, *HYDRACTL, "redeploy", "--deploy", spec, "--url", daemon.url],
                         capture_output=True, text=True, timeout=180, cwd=REPO,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "COLUMNS": "120"})
    assert out.returncode == 0, out.stdout + out.stderr + daemon.log()[-3000:]
    assert f"serving as {spec} after" in out.stdout + out.stderr
    return http("GET", daemon.url + "/admin/status").json()


@pytest.mark.parametrize("devices, start, chain", [
    ("cpu:2", "2EPD", ["1E+1PD", "1EP+1D", "1ED+1P", "2EPD"]),
    ("cpu:3", "3EPD", ["1E+1P+1D", "1E+1EP+1D", "3EPD"]),
])
def test_redeploy_under_load_loses_nothing(tiny_llava_dir, tmp_path, reference, devices, start, chain):  # noqa: F811
    daemon = Daemon(["--model", str(tiny_llava_dir), "--devices", devices, "--deploy", start],
                    tmp_path / "hydrad.log")
    try:
        stop, results = threading.Event(), []
        load = threading.Thread(target=steady_stream, args=(daemon.url, stop, results), daemon=True)
        load.start()
        for spec in chain:
            time.sleep(0.5)
            before = len(results)
            status = redeploy(daemon, spec)
            assert status["deployment"]["deploy"] == spec
            # Each instance runs on its role's threads in the new deployment.
            roles = [i["role"] for i in status["instances"]]
            plan = cpu_threads(roles, usable_cpus())
            assert [(i["threads"], i["borrowed_threads"]) for i in status["instances"]] == [(t.own, t.borrow) for t in plan]
            # A borrower measured its model on the borrowed cores too, or, where its lenders had
            # work under the load for too long, left it to the next start and says so.
            measured = [i["borrow_latency_model"] is not None for i in status["instances"]]
            assert all(t.borrow or not m for m, t in zip(measured, plan))
            left = sum(bool(t.borrow) and not m for m, t in zip(measured, plan))
            assert daemon.log().count("is left to later: its lenders have work") >= left
            assert len(results) > before or spec == chain[0]  # requests went on meanwhile
        time.sleep(0.5)
        stop.set()
        load.join(120)
        assert not load.is_alive()
        errors = [r for r in results if isinstance(r[1], str)]
        assert not errors, errors[:3]
        assert len(results) > 20
        for index, tokens in results:
            assert tokens == reference[index], index
        history = [d["deploy"] for d in status["deployment"]["history"]]
        assert history == [start, *chain]
        assert all(d["seconds"] > 0 for d in status["deployment"]["history"][1:])
        assert [d["trigger"] for d in status["deployment"]["history"]] == ["start"] + ["admin"] * len(chain)
        # The same in the metrics: the deployment served now, every redeploy and its time.
        samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                   for line in http("GET", daemon.url + "/metrics").text.splitlines()
                   if line.startswith(("hydrad_deployment_info{", "hydrad_redeploy"))}
        model = tiny_llava_dir.name
        assert [k for k in samples if k.startswith("hydrad_deployment_info{")] == [
            f'hydrad_deployment_info{{deploy="{chain[-1]}",model_name="{model}"}}']
        assert samples[f'hydrad_redeploys_total{{model_name="{model}",trigger="admin"}}'] == len(chain)
        assert samples[f'hydrad_redeploys_total{{model_name="{model}",trigger="auto"}}'] == 0
        assert samples[f'hydrad_redeploy_failures_total{{model_name="{model}"}}'] == 0
        assert samples[f'hydrad_redeploy_seconds_total{{model_name="{model}",trigger="admin"}}'] == pytest.approx(
            sum(d["seconds"] for d in status["deployment"]["history"][1:]), rel=1e-3)
        held = blocks_held_once_freed(daemon, 10)
        assert held == [(0, 0)] * len(held)
        assert daemon.stop() == 0, daemon.log()[-3000:]
    finally:
        daemon.stop()


def test_a_bad_redeploy_is_refused_and_changes_nothing(tiny_llava_dir, tmp_path):
    daemon = Daemon(["--model", str(tiny_llava_dir), "--devices", "cpu:2", "--deploy", "1EP+1D"],
                    tmp_path / "hydrad.log")
    try:
        for body, param in [({"deploy": "1E+1P+1D"}, "deploy"), ({"deploy": "2E"}, "deploy"), ({}, "deploy")]:
            reply = http("POST", daemon.url + "/admin/redeploy", json.dumps(body).encode(),
                         {"Content-Type": "application/json"})
            assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
        out = subprocess.run([sys.executable, *HYDRACTL, "redeploy", "--deploy", "3EPD", "--url", daemon.url],
                             capture_output=True, text=True, timeout=60, cwd=REPO,
                             env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
        assert out.returncode == 1 and "error:" in out.stderr and "keeps the devices" in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert http("GET", daemon.url + "/admin/status").json()["deployment"]["deploy"] == "1EP+1D"

        # The deployment it serves: nothing changes, and hydractl says so.
        out = subprocess.run([sys.executable, *HYDRACTL, "redeploy", "--deploy", "1EP+1D", "--url", daemon.url],
                             capture_output=True, text=True, timeout=60, cwd=REPO,
                             env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
        assert out.returncode == 0 and out.stderr == "already serving as 1EP+1D: nothing to change\n", out.stderr
        reply = http("POST", daemon.url + "/admin/redeploy", json.dumps({"deploy": "1EP+1D"}).encode(),
                     {"Content-Type": "application/json"})
        last = json.loads(reply.text.strip().splitlines()[-1])
        assert (last["deploy"], last["changed"], last["seconds"]) == ("1EP+1D", False, 0.0), last
        assert len(http("GET", daemon.url + "/admin/status").json()["deployment"]["history"]) == 1

        # Two at once: one changes the deployment, the other is told why not, in its last line.
        def post(_):
            reply = http("POST", daemon.url + "/admin/redeploy", json.dumps({"deploy": "2EPD"}).encode(),
                         {"Content-Type": "application/json"})
            assert reply.status_code == 200, reply.text
            return json.loads(reply.text.strip().splitlines()[-1])

        with ThreadPoolExecutor(2) as pool:
            answers = sorted(pool.map(post, range(2)), key=lambda a: "error" in a)
        assert answers[0]["deploy"] == "2EPD" and answers[0]["changed"] and answers[0]["seconds"] > 0, answers
        assert "a redeploy is already under way" in answers[1]["error"]["message"], answers
        assert http("GET", daemon.url + "/admin/status").json()["deployment"]["deploy"] == "2EPD"
    finally:
        assert daemon.stop() == 0, daemon.log()[-3000:]
