"""A recorded workload as simulator requests at a target rate, with the bench's own arrivals.

The replay follows ``hydractl bench --workload TRACE``: request ``i`` has the shape of the
trace's ``i``-th request by arrival (cycled), and arrives at the trace's ``i``-th
timestamp scaled to the mean rate (``--arrivals trace``, ``hydrad.bench.arrivals``), or at
Poisson times. So a simulated goodput and a live one measured with the bench on the same
trace and request count describe the same runs.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

from hydrad.bench.arrivals import Trace, poisson_arrivals, trace_arrivals
from hydrad.errors import ConfigError
from hydrad.planner.simulator import SimRequest
from hydrad.trace import TraceRecord

ARRIVALS = ("trace", "poisson")
# The quantile of a trace's preprocess times (per image count) taken as the Request
# Processor's service time. A low one (it was the 10th percentile) keeps waits out even
# under load, but on a workload whose image sizes vary it takes the smallest images' time:
# on TextCaps-like traces recorded at 1 req/s the 10th percentile was 14.7 ms, the median
# 21.3 ms and the mean 23.4 ms, and replays of 72 live rounds of four accuracy runs came out
# 2.3 points lower on average with the median, closer to live (bench/RESULTS.md).
SERVICE_QUANTILE = 0.5


@dataclass(frozen=True)
class RequestShape:
    num_prompt_tokens: int
    num_output_tokens: int
    images: tuple[tuple[int, int, int, int], ...]  # (offset, tokens, patches, attention span)
    preprocess: float
    cached_tokens: int = 0  # found in a prefix cache when it was traced
    prompt_logprobs: bool = False  # its prefill prices every prompt position
    # One of a prompt's ``n`` completions: the index of the group's first shape (the one that
    # computed the prompt when traced), None for a prompt's only completion.
    group: int | None = None


@dataclass(frozen=True)
class Workload:
    """Request shapes in arrival order and their arrival times (seconds from the first)."""

    shapes: tuple[RequestShape, ...]
    trace: Trace

    @classmethod
    def from_records(cls, records: list[TraceRecord]) -> Workload:
        if len(records) < 2:
            raise ConfigError(f"the trace holds {len(records)} finished request(s); planning needs at least 2")
        # A prompt's completions arrived at one instant: the one that computed the prompt (the
        # fewest tokens found cached) goes first, the group's first shape.
        records = sorted(records, key=lambda r: (r.timestamp, r.cached_tokens))
        # The simulator queues requests for the Request Processor itself, so it replays each
        # one's service time: the median (SERVICE_QUANTILE) over the requests with as many
        # images, and as many of them found preprocessed (a file sent before: neither decoded
        # nor processed again, 4-5x cheaper; a chat's later turns against its first), of the
        # processor's CPU time on each (``processing``). A trace written before that was
        # recorded has only ``preprocess``, which includes the waits for a thread: its median
        # moves only once most requests waited, as they all do in a trace recorded at
        # overload, whose replay would then be bound by a processor many times slower than
        # the daemon's.
        by_images: dict[tuple[int, int], list[float]] = {}
        for r in records:
            by_images.setdefault((len(r.images), r.images_found), []).append(
                r.preprocess if r.processing is None else min(r.processing, r.preprocess))
        service = {k: _quantile(v, SERVICE_QUANTILE) for k, v in by_images.items()}
        firsts: dict[str, int] = {}  # group -> its first shape
        shapes = tuple(RequestShape(r.prompt_tokens, max(1, r.output_tokens),
                                    tuple((i.offset, i.tokens, i.patches, i.span) for i in r.images),
                                    service[len(r.images), r.images_found], r.cached_tokens, r.prompt_logprobs,
                                    None if r.group is None else firsts.setdefault(r.group, k))
                       for k, r in enumerate(records))
        stamps = [r.timestamp for r in records]
        if stamps[-1] <= stamps[0]:
            raise ConfigError("the trace's requests all arrived at the same instant: it has no rate to scale")
        return cls(shapes, Trace.from_timestamps(stamps))

    def __len__(self) -> int:
        return len(self.shapes)

    @property
    def mean_rate(self) -> float:
        """The trace's own request rate (req/s)."""
        return self.trace.mean_rate

    def requests(self, rate: float, num_requests: int, arrivals: str = "trace", seed: int = 0) -> list[SimRequest]:
        """``num_requests`` requests arriving at mean ``rate`` req/s."""
        if arrivals == "trace":
            times = trace_arrivals(self.trace, rate, num_requests, None)
        elif arrivals == "poisson":
            times = poisson_arrivals(rate, random.Random(f"{seed}/plan"), num_requests, None)
        else:
            raise ConfigError(f"arrivals must be one of {', '.join(ARRIVALS)}, got {arrivals!r}")
        shapes = self.shapes
        grouped = arrivals == "trace"  # Poisson arrivals part a prompt's completions
        return [SimRequest(t, s.num_prompt_tokens, s.num_output_tokens, s.images, s.preprocess, s.cached_tokens,
                           s.prompt_logprobs,
                           i - i % len(shapes) + s.group if grouped and s.group is not None else None)
                for i, t, s in ((i, t, shapes[i % len(shapes)]) for i, t in enumerate(times))]

    def summary(self) -> dict:
        """Means of what a request holds (for reports)."""
        n = len(self.shapes)
        return {
            "requests": n,
            "rate": self.mean_rate,
            "images": sum(len(s.images) for s in self.shapes) / n,
            "image_tokens": sum(image[1] for s in self.shapes for image in s.images) / n,
            "prompt_tokens": sum(s.num_prompt_tokens for s in self.shapes) / n,
            "cached_tokens": sum(s.cached_tokens for s in self.shapes) / n,
            "output_tokens": sum(s.num_output_tokens for s in self.shapes) / n,
            "preprocess": statistics.median(s.preprocess for s in self.shapes),
        }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
