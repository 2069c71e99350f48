"""The worker loop and the daemon's pipe client, with a fake engine in a thread."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
import time

import pytest

from factories import RecordingSink
from hydrad.engine.inputs import EngineOutput, EngineRequest, EngineStats, FinishedRequest
from hydrad.engine.worker import run_worker
from hydrad.errors import RequestError
from hydrad.sampling_params import SamplingParams
from hydrad.cluster.worker_client import WorkerClient, WorkerLost
from hydrad.cluster.requests import RequestTable
from hydrad.cluster.router import Router
from hydrad.transport.messages import Abort, AddRequest, GetStats, Shutdown, StatsReply, StepOutput


class FakeEngine:
    """Emits token 100+i at step i of each request; refuses prompts containing 0."""

    max_model_len = 64

    def __init__(self):
        self.requests: dict[str, list] = {}

    def add_request(self, req: EngineRequest) -> None:
        if 0 in req.prompt_token_ids:
            raise ValueError("token 0 is not allowed")
        self.requests[req.req_id] = [req.sampling_params.max_tokens, 0]

    def abort_requests(self, req_ids) -> None:
        for req_id in req_ids:
            self.requests.pop(req_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        return bool(self.requests)

    def take_offers(self) -> list:
        return []  # one EPD instance: nothing migrates

    def take_pulled(self) -> list:
        return []

    def step(self) -> EngineOutput:
        out = EngineOutput()
        for req_id, state in list(self.requests.items()):
            state[1] += 1
            out.req_ids.append(req_id)
            out.token_ids.append(100 + state[1])
            if state[1] == state[0]:
                out.finished.append(FinishedRequest(req_id, "length", {"decode_exec": 0.001}))
                del self.requests[req_id]
        return out

    def get_stats(self) -> EngineStats:
        n = len(self.requests)
        return EngineStats(n, 0, n / 10, 0.0, n, 0, 0)


def request(req_id: str, max_tokens: int, prompt=(1, 2)) -> EngineRequest:
    return EngineRequest(req_id, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0))


def start_worker(engine):
    daemon_end, worker_end = mp.Pipe()

    def target():
        try:
            run_worker(engine, worker_end)
        except EOFError:  # the daemon end closed: worker_main exits on this
            pass

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return daemon_end, thread


def recv_until(conn, kind, timeout: float = 10.0):
    while True:
        if not conn.poll(timeout):  # a worker thread that died must fail the test, not hang it
            raise AssertionError(f"no {kind.__name__} within {timeout} s")
        msg = conn.recv()
        if isinstance(msg, kind):
            return msg


def test_shutdown_finishing_running_requests():
    conn, thread = start_worker(FakeEngine())
    conn.send(AddRequest(request("a", 3)))
    conn.send(Shutdown(finish_running=True))
    tokens = []
    while True:
        msg = recv_until(conn, StepOutput)
        tokens += msg.output.token_ids
        if msg.output.finished:
            break
    assert tokens == [101, 102, 103]
    thread.join(5)
    assert not thread.is_alive()


def test_shutdown_aborting_running_requests():
    engine = FakeEngine()
    conn, thread = start_worker(engine)
    conn.send(GetStats(0))  # parks the worker in poll() until the request and Shutdown arrive together
    recv_until(conn, StatsReply)
    conn.send(AddRequest(request("a", 1000)))
    conn.send(Shutdown(finish_running=False))
    finished = []
    while not finished:
        finished += recv_until(conn, StepOutput).output.finished
    assert finished == [FinishedRequest("a", "abort")]
    thread.join(5)
    assert not thread.is_alive() and not engine.requests


def test_worker_exits_when_the_daemon_end_closes():
    conn, thread = start_worker(FakeEngine())
    conn.close()
    thread.join(5)
    assert not thread.is_alive()


def test_client_streams_aborts_stats_and_rejects():
    async def main():
        engine = FakeEngine()
        conn, thread = start_worker(engine)
        clients: list = []
        table = RequestTable(Router(clients, "round-robin"))
        client = WorkerClient(0, "EPD", "cpu", table)
        clients.append(client)
        await client.connect(conn)
        sink = RecordingSink()
        client.add_request(request("a", 3), sink)
        assert (await sink.until_ended())[:2] == ("finish", "length")
        assert sink.tokens == [101, 102, 103]
        assert client.num_inflight == 0 and client.tokens_per_second() > 0

        client.add_request(request("long", 10_000), RecordingSink())
        assert (await client.get_stats()).num_running == 1
        table.abort("long")
        assert client.num_inflight == 0
        for _ in range(50):
            if (await client.get_stats()).num_running == 0:
                break
        assert (await client.get_stats()).kv_usage == 0.0

        rejected = RecordingSink()
        client.add_request(request("bad", 3, prompt=(0,)), rejected)
        error = (await rejected.until_ended())[1]
        assert isinstance(error, RequestError) and "token 0" in str(error)

        pending = RecordingSink()
        client.add_request(request("lost", 10_000), pending)
        client.shutdown(finish_running=False)
        thread.join(5)
        assert (await pending.until_ended())[:2] == ("finish", "abort")
        for _ in range(100):  # the pipe's EOF marks the worker down
            if not client.alive:
                break
            await asyncio.sleep(0.01)
        assert not client.alive
        with pytest.raises(WorkerLost):
            client.add_request(request("late", 1), RecordingSink())

    asyncio.run(main())


def test_sends_to_a_busy_worker_never_block_the_event_loop():
    """A worker in a long step reads nothing; the daemon must keep serving meanwhile."""

    async def main():
        daemon_end, worker_end = mp.Pipe()
        client = WorkerClient(0, "EPD", "cpu", RequestTable(Router([], "round-robin")))
        await client.connect(daemon_end)
        received = []

        def busy_worker():  # reads only after a long "step"
            time.sleep(1.5)
            while len(received) < 9:
                received.append(worker_end.recv())

        thread = threading.Thread(target=busy_worker, daemon=True)
        thread.start()
        start = time.monotonic()
        for i in range(8):  # ~8 MB, far beyond what the socket buffers
            client.add_request(request(f"r{i}", 1, prompt=range(1, 250_000)), RecordingSink())
        client.abort(("r0",))
        assert time.monotonic() - start < 1.0
        for _ in range(200):  # the transport delivers the rest, in order
            if len(received) == 9:
                break
            await asyncio.sleep(0.05)
        assert [m.request.req_id for m in received[:8]] == [f"r{i}" for i in range(8)]
        assert received[8] == Abort(("r0",)) and len(received[1].request.prompt_token_ids) == 249_999
        client.close()
        worker_end.close()

    asyncio.run(main())


class PoolEngine(FakeEngine):
    """A fake engine with one shared pool to export to peers."""

    instance_id = 0

    def __init__(self):
        super().__init__()
        import torch

        self.pool = torch.zeros(64).share_memory_()
        self.detached: list[int] = []

    def pools(self):
        return {"kv": self.pool, "image": None}

    def share_pools(self) -> None:
        """Its pool is in shared memory from the start (a real engine moves it there here)."""

    def detach_peer(self, instance_id: int) -> None:
        self.detached.append(instance_id)


def test_a_detached_peer_s_unfetched_pool_descriptors_are_closed():
    """Pools exported to a peer that died before loading them: its ``DetachPeer`` closes the
    descriptors the worker's sharer kept for it (one per export; a peer that loaded its pools
    fetched them)."""
    import pickle

    from hydrad.transport.messages import DetachPeer, ExportPools, PoolsExported
    from hydrad.transport.sharing import HandleLedger

    engine = PoolEngine()
    exported: dict[int, HandleLedger] = {}
    daemon_end, worker_end = mp.Pipe()
    thread = threading.Thread(target=run_worker, args=(engine, worker_end, None, exported), daemon=True)
    thread.start()
    try:
        for peer in (7, 8):
            daemon_end.send(ExportPools(peer))
        blobs = {}
        for _ in range(2):
            msg = recv_until(daemon_end, PoolsExported)
            blobs[msg.peer_id] = msg.blob
        assert pickle.loads(blobs[8])["kv"].shape == (64,)  # peer 8 loads its pools; 7 never does
        assert (exported[7].num_held, exported[8].num_held) == (1, 0)
        for peer in (7, 8):
            daemon_end.send(DetachPeer(peer))
        daemon_end.send(GetStats(1))  # answered after the detaches
        recv_until(daemon_end, StatsReply)
        assert engine.detached == [7, 8] and exported == {}
        with pytest.raises((EOFError, OSError)):  # what 7 was sent is gone
            pickle.loads(blobs[7])
    finally:
        daemon_end.send(Shutdown())
        thread.join(5)
