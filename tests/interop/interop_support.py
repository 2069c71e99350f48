"""What the interop tests share: the tools' offline environment, and hydrad's own
counters (from ``/metrics``) to check what each tool reports against."""

from __future__ import annotations

import os
from dataclasses import dataclass

from daemon_process import http

# Nothing may come from a model hub: tools read the tokenizer from the model folder.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1"}

# How far a client's mean TTFT may sit above hydrad's own (which starts when the daemon
# reads the request's headers and ends when the first token is handed to the stream): the
# client also times connecting, sending the body and reading the chunk, and on two busy
# cores its own event loop can be late to read. Never below hydrad's, less a clock's jitter.
TTFT_SLACK_S = 0.15
TTFT_SLACK_REL = 0.5
TTFT_EARLY_S = 0.005


def tool_env(**overrides: str | None) -> dict[str, str]:
    """The environment for a tool's process: offline, and ``None`` removes a variable."""
    env = {**os.environ, **OFFLINE_ENV}
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


@dataclass(frozen=True)
class Counters:
    """hydrad's request counters, as ``/metrics`` exposes them."""

    requests: float  # finished, any reason
    failed: float  # finished with "error" or "abort"
    generation_tokens: float
    ttft_sum: float
    ttft_count: float

    def __sub__(self, other: Counters) -> Counters:
        return Counters(*(a - b for a, b in zip(self.__dict__.values(), other.__dict__.values())))

    @property
    def mean_ttft(self) -> float:
        return self.ttft_sum / self.ttft_count


def counters(daemon) -> Counters:
    from prometheus_client.parser import text_string_to_metric_families

    samples = [s for family in text_string_to_metric_families(http("GET", daemon.url + "/metrics").text)
               for s in family.samples]

    def total(name: str, keep=lambda labels: True) -> float:
        return sum(s.value for s in samples if s.name == name and keep(s.labels))

    return Counters(
        requests=total("hydrad_requests_finished_total"),
        failed=total("hydrad_requests_finished_total", lambda labels: labels["finish_reason"] in ("error", "abort")),
        generation_tokens=total("hydrad_generation_tokens_total"),
        ttft_sum=total("hydrad_time_to_first_token_seconds_sum"),
        ttft_count=total("hydrad_time_to_first_token_seconds_count"),
    )


def assert_ttft_agrees(client_mean_s: float, hydrad: Counters) -> None:
    server = hydrad.mean_ttft
    upper = server + TTFT_SLACK_S + TTFT_SLACK_REL * server
    print(f"mean TTFT: client {1000 * client_mean_s:.1f} ms, hydrad {1000 * server:.1f} ms")
    assert server - TTFT_EARLY_S <= client_mean_s <= upper, (
        f"client mean TTFT {1000 * client_mean_s:.1f} ms, hydrad's {1000 * server:.1f} ms "
        f"(allowed {1000 * (server - TTFT_EARLY_S):.1f}..{1000 * upper:.1f} ms)")
