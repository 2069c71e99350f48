"""Arrival times: Poisson at a rate, or a trace's timestamps rescaled to a mean rate.

A run sends either ``num_requests`` requests or every request that arrives within
``duration`` seconds; arrival offsets are seconds from the start of the run.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from hydrad.errors import ConfigError


@dataclass(frozen=True)
class Trace:
    """Arrival timestamps in seconds from the first request, sorted, with per-request lengths when known."""

    timestamps: tuple[float, ...]
    input_lengths: tuple[int, ...] | None = None
    output_lengths: tuple[int, ...] | None = None
    hash_ids: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        if len(self.timestamps) < 2 or self.timestamps[-1] <= self.timestamps[0]:
            raise ConfigError("a trace needs at least two distinct timestamps to define a rate")

    def __len__(self) -> int:
        return len(self.timestamps)

    @property
    def period(self) -> float:
        """The trace's span plus one mean gap: the offset at which a cycled trace repeats."""
        span = self.timestamps[-1] - self.timestamps[0]
        return span * len(self) / (len(self) - 1)

    @property
    def mean_rate(self) -> float:
        return len(self) / self.period

    @classmethod
    def from_timestamps(cls, timestamps: list[float] | tuple[float, ...]) -> Trace:
        order = sorted(timestamps)
        return cls(tuple(t - order[0] for t in order))


def load_mooncake_trace(path: str | Path) -> Trace:
    """Read a Mooncake trace: JSONL of ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}``."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read trace file {path}: {getattr(e, 'strerror', None) or e}") from None
    rows = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            ms = float(obj["timestamp"])
            lengths = (int(obj["input_length"]), int(obj["output_length"])) if "input_length" in obj else None
            hash_ids = tuple(int(h) for h in obj.get("hash_ids", ()))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise ConfigError(f"{path}:{lineno}: expected {{\"timestamp\": ms, ...}} (Mooncake trace format)") from None
        rows.append((ms / 1000.0, lengths, hash_ids))
    if not rows:
        raise ConfigError(f"trace file {path} holds no requests")
    # Stable sort: requests sharing a timestamp keep their order in the file.
    rows.sort(key=lambda row: row[0])
    t0 = rows[0][0]
    has_lengths = all(row[1] is not None for row in rows)
    return Trace(
        timestamps=tuple(row[0] - t0 for row in rows),
        input_lengths=tuple(max(1, row[1][0]) for row in rows) if has_lengths else None,
        output_lengths=tuple(row[1][1] for row in rows) if has_lengths else None,
        hash_ids=tuple(row[2] for row in rows) if has_lengths else None,
    )


def _take(times, num_requests: int | None, duration: float | None) -> list[float]:
    out = []
    for t in times:
        if (num_requests is not None and len(out) >= num_requests) or (duration is not None and t > duration):
            break
        out.append(t)
    return out


def poisson_arrivals(
    rate: float, rng: random.Random, num_requests: int | None, duration: float | None
) -> list[float]:
    def times():
        t = 0.0
        while True:
            yield t
            t += rng.expovariate(rate)

    return _take(times(), num_requests, duration)


def trace_arrivals(trace: Trace, rate: float, num_requests: int | None, duration: float | None) -> list[float]:
    """The trace's timestamps scaled by ``trace.mean_rate / rate``, cycled if more are needed.

    The scale comes from the whole trace, so a run that sends only its first requests
    keeps their burstiness rather than being stretched to the mean rate.
    """
    scale = trace.mean_rate / rate

    def times():
        cycle = 0
        while True:
            for t in trace.timestamps:
                yield (t + cycle * trace.period) * scale
            cycle += 1

    return _take(times(), num_requests, duration)
