"""More HTTP processes on the daemon's port (``[server] frontend_processes = N``): the daemon's side.

The daemon (the first process) serves HTTP as always and starts ``N - 1`` front-end
processes (``hydrad.server.frontend``). Each listens on the same port with
``SO_REUSEPORT`` (the kernel spreads new connections over the N sockets), parses
HTTP, prepares its requests (chat template, tokenizer, images), detokenizes and
streams their tokens. Only the daemon holds the workers, the router and the request
table, so every process routes by the same view of load: a front end sends each
prepared completion here (``Submit``), the router places it and the answer
(``Admitted``, or the error that refused it) goes back; the request's sink in the
table is a ``RemoteSink``, which adds the request's tokens to its front end's
columns, and once the step's outputs are delivered the front end gets them all in
one ``Deltas``. The daemon's cost per relayed token is a few list appends.

``/health``, ``/metrics`` and ``/admin/*`` reaching a front end are passed to the
daemon over a private Unix socket, so they read the same from any process; the
daemon merges the front ends' metrics (``Snapshot``) into its own answers. On
SIGTERM the daemon tells every front end to drain with the same deadline and waits
for them to exit before it stops the workers. A front end that dies loses only its
own requests (the daemon aborts them on their instances); the others go on serving,
and the daemon starts it again (unless it exited 3 times within 5 minutes).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import shutil
import tempfile
import time
from pathlib import Path

from hydrad.cluster.requests import RequestTable
from hydrad.cluster.router import Router, entry_stage
from hydrad.config_file import DaemonConfig
from hydrad.errors import HydradError
from hydrad.server.response_store import ResponseStore
from hydrad.transport.link import WorkerLink
from hydrad.transport.messages import (
    Abort,
    Admitted,
    Deltas,
    Drain,
    FrontendReady,
    GetSnapshot,
    KeptAnswer,
    KeptQuery,
    Listen,
    Shutdown,
    Snapshot,
    Submit,
    TraceFacts,
)

logger = logging.getLogger("hydrad.frontends")


# A front end that exits is restarted, unless it exited this often within this many seconds.
_RESTART_LIMIT = 3
_RESTART_WINDOW = 300.0


class FrontendStartError(HydradError):
    """A front-end process did not start."""


def portable(error: BaseException) -> Exception:
    """``error`` as it can cross to another process (its type when it unpickles as itself)."""
    try:
        return pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


class RemoteSink:
    """The request table's sink for a request of a front-end process: its outputs go into
    that front end's next ``Deltas``, under the front end's key for it."""

    __slots__ = ("peer", "key", "req_id")

    def __init__(self, peer: FrontendPeer, key: int, req_id: str):
        self.peer = peer
        self.key = key
        self.req_id = req_id

    def on_token(self, token_id: int, logprobs) -> None:
        peer = self.peer
        if not peer.keys:
            peer.schedule_flush()
        peer.keys.append(self.key)
        peer.token_ids.append(token_id)
        peer.logprobs.append(logprobs)
        if logprobs is not None:
            peer.any_logprobs = True

    def on_finish(self, finish_reason: str, stage_times: dict[str, float] | None, num_cached_tokens: int = 0) -> None:
        peer = self.peer
        peer.end(self.req_id, (self.key, finish_reason, stage_times, peer.table.routes.get(self.req_id), None,
                               num_cached_tokens))

    def on_error(self, error: Exception) -> None:
        self.peer.end(self.req_id, (self.key, None, None, None, portable(error), 0))


class FrontendPeer:
    """The daemon's end of one front-end process."""

    def __init__(self, index: int, process, table: RequestTable, router: Router, trace=None,
                 queue_timeout: float = 30.0, store: ResponseStore | None = None):
        self.index = index
        self.process = process
        self.table = table
        self.router = router
        self.trace = trace
        # The daemon's kept responses, which the front end's API reaches (``KeptQuery``).
        self.store = store
        # How long a submitted request waits for a restarting instance of its first stage.
        self.queue_timeout = queue_timeout
        # Requests waiting so (an abort meanwhile drops them), and their tasks.
        self._waiting: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        self.link: WorkerLink | None = None
        self.pid: int | None = None
        self._loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[FrontendReady] = self._loop.create_future()
        self.closed = asyncio.Event()
        # Its requests in the table (aborted on their instances if the process dies).
        self.open: set[str] = set()
        # The columns of the next Deltas.
        self.keys: list[int] = []
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.any_logprobs = False
        self.ends: list[tuple] = []
        self._flush_scheduled = False
        self._seq = itertools.count()
        self._snapshots: dict[int, asyncio.Future[Snapshot | None]] = {}
        self.on_gone = None  # (peer, reason) once its process is gone

    @property
    def alive(self) -> bool:
        return self.link is not None and self.link.is_open

    def send(self, msg) -> None:
        if self.link is not None:
            self.link.send_if_open(msg)

    # -- outputs ------------------------------------------------------------------------------
    def schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self.flush)

    def end(self, req_id: str, entry: tuple) -> None:
        self.open.discard(req_id)
        self.schedule_flush()
        self.ends.append(entry)

    def flush(self) -> None:
        """Send what the delivery passes since the last flush produced, in one message."""
        self._flush_scheduled = False
        if not self.keys and not self.ends:
            return
        msg = Deltas(self.keys, self.token_ids, self.logprobs if self.any_logprobs else None, self.ends)
        self.keys, self.token_ids, self.logprobs, self.ends, self.any_logprobs = [], [], [], [], False
        self.send(msg)

    # -- front end -> daemon ------------------------------------------------------------------
    def dispatch(self, msg) -> None:
        if isinstance(msg, Submit):
            self._submit(msg)
        elif isinstance(msg, Abort):
            for req_id in msg.req_ids:
                self.open.discard(req_id)
                self._waiting.discard(req_id)
                self.table.abort(req_id)
        elif isinstance(msg, TraceFacts):
            if self.trace is not None:
                self.trace.record(**msg.facts)
        elif isinstance(msg, KeptQuery):
            try:
                result = self.store.answer(msg.op, msg.arg, self.index)
            except Exception as e:  # the front end's request fails with it, not the daemon
                result = RuntimeError(f"the response store failed: {e}")
            self.send(KeptAnswer(msg.seq, result))
        elif isinstance(msg, Snapshot):
            waiter = self._snapshots.pop(msg.seq, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(msg)
        elif isinstance(msg, FrontendReady):
            self.pid = msg.pid
            if not self.ready.done():
                self.ready.set_result(msg)
        else:
            logger.error("front end %d sent an unexpected %s", self.index, type(msg).__name__)

    def _submit(self, msg: Submit) -> None:
        request = msg.request
        stage = entry_stage(bool(request.images))
        if self.table.hold_offers and not self.router.can_take(stage):
            # Its first stage's instances are being restarted: wait for them, as the daemon's
            # own requests do (``EngineClient.wait_for_entry``).
            self._waiting.add(request.req_id)
            task = asyncio.ensure_future(self._submit_when_ready(msg, stage))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        self._place(msg)

    async def _submit_when_ready(self, msg: Submit, stage: str) -> None:
        await self.table.wait_for_stage(stage, self.queue_timeout)
        if msg.request.req_id in self._waiting and self.alive:
            self._waiting.discard(msg.request.req_id)
            self._place(msg)

    def _place(self, msg: Submit) -> None:
        request = msg.request
        try:
            instance = self.router.select(has_images=bool(request.images), request=request)
            instance.add_request(request, RemoteSink(self, msg.key, request.req_id))
        except Exception as e:  # no instance for the stage, the daemon stopping: the front end answers
            self.send(Admitted(msg.key, portable(e)))
            return
        self.open.add(request.req_id)
        self.send(Admitted(msg.key))

    def on_closed(self, reason: str) -> None:
        self.closed.set()
        if not self.ready.done():
            self.ready.set_exception(FrontendStartError(f"front end {self.index} exited during start-up ({reason})"))
        if self.open:
            logger.error("front end %d (pid %s) is gone (%s): aborting its %d request(s)", self.index, self.pid,
                         reason, len(self.open))
            for req_id in list(self.open):
                self.table.abort(req_id)
            self.open.clear()
        if self.store is not None and (failed := self.store.orphaned(self.index, reason)):
            logger.error("front end %d: its %d background response(s) failed with it", self.index, failed)
        for waiter in self._snapshots.values():
            if not waiter.done():
                waiter.set_result(None)
        if self.on_gone is not None:
            self.on_gone(self, reason)

    async def snapshot(self, timeout: float) -> Snapshot | None:
        if not self.alive or not self.ready.done():
            return None
        seq = next(self._seq)
        waiter = self._snapshots[seq] = self._loop.create_future()
        self.send(GetSnapshot(seq))
        try:
            return await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            return None
        finally:
            self._snapshots.pop(seq, None)


class Frontends:
    """The front-end processes of one daemon (none when ``frontend_processes`` is 1)."""

    def __init__(self, config: DaemonConfig, store: ResponseStore | None = None):
        self.config = config
        self.store = store
        self.count = config.server.frontend_processes
        self.peers: list[FrontendPeer] = []
        self._dir: str | None = None
        self.socket_path: str | None = None
        self._started = time.monotonic()
        self._table: RequestTable | None = None
        self._router: Router | None = None
        self._trace = None
        self._timeout = 600.0
        self._listen: Listen | None = None
        self._stopping = False
        self._restarts: dict[int, list[float]] = {}
        # Every front end listens (after start): until then /health says "starting".
        self.listening = self.count == 1
        self._tasks: set[asyncio.Task] = set()
        if self.count > 1:
            base = os.environ.get("XDG_RUNTIME_DIR") or None
            self._dir = tempfile.mkdtemp(prefix="hydrad-", dir=base if base and os.path.isdir(base) else None)
            self.socket_path = str(Path(self._dir) / "daemon.sock")

    async def spawn(self, table: RequestTable, router: Router) -> None:
        """Start front ends 1 .. N-1: they load their Request Processor while the workers load."""
        self._table, self._router = table, router
        self._started = time.monotonic()
        for index in range(1, self.count):
            self.peers.append(await self._spawn_one(index))

    async def _spawn_one(self, index: int) -> FrontendPeer:
        import torch.multiprocessing as mp

        from hydrad.server.frontend import frontend_main

        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        process = ctx.Process(target=frontend_main, name=f"hydrad-frontend-{index}", args=(index, self.config, child))
        process.start()
        child.close()
        peer = FrontendPeer(index, process, self._table, self._router, self._trace,
                            self.config.server.queue_timeout, self.store)
        peer.on_gone = self._on_gone
        peer.link = await WorkerLink.open(parent, peer.dispatch, peer.on_closed, peer=f"front end {index}")
        return peer

    async def start(self, host: str, port: int, trace, max_model_len: int, timeout: float,
                    image_caches: tuple[tuple[int, int], ...] = ()) -> None:
        """Every front end listens on ``host:port`` too; returns once each does."""
        self._trace, self._timeout = trace, timeout
        self._listen = Listen(host, port, self.socket_path, max_model_len, image_caches)
        for peer in self.peers:
            peer.trace = trace
            peer.send(self._listen)
        try:
            readies = await asyncio.wait_for(asyncio.gather(*(p.ready for p in self.peers)), timeout)
        except asyncio.TimeoutError:
            raise FrontendStartError(f"front-end processes not listening after {timeout:.0f} s") from None
        self.listening = True
        logger.info("%d front-end process(es) ready in %.1f s (pids %s); %d processes serve port %d",
                    len(readies), time.monotonic() - self._started, ", ".join(str(r.pid) for r in readies),
                    self.count, port)

    # -- restart --------------------------------------------------------------------------------
    def _on_gone(self, peer: FrontendPeer, reason: str) -> None:
        if self._stopping or self._listen is None or peer not in self.peers:
            return
        now = time.monotonic()
        recent = [t for t in self._restarts.get(peer.index, []) if t > now - _RESTART_WINDOW]
        if len(recent) >= _RESTART_LIMIT:
            logger.error("front end %d exited (%s) %d times within %.0f s: not restarted; %d process(es) serve "
                         "the port", peer.index, reason, len(recent) + 1, _RESTART_WINDOW, len(self.alive_peers) + 1)
            return
        self._restarts[peer.index] = recent + [now]
        logger.warning("front end %d (pid %s) exited (%s): restarting it", peer.index, peer.pid, reason)
        task = asyncio.ensure_future(self._restart(peer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _restart(self, old: FrontendPeer) -> None:
        await asyncio.get_running_loop().run_in_executor(None, old.process.join, 5.0)
        try:
            peer = await self._spawn_one(old.index)
            self.peers[self.peers.index(old)] = peer
            peer.send(self._listen)
            ready = await asyncio.wait_for(asyncio.shield(peer.ready), self._timeout)
        except (FrontendStartError, asyncio.TimeoutError, OSError, ValueError) as e:
            logger.error("front end %d did not restart: %s", old.index, e)
            return
        logger.info("front end %d restarted (pid %d)", old.index, ready.pid)

    @property
    def alive_peers(self) -> list[FrontendPeer]:
        return [p for p in self.peers if p.alive]

    async def snapshots(self, timeout: float = 1.0) -> list[Snapshot]:
        """Each live front end's metrics and status (those that answer within ``timeout``)."""
        answers = await asyncio.gather(*(p.snapshot(timeout) for p in self.peers))
        return [a for a in answers if a is not None]

    def drain(self, reason: str, timeout: float) -> None:
        """Every front end drains (``Drain``) and exits; ``wait_exited`` waits for them."""
        self._stopping = True
        for peer in self.peers:
            peer.send(Drain(reason, timeout))

    async def wait_exited(self, timeout: float) -> bool:
        """True once every front end has closed its link (it exits right after)."""
        try:
            await asyncio.wait_for(asyncio.gather(*(p.closed.wait() for p in self.peers)), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    @property
    def num_inflight(self) -> int:
        return sum(len(p.open) for p in self.peers)

    async def stop(self, timeout: float = 3.0) -> None:
        """Stop every front end now (its requests have been failed or finished)."""
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()
        for peer in self.peers:
            peer.send(Shutdown())
        if self.peers:
            await self.wait_exited(timeout)
        loop = asyncio.get_running_loop()
        for peer in self.peers:
            process = peer.process
            await loop.run_in_executor(None, process.join, timeout)
            if process.is_alive():
                logger.warning("front end %d did not exit; killing it", peer.index)
                process.kill()
                await loop.run_in_executor(None, process.join, 2.0)
            if peer.link is not None:
                peer.link.close()
        self.peers = []
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
