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
    metrics.set_instance(0, "cpu", "EPD", True, EngineStats(2, 1, 0.5, 0.25, 8, 1, 0))
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
        'hydrad_num_requests_waiting{device="cpu",instance="0",model_name="m",role="EPD"} 1.0',
        'hydrad_instance_up{device="cpu",instance="1",model_name="m",role="EPD"} 0.0',
        'hydrad_instance_up{device="cpu",instance="2",model_name="m",role="EPD"} 1.0',
    ]:
        assert line in text, line


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
    exposed = {f.name + "_total" if f.type == "counter" else f.name for f in Metrics("m").registry.collect()}
    assert set(units) == exposed
    assert all(units.values()), units
