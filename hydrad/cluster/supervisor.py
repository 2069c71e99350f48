"""Spawns one worker process per instance, waits until all are ready, stops them.

Workers are started with ``torch.multiprocessing`` (spawn). Readiness (weights
loaded, caches allocated) is shown as a progress display; a worker that fails
to start stops the others and surfaces its error as one line. A worker that
dies later is marked down (``/health`` turns 503), its requests fail, and one
line says which worker it was and how it ended. If every stage (E, P, D) is
still held by a live instance the daemon serves on, degraded; otherwise
``failed`` is set and the daemon stops, so that its service manager
restarts it whole.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Callable

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from hydrad.cluster.requests import RequestTable
from hydrad.cluster.router import Router
from hydrad.cluster.worker_client import EXITED, WorkerClient, WorkerLost
from hydrad.config import EngineConfig
from hydrad.errors import HydradError
from hydrad.transport.messages import AttachPeers, WorkerReady

logger = logging.getLogger("hydrad.supervisor")


class WorkerStartError(HydradError):
    pass


@dataclass(frozen=True)
class InstanceSpec:
    instance_id: int
    role: str
    device: str
    num_threads: int


def plan_specs(instances: list[tuple[str, str]]) -> list[InstanceSpec]:
    """Number the (role, device) pairs and split the CPU cores among CPU workers."""
    num_cpu = sum(1 for _, device in instances if device == "cpu")
    threads = max(1, (os.cpu_count() or 1) // max(1, num_cpu))
    return [InstanceSpec(i, role, device, threads) for i, (role, device) in enumerate(instances)]


def describe_exit(exitcode: int | None) -> str:
    """A process's ``exitcode`` in words (negative: the signal that killed it)."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


def missing_stages(roles: list[str]) -> list[str]:
    """The stages (of E, P, D) that none of ``roles`` holds."""
    return [stage for stage in "EPD" if not any(stage in role for role in roles)]


class Supervisor:
    def __init__(self, config: EngineConfig, specs: list[InstanceSpec], *, start_timeout: float = 600.0,
                 router_policy: str = "round-robin"):
        self.config = config
        self.specs = specs
        self.start_timeout = start_timeout
        self.clients: list[WorkerClient] = []
        # The router sees the clients list itself: a worker restarted in place is seen at once.
        self.router = Router(self.clients, router_policy, seed=config.seed if config is not None else None)
        self.table = RequestTable(self.router)
        # Called with a one-line status when the daemon goes on serving degraded.
        self.on_degraded: Callable[[str], None] | None = None
        # Pools are shared between instances only when requests migrate between them.
        self.migrates = any(spec.role != "EPD" for spec in specs)
        self._processes: dict[int, BaseProcess] = {}  # by instance id
        self._stopping = False
        # Set once a worker has died and left some stage without a live instance;
        # ``failure`` says which worker and how it ended.
        self.failed = asyncio.Event()
        self.failure: str | None = None
        self._reports: set[asyncio.Task] = set()

    @property
    def healthy(self) -> bool:
        return bool(self.clients) and all(c.alive for c in self.clients)

    async def start(self, console: Console | None = None) -> list[WorkerReady]:
        import torch.multiprocessing as mp

        from hydrad.engine.worker import worker_main

        ctx = mp.get_context("spawn")
        for spec in self.specs:
            parent, child = ctx.Pipe()
            peer_ids = tuple(s.instance_id for s in self.specs if s is not spec) if self.migrates else ()
            process = ctx.Process(
                target=worker_main,
                args=(spec.instance_id, spec.role, spec.device, self.config, child, spec.num_threads, peer_ids),
                name=f"hydrad-worker-{spec.instance_id}",
            )
            process.start()
            child.close()  # so the daemon sees EOF when the worker exits
            self._processes[spec.instance_id] = process
            client = WorkerClient(spec.instance_id, spec.role, spec.device, self.table)
            client.on_lost = self._on_lost
            await client.connect(parent)
            self.clients.append(client)
        try:
            readies = await asyncio.wait_for(self._wait_ready(console), self.start_timeout)
            if self.migrates:
                self._attach_peers(readies)
            return readies
        except (WorkerLost, asyncio.TimeoutError) as e:
            await self.stop(timeout=5.0)
            if isinstance(e, asyncio.TimeoutError):
                raise WorkerStartError(f"workers not ready after {self.start_timeout:.0f} s") from None
            failed = next(c for c in self.clients if not c.alive)
            raise WorkerStartError(f"worker {failed.instance_id} ({failed.device}) failed to start: "
                                   f"{failed.failure}") from None

    async def _wait_ready(self, console: Console | None) -> list[WorkerReady]:
        start = time.monotonic()
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                      console=console or Console(stderr=True), transient=False) as progress:
            tasks = {c.instance_id: progress.add_task(f"worker {c.instance_id} {c.device} {c.role}: loading",
                                                      total=1) for c in self.clients}

            async def one(client: WorkerClient) -> WorkerReady:
                ready = await client.wait_ready()
                progress.update(tasks[client.instance_id], completed=1,
                                description=f"worker {client.instance_id} {client.device} {client.role}: ready")
                logger.info("worker %d (%s, %s, pid %d) ready in %.1f s", client.instance_id, client.device,
                            client.role, ready.pid, ready.load_seconds)
                return ready

            readies = await asyncio.gather(*(one(c) for c in self.clients))
        logger.info("%d worker(s) ready in %.1f s", len(readies), time.monotonic() - start)
        return readies

    def _attach_peers(self, readies: list[WorkerReady]) -> None:
        """Hand every instance the pools of all others (pickled by each source for it)."""
        for client in self.clients:
            pools = {r.instance_id: r.pools[client.instance_id] for r in readies if r.instance_id != client.instance_id}
            client.send_quietly(AttachPeers(pools))
        logger.info("cache pools shared between %d instances for migration", len(self.clients))

    def _on_lost(self, client: WorkerClient) -> None:
        if client.ready is not None and not self._stopping:  # start-up failures are reported by start()
            task = asyncio.ensure_future(self._report_lost(client))
            self._reports.add(task)
            task.add_done_callback(self._reports.discard)

    async def _report_lost(self, client: WorkerClient) -> None:
        """One line on how the worker ended; ``failed`` if a stage lost its last instance."""
        process = self._processes[client.instance_id]
        # The pipe closes as the process ends; its exit status follows at once.
        await asyncio.get_running_loop().run_in_executor(None, process.join, 5.0)
        # Which came first: the pipe's EOF (the process exited or is exiting) or a reported failure.
        link = "pipe reached EOF" if client.failure == EXITED else client.failure
        why = f"{link}; process {describe_exit(process.exitcode)}"
        down = f"worker {client.instance_id} ({client.device}, {client.role}, pid {process.pid}) is down: {why}"
        live = [c for c in self.clients if c.alive]
        missing = missing_stages([c.role for c in live])
        if self._stopping:
            logger.error("%s", down)
        elif missing:
            reason = f"{down}; no live instance holds stage {', '.join(missing)}"
            logger.error("%s", reason)
            if self.failure is None:
                self.failure = reason
                self.failed.set()
        else:
            logger.error("%s; serving degraded on %d of %d instance(s)", down, len(live), len(self.clients))
            if self.on_degraded is not None:
                self.on_degraded(f"degraded: worker {client.instance_id} is down")

    async def stop(self, timeout: float = 10.0) -> None:
        """Tell every worker to exit (aborting what is left), wait, then force the stragglers."""
        self._stopping = True
        for client in self.clients:
            client.shutdown(finish_running=False)
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + timeout
        for process in self._processes.values():
            await loop.run_in_executor(None, process.join, max(0.0, deadline - time.monotonic()))
        for process in self._processes.values():
            if process.is_alive():
                logger.warning("worker %s did not exit in %.0f s; killing it", process.name, timeout)
                process.kill()
                await loop.run_in_executor(None, process.join, 5.0)
        for client in self.clients:
            client.close()
        logger.info("workers stopped")
