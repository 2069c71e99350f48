"""The daemon's life: start the app, serve until SIGTERM/SIGINT, shut down gracefully.

Shutdown: stop listening, give in-flight requests up to ``server.shutdown_timeout``
seconds, cancel (and so abort) the rest, stop the workers, return (exit 0).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from contextlib import suppress

from aiohttp import web
from rich.console import Console

from hydrad.config_file import DaemonConfig
from hydrad.errors import HydradError
from hydrad.server.app import ENGINE, SUPERVISOR, make_app
from hydrad.server.notify import sd_notify
from hydrad.server.supervisor import InstanceSpec

logger = logging.getLogger("hydrad.daemon")


async def serve(config: DaemonConfig, specs: list[InstanceSpec], console: Console) -> None:
    server = config.server
    app = make_app(config, specs, console=console)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=server.shutdown_timeout,
                           access_log=None)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stop_requested = asyncio.ensure_future(stop.wait())
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
    await stop_requested
    inflight = len(app[SUPERVISOR].table)
    logger.info("shutting down: %d request(s) in flight, waiting up to %.0f s", inflight, server.shutdown_timeout)
    sd_notify(f"STOPPING=1\nSTATUS=draining {inflight} request(s)")
    await runner.cleanup()
    logger.info("stopped")
