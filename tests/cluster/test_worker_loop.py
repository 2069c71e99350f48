"""The worker loop and the daemon's pipe client, with a fake engine in a thread."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import threading
import time
from concurrent.futures import Future

import pytest

from factories import RecordingSink
from hydrad.engine.block_manager import BlockManager
from hydrad.engine.cores import CoreBoard, CoreLending, CpuThreads
from hydrad.engine.inputs import EngineOutput, EngineRequest, EngineStats, FinishedRequest
from hydrad.engine.profiler import NoProbeRoom, ProbingElsewhere
from hydrad.engine.worker import StepThreads, run_worker
from hydrad.errors import RequestError
from hydrad.sampling_params import SamplingParams
from hydrad.cluster.worker_client import WorkerClient, WorkerLost
from hydrad.cluster.requests import RequestTable
from hydrad.cluster.router import Router
from hydrad.transport.messages import (
    Abort,
    AddRequest,
    GetStats,
    Migrate,
    ModelMeasured,
    Reconfigure,
    Reconfigured,
    Shutdown,
    StatsReply,
    StepOutput,
    WorkerReady,
)


class FakeEngine:
    """Emits token 100+i at step i of each request; refuses prompts containing 0."""

    max_model_len = 64

    def __init__(self):
        self.requests: dict[str, list] = {}
        self.grammar_builds: dict[str, Future] = {}  # by request: its grammar's build, set by a test

    def grammar_pending(self, req) -> Future | None:
        build = self.grammar_builds.get(req.req_id)
        return None if build is None or build.done() else build

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


def shut_down(conn, thread, finish_running: bool = False, timeout: float = 5.0) -> None:
    """Shut the worker down and wait for its thread to end, reading what it sends meanwhile, as
    the daemon's link does: a worker whose pipe is full waits in ``send`` until it is read, and
    a request still streaming fills it within a few hundred steps."""
    conn.send(Shutdown(finish_running=finish_running))
    deadline = time.monotonic() + timeout
    while thread.is_alive() and time.monotonic() < deadline:
        try:
            if conn.poll(0.05):
                conn.recv()
        except (EOFError, OSError):
            break
    thread.join(max(0.0, deadline - time.monotonic()))
    assert not thread.is_alive()


async def connected_client(conn) -> tuple[WorkerClient, RequestTable]:
    """The daemon's client of one EPD worker on ``conn``'s other end, and its request table."""
    clients: list = []
    table = RequestTable(Router(clients, "round-robin"))
    client = WorkerClient(0, "EPD", "cpu", table)
    clients.append(client)
    await client.connect(conn)
    return client, table


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


def test_a_request_waits_for_its_grammar_while_the_others_stream():
    """A request whose grammar is being built is admitted when the build is done; meanwhile the
    worker steps the rest. A refusal then carries the count of messages at its arrival (the
    daemon's fence for a run aborted since), and a request aborted while waiting is dropped."""
    from hydrad.transport.messages import RequestRejected

    engine = FakeEngine()
    builds = {req_id: Future() for req_id in ("g", "bad", "gone")}
    engine.grammar_builds.update(builds)
    conn, thread = start_worker(engine)
    conn.send(AddRequest(request("a", 10_000)))
    conn.send(AddRequest(request("g", 3)))
    conn.send(AddRequest(request("bad", 3, prompt=(0,))))  # its 3rd message
    conn.send(AddRequest(request("gone", 3)))
    conn.send(Abort(("gone",)))
    for _ in range(20):  # "a" streams; nothing waiting has run
        assert set(recv_until(conn, StepOutput).output.req_ids) == {"a"}
    builds["gone"].set_result(None)
    builds["bad"].set_result(None)
    rejected = recv_until(conn, RequestRejected)
    assert (rejected.req_id, rejected.received) == ("bad", 3) and "token 0" in rejected.message
    builds["g"].set_result(None)
    tokens = []
    while True:
        out = recv_until(conn, StepOutput).output
        tokens += [t for r, t in zip(out.req_ids, out.token_ids) if r == "g"]
        if any(f.req_id == "g" for f in out.finished):
            break
    assert tokens == [101, 102, 103] and "gone" not in engine.requests
    shut_down(conn, thread)  # "a" still streams


def test_an_idle_worker_admits_a_request_when_its_grammar_is_built():
    engine = FakeEngine()
    engine.grammar_builds["g"] = build = Future()
    conn, thread = start_worker(engine)
    conn.send(AddRequest(request("g", 2)))
    assert not conn.poll(0.1)  # nothing to step until the grammar is there
    build.set_result(None)
    assert recv_until(conn, StepOutput).output.token_ids == [101]
    shut_down(conn, thread, finish_running=True)


def test_worker_exits_when_the_daemon_end_closes():
    conn, thread = start_worker(FakeEngine())
    conn.close()
    thread.join(5)
    assert not thread.is_alive()


def test_client_streams_aborts_stats_and_rejects():
    async def main():
        engine = FakeEngine()
        conn, thread = start_worker(engine)
        client, table = await connected_client(conn)
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

    def share_pools(self) -> int:
        """Its pool is in shared memory from the start (a real engine moves it there here)."""
        return 0

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


async def _next(conn, kind, timeout: float = 5.0):
    """The next ``kind`` message on a scripted worker's end (others skipped)."""
    for _ in range(int(timeout / 0.01)):
        while conn.poll():
            msg = conn.recv()
            if isinstance(msg, kind):
                return msg
        await asyncio.sleep(0.01)
    raise AssertionError(f"no {kind.__name__} within {timeout} s")


async def _until(predicate, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def test_a_request_given_again_to_a_worker_hears_nothing_of_its_aborted_run():
    """What a worker sent of a request before it read that request's abort (a step already
    under way) never reaches the request when the daemon gives it to that worker again under
    the same id: neither its tokens, its finish, nor a refusal of the old run."""
    from hydrad.transport.messages import RequestRejected

    async def main():
        daemon_end, worker = mp.Pipe()
        client, table = await connected_client(daemon_end)
        first = RecordingSink()
        client.add_request(request("r", 3), first)
        await _next(worker, AddRequest)  # the worker's 1st message
        table.abort("r")
        again = RecordingSink()
        client.add_request(request("r", 2), again)
        # Sent by the worker before it read the abort (it had taken one message):
        worker.send(StepOutput(EngineOutput(["r"], [101], finished=[FinishedRequest("r", "length")]), received=1))
        worker.send(RequestRejected("r", "refused", None, received=1))
        assert await _next(worker, Abort) == Abort(("r",))
        assert (await _next(worker, AddRequest)).request.sampling_params.max_tokens == 2
        # After it read both:
        worker.send(StepOutput(EngineOutput(["r"], [201]), received=3))
        worker.send(StepOutput(EngineOutput(["r"], [202], finished=[FinishedRequest("r", "length")]), received=3))
        assert (await again.until_ended())[:2] == ("finish", "length")
        assert again.tokens == [201, 202] and first.events == []
        assert client._fences == {}  # the worker has read the abort: nothing is held back now
        client.close()
        worker.close()

    asyncio.run(main())


def test_a_request_run_again_after_its_source_died_mid_migration_gets_max_tokens():
    """An ``EP`` instance offers a request's KV to an ``EPD`` one and dies while that one
    pulls; the request runs again, from the tokens it had, on the ``EPD`` instance, which had
    meanwhile pulled and decoded a token of the old run: that token must not reach the
    client (it would get ``max_tokens`` + 1 tokens)."""
    from hydrad.engine.migration import MigrationOffer, Pulled

    async def main():
        ends = [mp.Pipe() for _ in range(2)]
        clients: list = []
        table = RequestTable(Router(clients, "round-robin"))
        for i, role in enumerate(("EP", "EPD")):
            client = WorkerClient(i, role, "cpu", table)
            client.ready = True  # started (the router takes only started instances)
            clients.append(client)
            await client.connect(ends[i][0])
        source, target = ends[0][1], ends[1][1]
        sink = RecordingSink()
        params = SamplingParams(max_tokens=3, temperature=0.0)
        clients[0].add_request(EngineRequest("r", [1, 2], params), sink)
        await _next(source, AddRequest)
        offer = MigrationOffer("r", 0, "kv", [0], [1, 2], [101], 2, params, [], (), None, {"arrival": 0.0})
        source.send(StepOutput(EngineOutput(["r"], [101]), [offer], received=1))
        assert (await _next(target, Migrate)).offer.req_id == "r"
        source.close()  # the source dies
        await _until(lambda: not clients[0].alive)
        # The target had pulled and decoded before it read the abort and the request again:
        target.send(StepOutput(EngineOutput(["r"], [102]), pulled=[Pulled("r", 0)], received=1))
        assert await _next(target, Abort) == Abort(("r",))
        rerun = (await _next(target, AddRequest)).request
        assert rerun.output_token_ids == [101]
        target.send(StepOutput(EngineOutput(["r"], [202]), received=3))
        target.send(StepOutput(EngineOutput(["r"], [203], finished=[FinishedRequest("r", "length")]), received=3))
        assert (await sink.until_ended())[:2] == ("finish", "length")
        assert sink.tokens == [101, 202, 203]
        assert table.num_run_again == 1
        clients[1].close()
        target.close()

    asyncio.run(main())


class FullPoolEngine(FakeEngine):
    """An EPD instance whose request in flight holds every block of its image cache, given
    back when it finishes: no probe image fits until then."""

    instance_id, role = 0, "EPD"

    def __init__(self):
        super().__init__()
        self.kv_manager = BlockManager(8, 16, "kv")
        self.image_manager = BlockManager(4, 16, "image")
        self.held: dict[str, list[int]] = {}

    def add_request(self, req: EngineRequest) -> None:
        super().add_request(req)
        self.held[req.req_id] = self.image_manager.allocate(self.image_manager.num_free_blocks)

    def step(self) -> EngineOutput:
        time.sleep(0.01)
        out = super().step()
        for finished in out.finished:
            self.image_manager.free(self.held.pop(finished.req_id))
        return out

    def expand(self, role: str, pools=None) -> str:
        self.expanded_with = pools
        return self.role

    def pools_to_add(self, role: str) -> dict:
        return {}

    def geometry(self):
        return None


@contextlib.contextmanager
def serving(engine, threads: StepThreads):
    """The daemon's end of a worker loop serving ``engine`` on ``threads`` in a thread; on
    leaving, the worker is shut down (running requests aborted) and has stopped."""
    conn, worker_end = mp.Pipe()
    thread = threading.Thread(target=run_worker, args=(engine, worker_end, threads), daemon=True)
    thread.start()
    yield conn
    shut_down(conn, thread)


class ProbingThreads(StepThreads):
    """The worker's step threads (one thread, nothing borrowed), with latency models measured
    in ``probes`` probes, each only where a probe image fits. ``log`` records each probe and
    each engine step in order."""

    def __init__(self, engine: FullPoolEngine, probes: int = 3, seconds: float = 0.0, board: CoreBoard | None = None):
        super().__init__(engine, CoreLending(board, 0, CpuThreads(1)))
        self.probes, self.seconds = probes, seconds  # how many, how long each
        self.fits: list[int] = []  # free image blocks at each probe that ran
        self.published: list[int] = []  # its flag on the board at each probe
        self.log: list[str] = []
        step = engine.step
        engine.step = lambda: self.log.append("step") or step()

    def fitting(self, role, threads=None, hurry=None, borrowed=True):
        while len(self.fits) < self.probes:
            if self.engine.image_manager.num_free_blocks == 0:
                yield NoProbeRoom("the image cache has 0 free blocks: not one image fits")
                continue
            self.fits.append(self.engine.image_manager.num_free_blocks)
            if self.lending.board is not None:
                self.published.append(self.lending.board.flags[0])
            self.log.append("probe")
            time.sleep(self.seconds)
            yield None
        return "model", 0.1, None


@pytest.mark.parametrize("wait", [0.0, 0.5, 30.0])
def test_a_reconfigure_waits_while_the_requests_in_flight_hold_the_room_its_probes_need(wait, caplog):
    engine = FullPoolEngine()
    threads = ProbingThreads(engine)
    with serving(engine, threads) as conn:
        steps = 100 if wait == 0.5 else 40  # the request outlasts the wait, or not
        conn.send(AddRequest(request("a", steps)))
        conn.send(Reconfigure("EPD", CpuThreads(2), wait=wait))
        start = time.monotonic()
        seen = []
        while not seen or not isinstance(seen[-1], Reconfigured):
            assert conn.poll(10), seen[-1:]
            seen.append(conn.recv())
        answer, finished = seen[-1], [f for m in seen if isinstance(m, StepOutput) for f in m.output.finished]
        if wait == 30.0:  # answered once the request gave its blocks back, the models measured then
            assert answer.error is None and answer.latency_model == "model" and threads.fits == [4, 4, 4]
            assert finished == [FinishedRequest("a", "length", {"decode_exec": 0.001})]
        else:  # at once, or when the wait ran out: an error the daemon reports in one line
            assert answer.error == "the image cache has 0 free blocks: not one image fits" and threads.fits == []
            assert not finished and time.monotonic() - start >= wait
            assert "Traceback" not in caplog.text and "0 free blocks" in caplog.text


def test_a_busy_worker_serves_a_step_between_a_step_s_length_of_probes():
    """A live redeploy's models are measured between the instance's steps, probes for about
    a step's length (its bound) at a time: the streams wait a step's length more, not for
    every probe."""
    engine = FullPoolEngine()
    engine.add_request = FakeEngine.add_request.__get__(engine)  # holds no image blocks
    threads = ProbingThreads(engine, probes=20, seconds=0.03)
    threads.bound = 0.05  # two probes a time
    with serving(engine, threads) as conn:
        conn.send(AddRequest(request("a", 1000)))
        recv_until(conn, StepOutput)
        conn.send(Reconfigure("EPD", CpuThreads(2), wait=30.0))
        answer = recv_until(conn, Reconfigured)
        assert answer.error is None and answer.latency_model == "model" and len(threads.fits) == 20
        log = "".join("p" if what == "probe" else "s" for what in threads.log)
        runs = [len(run) for run in log.strip("s").split("s") if run]
        assert sum(runs) == 20 and max(runs) <= 2 and len(runs) >= 10  # a step after two probes (or one)


def test_a_busy_worker_steps_while_the_pools_of_its_new_stages_are_made():
    """The pools a Reconfigure's new stages need are made on a thread while the worker goes on
    stepping (a 256 MiB image pool in shared memory held a D instance's streams a second
    under load), and ``expand`` takes them as they were made; the worker steps meanwhile."""
    engine = FullPoolEngine()
    engine.add_request = FakeEngine.add_request.__get__(engine)  # holds no image blocks
    made = []

    class Runner:
        def new_pool(self, shape):
            time.sleep(0.3)
            made.append(("pool", shape, threading.current_thread().name))
            return ("pool", shape)

    engine.runner = Runner()
    engine.pools_to_add = lambda role: {"image": (4, 16, 8)}
    threads = ProbingThreads(engine, probes=1)
    with serving(engine, threads) as conn:
        conn.send(AddRequest(request("a", 1000)))
        recv_until(conn, StepOutput)
        conn.send(Reconfigure("EPD", CpuThreads(1), wait=30.0))
        answer = recv_until(conn, Reconfigured)
        assert answer.error is None
        assert made == [("pool", (4, 16, 8), "hydrad-pools")]
        assert engine.expanded_with == {"image": ("pool", (4, 16, 8))}
        steps_before_probe = threads.log.index("probe")
        assert steps_before_probe >= 10  # steps of 10 ms went on while the pool took 0.3 s


def test_an_idle_worker_answers_a_reconfigure_it_has_no_room_for_at_once():
    """With nothing in flight no block comes back: waiting could not help."""
    engine = FullPoolEngine()
    held = engine.image_manager.allocate(engine.image_manager.num_free_blocks)  # pools too small
    threads = ProbingThreads(engine)
    with serving(engine, threads) as conn:
        start = time.monotonic()
        conn.send(Reconfigure("EPD", CpuThreads(2), wait=30.0))
        answer = recv_until(conn, Reconfigured)
        assert answer.error == "the image cache has 0 free blocks: not one image fits"
        assert time.monotonic() - start < 5.0
        engine.image_manager.free(held)


def test_an_idle_worker_probing_tells_its_borrowers_it_has_work():
    """While it times probes an idle instance is not idle: a borrower of its cores would time
    its probes with them."""
    engine = FullPoolEngine()
    board = CoreBoard.new()
    threads = ProbingThreads(engine, probes=5, board=board)
    with serving(engine, threads) as conn:
        conn.send(Reconfigure("EPD", CpuThreads(1), wait=30.0))
        answer = recv_until(conn, Reconfigured)
        assert answer.error is None and threads.published == [1] * 5
        deadline = time.monotonic() + 5
        while board.flags[0] and time.monotonic() < deadline:  # idle again once measured
            time.sleep(0.01)
        assert board.flags[0] == 0


class LockedThreads(ProbingThreads):
    """Step threads whose probes wait for another worker's until ``released``: a busy worker
    serves meanwhile."""

    def __init__(self, engine):
        super().__init__(engine)
        self.released = threading.Event()
        self.waited = 0

    def fitting(self, role, threads=None, hurry=None, borrowed=True):
        while not self.released.is_set():
            self.waited += 1
            yield ProbingElsewhere("another worker is measuring its latency model on these cores")
        return (yield from super().fitting(role, threads, hurry, borrowed))


def test_a_busy_worker_serves_while_another_worker_probes_and_measures_after_it():
    engine = FullPoolEngine()
    engine.add_request = FakeEngine.add_request.__get__(engine)  # holds no image blocks: room is not the matter
    threads = LockedThreads(engine)
    with serving(engine, threads) as conn:
        conn.send(AddRequest(request("a", 1000)))
        conn.send(Reconfigure("EPD", CpuThreads(2), wait=30.0))
        tokens = 0
        while tokens < 60:  # it keeps stepping while the other worker's probes last (10 ms a step)
            msg = recv_until(conn, StepOutput)
            tokens += len(msg.output.token_ids)
        assert threads.fits == [] and threads.waited >= 2  # tried again every 0.2 s
        threads.released.set()
        answer = recv_until(conn, Reconfigured)
        assert answer.error is None and answer.latency_model == "model" and len(threads.fits) == 3


class BorrowingLater(ProbingThreads):
    """A borrower (one thread of its own) whose start left ``later`` counts to measure (by
    default the borrowed count, 2 threads, which the cache lacked): each is measured between
    steps in ``runs`` probe runs (``log`` records them as "borrowed probe"), each yielding
    what it waits for while ``lenders_busy`` is set."""

    def __init__(self, engine, runs: int = 6, later=(2,)):
        super().__init__(engine)
        self.later, self.runs, self.ran = list(later), runs, 0
        self.lenders_busy = threading.Event()
        self.closed = 0

    def measuring_later(self):
        from hydrad.engine.cores import LendersBusy

        n, self.ran = self.later[0], 0
        try:
            while self.ran < self.runs:
                if self.lenders_busy.is_set():
                    yield LendersBusy("the lenders have work")
                    continue
                self.ran += 1
                self.log.append("borrowed probe")
                time.sleep(0.005)
                yield None
        except GeneratorExit:
            self.closed += 1
            self.ran_when_closed = self.ran
            raise
        self.later.remove(n)
        return n, f"model at {n} threads"


def test_a_borrower_measures_its_borrowed_count_between_steps_after_it_is_ready():
    """What a start left to later is measured a probe run at a time between the steps of the
    requests it serves meanwhile, and reported once (``ModelMeasured``); while the
    lenders have work it waits (and serves), however long."""
    engine = FullPoolEngine()
    engine.add_request = FakeEngine.add_request.__get__(engine)  # holds no image blocks
    threads = BorrowingLater(engine, runs=6)
    threads.lenders_busy.set()
    with serving(engine, threads) as conn:
        conn.send(AddRequest(request("a", 1000)))
        for _ in range(30):  # 10 ms a step: its lenders busy for 0.3 s
            recv_until(conn, StepOutput)
        assert threads.ran == 0
        threads.lenders_busy.clear()
        measured = recv_until(conn, ModelMeasured)
        assert (measured.instance_id, measured.threads, measured.model, measured.borrowed) == (
            0, 2, "model at 2 threads", True)
        log = [what for what in threads.log if what != "probe"]
        first = log.index("borrowed probe")
        # One run at a time between two steps of the request in flight.
        assert log[first:first + 12:2] == ["borrowed probe"] * 6 and "step" in log[first + 1:first + 11:2]
        assert all(a != b for a, b in zip(log[first:first + 11], log[first + 1:first + 12]))
        later = []
        while conn.poll(0.2):  # the request goes on: nothing more is measured or reported
            later.append(conn.recv())
            if len(later) > 20:
                break
        assert later and not any(isinstance(m, ModelMeasured) for m in later) and threads.ran == 6


def test_an_idle_borrower_measures_its_borrowed_count_at_once_and_a_reconfigure_starts_it_anew():
    engine = FullPoolEngine()
    threads = BorrowingLater(engine, runs=40)
    with serving(engine, threads) as conn:
        while threads.ran < 3:  # idle: no message needed to wake it
            time.sleep(0.005)
        # A redeploy measures anew for its role and threads (this fake's own model at its share
        # only): the measurement under way is dropped, and what is still left afterwards is
        # measured from the start.
        conn.send(Reconfigure("EPD", CpuThreads(1, 1, (1,)), wait=30.0))
        answer = recv_until(conn, Reconfigured)
        assert answer.error is None and threads.closed == 1 and 0 < threads.ran_when_closed < 40
        measured = recv_until(conn, ModelMeasured)
        assert measured.model == "model at 2 threads" and threads.ran == 40


def test_a_start_s_unsteady_model_is_measured_again_first_then_the_borrowed_one():
    engine = FullPoolEngine()
    threads = BorrowingLater(engine, runs=3, later=(1, 2))
    with serving(engine, threads) as conn:
        first, second = recv_until(conn, ModelMeasured), recv_until(conn, ModelMeasured)
        assert (first.threads, first.model, first.borrowed) == (1, "model at 1 threads", False)
        assert (second.threads, second.model, second.borrowed) == (2, "model at 2 threads", True)
        assert threads.later == [] and threads.log.count("borrowed probe") == 6


def test_the_daemon_takes_the_models_measured_after_the_start():
    async def main():
        conn, worker_end = mp.Pipe()
        client, _ = await connected_client(conn)
        worker_end.send(WorkerReady(0, 1, 64, 1.0, "model at 1 thread", 0.1))
        ready = await client.wait_ready()
        assert ready.borrow_model is None
        worker_end.send(ModelMeasured(0, 2, "model at 2 threads", borrowed=True))
        for _ in range(200):
            if client.ready.borrow_model is not None:
                break
            await asyncio.sleep(0.01)
        assert client.ready.borrow_model == "model at 2 threads"
        assert client.ready.latency_model == "model at 1 thread"
        # Its own share's, measured again (its start's probes saw the machine's speed move).
        worker_end.send(ModelMeasured(0, 1, "model at 1 thread, again", borrowed=False))
        for _ in range(200):
            if client.ready.latency_model != "model at 1 thread":
                break
            await asyncio.sleep(0.01)
        assert client.ready.latency_model == "model at 1 thread, again"
        assert client.ready.borrow_model == "model at 2 threads"
        worker_end.close()

    asyncio.run(main())


def test_a_model_left_to_later_that_cannot_be_measured_is_given_up_and_the_worker_serves_on(caplog):
    """No room for the probes on an idle worker (nothing in flight gives any back): it keeps
    the model it has, says why in one line, reports nothing, and serves."""

    class NoRoom(BorrowingLater):
        def measuring_later(self):
            yield NoProbeRoom("the image cache has 0 free blocks: not one image fits")
            raise AssertionError("went on past a wait it cannot end")

    engine = FullPoolEngine()
    threads = NoRoom(engine)
    with serving(engine, threads) as conn:
        deadline = time.monotonic() + 10
        while threads.later and time.monotonic() < deadline:
            time.sleep(0.01)
        assert threads.later == []
        conn.send(AddRequest(request("a", 3)))
        seen = []
        while not any(f.req_id == "a" for m in seen if isinstance(m, StepOutput) for f in m.output.finished):
            assert conn.poll(10)
            seen.append(conn.recv())
        assert not any(isinstance(m, ModelMeasured) for m in seen)
    assert "the latency model at 2 threads cannot be measured (it keeps the model it has): the image cache" \
        in caplog.text
