"""Drive a benchmark: open-loop runs at fixed rates, a sweep, a goodput search, or a
closed loop at a fixed concurrency.

Library use::

    from hydrad.bench import BenchConfig, SLO, run_bench
    result = run_bench(BenchConfig(url="http://127.0.0.1:8000", slo=SLO(ttft=2.0, tbt=0.2), rates=(4.0,)))
    print(result.summary.attainment, result.to_json())

Requests are sent at their arrival times whether or not earlier ones have finished
(open loop), each over its own connection slot, so a slow server builds a queue
instead of slowing the client down. A closed loop (``concurrency=C``) keeps C requests
in flight instead, sending the next as soon as one finishes: the peak throughput.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import time
from dataclasses import asdict, dataclass, replace
from typing import Protocol

import aiohttp

from hydrad.bench.arrivals import Trace, load_mooncake_trace, poisson_arrivals, trace_arrivals
from hydrad.bench.client import (auth_headers, chat_payload, check_responses_workload, resolve_model,
                                 responses_payload, stream_chat)
from hydrad.bench.config import APIS, DEFAULT_NUM_REQUESTS, BenchConfig, GoodputSearch
from hydrad.bench.images import file_data_url, image_data_url, synth_image
from hydrad.bench.metrics import GOODPUT_ATTAINMENT, RequestResult, Summary, evaluate, goodput, summarize
from hydrad.bench.workloads import RequestSpec, SynthImage, SynthVideo, load_workload
from hydrad.errors import ConfigError


@dataclass(frozen=True)
class RateRun:
    """The requests of one run at one offered rate (a closed loop: the achieved rate at
    ``concurrency``); ``interrupted`` when it was cut short."""

    rate: float
    results: tuple[RequestResult, ...]
    summary: Summary
    interrupted: bool = False
    concurrency: int | None = None
    # The client's own CPU seconds (this process) while the run's requests were in flight;
    # their bodies (images encoded) are built before it starts and not counted.
    client_cpu_seconds: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.concurrency} in flight" if self.concurrency else f"{self.rate:.4g} req/s"

    @property
    def passes(self) -> bool:
        return self.summary.attainment >= GOODPUT_ATTAINMENT


class BenchObserver(Protocol):
    """Progress callbacks, called on the event loop; must not block."""

    def run_started(self, label: str, num_requests: int | None) -> None: ...

    def request_sent(self) -> None: ...

    def request_finished(self, result: RequestResult) -> None: ...

    def run_finished(self, run: RateRun) -> None: ...


class _SilentObserver:
    def run_started(self, label: str, num_requests: int | None) -> None:
        pass

    def request_sent(self) -> None:
        pass

    def request_finished(self, result: RequestResult) -> None:
        pass

    def run_finished(self, run: RateRun) -> None:
        pass


@dataclass(frozen=True)
class BenchResult:
    config: BenchConfig
    model: str
    runs: tuple[RateRun, ...]  # sorted by rate
    # Highest passing rate over all instances; None for fixed-rate runs.
    goodput_total: float | None
    interrupted: bool

    @property
    def client_cpu_seconds(self) -> float:
        """The client's own CPU while requests were in flight, over the runs (this process):
        a client on the server's machine takes it from the server's cores
        (``SimSetup.client_seconds``)."""
        return sum(r.client_cpu_seconds for r in self.runs)

    @property
    def num_sent(self) -> int:
        return sum(len(r.results) for r in self.runs)

    @property
    def client_cpu_per_request(self) -> float | None:
        return self.client_cpu_seconds / self.num_sent if self.num_sent else None

    @property
    def headline(self) -> RateRun | None:
        """The run at the goodput rate when one was searched for, else the first run."""
        if not self.runs:
            return None
        if self.goodput_total:
            return next(r for r in self.runs if r.rate == self.goodput_total)
        return self.runs[0]

    @property
    def summary(self) -> Summary | None:
        run = self.headline
        if run is None:
            return None
        if self.goodput_total is None:
            return run.summary
        return replace(run.summary, goodput_rps=self.goodput_total / self.config.instances)

    def to_dict(self) -> dict:
        config = asdict(self.config)
        config.pop("api_key")  # results files get shared; keys must not travel with them
        if config["sampling"]["response_format"] is None:  # named only where the requests carried one
            del config["sampling"]["response_format"]
        config["model"] = self.model
        summary = self.summary
        out = {
            "config": config,
            "summary": summary.to_dict() if summary else None,
            "requests": [r.to_dict() for r in self.headline.results] if self.headline else [],
            "interrupted": self.interrupted,
            "client_cpu_seconds": self.client_cpu_seconds,
        }
        if self.config.searches_goodput:
            out["sweep"] = [
                {"rate": r.rate, "summary": r.summary.to_dict(), "requests": [x.to_dict() for x in r.results]}
                for r in self.runs
            ]
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


class Bench:
    """One benchmark. ``run()`` may be cancelled; ``result()`` then holds what was measured."""

    def __init__(self, config: BenchConfig, observer: BenchObserver | None = None):
        self.config = config
        self.observer = observer or _SilentObserver()
        trace = load_mooncake_trace(config.trace) if config.trace else None
        self.workload = load_workload(config.workload, config.seed, trace)
        if config.arrivals == "trace" and trace is None:
            if self.workload.timestamps is None:
                raise ConfigError(
                    "trace arrivals need --trace FILE, or a JSONL workload with a timestamp on every line"
                )
            trace = Trace.from_timestamps(self.workload.timestamps)
        self.trace = trace
        self.model = config.model or ""
        self.runs: list[RateRun] = []
        self.completed = False
        self._file_urls: dict[str, str] = {}

    def result(self) -> BenchResult:
        runs = tuple(sorted(self.runs, key=lambda r: r.rate))
        # A run cut short measured only its fastest requests; it cannot vouch for its rate.
        points = [(r.rate, r.summary.attainment) for r in runs if not r.interrupted]
        total = goodput(points) if self.config.searches_goodput and points else None
        return BenchResult(self.config, self.model, runs, total, interrupted=not self.completed)

    async def run(self) -> None:
        headers = {"Content-Type": "application/json", **auth_headers(self.config.api_key)}
        # limit=0: one connection per in-flight request, never a client-side queue.
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=self.config.request_timeout)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            base = self.config.base_url
            self.model = await resolve_model(session, base, self.config.api_key, self.config.model)
            url = base + APIS[self.config.api]
            if self.config.warmup and self.config.concurrency is None:
                first = self.config.search.start_rate if self.config.search is not None else self.config.rates[0]
                await self._warm_up(first, session, url, headers)
            if self.config.search is not None:
                await self._search(self.config.search, session, url, headers)
            elif self.config.concurrency is not None:
                await self._run_closed(self.config.concurrency, session, url, headers)
            else:
                for rate in self.config.rates:
                    await self._run_rate(rate, session, url, headers)
        self.completed = True

    async def _search(self, search: GoodputSearch, session, url, headers) -> None:
        async def passes(rate: float) -> bool:
            return (await self._run_rate(rate, session, url, headers)).passes

        # Bracket: double while passing, halve while failing, within [lower, upper].
        lo = hi = None
        rate = search.start_rate
        while lo is None or hi is None:
            if await passes(rate):
                lo = rate
                if hi is not None or rate >= search.upper:
                    break
                rate = min(rate * 2, search.upper)
            else:
                hi = rate
                if lo is not None or rate <= search.lower:
                    break
                rate = max(rate / 2, search.lower)
        if lo is None or hi is None:
            return
        while (hi - lo) / lo > search.rel_tol:
            mid = (lo + hi) / 2
            if await passes(mid):
                lo = mid
            else:
                hi = mid

    def _arrivals(self, rate: float, salt: int) -> list[float]:
        num, duration = self.config.num_requests, self.config.duration
        if num is None and duration is None:
            num = DEFAULT_NUM_REQUESTS
        if self.trace is not None:
            return trace_arrivals(self.trace, rate, num, duration)
        return poisson_arrivals(rate, random.Random(f"{self.config.seed}/{salt}"), num, duration)

    def _image_url(self, image: SynthImage | str) -> str:
        if isinstance(image, str):
            if image not in self._file_urls:
                self._file_urls[image] = file_data_url(image)
            return self._file_urls[image]
        return image_data_url(synth_image(image.width, image.height, image.seed), self.config.image_format)

    def _video_url(self, video: SynthVideo | str) -> str:
        from hydrad.bench.videos import video_data_url, video_file_data_url

        if isinstance(video, str):
            if video not in self._file_urls:
                self._file_urls[video] = video_file_data_url(video)
            return self._file_urls[video]
        return video_data_url(video)

    def _payload(self, spec: RequestSpec) -> bytes:
        images = [self._image_url(img) for img in spec.images]
        if self.config.api == "responses":
            check_responses_workload(spec)
            return responses_payload(self.model, spec, images, self.config.sampling.fields())
        return chat_payload(self.model, spec, images, self.config.sampling.fields(),
                            [self._video_url(v) for v in spec.videos])

    async def _payloads(self, specs: list[RequestSpec]) -> list[bytes]:
        bodies = []
        for spec in specs:
            bodies.append(self._payload(spec))
            # Encoding images takes tens of ms each; yield so Ctrl-C is honoured promptly.
            await asyncio.sleep(0)
        return bodies

    async def _send(self, session, url, body: bytes, headers, results: list[RequestResult]) -> None:
        record = await stream_chat(session, url, body, headers, self.config.request_timeout)
        result = evaluate(record, self.config.slo)
        results.append(result)
        self.observer.request_finished(result)

    async def _run_closed(self, concurrency: int, session, url, headers) -> RateRun:
        """Keep ``concurrency`` requests in flight: the warmup requests (not counted), then
        ``num_requests`` of them, or as many as start within ``duration`` seconds."""
        if self.config.warmup:
            warm = [self.workload.request(i, "warmup") for i in range(self.config.warmup)]
            await self._closed_loop(concurrency, await self._payloads(warm), None, session, url, headers, None)
        num, duration = self.config.num_requests, self.config.duration
        if num is None and duration is None:
            num = DEFAULT_NUM_REQUESTS
        # A count: every body is built before the clock starts. A duration: bodies are built
        # as requests start (images encode in tens of ms; a closed loop rarely waits on it).
        bodies = await self._payloads([self.workload.request(i, 0) for i in range(num)]) if num else None
        self.observer.run_started(f"{concurrency} in flight", num)
        results: list[RequestResult] = []
        start, cpu = time.perf_counter(), time.process_time()
        interrupted = True
        try:
            await self._closed_loop(concurrency, bodies, duration, session, url, headers, results)
            interrupted = False
        finally:
            elapsed = time.perf_counter() - start
            summary = summarize(results, None, elapsed, concurrency)
            run = RateRun(summary.rate, tuple(results), summary, interrupted, concurrency,
                          client_cpu_seconds=time.process_time() - cpu)
            self.runs.append(run)
            self.observer.run_finished(run)
        return run

    async def _closed_loop(self, concurrency: int, bodies: list[bytes] | None, duration: float | None,
                           session, url, headers, results: list[RequestResult] | None) -> None:
        """``results`` None: warmup, neither kept nor reported."""
        deadline = None if duration is None else time.perf_counter() + duration
        index = 0

        def next_body() -> bytes | None:
            nonlocal index
            if bodies is not None:
                body = bodies[index] if index < len(bodies) else None
            elif time.perf_counter() < deadline:
                body = self._payload(self.workload.request(index, 0))
            else:
                body = None
            index += 1
            return body

        async def worker() -> None:
            while (body := next_body()) is not None:
                if results is None:
                    await stream_chat(session, url, body, headers, self.config.request_timeout)
                    continue
                self.observer.request_sent()
                await self._send(session, url, body, headers, results)

        workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
        try:
            await asyncio.gather(*workers)
        finally:
            # Reached on Ctrl-C too: requests still in flight are dropped, not counted.
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    async def _warm_up(self, rate: float, session, url, headers) -> None:
        """``warmup`` requests sent at ``rate`` (the first rate) before the counted runs, and
        waited for; neither kept nor reported. A freshly started server serves its first
        requests slower than the rest (its workers calibrate their steps, allocate, fill
        caches): the runs then measure it as it serves."""
        num = self.config.warmup
        if self.trace is not None:
            offsets = trace_arrivals(self.trace, rate, num, None)
        else:
            offsets = poisson_arrivals(rate, random.Random(f"{self.config.seed}/warmup"), num, None)
        bodies = await self._payloads([self.workload.request(i, "warmup") for i in range(len(offsets))])
        await self._open_loop(offsets, bodies, session, url, headers, None)

    async def _open_loop(self, offsets: list[float], bodies: list[bytes], session, url, headers,
                         results: list[RequestResult] | None) -> None:
        """Send each body at its offset (seconds from now) and wait for every answer;
        ``results`` None: warmup, neither kept nor reported."""
        tasks: list[asyncio.Task] = []
        start = time.perf_counter()
        try:
            for offset, body in zip(offsets, bodies):
                delay = start + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if results is None:
                    tasks.append(asyncio.create_task(
                        stream_chat(session, url, body, headers, self.config.request_timeout)))
                    continue
                tasks.append(asyncio.create_task(self._send(session, url, body, headers, results)))
                self.observer.request_sent()
            await asyncio.gather(*tasks)
        finally:
            # Reached on Ctrl-C too: requests still in flight are dropped, not counted.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_rate(self, rate: float, session, url, headers) -> RateRun:
        salt = len(self.runs)
        offsets = self._arrivals(rate, salt)
        self.observer.run_started(f"{rate:.4g} req/s", len(offsets))
        bodies = await self._payloads([self.workload.request(i, salt) for i in range(len(offsets))])
        results: list[RequestResult] = []
        start, cpu = time.perf_counter(), time.process_time()
        try:
            await self._open_loop(offsets, bodies, session, url, headers, results)
        finally:
            interrupted = len(results) < len(offsets)
            duration = time.perf_counter() - start
            run = RateRun(rate, tuple(results), summarize(results, rate, duration), interrupted,
                          client_cpu_seconds=time.process_time() - cpu)
            self.runs.append(run)
            self.observer.run_finished(run)
        return run


def run_bench(config: BenchConfig, observer: BenchObserver | None = None) -> BenchResult:
    """Run a benchmark to completion, or until Ctrl-C, and return what was measured."""
    bench = Bench(config, observer)

    async def main() -> BenchResult:
        try:
            await bench.run()
        except asyncio.CancelledError:
            # asyncio.run turns the first Ctrl-C into this cancellation; stop and report.
            pass
        return bench.result()

    # The collector walks every tracked object of the process in a full pass: ~0.3 s on this
    # CPU once torch and transformers are loaded (as in the planner's scripts and the tests),
    # and a pass in the middle of a request delays the chunks it times. Collect once before,
    # and keep what exists now out of the passes while the benchmark runs.
    gc.collect()
    gc.freeze()
    try:
        return asyncio.run(main())
    finally:
        gc.unfreeze()
