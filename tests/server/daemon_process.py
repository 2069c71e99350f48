"""Start ``hydrad start`` as a subprocess on a free loopback port, for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HYDRAD = ["-m", "hydrad"]
HYDRACTL = ["-m", "hydrad.cli.hydractl_main"]
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Daemon:
    def __init__(self, args: list[str], log_path: Path, timeout: float = 180.0, repo: Path = REPO):
        """``repo``: the checkout whose hydrad runs (benchmarks measure older ones too)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(
            [sys.executable, *HYDRAD, "start", "--host", "127.0.0.1", "--port", str(self.port), *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env,
        )
        deadline = time.monotonic() + timeout
        while not self._healthy():
            if self.process.poll() is not None:
                raise RuntimeError(f"hydrad exited with {self.process.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"hydrad not ready after {timeout} s:\n{self.log()}")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def shared_memory_descriptors(pid: int) -> int:
    """Descriptors of torch shared memory the process holds (a request's pixels, a pool)."""
    from factories import open_paths

    return sum("/dev/shm/torch_" in path for path in open_paths(pid))


def wait_for(condition, timeout: float, interval: float = 0.05) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def assert_gone(pids: list[int], timeout: float = 10.0) -> None:
    """No process of ``pids`` is left (workers exit shortly after their daemon)."""
    wait_for(lambda: not any(pid_exists(p) for p in pids), timeout)
    assert not any(pid_exists(p) for p in pids)


def blocks_held(daemon: Daemon) -> list[tuple[int, int]]:
    """(KV blocks, image blocks) in use on each instance."""
    status = http("GET", daemon.url + "/admin/status").json()
    return [(i["num_kv_blocks_used"], i["num_image_blocks_used"]) for i in status["instances"]]


def blocks_held_once_freed(daemon: Daemon, timeout: float) -> list[tuple[int, int]]:
    """``blocks_held`` once no instance holds any, or after ``timeout`` seconds (a release
    may still be on its way when the last response arrives)."""
    wait_for(lambda: not any(kv or image for kv, image in blocks_held(daemon)), timeout, interval=0.1)
    return blocks_held(daemon)


def stream_events(text: str) -> list[str]:
    """The ``data:`` payloads of a server-sent event stream."""
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


class Response:
    def __init__(self, status: int, body: bytes, headers=None):
        self.status_code = status
        self.text = body.decode(errors="replace")
        self.headers = headers or {}

    def json(self):
        import json

        return json.loads(self.text)


def http(method: str, url: str, body: bytes | None = None, headers: dict | None = None,
         timeout: float = 30) -> Response:
    """One request with the standard library; any status comes back as a Response."""
    import urllib.error

    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return Response(response.status, response.read(), response.headers)
    except urllib.error.HTTPError as e:
        return Response(e.code, e.read(), e.headers)


def open_stream(url: str, body: bytes, headers: dict):
    """POST and return (connection, response) once the first data line has arrived."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request("POST", parts.path, body=body, headers=headers)
    response = conn.getresponse()
    assert response.status == 200, response.read()
    while not response.readline().startswith(b"data: {"):
        pass
    return conn, response
