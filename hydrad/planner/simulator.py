"""A discrete-event replay of a workload against a deployment, on the live system's own code.

Every instance is the engine's real ``Scheduler`` over real ``BlockManager``s, filled by
its latency model up to its role's bound exactly as a worker fills its steps; requests
enter through the cluster's real ``Router`` and move between instances through the real
``MigrationRelay`` (offers built by ``migration.offer_for``, rebuilt on the target by
``Request.from_offer``). Only the model and the pipes are replaced:

* a step takes the work the instance's latency model predicts for it (times the speed
  measured on the machine against the model now, ``SimSetup.speeds``, plus a fixed
  per-step overhead), done at a speed that changes whenever another step starts or ends:
  slower while more CPU threads are busy than there are cores (the workers' torch threads,
  and the daemon's Request Processor while it prepares a request: it runs on the same
  cores), and by each kind of work's measured slowdown while another step runs on the
  other cores (``SimSetup.corun_slowdown``: shared caches and memory bandwidth), or, for
  an instance whose own threads take every core, at every step (``all_cores_slowdown``:
  its threads wait for the one the daemon or a client took a core from), and while the
  Request Processor or the clients want a core, by all of it (``team_waits``). Each
  CPU instance runs on the threads the live deployment gives it, with its model at that
  count: its share, and an instance that borrows idle cores more while the
  instances it borrows from have no work and no message on its way (``engine.cores``;
  ``SimInstance.lends_no_core``). A borrower's step is filled by the model at the count
  of its start and then follows its lenders, as the worker re-picks its threads between
  operations: it runs at the speed of its share while a lender has work, and of the borrowed
  count while none has. As a worker's engine, an instance whose steps that carry decodes
  run longer than predicted (slowed by the others) fills them to less of its bound
  (``latency_model.Calibration``, the same rule on the virtual clock);
* a message between the daemon and a worker (a new request, a migration hand-off, a
  release, a step's tokens) takes ``message_seconds``; a pull's copy takes its bytes
  over the measured copy bandwidth, on one copy thread per instance;
* the daemon's Request Processor prepares requests (template, tokenizer, images)
  ``processor_threads`` at a time, each for its service time, first come first served.

The loop of each simulated instance is the worker's: messages that arrive during a step
are taken after it; a step collects the copies finished since the last one, admits and
starts pulls (waiting for them when they are quick, as ``EngineCore._pull_first``),
schedules, starts this step's pulls, runs, then reports its tokens, offers and finished
pulls. A request's first token therefore comes from the step that samples it, and a
pulled request runs in the step that waited for its copy or the step after the one its
copy overlapped, as in the live system.

A run can stop as soon as so many requests have missed the SLO that the attainment
target is out of reach (``stop_below``): failing rates of a goodput search then cost a
fraction of a full replay. Requests sampled with ``ignore_eos`` run to their recorded
output length, so the replay needs no model and no tokens.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from copy import deepcopy
from dataclasses import dataclass, field, replace

from hydrad.cluster.relay import MigrationRelay
from hydrad.cluster.router import Router
from hydrad.config import SchedulerConfig, SLOConfig
from hydrad.engine.block_manager import BlockManager
from hydrad.engine.cores import CpuThreads, cpu_threads
from hydrad.engine.inputs import EngineRequest, ImageInput
from hydrad.engine.latency_model import (
    KINDS, LANGUAGE_TERMS, VISION_TERMS, Calibration, LatencyModel, StepShape, at_threads, handoff_wait, idle_bound,
    latency_bound,
)
from hydrad.engine.migration import MigrationOffer, Pulled, offer_for, quick_pull_seconds
from hydrad.engine.request import Request
from hydrad.engine.scheduler import Scheduler
from hydrad.sampling_params import SamplingParams

# A token no replayed request stops on (they ignore EOS and have no stop ids).
_TOKEN = 1


@dataclass(frozen=True)
class SimRequest:
    """One request to replay: when it reaches the daemon, and what it holds."""

    arrival: float  # seconds from the start of the run
    num_prompt_tokens: int  # image tokens included
    num_output_tokens: int
    # (offset in the prompt, tokens, patches[, attention span]) per image
    images: tuple[tuple[int, ...], ...] = ()
    # Seconds from reading the HTTP request to handing it to an instance (chat template,
    # tokenizer, image decoding): counted in its TTFT, as a client measures it.
    preprocess: float = 0.0
    # Prompt tokens its prefill found in a prefix cache when it was traced: the instance that
    # prefills it starts after them (``Scheduler.replay_cached``).
    cached_tokens: int = 0
    # It asks for its prompt's log-probabilities: its prefill chunks price every position.
    prompt_logprobs: bool = False
    # One of a prompt's ``n`` completions: the index of the group's first request (its
    # ``EngineRequest.group`` is that one's id), None for a prompt's only completion. The
    # router places a group together, and the completions that found the prompt cached when
    # traced wait for the one computing it (``Scheduler.replay_cached``).
    group: int | None = None


@dataclass(frozen=True)
class InstanceLayout:
    """The pools of one instance of a role (the engine splits its memory by role)."""

    num_kv_blocks: int
    num_image_blocks: int


@dataclass(frozen=True)
class SimSetup:
    """How this machine runs instances: everything the replay needs besides the deployment."""

    # The vision+language latency model of an instance (``role_model`` keeps a role's parts).
    model: LatencyModel
    layouts: dict[str, InstanceLayout]  # by role
    kv_block_size: int
    image_block_size: int
    kv_block_bytes: int
    image_block_bytes: int
    max_model_len: int
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    slo: SLOConfig = field(default_factory=SLOConfig)  # the step bounds come from it
    router_policy: str = "round-robin"
    bandwidth: float = 3e9  # bytes per second of a pull's copy
    message_seconds: float = 0.0  # one message between the daemon and a worker
    step_overhead: float = 0.0  # seconds per step beyond the model's prediction
    # CPU: cores the instances share and each instance's share of torch threads; None: one
    # device each. Instances that borrow idle cores run on more (``engine.cores``).
    cores: int | None = None
    threads: int = 1
    # Vision+language models measured at other thread counts than ``threads`` (``model``'s),
    # by count; a borrower's model is interpolated from them (``latency_model.at_threads``).
    thread_models: dict[int, LatencyModel] = field(default_factory=dict)
    # Whether the scheduler fills steps by the model ([scheduler] derive_budgets), or only
    # by the token and image caps.
    fill_by_model: bool = True
    # Requests the daemon's Request Processor prepares at a time, first come first served
    # (None: no queue). Its threads ([server] processor_threads) work on several requests
    # at once but share the daemon's interpreter lock and cores: one at a time models it.
    processor_threads: int | None = 1
    # How many times its model's prediction a step takes on this machine now, by thread count
    # (``machine_speed.measure_speed``; 1 where absent). Steps are filled by the model, as the
    # workers fill them, and take this much longer.
    speeds: dict[int, float] = field(default_factory=dict)
    # The same per kind of work where the check timed each kind (``machine_speed.Speed.parts``:
    # ``"images"``, ``"prefills"``, ``"decodes"``), by thread count: a step's vision, prefill
    # and decode terms each take their kind's factor (``LatencyModel.scaled_parts``); a kind
    # not timed takes the count's ``speeds`` factor. Empty: one factor per count.
    part_speeds: dict[int, dict[str, float]] = field(default_factory=dict)
    # How ``speeds`` came about, by thread count (``profile.planning_speeds``): reported, not
    # replayed.
    speed_basis: dict[int, dict] = field(default_factory=dict)
    # The speed checks a profile averages each ranked deployment's goodput over
    # (``profile.planning_speeds``: ``machine_speed.Speed`` by thread count, each): the
    # planner's, not replayed as such (each is replayed as a setup of its own).
    speed_sample: tuple = ()
    # The spread of step times around that: each step's time is multiplied by exp(N(0, s))
    # (s the standard deviation of log(measured / predicted); 0: steps take exactly their
    # time). Queues grow with it: a slow step lets requests gather for the next.
    step_noise: float = 0.0
    # How that spread runs in time: each step's log factor is this times the same instance's
    # previous step's plus the rest drawn anew (an AR(1) process with the spread of
    # ``step_noise``). 0: every step draws anew. Live steps run slow in stretches (the
    # machine's other tenants, the daemon's own bursts): stretches let requests gather.
    noise_correlation: float = 0.0
    # A borrower's speed on borrowed threads (while its lenders are idle) as a share of its
    # model's at that count: the lenders' steps start again within a borrowed operation and
    # share the lent core with it, and the instances share caches and memory bandwidth
    # (``bench/borrow_speed.py``; at most the speed of its own share).
    borrow_efficiency: float = 1.0
    # CPU: how much longer each kind of work (``"images"``, ``"prefills"``, ``"decodes"``)
    # takes while another instance's step runs on the other cores: they share the caches and
    # the memory bandwidth (``bench/corun_speed.py``; a kind absent: no slowdown). A step
    # takes the mean of its kinds' factors, weighted by their predicted time.
    corun_slowdown: dict[str, float] = field(default_factory=dict)
    # CPU: the same for an instance whose own threads take every core (one worker on the
    # whole machine), at every step: the daemon's and the clients' threads take a core
    # from one of its threads now and then, and its other threads wait for that one at
    # each operation's end (a one-thread step beside them only shares a core). Applied
    # instead of ``corun_slowdown``, which such an instance never meets.
    all_cores_slowdown: dict[str, float] = field(default_factory=dict)
    # CPU: how an instance whose threads take every core slows while more threads want the
    # cores than there are (the Request Processor's, the clients', another step's): True, as a
    # team that waits for its slowest thread at each operation's end (each thread's worth of
    # extra load stretches the whole step: 1 + extra); False, as threads that share the cores
    # evenly (load / cores).
    team_waits: bool = False
    # CPU: seconds of CPU the clients spend per request on the same cores (a benchmark's
    # client on the measured machine, ``BenchResult.client_cpu_per_request``; 0: clients run
    # elsewhere, as in production). Taken as a steady load of this times the replay's
    # arrival rate threads.
    client_seconds: float = 0.0
    # Requests of a warm-up replay run before the counted one (the first ones of the same
    # replay): each instance then starts calibrated as a worker that has served them
    # (``latency_model.Calibration``: steps that carry decodes filled by how they ran), as
    # the instances of a daemon that has been serving do. 0: every instance starts cold, as
    # a freshly started daemon's, whose first steps are filled to the model's bound.
    warm_requests: int = 0
    # A step's language work runs after its vision work on the same thread (no dual streams):
    # a request may start its prefill in the step that encodes its last images
    # (``Scheduler.prefill_after_encode``).
    prefill_after_encode: bool = False

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or self.message_seconds < 0 or self.step_overhead < 0:
            raise ValueError("bandwidth must be > 0, message and step overheads >= 0")
        if any(not math.isfinite(f) or f <= 0 for f in
               (*self.speeds.values(), *(f for parts in self.part_speeds.values() for f in parts.values()))):
            raise ValueError(f"speeds must be finite and > 0, got {self.speeds}, {self.part_speeds}")
        if not 0.0 < self.borrow_efficiency <= 1.0:
            raise ValueError(f"borrow_efficiency must be in (0, 1], got {self.borrow_efficiency}")
        for name in ("corun_slowdown", "all_cores_slowdown"):
            if any(not 0.0 <= f < 1.0 for f in getattr(self, name).values()):
                raise ValueError(f"{name} must be in [0, 1) per kind, got {getattr(self, name)}")
        if not 0.0 <= self.client_seconds < 1.0:
            raise ValueError(f"client_seconds must be in [0, 1), got {self.client_seconds}")
        if self.warm_requests < 0:
            raise ValueError(f"warm_requests must be >= 0, got {self.warm_requests}")
        if not 0.0 <= self.step_noise < 2.0:
            raise ValueError(f"step_noise must be in [0, 2), got {self.step_noise}")
        if not 0.0 <= self.noise_correlation < 1.0:
            raise ValueError(f"noise_correlation must be in [0, 1), got {self.noise_correlation}")

    def speed(self, threads: int) -> float:
        """The factor at ``threads`` (at the nearest count measured)."""
        if not self.speeds:
            return 1.0
        return self.speeds[min(self.speeds, key=lambda n: (abs(n - threads), n))]

    def at_speed(self, model: LatencyModel, threads: int) -> LatencyModel:
        """``model`` (on ``threads`` threads) as its steps run on the machine now: per kind of
        work where the check timed the kinds, else at the count's one factor."""
        if not self.part_speeds:
            return model.scaled(self.speed(threads))
        parts = self.part_speeds[min(self.part_speeds, key=lambda n: (abs(n - threads), n))]
        whole = self.speed(threads)
        return model.scaled_parts(*(parts.get(kind, whole) for kind in KINDS))


def step_shape(out, scheduler: Scheduler) -> StepShape:
    """The latency model's features of a step ``scheduler`` scheduled (a recomputed
    request's last prompt token is a prefill, not a decode)."""
    decodes, prefills, priced = [], [], 0
    decoding = scheduler.decoding
    for req, n in out.chunks:
        if req.req_id in decoding:
            decodes.append(req.num_computed_tokens + 1)
        else:
            prefills.append((req.num_computed_tokens, n))
            if req.prompt_logprobs is not None:
                priced += n
    images = [(req.images[i].num_patches, req.images[i].length, req.images[i].attention_span) for req, i in out.encodes]
    return StepShape.of(images=images, prefills=prefills, decodes=decodes, priced=priced)


def role_model(model: LatencyModel, role: str) -> LatencyModel:
    """The parts of a vision+language model that an instance of ``role`` runs."""
    drop = () if "E" in role else VISION_TERMS
    if "P" not in role and "D" not in role:
        drop += LANGUAGE_TERMS
    return replace(model, **{name: 0.0 for name in drop}) if drop else model


@dataclass
class RequestTiming:
    """What a client would have measured for one replayed request."""

    arrival: float
    num_output_tokens: int
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    last: float = 0.0
    done: bool = False
    # Known to miss the SLO (before it finished, when its TTFT deadline passed unserved).
    missed: bool = False

    def meets(self, slo_ttft: float, slo_tbt: float) -> bool:
        if self.missed or self.ttft is None or self.ttft > slo_ttft:
            return False
        return tbt_p90(self.gaps) <= slo_tbt


def tbt_p90(gaps: list[float]) -> float:
    """The 90th percentile of a request's gaps, as ``hydrad.bench.metrics.percentile``
    (linear interpolation); 0 without gaps."""
    if not gaps:
        return 0.0
    ordered = sorted(gaps)
    pos = (len(ordered) - 1) * 0.9
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class SimResult:
    roles: list[str]
    requests: list[RequestTiming]
    num_met: int
    # True when the run stopped as soon as the attainment target was out of reach: the
    # attainment is then an upper bound on what the whole run would reach, and below target.
    stopped_early: bool
    duration: float  # virtual seconds from the first arrival to the last event
    busy: list[float]  # virtual seconds each instance spent in steps
    num_steps: int

    @property
    def attainment(self) -> float:
        return self.num_met / len(self.requests) if self.requests else 0.0

    def utilization(self) -> list[float]:
        return [b / self.duration if self.duration > 0 else 0.0 for b in self.busy]


class SimInstance:
    """One instance as the router and the relay see it, stepping on the virtual clock."""

    def __init__(self, sim: Simulation, instance_id: int, role: str, threads: CpuThreads):
        setup = sim.setup
        layout = setup.layouts[role]
        has_kv = "P" in role or "D" in role
        has_images = "E" in role or "P" in role
        kv = BlockManager(layout.num_kv_blocks, setup.kv_block_size, "kv") if has_kv else None
        images = BlockManager(layout.num_image_blocks, setup.image_block_size, "image") if has_images else None
        self.sim = sim
        self.instance_id = instance_id
        self.role = role
        self.alive = True
        self.accepting = True
        self.threads = threads
        models = {setup.threads: setup.model, **setup.thread_models}
        # By thread count: its share and, when it borrows, the count it borrows up to.
        self.models = {n: role_model(at_threads(models, n), role) for n in {threads.own, threads.most}}
        # The same as its steps run on the machine now (``SimSetup.at_speed``).
        self.run_models = {n: setup.at_speed(m, n) for n, m in self.models.items()}
        self.step_threads = threads.own  # of the step under way, or the last one
        self.model = self.models[threads.own]
        # Its own threads take every core: each step slows by this (``SimSetup.all_cores_slowdown``),
        # and as a team while other threads want the cores (``SimSetup.team_waits``).
        self.whole_machine = setup.cores is not None and 1 < setup.cores <= threads.own
        self.all_cores_slowdown = setup.all_cores_slowdown if self.whole_machine else {}
        self.scheduler = Scheduler(setup.scheduler, kv, images, setup.max_model_len, role=role,
                                   clock=lambda: sim.now, replay_cached=True,
                                   prefill_after_encode=setup.prefill_after_encode)
        # As the engine's: steps that carry decodes and run longer than predicted (the cores
        # shared) are filled to less of the bound; a new model starts it anew (``_use``).
        self.calibration = Calibration()
        self._use(threads.own)
        self.running = False  # in a step (or waiting on a copy)
        self.stalled = False
        self.inbox: list[tuple[int, object]] = []  # messages that arrived during a step
        self.copies: list[tuple[float, object]] = []  # (done time, Pull) on the copy thread
        self.copier_free = 0.0
        self.pulled: list[Pulled] = []
        self.busy = 0.0
        self.num_steps = 0
        self.log_noise = 0.0  # its last step's log time factor (``SimSetup.noise_correlation``)
        self.messages_on_the_way = 0  # sent by the daemon, not yet delivered

    def warm_from(self, other: SimInstance) -> None:
        """Start with the calibration ``other`` (this instance in a warm-up replay) ended with,
        when it ended on the model this one starts on (a new model starts uncalibrated)."""
        if self.sim.setup.fill_by_model and other.step_threads == self.step_threads:
            self.calibration = deepcopy(other.calibration)
            self.scheduler.set_calibration(self.calibration.factor, self.calibration.guard_factor)

    def _use(self, threads: int) -> None:
        """Step on ``threads`` threads, with the model at that count (the worker's ``StepThreads``)."""
        self.step_threads, self.model = threads, self.models[threads]
        if self.sim.setup.fill_by_model:
            if self.model is not self.scheduler.latency_model:  # a new model starts uncalibrated
                self.calibration = Calibration()
                self.scheduler.set_calibration(1.0)
            # As EngineCore.set_latency_model: a step without decodes takes the TTFT share.
            setup = self.sim.setup
            self.scheduler.set_latency_model(self.model, latency_bound(setup.slo, self.role),
                                             idle_bound=idle_bound(setup.slo), handoff_wait=handoff_wait(setup.slo)
                                             if setup.scheduler.handoff_backpressure else None)

    @property
    def has_work(self) -> bool:
        """What the worker publishes for the instances that borrow its cores."""
        return self.running or (not self.stalled and self.scheduler.has_work())

    @property
    def lends_no_core(self) -> bool:
        """Whether a borrower starting a step now finds this lender busy: it has work, or a
        message is on its way to it. Live, a message (pipe, daemon, pipe: about a millisecond)
        reaches the lender, which publishes its work, before the borrower that caused it (its
        step's offers) has taken its own new requests and picked its threads: a P or EP
        instance's step that hands KV to a D instance is followed by one on its own share."""
        return self.has_work or self.messages_on_the_way > 0

    def threads_now(self) -> int:
        """The threads a borrower may run on at this moment (its share for any other)."""
        t = self.threads
        if not t.borrow or any(self.sim.instances[i].lends_no_core for i in t.lenders):
            return t.own
        return t.most

    # -- the relay's and the router's Instance interface --------------------------------------
    @property
    def num_inflight(self) -> int:
        return self.sim.relay.held_by(self)

    def migrate(self, offer: MigrationOffer) -> None:
        self.sim.send(self, _MIGRATE, offer)

    def release(self, req_ids: tuple[str, ...]) -> None:
        self.sim.send(self, _RELEASE, req_ids)

    def abort(self, req_ids: tuple[str, ...]) -> None:
        self.sim.send(self, _ABORT, req_ids)

    # -- the worker loop ------------------------------------------------------------------------
    def receive(self, kind: int, payload) -> None:
        self.inbox.append((kind, payload))
        if not self.running:
            # An idle worker takes every message that is there before it steps: wake it
            # after the other events of this instant.
            self.running = True
            self.sim.at(self.sim.now, _WAKE, self, None)

    def _apply(self, kind: int, payload) -> None:
        s = self.scheduler
        if kind == _ADD:
            s.add(payload)
        elif kind == _MIGRATE:
            s.add(Request.from_offer(payload))
        elif kind == _RELEASE:
            for req_id in payload:
                s.release(req_id)
        else:
            for req_id in payload:
                s.abort(req_id)
        self.stalled = False

    def start_step(self) -> None:
        """Begin the next step if there is anything to do (the engine's ``step``)."""
        sim, s, now = self.sim, self.scheduler, self.sim.now
        if self.copies:
            still = []
            for done, pull in self.copies:
                if done <= now:
                    aborted = pull.req.finish_reason == "abort"
                    s.finish_pull(pull.req)
                    if not aborted:
                        self.pulled.append(Pulled(pull.req.req_id, pull.source))
                else:
                    still.append((done, pull))
            self.copies = still
        if s.incoming and self._pull_first():
            return
        if not self.copies and (self.stalled or not s.has_work()):
            self._report()
            return
        t = self.threads
        if t.borrow and (n := self.threads_now()) != self.step_threads:
            self._use(n)
        out = s.schedule()
        for pull in out.pulls:
            start = max(now, self.copier_free)
            self.copier_free = start + sim.copy_seconds(pull)
            self.copies.append((self.copier_free, pull))
        if not out.encodes and not out.chunks:
            # Nothing runnable: the engine waits for a copy, or stalls until a message.
            if not self.copies:
                self.stalled = True
            self._report()
            if self.copies:
                self.running = True
                sim.at(min(done for done, _ in self.copies), _WAKE, self, None)
            return
        setup = sim.setup
        shape = None
        if setup.fill_by_model and not setup.part_speeds:
            # One factor: the fill's own prediction, scaled (no need to rebuild the step's shape).
            seconds = self.model.combine(out.predicted_vision, out.predicted_language) * setup.speed(self.step_threads)
        else:
            shape = step_shape(out, self.scheduler)
            seconds = self.run_models[self.step_threads].step_seconds(shape)
        overhead = setup.step_overhead
        noise = sim.step_noise(self)
        alone = {self.step_threads: seconds * noise + overhead}
        if t.borrow:
            # It follows its lenders within the step: its time alone at the other count too.
            other = t.own if self.step_threads != t.own else t.most
            shape = shape or step_shape(out, self.scheduler)
            alone[other] = self.run_models[other].step_seconds(shape) * noise + overhead
            # Borrowed stretches run at a share of the borrowed count's speed, never below the own.
            alone[t.most] = min(alone[t.own], alone[t.most] / setup.borrow_efficiency)
        if self.all_cores_slowdown:
            whole = corun_factor(self.all_cores_slowdown, out)
            alone = {n: seconds * whole for n, seconds in alone.items()}
        self.running = True
        self.num_steps += 1
        sim.start(self, out, alone, corun_factor(setup.corun_slowdown, out))

    def _pull_first(self) -> bool:
        """As ``EngineCore._pull_first``: start the pulls admitted ahead of the step; True when
        the step waits for them (they are quick and the copier was idle)."""
        sim, s = self.sim, self.scheduler
        idle = not self.copies
        pulls = s.admit_pulls()
        for pull in pulls:
            start = max(sim.now, self.copier_free)
            self.copier_free = start + sim.copy_seconds(pull)
            self.copies.append((self.copier_free, pull))
        if not pulls or not idle or s.latency_model is None:
            return False
        if sum(sim.copy_seconds(p) for p in pulls) > quick_pull_seconds(s.latency_bound):
            return False
        self.running = True
        sim.at(self.copier_free, _WAKE, self, None)
        return True

    def end_step(self, out, seconds: float) -> None:
        """The step ``out`` ended after ``seconds`` on the virtual clock."""
        sim, s = self.sim, self.scheduler
        if out.num_decodes and sim.setup.fill_by_model:
            # As EngineCore._calibrate (its time excludes building the step).
            predicted = self.model.combine(out.predicted_vision, out.predicted_language)
            if self.calibration.add(predicted, seconds - sim.setup.step_overhead):
                s.set_calibration(self.calibration.factor, self.calibration.guard_factor)
        if out.encodes:
            s.update_after_encode(out)
        if out.chunks:
            sampled = [_TOKEN for r, n in out.chunks if r.num_computed_tokens + n == r.num_tokens]
            result = s.update_after_language(out, sampled)
            sim.deliver(result.req_ids, result.finished)
        self._report()
        self.wake()

    def wake(self, _=None) -> None:
        self.running = False
        for kind, payload in self.inbox:
            self._apply(kind, payload)
        self.inbox.clear()
        self.start_step()

    def _report(self) -> None:
        """What a worker sends after a step: its offers and its finished pulls."""
        relay = self.sim.relay
        if self.pulled:
            pulled, self.pulled = self.pulled, []
            for p in pulled:
                relay.on_pulled(self, p)
        if self.scheduler.new_offers:
            offers = [offer_for(req, kind, self.instance_id) for req, kind in self.scheduler.new_offers]
            self.scheduler.new_offers.clear()
            for offer in offers:
                relay.on_offer(self, offer)


@dataclass
class _Step:
    """A step under way: what is left of it, at the speed it runs now."""

    instance: SimInstance
    out: object
    alone: dict[int, float]  # seconds alone on enough cores, by the thread count it runs on
    processor: float  # share of the Request Processor's thread over the step, taken at its start
    started: float
    updated: float
    left: float = 1.0  # share of its work still to do
    seconds: float = 0.0  # its whole length at the speed it runs now
    token: int = 0
    corun: float = 1.0  # how many times as long while another step runs (SimSetup.corun_slowdown)

    @property
    def threads(self) -> int:
        """The threads it runs on now: a borrower's follow its lenders."""
        return self.instance.threads_now() if len(self.alone) > 1 else next(iter(self.alone))


def corun_factor(slowdown: dict[str, float], out) -> float:
    """How many times as long the step ``out`` takes at ``slowdown`` per kind of work (while
    another step runs: ``SimSetup.corun_slowdown``; on every core: ``all_cores_slowdown``),
    its kinds' factors weighted by their predicted time."""
    work = out.predicted_vision + out.predicted_language
    if not slowdown or work <= 0.0:
        return 1.0
    decodes = out.predicted_language - out.predicted_prefill
    extra = (out.predicted_vision * slowdown.get("images", 0.0) + out.predicted_prefill * slowdown.get("prefills", 0.0)
             + decodes * slowdown.get("decodes", 0.0))
    return 1.0 + extra / work


# Event kinds.
_ARRIVE, _DELIVER, _STEP_END, _WAKE = range(4)
# Message kinds.
_ADD, _MIGRATE, _RELEASE, _ABORT = range(4)


class Simulation:
    """One replay of ``requests`` (sorted by arrival) against ``roles`` (one per instance)."""

    def __init__(self, setup: SimSetup, roles: list[str], requests: list[SimRequest], *,
                 slo_ttft: float, slo_tbt: float, stop_below: float | None = None):
        self.setup = setup
        self.now = 0.0
        self.steps: dict[SimInstance, _Step] = {}  # the steps under way, by instance
        self._tokens = 0
        self._events: list = []
        self._seq = 0
        threads = (cpu_threads(roles, setup.cores, share=setup.threads) if setup.cores is not None
                   else [CpuThreads(setup.threads)] * len(roles))
        self.instances = [SimInstance(self, i, role, n) for i, (role, n) in enumerate(zip(roles, threads))]
        # A recorded request has shapes, not content: no prefix is known to repeat, and the
        # cache-aware router then sends each where least-load would.
        policy = "least-load" if setup.router_policy == "cache-aware" else setup.router_policy
        self.router = Router(self.instances, policy, seed=0)
        self.relay = MigrationRelay(self.router)
        self.requests = sorted(requests, key=lambda r: r.arrival)
        self.slo_ttft, self.slo_tbt = slo_ttft, slo_tbt
        self.timings: dict[str, RequestTiming] = {}
        n = len(self.requests)
        # Misses allowed before the target attainment is out of reach.
        self._max_missed = n - math.ceil(stop_below * n - 1e-9) if stop_below is not None else n + 1
        self._missed = 0
        self._deadlines: deque[tuple[float, RequestTiming]] = deque()
        self._params: dict[tuple[int, bool], SamplingParams] = {}
        self._pending = 0
        self._copy_seconds = {"kv": setup.kv_block_bytes / setup.bandwidth,
                              "image": setup.image_block_bytes / setup.bandwidth}
        # (start, end) of each request's preparation by the Request Processor, in time order.
        self._processor_busy: list[tuple[float, float]] = []
        # Threads' worth of the clients' CPU on the cores (``SimSetup.client_seconds``).
        self._client_threads = 0.0
        self._processor_next = 0
        self._noise = random.Random(0) if setup.step_noise > 0 else None  # the same draws every replay

    def step_noise(self, instance: SimInstance) -> float:
        """The factor of ``instance``'s next step's time (``SimSetup.step_noise``,
        ``SimSetup.noise_correlation``)."""
        if self._noise is None:
            return 1.0
        rho = self.setup.noise_correlation
        draw = self._noise.gauss(0.0, self.setup.step_noise)
        if rho:
            draw = instance.log_noise = rho * instance.log_noise + math.sqrt(1.0 - rho * rho) * draw
        return math.exp(draw)

    # -- the clock --------------------------------------------------------------------------------
    def at(self, time: float, kind: int, target, payload) -> None:
        self._seq += 1
        heapq.heappush(self._events, (time, self._seq, kind, target, payload))

    def send(self, instance: SimInstance, kind: int, payload) -> None:
        """A message from the daemon to a worker."""
        instance.messages_on_the_way += 1
        self.at(self.now + self.setup.message_seconds, _DELIVER, instance, (kind, payload))

    # -- steps sharing the cores ------------------------------------------------------------------
    def start(self, instance: SimInstance, out, alone: dict[int, float], corun: float = 1.0) -> None:
        """Begin ``instance``'s step, of ``alone`` seconds by thread count when nothing else
        runs (``corun`` times as long while another step runs); it ends when its work is done
        at the speeds it gets while other steps start and end and, for a borrower, while its
        lenders get and finish work (``_retime``)."""
        length = alone[instance.step_threads]
        processor = self._processor_share(self.now, self.now + length) if self.setup.cores is not None else 0.0
        self.steps[instance] = _Step(instance, out, alone, processor, self.now, self.now, corun=corun)

    def end(self, instance: SimInstance, token: int):
        """The step's output and its length when ``token`` is its current end, else None (a
        stale end event)."""
        step = self.steps.get(instance)
        if step is None or step.token != token:
            return None
        del self.steps[instance]
        instance.busy += self.now - step.started
        return step.out, self.now - step.started

    def _retime(self) -> None:
        """After each event (steps may have started or ended, a lender may have got or
        finished its work): every step under way goes on at its new speed."""
        now = self.now
        for instance, step in self.steps.items():
            if step.seconds > 0.0:
                step.left = max(0.0, step.left - (now - step.updated) / step.seconds)
            step.updated = now
            seconds = self._seconds(step)
            if seconds != step.seconds:
                step.seconds = seconds
                self._tokens += 1
                step.token = self._tokens
                self.at(now + step.left * seconds, _STEP_END, instance, step.token)

    def _seconds(self, step: _Step) -> float:
        """How long ``step`` would take as things are now: alone on the threads it runs on,
        slowed while more CPU threads are busy than there are cores (the other steps'
        threads and, for the share of the step it overlaps, the Request Processor's)."""
        threads = step.threads
        alone = step.alone[threads]
        cores = self.setup.cores
        if cores is None:
            return alone
        busy = sum(s.threads for s in self.steps.values() if s is not step)
        load = threads + busy + step.processor + self._client_threads
        if self.setup.team_waits and step.instance.whole_machine:
            return alone * (1.0 + max(0.0, load - cores)) * (step.corun if busy else 1.0)
        return alone * max(1.0, load / cores) * (step.corun if busy else 1.0)

    def _processor_share(self, start: float, end: float) -> float:
        """The fraction of [start, end] the Request Processor is busy (steps start in time order,
        so the intervals before ``start`` are dropped as the clock passes them)."""
        busy, i = self._processor_busy, self._processor_next
        while i < len(busy) and busy[i][1] <= start:
            i += 1
        self._processor_next = i
        if end <= start:
            return 0.0
        overlap = 0.0
        while i < len(busy) and busy[i][0] < end:
            overlap += max(0.0, min(end, busy[i][1]) - max(start, busy[i][0]))
            i += 1
        return min(1.0, overlap / (end - start))

    def copy_seconds(self, pull) -> float:
        return len(pull.src_block_ids) * self._copy_seconds[pull.kind]

    # -- requests ---------------------------------------------------------------------------------
    def _engine_request(self, i: int, spec: SimRequest) -> EngineRequest:
        params = self._params.get((spec.num_output_tokens, spec.prompt_logprobs))
        if params is None:
            params = self._params[spec.num_output_tokens, spec.prompt_logprobs] = SamplingParams(
                max_tokens=spec.num_output_tokens, temperature=0.0, ignore_eos=True,
                prompt_logprobs=0 if spec.prompt_logprobs else None)
        return EngineRequest(f"r{i}", [0] * spec.num_prompt_tokens, params,
                             [ImageInput(None, offset, length, num_patches=patches,
                                         attention_span=span[0] if span else 0)
                              for offset, length, patches, *span in spec.images],
                             group=None if spec.group is None else f"r{spec.group}")

    def _arrive(self, i: int) -> None:
        spec = self.requests[i]
        req = self._engine_request(i, spec)
        timing = RequestTiming(spec.arrival, spec.num_output_tokens)
        self.timings[req.req_id] = timing
        self._deadlines.append((spec.arrival + self.slo_ttft, timing))
        entry = self.router.select(has_images=bool(req.images), request=req)
        self.relay.open(req.req_id, entry)
        request = Request(req)
        if spec.cached_tokens:
            request.num_cached_tokens = spec.cached_tokens
        self.send(entry, _ADD, request)

    def deliver(self, req_ids: list[str], finished: list[Request]) -> None:
        """A step's tokens reach the client one message later."""
        t = self.now + self.setup.message_seconds
        timings = self.timings
        for req_id in req_ids:
            timing = timings[req_id]
            if timing.ttft is None:
                timing.ttft = t - timing.arrival
            else:
                timing.gaps.append(t - timing.last)
            timing.last = t
        for req in finished:
            self.relay.close(req.req_id)
            timing = timings[req.req_id]
            timing.done = True
            self._pending -= 1
            if not timing.missed and not timing.meets(self.slo_ttft, self.slo_tbt):
                timing.missed = True
                self._missed += 1

    def _check_deadlines(self) -> None:
        """Requests still without a first token past their TTFT deadline have missed."""
        deadlines, now = self._deadlines, self.now
        while deadlines and deadlines[0][0] < now:
            _, timing = deadlines.popleft()
            if timing.ttft is None and not timing.missed:
                timing.missed = True
                self._missed += 1

    # -- the run ------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        requests = self.requests
        threads = self.setup.processor_threads
        free = [0.0] * threads if threads else None  # when each processor thread is next free
        processed: dict[int, float] = {}  # a group's first request -> when it was processed
        for i, spec in enumerate(requests):
            if spec.group is not None and spec.group in processed:
                # A prompt's completions are one HTTP request, processed once: live, they are
                # sent together once the prompt is ready.
                ready = max(spec.arrival, processed[spec.group])
            elif free is None:
                ready = spec.arrival + spec.preprocess
            else:
                ready = max(spec.arrival, heapq.heappop(free)) + spec.preprocess
                heapq.heappush(free, ready)
                if spec.preprocess > 0:
                    self._processor_busy.append((ready - spec.preprocess, ready))
            if spec.group == i:
                processed[i] = ready
            self.at(ready, _ARRIVE, None, i)
        self._processor_busy.sort()
        if len(requests) > 1 and self.setup.client_seconds:
            span = requests[-1].arrival - requests[0].arrival
            self._client_threads = self.setup.client_seconds * (len(requests) - 1) / span if span > 0 else 0.0
        self._pending = len(requests)
        events = self._events
        stopped = False
        start = requests[0].arrival if requests else 0.0
        while events:
            time, _, kind, target, payload = heapq.heappop(events)
            self.now = time
            if kind == _STEP_END:
                ended = self.end(target, payload)
                if ended is None:  # the step was re-timed: a later event ends it
                    continue
                target.end_step(*ended)
                self._check_deadlines()
                if self._missed >= self._max_missed:
                    stopped = True
                    break
            elif kind == _DELIVER:
                target.messages_on_the_way -= 1
                target.receive(*payload)
            elif kind == _ARRIVE:
                self._arrive(payload)
            else:
                target.wake()
            self._retime()
        if not stopped and self._pending:
            raise RuntimeError(f"{self._pending} requests never finished: the deployment cannot serve them")
        timings = list(self.timings.values())
        num_met = sum(1 for t in timings if t.done and not t.missed)
        # Requests that never arrived (a run stopped early) count as sent and not met.
        timings += [RequestTiming(r.arrival, r.num_output_tokens, missed=True) for r in requests[len(timings):]]
        return SimResult([i.role for i in self.instances], timings, num_met, stopped, self.now - start,
                         [i.busy for i in self.instances], sum(i.num_steps for i in self.instances))


def simulate(setup: SimSetup, roles: list[str], requests: list[SimRequest], *, slo_ttft: float, slo_tbt: float,
             stop_below: float | None = None) -> SimResult:
    """Replay ``requests`` against one instance per entry of ``roles``; per-request TTFT and
    gaps, and SLO attainment. ``stop_below``: stop as soon as the attainment must end below it."""
    if not roles:
        raise ValueError("a deployment needs at least one instance")
    sim = Simulation(setup, roles, requests, slo_ttft=slo_ttft, slo_tbt=slo_tbt, stop_below=stop_below)
    if setup.warm_requests and setup.fill_by_model and requests:
        # The instances as a daemon's that has served the first requests (``SimSetup.warm_requests``).
        warm = Simulation(setup, roles, sim.requests[: setup.warm_requests], slo_ttft=slo_ttft, slo_tbt=slo_tbt)
        warm.run()
        for instance, warmed in zip(sim.instances, warm.instances):
            instance.warm_from(warmed)
    return sim.run()


__all__ = ["InstanceLayout", "RequestTiming", "SimRequest", "SimResult", "SimSetup",
           "role_model", "simulate", "tbt_p90"]
