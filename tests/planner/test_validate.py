"""``hydractl profile --validate``'s bookkeeping, without a live daemon: each deployment is
simulated again at the machine's speed measured around its live run, and at the speed its
workers measured on their own steps during it, next to its live goodput; speed checks
taken together; a profile replayed at another speed; the table ``--validate`` prints."""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest

from hydrad.config_file import load_config
from hydrad.engine.latency_model import LatencyModel
from hydrad.engine.machine_speed import Speed, recent_speeds, record_speed
from hydrad.planner import validate as validate_module
from hydrad.planner.profile import Devices, Profile, at_speeds, mean_speeds, planning_speeds
from hydrad.planner.search import Planner
from hydrad.planner.validate import validate

from test_search import planner, trace_records


def test_mean_speeds_averages_factors_and_pools_spreads():
    a = {1: Speed(1.2, 0.1), 2: Speed(1.5, 0.3)}
    b = {1: Speed(1.4, 0.2)}
    both = mean_speeds(a, b)
    assert list(both) == [1]  # only the counts every check measured
    assert both[1].factor == pytest.approx(1.3)
    assert both[1].spread == pytest.approx(math.sqrt((0.1 ** 2 + 0.2 ** 2) / 2))
    assert mean_speeds(a) == a
    # Per kind, of the kinds both timed.
    c = {1: Speed(1.0, 0.0, {"images": 1.2, "decodes": 1.0})}
    d = {1: Speed(1.0, 0.0, {"images": 1.4, "prefills": 1.1})}
    assert mean_speeds(c, d)[1].parts == {"images": pytest.approx(1.3)}


class CheckingProbe:
    """A ``MachineProbe`` whose speed check answers ``now`` and joins the history, as the real one's does."""

    def __init__(self, now: dict, keep_check: bool = False):
        key = {"model": "/models/small", "parts": "vision+language"}
        self.models = {n: LatencyModel(l_fixed=0.01 * n, meta={"key": {**key, "device": f"cpu:{n}threads"}})
                       for n in now}
        self.now = now
        self.keep_check, self.kept_check, self.owner = keep_check, None, self
        self.checks = 0

    def speeds(self, rounds: int = 5) -> dict:
        self.checks += 1
        for n, speed in self.now.items():
            record_speed(self.models[n], speed)
        return dict(self.now)


def test_plans_of_several_worker_counts_on_one_probe_share_its_models_and_one_speed_check(monkeypatch, tmp_path):
    """``hydrad start`` with ``--devices auto`` plans each count of CPU workers on one probe:
    each plan sees the models of its own workers' thread counts, and the speed check runs once."""
    from hydrad.planner import profile as profile_module
    from hydrad.planner.profile import MachineProbe

    monkeypatch.setenv("HYDRAD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(profile_module, "usable_cpus", lambda: 4)
    fake = CheckingProbe({n: Speed(1.0 + n / 10, 0.1, {"decodes": 1.0}) for n in (1, 2, 4)}, keep_check=True)
    owner = object.__new__(MachineProbe)  # the models and the check of the fake, the views of the real one
    owner.__dict__.update(fake.__dict__, devices=Devices(("cpu",) * 4), cores=4, engine=object())
    owner.owner = owner
    owner.speeds = fake.speeds
    one, two = owner.for_devices(Devices(("cpu",))), owner.for_devices(Devices(("cpu", "cpu")))
    assert set(one.models) == {4} and set(two.models) == {2, 4} and two.model is owner.models[2]
    assert one.devices.threads == 4 and one.engine is owner.engine and one.owner is two.owner is owner
    with pytest.raises(ValueError, match=r"no latency model at \[2\] thread"):
        one.for_devices(Devices(("cpu", "cpu")))  # a view holds only its own counts
    speeds_one, basis_one, _ = planning_speeds(one)
    speeds_two, _, sample_two = planning_speeds(two)
    assert fake.checks == 1
    assert set(speeds_one) == set(basis_one) == {4} and set(speeds_two) == {2, 4}
    assert speeds_one[4] == speeds_two[4] and all(set(check) == {2, 4} for check in sample_two)
    # A probe that does not keep its check checks at every plan.
    plain = CheckingProbe(fake.now)
    planning_speeds(plain)
    planning_speeds(plain)
    assert plain.checks == 2


def test_a_plan_is_made_at_the_median_of_the_check_now_recent_checks_and_the_fit(monkeypatch, tmp_path):
    monkeypatch.setenv("HYDRAD_CACHE_DIR", str(tmp_path))
    probe = CheckingProbe({1: Speed(1.4, 0.1, {"decodes": 1.4}), 2: Speed(0.9, 0.1, {"decodes": 0.9})})
    # The first plan: the check and the fit, per thread count.
    speeds, basis, sample = planning_speeds(probe)
    assert {n: s.factor for n, s in speeds.items()} == pytest.approx({1: 1.2, 2: 0.95})
    # The goodput is averaged over the check and the fit.
    assert [{n: s.factor for n, s in c.items()} for c in sample] == [{1: 1.4, 2: 0.9}, {1: 1.0, 2: 1.0}]
    assert speeds[1].parts == pytest.approx({"decodes": 1.2}) and speeds[1].spread == 0.1
    assert basis[1] == {"check_now": 1.4, "check_now_by_kind": {"decodes": 1.4}, "earlier_checks": 0,
                        "with_fit": True, "planned_at": pytest.approx(1.2)}
    # Each check joined its model's history: the next plan counts it.
    assert [s.factor for s in recent_speeds(probe.models[1])] == [1.4]
    probe.now = {1: Speed(1.0, 0.1, {"decodes": 1.0}), 2: Speed(0.9, 0.1, {"decodes": 0.9})}
    speeds, basis, sample = planning_speeds(probe)
    assert speeds[1].factor == pytest.approx(1.0) and basis[1]["earlier_checks"] == 1
    assert [c[1].factor for c in sample] == [1.4, 1.0, 1.0]  # the earlier check, this one, the fit
    # 0: the check now alone.
    speeds, basis, sample = planning_speeds(probe, history=0)
    assert speeds[1].factor == 1.0 and basis[1]["with_fit"] is False
    assert sample == [probe.now]


def test_at_speeds_sets_the_factors_and_the_spread_they_imply():
    setup = planner().setup
    slow = at_speeds(setup, {1: Speed(1.5, 0.2)})
    assert slow.speeds == {1: 1.5} and slow.speed(1) == 1.5
    assert slow.step_noise == pytest.approx(0.2)  # the synthetic model has no held-out error
    assert setup.speeds == {} and setup.step_noise == 0.0  # the original is left alone
    kinds = at_speeds(setup, {1: Speed(1.5, 0.2, {"images": 1.1, "prefills": 1.6, "decodes": 1.4})})
    assert kinds.part_speeds == {1: {"images": 1.1, "prefills": 1.6, "decodes": 1.4}}
    assert kinds.at_speed(setup.model, 1).l_prefill == pytest.approx(1.6 * setup.model.l_prefill)
    # Speeds measured under load hold the co-running slowdown: it is not added on top.
    corun = replace(setup, corun_slowdown={"decodes": 0.1})
    assert at_speeds(corun, {1: Speed(1.5, 0.2)}).corun_slowdown == {"decodes": 0.1}
    assert at_speeds(corun, {1: Speed(1.5, 0.2)}, under_load=True).corun_slowdown == {}
    # The clients' CPU slowed the steps the workers measured too: not added again.
    clients = replace(corun, client_seconds=0.02)
    assert at_speeds(clients, {1: Speed(1.5, 0.2)}).client_seconds == 0.02
    assert at_speeds(clients, {1: Speed(1.5, 0.2)}, under_load=True).client_seconds == 0.0


def _profile():
    p = planner()
    result = p.search(2, top_k=2)
    return Profile(p.workload, Devices(("cpu", "cpu")), p.setup, 2.0, 0.1, p, result)


def test_a_profile_ranks_by_the_mean_goodput_over_its_speed_sample():
    p = planner()
    # A sample of three checks: the fit, one 30% slower, one 10% faster.
    sample = ({1: Speed(1.0, 0.0)}, {1: Speed(1.3, 0.0)}, {1: Speed(0.9, 0.0)})
    setup = replace(p.setup, speed_sample=sample)
    p = Planner(setup, p.workload, slo_ttft=2.0, slo_tbt=0.1, num_requests=p.num_requests)
    result = p.search(2, top_k=2)
    profile = Profile(p.workload, Devices(("cpu", "cpu")), setup, 2.0, 0.1, p, result)
    searched = {e.spec: e.goodput for e in result.ranked}
    profile.average_over_speeds()
    ranked = profile.result.ranked
    assert len(ranked) >= 2
    for e in ranked:
        assert e.goodput_at_planned_speed == searched[e.spec]
        each = [profile.goodput_at(e.roles, speeds) for speeds in sample]
        # Each bisected again (from the searched goodput as a guess): the same within the bisection's tolerance.
        assert e.goodput_by_speed == pytest.approx(each, rel=2 * p.rel_tol)
        assert e.goodput == pytest.approx(sum(e.goodput_by_speed) / 3)
        # Slower checks, lower goodput: the mean lies between the slowest and the fastest.
        assert e.goodput_by_speed[1] < e.goodput_by_speed[0] <= e.goodput_by_speed[2]
    # Ranked again on the mean; in the JSON, each deployment's goodput at each check.
    assert [e.goodput for e in ranked] == sorted((e.goodput for e in ranked), reverse=True)
    row = profile.to_json(2)["ranking"][0]
    assert row["goodput_rps"] == ranked[0].goodput and len(row["goodput_by_speed_rps"]) == 3
    assert len(profile.to_json(2)["machine"]["speed_sample"]) == 3
    # Averaged once: a second call changes nothing.
    before = [e.goodput for e in ranked]
    profile.average_over_speeds()
    assert [e.goodput for e in profile.result.ranked] == before


def test_a_profile_without_a_speed_sample_keeps_its_goodput_at_the_speed_it_searched_at():
    profile = _profile()
    before = [(e.spec, e.goodput) for e in profile.result.ranked]
    profile.average_over_speeds()
    assert [(e.spec, e.goodput) for e in profile.result.ranked] == before
    assert all(e.goodput_by_speed is None for e in profile.result.ranked)


def test_a_ranking_made_again_orders_by_the_new_goodput_and_keeps_the_rest_after_it():
    from hydrad.planner.search import Evaluation, SearchResult

    p = planner()
    evs = [Evaluation(("EPD", "EPD"), p.bound(("EPD", "EPD")), "ranked", 3.0),
           Evaluation(("EP", "D"), p.bound(("EP", "D")), "ranked", 2.0),
           Evaluation(("E", "PD"), p.bound(("E", "PD")), "below")]
    result = SearchResult(2, evs, {}, 0, 0.0)
    evs[1].goodput = 4.0
    result.rerank(p.rank_key)
    assert [e.spec for e in result.evaluations] == ["1EP+1D", "2EPD", "1E+1PD"]


def test_goodput_at_the_profiles_speed_is_the_searched_one_and_lower_when_slower():
    profile = _profile()
    best = profile.result.ranked[0]
    same = profile.goodput_at(best.roles, {1: Speed(1.0, 0.0)})
    assert same == pytest.approx(best.goodput, rel=profile.planner.rel_tol)
    slower = profile.goodput_at(best.roles, {1: Speed(1.5, 0.0)})
    assert slower < 0.85 * same


class _FakeDaemon:
    started: list[str] = []
    stopped: list[str] = []

    traces: list = []

    def __init__(self, config, log_path, **kwargs):
        _FakeDaemon.started.append(config.engine.parallel.deploy)
        _FakeDaemon.traces.append(kwargs.get("trace_dir"))
        self.url = "http://127.0.0.1:1"

    def stop(self):
        _FakeDaemon.stopped.append(_FakeDaemon.started[-1])


def test_validate_simulates_each_deployment_again_at_the_speed_around_its_run(monkeypatch, tmp_path):
    import hydrad.bench

    profile = _profile()
    specs = [e.spec for e in profile.result.ranked[:2]]
    live = {specs[0]: 3.0, specs[1]: 2.0}
    calls = []

    def fake_bench(config, observer=None):
        spec = _FakeDaemon.started[-1]
        calls.append(("bench", spec))
        # Each daemon is warmed up before its search (the replay starts warm too).
        assert config.warmup == validate_module.LIVE_WARMUP > 0 and config.search is not None
        run = SimpleNamespace(rate=live[spec], summary=SimpleNamespace(attainment=0.95))
        return SimpleNamespace(goodput_total=live[spec], runs=[run], interrupted=False,
                               client_cpu_per_request=0.01 * live[spec])

    checks = iter([{1: Speed(1.2, 0.1)}, {1: Speed(1.4, 0.3)}, {1: Speed(1.0, 0.0)}, {1: Speed(1.0, 0.0)}])

    def speed_check():
        # Which daemons were started and stopped when the machine's speed was checked.
        calls.append(("speed", len(_FakeDaemon.started), len(_FakeDaemon.stopped)))
        return next(checks)

    loaded = {specs[0]: [({"images": 1.5, "decodes": 1.1}, {"images": 40, "decodes": 40}, 0.1),
                         ({"prefills": 1.3}, {"prefills": 20}, 0.0)],
              specs[1]: [({}, {}, 0.0), ({}, {}, 0.0)]}  # too few steps of any kind

    def workers_speed(url):
        # Read from the daemon after its search, before it stops.
        calls.append(("workers", len(_FakeDaemon.started), len(_FakeDaemon.stopped)))
        return loaded[_FakeDaemon.started[-1]]

    _FakeDaemon.started, _FakeDaemon.stopped = [], []
    monkeypatch.setattr(validate_module, "LiveDaemon", _FakeDaemon)
    monkeypatch.setattr(validate_module, "workers_speed", workers_speed)
    monkeypatch.setattr(hydrad.bench, "run_bench", fake_bench)
    rows = validate(profile, load_config(None), tmp_path / "trace.jsonl", specs, log_dir=tmp_path,
                    speed_check=speed_check)
    # A check before each daemon starts and after it stops.
    assert calls == [("speed", 0, 0), ("bench", specs[0]), ("workers", 1, 0), ("speed", 1, 1),
                     ("speed", 1, 1), ("bench", specs[1]), ("workers", 2, 1), ("speed", 2, 2)]
    assert _FakeDaemon.stopped == specs
    first, second = rows
    # Each live daemon keeps its own trace, beside its log.
    assert _FakeDaemon.traces[-2:] == [tmp_path / f"trace-{spec}" for spec in specs]
    assert [row["trace_dir"] for row in rows] == [str(tmp_path / f"trace-{spec}") for spec in specs]
    # The bench client's CPU per request in each search, as the bench measured it.
    assert first["client_cpu_seconds_per_request"] == 0.03 and second["client_cpu_seconds_per_request"] == 0.02
    assert first["speed_around_run"] == {"1": pytest.approx(1.3)}
    # The two checks' spreads as one, the root mean square (profile.mean_speeds).
    assert first["speed_around_run_spread"] == {"1": pytest.approx(0.05 ** 0.5)}
    assert first["simulated_at_run_speed_rps"] == pytest.approx(
        profile.goodput_at(profile.result.ranked[0].roles, {1: Speed(1.3, 0.05 ** 0.5)}))
    assert first["simulated_at_run_speed_rps"] < first["simulated_goodput_rps"]
    assert first["error_at_run_speed"] == pytest.approx((first["simulated_at_run_speed_rps"] - 3.0) / 3.0)
    # At the speed the workers measured under the search's load, pooled by their steps.
    assert first["live_speed_by_kind"] == {"decodes": 1.1, "images": 1.5, "prefills": 1.3}
    assert first["live_speed"] == pytest.approx((40 * 1.5 + 40 * 1.1 + 20 * 1.3) / 100)
    assert first["live_speed_steps"] == {"decodes": 40, "images": 40, "prefills": 20}
    parts = Speed(first["live_speed"], first["live_speed_spread"], first["live_speed_by_kind"])
    assert first["simulated_at_live_speed_rps"] == pytest.approx(
        profile.goodput_at(profile.result.ranked[0].roles, {1: parts}, under_load=True))
    assert first["simulated_at_live_speed_rps"] < first["simulated_goodput_rps"]
    assert first["error_at_live_speed"] == pytest.approx((first["simulated_at_live_speed_rps"] - 3.0) / 3.0)
    assert "simulated_at_live_speed_rps" not in second
    assert second["speed_around_run"] == {"1": 1.0}
    assert second["simulated_at_run_speed_rps"] == pytest.approx(second["simulated_goodput_rps"],
                                                                 rel=profile.planner.rel_tol)
    assert second["error"] == pytest.approx((second["simulated_goodput_rps"] - 2.0) / 2.0)
    assert profile.validation == rows
    ceiling = (1 - profile.planner.rel_tol) * profile.planner.max_rate
    for row in rows:
        assert row["simulated_is_lower_bound"] == (row["simulated_goodput_rps"] >= ceiling)


def test_validate_without_a_speed_check_reports_only_the_profiles_simulation(monkeypatch, tmp_path):
    import hydrad.bench

    profile = _profile()
    spec = profile.result.ranked[0].spec
    _FakeDaemon.started, _FakeDaemon.stopped = [], []
    monkeypatch.setattr(validate_module, "LiveDaemon", _FakeDaemon)
    monkeypatch.setattr(hydrad.bench, "run_bench", lambda config, observer=None: SimpleNamespace(
        goodput_total=1.0, runs=[], interrupted=False, client_cpu_per_request=None))
    monkeypatch.setattr(validate_module, "workers_speed", lambda url: [({}, {}, 0.0)])
    (row,) = validate(profile, load_config(None), tmp_path / "t.jsonl", [spec], log_dir=tmp_path)
    assert "simulated_at_run_speed_rps" not in row and row["live_goodput_rps"] == 1.0


def test_goodput_at_speeds_measured_under_load_leaves_out_the_corun_slowdown():
    """Speeds the workers measured while serving hold the slowdown of steps running beside
    each other; added again, the replay would count it twice."""
    profile = _profile()
    profile.setup = replace(profile.setup, cores=2, threads=1, corun_slowdown={"prefills": 0.5, "decodes": 0.5})
    roles = profile.result.ranked[0].roles
    assert len(roles) == 2
    idle = profile.goodput_at(roles, {1: Speed(1.0, 0.0)})
    loaded = profile.goodput_at(roles, {1: Speed(1.0, 0.0)}, under_load=True)
    assert loaded > idle
    profile.setup = replace(profile.setup, corun_slowdown={})
    assert profile.goodput_at(roles, {1: Speed(1.0, 0.0)}) == pytest.approx(loaded)


def test_the_validate_table_shows_each_comparison(monkeypatch, tmp_path):
    """``hydractl profile --validate``'s table: the profile's speed, the idle checks around
    the run and the workers' own speed, each with its simulated goodput and error; ">=" at
    the replay's ceiling; "-" where a figure is missing."""
    import io

    from rich.console import Console

    import hydrad.cli.profile as cli_profile

    rows = [{"deploy": "2EPD", "simulated_goodput_rps": 12.0, "live_goodput_rps": 10.0, "error": 0.2,
             "simulated_is_lower_bound": False, "speed_around_run": {"1": 1.1, "2": 1.2},
             "simulated_at_run_speed_rps": 11.0, "error_at_run_speed": 0.1,
             "simulated_at_run_speed_is_lower_bound": False,
             "live_speed_by_kind": {"images": 1.31, "prefills": 1.12, "decodes": 1.05},
             "simulated_at_live_speed_rps": 50.0, "error_at_live_speed": 4.0,
             "simulated_at_live_speed_is_lower_bound": True},
            {"deploy": "1EP+1D", "simulated_goodput_rps": 9.0, "live_goodput_rps": None, "error": None}]
    monkeypatch.setattr(validate_module, "validate", lambda *args, **kwargs: rows)
    buf = io.StringIO()
    monkeypatch.setattr(cli_profile, "console", Console(file=buf, width=250))
    profile = _profile()
    cli_profile._validate(profile, load_config(None), tmp_path / "t.jsonl", 2, tmp_path, None)
    lines = buf.getvalue().splitlines()
    first = next(line for line in lines if "2EPD" in line)
    cells = [c.strip() for c in first.split("│")[1:-1]]
    assert cells == ["2EPD", "12", "10", "+20.0%", "1.10x, 1.20x", "11", "+10.0%", "i 1.31x, p 1.12x, d 1.05x",
                     ">=50", ">=+400.0%"]
    second = [c.strip() for c in next(line for line in lines if "1EP+1D" in line).split("│")[1:-1]]
    assert second == ["1EP+1D", "9", "-", "-", "-", "-", "-", "-", "-", "-"]


def test_a_profile_bisects_and_averages_the_deployments_asked_for_beside_its_top():
    from hydrad.config import EngineConfig
    from hydrad.planner.profile import run_profile

    records = trace_records()
    setup = replace(planner().setup, speed_sample=({1: Speed(1.0, 0.0)}, {1: Speed(1.2, 0.0)}))
    kwargs = dict(slo_ttft=2.0, slo_tbt=0.1, top_k=1, num_requests=80, setup=setup, processes=1)
    alone = run_profile(records, EngineConfig(), Devices(("cpu", "cpu")), **kwargs)
    asked = ("EP", "EPD")
    assert next(e for e in alone.result.evaluations if e.roles == asked).goodput is None  # the search left it out
    profile = run_profile(records, EngineConfig(), Devices(("cpu", "cpu")), also=(asked,), **kwargs)
    ev = next(e for e in profile.result.ranked if e.roles == asked)
    assert ev.goodput == pytest.approx(sum(ev.goodput_by_speed) / 2) and ev.goodput_by_speed[1] < ev.goodput_by_speed[0]
    ranked = profile.result.ranked
    assert [e.goodput for e in ranked] == sorted((e.goodput for e in ranked), reverse=True)
    # The rest of the ranking is the same as without it.
    assert [(e.spec, e.goodput) for e in ranked if e is not ev] == [(e.spec, e.goodput) for e in alone.result.ranked]
