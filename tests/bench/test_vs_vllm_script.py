"""The pure parts of ``bench/vs_vllm.py``: the counters read off a server's /metrics, and the
ratio table with a checkout measured before a change. The runs themselves are the benchmark."""

from __future__ import annotations

import pytest
from factories import http_get_stub


@pytest.fixture(scope="module")
def script(bench_script):
    return bench_script("vs_vllm")


@pytest.fixture
def metrics_url():
    """A server that answers each path with ``served[path]`` (404 for others)."""
    served: dict[str, str] = {}
    with http_get_stub(lambda path: served[path].encode() if path in served else None, "text/plain") as url:
        yield url, served


def test_counters_add_up_hydrads_instances_and_read_vllms_names(script, metrics_url):
    url, served = metrics_url
    served["/metrics"] = "\n".join([
        '# TYPE hydrad_preemptions_total counter',
        'hydrad_preemptions_total{instance="0",model_name="m"} 3.0',
        'hydrad_preemptions_total{instance="1",model_name="m"} 4.0',
        'hydrad_prefix_cache_queries_total{instance="0",model_name="m"} 100.0',
        'hydrad_prefix_cache_hits_total{instance="0",model_name="m"} 40.0',
        'hydrad_prefix_cache_hits_created{instance="0",model_name="m"} 1.7e9',
    ])
    assert script.server_counters(url) == {"queries": 100.0, "hits": 40.0, "preemptions": 7.0}
    served["/metrics"] = "\n".join([
        'vllm:num_preemptions_total{engine="0",model_name="small"} 12.0',
        'vllm:prefix_cache_queries_total{engine="0",model_name="small"} 500.0',
        'vllm:prefix_cache_hits_total{engine="0",model_name="small"} 200.0',
    ])
    assert script.server_counters(url) == {"queries": 500.0, "hits": 200.0, "preemptions": 12.0}
    assert script.server_counters("http://127.0.0.1:9") is None  # nothing listens: no counters


def test_a_hydrad_without_the_preemption_counter_is_read_from_its_status(script, metrics_url):
    url, served = metrics_url
    served["/metrics"] = 'hydrad_prefix_cache_queries_total{instance="0",model_name="m"} 1.0'
    served["/admin/status"] = '{"instances": [{"num_preemptions": 2}, {"num_preemptions": null}, {"num_preemptions": 5}]}'
    assert script.server_counters(url) == {"queries": 1.0, "hits": 0.0, "preemptions": 7.0}
    del served["/admin/status"]  # not answered either: unknown, not none
    assert script.server_counters(url)["preemptions"] is None


def test_a_run_records_what_the_server_counted_and_no_more(script):
    doc = {}
    script.record_counters(doc, {"queries": 100.0, "hits": 10.0, "preemptions": 2.0},
                           {"queries": 300.0, "hits": 110.0, "preemptions": 5.0})
    assert doc == {"preemptions": 3.0, "prefix_hit_rate": 0.5}
    doc = {}  # preemptions not counted, no prompt looked up: neither recorded
    script.record_counters(doc, {"queries": 0.0, "hits": 0.0, "preemptions": None},
                           {"queries": 0.0, "hits": 0.0, "preemptions": None})
    assert doc == {}
    script.record_counters(doc, None, {"queries": 1.0, "hits": 1.0, "preemptions": 1.0})  # no answer before
    assert doc == {}


def test_the_checkout_before_a_change_gets_its_own_ratios(script):
    run = {"req_per_s": 2.0, "ttft_p50": 1.0, "preemptions": 5.0, "prefix_hit_rate": 0.5}
    results = {
        "hydrad-1EPD": {"chat256/greedy": {**run, "req_per_s": 3.0, "preemptions": 0.0}, "crowd256/greedy": run},
        "hydrad-1EPD@before": {"chat256/greedy": run, "crowd16/greedy": run},
        "vllm": {"chat256/greedy": {**run, "req_per_s": 2.5, "ttft_p50": 2.0}, "crowd256/greedy": run,
                 "crowd16/greedy": run},
    }
    labels = [label for label, *_ in script.ratios(results)]
    assert labels == ["hydrad-1EPD chat256/greedy", "hydrad-1EPD chat256/greedy, TTFT p50",
                      "hydrad-1EPD crowd256/greedy", "hydrad-1EPD crowd256/greedy, TTFT p50",
                      "hydrad-1EPD@before chat256/greedy", "hydrad-1EPD@before chat256/greedy, TTFT p50",
                      "hydrad-1EPD@before crowd16/greedy", "hydrad-1EPD@before crowd16/greedy, TTFT p50"]
    rows = {label: ratio for label, _, _, _, ratio in script.ratios(results)}
    assert rows["hydrad-1EPD chat256/greedy"] == pytest.approx(1.2)
    assert rows["hydrad-1EPD@before chat256/greedy"] == pytest.approx(0.8)
    assert rows["hydrad-1EPD@before chat256/greedy, TTFT p50"] == pytest.approx(0.5)
    # Every deployment's crowd runs get their rows, not only the EPD instance's.
    two = {"hydrad-1EP+1D": {"crowd256/greedy": run}, "hydrad-1EP+1D@before": {"crowd256/greedy": run},
           "vllm": {"crowd256/greedy": {**run, "req_per_s": 4.0}}}
    assert {label: ratio for label, _, _, _, ratio in script.ratios(two)} == {
        "hydrad-1EP+1D crowd256/greedy": 0.5, "hydrad-1EP+1D crowd256/greedy, TTFT p50": 1.0,
        "hydrad-1EP+1D@before crowd256/greedy": 0.5, "hydrad-1EP+1D@before crowd256/greedy, TTFT p50": 1.0}
    table = script.markdown(results, "python bench/vs_vllm.py --before /old")
    assert "hydrad-1EPD@before requests preempted: chat256/greedy 5" in table
    assert "hydrad-1EPD requests preempted: chat256/greedy 0" in table


def test_video_runs_compare_their_prompt_tokens(script):
    run = {"req_per_s": 2.0, "ttft_p50": 1.0, "prompt_tokens": 280.0}
    results = {"hydrad-1EPD": {"video16/greedy": run},
               "vllm": {"video16/greedy": {**run, "req_per_s": 1.0, "prompt_tokens": 560.0}}}
    rows = {label: ratio for label, _, _, _, ratio in script.ratios(results)}
    assert rows == {"hydrad-1EPD video16/greedy": 2.0, "hydrad-1EPD video16/greedy, TTFT p50": 1.0,
                    "hydrad-1EPD video16/greedy, prompt tokens": 0.5}


def test_parallel_runs_compare_the_prompt_tokens_found_cached(script):
    run = {"req_per_s": 2.0, "ttft_p50": 1.0, "prefix_hit_rate": 0.72}
    results = {"hydrad-1EPD": {"parallel64/top_p": run, "parallel4/defaults": run},
               "vllm": {"parallel64/top_p": {**run, "req_per_s": 1.0, "prefix_hit_rate": 0.36},
                        "parallel4/defaults": run}}
    rows = {label: ratio for label, _, _, _, ratio in script.ratios(results)}
    assert rows["hydrad-1EPD parallel64/top_p"] == 2.0
    assert rows["hydrad-1EPD parallel64/top_p, prompt tokens found cached"] == pytest.approx(2.0)
    # Fewer requests in flight first.
    assert [label for label in rows if label.endswith("found cached")] == [
        "hydrad-1EPD parallel4/defaults, prompt tokens found cached",
        "hydrad-1EPD parallel64/top_p, prompt tokens found cached"]


def test_many_streams_compare_each_requests_longest_gap(script):
    run = {"req_per_s": 2.0, "ttft_p50": 1.0, "max_gap_p50": 0.1}
    results = {"hydrad-1EP+1D": {"crowd256/greedy": run},
               "vllm": {"crowd256/greedy": {**run, "max_gap_p50": 0.8}}}
    rows = {label: ratio for label, _, _, _, ratio in script.ratios(results)}
    assert rows["hydrad-1EP+1D crowd256/greedy, longest gap p50"] == pytest.approx(0.125)
    # A result written before the bench measured it: no row.
    del results["vllm"]["crowd256/greedy"]["max_gap_p50"]
    assert not any("longest gap" in label for label, *_ in script.ratios(results))


def test_each_router_policy_gets_its_own_rows(script):
    run = {"req_per_s": 2.0, "ttft_p50": 1.0}
    results = {"hydrad-2EPD": {"peak/greedy": run, "chat16/defaults": run},
               "hydrad-2EPD-cache-aware": {"peak/greedy": {**run, "req_per_s": 3.0}, "chat16/defaults": run},
               "vllm": {"peak/greedy": {**run, "req_per_s": 4.0}, "chat16/defaults": {**run, "ttft_p50": 2.0}}}
    rows = {label: ratio for label, _, _, _, ratio in script.ratios(results)}
    assert rows == {
        "hydrad-2EPD peak greedy, 16 in flight": 0.5, "hydrad-2EPD peak greedy, TTFT p50": 1.0,
        "hydrad-2EPD-cache-aware peak greedy, 16 in flight": 0.75,
        "hydrad-2EPD-cache-aware peak greedy, TTFT p50": 1.0,
        "hydrad-2EPD chat16/defaults": 1.0, "hydrad-2EPD chat16/defaults, TTFT p50": 0.5,
        "hydrad-2EPD-cache-aware chat16/defaults": 1.0, "hydrad-2EPD-cache-aware chat16/defaults, TTFT p50": 0.5}
    assert set(script.ROUTED.values()) == {"round-robin", "least-load", "cache-aware"}


def test_a_video_mix_reports_each_kinds_ttft_and_the_inter_token_p99(script):
    from hydrad.bench.metrics import RequestResult

    def result(prompt_tokens, ttft, error=None):
        return RequestResult(ttft=ttft, tbts=(), e2e=ttft, output_tokens=1, met_slo=True, error=error,
                             prompt_tokens=prompt_tokens)

    results = [result(30, 0.1), result(31, 0.3), result(32, 0.2), result(440, 2.0), result(441, 4.0),
               result(30, None, error="reset"), result(440, 9.0, error="timeout")]
    assert script.ttft_by_kind(results) == {"text_requests": 3, "text_ttft_p50": 0.2,
                                            "video_requests": 2, "video_ttft_p50": 3.0}
    assert script.ttft_by_kind(results[:3])["video_ttft_p50"] is None
    run = {"req_per_s": 4.0, "ttft_p50": 0.5, "prompt_tokens": 130.0, "text_ttft_p50": 0.2, "video_ttft_p50": 3.0,
           "tbt_p99": 0.1}
    results = {"hydrad-1EPD": {"videomix16/greedy": run},
               "vllm": {"videomix16/greedy": {**run, "req_per_s": 2.0, "text_ttft_p50": 0.8, "tbt_p99": 1.0}}}
    rows = {label: ratio for label, _, _, _, ratio in script.ratios(results)}
    assert rows == {"hydrad-1EPD videomix16/greedy": 2.0, "hydrad-1EPD videomix16/greedy, TTFT p50": 1.0,
                    "hydrad-1EPD videomix16/greedy, prompt tokens": 1.0,
                    "hydrad-1EPD videomix16/greedy, text TTFT p50": 0.25,
                    "hydrad-1EPD videomix16/greedy, video TTFT p50": 1.0,
                    "hydrad-1EPD videomix16/greedy, inter-token p99": 0.1}


def test_closed_loops_run_each_concurrency_greedy_and_at_the_defaults(script, monkeypatch):
    calls, counted = [], []
    monkeypatch.setattr(script, "bench", lambda url, workload, slo, key, **kw: calls.append((key, kw)) or {"key": key})
    monkeypatch.setattr(script, "server_counters", lambda url: counted.append(url) or {"queries": 0})
    monkeypatch.setattr(script, "record_counters", lambda doc, before, after: doc.update(counted=True))
    out = {}
    script._closed_loops(out, "u", "videomix", "w.jsonl", [16, 256], 2, kinds=True)
    assert [(key, kw["concurrency"], kw["num_requests"], kw["kinds"]) for key, kw in calls] == [
        ("videomix16/greedy", 16, 32, True), ("videomix16/defaults", 16, 32, True),
        ("videomix256/greedy", 256, 512, True), ("videomix256/defaults", 256, 512, True)]
    assert calls[0][1]["sampling"] != calls[1][1]["sampling"] and not counted and "counted" not in out["videomix16/greedy"]
    script._closed_loops(out, "u", "crowd", "w.jsonl", [8], 1, counters=True)
    assert out["crowd8/defaults"] == {"key": "crowd8/defaults", "counted": True} and len(counted) == 4


def test_json_runs_constrain_every_request_and_compare_throughput_and_latency(script, monkeypatch):
    calls = []
    monkeypatch.setattr(script, "bench", lambda url, workload, slo, key, **kw: calls.append((key, kw)) or {"key": key})
    out = {}
    script._closed_loops(out, "u", "json", "w.jsonl", [256], 2, response_format=script.JSON_FORMAT)
    assert [key for key, _ in calls] == ["json256/greedy", "json256/defaults"]
    fields = [kw["sampling"].fields() for _, kw in calls]
    assert [f["temperature"] for f in fields] == [0.0, 1.0]
    assert all(f["response_format"]["type"] == "json_schema" for f in fields)
    assert script.JSON_FORMAT["json_schema"]["schema"]["required"] == ["name", "score"]
    run = {"output_tok_per_s": 900.0, "ttft_p50": 0.5, "tbt_p99": 0.2}
    results = {"hydrad-streams": {"json256/greedy": run},
               "vllm": {"json256/greedy": {"output_tok_per_s": 600.0, "ttft_p50": 1.0, "tbt_p99": 0.8}}}
    rows = {label: ratio for label, _, _, _, ratio in script.ratios(results)}
    assert rows["hydrad json256/greedy"] == pytest.approx(1.5)
    assert rows["hydrad json256/greedy, TTFT p50"] == pytest.approx(0.5)
    assert rows["hydrad json256/greedy, inter-token p99"] == pytest.approx(0.25)


def test_the_large_schema_compiles_and_runs_beside_the_code_before(script):
    """The jsonlarge scenario's schema is one hydrad takes (every field typed, the two of the
    small schema required), and a ``--before`` twin of the stream server gets its own rows."""
    from hydrad.sampling_params import StructuredOutputsParams

    schema = script.JSON_LARGE_FORMAT["json_schema"]["schema"]
    assert len(schema["properties"]) == 202 and schema["required"] == ["name", "score"]
    assert StructuredOutputsParams(json=schema).compiled
    run = {"output_tok_per_s": 900.0, "ttft_p50": 0.5, "tbt_p99": 0.2}
    results = {"hydrad-streams": {"jsonlarge16/defaults": run},
               "hydrad-streams@before": {"jsonlarge16/defaults": dict(run, output_tok_per_s=300.0)},
               "vllm": {"jsonlarge16/defaults": {"output_tok_per_s": 600.0, "ttft_p50": 1.0, "tbt_p99": 0.8}}}
    rows = {label: ratio for label, _, _, _, ratio in script.ratios(results)}
    assert rows["hydrad jsonlarge16/defaults"] == pytest.approx(1.5)
    assert rows["hydrad@before jsonlarge16/defaults"] == pytest.approx(0.5)
    assert rows["hydrad@before jsonlarge16/defaults, inter-token p99"] == pytest.approx(0.25)


def test_a_mix_at_a_rate_reports_each_kinds_share_within_the_slo(script, monkeypatch):
    from hydrad.bench.metrics import RequestResult

    def result(prompt_tokens, ttft, met=True, error=None):
        return RequestResult(ttft=ttft, tbts=(), e2e=ttft, output_tokens=1, met_slo=met, error=error,
                             prompt_tokens=prompt_tokens)

    results = [result(30, 0.1), result(31, 0.3), result(32, 0.2), result(33, 2.5, met=False),
               result(440, 2.0), result(441, 4.0, met=False), result(30, None, met=False, error="reset")]
    doc = script.ttft_by_kind(results, slo=True)
    # A failed request counts against both kinds; the p90 interpolates, as the bench's own.
    assert doc == pytest.approx({"text_requests": 4, "text_ttft_p50": 0.25, "text_ttft_p90": 1.84,
                                 "text_attainment": 3 / 5, "video_requests": 2, "video_ttft_p50": 3.0,
                                 "video_ttft_p90": 3.8, "video_attainment": 1 / 3})
    assert "text_attainment" not in script.ttft_by_kind(results)
    run = {"req_per_s": 0.5, "attainment": 0.5, "text_attainment": 0.6, "video_attainment": 0.25,
           "text_ttft_p50": 0.2, "text_ttft_p90": 0.4, "video_ttft_p50": 2.0, "tbt_p99": 0.1, "ttft_p50": 0.3}
    theirs = {**run, "attainment": 0.25, "text_attainment": 0.3, "text_ttft_p90": 1.6, "tbt_p99": 2.0}
    rows = {label: ratio for label, _, _, _, ratio in
            script.ratios({"hydrad-1EPD": {"mixrate0.5/greedy": run}, "vllm": {"mixrate0.5/greedy": theirs}})}
    assert rows == {"hydrad-1EPD mixrate0.5/greedy, within SLO": 2.0,
                    "hydrad-1EPD mixrate0.5/greedy, text within SLO": 2.0,
                    "hydrad-1EPD mixrate0.5/greedy, video within SLO": 1.0,
                    "hydrad-1EPD mixrate0.5/greedy, text TTFT p50": 1.0,
                    "hydrad-1EPD mixrate0.5/greedy, text TTFT p90": 0.25,
                    "hydrad-1EPD mixrate0.5/greedy, video TTFT p50": 1.0,
                    "hydrad-1EPD mixrate0.5/greedy, inter-token p99": 0.05}
    # Each rate runs greedy and at the API's defaults, at that rate, under the SLO.
    calls = []
    monkeypatch.setattr(script, "bench", lambda url, workload, slo, key, **kw: calls.append((key, kw)) or {})
    server = type("S", (), {"url": "u", "name": "hydrad-1EPD", "scenarios": ("mixrate",)})()
    args = type("A", (), {"scenarios": ("mixrate",), "mix_rates": [0.5, 1.0], "mix_requests": 64})()
    script.run_scenarios(server, args, {"videomix32": "w.jsonl"}, "slo")
    assert [(key, kw["rates"], kw["num_requests"], kw["kinds"]) for key, kw in calls] == [
        ("mixrate0.5/greedy", (0.5,), 64, True), ("mixrate0.5/defaults", (0.5,), 64, True),
        ("mixrate1/greedy", (1.0,), 64, True), ("mixrate1/defaults", (1.0,), 64, True)]


def test_scoring_runs_count_prompt_tokens_and_compare_each_texts_log_likelihood(script):
    """The scoring client against a stand-in server: warm-up requests apart, each text's
    log-likelihood is the sum of its prompt tokens' log-probabilities after the first; the
    ratio table compares throughput and the notes how far the servers' log-likelihoods are."""
    import json

    from factories import http_get_stub

    sent = []

    def post(path, data):
        body = json.loads(data)
        sent.append(body)
        n = len(body["prompt"].split())  # a token a word
        return json.dumps({"usage": {"prompt_tokens": n}, "choices": [
            {"logprobs": {"token_logprobs": [None] + [-1.0] * (n - 1) + [-0.25]}}]}).encode() \
            if path == "/v1/completions" else None

    models = json.dumps({"data": [{"id": "m"}]}).encode()
    with http_get_stub(lambda path: models if path == "/v1/models" else None, post=post) as url:
        greedy = script.score(url, ["a b c", "d e"], concurrency=2, num_requests=4, temperature=0.0)
        defaults = script.score(url, ["a b c", "d e"], concurrency=1, num_requests=1, temperature=None)
    assert len(sent) == 2 + 4 + 1 + 1  # each run's warm-up (a request a stream), then its requests
    assert all(b["echo"] is True and b["logprobs"] == 1 and b["max_tokens"] == 1 and b["model"] == "m" for b in sent)
    assert [b.get("temperature") for b in sent] == [0.0] * 6 + [None] * 2
    assert greedy["failures"] == 0 and greedy["loglik"] == {0: -2.0, 1: -1.0}
    assert greedy["prompt_tok_per_s"] == pytest.approx(10 / greedy["seconds"])  # 3 + 2 + 3 + 2 tokens
    assert greedy["req_per_s"] == pytest.approx(4 / greedy["seconds"]) and defaults["loglik"] == {0: -2.0}
    theirs = dict(greedy, req_per_s=greedy["req_per_s"] / 2, loglik={0: -2.1, 1: -1.0})
    results = {"hydrad-streams": {"scoring16/greedy": greedy}, "vllm": {"scoring16/greedy": theirs}}
    rows = {label: ratio for label, _, _, _, ratio in script.ratios(results)}
    assert rows["hydrad scoring16/greedy"] == pytest.approx(2.0)
    assert rows["hydrad scoring16/greedy, prompt tokens scored"] == pytest.approx(1.0)
    assert "hydrad-streams scoring16/greedy: each text's log-likelihood within 0.1 of vLLM-cpu's (2 texts" \
        in script.markdown(results, "cmd")


def test_scoring_beside_streams_counts_only_the_streams_window(script):
    """The scoremix run: scoring loops start first, only the requests that end while the
    streams run count, and the loops stop with them; the ratio table compares the streams'
    output, their share within the TBT and the scoring beside them."""
    import json
    import time

    from factories import http_get_stub

    sent = []

    def post(path, data):
        body = json.loads(data)
        sent.append(body)
        time.sleep(0.01)
        n = len(body["prompt"].split())
        return json.dumps({"usage": {"prompt_tokens": n}, "choices": [
            {"logprobs": {"token_logprobs": [None] + [-1.0] * n}}]}).encode() if path == "/v1/completions" else None

    models = json.dumps({"data": [{"id": "m"}]}).encode()
    texts = script.scoremix_texts(3)
    assert len(texts) == 3 and all(160 <= len(t.split()) <= 320 for t in texts)
    window = {}

    def streams():
        window["before"] = len(sent)
        time.sleep(0.5)
        window["after"] = len(sent)
        return {"output_tok_per_s": 100.0, "attainment": 0.9, "tbt_p99": 0.2, "max_gap_p50": 0.15}

    with http_get_stub(lambda path: models if path == "/v1/models" else None, post=post) as url:
        doc = script.beside_scoring(url, texts, 2, streams)
    assert window["before"] >= 2  # each loop had a request done before the streams started
    # The requests counted are those of the window (a loop's request in flight at either edge
    # may fall on either side of it): about the ones sent meanwhile, two loops at ~100 a second.
    counted = doc["scoring_req_per_s"] * 0.5
    assert abs(counted - (window["after"] - window["before"])) <= 4 and counted > 10
    assert doc["scoring_failures"] == 0 and doc["output_tok_per_s"] == 100.0
    stopped = len(sent)
    time.sleep(0.1)
    assert len(sent) == stopped  # the loops ended with the streams
    assert all(b["echo"] and b["temperature"] == 0.0 and b["max_tokens"] == 1 for b in sent)
    theirs = dict(doc, output_tok_per_s=50.0, attainment=0.45, scoring_req_per_s=doc["scoring_req_per_s"] / 4)
    results = {"hydrad-1EPD": {"scoremix16/greedy": doc}, "vllm": {"scoremix16/greedy": theirs}}
    rows = {label: ratio for label, _, _, _, ratio in script.ratios(results)}
    assert rows["hydrad-1EPD scoremix16/greedy, streams' output"] == pytest.approx(2.0)
    assert rows["hydrad-1EPD scoremix16/greedy, streams within the TBT"] == pytest.approx(2.0)
    assert rows["hydrad-1EPD scoremix16/greedy, scoring beside them"] == pytest.approx(4.0)


def test_the_twin_before_a_change_serves_the_checkouts_code(script, tmp_path, monkeypatch):
    """``--before``: the twin runs ``python -m`` in the checkout, so the checkout's package is
    the one it imports, though the script runs from this one (``python -m`` puts the working
    directory first on sys.path, before PYTHONPATH: started from here, the twin served this
    checkout's code). Shown with a stand-in package that answers /health with its own name."""
    import sys
    from pathlib import Path

    from common import Server, free_port

    checkouts = {}
    for which in ("here", "before"):
        package = tmp_path / which / "fakepkg"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(f"NAME = {which!r}\n")
        (package / "__main__.py").write_text(
            "import sys\nfrom http.server import BaseHTTPRequestHandler, HTTPServer\nimport fakepkg\n"
            "class H(BaseHTTPRequestHandler):\n"
            "    def do_GET(self):\n"
            "        body = fakepkg.NAME.encode()\n"
            "        self.send_response(200); self.send_header('Content-Length', str(len(body))); self.end_headers()\n"
            "        self.wfile.write(body)\n"
            "    def log_message(self, *args): pass\n"
            "HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")
        checkouts[which] = tmp_path / which
    (name, env, cwd), (twin, twin_env, twin_cwd) = script.twins("hydrad-1EPD", tmp_path / "c", tmp_path / "cb",
                                                                str(checkouts["before"]))
    assert (name, cwd, twin) == ("hydrad-1EPD", None, "hydrad-1EPD@before") and "PYTHONPATH" not in env
    monkeypatch.chdir(checkouts["here"])  # the script runs from this checkout
    served = {}
    for label, environment, directory in (("main", env, cwd), ("twin", twin_env, twin_cwd)):
        port = free_port()
        server = Server(label, [sys.executable, "-m", "fakepkg", str(port)], environment, port,
                        tmp_path / f"{label}.log", (), directory)
        server.start(timeout=60)
        try:
            import urllib.request

            with urllib.request.urlopen(server.url + "/health", timeout=5) as response:
                served[label] = response.read().decode()
        finally:
            server.stop()
    assert served == {"main": "here", "twin": "before"}
    assert Path(twin_cwd) == checkouts["before"].resolve()


def test_each_rounds_first_start_measures_its_latency_models(script, tmp_path, monkeypatch):
    """The start scenario's first start is a first start in every round: the cache an earlier
    round (or another server of the checkout) filled is emptied before it, and the restart
    after it reads what it stored, once every model is measured (a borrower's model on
    borrowed cores comes after it is healthy; the seconds until then are recorded)."""
    import argparse
    import types

    cache = tmp_path / "cache"
    seen = []

    class FakeServer:
        name, scenarios, env = "hydrad-1EPD", ("start",), {"HYDRAD_CACHE_DIR": str(cache)}
        url = "http://127.0.0.1:9"

        def start(self):
            seen.append(sorted(p.name for p in cache.glob("*")) if cache.exists() else None)
            cache.mkdir(exist_ok=True)
            (cache / "model.json").write_text("{}")
            return 1.5

        def stop(self):
            seen.append("stopped")

    measured = iter([True, False])

    def models_measured(url):
        seen.append("measured")
        return next(measured)

    monkeypatch.setattr(script, "models_measured", models_measured)
    args = argparse.Namespace(scenarios=["start"])
    doc = script.measure(FakeServer(), args, {}, types.SimpleNamespace())
    assert doc["start"]["first"] == doc["start"]["restart"] == 1.5 and doc["start"]["models"] > 0
    doc = script.measure(FakeServer(), args, {}, types.SimpleNamespace())
    assert doc["start"] == {"first": 1.5, "restart": 1.5}  # not measured in time: restarted all the same
    # Emptied before each first start, kept for its restart, the server stopped between.
    assert seen == [None, "measured", "stopped", ["model.json"], "stopped"] * 2
    args.scenarios = ["peak"]  # no start measured: the cache is kept for the scenarios
    script.measure(FakeServer(), args, {}, types.SimpleNamespace())
    assert seen[-2:] == [["model.json"], "stopped"]


def test_the_start_scenario_waits_for_a_borrower_s_model_on_borrowed_cores(script, monkeypatch):
    """``models_measured``: until every instance that borrows idle cores reports its model on
    them (an instance that borrows none has nothing to wait for); False past the timeout."""
    import io
    import json
    import urllib.request

    ep = {"borrowed_threads": 1, "borrow_latency_model": None}
    d = {"borrowed_threads": 0, "borrow_latency_model": None}
    answers = [OSError("not serving yet"), [ep, d], [ep, d], [{**ep, "borrow_latency_model": "encode ..."}, d]]
    asked = []

    def urlopen(url, timeout):
        asked.append(url)
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(answer, Exception):
            raise answer
        return io.BytesIO(json.dumps({"instances": answer}).encode())

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    monkeypatch.setattr(script.time, "sleep", lambda seconds: None)
    assert script.models_measured("http://x", timeout=60)
    assert asked == ["http://x/admin/status"] * 4
    answers[:] = [[ep, d]]
    assert not script.models_measured("http://x", timeout=0.05)
