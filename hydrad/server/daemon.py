"""The daemon's life: start the app, serve until SIGTERM/SIGINT, shut down gracefully.

Shutdown (the drain): ``/health`` and new requests answer 503 while the requests in
flight go on, for up to ``server.shutdown_timeout`` seconds, counted once from the
signal; what is still running then is aborted (streams end with an error event, a
``finish_reason`` and ``[DONE]``; the ids are logged); then the listening socket and
the connections close, the workers stop, and ``serve`` returns (exit 0). So the
daemon is gone ``shutdown_timeout`` plus a few seconds plus the workers' exit
after the signal.

Stopping at once: a second SIGTERM/SIGINT while draining, or a worker death that
leaves some stage without a live instance (``Supervisor.failed``), fails every
request in flight, stops the workers and raises ``DaemonFailed`` (exit 1), so a
service manager restarts the daemon.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from contextlib import suppress
from typing import Awaitable, NoReturn

from aiohttp import web
from rich.console import Console

from hydrad.config_file import DaemonConfig
from hydrad.errors import HydradError
from hydrad.heap import freeze_startup_heap
from hydrad.server.app import ADMISSION, ENGINE, FRONTENDS, SUPERVISOR, make_app
from hydrad.server.notify import keep_alive, sd_notify, watchdog_interval
from hydrad.cluster.launch import InstanceSpec, Launched

logger = logging.getLogger("hydrad.daemon")

# After the drain, the requests aborted at its end get this long to write their last
# bytes, and aiohttp as long (twice: before and after cancelling) for a handler stuck
# writing to a client that does not read, before the connections close.
_ABORT_GRACE = 2.0
_CLOSE_TIMEOUT = 1.0


class DaemonFailed(HydradError):
    """The daemon stopped before its in-flight requests could finish."""


async def serve(config: DaemonConfig, specs: list[InstanceSpec], console: Console,
                deployment: dict | None = None, launched: dict[int, Launched] | None = None) -> None:
    """``launched``: the workers of ``specs`` started already, which the supervisor adopts."""
    server = config.server
    app = make_app(config, specs, console=console, deployment=deployment, launched=launched)
    # The drain is done here, not by aiohttp, which would grant its timeout twice (waiting
    # for handlers, then again after cancelling them) and stop listening first.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=_CLOSE_TIMEOUT, access_log=None)
    loop = asyncio.get_running_loop()
    signals: asyncio.Queue[signal.Signals] = asyncio.Queue()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    stop_requested = asyncio.ensure_future(signals.get())
    setup = asyncio.ensure_future(runner.setup())
    await asyncio.wait([setup, stop_requested], return_when=asyncio.FIRST_COMPLETED)
    if not setup.done():  # a signal while the workers were loading
        logger.info("stop requested during start-up")
        setup.cancel()
        with suppress(asyncio.CancelledError):
            await setup
        return
    setup.result()
    frontends = app[FRONTENDS]
    site = web.TCPSite(runner, server.host, server.port, reuse_port=frontends.count > 1)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise HydradError(f"cannot listen on {server.host}:{server.port}: {e.strerror or e}") from None
    urls = ", ".join(f"http://{a[0]}:{a[1]}" if isinstance(a, tuple) else str(a) for a in runner.addresses)
    supervisor = app[SUPERVISOR]
    if frontends.count > 1:
        port = next(a[1] for a in runner.addresses if isinstance(a, tuple))
        try:
            await web.UnixSite(runner, frontends.socket_path).start()  # their /health, /metrics, /admin
            await frontends.start(server.host, port, app[ENGINE].trace, app[ENGINE].max_model_len,
                                  server.worker_start_timeout, app[ENGINE].image_caches)
        except (HydradError, OSError) as e:
            await runner.cleanup()
            raise HydradError(f"cannot start the front-end processes: {e}") from None
    logger.info("serving %s on %s%s", app[ENGINE].model_name, urls,
                f" ({frontends.count} front-end processes)" if frontends.count > 1 else "")
    freeze_startup_heap(logger)
    sd_notify("READY=1\nSTATUS=serving")
    interval = watchdog_interval()
    pinging = None  # a stop at once leaves it to the loop's end
    if interval is not None:
        pinging = asyncio.ensure_future(keep_alive(interval))
        logger.info("pinging systemd's watchdog every %.1f s (WatchdogSec %.0f s)", interval / 4, interval)
    failed = asyncio.ensure_future(supervisor.failed.wait())
    await asyncio.wait([stop_requested, failed], return_when=asyncio.FIRST_COMPLETED)
    if not stop_requested.done():  # a stage lost its last instance (the supervisor logged which)
        stop_requested.cancel()
        _log_stopping_now(app)
        await _stop_now(app, runner.cleanup(), supervisor.failure)
    admission = app[ADMISSION]
    inflight = len(admission.inflight) + frontends.num_inflight
    logger.info("shutting down: %d request(s) in flight, waiting up to %.0f s", inflight, server.shutdown_timeout)
    sd_notify(f"STOPPING=1\nSTATUS=draining {inflight} request(s)")
    reason = f"{stop_requested.result().name} received"
    admission.start_draining(reason)
    frontends.drain(reason, server.shutdown_timeout)
    drained = asyncio.ensure_future(_drain(admission, frontends, server.shutdown_timeout))
    second_signal = asyncio.ensure_future(signals.get())
    await asyncio.wait([drained, second_signal, failed], return_when=asyncio.FIRST_COMPLETED)
    if not drained.done():
        drained.cancel()
        if second_signal.done():
            reason = f"second {second_signal.result().name} while draining"
            logger.warning("%s: aborting %d request(s) and stopping now", reason, len(admission.inflight))
        else:
            reason = supervisor.failure
            _log_stopping_now(app)
        await _stop_now(app, runner.cleanup(), reason)
    second_signal.cancel()
    failed.cancel()
    if not drained.result():
        ids = sorted(entry.req_id or "(not started)" for entry in admission.inflight)
        logger.warning("shutting down: %d request(s) still running after %g s (server.shutdown_timeout), aborted: %s",
                       len(ids), server.shutdown_timeout, ", ".join(ids))
        _abort_all(app, f"the daemon is shutting down: the request was still running after "
                        f"server.shutdown_timeout ({server.shutdown_timeout:g} s)")
        await admission.wait_idle(_ABORT_GRACE)
        await frontends.wait_exited(_ABORT_GRACE + 1.0)
    await runner.cleanup()
    if pinging is not None:
        pinging.cancel()
    logger.info("stopped")


async def _drain(admission, frontends, timeout: float) -> bool:
    """True once the daemon's requests and the front-end processes' are all done (the front
    ends exit when theirs are), False if ``timeout`` seconds pass first."""
    start = time.monotonic()
    if not await admission.wait_idle(timeout):
        return False
    return await frontends.wait_exited(max(0.0, timeout - (time.monotonic() - start)))


def _log_stopping_now(app: web.Application) -> None:
    table = app[SUPERVISOR].table
    # The requests of the worker that died have failed already; count them with the rest.
    logger.error("stopping now: %d request(s) failed with the lost worker(s), %d more in flight fail",
                 table.num_lost, len(app[ADMISSION].inflight) + app[FRONTENDS].num_inflight)


def _abort_all(app: web.Application, reason: str) -> None:
    """End every request: those on workers, those waiting for a budget or being processed."""
    app[ADMISSION].abort_all(reason)
    app[SUPERVISOR].table.fail_all(reason)


async def _stop_now(app: web.Application, cleanup: Awaitable[None], reason: str) -> NoReturn:
    """Fail every request in flight, stop the workers (``cleanup``: the app's, which
    returns as soon as no handler runs) and raise ``DaemonFailed``."""
    _abort_all(app, f"the daemon is stopping: {reason}")
    sd_notify(f"STOPPING=1\nSTATUS=stopping: {reason}")
    await cleanup
    raise DaemonFailed(f"stopped: {reason}")
