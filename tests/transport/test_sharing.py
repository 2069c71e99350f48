"""A process that dies while taking a shared tensor's descriptor costs the sending process
one warning line, not a traceback from multiprocessing's resource sharer."""

from __future__ import annotations

import logging
import os
import socket
import struct
import sys
import time
from multiprocessing import reduction, resource_sharer

import pytest

from hydrad.transport.sharing import quiet_taker_resets


@pytest.fixture
def hook():
    previous = sys.excepthook
    yield
    sys.excepthook = previous


def test_a_taker_reset_mid_handshake_is_one_warning(hook, caplog, capsys):
    quiet_taker_resets()
    quiet_taker_resets()  # once is enough: not wrapped twice
    r, w = os.pipe()
    try:
        handle = reduction.DupFd(r)  # registers the descriptor with this process's sharer thread
        address = resource_sharer._resource_sharer._address
        assert handle is not None and address is not None
        # A taker that connects and dies at once: its socket closes with a reset.
        taker = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        taker.connect(address)
        taker.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        with caplog.at_level(logging.WARNING, logger="hydrad.link"):
            taker.close()
            deadline = time.monotonic() + 5
            while not caplog.records and time.monotonic() < deadline:
                time.sleep(0.01)
        assert [r.getMessage().startswith("a process went away while taking a shared tensor") for r in caplog.records] \
            == [True], caplog.records
        assert "Traceback" not in capsys.readouterr().err
    finally:
        os.close(r)
        os.close(w)


def test_other_exceptions_reach_the_previous_hook(hook):
    seen = []
    sys.excepthook = lambda *info: seen.append(info[0])
    quiet_taker_resets()
    try:
        raise ConnectionResetError("elsewhere")
    except ConnectionResetError:
        sys.excepthook(*sys.exc_info())
    assert seen == [ConnectionResetError]
