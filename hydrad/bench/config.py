"""Benchmark configuration: what to send, how fast, and which SLO to judge it by."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from hydrad.bench.images import IMAGE_FORMATS
from hydrad.errors import ConfigError

# Used when neither a request count nor a duration is given.
DEFAULT_NUM_REQUESTS = 100
ARRIVAL_KINDS = ("poisson", "trace")


@dataclass(frozen=True)
class SLO:
    """HydraInfer's per-request SLO: TTFT and the 90th percentile of the request's TBTs."""

    ttft: float
    tbt: float

    def __post_init__(self) -> None:
        if not (self.ttft > 0 and self.tbt > 0):
            raise ConfigError(f"SLO TTFT and TBT must be > 0 seconds, got {self.ttft} and {self.tbt}")


@dataclass(frozen=True)
class GoodputSearch:
    """Bracket the goodput by doubling (or halving) the rate from ``start_rate``, then bisect.

    The search stops when the bracket's width is at most ``rel_tol`` of its lower end.
    ``min_rate`` and ``max_rate`` bound the bracketing (defaults: start/16 and start*256);
    when every rate passes, the reported goodput is ``max_rate``, a lower bound.
    """

    start_rate: float = 1.0
    rel_tol: float = 0.05
    min_rate: float | None = None
    max_rate: float | None = None

    def __post_init__(self) -> None:
        if not self.start_rate > 0:
            raise ConfigError(f"goodput search start rate must be > 0, got {self.start_rate}")
        if not 0 < self.rel_tol < 1:
            raise ConfigError(f"goodput search tolerance must be in (0, 1), got {self.rel_tol}")
        if not 0 < self.lower <= self.start_rate <= self.upper:
            raise ConfigError("goodput search needs 0 < min_rate <= start_rate <= max_rate")

    @property
    def lower(self) -> float:
        return self.min_rate if self.min_rate is not None else self.start_rate / 16

    @property
    def upper(self) -> float:
        return self.max_rate if self.max_rate is not None else self.start_rate * 256


# The routes a benchmark drives (``BenchConfig.api``), and their paths.
APIS = {"chat": "/v1/chat/completions", "responses": "/v1/responses"}


@dataclass(frozen=True)
class Sampling:
    """How every request samples: greedy by default (temperature 0, as exact comparisons
    need); ``top_k`` is an extension vLLM, SGLang and hydrad accept."""

    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    # The request body's ``response_format`` (structured outputs); None: none.
    response_format: dict | None = None

    def __post_init__(self) -> None:
        if not (0 <= self.temperature <= 2):
            raise ConfigError(f"temperature must be in [0, 2], got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ConfigError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"top-k must be >= 1, got {self.top_k}")

    def fields(self) -> dict:
        """The request body's sampling fields."""
        out: dict = {"temperature": self.temperature}
        if self.top_p is not None:
            out["top_p"] = self.top_p
        if self.top_k is not None:
            out["top_k"] = self.top_k
        if self.response_format is not None:
            out["response_format"] = self.response_format
        return out


def response_format_of(spec: str) -> dict:
    """``--response-format``: ``json_object``, or ``json_schema:FILE`` (a JSON schema in FILE), as
    the request body's ``response_format``."""
    if spec == "json_object":
        return {"type": "json_object"}
    kind, _, path = spec.partition(":")
    if kind != "json_schema" or not path:
        raise ConfigError(f"--response-format is json_object or json_schema:FILE, got {spec!r}")
    try:
        schema = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--response-format: cannot read a JSON schema from {path}: {e}") from None
    if not isinstance(schema, dict):
        raise ConfigError(f"--response-format: {path} holds no JSON schema object")
    return {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}


# The samplings benchmarks compare by name: greedy (exact comparisons), the API's
# defaults (temperature 1), temperature with top-p alone (as OpenAI's API filters), and
# temperature with top-p and top-k filtering.
SAMPLING_PRESETS = {
    "greedy": Sampling(temperature=0.0),
    "defaults": Sampling(temperature=1.0),
    "top_p": Sampling(temperature=0.7, top_p=0.95),
    "filtered": Sampling(temperature=0.8, top_p=0.9, top_k=50),
}


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark: fixed rates (one, or a sweep), a goodput search, or a closed loop of
    ``concurrency`` requests in flight; exactly one of them."""

    url: str
    slo: SLO
    workload: str = "textcaps"
    model: str | None = None
    api_key: str | None = None
    # Requests per rate: a count, or as many as arrive within ``duration`` seconds.
    num_requests: int | None = None
    duration: float | None = None
    rates: tuple[float, ...] = ()
    search: GoodputSearch | None = None
    # Closed loop: this many requests in flight, each sent as soon as one finishes (peak
    # throughput).
    concurrency: int | None = None
    # Requests run first and not counted: in a closed loop the same way; with rates or a
    # search, sent at the first rate (the search's start) and waited for.
    warmup: int = 0
    sampling: Sampling = Sampling()
    arrivals: str = "poisson"
    # A Mooncake-format trace; with arrivals="trace" and no trace, the JSONL workload's timestamps.
    trace: str | None = None
    # Serving instances (GPUs) behind the URL; goodput is reported per instance.
    instances: int = 1
    seed: int = 0
    image_format: str = "jpeg"
    # Longest silence tolerated on a stream before the request counts as failed.
    request_timeout: float = 600.0
    # The API the requests go to: "chat" (/v1/chat/completions) or "responses" (OpenAI's
    # Responses API, /v1/responses: the same requests as its input items).
    api: str = "chat"

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"--url must be http(s)://host:port, got {self.url!r}")
        if self.num_requests is not None and self.duration is not None:
            raise ConfigError("give either a number of requests or a duration, not both")
        if self.num_requests is not None and self.num_requests < 1:
            raise ConfigError(f"number of requests must be >= 1, got {self.num_requests}")
        if self.duration is not None and not self.duration > 0:
            raise ConfigError(f"duration must be > 0 seconds, got {self.duration}")
        if bool(self.rates) + (self.search is not None) + (self.concurrency is not None) != 1:
            raise ConfigError("give exactly one of request rates, a goodput search and a concurrency")
        if self.concurrency is not None and self.concurrency < 1:
            raise ConfigError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.warmup < 0:
            raise ConfigError(f"warmup must be >= 0 requests, got {self.warmup}")
        if not all(r > 0 and math.isfinite(r) for r in self.rates):
            raise ConfigError(f"request rates must be > 0, got {list(self.rates)}")
        if self.arrivals not in ARRIVAL_KINDS:
            raise ConfigError(f"arrivals must be one of {', '.join(ARRIVAL_KINDS)}, got {self.arrivals!r}")
        if self.concurrency is not None and self.trace is not None:
            raise ConfigError("a closed loop sends each request when one finishes; it takes no trace")
        if self.trace is not None and self.arrivals != "trace":
            raise ConfigError("a trace file gives the arrivals; it cannot be combined with Poisson arrivals")
        if self.instances < 1:
            raise ConfigError(f"instances must be >= 1, got {self.instances}")
        if self.image_format not in IMAGE_FORMATS:
            raise ConfigError(f"image format must be one of {', '.join(IMAGE_FORMATS)}, got {self.image_format!r}")
        if self.api not in APIS:
            raise ConfigError(f"api must be one of {', '.join(APIS)}, got {self.api!r}")
        if not self.request_timeout > 0:
            raise ConfigError(f"request timeout must be > 0 seconds, got {self.request_timeout}")

    @property
    def searches_goodput(self) -> bool:
        """A sweep or a search reports a goodput; a single fixed rate does not."""
        return len(self.rates) > 1 or self.search is not None

    @property
    def base_url(self) -> str:
        """The server root: accepts both ``http://host:port`` and ``http://host:port/v1``."""
        url = self.url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


def sweep_rates(start: float, stop: float, step: float) -> tuple[float, ...]:
    """Rates ``start, start+step, ...`` up to ``stop`` inclusive (``R1:R2:STEP``)."""
    if not (start > 0 and step > 0 and stop >= start):
        raise ConfigError(f"a sweep needs 0 < R1 <= R2 and STEP > 0, got {start}:{stop}:{step}")
    count = int(math.floor((stop - start) / step + 1e-9)) + 1
    return tuple(round(start + i * step, 9) for i in range(count))
