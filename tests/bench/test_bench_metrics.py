import numpy as np
import pytest

from hydrad.bench import SLO
from hydrad.bench.metrics import (
    StreamRecord,
    chunk_token_counts,
    evaluate,
    goodput,
    inter_token_gaps,
    percentile,
    summarize,
)

SLO_ = SLO(ttft=0.5, tbt=0.1)


def make_record(chunk_times, start=0.0, chunk_tokens=None, completion_tokens=None, error=None, chunk_chars=None):
    return StreamRecord(
        start=start,
        end=chunk_times[-1] if chunk_times else start + 1.0,
        chunk_times=list(chunk_times),
        chunk_tokens=list(chunk_tokens) if chunk_tokens is not None else [None] * len(chunk_times),
        chunk_chars=list(chunk_chars) if chunk_chars is not None else [4] * len(chunk_times),
        completion_tokens=completion_tokens,
        error=error,
    )


def test_one_token_per_chunk_without_usage():
    record = make_record([0.3, 0.4, 0.6])
    assert chunk_token_counts(record) == [1, 1, 1]
    assert inter_token_gaps(record) == pytest.approx([0.1, 0.2])


def test_final_usage_spreads_extra_tokens_over_later_chunks():
    # 8 tokens in 4 chunks: the first holds one, the other 7 spread 2, 2, 3.
    record = make_record([1.0, 1.2, 1.4, 1.7], completion_tokens=8)
    assert chunk_token_counts(record) == [1, 2, 2, 3]
    assert inter_token_gaps(record) == pytest.approx([0.1] * 7)


def test_final_usage_goes_to_the_chunks_with_more_text():
    # 6 tokens in 5 chunks; the fourth chunk has twice the text: it carried two tokens.
    record = make_record([1.0, 1.1, 1.2, 1.4, 1.5], completion_tokens=6, chunk_chars=[4, 4, 4, 8, 4])
    assert chunk_token_counts(record) == [1, 1, 1, 2, 1]
    assert inter_token_gaps(record) == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.1])
    result = evaluate(record, SLO_)
    assert result.token_counts == "estimated" and result.output_tokens == 6


@pytest.mark.parametrize("chars, total, expected", [
    # 3 characters per token: 1, 3, 0 and 2 tokens' worth, but the textless chunk holds one too
    ([3, 9, 0, 6], 6, [1, 2, 1, 2]),
    ([2, 20, 2, 11], 8, [1, 4, 1, 2]),
    ([5, 1, 1, 1], 5, [2, 1, 1, 1]),  # a first chunk with several tokens gets them too
])
def test_extra_tokens_are_apportioned_by_text_length(chars, total, expected):
    record = make_record([1.0, 1.1, 1.2, 1.3], completion_tokens=total, chunk_chars=chars)
    assert chunk_token_counts(record) == expected and sum(expected) == total


def test_counts_are_exact_from_the_server_or_when_the_usage_matches_the_chunks():
    assert evaluate(make_record([1.0, 1.1], chunk_tokens=[1, 2]), SLO_).token_counts == "exact"
    assert evaluate(make_record([1.0, 1.1], completion_tokens=2), SLO_).token_counts == "exact"
    assert evaluate(make_record([1.0, 1.1]), SLO_).token_counts == "estimated"


def test_per_chunk_usage_gives_exact_counts():
    record = make_record([1.0, 1.3, 1.5], chunk_tokens=[2, 3, 1], completion_tokens=6)
    # The token that came with the first one adds a zero gap.
    assert inter_token_gaps(record) == pytest.approx([0.0, 0.1, 0.1, 0.1, 0.2])


def test_chunk_without_new_tokens_leaves_its_time_to_the_next():
    record = make_record([1.0, 1.1, 1.4], chunk_tokens=[1, 0, 2])
    assert inter_token_gaps(record) == pytest.approx([0.2, 0.2])


def test_usage_below_chunk_count_keeps_one_token_per_chunk():
    assert chunk_token_counts(make_record([1.0, 1.1, 1.2], completion_tokens=2)) == [1, 1, 1]


@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    values = list(np.random.default_rng(q).exponential(size=37))
    assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_percentile_of_nothing_is_none():
    assert percentile([], 50) is None


def test_slo_uses_ttft_and_p90_of_the_requests_gaps():
    ttft = 0.4
    fast = [ttft + 0.05 * i for i in range(20)]
    assert evaluate(make_record(fast), SLO_).met_slo
    # One slow gap in 19 stays above the 90th percentile; three do not.
    one_slow = fast[:5] + [t + 1.0 for t in fast[5:]]
    assert evaluate(make_record(one_slow), SLO_).met_slo
    three_slow = [ttft + 0.05 * i + 0.3 * (i >= 3) + 0.3 * (i >= 4) + 0.3 * (i >= 5) for i in range(10)]
    assert not evaluate(make_record(three_slow), SLO_).met_slo
    assert not evaluate(make_record([0.51, 0.55]), SLO_).met_slo


def test_failed_request_never_meets_slo():
    result = evaluate(make_record([0.1, 0.2], error="HTTP 500: boom"), SLO_)
    assert not result.met_slo and result.error == "HTTP 500: boom"


def test_usage_without_any_text_chunk_has_no_gaps():
    record = make_record([], completion_tokens=5)
    assert chunk_token_counts(record) == [] and inter_token_gaps(record) == []
    assert evaluate(record, SLO_).ttft is None


def test_single_token_request_is_judged_on_ttft_alone():
    result = evaluate(make_record([0.2], completion_tokens=1), SLO_)
    assert result.met_slo and result.tbts == () and result.output_tokens == 1


def test_summary_counts_failures_as_sent_and_not_met():
    results = [
        evaluate(make_record([0.1, 0.2, 0.3]), SLO_),
        evaluate(make_record([0.9, 1.0]), SLO_),
        evaluate(make_record([], error="timeout"), SLO_),
    ]
    s = summarize(results, rate=2.0, duration=2.0)
    assert (s.num_requests, s.num_met, s.errors) == (3, 1, 1)
    assert s.attainment == pytest.approx(1 / 3)
    assert s.ttft_p50 == pytest.approx(0.5)  # over the two successful requests
    assert s.throughput_rps == pytest.approx(1.0)
    assert s.output_tokens_per_s == pytest.approx(2.5)


def test_a_stall_once_per_answer_shows_in_the_longest_gaps_not_in_the_pooled_tbt():
    """Ten streams of 31 gaps of 20 ms, each with one gap of 5 s (a stream left waiting after
    its first token): the pooled TBT p90 and each request's p90 stay at 20 ms, and each
    request meets the SLO; the longest gaps say 5 s."""
    results = []
    for i in range(10):
        times = [0.5, 5.5] + [5.5 + 0.02 * k for k in range(1, 31)]
        results.append(evaluate(make_record(times, start=0.0), SLO_))
    results.append(evaluate(make_record([0.1, 0.2]), SLO_))  # one without a stall
    s = summarize(results, rate=1.0, duration=10.0)
    assert s.tbt_p90 == pytest.approx(0.02) and all(r.met_slo for r in results[:10])
    assert s.max_gap_p50 == pytest.approx(5.0) and s.max_gap_p99 == pytest.approx(5.0)
    assert summarize(results[10:], rate=1.0, duration=1.0).max_gap_p50 == pytest.approx(0.1)
    assert "max_gap_p90" in s.to_dict()


def test_goodput_is_the_last_passing_rate_before_the_first_failure():
    assert goodput([(1, 1.0), (2, 0.95), (3, 0.8), (4, 0.92)]) == 2
    assert goodput([(4, 0.5), (2, 0.89)]) == 0.0
    assert goodput([(1, 0.9), (2, 0.9)]) == 2
