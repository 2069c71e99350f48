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
from factories import open_paths

from hydrad.transport.sharing import HandleLedger, dumps_recording, quiet_taker_resets


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


def descriptors_of(path: str) -> int:
    """This process's descriptors open on ``path`` (others come and go with the rest of the
    suite: only these are counted)."""
    return open_paths().count(path)


def shared_tensor():
    """A tensor in shared memory, and the file its descriptors name."""
    import torch

    before = set(open_paths())
    tensor = torch.arange(12, dtype=torch.float32).share_memory_()
    (path,) = [p for p in set(open_paths()) - before if "/dev/shm/" in p]
    return tensor, path


def test_a_ledger_closes_the_descriptors_its_taker_never_fetched(hook, caplog, capsys):
    """Two pickles of a shared tensor for one taker: the one it loads is fetched (the sharer
    forgets it); the other, never loaded, stays open until the ledger releases it."""
    import pickle

    quiet_taker_resets()
    ledger = HandleLedger()
    tensor, path = shared_tensor()
    assert descriptors_of(path) == 1  # the tensor's own
    taken, never = dumps_recording(tensor, ledger), dumps_recording(tensor, ledger)
    assert descriptors_of(path) == 3  # the sharer holds a duplicate per pickle
    assert pickle.loads(taken).tolist() == tensor.tolist()  # the taker fetches this one
    assert ledger.num_held == 1
    # The fetched duplicate is closed by the sharer's thread once it has sent it (the taker may
    # return first), and the taker closes what it received (it finds the storage it has).
    deadline = time.monotonic() + 5
    while descriptors_of(path) != 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert descriptors_of(path) == 2
    assert ledger.release() == 1
    assert ledger.num_held == 0 and ledger.release() == 0
    assert descriptors_of(path) == 1
    # The released one is gone from the sharer: a taker coming for it gets nothing, and this
    # process logs one warning, no traceback.
    with caplog.at_level(logging.WARNING, logger="hydrad.link"):
        with pytest.raises((EOFError, OSError)):
            pickle.loads(never)
        deadline = time.monotonic() + 5
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.01)
    assert [r.getMessage() for r in caplog.records] == [
        "a process asked for a shared tensor released when it was counted as gone"]
    assert "Traceback" not in capsys.readouterr().err


def test_a_ledger_forgets_fetched_descriptors_as_it_goes():
    import pickle

    ledger = HandleLedger()
    tensor, _ = shared_tensor()
    for _ in range(300):
        pickle.loads(dumps_recording(tensor, ledger))
    assert len(ledger._keys) < 64 + 2  # pruned of what was fetched
    assert ledger.num_held == 0 and ledger.release() == 0


def test_a_link_releases_what_its_dead_peer_never_read():
    """A link whose other end never reads: the request's pixels sent over it stay held by the
    sharer until ``release_handles``."""
    import asyncio
    from multiprocessing import Pipe

    from hydrad.engine.inputs import EngineRequest, ImageInput
    from hydrad.sampling_params import SamplingParams
    from hydrad.transport.link import WorkerLink
    from hydrad.transport.messages import AddRequest

    async def main():
        ours, theirs = Pipe()
        link = await WorkerLink.open(ours, lambda msg: None, lambda reason: None)
        pixels, path = shared_tensor()
        for i in range(3):
            link.send(AddRequest(EngineRequest(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=2),
                                               [ImageInput(pixels, 0, 1)])))
        link.send(AddRequest(EngineRequest("text", [1, 2, 3], SamplingParams(max_tokens=2))))
        held, before = link.handles.num_held, descriptors_of(path)
        released = link.release_handles()
        after = descriptors_of(path)
        link.close()
        theirs.close()
        return held, before, released, after

    assert asyncio.run(main()) == (3, 4, 3, 1)


def test_without_the_sharers_internals_nothing_is_recorded_and_pickling_goes_on(monkeypatch):
    """multiprocessing keeps no public view of its sharer; should its internals change, the
    ledger records nothing and releases nothing (as before it), and pickles still load."""
    import pickle
    from multiprocessing import resource_sharer

    from hydrad.transport import sharing

    monkeypatch.setattr(sharing, "_DUP_FD", None)  # no such class
    ledger = HandleLedger()
    tensor, _ = shared_tensor()
    blobs = [dumps_recording(tensor, ledger) for _ in range(3)]
    assert ledger.num_held == 0 and ledger.release() == 0
    assert all(pickle.loads(blob).tolist() == tensor.tolist() for blob in blobs)
    monkeypatch.undo()
    monkeypatch.delattr(resource_sharer._resource_sharer, "_cache")  # no such table
    assert sharing._held() == {}
    ledger.record(1)
    assert ledger.num_held == 0 and ledger.release() == 0
