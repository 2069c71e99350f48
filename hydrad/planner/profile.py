"""``hydractl profile`` and ``--deploy auto``: this machine's numbers, then the search.

The simulator needs, for the deployments of N devices:

* the latency model of an instance as a worker of such a deployment runs it: on CPU a
  worker gets ``cores // N`` torch threads, its share, or up to all cores when it
  borrows idle ones (``engine.cores``), so the model is fitted
  (``engine.profiler.fit_latency_model``, which loads the daemon's disk cache when it
  has the file) on a vision+language instance in this process with the share and
  again with all cores (other counts are interpolated, ``latency_model.at_threads``);
  every role's model is that model's vision part, language part or both
  (``simulator.role_model``), measured by the same probes;
* the pools of an instance of each role (the engine splits its cache memory by role),
  from the checkpoint's geometry and ``[cache]``;
* the copy bandwidth of a pull, measured with the runner's own block copy and cached
  under ``$HYDRAD_CACHE_DIR/bandwidth/`` (``engine.profiler.measure_bandwidth``).

A fixed cost per message between the daemon and a worker and per step is not measured
here: ``message_seconds`` (default 2 ms: the idle E->P and P->D migration of
``bench/migration.py`` less its copy) and ``step_overhead`` (default 1 ms) are options.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from hydrad.cluster.deploy import format_deploy, parse_devices
from hydrad.config import EngineConfig, SLOConfig
from hydrad.engine.cores import usable_cpus
from hydrad.engine.latency_model import NORMAL_MEDIAN_ABS, LatencyModel
from hydrad.errors import ConfigError
from hydrad.planner.search import (MAX_PLAN_REQUESTS, ROLE_ORDER, Evaluation, Planner, SearchResult, at_ceiling,
                                   bisect_at_each, rate_text)
from hydrad.planner.simulator import InstanceLayout, SimSetup
from hydrad.planner.workload import Workload
from hydrad.trace import TraceRecord

logger = logging.getLogger("hydrad.planner")

DEFAULT_MESSAGE_SECONDS = 0.002
DEFAULT_STEP_OVERHEAD = 0.001
DEFAULT_NUM_REQUESTS = 300
# A borrower's speed on lent threads against its model at that count while its lender works
# in bursts beside it: 0.57-0.76 on the 2-core machine this was built on (bench/borrow_speed.py).
DEFAULT_BORROW_EFFICIENCY = 0.65
# How much longer each kind of work takes in a serving deployment than in the idle speed
# check, while another worker computes on the other cores: the workers' own steps against
# the speed check timed around the same run (bench/planner_accuracy.py accuracy, its
# serving_slowdown), medians over 18 live runs of three workloads and three deployments on
# the 2-core machine this was built on: images 1.14x, prefills 1.10x, decodes 1.10x. It
# holds the shared caches and memory bandwidth (the probes beside a copy of themselves on
# the other core alone: 1.01x, 1.03x and 1.09x, bench/corun_speed.py) and what else serving
# adds to a step: the daemon's and the client's processes on the same cores between steps.
DEFAULT_CORUN_SLOWDOWN = {"images": 0.14, "prefills": 0.10, "decodes": 0.10}
# The same for one instance on every core (``SimSetup.all_cores_slowdown``): its steps while
# serving against the speed check at that thread count, measured the same way with one
# worker on the 2-core machine (``bench/planner_accuracy.py accuracy --devices cpu:1``).
DEFAULT_ALL_CORES_SLOWDOWN = {"images": 0.16, "prefills": 0.18, "decodes": 0.02}
# A goodput is what a daemon sustains while serving: each replay starts on instances
# calibrated by a warm-up replay of its first requests (``SimSetup.warm_requests``), as the
# live goodput search runs its rates one after another on one daemon (and warms it up
# first, ``BenchConfig.warmup``). Enough for the calibration's first updates (every 16
# steps that carry decodes).
DEFAULT_WARM_REQUESTS = 32
# How a step's time noise runs on from the instance's previous step's (``SimSetup.noise_correlation``).
# Live steps of a `2EPD` at 6.5 req/s here ran slow in stretches (log measured / predicted:
# lag-one autocorrelation 0.59-0.66, 0.33-0.36 five steps on), but replaying the 72 live
# rounds of four accuracy runs with 0.6 instead of 0 moved their mean error by 0.1 point
# (bench/replay_settings.py, bench/RESULTS.md): off by default.
DEFAULT_NOISE_CORRELATION = 0.0


@dataclass(frozen=True)
class Devices:
    """The devices a deployment gets: one instance each."""

    devices: tuple[str, ...]

    @classmethod
    def parse(cls, spec: str | None) -> Devices:
        """``cpu:N``, ``cuda:0,1``, ``auto``; default (None): every GPU, else one CPU worker
        per core."""
        import torch

        num_cuda = torch.cuda.device_count()
        if spec is None:
            spec = "auto" if num_cuda else f"cpu:{usable_cpus()}"
        return cls(tuple(parse_devices(spec, num_cuda)))

    def __len__(self) -> int:
        return len(self.devices)

    @property
    def is_cpu(self) -> bool:
        return self.devices[0] == "cpu"

    @property
    def threads(self) -> int:
        """Torch threads per worker, as the supervisor gives them."""
        return max(1, usable_cpus() // len(self.devices)) if self.is_cpu else 1

    @property
    def spec(self) -> str:
        return f"cpu:{len(self.devices)}" if self.is_cpu else ",".join(self.devices)


def role_layouts(config: EngineConfig, geometry) -> dict[str, InstanceLayout]:
    """Each role's pools, as ``EngineCore`` sizes them (``hydrad.engine.memory``): from
    [cache], or from the budget a GPU gave an instance's pools (``geometry.pool_bytes``)."""
    from hydrad.engine.memory import role_pool_bytes

    cache = config.cache
    layouts = {}
    for role in ROLE_ORDER:
        kv_bytes, image_bytes = role_pool_bytes(cache, role, geometry.pool_bytes)
        num_kv = (cache.num_kv_blocks or max(1, kv_bytes // geometry.kv_block_bytes)) if kv_bytes else 0
        num_image = (cache.num_image_blocks or max(1, image_bytes // geometry.image_block_bytes)) if image_bytes else 0
        layouts[role] = InstanceLayout(num_kv, num_image)
    return layouts


@dataclass(frozen=True)
class MachineOptions:
    message_seconds: float = DEFAULT_MESSAGE_SECONDS
    step_overhead: float = DEFAULT_STEP_OVERHEAD
    router_policy: str = "round-robin"
    processor_threads: int = 1
    # Time a few of the latency model's probes again and replay at the speed they run now:
    # the median of that check, up to ``speed_history`` recent ones and the fit
    # (``planning_speeds``; None: ``machine_speed.SPEED_HISTORY``; 0: the check alone).
    check_speed: bool = True
    speed_history: int | None = None
    borrow_efficiency: float = DEFAULT_BORROW_EFFICIENCY
    corun_slowdown: dict = field(default_factory=lambda: dict(DEFAULT_CORUN_SLOWDOWN))
    all_cores_slowdown: dict = field(default_factory=lambda: dict(DEFAULT_ALL_CORES_SLOWDOWN))
    # One instance on every core replayed as a team that waits for its slowest thread
    # (``SimSetup.team_waits``).
    team_waits: bool = True
    # CPU seconds per request of clients on the same cores (``SimSetup.client_seconds``).
    client_seconds: float = 0.0
    warm_requests: int = DEFAULT_WARM_REQUESTS
    noise_correlation: float = DEFAULT_NOISE_CORRELATION
    # On CPU, rank the deployments the search bisected by the mean of their goodput at each
    # check of the speed sample (``machine_speed.speed_sample``: the recent checks, this one
    # and the fit), not by their goodput at the median speed alone
    # (``Profile.average_over_speeds``): a shared CPU's speed drifts by 15-45% within an hour
    # here. Not on GPUs, whose drift has not been measured.
    average_speeds: bool = True


class MachineProbe:
    """An instance of the model in this process, with the latency model of each thread count
    a worker of a deployment of ``devices`` runs on (fitted, or loaded from the daemon's disk
    cache): what ``machine_setup`` measures, and the speed check again later
    (``speeds``), as ``hydractl profile --validate`` does around each live run. Use as a
    context manager; torch's thread count is restored on exit.

    ``thread_counts``: more counts to hold a model of, for plans of other numbers of CPU
    workers on the same probe (``for_devices``); ``keep_check``: the speeds a plan is made at
    (``planning_speeds``) are measured once and kept for every plan made on this probe, as
    one start's plans of several worker counts are (a check takes seconds, and they follow
    each other within them)."""

    def __init__(self, config: EngineConfig, devices: Devices, *, show_progress: bool = True,
                 thread_counts: tuple[int, ...] = (), keep_check: bool = False):
        import torch

        from hydrad.engine.core import EngineCore
        from hydrad.engine.profiler import fit_latency_model

        self.devices = devices
        self.cores = usable_cpus()
        self.keep_check = keep_check
        self.kept_check: tuple | None = None  # (history, planning_speeds' answer)
        self.owner = self  # its views (``for_devices``) keep this one: its models, its kept check
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(devices.threads)
        self.engine = None
        try:
            self.engine = EngineCore(config, role="EPD", device=devices.devices[0])
            self.models = {devices.threads: fit_latency_model(self.engine, show_progress=show_progress)}
            # Instances that borrow idle cores run on up to all of them while their lenders idle (engine.cores).
            more = ({self.cores} if devices.is_cpu and self.cores > devices.threads else set()) | set(thread_counts)
            for threads in sorted(more - set(self.models)):
                torch.set_num_threads(threads)
                self.models[threads] = fit_latency_model(self.engine, show_progress=show_progress)
            torch.set_num_threads(devices.threads)
        except BaseException:
            self.close()
            raise

    @property
    def model(self) -> LatencyModel:
        """The model at a worker's own share of threads."""
        return self.models[self.devices.threads]

    def for_devices(self, devices: Devices) -> MachineProbe:
        """This probe as one made for ``devices``, sharing its instance, its models and its kept
        check: it must hold the models their workers run on."""
        need = {devices.threads} | ({self.cores} if devices.is_cpu and self.cores > devices.threads else set())
        if missing := need - set(self.models):
            raise ValueError(f"the probe holds no latency model at {sorted(missing)} thread(s)")
        view = copy.copy(self)
        view.devices = devices
        view.models = {n: self.models[n] for n in sorted(need)}
        return view

    def speeds(self, rounds: int = 5) -> dict:
        """``machine_speed.Speed`` of this machine now against each thread count's model, from
        ``rounds`` timings of each probe; each check joins that model's speed history."""
        import torch

        from hydrad.engine.machine_speed import measure_speed, record_speed

        speeds = {}
        try:
            for threads, model in sorted(self.models.items()):
                torch.set_num_threads(threads)
                speeds[threads] = measure_speed(self.engine, model, rounds=rounds)
                record_speed(model, speeds[threads])
        finally:
            torch.set_num_threads(self.devices.threads)
        return speeds

    def close(self) -> None:
        import torch

        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        torch.set_num_threads(self._threads_before)

    def __enter__(self) -> MachineProbe:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def machine_setup(config: EngineConfig, devices: Devices, options: MachineOptions = MachineOptions(),
                  *, show_progress: bool = True, probe: MachineProbe | None = None) -> SimSetup:
    """How ``devices`` run instances of the model in ``config``: measured (or cached) here;
    ``probe``: on that instance (kept open), else on one made and closed here."""
    from hydrad.engine.profiler import measure_bandwidth

    owned = probe is None
    if probe is None:
        probe = MachineProbe(config, devices, show_progress=show_progress)
    try:
        model = probe.model
        speeds, basis, sample = (planning_speeds(probe, options.speed_history) if options.check_speed
                                 else ({}, {}, []))
        engine = probe.engine
        geometry = engine.geometry()
        bandwidth = measure_bandwidth(engine)
        setup = SimSetup(
            model=model, layouts=role_layouts(config, geometry),
            kv_block_size=geometry.kv_block_size, image_block_size=geometry.image_block_size,
            kv_block_bytes=geometry.kv_block_bytes, image_block_bytes=geometry.image_block_bytes,
            max_model_len=engine.max_model_len,
            scheduler=config.scheduler, slo=config.slo, router_policy=options.router_policy, bandwidth=bandwidth,
            message_seconds=options.message_seconds, step_overhead=options.step_overhead,
            cores=probe.cores if devices.is_cpu else None, threads=devices.threads,
            thread_models={n: m for n, m in probe.models.items() if n != devices.threads},
            fill_by_model=config.scheduler.derive_budgets, processor_threads=options.processor_threads,
            prefill_after_encode=not config.parallel.dual_streams_on("cpu" if devices.is_cpu else "cuda"),
            borrow_efficiency=options.borrow_efficiency,
            corun_slowdown=dict(options.corun_slowdown), all_cores_slowdown=dict(options.all_cores_slowdown),
            team_waits=options.team_waits, client_seconds=options.client_seconds,
            warm_requests=options.warm_requests, noise_correlation=options.noise_correlation, speed_basis=basis,
            speed_sample=tuple(sample) if options.average_speeds and devices.is_cpu else (),
        )
        return at_speeds(setup, speeds)
    finally:
        if owned:
            probe.close()


def planning_speeds(probe: MachineProbe, history: int | None = None) -> tuple[dict, dict, list[dict]]:
    """The speeds a plan is made at (``machine_speed.Speed`` by thread count): a check now, taken
    with up to ``history`` recent ones and the fit (``machine_speed.typical_speed``; None:
    ``machine_speed.SPEED_HISTORY``; 0: the check alone); how each came about, for the
    profile's report; and the checks a plan averages its goodput over
    (``machine_speed.speed_sample``; with ``history`` 0, the check now alone)."""
    owner = probe.owner
    if not owner.keep_check:
        return _check_speeds(probe, history)
    if owner.kept_check is None or owner.kept_check[0] != history:
        # Checked once on every model the probe holds, for each plan to take its own from.
        owner.kept_check = (history, _check_speeds(owner, history))
    speeds, basis, sample = owner.kept_check[1]
    return ({n: s for n, s in speeds.items() if n in probe.models}, {n: b for n, b in basis.items() if n in probe.models},
            [{n: s for n, s in check.items() if n in probe.models} for check in sample])


def _check_speeds(probe: MachineProbe, history: int | None) -> tuple[dict, dict, list[dict]]:
    from hydrad.engine.machine_speed import SPEED_HISTORY, recent_speeds, speed_sample, typical_speed

    history = SPEED_HISTORY if history is None else history
    # The history as it was before this check, which joins it.
    earlier = {n: recent_speeds(model, count=history) if history > 0 else [] for n, model in probe.models.items()}
    now = probe.speeds()
    speeds = {n: typical_speed(speed, earlier[n]) if history > 0 else speed for n, speed in now.items()}
    sample = speed_sample(now, earlier) if history > 0 else [dict(now)]
    basis = {n: {"check_now": now[n].factor, "check_now_by_kind": dict(now[n].parts),
                 "earlier_checks": len(earlier[n]), "with_fit": history > 0, "planned_at": speeds[n].factor}
             for n in sorted(now)}
    if history > 0:
        for n, b in basis.items():
            logger.info("planning at %.2fx the latency model's speed on %d thread(s): the median of this check "
                        "(%.2fx), %d earlier one(s) and the fit", b["planned_at"], n, b["check_now"],
                        b["earlier_checks"])
    return speeds, basis, sample


def mean_speeds(*checks: dict) -> dict:
    """The speed checks ``checks`` (``machine_speed.Speed`` by thread count) taken together: the
    mean factor, and the root mean square spread, per thread count they all measured."""
    from hydrad.engine.machine_speed import Speed

    common = set.intersection(*(set(c) for c in checks)) if checks else set()

    def parts(n: int) -> dict[str, float]:
        kinds = set.intersection(*(set(c[n].parts) for c in checks))
        return {k: sum(c[n].parts[k] for c in checks) / len(checks) for k in sorted(kinds)}

    return {n: Speed(sum(c[n].factor for c in checks) / len(checks),
                     math.sqrt(sum(c[n].spread ** 2 for c in checks) / len(checks)), parts(n)) for n in sorted(common)}


def live_speeds(reports, thread_counts) -> dict:
    """The machine's speed under load (``machine_speed.Speed`` by thread count) from what the
    workers measured on their own steps: ``reports`` holds one (factors, steps, spread)
    triple per instance, its ``EngineStats.live_speed``, ``live_speed_steps`` and
    ``live_speed_spread``. Per kind of work, the instances' factors weighted by their steps;
    the overall factor over every kind; the root mean square spread, weighted the same; the
    same at each of ``thread_counts`` (each worker measures against its model at the count it
    runs on, the models the replay uses). {} when no instance measured any kind."""
    from hydrad.engine.machine_speed import Speed

    weights: dict[str, float] = {}
    sums: dict[str, float] = {}
    spread_sum = spread_weight = 0.0
    for factors, steps, spread in reports:
        counted = 0
        for kind, factor in factors.items():
            n = steps.get(kind, 1)
            counted += n
            weights[kind] = weights.get(kind, 0) + n
            sums[kind] = sums.get(kind, 0.0) + n * factor
        spread_sum += counted * spread ** 2
        spread_weight += counted
    if not weights:
        return {}
    parts = {kind: sums[kind] / weights[kind] for kind in sorted(weights)}
    factor = sum(sums.values()) / sum(weights.values())
    spread = math.sqrt(spread_sum / spread_weight)
    return {n: Speed(factor, spread, dict(parts)) for n in sorted(thread_counts)}


def at_speeds(setup: SimSetup, speeds: dict, *, under_load: bool = False) -> SimSetup:
    """``setup`` replayed at ``speeds`` (``machine_speed.Speed`` by thread count), with the spread
    they imply. ``under_load``: speeds the workers measured on their own steps while serving
    (``live_speeds``), which hold the slowdown of steps running beside each other and beside
    the clients already, so neither ``SimSetup.corun_slowdown`` (nor ``all_cores_slowdown``) nor
    ``client_seconds`` is added on top."""
    corun = {} if under_load else setup.corun_slowdown
    whole = {} if under_load else setup.all_cores_slowdown
    client = 0.0 if under_load else setup.client_seconds
    return replace(setup, speeds={n: s.factor for n, s in speeds.items()}, corun_slowdown=corun,
                   all_cores_slowdown=whole, client_seconds=client,
                   part_speeds={n: dict(s.parts) for n, s in speeds.items() if s.parts},
                   step_noise=step_noise(setup.model, speeds))


def step_noise(model: LatencyModel, speeds: dict) -> float:
    """The spread of the replay's step times (``SimSetup.step_noise``): the model's error on
    the probes it was not fitted on (its median relative error, as the standard deviation of
    a normal whose median absolute value it is) and the spread of the speed check's timings
    (``machine_speed.Speed``, pooled over the thread counts), independent."""
    model_sd = model.error.median / NORMAL_MEDIAN_ABS if model.error is not None else 0.0
    machine_var = sum(speed.spread ** 2 for speed in speeds.values()) / len(speeds) if speeds else 0.0
    return math.sqrt(model_sd ** 2 + machine_var)


@dataclass
class Profile:
    """One ``hydractl profile`` run: what it planned from, and the ranking."""

    workload: Workload
    devices: Devices
    setup: SimSetup
    slo_ttft: float
    slo_tbt: float
    planner: Planner
    result: SearchResult
    curves: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    validation: list[dict] = field(default_factory=list)

    @property
    def pick(self) -> str:
        return self.result.best.spec

    def goodput_at(self, roles, speeds: dict, *, under_load: bool = False) -> float:
        """The simulated goodput of the deployment ``roles`` with the machine at ``speeds``
        (``machine_speed.Speed`` by thread count) instead of the speed measured for the profile;
        ``under_load``: as ``at_speeds``."""
        planner = self.planner.at(at_speeds(self.setup, speeds, under_load=under_load))
        roles = tuple(roles)
        return planner.bisect(Evaluation(roles, planner.bound(roles)))

    def average_over_speeds(self, evaluations: list[Evaluation] | None = None, *, processes: int | None = None,
                            progress: Callable[[int, int], None] | None = None) -> None:
        """Each of ``evaluations`` (None: every deployment the search ranked) takes as its
        goodput the mean of its goodput at each check of the setup's speed sample
        (``SimSetup.speed_sample``), replayed with the same step noise; the ranking is made
        again on it. Nothing changes without a sample of two checks or more. The search
        itself runs at the median speed, and the deployments it did not bisect stay below
        (a few percent of goodput moves none of them past the ``SLACK`` of its bound). The
        checks are bisected in up to ``processes`` processes (``search.bisect_at_each``; None:
        one per core), with the same results as in one."""
        sample = self.setup.speed_sample
        if len(sample) < 2:
            return
        todo = [ev for ev in (self.result.ranked if evaluations is None else evaluations)
                if ev.goodput_by_speed is None and ev.goodput is not None]
        if not todo:
            return
        planners = [self.planner.at(replace(at_speeds(self.setup, speeds), step_noise=self.setup.step_noise))
                    for speeds in sample]
        by_speed, replays = bisect_at_each(planners, [(ev.roles, ev.goodput) for ev in todo], processes=processes,
                                           progress=progress)
        for i, ev in enumerate(todo):
            each = [goodputs[i] for goodputs in by_speed]
            ev.goodput_at_planned_speed, ev.goodput_by_speed = ev.goodput, each
            ev.goodput = sum(each) / len(each)
        self.result.num_replays += replays
        self.result.rerank(self.planner.rank_key)

    def pick_reason(self, num_records: int, who: str = "planner's pick") -> str:
        """One line on why the pick: the SLO, what it was planned from, its simulated goodput
        and, where it was replayed too, that of one EPD instance per device."""
        best = self.result.best
        default = ("EPD",) * len(self.devices)
        baseline = next((e for e in self.result.evaluations if e.roles == default), None)
        top = self.planner.max_rate
        versus = (f", {len(self.devices)}EPD {rate_text(baseline.goodput, top)}"
                  if baseline is not None and baseline.goodput is not None and best is not baseline else "")
        return (f"{who} for TTFT <= {self.slo_ttft:g} s, TBT p90 <= {self.slo_tbt:g} s from {num_records} traced "
                f"requests ({self.workload.mean_rate:.3g} req/s): simulated goodput "
                f"{rate_text(best.goodput, top)} req/s{versus}")

    def to_json(self, top_k: int) -> dict:
        r = self.result
        a2 = r.algorithm2_pick
        costs = self.planner.costs
        ranking = [{
            "deploy": e.spec, "goodput_rps": e.goodput, "attainment_at_trace_rate": e.trace_attainment,
            "bottleneck": e.bottleneck(costs), "bound_rps": e.bound.rate, "algorithm2": e.methods,
            "utilization": e.utilization, "points": [list(p) for p in sorted(e.points)],
            "goodput_at_planned_speed_rps": e.goodput_at_planned_speed, "goodput_by_speed_rps": e.goodput_by_speed,
        } for e in r.ranked]
        coefficients = {k: v for k, v in self.setup.model.to_json()["coefficients"].items()}
        return {
            "workload": self.workload.summary(),
            "devices": self.devices.spec, "threads_per_instance": self.devices.threads,
            "slo": {"ttft": self.slo_ttft, "tbt": self.slo_tbt, "alpha": self.setup.slo.alpha,
                    "headroom": self.setup.slo.headroom},
            "num_requests": self.planner.num_requests, "arrivals": self.planner.arrivals,
            "machine": {"latency_model": coefficients,
                        "latency_models_at_threads": {str(n): m.to_json()["coefficients"]
                                                      for n, m in sorted(self.setup.thread_models.items())},
                        "latency_error": self.setup.model.error and {
                "median": self.setup.model.error.median, "max": self.setup.model.error.max},
                "speed_vs_latency_model": {str(n): f for n, f in sorted(self.setup.speeds.items())},
                "speed_by_kind": {str(n): p for n, p in sorted(self.setup.part_speeds.items())},
                "speed_basis": {str(n): b for n, b in sorted(self.setup.speed_basis.items())},
                "speed_sample": [{str(n): {"factor": s.factor, "by_kind": dict(s.parts)} for n, s in sorted(c.items())}
                                 for c in self.setup.speed_sample],
                "step_noise": self.setup.step_noise, "borrow_efficiency": self.setup.borrow_efficiency,
                "corun_slowdown": dict(self.setup.corun_slowdown),
                "all_cores_slowdown": dict(self.setup.all_cores_slowdown), "team_waits": self.setup.team_waits,
                "client_seconds": self.setup.client_seconds,
                "bandwidth_bytes_per_s": self.setup.bandwidth, "message_seconds": self.setup.message_seconds,
                "step_overhead": self.setup.step_overhead},
            "search": {"instances": r.n, "deployments": len(r.evaluations), "replays": r.num_replays,
                       "seconds": r.seconds, "ranked": len(r.ranked),
                       # What the Request Processor prepares a second (the trace's times): no
                       # deployment's goodput passes it. None: no preparing time recorded.
                       "processor_rate_rps": (self.planner.processor_rate
                                              if math.isfinite(self.planner.processor_rate) else None),
                       "below": sum(e.status == "below" for e in r.evaluations),
                       "pruned": sum(e.status == "pruned" for e in r.evaluations)},
            "algorithm2": {"candidates": {m: format_deploy(list(roles)) for m, roles in r.algorithm2.items()},
                           "pick": a2.spec if a2 else None,
                           "stage_seconds": dict(zip(("encode", "prefill", "decode"),
                                                     self.planner.stage_times()))},
            "pick": self.pick,
            "top": [x["deploy"] for x in ranking[:top_k]],
            "ranking": ranking,
            "others": [{"deploy": e.spec, "status": e.status, "bound_rps": e.bound.rate}
                       for e in r.evaluations if e.status != "ranked"],
            "curves": {spec: [list(p) for p in points] for spec, points in self.curves.items()},
            "validation": self.validation,
        }


def run_profile(records: list[TraceRecord], config: EngineConfig, devices: Devices, *, slo_ttft: float,
                slo_tbt: float, top_k: int = 3, num_requests: int = DEFAULT_NUM_REQUESTS, arrivals: str = "trace",
                options: MachineOptions = MachineOptions(), setup: SimSetup | None = None,
                progress: Callable[[int, int, str], None] | None = None, show_progress: bool = True,
                probe: MachineProbe | None = None, processes: int | None = None,
                also: tuple[tuple[str, ...], ...] = (), max_requests: int | None = None) -> Profile:
    """Measure (or load) this machine's numbers and rank every deployment of ``devices``;
    ``probe``: measure on that instance of the model (left open); ``processes``: how many
    the averaging over recent speeds may run in (``Profile.average_over_speeds``); ``also``:
    deployments bisected to their goodput (and averaged) even where the search left them out;
    ``max_requests``: replay up to that many requests per rate where ``num_requests`` cannot
    tell the best deployments apart."""
    workload = Workload.from_records(records)
    config = replace(config, slo=replace(config.slo, ttft=slo_ttft, tbt=slo_tbt))
    if setup is None:
        setup = machine_setup(config, devices, options, show_progress=show_progress, probe=probe)
    planner = Planner(setup, workload, slo_ttft=slo_ttft, slo_tbt=slo_tbt, num_requests=num_requests,
                      arrivals=arrivals, seed=config.seed, max_requests=max_requests)
    result = planner.search(len(devices), top_k, progress=progress)
    for roles in also:
        ev = next((e for e in result.evaluations if e.roles == tuple(roles)), None)
        if ev is not None and ev.goodput is None:
            planner.bisect(ev)
    if also:
        result.rerank(planner.rank_key)
    profile = Profile(workload, devices, setup, slo_ttft, slo_tbt, planner, result)
    if len(setup.speed_sample) > 1:
        start = time.perf_counter()
        what = f"the ranked deployments at {len(setup.speed_sample)} recent speeds"
        profile.average_over_speeds(processes=processes,
                                    progress=None if progress is None else lambda done, n: progress(done, n, what))
        result.seconds += time.perf_counter() - start
    return profile


def attainment_curves(profile: Profile, top_k: int, points: int = 10) -> dict[str, list[tuple[float, float]]]:
    """SLO attainment against rate for the top deployments, from 20% to 150% of the best goodput."""
    best = profile.result.best.goodput or profile.workload.mean_rate
    rates = [best * (0.2 + 1.3 * i / (points - 1)) for i in range(points)]
    curves = {e.spec: profile.planner.sweep(e.roles, rates) for e in profile.result.ranked[:top_k]}
    profile.curves = curves
    return curves


def plot_curves(profile: Profile, path: str | Path, title: str) -> None:
    """SLO attainment against request rate per deployment, with the 90% line (Figure 9 of the paper)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for spec, points in profile.curves.items():
        ax.plot([r for r, _ in points], [100 * a for _, a in points], marker="o", label=spec)
    ax.axhline(90, color="grey", linestyle="--", linewidth=1, label="90% SLO attainment")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%), simulated")
    ax.set_ylim(0, 105)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower left", fontsize="small")
    ax.set_title(title, fontsize="medium")
    fig.tight_layout()
    try:
        fig.savefig(path, format="png")
    except OSError as e:
        raise ConfigError(f"cannot write plot {path}: {e.strerror}") from None


@dataclass(frozen=True)
class PlannedDeployment:
    """``--deploy auto``'s pick on one set of devices."""

    spec: str
    reason: str
    goodput: float  # simulated, req/s
    # At the replay's ceiling (``Planner.max_rate``): the goodput is only known to be at least that.
    lower_bound: bool = False


def plan_deployment(records: list[TraceRecord], config: EngineConfig, devices: Devices, *,
                    num_requests: int = DEFAULT_NUM_REQUESTS, options: MachineOptions = MachineOptions(),
                    probe: MachineProbe | None = None) -> PlannedDeployment:
    """``--deploy auto``: the planner's pick for ``config``'s SLO, and one line on why;
    ``probe``: measured on that one (``MachineProbe.for_devices``), else on one of its own."""
    slo: SLOConfig = config.slo
    default = ("EPD",) * len(devices)
    profile = run_profile(records, config, devices, slo_ttft=slo.ttft, slo_tbt=slo.tbt, top_k=1,
                          num_requests=num_requests, options=options, show_progress=True, also=(default,),
                          probe=None if probe is None else probe.for_devices(devices),
                          max_requests=MAX_PLAN_REQUESTS)
    best = profile.result.best
    reason = profile.pick_reason(len(records))
    return PlannedDeployment(best.spec, reason, best.goodput, at_ceiling(best.goodput, profile.planner.max_rate))
