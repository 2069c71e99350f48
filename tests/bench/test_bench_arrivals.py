import json
import random
import statistics

import pytest

from hydrad.bench.arrivals import Trace, load_mooncake_trace, poisson_arrivals, trace_arrivals
from hydrad.errors import ConfigError


def test_poisson_has_the_rate_and_exponential_gaps():
    times = poisson_arrivals(5.0, random.Random(0), num_requests=20000, duration=None)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and len(times) == 20000
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.03)
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.05)


def test_duration_bounds_the_arrivals():
    times = poisson_arrivals(100.0, random.Random(1), num_requests=None, duration=2.0)
    assert max(times) <= 2.0 and 150 < len(times) < 250


def write_mooncake(path, timestamps_ms, lengths=True):
    rows = [{"timestamp": t, "hash_ids": [i]} | ({"input_length": 100 + i, "output_length": 10} if lengths else {})
            for i, t in enumerate(timestamps_ms)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mooncake_timestamps_are_milliseconds_and_sorted(tmp_path):
    trace = load_mooncake_trace(write_mooncake(tmp_path / "t.jsonl", [3000, 1000, 1000, 2000]))
    assert trace.timestamps == (0.0, 0.0, 1.0, 2.0)
    assert trace.input_lengths == (101, 102, 103, 100)
    assert trace.mean_rate == pytest.approx(1.5)  # 3 gaps over 2 s


def test_trace_is_rescaled_to_the_mean_rate_and_keeps_its_bursts():
    trace = Trace((0.0, 0.0, 3.0, 3.0))  # period 4 s: a mean rate of 1 req/s
    assert trace_arrivals(trace, 2.0, num_requests=6, duration=None) == pytest.approx([0, 0, 1.5, 1.5, 2, 2])
    assert trace_arrivals(trace, 2.0, num_requests=None, duration=1.6) == pytest.approx([0, 0, 1.5, 1.5])


def test_uniform_trace_gives_exact_gaps():
    trace = Trace(tuple(0.1 * i for i in range(10)))
    times = trace_arrivals(trace, 40.0, num_requests=25, duration=None)
    assert [b - a for a, b in zip(times, times[1:])] == pytest.approx([0.025] * 24)


@pytest.mark.parametrize("content", ['{"ts": 1}\n', "not json\n", '{"timestamp": 5}\n'])
def test_bad_traces_are_config_errors(tmp_path, content):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError):
        load_mooncake_trace(path)


def test_trace_without_lengths(tmp_path):
    trace = load_mooncake_trace(write_mooncake(tmp_path / "t.jsonl", [0, 500], lengths=False))
    assert trace.timestamps == (0.0, 0.5) and trace.input_lengths is None
