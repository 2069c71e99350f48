"""Benchmark client: SLO attainment and goodput of any OpenAI-compatible chat server.

Modules: ``config`` (what to run), ``workloads``, ``images`` and ``videos`` (request contents),
``arrivals`` (when to send), ``client`` (streaming and timestamps), ``metrics``
(TTFT/TBT, SLO, goodput), ``runner`` (rates, sweeps, goodput search, closed loop), ``plot``.
"""

from hydrad.bench.config import SAMPLING_PRESETS, SLO, BenchConfig, GoodputSearch, Sampling, sweep_rates
from hydrad.bench.metrics import RequestResult, Summary
from hydrad.bench.runner import Bench, BenchResult, RateRun, run_bench

__all__ = [
    "SAMPLING_PRESETS",
    "SLO",
    "Bench",
    "BenchConfig",
    "BenchResult",
    "GoodputSearch",
    "RateRun",
    "RequestResult",
    "Sampling",
    "Summary",
    "run_bench",
    "sweep_rates",
]
