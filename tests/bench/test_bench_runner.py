"""The benchmark against a fake server whose latencies are known exactly."""

import asyncio
import json
import statistics

import pytest

from hydrad.bench import SLO, Bench, GoodputSearch, run_bench
from hydrad.bench.client import ServerError
from hydrad.errors import ConfigError

# Delays long enough that scheduling jitter on a busy machine stays within 5% at the median.
TTFT, TBT, NUM_TOKENS = 0.5, 0.5, 5


def assert_gaps_near(gaps, gap: float) -> None:
    """No gap nearer twice ``gap`` than ``gap`` (a token counted in the wrong chunk doubles
    one) or near zero, and their median within 20% of ``gap``. The fake server sends each
    chunk at its own deadline, so a chunk a busy 2-core machine delays by tens of ms lengthens
    one gap and shortens the next (a CI run saw 0.134 s and 0.067 s for 0.1): a margin of a
    few ms on each gap fails now and then, while these bounds and the median of several gaps
    hold."""
    assert all(0.25 * gap < g < 1.5 * gap for g in gaps), gaps
    assert statistics.median(gaps) == pytest.approx(gap, rel=0.2), gaps


def test_latency_percentiles_match_the_servers_delays(make_config, write_jsonl):
    path = write_jsonl([{"prompt": f"ttft={TTFT} tbt={TBT}", "output_tokens": NUM_TOKENS}])
    result = run_bench(make_config(workload=str(path), num_requests=8, rates=(40.0,)))
    s = result.summary
    for name, truth in (("ttft", TTFT), ("tbt", TBT), ("e2e", TTFT + (NUM_TOKENS - 1) * TBT)):
        for q in (50, 90, 99):
            # The p99 of 32 gaps is about their longest: one chunk a busy machine delays by
            # tens of ms (as a CI run saw) moves it by as much, the median not.
            rel = 0.05 if q == 50 else 0.15
            assert getattr(s, f"{name}_p{q}") == pytest.approx(truth, rel=rel), f"{name}_p{q}"
    assert s.errors == 0 and s.num_requests == 8
    assert all(len(r.tbts) == NUM_TOKENS - 1 and r.output_tokens == NUM_TOKENS for r in result.headline.results)


@pytest.mark.parametrize("counts", ["usage=final", "usage=chunk", "token_ids=1"])
def test_batched_chunks_are_spread_over_their_tokens(make_config, write_jsonl, counts):
    # 13 tokens: the first alone, then 4 chunks of 3, one chunk every 3 * 0.1 s.
    path = write_jsonl([{"prompt": f"ttft=0.05 tbt=0.1 chunk=3 {counts}", "output_tokens": 13}])
    result = run_bench(make_config(workload=str(path), num_requests=3))
    for r in result.headline.results:
        assert r.output_tokens == 13 and len(r.tbts) == 12
        # Each chunk's gap is shared equally by its three tokens.
        assert all(r.tbts[i] == r.tbts[i + 1] == r.tbts[i + 2] for i in range(0, 12, 3))
    assert result.summary.tbt_p50 == pytest.approx(0.1, rel=0.05)


def test_a_chunk_with_two_tokens_gets_both_without_per_chunk_counts(make_config, write_jsonl):
    # 8 tokens in 7 chunks, tokens 3 and 4 together; only the final usage says there were 8.
    path = write_jsonl([{"prompt": "ttft=0.05 tbt=0.1 pair=3", "output_tokens": 8}])
    result = run_bench(make_config(workload=str(path), num_requests=2))
    for r in result.headline.results:
        assert r.error is None and r.output_tokens == 8 and len(r.tbts) == 7
        assert r.tbts[2] == r.tbts[3]  # the pair's chunk shared by its two tokens, not one doubled gap
        assert_gaps_near(r.tbts, 0.1)
        assert r.token_counts == "estimated"
    doc = result.to_dict()
    assert doc["summary"]["estimated_token_counts"] == 2
    assert {r["token_counts"] for r in doc["requests"]} == {"estimated"}


def test_tokens_without_text_still_count(make_config, write_jsonl):
    path = write_jsonl([{"prompt": "ttft=0.05 tbt=0.1 empty=2,3", "output_tokens": 6}])
    result = run_bench(make_config(workload=str(path), num_requests=2))
    for r in result.headline.results:
        assert r.error is None and r.output_tokens == 6
        # Each its own gap (a token without text merged into the next would double one).
        assert len(r.tbts) == 5
        assert_gaps_near(r.tbts, 0.1)


def test_stream_of_textless_tokens_is_timed_by_its_role_and_closing_chunks(make_config, write_jsonl):
    path = write_jsonl([{"prompt": "ttft=0.05 tbt=0.05 silent=1", "output_tokens": 5}])
    result = run_bench(make_config(workload=str(path), num_requests=1))
    (r,) = result.headline.results
    assert r.error is None and r.output_tokens == 5 and len(r.tbts) == 4
    # The role chunk arrives at once (timing the first token at the closing chunk: 0.2 s less).
    assert sum(r.tbts) == pytest.approx(r.e2e, abs=0.06)


def test_hydrad_role_chunk_carries_the_first_token(make_config, write_jsonl):
    # hydrad sends the role with the first token; here that token has no text of its own, so
    # only its token ids tell the chunk from a bare role announcement.
    path = write_jsonl([{"prompt": "style=hydrad token_ids=1 ttft=0.3 tbt=0.1 empty=0", "output_tokens": 4}])
    (r,) = run_bench(make_config(workload=str(path), num_requests=1)).headline.results
    assert r.error is None and r.output_tokens == 4
    # Within a busy machine's jitter of 0.3 s (a role chunk taken for a bare announcement
    # would time it at the next token, and leave two gaps: the count below says so).
    assert 0.25 < r.ttft < 0.6
    assert len(r.tbts) == 3
    assert_gaps_near(r.tbts, 0.1)


def test_hydrad_last_chunk_without_text_times_the_last_token(make_config, write_jsonl):
    path = write_jsonl([{"prompt": "style=hydrad ttft=0.05 tbt=0.1 gap4=0.4 empty=4", "output_tokens": 5}])
    (r,) = run_bench(make_config(workload=str(path), num_requests=1)).headline.results
    assert r.error is None and r.output_tokens == 5
    assert len(r.tbts) == 4 and r.tbts[3] > 0.25  # the long gap is the last token's
    assert_gaps_near(r.tbts[:3], 0.1)


@pytest.mark.parametrize("counts", ["", "usage=chunk", "token_ids=1"])
def test_role_chunk_before_any_token_is_not_the_first_token(make_config, write_jsonl, counts):
    # vLLM's shape: a role chunk with empty content at once, then one chunk per token.
    path = write_jsonl([{"prompt": f"ttft=0.3 tbt=0.1 empty=1 {counts}", "output_tokens": 3}])
    (r,) = run_bench(make_config(workload=str(path), num_requests=1)).headline.results
    # Not the role chunk's ~0 s (bounds that hold a busy machine's jitter of 0.3 s).
    assert r.error is None and 0.15 < r.ttft < 0.6 and r.output_tokens == 3
    assert len(r.tbts) == 2
    assert_gaps_near(r.tbts, 0.1)


def test_attainment_is_exact_on_a_crafted_mix(make_config, write_jsonl):
    rows = (
        [{"prompt": "ttft=0.05 tbt=0.02", "output_tokens": 6}] * 6
        + [{"prompt": "ttft=0.4 tbt=0.02", "output_tokens": 6}] * 2  # late first token
        + [{"prompt": "ttft=0.05 tbt=0.1", "output_tokens": 6}] * 2  # slow decode
        # One slow gap in 19 stays above the 90th percentile of the request's gaps...
        + [{"prompt": "ttft=0.05 tbt=0.02 gap3=0.3", "output_tokens": 20}]
        # ...three in 9 do not.
        + [{"prompt": "ttft=0.05 tbt=0.02 gap3=0.3 gap4=0.3 gap5=0.3", "output_tokens": 10}]
        + [{"prompt": "fail=500", "output_tokens": 4}]
    )
    path = write_jsonl(rows)
    config = make_config(workload=str(path), num_requests=len(rows), slo=SLO(ttft=0.2, tbt=0.06))
    result = run_bench(config)
    s = result.summary
    assert (s.num_requests, s.num_met, s.errors) == (13, 7, 1)
    assert s.attainment == 7 / 13
    assert sum(r.error is not None and "HTTP 500" in r.error for r in result.headline.results) == 1


def test_requests_ask_for_exact_greedy_streams(make_config, fake_requests):
    result = run_bench(make_config(workload="textcaps", num_requests=3, api_key="sk-test", seed=5))
    sent = fake_requests()
    assert result.model == "fake-model" and len(sent) == 3
    spec_tokens = sorted(r.output_tokens for r in result.headline.results)
    assert sorted(body["max_tokens"] for body in sent) == spec_tokens
    for body in sent:
        assert body["model"] == "fake-model" and body["stream"] is True and body["ignore_eos"] is True
        assert body["temperature"] == 0 and body["stream_options"] == {"include_usage": True}
        assert body["return_token_ids"] is True
        assert body["authorization"] == "Bearer sk-test"
        assert body["image_headers"] == ["data:image/jpeg;base64"] and body["image_bytes"][0] > 50_000
        assert 10 <= body["max_tokens"] <= 30


def test_goodput_search_finds_the_knee(make_config, write_jsonl, tmp_path):
    knee = 47.0
    # Evenly spaced arrivals: the server's observed rate is the offered rate.
    trace = tmp_path / "uniform.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 100 * i}) + "\n" for i in range(100)))
    path = write_jsonl([{"prompt": f"knee={knee} ttft=0.02 tbt=0.01 slow_ttft=0.3", "output_tokens": 4}])
    config = make_config(
        workload=str(path), num_requests=16, rates=(), arrivals="trace", trace=str(trace), instances=2,
        search=GoodputSearch(start_rate=20.0, rel_tol=0.1), slo=SLO(ttft=0.1, tbt=0.05),
    )
    result = run_bench(config)
    assert 0.85 * knee <= result.goodput_total <= 1.05 * knee
    assert result.summary.goodput_rps == result.goodput_total / 2
    rates = [run.rate for run in result.runs]
    assert min(rates) == 20.0 and any(not run.passes for run in result.runs)
    doc = result.to_dict()
    assert [entry["rate"] for entry in doc["sweep"]] == rates
    assert doc["summary"]["rate"] == result.goodput_total and doc["summary"]["attainment"] >= 0.9


def test_sweep_json_shape(make_config):
    result = run_bench(make_config(rates=(20.0, 40.0), num_requests=3, api_key="secret"))
    doc = json.loads(result.to_json())
    assert set(doc) == {"config", "summary", "requests", "sweep", "interrupted", "client_cpu_seconds"}
    # The client's own CPU over the runs (the fake server runs in its own process).
    assert 0.0 < doc["client_cpu_seconds"] < 60.0
    assert result.num_sent == 6 and result.client_cpu_per_request == pytest.approx(doc["client_cpu_seconds"] / 6)
    assert "api_key" not in doc["config"] and doc["config"]["model"] == "fake-model"
    keys = {"ttft_p50", "ttft_p90", "ttft_p99", "tbt_p50", "tbt_p90", "tbt_p99", "e2e_p50", "e2e_p90", "e2e_p99",
            "attainment", "throughput_rps", "output_tokens_per_s", "goodput_rps", "errors"}
    assert keys <= set(doc["summary"])
    assert doc["summary"]["goodput_rps"] == 40.0
    assert [e["rate"] for e in doc["sweep"]] == [20.0, 40.0]
    assert all(keys <= set(e["summary"]) and e["summary"]["goodput_rps"] is None for e in doc["sweep"])
    request = doc["requests"][0]
    assert {"ttft", "tbts", "e2e", "output_tokens", "met_slo", "error"} <= set(request)
    assert doc["interrupted"] is False


def test_single_rate_reports_no_goodput(make_config):
    doc = run_bench(make_config(num_requests=2)).to_dict()
    assert doc["summary"]["goodput_rps"] is None and "sweep" not in doc


def test_cancelled_bench_keeps_what_finished(make_config, write_jsonl):
    rows = [{"prompt": "ttft=0.01 tbt=0.01", "output_tokens": 2}] * 3 + [{"prompt": "ttft=5", "output_tokens": 2}]
    bench = Bench(make_config(workload=str(write_jsonl(rows)), num_requests=4, rates=(100.0,)))

    async def cancel_midway():
        task = asyncio.create_task(bench.run())
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_midway())
    result = bench.result()
    assert result.interrupted and result.runs[0].interrupted
    assert result.summary.num_requests == 3 and result.summary.num_met == 3


def test_trace_arrivals_from_the_workloads_own_timestamps(make_config, write_jsonl):
    rows = [{"timestamp": t, "prompt": "ttft=0.01", "output_tokens": 2} for t in (0.0, 0.5, 1.0, 1.5)]
    bench = Bench(make_config(workload=str(write_jsonl(rows)), arrivals="trace"))
    assert bench.trace.timestamps == (0.0, 0.5, 1.0, 1.5)
    with pytest.raises(ConfigError, match="trace arrivals need"):
        Bench(make_config(arrivals="trace"))


def test_unreachable_server_is_one_clear_error(make_config):
    with pytest.raises(ServerError, match="cannot reach http://127.0.0.1:9"):
        run_bench(make_config(url="http://127.0.0.1:9"))


# -- closed loop -------------------------------------------------------------------------------
def test_closed_loop_keeps_the_concurrency_in_flight(make_config, write_jsonl, fake_requests):
    # Every request takes 0.3 s; 3 in flight, 9 requests: three waves, ~0.9 s, ~10 req/s.
    path = write_jsonl([{"prompt": "ttft=0.3", "output_tokens": 1}])
    result = run_bench(make_config(workload=str(path), rates=(), concurrency=3, num_requests=9))
    s = result.summary
    assert s.num_requests == 9 and s.errors == 0 and s.concurrency == 3
    assert 0.85 <= s.duration < 1.3, s.duration
    assert s.rate == s.throughput_rps == pytest.approx(9 / s.duration)
    arrivals = sorted(r["arrived"] for r in fake_requests())
    assert len(arrivals) == 9
    # A request starts only when one of the 3 before it finished: never 4 within 0.3 s.
    assert all(later - earlier >= 0.28 for earlier, later in zip(arrivals, arrivals[3:]))
    assert arrivals[2] - arrivals[0] < 0.1  # the first wave goes out at once
    doc = result.to_dict()
    assert doc["config"]["concurrency"] == 3 and doc["summary"]["concurrency"] == 3 and len(doc["requests"]) == 9
    assert "sweep" not in doc


def test_closed_loop_warmup_is_sent_but_not_counted(make_config, write_jsonl, fake_requests):
    path = write_jsonl([{"prompt": "ttft=0.05", "output_tokens": 2}])
    result = run_bench(make_config(workload=str(path), rates=(), concurrency=2, num_requests=4, warmup=3))
    assert result.summary.num_requests == 4 and len(result.headline.results) == 4
    assert len(fake_requests()) == 7


def test_open_loop_warmup_is_sent_first_and_not_counted(make_config, write_jsonl, fake_requests):
    path = write_jsonl([{"prompt": "ttft=0.01", "output_tokens": 2}])
    result = run_bench(make_config(workload=str(path), rates=(40.0, 80.0), num_requests=4, warmup=3))
    assert [run.summary.num_requests for run in result.runs] == [4, 4]
    assert len(fake_requests()) == 11


def test_goodput_search_warms_up_once_before_its_first_rate(make_config, write_jsonl, fake_requests):
    from hydrad.bench import GoodputSearch

    path = write_jsonl([{"prompt": "ttft=0.01", "output_tokens": 2}])
    result = run_bench(make_config(workload=str(path), rates=(), num_requests=3, warmup=5,
                                   search=GoodputSearch(start_rate=50.0, rel_tol=0.5, max_rate=100.0)))
    counted = sum(run.summary.num_requests for run in result.runs)
    assert len(result.runs) >= 2 and counted == 3 * len(result.runs)
    assert len(fake_requests()) == counted + 5


def test_closed_loop_for_a_duration(make_config, write_jsonl):
    # 0.2 s requests, 2 in flight, 0.5 s: requests start at 0, 0.2 and 0.4 s on each slot.
    path = write_jsonl([{"prompt": "ttft=0.2", "output_tokens": 1}])
    result = run_bench(make_config(workload=str(path), rates=(), concurrency=2, num_requests=None, duration=0.5))
    assert 4 <= result.summary.num_requests <= 6, result.summary.num_requests
    assert result.summary.errors == 0


def test_video_workloads_send_video_files_and_count_prompt_tokens(make_config, write_jsonl, fake_requests):
    pytest.importorskip("av")
    from hydrad.videos import read_header, video_data_url_bytes

    path = write_jsonl([{"prompt_tokens": 4, "output_tokens": 3, "images": [{"width": 40, "height": 30}],
                         "videos": [{"frames": 6, "width": 64, "height": 48, "fps": 3}]}])
    result = run_bench(make_config(workload=str(path), rates=(), concurrency=2, num_requests=2))
    sent = fake_requests()
    assert len(sent) == 2 and all(body["kinds"] == ["image_url", "video_url", "text"] for body in sent)
    header = read_header(video_data_url_bytes(sent[0]["videos"][0], "p"), max_pixels=10**6, param="p")
    assert (header.num_frames, header.fps, header.width, header.height) == (6, 3.0, 64, 48)
    assert sent[0]["videos"] != sent[1]["videos"]  # each request its own video
    assert result.summary.prompt_tokens_mean == 1  # the fake server's usage


def test_sampling_goes_into_every_request(make_config, fake_requests):
    from hydrad.bench import Sampling

    run_bench(make_config(num_requests=3, sampling=Sampling(0.8, 0.9, 50)))
    seen = fake_requests()
    assert len(seen) == 3
    assert all((r["temperature"], r["top_p"], r["top_k"]) == (0.8, 0.9, 50) for r in seen)
    run_bench(make_config(num_requests=2))
    assert all(r["temperature"] == 0.0 and "top_p" not in r and "top_k" not in r for r in fake_requests())


# -- the Responses API ---------------------------------------------------------------------------------
def test_the_responses_api_is_timed_by_its_text_events(make_config, write_jsonl, fake_requests):
    """``api="responses"``: the requests go to /v1/responses as input items (images first,
    then the text), streamed and not kept; each text event is timed, and a chunk of three
    tokens has its gap spread over them (counted from the final usage)."""
    path = write_jsonl([{"prompt": "ttft=0.3 tbt=0.1", "output_tokens": 4, "images": [{"width": 32, "height": 24}]},
                        {"prompt": "ttft=0.05 tbt=0.1 chunk=3", "output_tokens": 7}])
    result = run_bench(make_config(workload=str(path), num_requests=2, api="responses"))
    timed, chunked = sorted(result.headline.results, key=lambda r: r.output_tokens)
    # Timed at its first text event, not at response.created (~0 s).
    assert timed.error is None and timed.output_tokens == 4 and 0.15 < timed.ttft < 0.6
    assert len(timed.tbts) == 3
    assert_gaps_near(timed.tbts, 0.1)
    assert chunked.error is None and chunked.output_tokens == 7 and chunked.token_counts == "estimated"
    assert chunked.tbts[0:3] == (chunked.tbts[0],) * 3 and chunked.tbts[3:6] == (chunked.tbts[3],) * 3
    sent = sorted(fake_requests(), key=lambda r: r["max_output_tokens"])
    assert [r["kinds"] for r in sent] == [["input_image", "input_text"], ["input_text"]]
    assert all(r["stream"] and r["store"] is False and r["ignore_eos"] for r in sent)
    assert sent[0]["image_headers"] == ["data:image/jpeg;base64"]


@pytest.mark.parametrize("prompt, error", [
    ("failmid=2", "injected failure mid-stream"),
    ("cut=2", "the stream ended without response.completed"),
    ("extra=1", "the answer had 4 token(s) for max_tokens 3"),
    ("fail=400", "HTTP 400"),
])
def test_a_responses_stream_that_fails_or_is_cut_is_an_error(make_config, write_jsonl, prompt, error):
    path = write_jsonl([{"prompt": prompt, "output_tokens": 3}])
    (r,) = run_bench(make_config(workload=str(path), num_requests=1, api="responses")).headline.results
    assert r.error is not None and error in r.error, r.error


def test_the_responses_api_refuses_a_workload_it_cannot_send(make_config, write_jsonl):
    path = write_jsonl([{"prompt": "hi", "output_tokens": 3, "n": 2}])
    with pytest.raises(ConfigError, match="n > 1, which the Responses API"):
        run_bench(make_config(workload=str(path), num_requests=1, api="responses"))
    with pytest.raises(ConfigError, match="api must be one of chat, responses"):
        make_config(api="completions")
