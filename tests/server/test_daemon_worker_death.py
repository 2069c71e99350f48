"""A worker dies: it is restarted with its role and its requests run again (from the tokens
they had); a worker that keeps failing to restart is a crash loop, reported, not retried
forever; with restarts off, a stage left without a live instance stops the daemon for its
service manager."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import time

import aiohttp
import pytest

from daemon_process import (
    Daemon,
    assert_gone,
    blocks_held_once_freed,
    http,
    open_stream,
    shared_memory_descriptors,
    stream_events,
    wait_for,
)
from test_daemon_shutdown import JSON, stream_body

pytestmark = pytest.mark.slow


def instances(daemon: Daemon) -> list[dict]:
    return http("GET", daemon.url + "/admin/status").json()["instances"]


def healthy(daemon: Daemon) -> bool:
    return http("GET", daemon.url + "/health").status_code == 200


async def decoding_at_least(daemon: Daemon, num_running: int) -> None:
    """Until instance 2 (the D of ``1E+1P+1D``) decodes ``num_running`` requests (its status,
    read off the loop)."""
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + 60
    while (await loop.run_in_executor(None, instances, daemon))[2]["num_running"] < num_running:
        assert time.monotonic() < deadline, "the requests did not reach the decode instance"
        await asyncio.sleep(0.02)


async def stream(session: aiohttp.ClientSession, url: str, i: int, max_tokens: int) -> tuple[list[int], str | None]:
    """(token ids received, error message or None) of one streamed request: every third one
    with an image, every other one greedy, the rest seeded."""
    from test_daemon_api import PNG, data_url

    content = [{"type": "image_url", "image_url": {"url": data_url(PNG, "png")}}] if i % 3 == 0 else []
    content.append({"type": "text", "text": f"Tell me about {i}."})
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "return_token_ids": True, **({"seed": i} if i % 2 else {"temperature": 0})}
    tokens, error = [], None
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        if response.status != 200:
            return [], await response.text()
        async for line in response.content:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]["message"]
                elif chunk["choices"]:
                    tokens += chunk["choices"][0].get("token_ids") or []
    return tokens, error


@pytest.mark.parametrize("rerun_image_mb", [None, 0])
def test_a_killed_worker_is_restarted_and_its_requests_run_again(tiny_llava_dir, tmp_path, rerun_image_mb):
    """SIGKILL the decode instance of 1E+1P+1D under a steady stream of requests: the
    requests it was decoding run again from the tokens they had and end as if nothing had
    happened (the same tokens as the same requests sent afterwards: greedy and seeded);
    requests sent meanwhile wait for it; it comes back with its pools shared again, and
    nothing is left held. With ``server.rerun_image_mb = 0`` the requests with images that
    it was decoding fail with a clear error instead, and only they."""
    config = tmp_path / "hydrad.toml"
    config.write_text("" if rerun_image_mb is None else f"[server]\nrerun_image_mb = {rerun_image_mb}\n")
    daemon = Daemon(["--model", str(tiny_llava_dir), "--config", str(config), "--devices", "cpu:3",
                     "--deploy", "1E+1P+1D"], tmp_path / "hydrad.log")
    try:
        workers = instances(daemon)
        decode = next(i for i in workers if i["role"] == "D")

        async def load():
            async with aiohttp.ClientSession() as session:
                first = [asyncio.ensure_future(stream(session, daemon.url, i, 200)) for i in range(24)]
                await decoding_at_least(daemon, 20)  # most of them, so some with images
                os.kill(decode["pid"], signal.SIGKILL)
                later = [asyncio.ensure_future(stream(session, daemon.url, 100 + i, 30)) for i in range(16)]
                return await asyncio.gather(*first), await asyncio.gather(*later)

        first, later = asyncio.run(load())
        failed = [i for i, (_, error) in enumerate(first) if error is not None]
        assert all(first[i][1] == "worker 2 (cpu, D) exited" for i in failed), first
        run_again = daemon.log().count("lost instance 2 after")
        if rerun_image_mb is None:
            assert not failed and run_again, daemon.log()
        else:  # those with an image (every third) that had a token
            assert failed and all(i % 3 == 0 for i in failed), failed
        assert all(len(first[i][0]) == 200 for i in range(24) if i not in failed)
        # Requests sent after the kill waited for D and finished.
        assert [(len(tokens), error) for tokens, error in later] == [(30, None)] * len(later), later
        assert wait_for(lambda: healthy(daemon), 30), daemon.log()
        restarted = instances(daemon)
        assert [i["state"] for i in restarted] == ["ready"] * 3 and restarted[2]["restarts"] == 1
        assert restarted[2]["pid"] != decode["pid"]
        assert "worker 2 (cpu, D, pid" in daemon.log() and "restarted in" in daemon.log()
        metrics = http("GET", daemon.url + "/metrics").text
        assert re.search(rf'^hydrad_requests_lost_total{{model_name="[^"]+"}} {len(failed)}\.0$', metrics, re.M), metrics
        assert re.search(rf'^hydrad_requests_run_again_total{{model_name="[^"]+"}} {run_again}\.0$', metrics, re.M)

        async def again():  # the same requests, uninterrupted
            async with aiohttp.ClientSession() as session:
                return await asyncio.gather(*(stream(session, daemon.url, i, 200) for i in range(24)))

        uninterrupted = asyncio.run(again())
        assert all(error is None for _, error in uninterrupted)
        for i in range(24):
            if i not in failed:
                assert first[i][0] == uninterrupted[i][0], i
        held = blocks_held_once_freed(daemon, 10)
        assert held == [(0, 0)] * len(held)
        metrics = http("GET", daemon.url + "/metrics").text  # no pixels kept once all ended
        assert re.search(r'^hydrad_rerun_image_bytes\{model_name="[^"]+"\} 0\.0$', metrics, re.M), metrics
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.stop()


def test_a_hung_worker_is_killed_and_restarted_and_systemds_watchdog_is_pinged(tiny_llava_dir, tmp_path,
                                                                               monkeypatch):
    """SIGSTOP the decode instance of 1E+1P+1D while it decodes (a hang: alive, silent):
    with ``server.worker_stall_timeout = 1`` the daemon finds it silent while it holds
    requests, probes it, kills it and restarts it, and its requests run again and finish;
    the log says why. Before that, under the same small timeout, busy workers are left
    alone. Started by systemd with ``WatchdogSec`` (its environment, a socket read as
    systemd does), the daemon says READY=1, then pings WATCHDOG=1 four times per interval."""
    import socket
    import threading

    notify_path = str(tmp_path / "notify.sock")
    notifications: list[bytes] = []
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(notify_path)
    server.settimeout(0.5)

    def read() -> None:
        while server.fileno() >= 0:
            try:
                notifications.append(server.recv(4096))
            except (TimeoutError, OSError):
                continue  # nothing for 0.5 s, or the socket closed: then the loop ends

    threading.Thread(target=read, daemon=True).start()
    monkeypatch.setenv("NOTIFY_SOCKET", notify_path)
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    config = tmp_path / "hydrad.toml"
    config.write_text("[server]\nworker_stall_timeout = 1.0\n")
    daemon = Daemon(["--model", str(tiny_llava_dir), "--config", str(config), "--devices", "cpu:3",
                     "--deploy", "1E+1P+1D"], tmp_path / "hydrad.log")
    try:
        decode = instances(daemon)[2]

        async def load(kill: bool):
            async with aiohttp.ClientSession() as session:
                streams = [asyncio.ensure_future(stream(session, daemon.url, i, 100)) for i in range(8)]
                if kill:
                    await decoding_at_least(daemon, 4)
                    os.kill(decode["pid"], signal.SIGSTOP)
                return await asyncio.wait_for(asyncio.gather(*streams), 120)  # a hang fails the test

        assert [(len(t), e) for t, e in asyncio.run(load(kill=False))] == [(100, None)] * 8
        assert [i["restarts"] for i in instances(daemon)] == [0, 0, 0]  # busy is not hung
        assert [(len(t), e) for t, e in asyncio.run(load(kill=True))] == [(100, None)] * 8
        assert re.search(rf"worker 2 \(cpu, D, pid {decode['pid']}\) is down: answered nothing for [0-9]+ s while "
                         r"holding [0-9]+ request\(s\): killed; process killed by SIGKILL; restarting it", daemon.log())
        assert wait_for(lambda: healthy(daemon), 30), daemon.log()
        assert [i["restarts"] for i in instances(daemon)] == [0, 0, 1]
        ready = next(i for i, n in enumerate(notifications) if n.startswith(b"READY=1"))
        assert b"WATCHDOG=1" not in notifications[:ready] and notifications.count(b"WATCHDOG=1") >= 8, notifications
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.stop()
        server.close()


@pytest.mark.parametrize("frontends", [1, 2])
def test_requests_without_a_token_survive_their_instance_and_new_ones_wait_for_it(tiny_llava_dir, tmp_path,
                                                                                  frontends):
    """The only encoder of 1E+1PD is stopped (SIGSTOP) with requests with images queued on it,
    then killed: those requests, which had no token yet, run again once it is back, and the
    requests with images sent while it restarts wait for it (both used to fail: 'worker 0
    (cpu, E) exited', and 503 'no live instance can take stage E'); text requests go on
    meanwhile. The same through several front-end processes. The descriptors of the pixels sent
    to the encoder that it never took are closed (they kept the pixels' memory for the daemon's
    life before)."""
    from test_daemon_api import PNG, data_url

    config = tmp_path / "hydrad.toml"
    config.write_text(f"[server]\nfrontend_processes = {frontends}\n")
    daemon = Daemon(["--model", str(tiny_llava_dir), "--config", str(config), "--devices", "cpu:2",
                     "--deploy", "1E+1PD"], tmp_path / "hydrad.log")
    try:
        encoder = next(i for i in instances(daemon) if i["role"] == "E")
        descriptors = shared_memory_descriptors(daemon.process.pid)

        async def ask(session, i: int, image: bool):
            content = [{"type": "image_url", "image_url": {"url": data_url(PNG, "png")}}] if image else []
            content.append({"type": "text", "text": f"Describe {i}."})
            body = {"messages": [{"role": "user", "content": content}], "max_tokens": 6, "ignore_eos": True,
                    "temperature": 0, "stream": bool(i % 2)}
            async with session.post(daemon.url + "/v1/chat/completions", json=body) as response:
                text = await response.text()
                return response.status, '"finish_reason":"length"' in text.replace(" ", ""), "error" in text

        async def main():
            connector = aiohttp.TCPConnector(limit=0, force_close=True)  # a connection each: any process
            async with aiohttp.ClientSession(connector=connector) as session:
                os.kill(encoder["pid"], signal.SIGSTOP)
                held = [asyncio.ensure_future(ask(session, i, image=True)) for i in range(6)]
                text = [asyncio.ensure_future(ask(session, 100 + i, image=False)) for i in range(4)]
                assert await asyncio.gather(*text) == [(200, True, False)] * 4  # PD serves on
                os.kill(encoder["pid"], signal.SIGKILL)
                loop = asyncio.get_running_loop()
                deadline = time.monotonic() + 10
                while (await loop.run_in_executor(None, instances, daemon))[encoder["id"]]["state"] != "restarting":
                    assert time.monotonic() < deadline, "the encoder was not seen restarting"
                    await asyncio.sleep(0.02)
                later = [asyncio.ensure_future(ask(session, 200 + i, image=True)) for i in range(6)]
                return await asyncio.gather(*held), await asyncio.gather(*later)

        held, later = asyncio.run(main())
        assert held == [(200, True, False)] * 6
        assert later == [(200, True, False)] * 6
        assert instances(daemon)[encoder["id"]]["restarts"] == 1
        assert daemon.log().count("lost instance 0 after 0 tokens: running it again") == 6
        assert "WARNING hydrad.migration: instance 0 held 6 request(s) when it died: 6 run again from the tokens " \
               "they had (0 tokens), 0 to be pulled by another instance, 0 failed" in daemon.log()
        metrics = http("GET", daemon.url + "/metrics").text
        assert re.search(r'^hydrad_requests_run_again_total\{model_name="[^"]+"\} 6\.0$', metrics, re.M), metrics
        assert re.search(r'^hydrad_requests_lost_total\{model_name="[^"]+"\} 0\.0$', metrics, re.M)
        assert re.search(r'^hydrad_worker_restarts_total\{instance="0",model_name="[^"]+"\} 1\.0$', metrics, re.M)
        assert "worker 0: closed 6 shared-memory descriptor(s) it never took" in daemon.log()
        assert wait_for(lambda: shared_memory_descriptors(daemon.process.pid) == descriptors, 10), \
            (shared_memory_descriptors(daemon.process.pid), descriptors)
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.stop()


def _crash(pid: int, how: signal.Signals) -> None:
    """Kill a worker with ``how``; a crash's signal (SIGSEGV) without leaving a core file."""
    import resource

    resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))
    os.kill(pid, how)


@pytest.mark.parametrize("frontends, how", [(1, signal.SIGSEGV), (2, signal.SIGSEGV), (1, signal.SIGKILL)])
def test_a_request_that_takes_down_two_workers_is_quarantined(tiny_llava_dir, tmp_path, frontends, how):
    """A request whose worker crashes, run again, and crashes the restarted worker too fails;
    the same request sent again is refused (400, ``request_quarantined``) before it reaches a
    worker, so a client resending it cannot put the worker in a crash loop; other requests
    are served. The same through several front-end processes. Where the workers were killed
    from outside (SIGKILL, as an operator's ``kill -9``), the request still fails, but the
    same request sent again is served: it was a bystander."""
    config = tmp_path / "hydrad.toml"
    config.write_text(f"[server]\nfrontend_processes = {frontends}\n")
    daemon = Daemon(["--model", str(tiny_llava_dir), "--config", str(config), "--devices", "cpu:1"],
                    tmp_path / "hydrad.log")
    body = {"messages": [{"role": "user", "content": "A request that takes workers down."}], "max_tokens": 1800,
            "ignore_eos": True, "temperature": 0, "stream": True}
    try:
        async def kill_twice() -> tuple[int, str | None]:
            """Kill the worker at the request's first token, and again at its first token on
            the restarted worker; (tokens received, the stream's error)."""
            loop = asyncio.get_running_loop()
            killed: list[int] = []
            tokens, error = 0, None
            async with aiohttp.ClientSession() as session:
                async with session.post(daemon.url + "/v1/chat/completions", json=body) as response:
                    assert response.status == 200, await response.text()
                    async for line in response.content:
                        if not line.startswith(b"data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            error = chunk["error"]["message"]
                            break
                        tokens += bool(chunk["choices"])
                        if len(killed) < 2:
                            worker = (await loop.run_in_executor(None, instances, daemon))[0]
                            if worker["state"] == "ready" and worker["pid"] not in killed:
                                _crash(worker["pid"], how)
                                killed.append(worker["pid"])
            assert len(killed) == 2, (killed, tokens, error)
            return tokens, error

        tokens, error = asyncio.run(kill_twice())
        assert error == "worker 0 (cpu, EPD) exited" and tokens < 1800, (tokens, error)
        assert "lost a second instance (0): failed" in daemon.log()
        assert wait_for(lambda: healthy(daemon), 30), daemon.log()
        if how == signal.SIGKILL:
            assert wait_for(lambda: "after losing another; not refused: it was killed from outside" in daemon.log(),
                            10), daemon.log()
            again = http("POST", daemon.url + "/v1/chat/completions",
                         json.dumps({**body, "stream": False, "max_tokens": 4}).encode(), JSON)
            assert again.status_code == 200, again.text
            assert http("GET", daemon.url + "/admin/status").json()["failures"]["quarantined"] == 0
            assert daemon.stop() == 0, daemon.log()
            return
        assert ("1 request(s) lost instance 0 (killed by SIGSEGV) after losing another: the same request(s) are "
                "refused for 300 s") in daemon.log()
        for stream in (True, False):  # refused at once, streaming or not, whichever process takes it
            again = http("POST", daemon.url + "/v1/chat/completions", json.dumps({**body, "stream": stream}).encode(),
                         JSON)
            assert again.status_code == 400, again.text
            assert again.json()["error"]["code"] == "request_quarantined", again.text
            assert "refused for" in again.json()["error"]["message"]
        other = http("POST", daemon.url + "/v1/chat/completions",
                     json.dumps({**body, "stream": False, "max_tokens": 8,
                                 "messages": [{"role": "user", "content": "Another one."}]}).encode(), JSON)
        assert other.status_code == 200, other.text
        assert instances(daemon)[0]["restarts"] == 2
        status = http("GET", daemon.url + "/admin/status").json()["failures"]
        assert status["quarantined"] == 1 and status["requests_refused_quarantined"] == 2, status
        metrics = http("GET", daemon.url + "/metrics").text
        assert re.search(r'^hydrad_requests_refused_quarantined_total\{model_name="[^"]+"\} 2\.0$', metrics, re.M)
        assert re.search(r'^hydrad_quarantined_requests\{model_name="[^"]+"\} 1\.0$', metrics, re.M), metrics
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.stop()


def test_a_worker_that_cannot_restart_is_a_crash_loop_and_the_others_serve_on(tiny_llava_dir, tmp_path):
    """The model folder disappears after start, then a worker of 2EPD is killed: every
    restart fails at loading; after the limit the daemon says crash loop, does not hang,
    and the other instance serves on (degraded, /health 503 naming it)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llava_dir, model)
    config = tmp_path / "hydrad.toml"
    config.write_text("[server]\nworker_restart_limit = 2\nworker_restart_window = 60\n")
    daemon = Daemon(["--model", str(model), "--config", str(config), "--devices", "cpu:2", "--deploy", "2EPD"],
                    tmp_path / "hydrad.log")
    try:
        victim, survivor = instances(daemon)
        model.rename(tmp_path / "gone")
        os.kill(victim["pid"], signal.SIGKILL)
        assert wait_for(lambda: "crash loop" in daemon.log(), 60), daemon.log()
        health = http("GET", daemon.url + "/health")
        assert health.status_code == 503
        assert list(health.json()["crash_loop"]) == [str(victim["id"])]
        assert [i["state"] for i in instances(daemon)] == ["crash loop", "ready"]
        assert daemon.log().count(f"hydrad.supervisor: worker {victim['id']} failed to restart") == 2
        body = json.dumps({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
                           "temperature": 0}).encode()
        for _ in range(4):  # round-robin would have sent every other one to the dead instance
            reply = http("POST", daemon.url + "/v1/chat/completions", body, JSON)
            assert reply.status_code == 200, reply.text
        assert daemon.process.poll() is None
        assert daemon.stop() == 0, daemon.log()
        assert_gone([survivor["pid"]])
    finally:
        daemon.stop()


def test_with_restarts_off_a_stage_without_a_live_instance_stops_the_daemon(tiny_llava_dir, tmp_path):
    config = tmp_path / "hydrad.toml"
    config.write_text("[server]\nworker_restart_limit = 0\n")
    daemon = Daemon(["--model", str(tiny_llava_dir), "--config", str(config), "--devices", "cpu:2",
                     "--deploy", "1E+1PD"], tmp_path / "hydrad.log")
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
