"""Starts one worker process per instance, watches them, restarts the ones that die.

Workers are started by ``cluster/launch.py`` (forked from a fork server, or spawned).
Readiness (weights loaded, caches allocated) is shown as a progress display; a worker
that fails to start at daemon start stops the others and surfaces its error as one line.

A worker that dies later (killed, crashed, out of memory) is noticed when its pipe
reaches EOF — at once — and one line says which worker it was and how it ended. The
requests it held run again from the tokens they had (``RequestTable.lost``: once each;
those whose pixels were not kept fail); offers waiting for a stage it held wait for it
(``RequestTable.hold_offers``). It is restarted with its role after a short backoff,
its pools are shared again with every live peer (and theirs with it), and it takes
requests again; ``/health`` is 503 meanwhile. A worker restarted ``restart_limit``
times within ``restart_window`` seconds is in a crash loop and stays down: if every
stage (E, P, D) is still held by a live instance the daemon serves on, degraded;
otherwise ``failed`` is set and the daemon stops, so that its service manager
restarts it whole.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Awaitable, Callable

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from hydrad.cluster.launch import (
    InstanceSpec, Launched, launch_worker, migrates, new_board, peer_ids, plan_threads, pools_in_shared_memory,
    share_cpu_cores,
)
from hydrad.cluster.preflight import check_shared_memory
from hydrad.cluster.redeploy import RoleChange, format_deploy, plan_redeploy
from hydrad.cluster.requests import RequestTable
from hydrad.cluster.router import Router
from hydrad.cluster.worker_client import EXITED, WorkerClient, WorkerLost
from hydrad.console import console as default_console
from hydrad.config import EngineConfig
from hydrad.errors import HydradError
from hydrad.transport.messages import Reconfigured, WorkerReady

logger = logging.getLogger("hydrad.supervisor")

# Seconds before the first restart of a worker, doubled for each further one.
_FIRST_BACKOFF = 0.5
_MAX_BACKOFF = 8.0
# Signals a worker dies of when killed from outside (an operator, a stop), never of a request.
_OUTSIDE_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
# While a redeploy waits for its workers (hand-over, latency models), one line this often.
HANDOVER_REPORT_SECONDS = 5.0


class WorkerStartError(HydradError):
    pass


async def _reporting(calls: dict[int, Awaitable], line: Callable[[float, list[int]], str],
                     say: Callable[[str], None]) -> list:
    """The results of ``calls`` (by instance), in their order; every ``HANDOVER_REPORT_SECONDS``
    while some are pending, ``line(seconds so far, instances pending)`` to ``say`` and the log.
    Cancelled, it cancels them."""
    futures = {i: asyncio.ensure_future(call) for i, call in calls.items()}
    waiting = asyncio.gather(*futures.values())
    start = time.monotonic()
    try:
        while not (await asyncio.wait({waiting}, timeout=HANDOVER_REPORT_SECONDS))[0]:
            text = line(time.monotonic() - start, [i for i, f in futures.items() if not f.done()])
            logger.info("redeploy: %s", text)
            say(text)
    except asyncio.CancelledError:
        waiting.cancel()
        raise
    return waiting.result()


class RedeployError(HydradError):
    """A redeploy could not start or did not complete (the deployment is as it was)."""


@dataclass(frozen=True)
class Deployment:
    """A deployment the daemon ran: its spec, since when (wall clock), why, and how long
    the change to it took (None for the first)."""

    deploy: str
    since: float
    reason: str
    seconds: float | None = None
    # What asked for it: "start", "admin" (hydractl redeploy, the admin API) or "auto" (the
    # re-planner).
    trigger: str = "start"


@dataclass(frozen=True)
class RestartPolicy:
    """Restart a dead worker unless it was restarted ``limit`` times within ``window`` seconds."""

    limit: int = 3
    window: float = 300.0


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


def oom_kills(vmstat: str = "/proc/vmstat") -> int | None:
    """Processes the kernel's out-of-memory killer has killed since boot (a cgroup's memory
    limit included), or None where the kernel does not say."""
    try:
        with open(vmstat) as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass  # not Linux, or no such counter: None, and no worker's line names the killer
    return None


def missing_stages(roles: list[str]) -> list[str]:
    """The stages (of E, P, D) that none of ``roles`` holds."""
    return [stage for stage in "EPD" if not any(stage in role for role in roles)]


class Supervisor:
    def __init__(self, config: EngineConfig, specs: list[InstanceSpec], *, start_timeout: float = 600.0,
                 router_policy: str = "round-robin", restart: RestartPolicy | None = None,
                 launched: dict[int, Launched] | None = None, rerun_image_bytes: int = 1 << 30,
                 stall_timeout: float = 0.0, quarantine_seconds: float = 300.0):
        """``launched``: workers of ``specs`` started already (``launch.launch_all``), by
        instance id; the supervisor takes them over at ``start`` instead of spawning them.
        ``rerun_image_bytes``: pixels kept to run requests again when their worker dies
        (``RequestTable``); ``quarantine_seconds``: for how long the content of a request
        that lost two of them is refused. ``stall_timeout``: a worker that holds requests and
        answers nothing for this long, then nothing to a probe for as long again, is killed
        (and restarted as any dead worker); 0: never."""
        self.config = config
        self.specs = list(specs)
        self.start_timeout = start_timeout
        self.restart = restart or RestartPolicy()
        self.clients: list[WorkerClient] = []
        # The router sees the clients list itself: a worker restarted in place is seen at once.
        self.router = Router(self.clients, router_policy, seed=config.seed if config is not None else None)
        self.table = RequestTable(self.router, rerun_image_bytes, quarantine_seconds)
        # Called with a one-line status when the daemon goes on serving degraded or recovers.
        self.on_status: Callable[[str], None] | None = None
        # Called with every new worker client (at start and at each restart), to wire it up.
        self.on_client: Callable[[WorkerClient], None] | None = None
        # Pools are shared between instances only when requests migrate between them.
        self.migrates = migrates(specs)
        self._launched = launched if launched is not None else {}
        # Where the CPU workers say whether they have work, to lend their cores (``engine.cores``).
        self.board = next((item.board for item in self._launched.values()), None) or new_board(self.specs)
        self._processes: dict[int, BaseProcess] = {}  # by instance id
        self._stopping = False
        self._restart_times: dict[int, deque[float]] = {}
        # The kernel's out-of-memory kills so far: a worker killed by SIGKILL meanwhile was likely one.
        self._oom_kills = oom_kills()
        self.restarting: set[int] = set()
        # Instance id -> why it is not restarted any more.
        self.crash_loops: dict[int, str] = {}
        self.num_restarts: dict[int, int] = {spec.instance_id: 0 for spec in specs}
        # Set once a stage is left without a live instance for good; ``failure`` says why.
        self.failed = asyncio.Event()
        self.failure: str | None = None
        self._tasks: set[asyncio.Task] = set()
        # Every deployment since start, the current one last.
        self.history: list[Deployment] = []
        self.num_failed_redeploys = 0  # started and not completed
        self._redeploying = False
        self.stall_timeout = stall_timeout
        self._probing: set[int] = set()  # instance ids whose silence is being probed

    @property
    def healthy(self) -> bool:
        return bool(self.clients) and all(c.accepting for c in self.clients)

    @property
    def busy(self) -> str | None:
        """Why the deployment cannot be changed now (None: it can)."""
        if self._redeploying:
            return "a redeploy is under way"
        down = [c.instance_id for c in self.clients if not c.accepting]
        if down:
            return f"instance(s) {', '.join(map(str, down))} are down or restarting"
        return None

    @property
    def is_cpu(self) -> bool:
        return all(spec.device.startswith("cpu") for spec in self.specs)

    def process(self, instance_id: int) -> BaseProcess | None:
        return self._processes.get(instance_id)

    # -- start -----------------------------------------------------------------------------------
    async def start(self, console: Console | None = None, reason: str = "start") -> list[WorkerReady]:
        self.history.append(Deployment(format_deploy([s.role for s in self.specs]), time.time(), reason))
        for spec in self.specs:
            self.clients.append(await self._spawn(spec))
        try:
            readies = await asyncio.wait_for(self._wait_ready(console), self.start_timeout)
            if self.migrates:
                self._attach_all(readies)
            if self.stall_timeout > 0:
                self._spawn_task(self._watch_stalls())
            return readies
        except (WorkerLost, asyncio.TimeoutError) as e:
            await self.stop(timeout=5.0)
            if isinstance(e, asyncio.TimeoutError):
                raise WorkerStartError(f"workers not ready after {self.start_timeout:.0f} s") from None
            failed = next(c for c in self.clients if not c.alive)
            raise WorkerStartError(f"worker {failed.instance_id} ({failed.device}) failed to start: "
                                   f"{failed.failure}") from None

    async def _spawn(self, spec: InstanceSpec) -> WorkerClient:
        """Start the worker process of ``spec`` (or take the one launched for it before the
        daemon started); its client is connected, not yet ready."""
        # Registers torch's reductions, with which tensors go down the pipes through shared memory.
        import torch.multiprocessing  # noqa: F401

        launched = self._launched.pop(spec.instance_id, None)
        if launched is None:
            share_cpu_cores(self.specs)
            launched = launch_worker(self.config, spec, peer_ids(spec, self.specs) if self.migrates else (), self.board,
                                     shared=self.config is not None and pools_in_shared_memory(self.config, self.specs))
        if not launched.started.is_set():
            await asyncio.get_running_loop().run_in_executor(None, launched.started.wait)
        process, parent = launched.process, launched.conn
        self._processes[spec.instance_id] = process
        client = WorkerClient(spec.instance_id, spec.role, spec.device, self.table)
        client.on_lost = self._on_lost
        if self.on_client is not None:
            self.on_client(client)
        await client.connect(parent)
        return client

    async def _wait_ready(self, console: Console | None) -> list[WorkerReady]:
        start = time.monotonic()
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                      console=console or default_console, transient=False) as progress:
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

    def _attach_all(self, readies: list[WorkerReady]) -> None:
        """Hand every instance the pools of all others (pickled by each source for it)."""
        for client in self.clients:
            client.attach_peers({r.instance_id: r.pools[client.instance_id] for r in readies
                                 if r.instance_id != client.instance_id})
        logger.info("cache pools shared between %d instances for migration", len(self.clients))

    async def share_pools(self, client: WorkerClient) -> None:
        """Exchange pools between ``client`` (new, or with new pools) and every live peer."""
        if not self.migrates:
            return
        peers = [c for c in self.clients if c is not client and c.alive]
        mine = await asyncio.gather(*(client.export_pools_for(p.instance_id) for p in peers))
        theirs = await asyncio.gather(*(p.export_pools_for(client.instance_id) for p in peers))
        client.attach_peers({p.instance_id: blob for p, blob in zip(peers, theirs)})
        for peer, blob in zip(peers, mine):
            peer.attach_peers({client.instance_id: blob})

    async def _share_all_pools(self) -> None:
        """Every instance gets every other's current pools (after pools were added)."""
        clients = [c for c in self.clients if c.alive]

        async def one(source: WorkerClient) -> None:
            peers = [c for c in clients if c is not source]
            blobs = await asyncio.gather(*(source.export_pools_for(p.instance_id) for p in peers))
            for peer, blob in zip(peers, blobs):
                peer.attach_peers({source.instance_id: blob})

        await asyncio.gather(*(one(c) for c in clients))

    # -- live redeploy ------------------------------------------------------------------------------
    @property
    def deployment(self) -> str:
        return format_deploy([c.role for c in self.clients])

    async def redeploy(self, roles: list[str], *, reason: str = "redeploy", trigger: str = "admin",
                       progress: Callable[[str], None] | None = None) -> Deployment:
        """Change the instances' roles while serving (``hydrad.cluster.redeploy``): expand,
        share pools, switch the router, hand the lost stages over and drop them."""
        say = progress or (lambda line: None)
        if self._redeploying:
            raise RedeployError("a redeploy is already under way")
        if self.busy:
            raise RedeployError(f"{self.busy}; redeploy once /health is ok")
        changes = plan_redeploy([c.role for c in self.clients], roles)
        target = format_deploy(roles)
        start = time.monotonic()
        if not changes:  # the caller tells it from a change: the deployment returned is the current one
            return self.history[-1]
        if not self.migrates and any(role != "EPD" for role in roles) and self.config is not None:
            try:  # the pools move to shared memory: refused now rather than failing half-way
                check_shared_memory(self.config.cache, [spec.device for spec in self.specs], True)
            except HydradError as e:
                raise RedeployError(str(e)) from None
        self._redeploying = True
        try:
            expanding = [c for c in changes if c.gains]
            if expanding:
                say("taking on new stages: " + ", ".join(f"#{c.instance_id} {c.old} -> {c.union}" for c in expanding))
                # An instance whose threads change once the roles have switched (_share_cores)
                # measures its model on borrowed cores then, for the threads it keeps.
                final = plan_threads([(role, spec.device) for role, spec in zip(roles, self.specs)])
                answers = await self._reconfiguring(
                    {c.instance_id: self.clients[c.instance_id].reconfigure(
                        c.union, self.start_timeout,
                        borrowed=final[c.instance_id] == self.specs[c.instance_id].threads)
                     for c in expanding}, "taking on new stages", say)
                failed = [(c, a) for c, a in zip(expanding, answers) if a.error]
                if failed:
                    await self._undo_expand([(c, a) for c, a in zip(expanding, answers) if not a.error])
                    c, a = failed[0]
                    raise RedeployError(f"instance {c.instance_id} could not take on {c.gains}: {a.error}")
                for change, answer in zip(expanding, answers):
                    client = self.clients[change.instance_id]
                    client.role = change.union
                    client.ready = dataclasses.replace(client.ready, latency_model=answer.latency_model,
                                                       latency_bound=answer.latency_bound,
                                                       geometry=answer.geometry or client.ready.geometry,
                                                       borrow_model=answer.borrow_model)
                    say(f"#{change.instance_id} serves {change.union} ({answer.seconds:.1f} s)")
            self.migrates = True
            say("sharing cache pools")
            await self._share_all_pools()
            for change in changes:  # the router sends each instance only its new role's work
                self.clients[change.instance_id].role = change.new
                self.specs[change.instance_id] = dataclasses.replace(self.specs[change.instance_id], role=change.new)
            shrinking = [c for c in changes if c.loses]
            if shrinking:
                say("handing over: " + ", ".join(f"#{c.instance_id} {c.loses}" for c in shrinking))
                answers = await self._handing_over(shrinking, say)
                for change, answer in zip(shrinking, answers):
                    client = self.clients[change.instance_id]
                    if client.ready.latency_model is not None:
                        client.ready = dataclasses.replace(client.ready, latency_bound=answer.latency_bound)
                    say(f"#{change.instance_id} is {answer.role} ({answer.seconds:.1f} s)")
            await self._share_cores(say)
        except RedeployError:
            self.num_failed_redeploys += 1
            raise
        except (WorkerLost, asyncio.TimeoutError) as e:
            self.num_failed_redeploys += 1
            raise RedeployError(f"the redeploy to {target} did not complete: {e or 'timed out'}") from None
        finally:
            self._redeploying = False
        deployment = Deployment(target, time.time(), reason, time.monotonic() - start, trigger)
        self.history.append(deployment)
        logger.info("redeployed as %s in %.1f s (%s)", target, deployment.seconds, reason)
        say(f"serving as {target} after {deployment.seconds:.1f} s")
        return deployment

    async def _handing_over(self, shrinking: list[RoleChange], say: Callable[[str], None]) -> list:
        """Wait for the instances that lose stages to hand over what they hold in them (their
        ``Retired`` answers); every ``HANDOVER_REPORT_SECONDS`` meanwhile, one line (to the
        caller and the log) on what each of them still holds: under load a hand-over lasts
        until the instances taking the stages have room for the requests (seconds, or more
        where two decode instances' requests go to one)."""
        retiring = {c.instance_id: self.clients[c.instance_id].retire(c.loses, self.start_timeout)
                    for c in shrinking}
        return await _reporting(retiring, lambda seconds, pending: (
            f"handing over for {seconds:.0f} s; requests still held: "
            + ", ".join(f"#{i} {self.table.held_by(self.clients[i])}" for i in pending)), say)

    async def _reconfiguring(self, calls: dict[int, Awaitable[Reconfigured]], what: str,
                             say: Callable[[str], None]) -> list[Reconfigured]:
        """The answers to ``Reconfigure`` calls by instance; every ``HANDOVER_REPORT_SECONDS``
        meanwhile, one line on those still measuring their latency models (between their
        steps, each probe once the requests leave room in the pools for it)."""
        return await _reporting(calls, lambda seconds, pending: (
            f"{what} for {seconds:.0f} s: " + ", ".join(f"#{i}" for i in pending)
            + " measuring latency models (between their steps, serving)"), say)

    async def _share_cores(self, say: Callable[[str], None]) -> None:
        """Give each CPU instance the threads of its role in the new deployment (its share,
        and what it borrows from whom: ``engine.cores``), with its latency models at them."""
        plan = plan_threads([(client.role, spec.device) for client, spec in zip(self.clients, self.specs)])
        changed = [(spec, threads) for spec, threads in zip(self.specs, plan)
                   if spec.device == "cpu" and threads != spec.threads]
        if not changed:
            return
        say("threads: " + ", ".join(f"#{spec.instance_id} {spec.threads} -> {threads}" for spec, threads in changed))
        answers = await self._reconfiguring(
            {spec.instance_id: self.clients[spec.instance_id].reconfigure(
                self.clients[spec.instance_id].role, self.start_timeout, threads=threads)
             for spec, threads in changed}, "changing threads", say)
        for (spec, threads), answer in zip(changed, answers):
            if answer.error:  # it keeps its threads and models: slower or faster, still serving
                logger.warning("instance %d keeps its threads (%s): %s", spec.instance_id, spec.threads, answer.error)
                continue
            client = self.clients[spec.instance_id]
            self.specs[spec.instance_id] = dataclasses.replace(spec, threads=threads)
            client.ready = dataclasses.replace(client.ready, latency_model=answer.latency_model,
                                               latency_bound=answer.latency_bound, borrow_model=answer.borrow_model)

    async def _undo_expand(self, expanded: list) -> None:
        """Give back the stages the instances that did expand had just taken on."""
        await asyncio.gather(*(self.clients[c.instance_id].retire(c.gains, self.start_timeout)
                               for c, _ in expanded if c.gains))

    # -- a worker stalls -----------------------------------------------------------------------------
    async def _watch_stalls(self) -> None:
        """Probe each worker that holds requests and has sent nothing for ``stall_timeout``
        (a worker with work sends a step's output at least every step; an idle one waiting
        for a peer answers the probe between steps). Not during a redeploy: a worker taking on
        a role loads weights without answering."""
        while not self._stopping:
            await asyncio.sleep(self.stall_timeout / 4)
            if self._redeploying:
                continue
            now = time.monotonic()
            for client in self.clients:
                if (client.alive and client.ready is not None and client.instance_id not in self._probing
                        and client.instance_id not in self.restarting and now - client.last_heard > self.stall_timeout
                        and self.table.held_by(client)):
                    self._probing.add(client.instance_id)
                    self._spawn_task(self._probe(client))

    async def _probe(self, client: WorkerClient) -> None:
        try:
            await client.get_stats(timeout=self.stall_timeout)
        except asyncio.TimeoutError:
            held, silent = self.table.held_by(client), time.monotonic() - client.last_heard
            # Still silent since before the probe (a step's output meanwhile would say it goes on).
            if client.alive and not self._redeploying and silent >= 2 * self.stall_timeout:
                process = self._processes.get(client.instance_id)
                if process is not None and process.is_alive():
                    process.kill()
                client.give_up(f"answered nothing for {silent:.0f} s while holding {held} request(s): killed")
        except WorkerLost:
            pass  # it died meanwhile: handled as any dead worker (``_on_lost``)
        finally:
            self._probing.discard(client.instance_id)

    # -- a worker dies ------------------------------------------------------------------------------
    def _on_lost(self, client: WorkerClient) -> None:
        if client.ready is not None and not self._stopping:  # start-up failures are reported by start()
            if self.restart.limit > 0:
                # From this moment offers for its stages wait for the restart instead of failing.
                self.restarting.add(client.instance_id)
                self.table.hold_offers = True
            self._spawn_task(self._handle_lost(client))

    def _spawn_task(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle_lost(self, client: WorkerClient) -> None:
        """One line on how the worker ended, then restart it (or give up, and say why)."""
        process = self._processes[client.instance_id]
        # The pipe closes as the process ends; its exit status follows at once.
        await asyncio.get_running_loop().run_in_executor(None, process.join, 5.0)
        # Which came first: the pipe's EOF (the process exited or is exiting) or a reported failure.
        link = "pipe reached EOF" if client.failure == EXITED else client.failure
        why = f"{link}; process {describe_exit(process.exitcode)}"
        out_of_memory = self._out_of_memory() if process.exitcode == -signal.SIGKILL else ""
        why += out_of_memory
        # Killed from outside (an operator, a stop): none of its requests can have caused it.
        # The out-of-memory killer's SIGKILL and the stall watchdog's may have been a request's
        # doing; so may any crash or failed step.
        from_outside = (process.exitcode is not None and -process.exitcode in _OUTSIDE_SIGNALS and not out_of_memory
                        and client.failure == EXITED)
        self.table.judge(client.instance_id, not from_outside, describe_exit(process.exitcode) + out_of_memory)
        down = f"worker {client.instance_id} ({client.device}, {client.role}, pid {process.pid}) is down: {why}"
        if self._stopping:
            logger.error("%s", down)
            return
        for peer in self.clients:
            if peer is not client and peer.alive:
                peer.detach_peer(client.instance_id)
        spec = self.specs[client.instance_id]
        if client.instance_id in self.restarting:
            logger.error("%s; restarting it", down)
            self._status(f"restarting worker {spec.instance_id}")
            await self._restart(spec, down)
            return
        self._give_up(spec, down)

    def _out_of_memory(self) -> str:
        """What to add to a SIGKILL's line when the kernel's out-of-memory killer has killed
        since the last look (it kills with SIGKILL; so do operators and the stall watchdog)."""
        before, self._oom_kills = self._oom_kills, oom_kills()
        if before is None or self._oom_kills is None or self._oom_kills <= before:
            return ""
        return (f" (the kernel's out-of-memory killer killed {self._oom_kills - before} process(es) meanwhile: "
                "likely this one; /proc/vmstat oom_kill)")

    async def _restart(self, spec: InstanceSpec, down: str) -> None:
        """Restart ``spec``'s worker until it is ready, backing off, or declare a crash loop."""
        times = self._restart_times.setdefault(spec.instance_id, deque())
        self.restarting.add(spec.instance_id)
        self.table.hold_offers = True
        try:
            while not self._stopping:
                now = time.monotonic()
                while times and times[0] < now - self.restart.window:
                    times.popleft()
                if len(times) >= self.restart.limit:
                    self._give_up(spec, f"{down}; crash loop: restarted {len(times)} times within "
                                        f"{self.restart.window:.0f} s, not restarting it again")
                    return
                await asyncio.sleep(min(_MAX_BACKOFF, _FIRST_BACKOFF * 2 ** len(times)))
                times.append(time.monotonic())
                self.num_restarts[spec.instance_id] += 1
                client = await self._spawn(spec)
                client.held_back = True  # until its pools and its peers' are shared
                self.clients[spec.instance_id] = client
                try:
                    ready = await asyncio.wait_for(client.wait_ready(), self.start_timeout)
                    await self.share_pools(client)
                    client.held_back = False
                except (WorkerLost, asyncio.TimeoutError) as e:
                    if isinstance(e, asyncio.TimeoutError):
                        reason = f"not ready after {self.start_timeout:.0f} s"
                    else:
                        reason = client.failure or str(e)
                    logger.error("worker %d failed to restart: %s", spec.instance_id, reason)
                    down = f"worker {spec.instance_id} ({spec.device}, {spec.role}) failed to restart: {reason}"
                    await self._reap(spec.instance_id, client)
                    continue
                logger.info("worker %d (%s, %s, pid %d) restarted in %.1f s", spec.instance_id, spec.device,
                            spec.role, ready.pid, ready.load_seconds)
                self._status("serving" if self.healthy else "degraded")
                return
        finally:
            self.restarting.discard(spec.instance_id)
            self.table.hold_offers = bool(self.restarting)
            self.table.retry_parked()

    async def _reap(self, instance_id: int, client: WorkerClient) -> None:
        """Make sure a worker that failed is gone (it may hang half-started)."""
        client.close()
        process = self._processes[instance_id]
        if process.is_alive():
            process.kill()
        await asyncio.get_running_loop().run_in_executor(None, process.join, 5.0)

    def _give_up(self, spec: InstanceSpec, reason: str) -> None:
        self.crash_loops[spec.instance_id] = reason
        live = [c for c in self.clients if c.accepting]
        missing = missing_stages([c.role for c in live])
        if missing:
            reason = f"{reason}; no live instance holds stage {', '.join(missing)}"
            logger.error("%s", reason)
            if self.failure is None:
                self.failure = reason
                self.failed.set()
            return
        logger.error("%s; serving degraded on %d of %d instance(s)", reason, len(live), len(self.clients))
        self._status(f"degraded: worker {spec.instance_id} is down")

    def _status(self, status: str) -> None:
        if self.on_status is not None:
            self.on_status(status)

    # -- stop ------------------------------------------------------------------------------------------
    async def stop(self, timeout: float = 10.0) -> None:
        """Tell every worker to exit (aborting what is left), wait, then force the stragglers."""
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()
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
