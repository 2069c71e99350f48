"""Re-planning while serving (``[planner] auto``).

Every ``planner.interval`` seconds the daemon ranks the deployments of its devices on
the requests of the last ``planner.window`` seconds of its own trace, and redeploys
(``Supervisor.redeploy``, the path of ``hydractl redeploy``) when the best one's
simulated goodput beats the running one's by ``planner.margin``, at most once per
``planner.min_interval`` seconds. Every decision, taken or not, is logged with its
numbers and kept for ``/admin/status`` (``hydractl status``).

Nothing is measured for it: the simulator's machine (``SimSetup``) is built from what
the workers reported when they became ready (or changed roles): their latency models,
block geometry and copy bandwidth (``live_setup``); and it runs at the speed the workers
measure on their own steps now, per kind of work (``EngineStats.live_speed``), as the
profile runs at the speed of its check. Each CPU worker runs on its share
of the cores, and its model is measured there; a worker that borrows idle cores
(``engine.cores``) also reports its model at the count it borrows up to. A role's
latency model holds only the parts the role runs, so the vision terms come from an
instance that encodes and the language terms from one that prefills or decodes.

The search runs in a child process at a lower CPU priority (``nice``), so that it
neither holds the daemon's event loop nor takes the cores from the workers first; it
reads the trace window itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from hydrad.cluster.deploy import format_deploy
from hydrad.config import EngineConfig
from hydrad.engine.cores import usable_cpus
from hydrad.engine.latency_model import LANGUAGE_TERMS, VISION_TERMS, LatencyModel
from hydrad.planner.search import ROLE_ORDER, rate_text

logger = logging.getLogger("hydrad.planner")

# Decisions kept for /admin/status.
MAX_DECISIONS = 50
# How much lower the search's own process runs (nice increment).
NICENESS = 10
# Planning at start on a busy cluster (a worker restarting): tries, and the wait between them.
REFRESH_TRIES = 12
REFRESH_RETRY_SECONDS = 5.0


@dataclass(frozen=True)
class InstanceFacts:
    """What the planner needs of one running instance (from its ``WorkerReady``)."""

    role: str
    latency_model: LatencyModel | None
    geometry: object | None  # hydrad.engine.core.PoolGeometry
    copy_bandwidth: float | None
    max_model_len: int
    # A CPU instance that borrows idle cores: its model on ``borrow_threads`` threads.
    borrow_model: LatencyModel | None = None
    borrow_threads: int = 0
    # Measured / predicted seconds of its recent steps by kind of work, and how many steps
    # of each (``EngineStats.live_speed``, ``live_speed_steps``): the machine under load.
    live_speed: dict[str, float] = field(default_factory=dict)
    live_speed_steps: dict[str, int] = field(default_factory=dict)
    live_speed_spread: float = 0.0


@dataclass(frozen=True)
class Decision:
    """One re-planning: what ran, what the planner ranked first, and what was done."""

    time: float  # UNIX time it was decided
    action: str  # "redeploy", "keep", "skip" (too little to plan from) or "failed"
    current: str  # the deployment running when it was decided
    reason: str  # one line
    best: str | None = None
    current_goodput: float | None = None  # simulated, req/s
    best_goodput: float | None = None
    num_requests: int = 0  # finished requests in the window
    rate: float | None = None  # their mean arrival rate, req/s
    seconds: float = 0.0  # what the planning took

    def line(self) -> str:
        return f"{self.action} {self.current}: {self.reason}"


@dataclass(frozen=True)
class Ranking:
    """The answer for one window (what crosses back from the child process); ``best`` is
    None when the window held fewer than ``min_requests`` finished requests."""

    num_requests: int
    current: tuple[str, ...] = ()
    best: tuple[str, ...] | None = None
    current_goodput: float = 0.0
    best_goodput: float = 0.0
    rate: float = 0.0
    seconds: float = 0.0
    # The highest goodput a replay of the window can tell (``Planner.max_rate``).
    max_rate: float = float("inf")


def canonical(roles: Sequence[str]) -> tuple[str, ...]:
    return tuple(sorted(roles, key=ROLE_ORDER.index))


def combine_models(instances: Sequence[InstanceFacts]) -> LatencyModel:
    """One vision+language model from the instances' models: the vision terms of an instance
    whose model was fitted with the vision part, the language terms of one fitted with the
    language part, the overlap of one fitted with both (else 1: vision and language one after
    the other, as on a CPU)."""

    def parts(facts: InstanceFacts) -> str:
        key = facts.latency_model.meta.get("key") if facts.latency_model.meta else None
        if isinstance(key, dict) and "parts" in key:
            return key["parts"]
        from hydrad.engine.latency_model import role_parts

        return role_parts(facts.role)

    fitted = [(parts(f), f.latency_model) for f in instances if f.latency_model is not None]
    vision = next((m for p, m in fitted if "vision" in p), None)
    language = next((m for p, m in fitted if "language" in p), None)
    if vision is None or language is None:
        missing = "an encoding" if vision is None else "a prefilling or decoding"
        raise ValueError(f"no latency model of {missing} instance (is [scheduler] derive_budgets off?)")
    both = next((m for p, m in fitted if "vision" in p and "language" in p), None)
    terms = {name: getattr(vision, name) for name in VISION_TERMS}
    terms.update({name: getattr(language, name) for name in LANGUAGE_TERMS})
    return LatencyModel(**terms, overlap=both.overlap if both is not None else 1.0,
                        meta={"combined_from": sorted({p for p, _ in fitted})})


def live_setup(config: EngineConfig, instances: Sequence[InstanceFacts], *, is_cpu: bool, cores: int | None,
               router_policy: str, options=None):
    """The simulator's machine from what the running instances reported."""
    from hydrad.planner.profile import MachineOptions, at_speeds, live_speeds, role_layouts
    from hydrad.planner.simulator import SimSetup

    options = options or MachineOptions(router_policy=router_policy)
    geometry = next((f.geometry for f in instances if f.geometry is not None and ("P" in f.role or "D" in f.role)),
                    next((f.geometry for f in instances if f.geometry is not None), None))
    if geometry is None:
        raise ValueError("the workers reported no block geometry")
    bandwidths = [f.copy_bandwidth for f in instances if f.copy_bandwidth]
    extra = {"bandwidth": min(bandwidths)} if bandwidths else {}
    n = len(instances)
    share = max(1, (cores or 1) // n) if is_cpu else 1
    # Each model reported at a borrowed count whose instances fitted both parts (a count
    # missing one is taken from the share's model in the simulator).
    thread_models = {}
    for threads in {f.borrow_threads for f in instances if f.borrow_model is not None}:
        borrowed = [dataclasses.replace(f, latency_model=f.borrow_model) for f in instances
                    if f.borrow_model is not None and f.borrow_threads == threads]
        try:
            thread_models[threads] = combine_models(borrowed)
        except ValueError:
            pass
    setup = SimSetup(
        model=combine_models(instances), thread_models=thread_models,
        layouts=role_layouts(config, geometry),
        kv_block_size=geometry.kv_block_size, image_block_size=geometry.image_block_size,
        kv_block_bytes=geometry.kv_block_bytes, image_block_bytes=geometry.image_block_bytes,
        max_model_len=min(f.max_model_len for f in instances),
        scheduler=config.scheduler, slo=config.slo, router_policy=router_policy,
        message_seconds=options.message_seconds, step_overhead=options.step_overhead,
        cores=cores if is_cpu else None, threads=share,
        fill_by_model=config.scheduler.derive_budgets, processor_threads=options.processor_threads,
        prefill_after_encode=not config.parallel.dual_streams_on("cpu" if is_cpu else "cuda"),
        borrow_efficiency=options.borrow_efficiency, corun_slowdown=dict(options.corun_slowdown),
        all_cores_slowdown=dict(options.all_cores_slowdown), team_waits=options.team_waits,
        warm_requests=options.warm_requests, noise_correlation=options.noise_correlation, **extra,
    )
    # The machine as the workers measured it on their own steps: a replay at speed 1 would
    # plan for the machine as it was when the models were fitted.
    speeds = live_speeds([(f.live_speed, f.live_speed_steps, f.live_speed_spread) for f in instances],
                         {share, *thread_models})
    return at_speeds(setup, speeds, under_load=True) if speeds else setup


def rank_window(trace_dir: str | Path, model: str, since: float, setup, current: Sequence[str], *,
                min_requests: int, slo_ttft: float, slo_tbt: float, num_requests: int, seed: int = 0) -> Ranking:
    """Rank every deployment of ``len(current)`` instances on the requests of ``model`` that
    arrived at ``since`` (UNIX time) or later, and bisect the running one's goodput too (it
    may be out of the search's top)."""
    from hydrad.planner.search import MAX_PLAN_REQUESTS, Evaluation, Planner
    from hydrad.trace import read_trace, trace_files
    from hydrad.planner.workload import Workload

    start = time.perf_counter()
    trace_dir = Path(trace_dir)
    records = []
    if trace_dir.is_dir() and trace_files(trace_dir):
        records = read_trace(trace_dir, model=model, since=since)
    if len(records) < min_requests:
        return Ranking(len(records))
    workload = Workload.from_records(records)
    planner = Planner(setup, workload, slo_ttft=slo_ttft, slo_tbt=slo_tbt, num_requests=num_requests,
                      arrivals="trace", seed=seed, max_requests=MAX_PLAN_REQUESTS)
    result = planner.search(len(current), top_k=1)
    best = result.best
    roles = canonical(current)
    running = next((e for e in result.evaluations if e.roles == roles), None)
    if running is None:
        running = Evaluation(roles, planner.bound(roles))
    if running.goodput is None or running.status != "ranked":
        planner.bisect(running)
    return Ranking(len(records), roles, best.roles, running.goodput, best.goodput, workload.mean_rate,
                   time.perf_counter() - start, planner.max_rate)


async def _stats(client, timeout: float = 2.0):
    """An instance's ``EngineStats``; None when it is down or does not answer in time."""
    from hydrad.cluster.worker_client import WorkerLost

    try:
        return await client.get_stats(timeout)
    except (WorkerLost, asyncio.TimeoutError):
        return None


def _lower_priority() -> None:
    try:
        os.nice(NICENESS)
    except OSError:
        pass


class Replanner:
    """The daemon's re-planning loop. ``supervisor`` is the cluster's ``Supervisor`` (its
    ``clients``, ``deployment``, ``redeploy``, ``busy``); ``rank``: ``rank_window`` or a
    stand-in, run in the child process unless ``executor`` says otherwise."""

    def __init__(self, daemon_config, supervisor, model_name: str, *, trace_dir: Path | None = None,
                 rank: Callable[..., Ranking] = rank_window, executor=None, clock: Callable[[], float] = time.time,
                 keep_plans: bool = False, planned_devices: str | None = None):
        self.config = daemon_config.planner
        self.engine_config: EngineConfig = daemon_config.engine
        self.router_policy = daemon_config.server.router_policy
        self.supervisor = supervisor
        self.model_name = model_name
        self.trace_dir = trace_dir or daemon_config.trace.directory
        self.rank = rank
        self._executor = executor
        self._own_executor = executor is None
        self.clock = clock
        # Started with --deploy auto: each redeploy is kept as the plan a restart comes back on.
        self.keep_plans = keep_plans
        # The --devices the start planned for (``auto``: the plan picked the count of CPU
        # workers too), which a kept plan's key names; None: the daemon's own.
        self.planned_devices = planned_devices or daemon_config.engine.parallel.devices
        self.decisions: deque[Decision] = deque(maxlen=MAX_DECISIONS)
        self.num_decisions: dict[str, int] = {}  # by action, since start (for the metrics)
        self.last_redeploy: float | None = None
        self._task: asyncio.Task | None = None
        self._refresh_task: asyncio.Task | None = None

    # -- life -------------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    def start_refresh(self, since: float) -> None:
        """Plan once now, on the trace's requests since ``since`` (UNIX time), as a start would
        have (the kept plan the daemon started on was outgrown): redeploy to the best where it
        is ahead at all, and keep the plan for the next start (``refresh``)."""
        self._refresh_task = asyncio.ensure_future(self.refresh(since))

    async def refresh(self, since: float) -> Decision | None:
        """``start_refresh``'s planning; while the cluster is busy (a worker restarting, a
        redeploy under way) it tries again every ``REFRESH_RETRY_SECONDS``, up to
        ``REFRESH_TRIES`` times."""
        try:
            for _ in range(REFRESH_TRIES):
                decision = await self.replan(since=since)
                if decision.action != "skip" or not self.supervisor.busy:
                    return decision
                await asyncio.sleep(REFRESH_RETRY_SECONDS)
            return decision
        except asyncio.CancelledError:
            raise
        except Exception:  # the daemon serves on the plan it started with
            logger.exception("planning at start failed")
            return None

    async def stop(self) -> None:
        for task in (self._task, self._refresh_task):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        self._task = self._refresh_task = None
        if self._own_executor and self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval)
            try:
                await self.replan()
            except asyncio.CancelledError:
                raise
            except Exception:  # a re-planning must never take the daemon down
                logger.exception("re-planning failed")

    def status(self) -> dict:
        c = self.config
        return {"auto": c.auto, "interval": c.interval, "window": c.window, "margin": c.margin,
                "min_interval": c.min_interval, "decisions": [dataclasses.asdict(d) for d in self.decisions]}

    # -- one re-planning --------------------------------------------------------------------------------
    async def replan(self, since: float | None = None) -> Decision:
        """One decision on the last ``planner.window`` seconds of the trace, or (``since``:
        planning at start) on its requests since then."""
        decision = await self._decide(since)
        self.decisions.append(decision)
        self.num_decisions[decision.action] = self.num_decisions.get(decision.action, 0) + 1
        log = logger.warning if decision.action == "failed" else logger.info
        log("%s: %s", "re-planning" if since is None else "planning at start", decision.line())
        return decision

    async def _decide(self, since: float | None = None) -> Decision:
        """``since`` (planning at start): the trace's requests since then, as ``--deploy auto``
        plans from them (``auto.MIN_REQUESTS`` at least); the best is taken where it is ahead at
        all (no ``margin``, no ``min_interval``), and the plan kept either way."""
        from hydrad.planner.auto import MIN_REQUESTS

        now = self.clock()
        at_start = since is not None
        supervisor = self.supervisor
        current_roles = [c.role for c in supervisor.clients]
        current = format_deploy(current_roles)

        def decision(action: str, reason: str, **numbers) -> Decision:
            return Decision(now, action, current, reason, **numbers)

        busy = supervisor.busy
        if busy:
            return decision("skip", busy)
        if not supervisor.migrates:
            from hydrad.cluster.preflight import shared_memory_error

            no_room = shared_memory_error(self.engine_config.cache, [spec.device for spec in supervisor.specs])
            if no_room is not None:  # every other deployment keeps its CPU pools in /dev/shm
                return decision("skip", f"no deployment but {current} can run here: {no_room}")
        window = "the trace's newest" if at_start else f"the last {self.config.window:g} s"
        min_requests = MIN_REQUESTS if at_start else self.config.min_requests
        margin = 0.0 if at_start else self.config.margin
        stats = await asyncio.gather(*(_stats(c) for c in supervisor.clients))
        facts = [InstanceFacts(c.role, c.ready.latency_model, getattr(c.ready, "geometry", None),
                               getattr(c.ready, "copy_bandwidth", None), c.ready.max_model_len,
                               getattr(c.ready, "borrow_model", None), supervisor.specs[c.instance_id].threads.most,
                               live_speed=dict(st.live_speed) if st else {},
                               live_speed_steps=dict(st.live_speed_steps) if st else {},
                               live_speed_spread=st.live_speed_spread if st else 0.0)
                 for c, st in zip(supervisor.clients, stats)]
        slo = self.engine_config.slo
        try:
            setup = live_setup(self.engine_config, facts, is_cpu=supervisor.is_cpu, cores=usable_cpus(),
                               router_policy=self.router_policy)
            ranking = await asyncio.get_running_loop().run_in_executor(self._pool(), functools.partial(
                self.rank, str(self.trace_dir), self.model_name, since if at_start else now - self.config.window,
                setup, current_roles, min_requests=min_requests, slo_ttft=slo.ttft, slo_tbt=slo.tbt,
                num_requests=self.config.num_requests, seed=self.engine_config.seed))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            return decision("failed", f"planning failed: {type(e).__name__}: {e}")
        if ranking.best is None:
            least = f"{min_requests}" if at_start else f"planner.min_requests ({min_requests})"
            return decision("skip", f"{ranking.num_requests} finished request(s) in {window}, fewer than {least}",
                            num_requests=ranking.num_requests)
        best = format_deploy(list(ranking.best))
        numbers = dict(best=best, current_goodput=ranking.current_goodput, best_goodput=ranking.best_goodput,
                       num_requests=ranking.num_requests, rate=ranking.rate, seconds=ranking.seconds)

        def rate(goodput: float) -> str:
            return f"{rate_text(goodput, ranking.max_rate)} req/s"

        summary = (f"{ranking.num_requests} requests in {window} ({ranking.rate:.3g} req/s); simulated goodput "
                   f"{current} {rate(ranking.current_goodput)}")

        def keep(why: str) -> Decision:
            if at_start and self.keep_plans:  # the next start reuses it
                self._keep(current, f"planned at start: {summary}: {why}", now, ranking.num_requests)
            return decision("keep", f"{summary}: {why}", **numbers)

        if ranking.best == canonical(current_roles):
            return keep("the running deployment is the best")
        summary += f", {best} {rate(ranking.best_goodput)}"
        if ranking.best_goodput <= ranking.current_goodput * (1 + margin):
            return keep(f"not better by planner.margin ({margin:.0%})" if margin else "not better")
        if not at_start and self.last_redeploy is not None and now - self.last_redeploy < self.config.min_interval:
            wait = self.config.min_interval - (now - self.last_redeploy)
            return decision("keep", f"{summary}: the last redeploy was {now - self.last_redeploy:.0f} s ago "
                                    f"(planner.min_interval {self.config.min_interval:g} s; {wait:.0f} s to go)",
                            **numbers)
        from hydrad.cluster.supervisor import RedeployError

        self.last_redeploy = now
        try:
            changed = await supervisor.redeploy(list(ranking.best), reason=f"auto: {'at start: ' if at_start else ''}"
                                                f"{summary}", trigger="auto")
        except RedeployError as e:
            return decision("failed", f"{summary}: the redeploy to {best} failed: {e}", **numbers)
        if self.keep_plans:
            self._keep(best, f"auto: {summary}", now, ranking.num_requests)
        return decision("redeploy", f"{summary}: redeployed to {best} in {changed.seconds:.1f} s", **numbers)

    def _keep(self, deploy: str, reason: str, now: float, num_requests: int) -> None:
        from hydrad.planner.auto import keep_redeploy

        devices = [self.supervisor.specs[c.instance_id].device for c in self.supervisor.clients]
        keep_redeploy(self.trace_dir, self.model_name, self.engine_config, self.router_policy, self.planned_devices,
                      devices, deploy, reason, now, num_requests)

    def _pool(self):
        if self._executor is None:
            import multiprocessing

            self._executor = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_lower_priority)
        return self._executor
