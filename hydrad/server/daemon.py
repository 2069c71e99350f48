"""The daemon's life: start the app, serve until SIGTERM/SIGINT, shut down gracefully.

Shutdown: stop listening, give in-flight requests up to ``server.shutdown_timeout``
seconds, cancel (and so abort) the rest, stop the workers, return (exit 0).

Stopping at once: a second SIGTERM/SIGINT while draining, or a worker death that
leaves some stage without a live instance (``Supervisor.failed``), fails every
request in flight, stops the workers and raises ``DaemonFailed`` (exit 1), so a
service manager restarts the daemon.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from contextlib import suppress
from typing import Awaitable, NoReturn

from aiohttp import web
from rich.console import Console

from hydrad.config_file import DaemonConfig
from hydrad.errors import HydradError
from hydrad.server.app import ENGINE, SUPERVISOR, make_app
from hydrad.server.notify import sd_notify
from hydrad.cluster.supervisor import InstanceSpec

logger = logging.getLogger("hydrad.daemon")


class DaemonFailed(HydradError):
    """The daemon stopped before its in-flight requests could finish."""


async def serve(config: DaemonConfig, specs: list[InstanceSpec], console: Console,
                deployment: dict | None = None) -> None:
    server = config.server
    app = make_app(config, specs, console=console, deployment=deployment)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=server.shutdown_timeout,
                           access_log=None)
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
    site = web.TCPSite(runner, server.host, server.port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise HydradError(f"cannot listen on {server.host}:{server.port}: {e.strerror or e}") from None
    urls = ", ".join(f"http://{a[0]}:{a[1]}" if isinstance(a, tuple) else str(a) for a in runner.addresses)
    logger.info("serving %s on %s", app[ENGINE].model_name, urls)
    sd_notify("READY=1\nSTATUS=serving")
    supervisor = app[SUPERVISOR]
    failed = asyncio.ensure_future(supervisor.failed.wait())
    await asyncio.wait([stop_requested, failed], return_when=asyncio.FIRST_COMPLETED)
    if not stop_requested.done():  # a stage lost its last instance (the supervisor logged which)
        stop_requested.cancel()
        logger.error("stopping now: %d request(s) in flight fail", len(supervisor.table))
        await _stop_now(app, runner.cleanup(), supervisor.failure)
    inflight = len(supervisor.table)
    logger.info("shutting down: %d request(s) in flight, waiting up to %.0f s", inflight, server.shutdown_timeout)
    sd_notify(f"STOPPING=1\nSTATUS=draining {inflight} request(s)")
    draining = asyncio.ensure_future(runner.cleanup())
    second_signal = asyncio.ensure_future(signals.get())
    await asyncio.wait([draining, second_signal, failed], return_when=asyncio.FIRST_COMPLETED)
    if not draining.done():
        if second_signal.done():
            reason = f"second {second_signal.result().name} while draining"
            logger.warning("%s: aborting %d request(s) and stopping now", reason, len(supervisor.table))
        else:
            reason = supervisor.failure
            logger.error("stopping now: %d request(s) in flight fail", len(supervisor.table))
        await _stop_now(app, draining, reason)
    second_signal.cancel()
    failed.cancel()
    draining.result()
    logger.info("stopped")


async def _stop_now(app: web.Application, cleanup: Awaitable[None], reason: str) -> NoReturn:
    """Fail every request in flight, stop the workers (``cleanup``: the app's, which
    returns as soon as no handler runs) and raise ``DaemonFailed``."""
    app[SUPERVISOR].table.fail_all(f"the daemon is stopping: {reason}")
    sd_notify(f"STOPPING=1\nSTATUS=stopping: {reason}")
    await cleanup
    raise DaemonFailed(f"stopped: {reason}")
