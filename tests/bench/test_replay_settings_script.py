"""The pure parts of ``bench/replay_settings.py``: reading a setting, summing up errors. The
replays themselves are the benchmark."""

from __future__ import annotations

import math

import pytest


@pytest.fixture(scope="module")
def script(bench_script):
    return bench_script("replay_settings")


def test_a_corun_setting_reads_per_kind_and_names_a_bad_part(script):
    assert script.parse_kinds("images=0.14, prefills=0.1,decodes=0") == {"images": 0.14, "prefills": 0.1,
                                                                       "decodes": 0.0}
    assert script.parse_kinds("") == {}
    for bad in ("images", "vision=0.1", "images=fast"):
        with pytest.raises(SystemExit, match=repr(bad.strip())):
            script.parse_kinds(bad)


def test_errors_are_summed_up_with_their_sign_and_by_size(script):
    s = script.summarize([0.1, -0.2, 0.3, 0.15])
    assert s["rounds"] == 4
    assert s["mean"] == pytest.approx(0.0875) and s["median"] == pytest.approx(0.125)
    assert s["mean_abs"] == pytest.approx(0.1875)
    assert s["within_15pct"] == 2  # 0.1 and 0.15; -0.2 and 0.3 are out


def test_a_setting_takes_its_defaults_and_rejects_bad_values_in_one_line(script):
    defaults = {"corun_slowdown": {"images": 0.14}, "all_cores_slowdown": {"prefills": 0.18}}
    assert script.make_setting(None, "no", 32, 0.0, defaults) == {
        "corun_slowdown": {"images": 0.14}, "all_cores_slowdown": {"prefills": 0.18}, "client_cpu": False,
        "warm_requests": 32, "noise_correlation": 0.0, "speed": "check", "team_waits": False}
    assert script.make_setting(None, "no", 0, 0.0, defaults, team="yes")["team_waits"] is True
    assert script.make_setting("decodes=0.1", "yes", 0, 0.6, defaults)["corun_slowdown"] == {"decodes": 0.1}
    assert script.make_setting(None, "no", 0, 0.0, defaults, all_cores="")["all_cores_slowdown"] == {}
    with pytest.raises(SystemExit, match="warm-up requests must be >= 0, got -1"):
        script.make_setting(None, "no", -1, 0.0, defaults)
    with pytest.raises(SystemExit, match=r"noise correlation must be in \[0, 1\), got 1.0"):
        script.make_setting(None, "no", 0, 1.0, defaults)


def workload(check: float, around: list[float], basis: dict | None = None) -> dict:
    """One workload of an accuracy run's JSON: its profile's check, one deployment's rounds."""
    machine = {"speed_vs_latency_model": {"1": check}, "speed_by_kind": {"1": {"decodes": check}}}
    if basis is not None:
        machine["speed_basis"] = {"1": basis}
    return {"profile": {"machine": machine},
            "deployments": [{"rounds": [{"speed_around_run": {"1": f}, "speed_around_run_by_kind": {"1": {"decodes": f}}}
                                        for f in around]}]}


def test_a_profile_is_replayed_at_its_check_or_at_the_median_with_the_runs_earlier_checks(script):
    run = {"workloads": [workload(1.3, [1.0, 1.1]), workload(1.4, [1.0])]}
    assert script.planned_speeds(run, 1, "check", 0.1)[1].factor == 1.4
    # The first profile: its check and the fit; the second: 1.3, 1.0, 1.1 before it, 1.4, the fit.
    assert script.planned_speeds(run, 0, "history", 0.1)[1].factor == pytest.approx(1.15)
    second = script.planned_speeds(run, 1, "history", 0.1)[1]
    assert second.factor == pytest.approx(1.1) and second.parts == pytest.approx({"decodes": 1.1})
    # A run planned with the history: the speed it planned at, and its check alone from the basis.
    planned = {"check_now": 1.5, "check_now_by_kind": {"decodes": 1.5}, "earlier_checks": 3, "with_fit": True,
               "planned_at": 1.2}
    run = {"workloads": [workload(1.2, [1.0], planned)]}
    assert script.planned_speeds(run, 0, "history", 0.1)[1].factor == 1.2
    assert script.planned_speeds(run, 0, "check", 0.1)[1].factor == 1.5
    # Stored overall only: per kind, the planned speed scaled by the check's factor over the planned one.
    del planned["check_now_by_kind"]
    assert script.planned_speeds(run, 0, "check", 0.1)[1].parts == pytest.approx({"decodes": 1.5})
    # How far off the mean speed around the live runs each was (|log|).
    assert script.speed_off(script.planned_speeds(run, 0, "check", 0.1), run["workloads"][0]) == \
        pytest.approx([math.log(1.5)])


def test_a_profile_is_replayed_over_its_speed_sample_or_on_the_checks_of_earlier_runs(script):
    run = {"workloads": [workload(1.3, [1.0, 1.1]), workload(1.4, [1.0])]}
    # The speed sample: the run's earlier checks (1.3, then the two around the first runs), the check, the fit.
    sample = script.planned_speeds(run, 1, "sample", 0.1)
    assert [c[1].factor for c in sample] == pytest.approx([1.3, 1.0, 1.1, 1.4, 1.0])
    assert [c[1].factor for c in script.planned_speeds(run, 0, "sample", 0.1)] == [1.3, 1.0]
    # Chained: the checks of the runs before, here 1.2 and 1.25, count for the first profile too,
    # and a run planned with the history is planned again from them.
    chained = [{1: script_speed(1.2)}, {1: script_speed(1.25)}]
    assert [c[1].factor for c in script.planned_speeds(run, 0, "sample", 0.1, chained)] == [1.2, 1.25, 1.3, 1.0]
    assert script.planned_speeds(run, 0, "history", 0.1, chained)[1].factor == pytest.approx(1.225)
    planned = {"check_now": 1.5, "earlier_checks": 3, "with_fit": True, "planned_at": 1.1}
    stored = {"workloads": [workload(1.1, [1.0], planned)]}
    assert script.planned_speeds(stored, 0, "history", 0.1)[1].factor == 1.1
    assert script.planned_speeds(stored, 0, "history", 0.1, chained)[1].factor == pytest.approx(1.225)


def script_speed(factor: float):
    from hydrad.engine.machine_speed import Speed

    return Speed(factor, 0.1, {"decodes": factor})
