"""Per-request latencies from stream timings, SLO attainment, and goodput.

A request meets its SLO iff its TTFT <= the TTFT SLO and the 90th percentile of its
inter-token gaps (TBT) <= the TBT SLO (HydraInfer §2.2). Attainment is met / sent:
failed requests count as sent and not met. Goodput is the highest request rate with
attainment >= 90%.

Spreading a chunk's gap over its tokens: a chunk that carries k tokens and arrives
g seconds after the previous one contributes k gaps of g/k. The token counts come,
in order of preference, from

1. per-chunk ``token_ids`` (``return_token_ids``, which vLLM and hydrad honour) or
   per-chunk usage (cumulative ``completion_tokens`` in every chunk, as vLLM's
   ``continuous_usage_stats`` sends it): exact counts;
2. the final usage chunk, when it reports more tokens (C) than there were token
   chunks (M): every chunk holds at least one token and the other C-M go to the
   chunks whose text is longer than one token's worth (C tokens share the text's
   length), in proportion to the excess, by largest remainders. When the texts
   tell nothing apart (all alike), the first chunk holds one token, as a prefill
   emits one, and the other C-1 are spread as evenly as integers allow over the
   other M-1 chunks;
3. otherwise one token per chunk.

Counts from rule 1, or rule 3 when the final usage equals the number of chunks,
are exact; the others are estimates, and the request says so
(``token_counts: "estimated"``).

Which chunks carry tokens is decided by ``client.token_chunks``: a bare role
announcement and a closing chunk without content are not token chunks.

Tokens that arrive together with the first one add gaps of zero, since they were
observed at the same instant.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

from hydrad.bench.config import SLO

GOODPUT_ATTAINMENT = 0.9


@dataclass
class StreamRecord:
    """What the client observed for one request; times are ``time.perf_counter()`` seconds."""

    start: float
    end: float = 0.0
    # Arrival time of every chunk that carried a generated token.
    chunk_times: list[float] = field(default_factory=list)
    # Tokens per token chunk from token ids or per-chunk usage; None where the server gave neither.
    chunk_tokens: list[int | None] = field(default_factory=list)
    # Characters of text per token chunk.
    chunk_chars: list[int] = field(default_factory=list)
    # From the final usage chunk.
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    error: str | None = None
    # The answer came whole (not streamed): its tokens all at once, no gaps between them.
    whole: bool = False


@dataclass(frozen=True)
class RequestResult:
    ttft: float | None
    tbts: tuple[float, ...]
    e2e: float | None
    output_tokens: int
    met_slo: bool
    error: str | None
    # "exact": the server gave the tokens of every chunk (or one per chunk, as its usage
    # confirms); "estimated": apportioned from the final usage, or assumed one per chunk.
    token_counts: str = "exact"
    # The prompt's tokens as the server's usage counts them (images' and videos' included).
    prompt_tokens: int | None = None

    def to_dict(self) -> dict:
        return {**asdict(self), "tbts": list(self.tbts)}


def counts_are_exact(record: StreamRecord) -> bool:
    """Whether ``chunk_token_counts`` knows the tokens of every chunk rather than estimating them."""
    if all(k is not None for k in record.chunk_tokens):
        return True
    return record.completion_tokens == len(record.chunk_times)


def chunk_token_counts(record: StreamRecord) -> list[int]:
    """Tokens carried by each token chunk (rules 1-3 of the module docstring)."""
    num_chunks = len(record.chunk_times)
    if num_chunks == 0:
        return []
    if all(k is not None for k in record.chunk_tokens):
        return list(record.chunk_tokens)
    total = record.completion_tokens
    if total is None or total <= num_chunks:
        return [1] * num_chunks
    if num_chunks == 1:
        return [total]
    by_text = _apportion_by_text(total, record.chunk_chars)
    if by_text is not None:
        return by_text
    rest, slots = total - 1, num_chunks - 1
    return [1] + [(j * rest) // slots - ((j - 1) * rest) // slots for j in range(1, num_chunks)]


def _apportion_by_text(total: int, chars: list[int]) -> list[int] | None:
    """``total`` tokens over chunks of ``chars`` characters: one each, and the rest where the
    text is longer than one token's worth; None when the texts tell nothing apart."""
    if not chars or sum(chars) == 0:
        return None
    chars_per_token = sum(chars) / total
    excess = [max(0.0, c / chars_per_token - 1) for c in chars]
    if sum(excess) == 0 or len(set(excess)) == 1:
        return None
    extra = total - len(chars)
    quotas = [extra * e / sum(excess) for e in excess]
    counts = [1 + int(q) for q in quotas]
    # Largest remainders first; ties to the earlier chunk.
    by_remainder = sorted(range(len(chars)), key=lambda i: (-(quotas[i] - int(quotas[i])), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def inter_token_gaps(record: StreamRecord) -> list[float]:
    counts = chunk_token_counts(record)
    if not counts or record.whole:
        return []
    gaps = [0.0] * max(0, counts[0] - 1)
    last = record.chunk_times[0]
    for t, k in zip(record.chunk_times[1:], counts[1:]):
        # A chunk with no new token leaves its time to the next chunk that has one.
        if k > 0:
            gaps.extend([(t - last) / k] * k)
            last = t
    return gaps


def percentile(values: list[float] | tuple[float, ...], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def evaluate(record: StreamRecord, slo: SLO) -> RequestResult:
    ttft = record.chunk_times[0] - record.start if record.chunk_times else None
    gaps = inter_token_gaps(record)
    output_tokens = record.completion_tokens
    if output_tokens is None:
        output_tokens = sum(chunk_token_counts(record))
    tbt_p90 = percentile(gaps, 90)
    met = (
        record.error is None
        and ttft is not None
        and ttft <= slo.ttft
        and (tbt_p90 is None or tbt_p90 <= slo.tbt)
    )
    return RequestResult(
        ttft=ttft,
        tbts=tuple(gaps),
        e2e=record.end - record.start if record.end else None,
        output_tokens=output_tokens,
        met_slo=met,
        error=record.error,
        token_counts="exact" if counts_are_exact(record) else "estimated",
        prompt_tokens=record.prompt_tokens,
    )


@dataclass(frozen=True)
class Summary:
    """One run's statistics over its successful requests; times in seconds."""

    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    tbt_p50: float | None
    tbt_p90: float | None
    tbt_p99: float | None
    e2e_p50: float | None
    e2e_p90: float | None
    e2e_p99: float | None
    attainment: float
    throughput_rps: float
    output_tokens_per_s: float
    # Set only on the headline summary of a sweep or a goodput search (per instance).
    goodput_rps: float | None
    errors: int
    # Successful requests whose tokens per chunk were estimated (see RequestResult.token_counts).
    estimated_token_counts: int
    rate: float
    num_requests: int
    num_met: int
    duration: float
    # A closed-loop run: requests kept in flight (``rate`` is then the achieved req/s).
    concurrency: int | None = None
    # Mean prompt tokens of the successful requests, as the server's usage counts them (None
    # where it gave none): what one server made of the same images and videos against another.
    prompt_tokens_mean: float | None = None
    # Each successful request's longest gap between two tokens, its percentiles: a stall (a
    # stream handed over and left waiting, a step past the bound) that the TBT percentiles,
    # pooled over every gap, and the SLO, a p90 per request, do not show.
    max_gap_p50: float | None = None
    max_gap_p90: float | None = None
    max_gap_p99: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(results: list[RequestResult], rate: float | None, duration: float,
              concurrency: int | None = None) -> Summary:
    """``rate``: the offered rate; None for a closed loop, which reports the achieved one."""
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tbts = [gap for r in ok for gap in r.tbts]
    e2es = [r.e2e for r in ok if r.e2e is not None]
    longest = [max(r.tbts) for r in ok if r.tbts]
    num_met = sum(r.met_slo for r in results)
    throughput = len(ok) / duration if duration > 0 else 0.0
    return Summary(
        *(percentile(values, q) for values in (ttfts, tbts, e2es) for q in (50, 90, 99)),
        attainment=num_met / len(results) if results else 0.0,
        throughput_rps=throughput,
        output_tokens_per_s=sum(r.output_tokens for r in ok) / duration if duration > 0 else 0.0,
        goodput_rps=None,
        errors=len(results) - len(ok),
        estimated_token_counts=sum(r.token_counts == "estimated" for r in ok),
        rate=throughput if rate is None else rate,
        num_requests=len(results),
        num_met=num_met,
        duration=duration,
        concurrency=concurrency,
        prompt_tokens_mean=statistics.fmean(counted) if (counted := [r.prompt_tokens for r in ok
                                                                     if r.prompt_tokens is not None]) else None,
        max_gap_p50=percentile(longest, 50), max_gap_p90=percentile(longest, 90), max_gap_p99=percentile(longest, 99),
    )


def goodput(points: list[tuple[float, float]]) -> float:
    """The highest rate meeting the attainment target below the lowest rate that misses it.

    ``points`` are (rate, attainment). A rate that passes above a failing one is noise
    past the knee, not goodput. 0.0 when even the lowest rate misses.
    """
    best = 0.0
    for rate, attainment in sorted(points):
        if attainment < GOODPUT_ATTAINMENT:
            break
        best = rate
    return best
