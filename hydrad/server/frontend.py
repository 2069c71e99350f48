"""A front-end process (``[server] frontend_processes`` > 1): HTTP, requests and streams, no workers.

It runs the daemon's API handlers with a ``CoreClient`` in place of the router and
the request table: a prepared completion goes to the daemon (``Submit``), which
routes it and answers ``Admitted``; its tokens come back in the daemon's per-step
``Deltas`` and feed the same ``ChoiceStream`` sinks (detokenization, stop strings,
metrics, SSE) as in the daemon itself. ``/health``, ``/metrics`` and ``/admin/*``
are passed to the daemon over its private Unix socket (the admin check is made here,
where the client's address is known). The process ignores SIGINT and SIGTERM: the
daemon tells it to drain (``Drain``) or to stop (``Shutdown``); if the daemon goes
away, its requests fail and it exits. See ``hydrad.server.frontends``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

import aiohttp
from aiohttp import web

from hydrad.cluster.requests import RequestSink, ServiceStopping
from hydrad.config_file import DaemonConfig
from hydrad.engine.inputs import EngineRequest
from hydrad.logs import RepeatedLines, configure_logging
from hydrad.heap import freeze_startup_heap
from hydrad.server import app as api
from hydrad.server.admin import check_admin_access
from hydrad.server.admission import Admission
from hydrad.server.background import BackgroundResponses
from hydrad.server.engine_client import EngineClient
from hydrad.server.errors import APIError
from hydrad.server.metrics import Metrics
from hydrad.server.monitor import FrontendMonitor
from hydrad.server.response_store import RemoteStore
from hydrad.transport.link import LinkClosed, WorkerLink
from hydrad.transport.messages import (
    Abort,
    Admitted,
    Deltas,
    Drain,
    FrontendReady,
    GetSnapshot,
    KeptAnswer,
    Listen,
    Shutdown,
    Snapshot,
    Submit,
    TraceFacts,
)

logger = logging.getLogger("hydrad.frontend")

# After a drain's deadline, the aborted streams get this long to write their last bytes.
_ABORT_GRACE = 2.0

CORE = web.AppKey("core", object)


class CoreClient:
    """The daemon, as this process's router, instance and request table."""

    instance_id = None  # the daemon picks the instance; the request's route says which

    def __init__(self, index: int):
        self.index = index
        self.link: WorkerLink | None = None
        # Each request's sink under its key (``Submit.key``), and the key of each request id.
        self.sinks: dict[int, RequestSink] = {}
        self.keys: dict[str, int] = {}
        self._next_key = itertools.count()
        # The instances a finishing request went through (read by its sink's on_finish).
        self.routes: dict[str, list[int]] = {}
        self._admissions: dict[int, asyncio.Future[None]] = {}
        self.app: web.Application | None = None
        self.done = asyncio.Event()
        self.gone: str | None = None  # why the daemon's link closed
        # The daemon's Listen (once its workers are ready) and its Unix socket's session.
        self.listen: asyncio.Future[Listen] = asyncio.get_running_loop().create_future()
        self.daemon_session: aiohttp.ClientSession | None = None

    # -- router / instance ----------------------------------------------------------------------
    def select(self, has_images: bool, request: EngineRequest | None = None) -> CoreClient:
        return self  # the daemon routes

    def add_request(self, request: EngineRequest, sink: RequestSink) -> asyncio.Future[None]:
        """Send ``request`` to the daemon; the returned future resolves once it is on an
        instance (or raises what refused it)."""
        if self.gone is not None:
            raise ServiceStopping(f"the daemon is gone ({self.gone})")
        admitted = asyncio.get_running_loop().create_future()
        key = next(self._next_key)
        self.sinks[key] = sink
        self.keys[request.req_id] = key
        self._admissions[key] = admitted
        try:
            self.link.send(Submit(request, key))
        except LinkClosed as e:
            self._forget(key, request.req_id)
            self._admissions.pop(key, None)
            raise ServiceStopping(f"the daemon is gone ({e})") from None
        return admitted

    def _forget(self, key: int, req_id: str | None = None) -> RequestSink | None:
        sink = self.sinks.pop(key, None)
        if req_id is None and sink is not None:
            req_id = sink.request.req_id
        if req_id is not None:
            self.keys.pop(req_id, None)
        return sink

    # -- request table --------------------------------------------------------------------------
    async def wait_for_stage(self, stage: str, timeout: float) -> None:
        """Nothing to wait for here: the daemon waits for a restarting stage on ``Submit``."""

    def abort(self, req_id: str) -> None:
        key = self.keys.pop(req_id, None)
        if key is not None and self.sinks.pop(key, None) is not None:
            self.send(Abort((req_id,)))

    def fail_all(self, error: Exception) -> None:
        kept = self.app.get(api.KEPT) if self.app is not None else None
        if kept is not None:
            kept.fail_all(error)
        for req_id, key in list(self.keys.items()):
            sink = self.sinks.get(key)
            self.abort(req_id)
            if sink is not None:
                sink.on_error(error)

    def record(self, **facts) -> None:
        """The request trace's ``record``: the daemon writes it."""
        self.send(TraceFacts(facts))

    def send(self, msg) -> None:
        if self.link is not None:
            self.link.send_if_open(msg)

    # -- daemon -> front end ----------------------------------------------------------------------
    def dispatch(self, msg) -> None:
        if isinstance(msg, Deltas):
            self._deliver(msg)
        elif isinstance(msg, Admitted):
            admitted = self._admissions.pop(msg.key, None)
            if msg.error is not None:
                self._forget(msg.key)
            if admitted is not None and not admitted.done():
                if msg.error is None:
                    admitted.set_result(None)
                else:
                    admitted.set_exception(msg.error)
        elif isinstance(msg, Listen):
            if not self.listen.done():
                self.listen.set_result(msg)
        elif isinstance(msg, GetSnapshot):
            self.send(self._snapshot(msg.seq))
        elif isinstance(msg, KeptAnswer):
            self.app[api.KEPT].answered(msg.seq, msg.result)
        elif isinstance(msg, Drain):
            asyncio.ensure_future(self._drain(msg))
        elif isinstance(msg, Shutdown):
            self.fail_all(ServiceStopping("the daemon is stopping"))
            self.done.set()
        else:
            logger.error("unexpected %s from the daemon", type(msg).__name__)

    def _deliver(self, msg: Deltas) -> None:
        sinks = self.sinks
        token_ids, logprobs = msg.token_ids, msg.logprobs
        for i, key in enumerate(msg.keys):
            sink = sinks.get(key)
            if sink is not None:  # else aborted here while the step ran
                sink.on_token(token_ids[i], logprobs[i] if logprobs is not None else None)
        for key, finish_reason, stage_times, route, error, num_cached_tokens in msg.ends:
            sink = self._forget(key)
            if sink is None:
                continue
            if error is not None:
                sink.on_error(error)
                continue
            req_id = sink.request.req_id
            self.routes[req_id] = route or []
            sink.on_finish(finish_reason, stage_times, num_cached_tokens)
            self.routes.pop(req_id, None)

    def _snapshot(self, seq: int) -> Snapshot:
        app = self.app
        if app is None or api.MONITOR not in app:  # still loading
            return Snapshot(seq, [], {"window_seconds": 0.0, "cpu_per_token": None, "cpu_share": None,
                                      "loop_lag_p99": None, "loop_lag_max": None},
                            {"finished": 0, "ttft": [], "tbt": []})
        metrics, monitor = app[api.METRICS], app[api.MONITOR]
        monitor.refresh()
        return Snapshot(seq, list(metrics.registry.collect()), monitor.status(), metrics.window.recent())

    async def _drain(self, msg: Drain) -> None:
        admission = self.app[api.ADMISSION]
        admission.start_draining(msg.reason)
        if not await admission.wait_idle(msg.timeout):
            reason = (f"the daemon is shutting down: the request was still running after "
                      f"server.shutdown_timeout ({msg.timeout:g} s)")
            logger.warning("%d request(s) still running after %g s, aborted", len(admission.inflight), msg.timeout)
            admission.abort_all(reason)
            self.fail_all(ServiceStopping(reason))
            await admission.wait_idle(_ABORT_GRACE)
        self.done.set()

    def on_closed(self, reason: str) -> None:
        self.gone = reason
        if self.sinks:
            logger.error("the daemon is gone (%s): failing %d request(s)", reason, len(self.sinks))
        self.fail_all(ServiceStopping(f"the daemon is gone ({reason})"))
        for admitted in self._admissions.values():
            if not admitted.done():
                admitted.set_exception(ServiceStopping(f"the daemon is gone ({reason})"))
        self._admissions.clear()
        self.done.set()


# -- the process ----------------------------------------------------------------------------------


def frontend_main(index: int, config: DaemonConfig, conn: Connection) -> None:
    """Process entry point (spawned by ``Frontends.spawn``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when front ends stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(config.server.log_level, config.server.log_requests,
                      f"%(asctime)s %(levelname)s frontend{index} %(name)s: %(message)s")
    try:
        from uvloop import run
    except ImportError:
        run = asyncio.run
    try:
        run(_serve(index, config, conn))
    except Exception:
        logger.exception("front end %d failed", index)
        raise SystemExit(1) from None


async def _serve(index: int, config: DaemonConfig, conn: Connection) -> None:
    core = CoreClient(index)
    core.link = await WorkerLink.open(conn, core.dispatch, core.on_closed, peer="daemon")
    app = make_frontend_app(config, core)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0, access_log=None)
    await runner.setup()  # loads the Request Processor
    try:
        done = asyncio.ensure_future(core.done.wait())
        await asyncio.wait([core.listen, done], return_when=asyncio.FIRST_COMPLETED)
        if core.listen.done():
            listen = core.listen.result()
            app[api.ENGINE].max_model_len = listen.max_model_len
            app[api.ENGINE].image_caches = listen.image_caches
            core.daemon_session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=listen.socket_path))
            await web.TCPSite(runner, listen.host, listen.port, reuse_port=True).start()
            freeze_startup_heap(logger)
            core.send(FrontendReady(index, os.getpid()))
            await done
    finally:
        await runner.cleanup()
        if core.daemon_session is not None:
            await core.daemon_session.close()
        if core.link is not None:
            core.link.close()


def make_frontend_app(config: DaemonConfig, core: CoreClient) -> web.Application:
    app = web.Application(client_max_size=config.server.max_body_mb << 20,
                          middlewares=[api.error_middleware, api.api_key_middleware])
    app[api.CONFIG] = config
    app[api.REJECTIONS_LOGGED] = RepeatedLines()
    app[CORE] = core
    # The daemon keeps the responses; this process asks it.
    app[api.KEPT] = RemoteStore(core.send) if config.server.responses_store_mb else None
    app[api.BACKGROUND] = BackgroundResponses(app[api.KEPT]) if app[api.KEPT] is not None else None
    core.app = app
    app.cleanup_ctx.append(_frontend_ctx)
    api.add_api_routes(app)
    for path in ("/health", "/metrics", "/admin/status", "/admin/trace"):
        app.router.add_get(path, _to_daemon)
    app.router.add_post("/admin/redeploy", _to_daemon)
    return app


async def _frontend_ctx(app: web.Application):
    config = app[api.CONFIG]
    server = config.server
    num_threads = server.processor_threads + 1
    executor = ThreadPoolExecutor(num_threads, thread_name_prefix="hydrad-processor")
    processor = await asyncio.get_running_loop().run_in_executor(executor, api.load_processor, config, num_threads)
    session = aiohttp.ClientSession() if server.remote_images.enabled else None
    app[api.METRICS] = Metrics(processor.model_name, processor.processed_images)
    app[api.MONITOR] = FrontendMonitor(app[api.METRICS])
    app[api.MONITOR].start()
    app[api.ADMISSION] = Admission(server, executor)
    app[api.METRICS].watch_admission(app[api.ADMISSION])
    core = app[CORE]
    # max_model_len and the image caches: the daemon's (its workers'), set when it says Listen.
    app[api.ENGINE] = EngineClient(processor, core, core, app[api.METRICS], app[api.ADMISSION], server,
                                   processor.max_model_len, session)
    if config.trace.enabled:
        app[api.ENGINE].trace = core
    yield
    if app[api.BACKGROUND] is not None:
        await app[api.BACKGROUND].stop()
    await app[api.MONITOR].stop()
    if session is not None:
        await session.close()
    executor.shutdown(wait=False, cancel_futures=True)


# Headers passed on to the daemon and back.
_FORWARD_HEADERS = ("Content-Type", "Authorization")
_BACK_HEADERS = ("Content-Type", "Retry-After")


async def _to_daemon(request: web.Request) -> web.StreamResponse:
    """Answer from the daemon (health, metrics, admin): the same from every process."""
    if request.path.startswith("/admin/"):
        check_admin_access(request, request.app[api.CONFIG].server.admin_token)
    session = request.app[CORE].daemon_session
    body = await request.read() if request.can_read_body else None
    headers = {k: request.headers[k] for k in _FORWARD_HEADERS if k in request.headers}
    try:
        async with session.request(request.method, "http://hydrad" + request.path_qs, data=body,
                                   headers=headers) as upstream:
            response = web.StreamResponse(
                status=upstream.status, headers={k: upstream.headers[k] for k in _BACK_HEADERS
                                                 if k in upstream.headers})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
    except aiohttp.ClientError as e:
        raise APIError(503, f"the daemon does not answer ({e})", code="unavailable") from None

