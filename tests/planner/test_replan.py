"""Re-planning while serving: the machine built from the workers' reports, the ranking of a
trace window, and the decisions (taken or not) with their numbers."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from types import SimpleNamespace

import pytest

from hydrad.cluster.supervisor import RedeployError
from hydrad.cluster.worker_client import WorkerLost
from hydrad.config_file import load_config
from hydrad.engine.core import PoolGeometry
from hydrad.engine.cores import CpuThreads
from hydrad.engine.latency_model import LatencyModel
from hydrad.errors import ConfigError
from hydrad.planner.replan import InstanceFacts, Ranking, Replanner, combine_models, live_setup, rank_window
from hydrad.trace import TraceWriter

VISION = LatencyModel(v_fixed=0.002, v_image=0.03, meta={"key": {"parts": "vision"}})
LANGUAGE = LatencyModel(l_fixed=0.006, l_prefill=0.0006, l_attn=2e-5, l_decode=0.0012, l_ctx=5e-4,
                        meta={"key": {"parts": "+language"}})
BOTH = LatencyModel(v_fixed=0.004, v_image=0.05, l_fixed=0.009, l_prefill=0.001, l_decode=0.002, overlap=0.7,
                    meta={"key": {"parts": "vision+language"}})
GEOMETRY = PoolGeometry(16, 16384, 576, 576 * 64 * 4)


def facts(role, model, bandwidth=None):
    return InstanceFacts(role, model, GEOMETRY, bandwidth, 2048)


def test_the_model_takes_vision_from_an_encoder_and_language_from_a_decoder():
    model = combine_models([facts("E", VISION), facts("PD", LANGUAGE)])
    assert (model.v_fixed, model.v_image) == (VISION.v_fixed, VISION.v_image)
    assert (model.l_fixed, model.l_prefill, model.l_decode, model.l_ctx) == (
        LANGUAGE.l_fixed, LANGUAGE.l_prefill, LANGUAGE.l_decode, LANGUAGE.l_ctx)
    assert model.overlap == 1.0  # nothing measured both at once: one after the other
    # An instance fitted with both parts gives its overlap.
    assert combine_models([facts("E", VISION), facts("EPD", BOTH)]).overlap == 0.7
    with pytest.raises(ValueError, match="encoding"):
        combine_models([facts("PD", LANGUAGE), facts("D", LANGUAGE)])
    with pytest.raises(ValueError, match="prefilling or decoding"):
        combine_models([facts("E", VISION), facts("E", None)])


def test_the_machine_comes_from_the_workers_reports():
    config = load_config(None).engine
    setup = live_setup(config, [facts("E", VISION), facts("PD", LANGUAGE, 2e9)], is_cpu=True, cores=4,
                       router_policy="least-load")
    assert (setup.kv_block_size, setup.kv_block_bytes, setup.image_block_bytes) == (16, 16384, 576 * 64 * 4)
    assert setup.bandwidth == 2e9 and setup.threads == 2 and setup.cores == 4
    assert setup.router_policy == "least-load" and setup.max_model_len == 2048
    # Each role's pools: a cache the role does not use gives its memory to the other.
    assert setup.layouts["E"].num_kv_blocks == 0 and setup.layouts["D"].num_image_blocks == 0
    assert setup.layouts["D"].num_kv_blocks > setup.layouts["PD"].num_kv_blocks


def test_a_borrowers_model_on_borrowed_cores_is_the_simulators_model_at_that_count():
    config = load_config(None).engine
    fast = dataclasses.replace(BOTH, l_prefill=BOTH.l_prefill / 2)
    ep = InstanceFacts("EP", BOTH, GEOMETRY, None, 2048, borrow_model=fast, borrow_threads=2)
    setup = live_setup(config, [ep, facts("D", LANGUAGE)], is_cpu=True, cores=2, router_policy="round-robin")
    assert setup.threads == 1 and list(setup.thread_models) == [2]
    assert setup.thread_models[2].l_prefill == fast.l_prefill and setup.model.l_prefill == BOTH.l_prefill
    # A borrower that fitted one part only: no model at its count (the simulator takes the share's).
    e = InstanceFacts("E", VISION, GEOMETRY, None, 2048, borrow_model=VISION, borrow_threads=2)
    assert live_setup(config, [e, facts("PD", LANGUAGE)], is_cpu=True, cores=2,
                      router_policy="round-robin").thread_models == {}


def test_the_machine_runs_at_the_speed_the_workers_measured_on_their_own_steps():
    config = load_config(None).engine
    ep = InstanceFacts("EP", BOTH, GEOMETRY, None, 2048, borrow_model=BOTH, borrow_threads=2,
                       live_speed={"images": 1.4, "prefills": 1.2}, live_speed_steps={"images": 30, "prefills": 10},
                       live_speed_spread=0.1)
    d = dataclasses.replace(facts("D", LANGUAGE), live_speed={"decodes": 1.1, "prefills": 1.6},
                            live_speed_steps={"decodes": 90, "prefills": 30}, live_speed_spread=0.2)
    setup = live_setup(config, [ep, d], is_cpu=True, cores=2, router_policy="round-robin")
    parts = {"decodes": 1.1, "images": 1.4, "prefills": (10 * 1.2 + 30 * 1.6) / 40}  # weighted by their steps
    assert setup.part_speeds == {1: pytest.approx(parts), 2: pytest.approx(parts)}  # the share and the borrowed count
    assert setup.speeds[1] == pytest.approx((30 * 1.4 + 10 * 1.2 + 90 * 1.1 + 30 * 1.6) / 160)
    # The steps' spread (the models stored no held-out error).
    assert setup.step_noise == pytest.approx(math.sqrt((40 * 0.1 ** 2 + 120 * 0.2 ** 2) / 160))
    assert setup.at_speed(setup.model, 1).v_image == pytest.approx(1.4 * BOTH.v_image)
    # Nothing measured yet (a worker just started): the models as fitted.
    still = live_setup(config, [facts("EP", BOTH), facts("D", LANGUAGE)], is_cpu=True, cores=2,
                       router_policy="round-robin")
    assert still.speeds == {} and still.part_speeds == {}
    # Speeds measured while serving hold the slowdown of steps running beside each other; the
    # models as fitted do not, and the replay adds it.
    from hydrad.planner.profile import DEFAULT_CORUN_SLOWDOWN

    assert setup.corun_slowdown == {} and still.corun_slowdown == DEFAULT_CORUN_SLOWDOWN


def test_live_speeds_pools_the_instances_by_their_steps():
    from hydrad.planner.profile import live_speeds

    speeds = live_speeds([({"images": 1.5}, {"images": 10}, 0.3), ({"images": 1.0, "decodes": 2.0},
                                                                   {"images": 30, "decodes": 10}, 0.0)], [1])
    (speed,) = speeds.values()
    assert speed.parts == {"images": pytest.approx(1.125), "decodes": 2.0}
    assert speed.factor == pytest.approx((15 + 30 + 20) / 50)
    assert speed.spread == pytest.approx(math.sqrt(10 * 0.09 / 50))
    assert live_speeds([({}, {}, 0.0)], [1, 2]) == {}


def write_trace(directory, start, n, rate, seed=0):
    rng = random.Random(seed)
    writer = TraceWriter(directory, max_bytes=1 << 20, max_files=2, model="m", deploy="2EPD", template_tokens=10)
    t = start
    for _ in range(n):
        t += rng.expovariate(rate)
        writer.record(timestamp=t, prompt_tokens=282, images=[(640, 480, 256, 5)], output_tokens=rng.randint(10, 30),
                      max_tokens=30, finish_reason="length", preprocess=0.01, ttft=0.2, e2e=1.0, gaps=[0.05] * 9,
                      stages={}, instances=[0])
    writer.close()


def test_a_window_is_ranked_and_the_running_deployment_gets_its_goodput(tmp_path):
    write_trace(tmp_path, 1000.0, 20, 2.0, seed=1)  # old: outside the window
    write_trace(tmp_path, 5000.0, 120, 2.0, seed=2)
    config = load_config(None).engine
    setup = live_setup(config, [facts("EPD", BOTH), facts("EPD", BOTH)], is_cpu=False, cores=None,
                       router_policy="round-robin")
    ranking = rank_window(tmp_path, "m", 4000.0, setup, ["EPD", "EPD"], min_requests=50, slo_ttft=2.0,
                          slo_tbt=0.1, num_requests=100)
    assert ranking.num_requests == 120 and ranking.current == ("EPD", "EPD")
    assert ranking.best is not None and ranking.best_goodput >= ranking.current_goodput > 0
    assert ranking.rate == pytest.approx(2.0, rel=0.4)
    # Too few in the window: no ranking.
    few = rank_window(tmp_path, "m", 1000.0 - 1, setup, ["EPD", "EPD"], min_requests=500, slo_ttft=2.0, slo_tbt=0.1,
                      num_requests=100)
    assert few.best is None and few.num_requests == 140
    assert rank_window(tmp_path / "none", "m", 0, setup, ["EPD"] * 2, min_requests=1, slo_ttft=2.0, slo_tbt=0.1,
                       num_requests=100).num_requests == 0


def _stats_of(instance_id):
    async def get_stats(timeout):
        if instance_id == 1:  # down, or too busy to answer
            raise WorkerLost("gone")
        return SimpleNamespace(live_speed={"images": 1.3}, live_speed_steps={"images": 20}, live_speed_spread=0.0)

    return get_stats


class FakeSupervisor:
    def __init__(self, roles, busy=None, fail=None):
        self.clients = [SimpleNamespace(instance_id=i, role=r, ready=SimpleNamespace(
            latency_model=BOTH, geometry=GEOMETRY, copy_bandwidth=None, max_model_len=2048),
            get_stats=_stats_of(i)) for i, r in enumerate(roles)]
        self.specs = [SimpleNamespace(threads=CpuThreads(1), device="cpu") for _ in roles]
        self.busy = busy
        self.migrates = any(role != "EPD" for role in roles)
        self.is_cpu = True
        self.fail = fail
        self.redeploys = []

    async def redeploy(self, roles, *, reason, trigger):
        if self.fail:
            raise RedeployError(self.fail)
        assert trigger == "auto"
        self.redeploys.append((list(roles), reason))
        for client, role in zip(self.clients, roles):
            client.role = role
        return SimpleNamespace(seconds=1.5)


def replanner(supervisor, rankings, tmp_path, keep_plans=False, planned_devices=None, **planner):
    """A Replanner whose search answers ``rankings`` in turn, on a clock advanced by hand."""
    config = load_config(None, {"planner.auto": True, "planner.min_interval": 600.0, "planner.margin": 0.2,
                                "parallel.devices": "cpu:2", "model.path": "m", **{f"planner.{k}": v for k, v in planner.items()}})
    answers = iter(rankings)
    calls = []

    def rank(*args, **kwargs):
        calls.append((args, kwargs))
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    clock = SimpleNamespace(now=10_000.0)
    r = Replanner(config, supervisor, "m", trace_dir=tmp_path, rank=rank, executor=ThreadPoolExecutor(1),
                  clock=lambda: clock.now, keep_plans=keep_plans, planned_devices=planned_devices)
    return r, calls, clock


def ranking(best, best_goodput, current=("EPD", "EPD"), current_goodput=1.0):
    return Ranking(200, current, best, current_goodput, best_goodput, 1.3, 0.4)


def test_decisions_keep_redeploy_and_wait_for_the_minimum_interval(tmp_path):
    supervisor = FakeSupervisor(["EPD", "EPD"])
    r, calls, clock = replanner(supervisor, [
        ranking(("EPD", "EPD"), 1.0),  # the running one is the best
        ranking(("EP", "D"), 1.1),  # better, within the margin
        ranking(("EP", "D"), 3.0),  # better by more than the margin: redeploy
        ranking(("E", "PD"), 9.0, current=("EP", "D"), current_goodput=3.0),  # too soon after the last
        ranking(("E", "PD"), 9.0, current=("EP", "D"), current_goodput=3.0),
    ], tmp_path)

    async def run():
        out = []
        for step in (0, 300, 300, 300, 300):
            clock.now += step
            out.append(await r.replan())
        return out

    keep, within, redeploy, soon, again = asyncio.run(run())
    assert (keep.action, keep.best, keep.current) == ("keep", "2EPD", "2EPD") and "the best" in keep.reason
    assert within.action == "keep" and "margin (20%)" in within.reason and within.best_goodput == 1.1
    assert redeploy.action == "redeploy" and redeploy.best == "1EP+1D" and "in 1.5 s" in redeploy.reason
    assert supervisor.redeploys[0][0] == ["EP", "D"] and supervisor.redeploys[0][1].startswith("auto: 200 requests")
    assert soon.action == "keep" and "min_interval" in soon.reason and soon.current == "1EP+1D"
    assert again.action == "redeploy" and supervisor.redeploys[1][0] == ["E", "PD"]
    # What the search got: the window, the running roles, the SLO and the planner's settings.
    (trace_dir, model, since, setup, roles), kwargs = calls[0]
    assert (trace_dir, model, since, roles) == (str(tmp_path), "m", 10_000.0 - 1800.0, ["EPD", "EPD"])
    assert kwargs["min_requests"] == 50 and kwargs["num_requests"] == 300
    assert setup.model.overlap == BOTH.overlap
    # At the speed the workers that answered measured on their own steps.
    assert setup.part_speeds == {1: {"images": 1.3}} and setup.speeds == {1: 1.3}
    # Every decision is kept, with its numbers, for /admin/status.
    status = r.status()
    assert [d["action"] for d in status["decisions"]] == ["keep", "keep", "redeploy", "keep", "redeploy"]
    assert r.num_decisions == {"keep": 3, "redeploy": 2}  # since start, for the metrics
    assert status["decisions"][2]["best_goodput"] == 3.0 and status["decisions"][2]["current_goodput"] == 1.0
    json.dumps(status)


def test_a_daemon_started_with_deploy_auto_keeps_each_redeploy_as_the_plan_a_restart_reuses(tmp_path):
    from hydrad.planner.auto import PLAN_FILE, load_plan, plan_key, reusable

    for keep in (False, True):
        supervisor = FakeSupervisor(["EPD", "EPD"])
        r, _, clock = replanner(supervisor, [ranking(("EPD", "EPD"), 1.0), ranking(("EP", "D"), 3.0)], tmp_path,
                                keep_plans=keep)
        keep_decision, redeploy = (asyncio.run(r.replan()) for _ in range(2))
        assert keep_decision.action == "keep" and redeploy.action == "redeploy"
        kept = load_plan(tmp_path / PLAN_FILE)
        if not keep:
            assert kept is None  # started with an explicit deployment: nothing kept
            continue
        assert kept.deploy == "1EP+1D" and kept.reason.startswith("auto: 200 requests")
        assert kept.made_at == clock.now == kept.newest and kept.num_requests == 200
        config = r.engine_config  # the daemon's: its deployment is the one running, not "auto"
        key = plan_key("m", ["cpu", "cpu"], dataclasses.replace(config, parallel=dataclasses.replace(
            config.parallel, deploy="auto")), "round-robin", tmp_path)
        assert kept.key == key and reusable(kept, key, [], reuse_hours=24, now=clock.now + 60) is None
        assert kept.devices == ""  # those of the key


def test_planning_at_start_ranks_the_start_s_requests_takes_any_gain_and_keeps_the_plan(tmp_path):
    """A daemon started on an outgrown kept plan plans once as it serves (``refresh``): on the
    trace's requests since the start's ``since`` (at least ``auto.MIN_REQUESTS``), redeploying
    to the best where it is ahead at all (no margin, even right after another redeploy), and
    keeping the plan either way, so the next start reuses it."""
    from hydrad.planner.auto import PLAN_FILE, load_plan

    supervisor = FakeSupervisor(["EPD", "EPD"])
    r, calls, clock = replanner(supervisor, [ranking(("EP", "D"), 1.1), ranking(("EP", "D"), 1.0, ("EP", "D"), 1.0),
                                             RuntimeError("no trace")], tmp_path, keep_plans=True)
    r.last_redeploy = clock.now  # min_interval does not hold it back
    redeploy = asyncio.run(r.refresh(since=5_000.0))
    assert redeploy.action == "redeploy" and supervisor.redeploys[0][0] == ["EP", "D"]  # 10% ahead: taken
    assert supervisor.redeploys[0][1].startswith("auto: at start: 200 requests in the trace's newest")
    (_, _, since, _, _), kwargs = calls[0]
    assert since == 5_000.0 and kwargs["min_requests"] == 10
    assert load_plan(tmp_path / PLAN_FILE).deploy == "1EP+1D"
    (tmp_path / PLAN_FILE).unlink()
    keep = asyncio.run(r.refresh(since=5_000.0))  # the running one is the best: kept as the plan
    assert keep.action == "keep" and load_plan(tmp_path / PLAN_FILE).reason.startswith("planned at start: ")
    assert asyncio.run(r.refresh(since=5_000.0)).action == "failed"  # the daemon serves on
    assert [d["action"] for d in r.status()["decisions"]] == ["redeploy", "keep", "failed"]


def test_planning_at_start_waits_out_a_busy_cluster(tmp_path, monkeypatch):
    """A worker restarting when the start's planning comes: it tries again once the cluster is
    no longer busy, rather than leaving the outgrown plan for another start."""
    from hydrad.planner import replan

    monkeypatch.setattr(replan, "REFRESH_RETRY_SECONDS", 0.01)
    supervisor = FakeSupervisor(["EPD", "EPD"], busy="instance 1 is restarting")
    r, calls, _ = replanner(supervisor, [ranking(("EP", "D"), 2.0)], tmp_path, keep_plans=True)

    async def run():
        refresh = asyncio.ensure_future(r.refresh(since=5_000.0))
        await asyncio.sleep(0.05)
        supervisor.busy = None
        return await refresh

    decision = asyncio.run(run())
    actions = [d["action"] for d in r.status()["decisions"]]
    assert decision.action == "redeploy" and actions[-1] == "redeploy" and set(actions[:-1]) == {"skip"}
    assert len(actions) >= 2 and len(calls) == 1  # ranked once, when it could act


def test_a_redeploy_of_workers_whose_count_the_start_planned_is_kept_with_their_count(tmp_path, monkeypatch):
    """Started with ``--devices auto`` on a CPU machine, where the plan picked two workers:
    a redeploy is kept under the key of ``--devices auto`` with ``cpu:2``, and the next start
    comes back on it."""
    from hydrad.engine import cores
    from hydrad.planner.auto import PLAN_FILE, choose_deployment, load_plan

    monkeypatch.setattr(cores, "usable_cpus", lambda: 2)
    supervisor = FakeSupervisor(["EPD", "EPD"])
    r, _, clock = replanner(supervisor, [ranking(("EP", "D"), 3.0)], tmp_path, keep_plans=True,
                            planned_devices="auto")
    assert asyncio.run(r.replan()).action == "redeploy"
    kept = load_plan(tmp_path / PLAN_FILE)
    assert (kept.deploy, kept.devices, kept.key.devices) == ("1EP+1D", "cpu:2", ("auto:cpu:2",))
    from hydrad.trace import make_record

    with open(tmp_path / "trace.jsonl", "w", encoding="utf-8") as f:  # what it was planned from
        for i in range(20):
            record = make_record(timestamp=clock.now - 100 + i, model="m", prompt_tokens=40, template_tokens=10,
                                 images=[], output_tokens=8, max_tokens=8, finish_reason="length", preprocess=0.001,
                                 ttft=0.1, e2e=0.5, gaps=[0.05] * 7, stages={}, instances=[0], deploy="2EPD")
            f.write(json.dumps(record.to_json()) + "\n")
    plan = json.loads((tmp_path / PLAN_FILE).read_text())
    plan["made_at"] = time.time() - 60  # a minute ago by the start's clock
    (tmp_path / PLAN_FILE).write_text(json.dumps(plan))
    config = load_config(None, {"parallel.devices": "auto", "trace.dir": str(tmp_path), "model.path": "m"})
    choice = choose_deployment(config)
    assert (choice.deploy, choice.devices) == ("1EP+1D", "cpu:2") and choice.reason.startswith("the plan of 1 min ago")


def test_nothing_is_changed_when_busy_short_of_requests_or_failing(tmp_path):
    busy = FakeSupervisor(["EPD", "EPD"], busy="a redeploy is under way")
    r, calls, _ = replanner(busy, [], tmp_path)
    decision = asyncio.run(r.replan())
    assert decision.action == "skip" and decision.reason == "a redeploy is under way" and not calls

    supervisor = FakeSupervisor(["EPD", "EPD"], fail="instance 1 could not take on P")
    r, _, _ = replanner(supervisor, [Ranking(3), RuntimeError("boom"), ranking(("EP", "D"), 5.0)], tmp_path)
    few, failed, refused = (asyncio.run(r.replan()) for _ in range(3))
    assert few.action == "skip" and "3 finished request(s)" in few.reason
    assert failed.action == "failed" and "RuntimeError: boom" in failed.reason
    assert refused.action == "failed" and "could not take on P" in refused.reason
    assert not supervisor.redeploys


def test_no_replanning_while_only_the_running_deployment_fits_in_shared_memory(tmp_path, monkeypatch):
    """2EPD keeps its CPU pools private; every other deployment puts them in /dev/shm. Without
    room there, re-planning says so and plans nothing (the redeploy would be refused)."""
    from hydrad.cluster import preflight

    monkeypatch.setattr(preflight, "SHM", str(tmp_path))  # a 64 MiB /dev/shm
    monkeypatch.setattr(preflight.os, "statvfs", lambda path: SimpleNamespace(f_bavail=64 * 256, f_frsize=4096))
    r, calls, _ = replanner(FakeSupervisor(["EPD", "EPD"]), [ranking(("EP", "D"), 5.0)], tmp_path)
    decision = asyncio.run(r.replan())
    assert decision.action == "skip" and not calls
    assert decision.reason.startswith(f"no deployment but 2EPD can run here: {tmp_path} has 64 MiB free")
    # A deployment that moves requests already holds its pools there: planned as usual.
    r, calls, _ = replanner(FakeSupervisor(["EP", "D"]), [ranking(("EP", "D"), 5.0, current=("EP", "D"))], tmp_path)
    assert asyncio.run(r.replan()).action == "keep" and calls


def test_the_planner_section_is_checked():
    config = load_config(None, {"planner.auto": True, "planner.interval": 60.0})
    assert config.planner.auto and config.planner.interval == 60.0
    with pytest.raises(ConfigError, match="planner.margin"):
        load_config(None, {"planner.margin": -0.1})
    with pytest.raises(ConfigError, match="needs \\[trace\\] enabled"):
        load_config(None, {"planner.auto": True, "trace.enabled": False})
    assert replace(config.planner, auto=False).auto is False
