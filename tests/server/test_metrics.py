from prometheus_client import generate_latest

from hydrad.engine.inputs import EngineStats
from hydrad.server.metrics import Metrics, RollingWindow, percentile


def test_percentile_nearest_rank():
    values = [float(v) for v in range(1, 11)]
    assert (percentile(values, 50), percentile(values, 90), percentile(values, 100)) == (5.0, 9.0, 10.0)
    assert percentile([], 50) is None


def test_finished_request_metrics_and_stage_times():
    metrics = Metrics("m")
    metrics.observe_first_token(0.2, 1)
    metrics.observe_next_tokens(0.01, 1)
    metrics.observe_finished("length", 0.5, 12, 2, {"encode_queue": 0.01, "encode_exec": 0.02,
                                                   "prefill_exec": 0.03, "decode_queue": 0.0,
                                                   "encode_to_prefill_migration": 0.004})
    metrics.set_instance(0, "cpu", "EPD", True, EngineStats(2, 1, 0.5, 0.25, 8, 1, 3, live_speed={"images": 1.25},
                                                                 prefix_cache_queries=300, prefix_cache_hits=96,
                                                                 images_cached=2, num_overrun_steps=4,
                                                                 num_slack_steps=5, num_held_steps=6,
                                                                 num_guarded_steps=7))
    metrics.set_instance(1, "cpu", "EPD", False, None)
    metrics.set_instance(2, "cpu", "EPD", True, None)  # alive, but busy past the stats timeout
    text = generate_latest(metrics.registry).decode()
    for line in [
        'hydrad_time_to_first_token_seconds_count{model_name="m"} 1.0',
        'hydrad_inter_token_latency_seconds_count{model_name="m"} 1.0',
        'hydrad_e2e_request_latency_seconds_count{model_name="m"} 1.0',
        'hydrad_stage_queue_time_seconds_count{model_name="m",stage="encode"} 1.0',
        'hydrad_stage_exec_time_seconds_count{model_name="m",stage="prefill"} 1.0',
        'hydrad_migration_time_seconds_count{edge="encode_to_prefill",model_name="m"} 1.0',
        'hydrad_requests_finished_total{finish_reason="length",model_name="m"} 1.0',
        'hydrad_generation_tokens_total{model_name="m"} 2.0',
        'hydrad_prompt_tokens_total{model_name="m"} 12.0',
        'hydrad_kv_cache_usage_ratio{device="cpu",instance="0",model_name="m",role="EPD"} 0.5',
        'hydrad_step_calibration_ratio{device="cpu",instance="0",model_name="m",role="EPD"} 1.0',
        'hydrad_num_requests_waiting{device="cpu",instance="0",model_name="m",role="EPD"} 1.0',
        'hydrad_step_speed_ratio{instance="0",kind="images",model_name="m"} 1.25',
        'hydrad_instance_up{device="cpu",instance="1",model_name="m",role="EPD"} 0.0',
        'hydrad_instance_up{device="cpu",instance="2",model_name="m",role="EPD"} 1.0',
        'hydrad_prefix_cache_queries_total{instance="0",model_name="m"} 300.0',
        'hydrad_prefix_cache_hits_total{instance="0",model_name="m"} 96.0',
        'hydrad_prefix_cache_images_total{instance="0",model_name="m"} 2.0',
        'hydrad_preemptions_total{instance="0",model_name="m"} 3.0',
        'hydrad_steps_over_bound_total{instance="0",model_name="m"} 4.0',
        'hydrad_steps_on_tbt_slack_total{instance="0",model_name="m"} 5.0',
        'hydrad_steps_holding_prompts_total{instance="0",model_name="m"} 6.0',
        'hydrad_steps_guarded_total{instance="0",model_name="m"} 7.0',
    ]:
        assert line in text, line


def test_the_deployment_and_its_changes():
    from hydrad.cluster.supervisor import Deployment
    from hydrad.server.metrics import MergedRegistry

    metrics = Metrics("m")
    # A process that serves no deployment (a front-end process): the families, no samples.
    assert 'hydrad_deployment_info{' not in generate_latest(metrics.registry).decode()
    assert "# TYPE hydrad_redeploys_total counter" in generate_latest(metrics.registry).decode()
    history = [Deployment("2EPD", 1.0, "start"), Deployment("1EP+1D", 2.0, "redeploy", 3.0, "admin"),
               Deployment("2EPD", 3.0, "auto: 200 requests ...", 1.5, "auto"),
               Deployment("1E+1PD", 4.0, "redeploy", 2.0, "admin")]
    metrics.set_deployment("1E+1PD", history, 1, {"keep": 4, "redeploy": 1})
    text = generate_latest(metrics.registry).decode()
    for line in [
        'hydrad_deployment_info{deploy="1E+1PD",model_name="m"} 1.0',
        'hydrad_redeploys_total{model_name="m",trigger="admin"} 2.0',
        'hydrad_redeploys_total{model_name="m",trigger="auto"} 1.0',
        'hydrad_redeploy_seconds_total{model_name="m",trigger="admin"} 5.0',
        'hydrad_redeploy_seconds_total{model_name="m",trigger="auto"} 1.5',
        'hydrad_redeploy_failures_total{model_name="m"} 1.0',
        'hydrad_replan_decisions_total{action="keep",model_name="m"} 4.0',
        'hydrad_replan_decisions_total{action="redeploy",model_name="m"} 1.0',
    ]:
        assert line in text, line
    assert text.count("hydrad_deployment_info{") == 1  # only the one served now
    # Merged with a front-end process's (which has none), the numbers stay the daemon's.
    merged = MergedRegistry([list(metrics.registry.collect()), list(Metrics("m").registry.collect())])
    assert 'hydrad_redeploys_total{model_name="m",trigger="admin"} 2.0' in generate_latest(merged).decode()
    # Workers restarted, requests lost with one and run again (the daemon's; none elsewhere).
    assert 'hydrad_worker_restarts_total{' not in text
    metrics.set_failures({0: 0, 1: 2}, 3, 5, 4096)
    text = generate_latest(metrics.registry).decode()
    for line in ['hydrad_worker_restarts_total{instance="0",model_name="m"} 0.0',
                 'hydrad_worker_restarts_total{instance="1",model_name="m"} 2.0',
                 'hydrad_requests_lost_total{model_name="m"} 3.0', 'hydrad_requests_run_again_total{model_name="m"} 5.0',
                 'hydrad_rerun_image_bytes{model_name="m"} 4096.0']:
        assert line in text, line
    # Not re-planning: no decisions.
    metrics.set_deployment("1E+1PD", history[:1], 0, None)
    text = generate_latest(metrics.registry).decode()
    assert "hydrad_replan_decisions_total{" not in text
    assert 'hydrad_redeploys_total{model_name="m",trigger="admin"} 0.0' in text


def test_registries_are_per_app():
    a, b = Metrics("m"), Metrics("m")
    a.observe_finished("stop", 1.0, 1, 0, None)
    assert 'finish_reason="stop"' not in generate_latest(b.registry).decode()


def test_rolling_window_summary():
    window = RollingWindow(seconds=10.0)
    for v in (0.1, 0.2, 0.3):
        window.add_ttft(v)
        window.add_finished()
    summary = window.summary()
    assert summary["request_rate"] == 0.3
    assert (summary["ttft_p50"], summary["ttft_p90"], summary["tbt_p50"]) == (0.2, 0.3, None)


def test_every_metric_is_documented_with_its_unit():
    """docs/daemon.md's metrics table lists exactly the metrics hydrad exposes, each with a unit."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "daemon.md").read_text()
    section = doc.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    units = {}
    for line in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        name = re.match(r"`(hydrad_\w+)", cells[0]) if cells else None
        if name:
            units[name.group(1)] = cells[2]
    from hydrad.processed_images import ProcessedImages
    from hydrad.server.response_store import ResponseStore

    from hydrad.config_file import ServerConfig
    from hydrad.server.admission import Admission

    metrics = Metrics("m", ProcessedImages(0), ResponseStore(1))
    metrics.watch_admission(Admission(ServerConfig(), None))
    registry = metrics.registry
    exposed = {f.name + "_total" if f.type == "counter" else f.name for f in registry.collect()
               if f.name.startswith("hydrad_")}  # and Prometheus' standard process_* metrics
    assert set(units) == exposed
    assert all(units.values()), units


def test_frontend_monitor_reports_loop_lag_and_cpu_per_token():
    import asyncio
    import time

    from hydrad.server.monitor import FrontendMonitor

    metrics = Metrics("m")

    async def main():
        monitor = FrontendMonitor(metrics, interval=0.01)
        monitor.start()
        await asyncio.sleep(0.05)
        assert monitor.cpu_per_token() is None  # no token yet
        end = time.process_time() + 0.3
        while time.process_time() < end:  # a callback that holds the loop for 0.3 s of CPU
            pass
        metrics.observe_first_token(0.1, 1000)
        await asyncio.sleep(0.02)
        monitor._sample(time.monotonic())
        status = monitor.status()
        await monitor.stop()
        return monitor, status

    monitor, status = asyncio.run(main())
    assert 0.25 <= status["loop_lag_max"] < 2.0 and status["loop_lag_p99"] <= status["loop_lag_max"]
    # ~0.3 s of CPU for 1000 tokens: about 300 us a token
    assert 2e-4 <= status["cpu_per_token"] <= 2e-3 and 0.05 <= status["cpu_share"] <= 1.5
    text = generate_latest(metrics.registry).decode()
    assert 'hydrad_event_loop_lag_seconds_count{model_name="m"}' in text
    lag_sum = next(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith('hydrad_event_loop_lag_seconds_sum{model_name="m"}'))
    assert lag_sum >= 0.25
    per_token = next(float(line.split()[-1]) for line in text.splitlines()
                     if line.startswith('hydrad_daemon_cpu_seconds_per_token{model_name="m"}'))
    assert per_token == status["cpu_per_token"]
    assert "process_cpu_seconds_total" in text


def test_step_output_delay_and_unread_bytes_per_instance():
    metrics = Metrics("m")
    metrics.observe_step(3, None, 0.004)
    metrics.observe_step(3, None, None)  # not stamped: not counted
    metrics.set_instance(3, "cpu", "D", True, None, unread_bytes=4096)
    text = generate_latest(metrics.registry).decode()
    assert 'hydrad_step_output_delay_seconds_count{instance="3",model_name="m"} 1.0' in text
    assert 'hydrad_worker_link_unread_bytes{instance="3",model_name="m"} 4096.0' in text
