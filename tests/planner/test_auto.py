"""``hydrad start --deploy auto``'s choice (``hydrad.planner.auto``): planned from the trace
and kept, a kept plan reused at the next start while it is young and the trace has not
outgrown it, and planned again whenever what it was made for changed."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time

import pytest

from hydrad.config_file import load_config
from hydrad.planner import auto
from hydrad.planner import profile as profile_module
from hydrad.trace import make_record


def write_trace(directory, n, start=1000.0, model="m"):
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "trace.jsonl", "a", encoding="utf-8") as f:
        for i in range(n):
            record = make_record(timestamp=start + i, model=model, prompt_tokens=40, template_tokens=10, images=[],
                                 output_tokens=8, max_tokens=8, finish_reason="length", preprocess=0.001, ttft=0.1,
                                 e2e=0.5, gaps=[0.05] * 7, stages={}, instances=[0], deploy="2EPD")
            f.write(json.dumps(record.to_json()) + "\n")


@pytest.fixture()
def planning(monkeypatch):
    """``plan_deployment`` replaced by one that answers 1EP+1D (or ``answers`` by device count)
    and counts its calls."""
    calls = []

    def plan(records, engine, devices, **kwargs):
        calls.append(len(records))
        plan.devices.append(devices)
        if isinstance(plan.answer, Exception):
            raise plan.answer
        spec, goodput, lower_bound = plan.answers.get(len(devices), (plan.answer, 1.0, False))
        return profile_module.PlannedDeployment(spec, f"planner's pick from {len(records)} traced requests", goodput,
                                                lower_bound)

    def probe(config, devices, **kwargs):  # the one instance of the model the plans of several counts share
        plan.probes.append((devices, kwargs))
        return contextlib.nullcontext()

    plan.answer = "1EP+1D"
    plan.answers = {}
    plan.calls = calls
    plan.devices = []
    plan.probes = []
    monkeypatch.setattr(profile_module, "plan_deployment", plan)
    monkeypatch.setattr(profile_module, "MachineProbe", probe)
    return plan


def config_for(tmp_path, **overrides):
    return load_config(None, {"model.path": str(tmp_path / "m"), "parallel.devices": "cpu:2",
                              "trace.dir": str(tmp_path / "trace"), **overrides})


def test_a_plan_is_kept_and_reused_at_the_next_start(tmp_path, planning, caplog):
    write_trace(tmp_path / "trace", 40)
    config = config_for(tmp_path)
    assert auto.choose_deployment(config) == ("1EP+1D", "planner's pick from 40 traced requests", "cpu:2", None)
    assert planning.calls == [40]
    kept = auto.load_plan(tmp_path / "trace" / auto.PLAN_FILE)
    assert kept.deploy == "1EP+1D" and kept.num_requests == 40 and kept.newest == 1039.0
    assert kept.key.devices == ("cpu", "cpu") and kept.key.model == "m"
    # The next start: the kept plan, without planning.
    with caplog.at_level(logging.INFO, logger="hydrad.planner"):
        spec, reason, _, _ = auto.choose_deployment(config)
    assert spec == "1EP+1D" and planning.calls == [40]
    assert reason.startswith("the plan of 0 min ago, kept in ") and reason.endswith("from 40 traced requests")
    assert "deploy auto: 1EP+1D (the plan of" in caplog.text
    # Fewer new requests than it was planned from: still reused.
    write_trace(tmp_path / "trace", 39, start=2000.0)
    assert auto.choose_deployment(config)[0] == "1EP+1D" and planning.calls == [40]
    # As many new ones as it was planned from: it serves at once while the daemon plans again
    # from the trace's newest requests (all 80 here, the oldest at 1000) ...
    write_trace(tmp_path / "trace", 1, start=3000.0)
    planning.answer = "1ED+1P"
    choice = auto.choose_deployment(config)
    assert (choice.deploy, choice.refresh_since, planning.calls) == ("1EP+1D", 1000.0, [40])
    assert "while a new one is made (40 requests traced since the kept plan, which was made from 40)" in choice.reason
    # ... or, where the start must not serve first, the start plans again, on the newest.
    with caplog.at_level(logging.INFO, logger="hydrad.planner"):
        choice = auto.choose_deployment(config, refresh=False)
    assert (choice.deploy, choice.refresh_since) == ("1ED+1P", None)
    assert planning.calls == [40, 80]
    assert "40 requests traced since the kept plan, which was made from 40" in caplog.text
    assert auto.load_plan(tmp_path / "trace" / auto.PLAN_FILE).deploy == "1ED+1P"


def test_a_plan_for_other_inputs_or_too_old_is_made_again(tmp_path, planning, caplog):
    write_trace(tmp_path / "trace", 20)
    auto.choose_deployment(config_for(tmp_path))
    assert len(planning.calls) == 1
    # Another SLO, router policy or device count: planned again (and kept in its place).
    for overrides in ({"slo.ttft": 3.0}, {"server.router_policy": "least-load"}, {"parallel.devices": "cpu:3"},
                      {"model.dtype": "bfloat16"}, {"cache.kv_cache_memory_mb": 64}):
        with caplog.at_level(logging.INFO, logger="hydrad.planner"):
            auto.choose_deployment(config_for(tmp_path, **overrides))
        assert "the kept plan was made for other inputs: " in caplog.text
        caplog.clear()
    assert len(planning.calls) == 6
    # The deployment the daemon ran since is not part of the key.
    kept = auto.load_plan(tmp_path / "trace" / auto.PLAN_FILE)
    config = config_for(tmp_path, **{"cache.kv_cache_memory_mb": 64})
    ran = dataclasses.replace(config.engine, parallel=dataclasses.replace(config.engine.parallel, deploy="1EP+1D"))
    assert auto.plan_key("m", ["cpu", "cpu"], ran, "round-robin", tmp_path / "trace") == kept.key
    # reuse_hours = 0: every start plans.
    config = config_for(tmp_path, **{"planner.reuse_hours": 0.0})
    auto.choose_deployment(config)
    auto.choose_deployment(config)
    assert len(planning.calls) == 8
    # Older than reuse_hours: planned again.
    path = tmp_path / "trace" / auto.PLAN_FILE
    old = json.loads(path.read_text())
    old["made_at"] -= 25 * 3600
    path.write_text(json.dumps(old))
    assert auto.choose_deployment(config_for(tmp_path)).refresh_since == 1000.0 and len(planning.calls) == 8
    with caplog.at_level(logging.INFO, logger="hydrad.planner"):
        auto.choose_deployment(config_for(tmp_path), refresh=False)
    assert len(planning.calls) == 9 and "h old (reuse_hours = 24)" in caplog.text
    # A trace given by --trace (the same folder here), or a plan made for other inputs: planned
    # before serving.
    for start in ({"trace_path": str(tmp_path / "trace")}, {"config": config_for(tmp_path, **{"slo.ttft": 2.5})}):
        old = json.loads(path.read_text())
        old["made_at"] -= 25 * 3600
        path.write_text(json.dumps(old))
        choice = auto.choose_deployment(start.get("config", config_for(tmp_path)), start.get("trace_path"))
        assert choice.refresh_since is None and not choice.reason.startswith("the plan of ")
    assert len(planning.calls) == 11


def test_an_unreadable_plan_is_replaced_and_a_failed_plan_is_not_kept(tmp_path, planning, caplog):
    write_trace(tmp_path / "trace", 20)
    path = tmp_path / "trace" / auto.PLAN_FILE
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="hydrad.planner"):
        assert auto.choose_deployment(config_for(tmp_path))[0] == "1EP+1D"
    assert "ignoring the kept plan" in caplog.text and auto.load_plan(path).deploy == "1EP+1D"
    path.unlink()
    planning.answer = RuntimeError("no machine")
    spec, reason, devices, _ = auto.choose_deployment(config_for(tmp_path))
    assert spec == "2EPD" and "RuntimeError: no machine" in reason and not path.exists() and devices == "cpu:2"


def test_without_room_in_shared_memory_the_pick_is_the_deployment_whose_pools_stay_private(tmp_path, planning,
                                                                                             monkeypatch, caplog):
    """Every deployment but one EPD instance per device moves requests between instances, with
    the CPU pools in /dev/shm: where they cannot fit (a container's 64 MB), ``--deploy auto``
    starts the one that works there, without planning, and says why."""
    from types import SimpleNamespace

    from hydrad.cluster import preflight

    write_trace(tmp_path / "trace", 40)
    monkeypatch.setattr(preflight, "SHM", str(tmp_path))  # a 64 MiB /dev/shm
    monkeypatch.setattr(preflight.os, "statvfs", lambda path: SimpleNamespace(f_bavail=64 * 256, f_frsize=4096))
    with caplog.at_level(logging.WARNING, logger="hydrad.planner"):
        spec, reason, _, _ = auto.choose_deployment(config_for(tmp_path))
    assert spec == "2EPD" and planning.calls == []
    assert reason.startswith("one EPD instance per device, the one deployment whose pools stay private: "
                             f"{tmp_path} has 64 MiB free, and the cache pools of 2 CPU instance(s) take 1536 MiB")
    assert reason in caplog.text
    # Smaller pools fit: planned as usual.
    spec = auto.choose_deployment(config_for(tmp_path, **{"cache.kv_cache_memory_mb": 16,
                                                          "cache.image_cache_memory_mb": 8})).deploy
    assert spec == "1EP+1D" and planning.calls == [40]


def test_a_profile_kept_is_the_plan_of_the_start_with_its_inputs(tmp_path, planning):
    """``hydractl profile --keep``: the start with the profile's devices, SLO and trace deploys
    its pick without planning; a start for other inputs plans as before."""
    from hydrad.errors import ConfigError

    write_trace(tmp_path / "trace", 40)
    from hydrad.trace import read_trace

    records = read_trace(tmp_path / "trace")
    config = config_for(tmp_path, **{"slo.ttft": 3.0})
    path = auto.keep_profile(config, "cpu:2", tmp_path / "trace", records, "1E+1PD", "the pick of hydractl profile",
                             now=time.time() - 120)
    assert path == tmp_path / "trace" / auto.PLAN_FILE
    spec, reason, devices, _ = auto.choose_deployment(config)
    assert (spec, devices) == ("1E+1PD", "cpu:2") and planning.calls == []
    assert reason.startswith("the plan of 2 min ago, kept in ") and reason.endswith(": the pick of hydractl profile")
    # Given the trace folder by --trace, as the profile read it: the same plan.
    assert auto.choose_deployment(config, str(tmp_path / "trace")).deploy == "1E+1PD" and planning.calls == []
    # The config's own [slo] (TTFT 2 s), a trace file instead of the folder: planned.
    assert auto.choose_deployment(config_for(tmp_path)).deploy == "1EP+1D" and planning.calls == [40]
    auto.keep_profile(config, "cpu:2", tmp_path / "trace", records, "1E+1PD", "again")
    assert auto.choose_deployment(config, str(tmp_path / "trace" / "trace.jsonl")).deploy == "1EP+1D"
    assert planning.calls == [40, 40]
    # A start that picks its count of CPU workers plans itself: nothing to keep for it.
    with pytest.raises(ConfigError, match="--devices auto on CPU cores"):
        from hydrad.engine import cores

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(cores, "usable_cpus", lambda: 2)
            auto.keep_profile(config, "auto", tmp_path / "trace", records, "2EPD", "why")
    # A trace folder that cannot be written: one clear error.
    (tmp_path / "ro").write_text("a file where the folder should be")
    with pytest.raises(ConfigError, match="cannot keep the plan in "):
        auto.keep_profile(config_for(tmp_path, **{"trace.dir": str(tmp_path / "ro")}), "cpu:2", tmp_path / "trace",
                          records, "2EPD", "why")


def test_reasons_a_kept_plan_is_not_reused(tmp_path):
    engine = load_config(None, {}).engine
    key = auto.plan_key("m", ["cpu", "cpu"], engine, "round-robin", tmp_path)
    plan = auto.KeptPlan(key, "1EP+1D", "why", made_at=1000.0, num_requests=100, newest=900.0)
    assert auto.KeptPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    assert auto.reusable(None, key, [], reuse_hours=24, now=1000.0) == "no plan kept"
    assert auto.reusable(plan, key, [], reuse_hours=24, now=1060.0) is None
    assert "reuse_hours = 0" in auto.reusable(plan, key, [], reuse_hours=0, now=1060.0)
    other = auto.plan_key("m2", ["cpu", "cpu"], engine, "round-robin", tmp_path / "elsewhere")
    assert auto.reusable(plan, other, [], reuse_hours=24, now=1060.0) == \
        "the kept plan was made for other inputs: model, trace"
    slower = load_config(None, {"slo.ttft": 3.0}).engine
    assert auto.reusable(plan, auto.plan_key("m", ["cpu", "cpu"], slower, "round-robin", tmp_path), [],
                         reuse_hours=24, now=1060.0) == "the kept plan was made for other inputs: engine settings"
    assert "h old" in auto.reusable(plan, key, [], reuse_hours=1, now=1000.0 + 3600)
    assert "clock was set back" in auto.reusable(plan, key, [], reuse_hours=24, now=900.0)


def test_the_cpu_worker_counts_a_plan_picks_among():
    assert auto.cpu_worker_counts(2) == [1, 2]
    assert auto.cpu_worker_counts(3) == [1, 2, 3]
    assert auto.cpu_worker_counts(6) == [1, 2, 4, 6]
    assert auto.cpu_worker_counts(64) == [1, 2, 4, 8]


def test_more_workers_are_picked_only_when_clearly_ahead():
    def plans(*rows):
        return {n: profile_module.PlannedDeployment(f"{n}EPD", "", goodput, bound) for n, goodput, bound in rows}

    assert auto.pick_worker_count(plans((1, 4.0, False), (2, 5.0, False))) == 2
    assert auto.pick_worker_count(plans((1, 4.0, False), (2, 4.1, False))) == 1  # within the margin
    assert auto.pick_worker_count(plans((1, 50.0, True), (2, 50.0, True))) == 1  # both at the ceiling
    assert auto.pick_worker_count(plans((1, 4.0, False), (2, 5.0, False), (4, 5.1, False))) == 2
    assert auto.pick_worker_count(plans((1, 4.0, False), (2, 3.0, False), (4, 6.0, False))) == 4


@pytest.fixture()
def two_cores(monkeypatch):
    from hydrad.engine import cores

    monkeypatch.setattr(cores, "usable_cpus", lambda: 2)


def test_devices_auto_without_a_gpu_plans_the_count_of_cpu_workers_too(tmp_path, planning, two_cores, caplog,
                                                                       monkeypatch):
    """``--devices auto`` on a CPU machine: one worker until there is a trace; then the plan
    ranks the deployments of one worker (all the cores) and of one per core, and runs the
    better count; a restart comes back on it, as long as its workers still fit in memory."""
    from hydrad.cluster import preflight

    config = config_for(tmp_path, **{"parallel.devices": "auto"})
    assert auto.choose_deployment(config)[::2] == ("1EPD", "auto")  # no trace: one worker
    assert planning.calls == []
    write_trace(tmp_path / "trace", 40)
    planning.answers = {1: ("1EPD", 4.0, False), 2: ("2EPD", 6.0, False)}
    with caplog.at_level(logging.INFO, logger="hydrad.planner"):
        choice = auto.choose_deployment(config)
    assert (choice.deploy, choice.devices) == ("2EPD", "cpu:2")
    assert [d.devices for d in planning.devices] == [("cpu",), ("cpu", "cpu")]
    # ... measured on one probe, with the models of both counts and one speed check.
    assert [(d.devices, kwargs) for d, kwargs in planning.probes] == [
        (("cpu", "cpu"), {"keep_check": True, "thread_counts": (2, 1)})]
    assert choice.reason.startswith("2 CPU worker(s) of 1 thread(s): planner's pick from 40 traced requests")
    assert choice.reason.endswith("(the count picked too: 1 worker(s): 1EPD 4 req/s)")
    assert "deploy auto: 2EPD on cpu:2" in caplog.text
    kept = auto.load_plan(tmp_path / "trace" / auto.PLAN_FILE)
    assert kept.devices == "cpu:2" and kept.key.devices == ("auto:cpu:2",)
    # The next start: the kept plan, on its devices.
    choice = auto.choose_deployment(config)
    assert (choice.deploy, choice.devices) == ("2EPD", "cpu:2") and choice.reason.startswith("the plan of ")
    assert len(planning.calls) == 2
    # Two workers no longer fit in memory: one, without planning.
    with monkeypatch.context() as patch:
        patch.setattr(preflight, "memory_shortfall",
                      lambda engine, n, path: None if n == 1 else f"the {n} CPU worker(s) need about 9 MiB")
        choice = auto.choose_deployment(config)
    assert choice == ("1EPD", "one EPD instance: the 2 CPU worker(s) need about 9 MiB", "auto", None)
    assert len(planning.calls) == 2
    # One worker ahead, or as good: one worker.
    (tmp_path / "trace" / auto.PLAN_FILE).unlink()
    planning.answers = {1: ("1EPD", 6.0, False), 2: ("1EP+1D", 6.1, False)}
    assert auto.choose_deployment(config)[::2] == ("1EPD", "cpu:1")


def test_profile_keep_needs_the_trace_a_start_reads(tmp_path):
    from click.testing import CliRunner

    from hydrad.cli.hydractl_main import cli

    run = CliRunner().invoke(cli, ["profile", "--url", "http://127.0.0.1:9", "--slo-ttft", "2", "--slo-tbt", "0.2",
                                   "--keep"])
    assert run.exit_code == 2 and "--keep needs --trace" in run.output and "Traceback" not in run.output
