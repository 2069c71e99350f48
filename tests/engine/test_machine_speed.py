"""The speed check (the machine against its fitted latency model, per kind of work), its
history beside the model's cache file, and the speed a plan is made at."""

from __future__ import annotations

import json
import math
import multiprocessing

import pytest

from hydrad.engine.latency_model import LatencyModel
from hydrad.engine.machine_speed import (
    SPEED_HISTORY,
    Speed,
    measure_speed,
    recent_speeds,
    record_speed,
    speed_history_path,
    speed_probes,
    typical_speed,
)
from hydrad.engine.profiler import Probe


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """A fresh cache per test, so no test sees another's speed history."""
    monkeypatch.setenv("HYDRAD_CACHE_DIR", str(tmp_path))
    return tmp_path / "latency"


def _stored(images=(), prefills=(), decodes=(), seconds=0.1) -> dict:
    return {"images": [list(x) for x in images], "prefills": [list(x) for x in prefills],
            "decodes": list(decodes), "seconds": seconds}


STORED = [
    _stored(images=[(257, 256)], seconds=0.02), _stored(images=[(257, 256)] * 4, seconds=0.08),
    _stored(images=[(577, 576)], seconds=0.05),  # another image size
    _stored(prefills=[(0, 128)], seconds=0.06), _stored(prefills=[(0, 512)], seconds=0.25),
    _stored(decodes=[300] * 8, seconds=0.2), _stored(decodes=[300] * 32, seconds=0.4),  # none within the limit
    _stored(prefills=[(0, 16)], decodes=[300] * 8, seconds=0.03),  # mixed: never taken
    _stored(prefills=[(0, 64)], seconds=float("nan")),
    {**_stored(prefills=[(0, 256)], seconds=0.1), "priced": True},  # a scoring prompt's: never taken
]


def test_the_speed_check_times_one_probe_of_each_kind_the_model_stored():
    model = LatencyModel(l_fixed=0.01, meta={"probes": STORED})
    picked = speed_probes(model)
    # Per kind the longest within 0.15 s, else the shortest; mixed or priced probes never.
    assert picked == [(Probe(images=((257, 256),) * 4), 0.08), (Probe(prefills=((0, 128),)), 0.06),
                      (Probe(decodes=(300,) * 8), 0.2)]
    # Only probes of the images the engine can make.
    picked = speed_probes(model, {(577, 576)})
    assert picked[0] == (Probe(images=((577, 576),)), 0.05)
    assert speed_probes(LatencyModel(l_fixed=0.01)) == []


def test_the_speed_check_is_the_median_ratio_of_the_probes_timed_again():
    model = LatencyModel(l_fixed=0.01, meta={"probes": STORED})
    # Each probe now runs 1.3x (images), 1.2x (prefill), 1.5x (decodes) its stored time.
    factors = {"images": 1.3, "prefills": 1.2, "decodes": 1.5}
    timed = []

    def timer(probe):
        kind = "images" if probe.images else "prefills" if probe.prefills else "decodes"
        timed.append(kind)
        stored = next(s for p, s in speed_probes(model) if p == probe)
        return stored * factors[kind]

    speed = measure_speed(None, model, timer=timer, rounds=2)
    assert timed == ["images", "prefills", "decodes"] * 2
    assert speed.factor == pytest.approx(1.3)
    # The spread from the median deviation of the log ratios from theirs (log 1.3): of 0,
    # log(1.3 / 1.2) and log(1.5 / 1.3), each twice.
    assert speed.spread == pytest.approx(math.log(1.3 / 1.2) / 0.6745)
    # And per kind: the replay scales each kind of work by its own.
    assert speed.parts == pytest.approx(factors)
    # One timing taken while another tenant held the core moves none of it.
    slow = {("prefills", 1)}
    count = {}

    def noisy(probe):
        kind = "images" if probe.images else "prefills" if probe.prefills else "decodes"
        count[kind] = count.get(kind, 0) + 1
        return timer(probe) * (2.5 if (kind, count[kind]) in slow else 1.0)

    robust = measure_speed(None, model, timer=noisy, rounds=3)
    assert robust.factor == pytest.approx(1.3) and robust.parts == pytest.approx(factors)
    assert robust.spread == pytest.approx(math.log(1.3 / 1.2) / 0.6745)
    # A model without stored probes (made by hand) is taken as it is.
    assert measure_speed(None, LatencyModel(l_fixed=0.01), timer=timer) == Speed(1.0, 0.0)


def keyed_model(l_fixed: float = 0.01) -> LatencyModel:
    """A model as the cache holds one: with the key its speed history is filed under."""
    key = {"model": "/models/small", "parts": "vision+language", "device": "cpu:x86_64:1threads"}
    return LatencyModel(l_fixed=l_fixed, meta={"key": key})


def test_speed_checks_are_kept_per_fit_newest_last_and_within_their_age(cache_dir):
    model = keyed_model()
    assert recent_speeds(model) == []
    for i in range(5):
        record_speed(model, Speed(1.0 + i / 10, 0.05, {"decodes": 1.0 + i / 10}), now=1000.0 + i)
    found = recent_speeds(model, now=1010.0)
    assert [s.factor for s in found] == pytest.approx([1.0, 1.1, 1.2, 1.3, 1.4])
    assert found[-1] == Speed(pytest.approx(1.4), 0.05, {"decodes": pytest.approx(1.4)})
    # The last few; none older than the age limit; none from the future (a clock set back).
    assert [s.factor for s in recent_speeds(model, count=2, now=1010.0)] == pytest.approx([1.3, 1.4])
    assert [s.factor for s in recent_speeds(model, max_age=7.5, now=1010.0)] == pytest.approx([1.3, 1.4])
    assert recent_speeds(model, now=999.0) == []
    # A refit (other coefficients) starts a new history; a model without a key keeps none.
    assert recent_speeds(keyed_model(0.02), now=1010.0) == []
    assert speed_history_path(LatencyModel(l_fixed=0.01)) is None
    record_speed(LatencyModel(l_fixed=0.01), Speed(2.0))
    # A torn or foreign line is skipped, not fatal.
    path = speed_history_path(model)
    assert path.parent == cache_dir and path.suffix == ".jsonl"
    with open(path, "a") as f:
        f.write('{"time": 1009, "fit": "x"\nnot json\n')
    assert len(recent_speeds(model, now=1010.0)) == 5


def test_the_speed_history_file_stays_short(cache_dir):
    model = keyed_model()
    for i in range(10 * SPEED_HISTORY):
        record_speed(model, Speed(1.0 + i / 1000), now=float(i))
    lines = speed_history_path(model).read_text().splitlines()
    assert SPEED_HISTORY < len(lines) <= 4 * SPEED_HISTORY
    # The newest are kept.
    assert recent_speeds(model, now=1e6, max_age=1e7)[-1].factor == pytest.approx(1.0 + (10 * SPEED_HISTORY - 1) / 1000)


def _record_many(start: int, count: int) -> None:
    for i in range(start, start + count):
        record_speed(keyed_model(), Speed(1.0 + i / 1000), now=float(i))


def test_speed_checks_recorded_by_several_processes_at_once_are_not_lost(cache_dir):
    """A trim renames a copy over the file; an append from another process between its read
    and its rename would be lost, and the count of lines would come out short."""
    writers, each = 4, 60
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_record_many, args=(k * each, each)) for k in range(writers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    # Serialized, the count of lines follows the trim rule whatever the order of the writes.
    expected = 0
    for _ in range(writers * each):
        expected = SPEED_HISTORY + 1 if expected >= 4 * SPEED_HISTORY else expected + 1
    lines = speed_history_path(keyed_model()).read_text().splitlines()
    assert len(lines) == expected
    assert all(json.loads(line)["fit"] for line in lines)


def test_a_plan_takes_the_median_of_recent_checks_the_check_now_and_the_fit():
    parts = {"images": 1.4, "decodes": 1.2}
    slow = Speed(1.3, 0.08, parts)
    # Alone, one slow check moves the plan halfway: the median of it and the fit's 1.0x.
    alone = typical_speed(slow, [])
    assert alone.factor == pytest.approx(1.15)
    assert alone.parts == pytest.approx({"images": 1.2, "decodes": 1.1})
    assert alone.spread == 0.08  # how steps scatter now, not how the speed moved
    # After steady checks at 0.95x, a slow one moves nothing much.
    steady = [Speed(0.95, 0.05, {"images": 0.95, "decodes": 0.95})] * 4
    assert typical_speed(slow, steady).factor == pytest.approx(0.95)
    # A machine that stays slower than its fit outvotes the fit.
    slower = [Speed(1.3, 0.05, {"images": 1.3, "decodes": 1.3})] * 2
    assert typical_speed(slow, slower).factor == pytest.approx(1.3)
    assert typical_speed(slow, slower).parts == pytest.approx({"images": 1.3, "decodes": 1.25})


def test_the_replays_step_noise_joins_the_models_error_and_the_speed_checks_spread():
    from hydrad.engine.latency_model import FitError
    from hydrad.planner.profile import step_noise

    # A median relative error of 0.06745 is a normal's standard deviation of 0.1; the speed
    # checks' spreads (0.1 and 0.2) pool to sqrt(0.025).
    model = LatencyModel(l_fixed=0.01, error=FitError(median=0.06745, max=0.2, num_probes=9))
    assert step_noise(model, {1: Speed(1.2, 0.1), 2: Speed(1.3, 0.2)}) == pytest.approx(math.sqrt(0.01 + 0.025))
    assert step_noise(LatencyModel(l_fixed=0.01), {}) == 0.0


def test_a_plan_averages_over_the_recent_checks_paired_newest_first_the_check_now_and_the_fit():
    from hydrad.engine.machine_speed import speed_sample

    now = {1: Speed(1.3, 0.1, {"decodes": 1.3}), 2: Speed(1.2, 0.1, {"decodes": 1.2})}
    earlier = {1: [Speed(1.0 + i / 10) for i in range(3)], 2: [Speed(2.0 + i / 10) for i in range(2)]}
    sample = speed_sample(now, earlier)
    # Two thread counts with three and two earlier checks: the newest two of each, paired.
    assert [{n: s.factor for n, s in c.items()} for c in sample] == [
        {1: pytest.approx(1.1), 2: pytest.approx(2.0)}, {1: pytest.approx(1.2), 2: pytest.approx(2.1)},
        {1: 1.3, 2: 1.2}, {1: 1.0, 2: 1.0}]
    # The fit: 1.0x overall and in each kind the check now timed.
    assert sample[-1][1] == Speed(1.0, 0.0, {"decodes": 1.0})
    # No history yet: the check and the fit.
    assert speed_sample(now, {1: [], 2: []}) == [now, {1: Speed(1.0, 0.0, {"decodes": 1.0}),
                                                       2: Speed(1.0, 0.0, {"decodes": 1.0})}]
