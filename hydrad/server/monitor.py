"""The daemon's own load (CPU per streamed token, event-loop lag) and its workers'.

A small task wakes every ``interval`` seconds and records how late the loop ran
it (the lag every callback on the loop saw then: SSE writes, step outputs, new
requests). Once a second it samples the daemon process's CPU time (all its
threads: the event loop and the Request Processor's pool; the workers are other
processes) and the output tokens streamed so far; the CPU per token over the last
``window`` seconds is their ratio. Both go to ``Metrics`` (``/metrics``) and to
``hydractl status``. Given the workers' pids (``worker_pids``: the daemon's, not a front-end
process's), it reads their CPU time and resident memory at the same samples.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Callable, Iterable

from hydrad.cluster.usage import UsageWindow
from hydrad.server.metrics import Metrics


class FrontendMonitor:
    def __init__(self, metrics: Metrics, *, interval: float = 0.1, window: float = 10.0,
                 worker_pids: Callable[[], Iterable[int]] | None = None):
        self.metrics = metrics
        self.worker_pids = worker_pids
        self.workers = UsageWindow(window)
        self.interval = interval
        self.window = window
        # (monotonic time, process CPU seconds, output tokens) once a second.
        self._samples: deque[tuple[float, float, int]] = deque()
        # (monotonic time, lag seconds) of each wake-up in the window.
        self._lags: deque[tuple[float, float]] = deque()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._sample(time.monotonic())
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        last_sample = loop.time()
        while True:
            due = loop.time() + self.interval
            await asyncio.sleep(self.interval)
            now = loop.time()
            self.observe_lag(now, max(0.0, now - due))
            if now - last_sample >= 1.0:
                last_sample = now
                self._sample(time.monotonic())

    def refresh(self) -> None:
        """Sample now (a scrape or a status call), so the tokens streamed since the last
        periodic sample count."""
        self._sample(time.monotonic())

    def observe_lag(self, now: float, lag: float) -> None:
        self.metrics.observe_loop_lag(lag)
        self._lags.append((now, lag))
        while self._lags and self._lags[0][0] < now - self.window:
            self._lags.popleft()

    def _sample(self, now: float) -> None:
        if self.worker_pids is not None:
            self.workers.sample(self.worker_pids(), now)
        self._samples.append((now, time.process_time(), self.metrics.num_generation_tokens))
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window:
            self._samples.popleft()
        per_token = self.cpu_per_token()
        if per_token is not None:
            self.metrics.set_cpu_per_token(per_token)

    def cpu_per_token(self) -> float | None:
        """Daemon CPU seconds per output token over the window; None while no token streamed."""
        if len(self._samples) < 2:
            return None
        (_, cpu0, tokens0), (_, cpu1, tokens1) = self._samples[0], self._samples[-1]
        return (cpu1 - cpu0) / (tokens1 - tokens0) if tokens1 > tokens0 else None

    def status(self) -> dict:
        """For ``/admin/status``: CPU per token and loop lag over the window."""
        lags = sorted(lag for _, lag in self._lags)
        cpu = tokens = None
        if len(self._samples) >= 2:
            (t0, cpu0, tokens0), (t1, cpu1, tokens1) = self._samples[0], self._samples[-1]
            if t1 > t0:
                cpu, tokens = (cpu1 - cpu0) / (t1 - t0), (tokens1 - tokens0) / (t1 - t0)
        return {
            "pid": os.getpid(),
            "window_seconds": self.window,
            "cpu_per_token": self.cpu_per_token(),
            "cpu_share": cpu,  # CPU seconds per second (1.0: one core busy)
            "tokens_per_second": tokens,  # streamed by this process
            "loop_lag_p99": lags[min(len(lags) - 1, int(0.99 * len(lags)))] if lags else None,
            "loop_lag_max": lags[-1] if lags else None,
        }


def combined_cpu_per_token(statuses: list[dict]) -> float | None:
    """CPU per streamed token of several front-end processes together: all their CPU over
    all their tokens (None while none streamed)."""
    cpu = sum(s["cpu_share"] or 0.0 for s in statuses)
    tokens = sum(s.get("tokens_per_second") or 0.0 for s in statuses)
    return cpu / tokens if tokens > 0 else None


def frontend_status(own: dict, others: list[dict]) -> dict:
    """``/admin/status``'s ``frontend``: the daemon's own monitor status when it is the only
    front-end process; else the processes together (CPU summed, lag the worst) and each
    one under ``processes``."""
    if not others:
        return own
    statuses = [own, *others]
    shares = [s["cpu_share"] for s in statuses if s["cpu_share"] is not None]
    lags99 = [s["loop_lag_p99"] for s in statuses if s["loop_lag_p99"] is not None]
    lags = [s["loop_lag_max"] for s in statuses if s["loop_lag_max"] is not None]
    rates = [s.get("tokens_per_second") for s in statuses if s.get("tokens_per_second") is not None]
    return {
        "window_seconds": own["window_seconds"],
        "cpu_per_token": combined_cpu_per_token(statuses),
        "cpu_share": sum(shares) if shares else None,
        "tokens_per_second": sum(rates) if rates else None,
        "loop_lag_p99": max(lags99) if lags99 else None,
        "loop_lag_max": max(lags) if lags else None,
        "processes": statuses,
    }
