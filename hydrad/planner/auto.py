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
A daemon started with ``--deploy auto`` that re-plans while serving (``[planner] auto``,
``replan``) keeps each deployment it redeploys to the same way, so that a restart comes
back on it.
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

logger = logging.getLogger("hydrad.planner")

# Fewer finished requests than this say too little about a workload to plan from.
MIN_REQUESTS = 10
# The newest requests of a long trace are planned from.
MAX_REQUESTS = 2000
# The kept plan, in the trace folder (the trace reader reads only trace*.jsonl there).
PLAN_FILE = "plan.json"


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

    def to_json(self) -> dict:
        return {**asdict(self), "key": {**asdict(self.key), "devices": list(self.key.devices)}}

    @classmethod
    def from_json(cls, d: dict) -> KeptPlan:
        k = d["key"]
        key = PlanKey(str(k["model"]), tuple(map(str, k["devices"])), str(k["engine_settings"]),
                      str(k["router_policy"]), str(k["trace"]), str(k["version"]))
        return cls(key, str(d["deploy"]), str(d["reason"]), float(d["made_at"]), int(d["num_requests"]),
                   float(d["newest"]))


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


def save_plan(path: Path, plan: KeptPlan) -> None:
    """Keep ``plan`` at ``path`` (written whole, then renamed into place); a failure is
    logged, never raised: it only costs the next start a plan."""
    temp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".plan-", suffix=".json", delete=False,
                                         encoding="utf-8") as f:
            temp = f.name
            json.dump(plan.to_json(), f, indent=1)
        os.replace(temp, path)
    except (OSError, TypeError, ValueError) as e:
        logger.warning("deploy auto: cannot keep the plan in %s (%s)", path, getattr(e, "strerror", None) or e)
        if temp is not None:
            with contextlib.suppress(OSError):
                os.unlink(temp)


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


def choose_deployment(config, trace_path: str | None = None) -> tuple[str, str]:
    """(deploy spec, why) for ``config`` (a ``DaemonConfig`` with its model path resolved)."""
    from hydrad.cluster.deploy import parse_devices
    from hydrad.cluster.launch import cuda_device_count
    from hydrad.cluster.preflight import shared_memory_error

    num_cuda = cuda_device_count(config.engine.parallel.devices)
    devices = parse_devices(config.engine.parallel.devices, num_cuda)
    num_devices = len(devices)
    fallback = f"{num_devices}EPD"
    source = Path(trace_path) if trace_path else config.trace.directory
    model = Path(config.engine.model.path).name
    if num_devices == 1:
        return fallback, "one device: one EPD instance"
    if (no_room := shared_memory_error(config.engine.cache, devices)) is not None:
        # Every other deployment moves requests between instances, their pools in /dev/shm.
        reason = f"one EPD instance per device, the one deployment whose pools stay private: {no_room}"
        logger.warning("deploy auto: %s (%s)", fallback, reason)
        return fallback, reason
    if not trace_path and not source.exists():
        reason = f"one EPD instance per device: no request trace yet in {source}"
        logger.info("deploy auto: %s (%s)", fallback, reason)
        return fallback, reason
    try:
        from hydrad.trace import read_trace

        records = read_trace(source, model=model, newest=MAX_REQUESTS)
        if len(records) < MIN_REQUESTS:
            reason = (f"one EPD instance per device: {source} holds {len(records)} finished request(s) of "
                      f"{model}, fewer than {MIN_REQUESTS}")
        else:
            key = plan_key(model, devices, config.engine, config.server.router_policy, source)
            plan_path = config.trace.directory / PLAN_FILE
            kept = load_plan(plan_path)
            now = time.time()
            why_not = reusable(kept, key, records, reuse_hours=config.planner.reuse_hours, now=now)
            if why_not is None:
                reason = (f"the plan of {(now - kept.made_at) / 60:.0f} min ago, kept in {plan_path}: "
                          f"{kept.reason}")
                logger.info("deploy auto: %s (%s)", kept.deploy, reason)
                return kept.deploy, reason
            logger.info("deploy auto: planning (%s)", why_not)
            # Planning reads the latency models (torch): only once there is a trace to plan from.
            from hydrad.planner.profile import Devices, MachineOptions, plan_deployment

            options = MachineOptions(router_policy=config.server.router_policy)
            spec, reason = plan_deployment(records, config.engine, Devices(tuple(devices)), options=options)
            logger.info("deploy auto: %s (%s)", spec, reason)
            save_plan(plan_path, KeptPlan(key, spec, reason, now, len(records), max(r.timestamp for r in records)))
            return spec, reason
    except Exception as e:  # planning must never keep the daemon from starting
        reason = f"one EPD instance per device: planning from {source} failed ({type(e).__name__}: {e})"
        logger.warning("deploy auto: %s", reason)
        return fallback, reason
    logger.info("deploy auto: %s (%s)", fallback, reason)
    return fallback, reason
