"""``hydrad start --deploy auto``: the planner's pick from a trace, never a reason not to start.

With a trace (``--trace``, else the daemon's own trace folder from earlier runs) holding
enough finished requests of the model being served, the deployment is the one the
planner ranks first for the ``[slo]`` targets on the configured devices. Without one,
or when planning fails for any reason, it is one EPD instance per device, and one log
line says why.

A plan takes seconds to tens of seconds (the machine's speed check, the search and the
averaging over recent speeds: ``docs/planner.md``), and a restart would pay it each time.
So each plan is kept (``plan.json`` in the trace folder) with what it was made for: the
model, the devices, the engine's configuration (``[slo]`` included), the router policy,
the trace and the newest request it read. A start reuses it while it is younger than ``[planner] reuse_hours`` and
the trace holds fewer new requests than the plan was made from (the workload it saw is
still at least half of what there is now); otherwise it plans again and keeps the new one.

``hydractl profile --keep`` keeps its pick the same way (``keep_profile``), under the key
of the start with the profile's inputs: what the operator read is what that start deploys.

A daemon started with ``--deploy auto`` that re-plans while serving (``[planner] auto``,
``replan``) keeps each deployment it redeploys to the same way, so that a restart comes
back on it.

``--devices auto`` on a machine without GPUs leaves the number of CPU workers open: a worker
of one thread per core and one worker on every core serve differently (the second does more
for one request at a time, the first keeps more of them going, each worker with its own
copy of the weights). There the plan also picks the count, among 1, 2, 4, ... and all the
usable cores (at most ``MAX_AUTO_CPU_WORKERS``) whose workers fit in memory: it ranks the
deployments of each count and takes the best; a count of more workers wins only where its
simulated goodput is ahead by more than ``WORKERS_MARGIN``, and not where the fewer already
reach the replay's ceiling. Without a trace it is one worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

logger = logging.getLogger("hydrad.planner")

# Fewer finished requests than this say too little about a workload to plan from.
MIN_REQUESTS = 10
# The newest requests of a long trace are planned from.
MAX_REQUESTS = 2000
# The kept plan, in the trace folder (the trace reader reads only trace*.jsonl there).
PLAN_FILE = "plan.json"
# ``--devices auto`` without GPUs: the most CPU workers a plan considers.
MAX_AUTO_CPU_WORKERS = 8
# ... and how far ahead a count of more workers must be to be picked over fewer.
WORKERS_MARGIN = 0.05


class Choice(NamedTuple):
    """What ``hydrad start --deploy auto`` runs, and why."""

    deploy: str
    reason: str
    # The --devices it runs on: as configured, or ``cpu:N`` where ``auto`` left the count of
    # CPU workers to the plan.
    devices: str
    # Where a kept plan runs while a new one is made (``refresh``): the arrival (UNIX time) of
    # the oldest of the trace's newest requests, which the daemon plans from once it serves.
    refresh_since: float | None = None


@dataclass(frozen=True)
class PlanKey:
    """What a plan was made for: a plan for other inputs is not reused."""

    model: str
    devices: tuple[str, ...]
    # A digest of the engine's configuration ([slo], dtype, caches, scheduler, ...: the
    # targets and what the instances' steps and pools depend on), the deployment left out.
    engine_settings: str
    router_policy: str
    trace: str  # the trace read, resolved
    version: str  # hydrad's: another planner may rank differently


@dataclass(frozen=True)
class KeptPlan:
    key: PlanKey
    deploy: str
    reason: str
    made_at: float  # UNIX time
    num_requests: int  # finished requests it was planned from
    newest: float  # the newest one's arrival (UNIX time)
    # The devices it runs on, where the plan picked them (``cpu:N`` for ``--devices auto``
    # without GPUs); empty: those of the key.
    devices: str = ""

    def to_json(self) -> dict:
        return {**asdict(self), "key": {**asdict(self.key), "devices": list(self.key.devices)}}

    @classmethod
    def from_json(cls, d: dict) -> KeptPlan:
        k = d["key"]
        key = PlanKey(str(k["model"]), tuple(map(str, k["devices"])), str(k["engine_settings"]),
                      str(k["router_policy"]), str(k["trace"]), str(k["version"]))
        return cls(key, str(d["deploy"]), str(d["reason"]), float(d["made_at"]), int(d["num_requests"]),
                   float(d["newest"]), str(d.get("devices", "")))


def plan_key(model: str, devices: list[str], engine, router_policy: str, source: Path) -> PlanKey:
    """The key of a plan for the model named ``model`` on ``devices`` (one device string per
    instance) with ``engine`` (an ``EngineConfig``), planned from the trace at ``source``."""
    from hydrad import __version__

    settings = dataclasses.asdict(engine)
    settings["parallel"].pop("deploy", None)
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return PlanKey(model, tuple(devices), digest, router_policy, str(Path(source).resolve()), __version__)


def load_plan(path: Path) -> KeptPlan | None:
    """The plan kept at ``path``; None when there is none or it cannot be read (a new plan
    then replaces it)."""
    try:
        return KeptPlan.from_json(json.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("deploy auto: ignoring the kept plan %s (%s)", path, e)
        return None


def save_plan(path: Path, plan: KeptPlan) -> str | None:
    """Keep ``plan`` at ``path`` (written whole, then renamed into place); a failure is
    logged and returned (why), never raised: it only costs the next start a plan."""
    temp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".plan-", suffix=".json", delete=False,
                                         encoding="utf-8") as f:
            temp = f.name
            json.dump(plan.to_json(), f, indent=1)
        os.replace(temp, path)
    except (OSError, TypeError, ValueError) as e:
        why = str(getattr(e, "strerror", None) or e)
        logger.warning("deploy auto: cannot keep the plan in %s (%s)", path, why)
        if temp is not None:
            with contextlib.suppress(OSError):
                os.unlink(temp)
        return why
    return None


def reusable(plan: KeptPlan | None, key: PlanKey, records, *, reuse_hours: float, now: float) -> str | None:
    """Why ``plan`` is not reused for ``key`` on the trace's newest ``records``; None when it is."""
    if plan is None:
        return "no plan kept"
    if reuse_hours <= 0:
        return "[planner] reuse_hours = 0"
    if plan.key != key:
        changed = [name.replace("_", " ") for name in PlanKey.__dataclass_fields__
                   if getattr(plan.key, name) != getattr(key, name)]
        return f"the kept plan was made for other inputs: {', '.join(changed)}"
    age = now - plan.made_at
    if age < 0:
        return "the kept plan was made later than now (the clock was set back)"
    if age >= reuse_hours * 3600:
        return f"the kept plan is {age / 3600:.1f} h old (reuse_hours = {reuse_hours:g})"
    new = sum(1 for r in records if r.timestamp > plan.newest)
    if new >= min(plan.num_requests, MAX_REQUESTS):
        return f"{new} requests traced since the kept plan, which was made from {plan.num_requests}"
    return None


def auto_cpu_cores(requested: str, num_cuda: int) -> int | None:
    """The usable cores where ``--devices`` ``requested`` leaves the number of CPU workers to
    the plan (``auto`` with no GPU, on more than one core); None elsewhere."""
    from hydrad.engine.cores import usable_cpus

    if requested.strip().lower() != "auto" or num_cuda:
        return None
    cores = usable_cpus()
    return cores if cores > 1 else None


def cpu_worker_counts(cores: int) -> list[int]:
    """The CPU worker counts a plan on ``cores`` cores picks among: 1, 2, 4, ... and ``cores``,
    at most ``MAX_AUTO_CPU_WORKERS``."""
    top = min(cores, MAX_AUTO_CPU_WORKERS)
    counts = {1, top}
    n = 2
    while n < top:
        counts.add(n)
        n *= 2
    return sorted(counts)


def pick_worker_count(plans: dict) -> int:
    """The count of ``plans`` (``PlannedDeployment`` by CPU worker count) to run: the fewest
    workers unless more are ahead by ``WORKERS_MARGIN`` (fewer workers hold fewer copies of
    the weights and put more threads on each request); fewer that reach the replay's ceiling
    cannot be shown to be behind."""
    best = min(plans)
    for n in sorted(plans):
        if n > best and not plans[best].lower_bound and plans[n].goodput > (1 + WORKERS_MARGIN) * plans[best].goodput:
            best = n
    return best


def _key_devices(devices: list[str], cores: int | None) -> list[str]:
    """The devices a plan's key names: those configured, or the cores where the plan picks the
    count of CPU workers."""
    return [f"auto:cpu:{cores}"] if cores else devices


def _start_key(config, devices: list[str], cores: int | None, source: Path) -> PlanKey:
    """The key of the plan a start with ``config`` (its model path resolved, its
    ``parallel.devices`` as given) on ``devices`` makes from the trace at ``source``."""
    return plan_key(Path(config.engine.model.path).name, _key_devices(devices, cores), config.engine,
                    config.server.router_policy, source)


def keep_profile(config, devices_spec: str, source: Path, records, deploy: str, reason: str,
                 now: float | None = None) -> Path:
    """Keep the pick ``deploy`` of a ``hydractl profile`` run as the plan of ``hydrad start
    --deploy auto --devices devices_spec`` with ``config`` (a ``DaemonConfig`` with its model
    path resolved and its ``[slo]`` the profile's), planning from the trace at ``source``; a
    start with those inputs deploys it without planning (``reusable``). ``records``: the
    finished requests of the model it was planned from. Returns where it was kept.

    Raises ``ConfigError`` where no start could reuse it: ``--devices auto`` on CPU cores
    (that start picks its count of workers too)."""
    from hydrad.cluster.deploy import parse_devices
    from hydrad.cluster.launch import cuda_device_count
    from hydrad.errors import ConfigError

    num_cuda = cuda_device_count(devices_spec)
    if auto_cpu_cores(devices_spec, num_cuda):
        raise ConfigError("a start with --devices auto on CPU cores picks its count of workers too and plans "
                          "itself: give --devices cpu:N to keep the pick")
    engine = dataclasses.replace(config.engine, parallel=dataclasses.replace(config.engine.parallel,
                                                                             devices=devices_spec))
    config = dataclasses.replace(config, engine=engine)
    key = _start_key(config, parse_devices(devices_spec, num_cuda), None, Path(source))
    path = config.trace.directory / PLAN_FILE
    now = time.time() if now is None else now
    if (why := save_plan(path, KeptPlan(key, deploy, reason, now, len(records),
                                        max(r.timestamp for r in records)))) is not None:
        raise ConfigError(f"cannot keep the plan in {path}: {why}")
    return path


def keep_redeploy(trace_dir: Path, model: str, engine, router_policy: str, requested_devices: str,
                  devices: list[str], deploy: str, reason: str, now: float, num_requests: int) -> None:
    """Keep a redeploy to ``deploy`` on ``devices`` (one device string per instance) of a daemon
    started with ``--deploy auto`` and ``--devices`` ``requested_devices``, as the plan its next
    start comes back on."""
    cores = auto_cpu_cores(requested_devices, sum(1 for d in devices if d.startswith("cuda")))
    if cores:
        engine = dataclasses.replace(engine, parallel=dataclasses.replace(engine.parallel, devices=requested_devices))
    key = plan_key(model, _key_devices(devices, cores), engine, router_policy, trace_dir)
    save_plan(trace_dir / PLAN_FILE, KeptPlan(key, deploy, reason, now, num_requests, now,
                                              f"cpu:{len(devices)}" if cores else ""))


def choose_deployment(config, trace_path: str | None = None, *, refresh: bool = True) -> Choice:
    """What to run for ``config`` (a ``DaemonConfig`` with its model path resolved).
    ``refresh``: a kept plan for the same inputs that is no longer reused (too old, or the
    trace outgrew it) runs while the daemon plans again (``Choice.refresh_since``), rather
    than the start planning before it serves."""
    from hydrad.cluster.deploy import parse_devices
    from hydrad.cluster.launch import cuda_device_count
    from hydrad.cluster.preflight import memory_shortfall, shared_memory_error

    requested = config.engine.parallel.devices
    num_cuda = cuda_device_count(requested)
    devices = parse_devices(requested, num_cuda)
    cores = auto_cpu_cores(requested, num_cuda)
    counts = [len(devices)]
    if cores:
        counts = [n for n in cpu_worker_counts(cores)
                  if n == 1 or memory_shortfall(config.engine, n, config.engine.model.path) is None]
        devices = ["cpu"] * counts[-1]
    num_devices = len(devices)

    def fallback(reason: str, level: int = logging.INFO) -> Choice:
        choice = Choice(f"{1 if cores else num_devices}EPD", reason, requested)
        logger.log(level, "deploy auto: %s (%s)", choice.deploy, reason)
        return choice

    source = Path(trace_path) if trace_path else config.trace.directory
    model = Path(config.engine.model.path).name
    if num_devices == 1:
        if cores:  # two workers would not fit in memory
            return fallback(f"one EPD instance: {memory_shortfall(config.engine, 2, config.engine.model.path)}")
        return Choice("1EPD", "one device: one EPD instance", requested)
    if (no_room := shared_memory_error(config.engine.cache, devices)) is not None:
        # Every other deployment moves requests between instances, their pools in /dev/shm.
        return fallback(f"one EPD instance per device, the one deployment whose pools stay private: {no_room}",
                        logging.WARNING)
    if not trace_path and not source.exists():
        return fallback(f"one EPD instance per device: no request trace yet in {source}")
    try:
        from hydrad.trace import read_trace

        records = read_trace(source, model=model, newest=MAX_REQUESTS)
        if len(records) < MIN_REQUESTS:
            return fallback(f"one EPD instance per device: {source} holds {len(records)} finished request(s) of "
                            f"{model}, fewer than {MIN_REQUESTS}")
        key = _start_key(config, devices, cores, source)
        plan_path = config.trace.directory / PLAN_FILE
        kept = load_plan(plan_path)
        now = time.time()
        why_not = reusable(kept, key, records, reuse_hours=config.planner.reuse_hours, now=now)
        fits = kept is None or not kept.devices or len(parse_devices(kept.devices, num_cuda)) in counts
        if why_not is None and not fits:
            why_not = f"the kept plan's {kept.devices} CPU workers would not fit in memory now"
        if why_not is None:
            reason = f"the plan of {(now - kept.made_at) / 60:.0f} min ago, kept in {plan_path}: {kept.reason}"
            logger.info("deploy auto: %s (%s)", kept.deploy, reason)
            return Choice(kept.deploy, reason, kept.devices or requested)
        if refresh and kept is not None and kept.key == key and fits and not trace_path \
                and config.planner.reuse_hours > 0:
            # Made for these inputs, since outgrown (older, or the trace grew): it serves at once
            # while the daemon makes the new plan (``Replanner.refresh``).
            reason = f"the plan of {(now - kept.made_at) / 60:.0f} min ago, kept in {plan_path}, while a new one " \
                     f"is made ({why_not}): {kept.reason}"
            logger.info("deploy auto: %s (%s)", kept.deploy, reason)
            return Choice(kept.deploy, reason, kept.devices or requested, min(r.timestamp for r in records))
        logger.info("deploy auto: planning (%s)", why_not)
        # Planning reads the latency models (torch): only once there is a trace to plan from.
        from hydrad.planner.profile import Devices, MachineOptions, MachineProbe, plan_deployment

        options = MachineOptions(router_policy=config.server.router_policy)
        if cores:
            # One instance of the model and one speed check for the plans of every count.
            with MachineProbe(config.engine, Devices(("cpu",) * counts[-1]), keep_check=True,
                              thread_counts=tuple(max(1, cores // n) for n in counts)) as probe:
                plans = {n: plan_deployment(records, config.engine, Devices(("cpu",) * n), options=options,
                                            probe=probe)
                         for n in counts}
        else:
            plans = {counts[0]: plan_deployment(records, config.engine, Devices(tuple(devices)), options=options)}
        n = pick_worker_count(plans)
        choice = Choice(plans[n].spec, plans[n].reason, f"cpu:{n}" if cores else requested)
        if cores:
            others = "; ".join(f"{m} worker(s): {plans[m].spec} {'>=' if plans[m].lower_bound else ''}"
                               f"{plans[m].goodput:.3g} req/s" for m in counts if m != n)
            choice = choice._replace(reason=f"{n} CPU worker(s) of {max(1, cores // n)} thread(s): {choice.reason}"
                                            f" (the count picked too: {others})")
        logger.info("deploy auto: %s on %s (%s)", choice.deploy, choice.devices, choice.reason)
        save_plan(plan_path, KeptPlan(key, choice.deploy, choice.reason, now, len(records),
                                      max(r.timestamp for r in records), choice.devices if cores else ""))
        return choice
    except Exception as e:  # planning must never keep the daemon from starting
        return fallback(f"one EPD instance per device: planning from {source} failed ({type(e).__name__}: {e})",
                        logging.WARNING)
