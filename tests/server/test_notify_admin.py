import socket

import pytest
from aiohttp.test_utils import make_mocked_request

from hydrad.server.admin import check_admin_access
from hydrad.server.errors import APIError
from hydrad.server.notify import sd_notify


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
