"""Every deployment of N instances, ranked by simulated goodput.

A deployment is a multiset of roles (E, P, D, EP, ED, PD, EPD) holding every stage,
written in the canonical order ``E, P, D, EP, ED, PD, EPD`` (``1E+1EP+2D``); N
instances have a few thousand at N = 8. Simulating each one's goodput by bisection
would take minutes, so the search is a branch and bound whose every ranked number still
comes from the simulator:

1. the capacity bound of every deployment (``capacity``: round-robin shares of each
   stage times its cost on the instance's role) orders them, best first;
2. the K best so far are kept. A deployment whose reach (its bound, raised by what a
   replay of finitely many requests can absorb above the sustainable rate, see
   ``Planner.reach``) is below the K-th best goodput cannot enter, nor can any after it:
   the search stops there;
3. otherwise one replay at the K-th best goodput decides whether it can enter; a replay
   stops as soon as 10% of its requests have missed the SLO, so a failing rate costs a
   fraction of a full one. Only deployments that pass are bisected (bracketed by their
   bound) to their goodput.

Goodput is the bench's: the highest rate with >= 90% of the requests meeting the SLO
below the lowest rate that misses it, found by doubling or halving and then bisecting
until the bracket is narrower than ``rel_tol`` (``hydractl bench --goodput``). A replay
of ``num_requests`` tells rates up to ``num_requests / (3 * TTFT)`` only: at higher rates
they all arrive within a few TTFTs, and a deployment that absorbs the burst would pass at
any rate. Goodputs are capped there (raise ``num_requests`` to see further); given
``max_requests``, a search replays as many requests as it takes to tell the highest
capacity bound of its deployments apart, up to that many.
"""

from __future__ import annotations

import itertools
import logging
import math
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Callable

from hydrad.bench.metrics import GOODPUT_ATTAINMENT, goodput
from hydrad.cluster.deploy import format_deploy
from hydrad.engine.cores import usable_cpus
from hydrad.planner.capacity import Capacity, StageCosts, algorithm2, capacity, stage_costs, stage_times
from hydrad.planner.simulator import SimResult, SimSetup, simulate
from hydrad.planner.workload import Workload

# Roles in the order a spec lists them: 1E+1P+1D, 1EP+1D, 1ED+1P, 1E+1EP+2D, 1E+1PD.
ROLE_ORDER = ("E", "EP", "ED", "EPD", "P", "PD", "D")
# Margin on a reach (``Planner.reach``) for what the capacity model leaves out.
SLACK = 1.1
# A replay tells a rate only if its arrivals span this many TTFTs (``Planner.max_rate``).
SPAN = 3.0
# A goodput this close to the replay's ceiling (``Planner.max_rate``, within the bisection's
# 5%) is only known to be at least what it says (``rate_text``).
CEILING_SHARE = 0.95
# The first step of a bracket started from a guess (``Planner.bisect``).
GUESS_STEP = 1.15
# ``--deploy auto``, the re-planner and ``hydractl profile`` (unless told a count) replay up to
# this many requests per rate where fewer cannot tell the best deployments apart
# (``Planner.fit_requests``: a fast machine's rates are past what 300 requests tell at the
# TTFT bound, 300 / (3 TTFT) req/s).
MAX_PLAN_REQUESTS = 2400

logger = logging.getLogger("hydrad.planner")


def at_ceiling(goodput: float, max_rate: float) -> bool:
    """Whether ``goodput`` is at the replay's ceiling ``max_rate``: only known to be at least that."""
    return goodput >= CEILING_SHARE * max_rate


def rate_text(goodput: float, max_rate: float) -> str:
    """``goodput`` in req/s for people, ``>=`` where it is at the replay's ceiling."""
    return f"{'>=' if at_ceiling(goodput, max_rate) else ''}{goodput:.3g}"


def deployments(n: int) -> list[tuple[str, ...]]:
    """Every multiset of ``n`` roles that holds E, P and D, each once, in canonical order."""
    if n < 1:
        raise ValueError("a deployment has at least one instance")
    return [combo for combo in itertools.combinations_with_replacement(ROLE_ORDER, n)
            if all(any(stage in role for role in combo) for stage in "EPD")]


@dataclass
class Evaluation:
    """What the search found out about one deployment."""

    roles: tuple[str, ...]
    bound: Capacity
    # "ranked": goodput bisected; "below": fails at the rate of the K-th best; "pruned":
    # its bound cannot reach the K-th best (never simulated).
    status: str = "pruned"
    goodput: float | None = None
    points: list[tuple[float, float]] = field(default_factory=list)  # (rate, attainment) replayed
    methods: list[str] = field(default_factory=list)  # Algorithm 2's methods that chose it
    trace_attainment: float | None = None  # attainment at the trace's own rate
    utilization: list[float] | None = None  # per instance, at the goodput rate
    # With a speed sample (``profile.Profile.average_over_speeds``): the goodput at each of
    # its checks, and the goodput at the speed the search ran at; ``goodput`` is then their mean.
    goodput_by_speed: list[float] | None = None
    goodput_at_planned_speed: float | None = None

    @property
    def spec(self) -> str:
        return format_deploy(list(self.roles))

    def bottleneck(self, costs: dict[str, StageCosts]) -> str:
        """The busiest instance (simulated at the goodput rate when known) and its main stage."""
        i = self.bound.bottleneck
        if self.utilization:
            i = max(range(len(self.utilization)), key=self.utilization.__getitem__)
        return f"#{i} {self.roles[i]} {self.bound.stage if i == self.bound.bottleneck else _main_stage(costs[self.roles[i]])}"


def _main_stage(c: StageCosts) -> str:
    parts = {"encode": c.encode, "prefill": c.prefill, "decode": c.decode}
    return max(parts, key=parts.get)


@dataclass
class SearchResult:
    n: int
    evaluations: list[Evaluation]  # ranked first (best goodput first), then the rest by bound
    algorithm2: dict[str, tuple[str, ...]]  # method -> its candidate
    num_replays: int
    seconds: float

    @property
    def ranked(self) -> list[Evaluation]:
        return [e for e in self.evaluations if e.status == "ranked"]

    @property
    def best(self) -> Evaluation:
        return self.ranked[0]

    def rerank(self, key: Callable[[Evaluation], tuple]) -> None:
        """Order the ranked evaluations by ``key`` again (their goodput changed), the rest after them."""
        ranked = sorted(self.ranked, key=key)
        self.evaluations = ranked + [e for e in self.evaluations if e.status != "ranked"]

    @property
    def algorithm2_pick(self) -> Evaluation | None:
        """Algorithm 2's candidate with the highest simulated goodput."""
        picks = [e for e in self.evaluations if e.methods and e.goodput is not None]
        return max(picks, key=lambda e: e.goodput) if picks else None


class Planner:
    """Goodput of deployments by replaying ``num_requests`` of ``workload`` in the simulator."""

    def __init__(self, setup: SimSetup, workload: Workload, *, slo_ttft: float, slo_tbt: float,
                 num_requests: int = 200, arrivals: str = "trace", rel_tol: float = 0.05, seed: int = 0,
                 max_requests: int | None = None):
        """``max_requests``: a search may replay up to this many requests where
        ``num_requests`` cannot tell its best deployments apart (``fit_requests``; never
        fewer than ``num_requests``)."""
        if not 0 < rel_tol < 1:
            raise ValueError(f"rel_tol must be in (0, 1), got {rel_tol}")
        self.setup = setup
        self.workload = workload
        self.slo_ttft, self.slo_tbt = slo_ttft, slo_tbt
        self.num_requests = num_requests
        self.max_requests = max_requests
        self.arrivals = arrivals
        self.rel_tol = rel_tol
        self.seed = seed
        self.num_replays = 0
        self.has_images = sum(1 for s in workload.shapes if s.images) / len(workload)
        # The most requests a second the Request Processor prepares: no deployment serves more.
        service = statistics.fmean(s.preprocess for s in workload.shapes)
        threads = setup.processor_threads
        self.processor_rate = threads / service if threads and service > 0 else math.inf
        # At the machine's speed now: what a stage takes, not what the workers fill steps by.
        model = setup.at_speed(setup.model, setup.threads)
        self.costs = {role: stage_costs(model, role, workload, setup.slo, setup.scheduler)
                      for role in ROLE_ORDER}

    def at(self, setup: SimSetup) -> Planner:
        """This planner (workload, SLO, requests per replay, arrivals, tolerance, seed) on ``setup``."""
        return Planner(setup, self.workload, slo_ttft=self.slo_ttft, slo_tbt=self.slo_tbt,
                       num_requests=self.num_requests, arrivals=self.arrivals, rel_tol=self.rel_tol, seed=self.seed,
                       max_requests=self.max_requests)

    # -- one deployment ---------------------------------------------------------------------------
    def replay(self, roles, rate: float, *, early: bool = True) -> SimResult:
        """One replay at ``rate``; ``early``: stop once 90% attainment is out of reach."""
        self.num_replays += 1
        requests = self.workload.requests(rate, self.num_requests, self.arrivals, self.seed)
        return simulate(self.setup, list(roles), requests, slo_ttft=self.slo_ttft, slo_tbt=self.slo_tbt,
                        stop_below=GOODPUT_ATTAINMENT if early else None)

    def stage_times(self) -> tuple[float, float, float]:
        """Algorithm 2's instance-seconds per request of encode, prefill and decode."""
        return stage_times(self.costs, self.has_images)

    def bound(self, roles) -> Capacity:
        return capacity(list(roles), self.costs, self.has_images)

    def reach(self, cap: float) -> float:
        """The highest rate at which a replay could still pass on a deployment that serves
        at most ``cap`` req/s. Above ``cap`` a backlog grows at ``rate - cap``: a request
        arriving ``t`` seconds in waits ``(rate - cap) * t / cap``, so the requests within the
        TTFT are those of the first ``ttft * cap / (rate - cap)`` seconds; for 90% of ``n``
        requests to be among them, ``rate <= cap / (1 - ttft * cap / (0.9 n))``."""
        share = self.slo_ttft * cap / (GOODPUT_ATTAINMENT * self.num_requests)
        return SLACK * cap / (1 - share) if share < 0.9 else float("inf")

    @property
    def max_rate(self) -> float:
        """The highest rate a replay of ``num_requests`` can tell: above it they all arrive
        within ``SPAN`` TTFTs, and a deployment that absorbs the burst would pass at any rate."""
        return self.num_requests / (SPAN * self.slo_ttft)

    def fit_requests(self, rate: float) -> int:
        """Replay enough requests from now on (at most ``max_requests``; never fewer than
        now) that a deployment of capacity bound ``rate`` is told apart from the ceiling: its
        ``reach`` within ``max_rate`` with the bisection's tolerance to spare. With ``n =
        x * TTFT * rate`` requests the reach is ``SLACK * rate / (1 - 1 / (0.9 x))`` and the
        ceiling ``x * rate / SPAN``: ``x >= SPAN * SLACK / (1 - rel_tol) + 1 / 0.9``.
        Returns the requests per replay."""
        if self.max_requests is not None:
            x = SPAN * SLACK / (1 - self.rel_tol) + 1 / GOODPUT_ATTAINMENT
            needed = math.ceil(x * self.slo_ttft * rate)
            grown = min(self.max_requests, max(self.num_requests, needed))
            if grown > self.num_requests:
                logger.info("replaying %d requests per rate, not %d: the best deployments may serve up to %.3g "
                            "req/s, past what %d tell", grown, self.num_requests, rate, self.num_requests)
                self.num_requests = grown
        return self.num_requests

    def rank_key(self, ev: Evaluation) -> tuple[float, float, str]:
        """Best first: by goodput, those at the replay's limit (known only to reach it) as
        equals, then by capacity bound."""
        goodput = self.max_rate if ev.goodput >= (1 - self.rel_tol) * self.max_rate else ev.goodput
        return -goodput, -ev.bound.rate, ev.spec

    def passes(self, ev: Evaluation, rate: float) -> bool:
        if rate > self.max_rate:
            return False  # not resolvable: the goodput is reported as at most max_rate
        attainment = self.replay(ev.roles, rate).attainment
        ev.points.append((rate, attainment))
        return attainment >= GOODPUT_ATTAINMENT

    def bisect(self, ev: Evaluation, known_pass: float | None = None, guess: float | None = None) -> float:
        """The goodput of ``ev``'s deployment; ``known_pass``: a rate it is known to pass;
        ``guess``: a rate near its goodput (the same deployment's at another speed), where the
        bracket starts in steps of ``GUESS_STEP`` that square while they miss it."""
        cap = min(ev.bound.rate, self.max_rate)
        lower, upper = cap / 256, min(cap * 16, self.max_rate)
        lo, hi = known_pass, None
        if known_pass:
            rate, step = max(0.8 * cap, 1.25 * known_pass), 2.0
        elif guess:
            rate, step = max(guess, lower), GUESS_STEP
        else:
            rate, step = 0.6 * cap, 2.0
        rate = min(rate, upper)
        while lo is None or hi is None:
            if self.passes(ev, rate):
                lo = rate
                if rate >= upper:
                    break
                rate = min(rate * step, upper)
            else:
                hi = rate
                if lo is not None or rate <= lower:
                    break
                rate = max(rate / step, lower)
            if step < 2.0:
                step = step * step
        if lo is not None and hi is not None:
            while (hi - lo) / lo > self.rel_tol:
                mid = (lo + hi) / 2
                if self.passes(ev, mid):
                    lo = mid
                else:
                    hi = mid
        ev.status = "ranked"
        ev.goodput = goodput(ev.points) if ev.points else 0.0
        if known_pass and ev.goodput < known_pass:
            ev.goodput = known_pass  # passed there in this very search
        return ev.goodput

    def describe(self, ev: Evaluation) -> None:
        """Attainment at the trace's own rate and utilization at the goodput rate (full replays)."""
        ev.trace_attainment = self.replay(ev.roles, self.workload.mean_rate, early=False).attainment
        if ev.goodput:
            ev.utilization = self.replay(ev.roles, ev.goodput, early=False).utilization()

    # -- the searches -----------------------------------------------------------------------------------
    def search(self, n: int, top_k: int = 3, *, candidates: list[tuple[str, ...]] | None = None,
               progress: Callable[[int, int, str], None] | None = None) -> SearchResult:
        """Rank ``candidates`` (default: every deployment of ``n`` instances) by simulated
        goodput; the ``top_k`` best are exact, the others are known to be worse."""
        start = time.perf_counter()
        replays_before = self.num_replays
        times = self.stage_times()
        a2 = {method: tuple(sorted(roles, key=ROLE_ORDER.index)) for method, roles in algorithm2(n, times).items()}
        pool = candidates if candidates is not None else deployments(n)
        evaluations = {roles: Evaluation(roles, self.bound(roles)) for roles in pool}
        for method, roles in a2.items():
            evaluations.setdefault(roles, Evaluation(roles, self.bound(roles))).methods.append(method)
        order = sorted(evaluations.values(), key=lambda e: -e.bound.rate)
        if order:  # as many requests as tell the best bound, or the Request Processor's rate below it
            self.fit_requests(min(order[0].bound.rate, self.processor_rate))
        top: list[Evaluation] = []  # the best so far, best first
        keep = max(1, top_k)
        for done, ev in enumerate(order):
            last = top[keep - 1] if len(top) >= keep else None
            kth = last.goodput if last is not None else 0.0
            if progress is not None:
                progress(done, len(order), ev.spec)
            if self.reach(ev.bound.rate) <= kth:
                break  # no deployment from here on can enter the top
            if last is not None and self.rank_key(last)[0] == -self.max_rate and ev.bound.rate < last.bound.rate:
                # The top are all at the replay's limit, where equals rank by their capacity
                # bound: from here on (lower bounds) a deployment could only rank below them.
                break
            if kth > 0 and not self.passes(ev, kth):
                ev.status = "below"
                continue
            self.bisect(ev, known_pass=kth or None)
            top.append(ev)
            top.sort(key=self.rank_key)
        # Algorithm 2's candidates are reported with their goodput even when out of the top.
        for ev in evaluations.values():
            if ev.methods and ev.status != "ranked":
                self.bisect(ev)
        ranked = sorted((e for e in evaluations.values() if e.status == "ranked"), key=self.rank_key)
        picks = [e for e in ranked if e.methods]
        for ev in ranked[:keep] + [e for e in picks[:1] if e not in ranked[:keep]]:
            self.describe(ev)
        rest = [e for e in order if e.status != "ranked"]
        if progress is not None:
            progress(len(order), len(order), "done")
        return SearchResult(n, ranked + rest, a2, self.num_replays - replays_before, time.perf_counter() - start)

    def sweep(self, roles, rates: list[float]) -> list[tuple[float, float]]:
        """Attainment at each rate (full replays), for plots."""
        return [(r, self.replay(roles, r, early=False).attainment) for r in rates]


# ``bisect_at_each``'s processes unless told: each imports the planner (about 55 MB) and the
# bisections of a profile number a few dozen.
MAX_PROCESSES = 16

# A process of ``bisect_at_each``'s pool: the planners it was started with.
_held_planners: list[Planner] = []


def _hold(planners: list[Planner]) -> None:
    global _held_planners
    _held_planners = planners


def _bisect_one(i: int, roles: tuple[str, ...], guess: float | None,
                planners: list[Planner] | None = None) -> tuple[float, int]:
    """The goodput of ``roles`` on planner ``i`` (of ``planners``, else of those this process
    holds) from ``guess``, and the replays it took."""
    q = (_held_planners if planners is None else planners)[i]
    before = q.num_replays
    goodput = q.bisect(Evaluation(tuple(roles), q.bound(roles)), guess=guess)
    return goodput, q.num_replays - before


def bisect_at_each(planners: list[Planner], jobs: list[tuple[tuple[str, ...], float | None]], *,
                   processes: int | None = None,
                   progress: Callable[[int, int], None] | None = None) -> tuple[list[list[float]], int]:
    """The goodput of each deployment of ``jobs`` ((roles, guess) pairs, ``Planner.bisect``'s
    ``guess``) on each of ``planners`` (the same workload on other setups): the goodputs by
    planner, and the replays they took. Every bisection is independent of the others and a
    replay's draws are its own (``simulate``), so they run in up to ``processes`` processes
    (None: one per core, up to ``MAX_PROCESSES``), each started with every planner
    and handed one bisection at a time, with the very same results as in this one. Spawned,
    not forked: the caller may hold torch's threads. Where no process can be started, they
    run here."""
    tasks = [(i, roles, guess) for i in range(len(planners)) for roles, guess in jobs]
    processes = min(min(usable_cpus(), MAX_PROCESSES) if processes is None else processes, len(tasks))
    out: list[tuple[float, int]] = []
    if progress is not None:
        progress(0, len(tasks))  # processes take a while to start

    def done(result: tuple[float, int]) -> None:
        out.append(result)
        if progress is not None:
            progress(len(out), len(tasks))

    if processes > 1:
        try:
            with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"),
                                     initializer=_hold, initargs=(planners,)) as pool:
                for result in pool.map(_bisect_one, *zip(*tasks)):
                    done(result)
        except (BrokenProcessPool, OSError) as e:
            logger.warning("planning in %d processes failed (%s: %s); planning in this one", processes,
                           type(e).__name__, e)
            out.clear()
    for i, roles, guess in tasks[len(out):]:
        done(_bisect_one(i, roles, guess, planners))
    by_planner = [[goodput for goodput, _ in out[i * len(jobs):(i + 1) * len(jobs)]] for i in range(len(planners))]
    return by_planner, sum(replays for _, replays in out)
