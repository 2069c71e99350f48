"""The search: every deployment once, Algorithm 2's partition on worked examples, round-robin
stage shares, capacity bounds against long replays, and pruning that never drops the best."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest

from hydrad.config import SchedulerConfig, SLOConfig
from hydrad.engine.latency_model import LatencyModel
from hydrad.planner.capacity import algorithm2, apportion, stage_costs, stage_shares
from hydrad.planner.search import ROLE_ORDER, Evaluation, Planner, deployments
from hydrad.planner.simulator import InstanceLayout, SimSetup
from hydrad.trace import make_record
from hydrad.planner.workload import Workload

# Encode is cheap, prefill dear, decode in between: on two instances one method wins clearly.
MODEL = LatencyModel(v_fixed=0.002, v_image=0.03, l_fixed=0.006, l_prefill=0.0006, l_attn=2e-5,
                     l_decode=0.0012, l_ctx=5e-4, overlap=0.95)


def trace_records(n=300, rate=2.0, seed=0) -> list:
    """``n`` finished one-image requests of model "m", Poisson at ``rate``."""
    rng = random.Random(seed)
    records, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        records.append(make_record(timestamp=t, model="m", prompt_tokens=282, template_tokens=10,
                                   images=[(640, 480, 256, 5)], output_tokens=rng.randint(10, 30), max_tokens=30,
                                   finish_reason="length", preprocess=0.01, ttft=0.1, e2e=1.0, gaps=[], stages={},
                                   instances=[0], deploy="1EPD"))
    return records


def workload(n=300, rate=2.0, seed=0) -> Workload:
    return Workload.from_records(trace_records(n, rate, seed))


def planner(num_requests=120, **kwargs) -> Planner:
    setup = SimSetup(MODEL, {r: InstanceLayout(4096, 256) for r in ROLE_ORDER}, 16, 256, 16384, 524288, 2048,
                     SchedulerConfig(), SLOConfig(ttft=2.0, tbt=0.1), message_seconds=0.002)
    return Planner(setup, workload(), slo_ttft=2.0, slo_tbt=0.1, num_requests=num_requests, **kwargs)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_every_deployment_of_n_instances_exactly_once(n):
    found = deployments(n)
    assert len(found) == len(set(found))
    # Brute force: every assignment of roles to n devices, up to the order of the devices.
    brute = {tuple(sorted(a, key=ROLE_ORDER.index)) for a in itertools.product(ROLE_ORDER, repeat=n)
             if all(any(s in r for r in a) for s in "EPD")}
    assert set(found) == brute
    assert (n > 1 or found == [("EPD",)]) and ("EPD",) * n in found


def test_deployments_of_eight_and_their_specs():
    found = deployments(8)
    assert len(found) == 2871  # C(14, 6) multisets less those that miss a stage
    specs = {Evaluation(roles, None).spec for roles in found}
    assert {"8EPD", "1E+1EP+6D", "1E+3P+4D", "7EP+1D", "1ED+7P", "2E+2PD+4D"} <= specs
    assert len(specs) == len(found)


def test_apportion_splits_by_largest_remainders_with_one_each():
    assert apportion(8, [1, 2, 5]) == [1, 2, 5]
    assert apportion(5, [1, 1, 2]) == [1, 1, 3]  # quotas 1.25, 1.25, 2.5
    assert apportion(3, [0.01, 0.01, 10]) == [1, 1, 1]  # at least one each
    assert apportion(6, [0.1, 3, 3]) == [1, 3, 2]  # quotas 0.1, 2.9, 2.9: the minimum, then the earlier tie
    with pytest.raises(ValueError):
        apportion(2, [1, 1, 1])


def test_algorithm2_partitions_instances_in_proportion_to_stage_times():
    # t_E = 1, t_P = 3, t_D = 4 seconds per request: 8 instances -> 1E + 3P + 4D; EP+D splits
    # 8 by (1 + 3) : 4 -> 4EP + 4D; ED+P by (1 + 4) : 3 -> 5ED + 3P.
    got = algorithm2(8, (1.0, 3.0, 4.0))
    assert got == {"E+P+D": ["E"] + ["P"] * 3 + ["D"] * 4, "EP+D": ["EP"] * 4 + ["D"] * 4,
                   "ED+P": ["ED"] * 5 + ["P"] * 3}
    # Two instances: no room for three single-stage groups.
    assert algorithm2(2, (0.2, 1.0, 0.5)) == {"EP+D": ["EP", "D"], "ED+P": ["ED", "P"]}
    # 5 instances, t = (0.5, 1, 3): 5 * (0.11, 0.22, 0.67) = 0.56, 1.11, 3.33 -> 1, 1, 3.
    assert algorithm2(5, (0.5, 1.0, 3.0))["E+P+D"] == ["E", "P", "D", "D", "D"]


def test_round_robin_shares_follow_the_router_and_in_place_stages():
    # 1E+1EP+2D: encodes split between E and EP; EP prefills its own and all of E's; two Ds.
    assert stage_shares(["E", "EP", "D", "D"], 1.0) == [(0.5, 0, 0), (0.5, 1.0, 0), (0, 0, 0.5), (0, 0, 0.5)]
    # 1E+1PD: everything migrates once; text-only requests (half) enter at PD directly.
    assert stage_shares(["E", "PD"], 0.5) == [(0.5, 0, 0), (0, 1.0, 1.0)]
    # 2EPD: halves.
    assert stage_shares(["EPD", "EPD"], 1.0) == [(0.5, 0.5, 0.5)] * 2


def test_a_videos_encode_is_costed_group_by_group_as_the_engine_encodes_it():
    def encode(*images) -> float:
        records = [make_record(timestamp=t, model="m", prompt_tokens=500, template_tokens=10, images=list(images),
                               output_tokens=10, max_tokens=10, finish_reason="length", preprocess=0.01, ttft=0.1,
                               e2e=1.0, gaps=[], stages={}, instances=[0], deploy="1EPD") for t in (0.0, 1.0)]
        return stage_costs(MODEL, "E", Workload.from_records(records), SLOConfig(ttft=2.0, tbt=0.1),
                           SchedulerConfig()).encode

    # A video of four groups of 396 patches (99 tokens each) costs what four such images do:
    # four times v_image, not once as one image of its patches would.
    video = encode((320, 240, 396, 5, 1584, 396, 8))
    assert video == pytest.approx(encode(*[(320, 240, 99, 5 + 99 * k, 396, 396, 0) for k in range(4)]))
    # (Beside one image of all its patches: three more v_image, and more steps' v_fixed shared.)
    assert 3 * MODEL.v_image < video - encode((320, 240, 396, 5, 1584, 396 * 4, 0)) < 3 * MODEL.v_image + MODEL.v_fixed


@pytest.mark.parametrize("roles", [("EP", "D"), ("E", "P", "D"), ("EPD", "EPD")])
def test_the_capacity_bound_holds_for_long_replays(roles):
    p = planner(num_requests=600)
    ev = Evaluation(roles, p.bound(roles))
    assert 0 < p.bisect(ev) <= ev.bound.rate


def test_pruning_never_drops_the_best_deployment():
    p = planner()
    result = p.search(2, top_k=1)
    exhaustive = {}
    for roles in deployments(2):
        ev = Evaluation(roles, p.bound(roles))
        exhaustive[roles] = p.bisect(ev)
    best = max(exhaustive.values())
    assert result.best.goodput == pytest.approx(best, rel=0.05)
    assert exhaustive[result.best.roles] == pytest.approx(best, rel=0.05)
    # Every deployment left out was shown to be below the best, by a replay or by its bound.
    for ev in result.evaluations[1:]:
        assert ev.status in ("ranked", "below", "pruned")
        if ev.status == "pruned":
            assert p.reach(ev.bound.rate) <= result.best.goodput * 1.0001
    # Algorithm 2's candidates carry their goodput and the pick is the best of them.
    pick = result.algorithm2_pick
    assert pick is not None and pick.methods
    assert pick.goodput == max(e.goodput for e in result.evaluations if e.methods)


def test_once_the_top_are_at_the_replays_limit_lower_bounds_are_not_replayed():
    # 20 requests per replay: every deployment of four instances passes at the highest rate
    # such a replay can tell, where equals rank by their capacity bound.
    p = planner(num_requests=20)
    result = p.search(4, top_k=2)
    top = result.ranked[:2]
    assert all(p.rank_key(e)[0] == -p.max_rate for e in top)
    # The same two as bisecting every deployment and ranking them all.
    every = planner(num_requests=20)
    evaluations = [Evaluation(roles, every.bound(roles)) for roles in deployments(4)]
    for ev in evaluations:
        every.bisect(ev)
    assert [e.spec for e in sorted(evaluations, key=every.rank_key)[:2]] == [e.spec for e in top]
    # Deployments whose bound would let them reach the top's rate were skipped all the same.
    skipped = [e for e in result.evaluations if e.status == "pruned" and p.reach(e.bound.rate) > top[-1].goodput]
    assert skipped


def test_a_bisection_started_from_a_guess_finds_the_same_goodput_in_no_more_replays():
    p = planner()
    roles = ("EP", "D")
    plain = Evaluation(roles, p.bound(roles))
    before = p.num_replays
    goodput = p.bisect(plain)
    plain_replays = p.num_replays - before
    assert goodput > 0
    # A guess near the goodput (another speed's), above it and below it: the same goodput
    # within the bisection's tolerance, from no more replays.
    for guess in (1.1 * goodput, 0.85 * goodput):
        ev = Evaluation(roles, p.bound(roles))
        before = p.num_replays
        found = p.bisect(ev, guess=guess)
        assert found == pytest.approx(goodput, rel=2 * p.rel_tol)
        assert p.num_replays - before <= plain_replays
    # A guess far off still brackets it: the steps square while they miss.
    far = Evaluation(roles, p.bound(roles))
    assert p.bisect(far, guess=goodput / 20) == pytest.approx(goodput, rel=2 * p.rel_tol)
    assert p.bisect(Evaluation(roles, p.bound(roles)), guess=goodput * 5) == pytest.approx(goodput, rel=2 * p.rel_tol)


def test_a_planner_on_another_setup_keeps_everything_else():
    from dataclasses import replace

    p = planner(num_requests=80, arrivals="poisson", rel_tol=0.1, seed=3)
    slower = replace(p.setup, speeds={1: 1.5})
    q = p.at(slower)
    assert q.setup is slower and q.workload is p.workload
    assert (q.slo_ttft, q.slo_tbt, q.num_requests, q.arrivals, q.rel_tol, q.seed) == (2.0, 0.1, 80, "poisson", 0.1, 3)


def _planners_at(speeds):
    from dataclasses import replace

    p = planner(num_requests=80)
    return [p.at(replace(p.setup, speeds={1: f}, step_noise=0.05)) for f in speeds]


JOBS = [(("EPD", "EPD"), None), (("EP", "D"), 2.0)]


def test_bisections_at_each_setup_are_the_same_in_processes_as_in_this_one():
    from hydrad.planner.search import bisect_at_each

    here = _planners_at((1.0, 1.3, 0.9))
    expected, replays = bisect_at_each(here, JOBS, processes=1)
    assert replays == sum(q.num_replays for q in here) > 0
    # Slower setups, lower goodputs: each row is its own setup's.
    assert expected[1][0] < expected[0][0] <= expected[2][0]
    elsewhere = _planners_at((1.0, 1.3, 0.9))
    calls = []
    got, replays_elsewhere = bisect_at_each(elsewhere, JOBS, processes=2, progress=lambda d, n: calls.append((d, n)))
    assert got == expected and replays_elsewhere == replays
    # Replayed in other processes: these planners never ran one.
    assert all(q.num_replays == 0 for q in elsewhere)
    assert calls == [(k, 6) for k in range(0, 7)]  # at the start, then one a bisection


def test_bisections_run_here_when_no_process_can_start(monkeypatch, caplog):
    from hydrad.planner import search

    class NoProcesses:
        def __init__(self, *args, **kwargs):
            raise OSError("no processes here")

    expected, _ = search.bisect_at_each(_planners_at((1.0, 1.2)), JOBS, processes=1)
    monkeypatch.setattr(search, "ProcessPoolExecutor", NoProcesses)
    here = _planners_at((1.0, 1.2))
    with caplog.at_level("WARNING", logger="hydrad.planner"):
        got, _ = search.bisect_at_each(here, JOBS, processes=4)
    assert got == expected and all(q.num_replays > 0 for q in here)
    assert "no processes here" in caplog.text


def test_a_search_that_may_replay_more_requests_tells_apart_deployments_at_the_ceiling_of_fewer():
    # 20 requests per replay cannot tell three instances' deployments apart (as four's in the
    # test above); allowed up to 2000, the search replays as many as the best bound needs.
    assert planner(num_requests=20).search(3, top_k=2).best.goodput == pytest.approx(planner(20).max_rate, rel=0.05)
    p = planner(num_requests=20, max_requests=2000)
    result = p.search(3, top_k=2)
    best_bound = max(p.bound(roles).rate for roles in deployments(3))
    assert 20 < p.num_requests < 2000
    assert p.reach(best_bound) <= (1 - p.rel_tol) * p.max_rate  # each one's goodput is below the ceiling
    assert all(p.rank_key(e)[0] > -p.max_rate for e in result.ranked)
    assert result.best.goodput < (1 - p.rel_tol) * p.max_rate
    # ... and the ranking is the one of bisecting every deployment with that many requests.
    every = planner(num_requests=p.num_requests)
    evaluations = [Evaluation(roles, every.bound(roles)) for roles in deployments(3)]
    for ev in evaluations:
        every.bisect(ev)
    assert [e.spec for e in sorted(evaluations, key=every.rank_key)[:2]] == [e.spec for e in result.ranked[:2]]
    # Never past max_requests, never below the requests asked for.
    capped = planner(num_requests=20, max_requests=30)
    capped.search(4, top_k=1)
    assert capped.num_requests == 30
    kept = planner(num_requests=500, max_requests=2000)
    assert kept.fit_requests(0.1) == 500
    assert planner(num_requests=3000, max_requests=2400).fit_requests(1e4) == 3000  # more asked than the cap


def test_a_search_replays_no_more_requests_than_the_request_processor_can_prepare_tells_apart():
    # A model 50x as fast: the best deployments of three are bound past 600 req/s; the Request
    # Processor prepares one request at a time, 10 ms each (the trace's): 100 req/s at most.
    fast = LatencyModel(**{name: getattr(MODEL, name) / 50 for name in (
        "v_fixed", "v_image", "l_fixed", "l_prefill", "l_attn", "l_decode", "l_ctx")}, overlap=MODEL.overlap)
    setup = SimSetup(fast, {r: InstanceLayout(4096, 256) for r in ROLE_ORDER}, 16, 256, 16384, 524288, 2048,
                     SchedulerConfig(), SLOConfig(ttft=2.0, tbt=0.1), message_seconds=0.002)
    p = Planner(setup, workload(), slo_ttft=2.0, slo_tbt=0.1, num_requests=20, max_requests=2400)
    assert p.processor_rate == pytest.approx(100.0)
    assert max(p.bound(roles).rate for roles in deployments(3)) > 600
    # (What the search replays does not matter here: every rate fails, nothing is described.)
    p.passes, p.describe = (lambda ev, rate: False), (lambda ev: None)
    p.search(3, top_k=1)  # as many as tell 100 req/s: ceil((3 x 1.1 / 0.95 + 1 / 0.9) x 2 s x 100)
    assert p.num_requests == 917
    unqueued = Planner(dataclasses.replace(setup, processor_threads=None), workload(), slo_ttft=2.0, slo_tbt=0.1)
    assert unqueued.processor_rate == math.inf
