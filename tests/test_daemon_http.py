"""The operator CLI's requests to a daemon (``hydrad.cli.daemon_http``): the admin token is
sent, a POST's answer is read line by line, and every failure is one ``HydradError`` line
with the daemon's own message where it sent one."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hydrad.cli.daemon_http import daemon_request
from hydrad.cli.redeploy import post_lines
from hydrad.errors import HydradError


class Handler(BaseHTTPRequestHandler):
    seen: list = []

    def log_message(self, *args):
        pass

    def _send(self, code: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        Handler.seen.append(("GET", self.path, self.headers.get("Authorization")))
        if self.path == "/admin/status":
            self._send(200, b'{"ok": true}')
        elif self.path == "/forbidden":
            self._send(403, json.dumps({"error": {"message": "admin token required", "type": "x"}}).encode())
        else:
            self._send(500, b"<html>boom</html>", "text/html")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Handler.seen.append(("POST", self.path, body, self.headers.get("Content-Type"),
                             self.headers.get("Authorization")))
        self._send(200, b'{"progress": "one"}\n\n{"deploy": "1EP+1D", "seconds": 1.5}\n')


@pytest.fixture()
def daemon_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    Handler.seen = []
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def test_a_get_sends_the_admin_token_and_reads_the_answer(daemon_url):
    with daemon_request(daemon_url, "/admin/status", "secret") as response:
        assert json.load(response) == {"ok": True}
    assert Handler.seen == [("GET", "/admin/status", "Bearer secret")]
    with daemon_request(daemon_url, "/admin/status") as response:
        response.read()
    assert Handler.seen[-1][2] is None


def test_a_post_answers_line_by_line(daemon_url):
    lines = list(post_lines(daemon_url, "/admin/redeploy", {"deploy": "1EP+1D"}, "t", 5.0))
    assert lines == [{"progress": "one"}, {"deploy": "1EP+1D", "seconds": 1.5}]
    assert Handler.seen == [("POST", "/admin/redeploy", {"deploy": "1EP+1D"}, "application/json", "Bearer t")]


def test_failures_are_one_line_with_the_daemons_message(daemon_url):
    with pytest.raises(HydradError, match=r"/forbidden: HTTP 403: admin token required$"):
        with daemon_request(daemon_url, "/forbidden"):
            pass
    with pytest.raises(HydradError, match=r"/other: HTTP 500: Internal Server Error$"):
        with daemon_request(daemon_url, "/other"):
            pass
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(HydradError, match=rf"^cannot reach the daemon at http://127.0.0.1:{port}: "):
        with daemon_request(f"http://127.0.0.1:{port}", "/admin/status", timeout=2):
            pass
