import socket

import pytest
from aiohttp.test_utils import make_mocked_request

from hydrad.server.admin import check_admin_access
from hydrad.server.errors import APIError
from hydrad.server.notify import keep_alive, sd_notify, watchdog_interval


def test_sd_notify_sends_a_datagram(tmp_path, monkeypatch):
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(path)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        assert sd_notify("READY=1")
        assert server.recv(100) == b"READY=1"


def test_sd_notify_without_systemd(monkeypatch, tmp_path):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not sd_notify("READY=1")
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))  # a stale socket path
    assert not sd_notify("READY=1")


def test_sd_notify_never_waits_for_a_reader(tmp_path, monkeypatch):
    """A socket whose reader has stopped reading fills up (a few datagrams on Linux): sends
    then fail at once instead of blocking the event loop."""
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(path)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        results = [sd_notify("WATCHDOG=1", warn=False) for _ in range(10_000)]
        assert results[0] and not results[-1]


def test_watchdog_interval_is_systemds_for_this_process_only(monkeypatch):
    import os

    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert watchdog_interval() == 30.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_interval() == 30.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # meant for another process
    assert watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_PID")
    for bad in ("0", "soon"):
        monkeypatch.setenv("WATCHDOG_USEC", bad)
        assert watchdog_interval() is None


def test_keep_alive_pings_four_times_per_interval(tmp_path, monkeypatch):
    import asyncio

    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(path)
        server.settimeout(1.0)
        monkeypatch.setenv("NOTIFY_SOCKET", path)

        async def main():
            task = asyncio.ensure_future(keep_alive(0.4))
            pings = []
            loop = asyncio.get_running_loop()
            start = loop.time()
            while len(pings) < 5:
                pings.append((await loop.run_in_executor(None, server.recv, 100), loop.time() - start))
            task.cancel()
            return pings

        pings = asyncio.run(main())
        assert [p for p, _ in pings] == [b"WATCHDOG=1"] * 5
        assert 0.3 <= pings[-1][1] <= 0.7  # 4 gaps of 0.1 s


class FakeTransport:
    def __init__(self, peer):
        self.peer = peer

    def get_extra_info(self, name, default=None):
        return self.peer if name == "peername" else default

    def is_closing(self):
        return False


def admin_request(peer, token=None):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return make_mocked_request("GET", "/admin/status", headers=headers, transport=FakeTransport(peer))


@pytest.mark.parametrize("peer, token, allowed", [
    (("127.0.0.1", 5000), None, True),
    (("::1", 5000, 0, 0), None, True),
    (("10.0.0.5", 5000), None, False),
    (("10.0.0.5", 5000), "wrong", False),
    (("10.0.0.5", 5000), "s3cret", True),
])
def test_admin_access(peer, token, allowed):
    request = admin_request(peer, token)
    if allowed:
        check_admin_access(request, "s3cret")
    else:
        with pytest.raises(APIError) as info:
            check_admin_access(request, "s3cret")
        assert info.value.status == 403


def test_admin_token_unset_means_loopback_only():
    with pytest.raises(APIError):
        check_admin_access(admin_request(("10.0.0.5", 1), ""), "")
