"""``hydractl profile --validate``: the top deployments started live and benchmarked.

Each candidate gets its own daemon (``python -m hydrad start``, one at a time, on a free
loopback port, with the profile's SLO and its own trace switched off so that replays do
not feed the trace being planned from); the bench client replays the trace against it
with the same request count, arrivals and goodput search as the simulator's, and the
daemon is stopped before the next one starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Callable

from hydrad.errors import HydradError


def config_toml(config) -> str:
    """A ``DaemonConfig`` as the TOML ``hydrad start --config`` reads (keys left None are omitted)."""
    engine = config.engine
    lines = [f"seed = {engine.seed}"]

    def table(name: str, obj) -> None:
        lines.append(f"[{name}]")
        nested = []
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                nested.append((f"{name}.{f.name}", value))
            elif value is not None:
                lines.append(f"{f.name} = {json.dumps(value)}")
        for sub, value in nested:
            table(sub, value)

    for name, obj in (("server", config.server), ("model", engine.model), ("cache", engine.cache),
                      ("scheduler", engine.scheduler), ("parallel", engine.parallel), ("slo", engine.slo),
                      ("trace", config.trace), ("planner", config.planner)):
        table(name, obj)
    return "\n".join(lines) + "\n"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LiveDaemon:
    """``hydrad start`` in a child process, until ``stop``."""

    def __init__(self, config, log_path: Path, timeout: float = 900.0, trace_dir: Path | None = None,
                 args: tuple[str, ...] = ()):
        """``trace_dir``: record the requests' trace there (else the trace is off); ``args``:
        more flags of ``hydrad start``."""
        port = _free_port()
        trace = dataclasses.replace(config.trace, enabled=trace_dir is not None,
                                    dir=str(trace_dir) if trace_dir is not None else config.trace.dir)
        config = dataclasses.replace(
            config, server=dataclasses.replace(config.server, host="127.0.0.1", port=port, log_level="warning"),
            trace=trace)
        self.url = f"http://127.0.0.1:{port}"
        self._config_file = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
        self._config_file.write(config_toml(config))
        self._config_file.close()
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen([sys.executable, "-m", "hydrad", "start", "--config", self._config_file.name,
                                         *args], stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise HydradError(f"the daemon for {config.engine.parallel.deploy} did not start; see {log_path}")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        os.unlink(self._config_file.name)


def workers_speed(url: str) -> list[tuple[dict, dict, float]]:
    """What each worker of the daemon at ``url`` measured of its own steps against its latency
    model (``/admin/status``: ``live_speed``, ``live_speed_steps``, ``live_speed_spread``),
    as ``profile.live_speeds`` takes it."""
    with urllib.request.urlopen(url + "/admin/status", timeout=30) as response:
        status = json.loads(response.read())
    return [(i.get("live_speed") or {}, i.get("live_speed_steps") or {}, i.get("live_speed_spread") or 0.0)
            for i in status["instances"]]


# Timings of each probe per speed check around a live run (``MachineProbe.speeds``): five
# back-to-back checks of three rounds ranged over 1.14-1.39x on the 2-core machine this was
# built on, and a deployment's simulated goodput moves faster than its speed (the TBT bounds
# the steps that decode); more rounds cost seconds against minutes of live search.
ROUNDS_AROUND_RUN = 9
# Requests sent at a live search's first rate before it and not counted (``BenchConfig.warmup``):
# the replay's instances start as a serving daemon's (``profile.DEFAULT_WARM_REQUESTS``), and a
# daemon just started is not one yet (its workers fill their first steps before they have
# calibrated them: on a machine slower than its latency model, a burst at the start misses
# its TBT).
LIVE_WARMUP = 24


def validate(profile, config, trace_file: Path, specs: list[str], *, log_dir: Path,
             observer_for: Callable[[str], object] | None = None,
             speed_check: Callable[[], dict] | None = None, warmup: int = LIVE_WARMUP,
             sampling=None) -> list[dict]:
    """Live goodput of each of ``specs`` on ``trace_file``, next to the simulated one. Each
    live daemon keeps its request trace under ``log_dir`` (``trace_dir`` in its row); every
    request samples as ``sampling`` says (a ``hydrad.bench.Sampling``; None: greedy).

    ``speed_check`` (``MachineProbe.speeds``): measure the machine's speed right before each
    deployment's daemon starts and right after it stops, and simulate the deployment again
    at the mean of the two. The profile's speed was measured before all the live runs, and
    a shared CPU's speed moves within the hour they take: the second figure tells the
    simulator's own error apart from the machine's drift.

    Each deployment is also simulated at the speed its workers measured on their own steps
    during its search (``workers_speed``, read before the daemon stops): the machine as it
    ran under that load, which an idle check cannot see.

    ``warmup`` requests of the trace go to each daemon before its search, not counted."""
    from hydrad.bench import SLO, BenchConfig, GoodputSearch, Sampling, run_bench
    from hydrad.planner.profile import live_speeds, mean_speeds

    simulated = {e.spec: e.goodput for e in profile.result.ranked}
    roles_of = {e.spec: e.roles for e in profile.result.evaluations}
    # At the replay's ceiling (Planner.max_rate) a goodput is only known to be at least that.
    ceiling = (1 - profile.planner.rel_tol) * profile.planner.max_rate
    rows = []
    for spec in specs:
        before = speed_check() if speed_check is not None else None
        cfg = dataclasses.replace(config, engine=dataclasses.replace(
            config.engine, parallel=dataclasses.replace(config.engine.parallel, deploy=spec,
                                                        devices=profile.devices.spec),
            slo=dataclasses.replace(config.engine.slo, ttft=profile.slo_ttft, tbt=profile.slo_tbt)))
        # Its own trace, as a production daemon keeps one: what each request met (TTFT, gaps,
        # time per stage, instances) when the live and simulated figures disagree.
        trace_dir = log_dir / f"trace-{spec}"
        daemon = LiveDaemon(cfg, log_dir / f"daemon-{spec}.log", trace_dir=trace_dir)
        try:
            # A deployment simulated at 0 is searched from the trace's rate; the bracket goes
            # down to the search's default (start / 16): below it, runs of a fixed number of
            # requests take longer than any benchmark should.
            start = simulated.get(spec) or profile.workload.mean_rate
            bench = BenchConfig(url=daemon.url, slo=SLO(profile.slo_ttft, profile.slo_tbt), workload=str(trace_file),
                                num_requests=profile.planner.num_requests,
                                search=GoodputSearch(start_rate=start, rel_tol=profile.planner.rel_tol),
                                arrivals=profile.planner.arrivals, seed=config.engine.seed, warmup=warmup,
                                sampling=sampling or Sampling())
            result = run_bench(bench, observer_for(spec) if observer_for else None)
            try:
                reports = workers_speed(daemon.url)
            except (OSError, ValueError, KeyError):  # the live figures above stand without it
                reports = []
        finally:
            daemon.stop()
        live = result.goodput_total
        sim = simulated.get(spec)
        row = {"deploy": spec, "simulated_goodput_rps": sim, "live_goodput_rps": live,
               "error": (sim - live) / live if sim is not None and live else None,
               "simulated_is_lower_bound": sim is not None and sim >= ceiling,
               "live_points": [[r.rate, r.summary.attainment] for r in result.runs],
               "interrupted": result.interrupted, "trace_dir": str(trace_dir),
               # The bench client's CPU per request, taken from the same cores as the daemon's.
               "client_cpu_seconds_per_request": result.client_cpu_per_request}
        # At the speed the workers measured on their own steps under the search's load: the
        # replay's error with the machine's speed taken out.
        loaded = live_speeds(reports, {profile.devices.threads, *profile.setup.thread_models})
        if loaded and not result.interrupted:
            sim_loaded = profile.goodput_at(roles_of[spec], loaded, under_load=True)
            any_speed = next(iter(loaded.values()))
            steps = {kind: sum(counts.get(kind, 0) for _, counts, _ in reports) for kind in any_speed.parts}
            row.update({"live_speed": any_speed.factor, "live_speed_by_kind": any_speed.parts,
                        "live_speed_steps": steps, "live_speed_spread": any_speed.spread,
                        "simulated_at_live_speed_rps": sim_loaded,
                        "simulated_at_live_speed_is_lower_bound": sim_loaded >= ceiling,
                        "error_at_live_speed": (sim_loaded - live) / live if live else None})
        if before is not None and not result.interrupted:
            around = mean_speeds(before, speed_check())
            sim_now = profile.goodput_at(roles_of[spec], around)
            row.update({"simulated_at_run_speed_is_lower_bound": sim_now >= ceiling,
                        "speed_around_run": {str(n): s.factor for n, s in around.items()},
                        "speed_around_run_by_kind": {str(n): s.parts for n, s in around.items()},
                        "speed_around_run_spread": {str(n): s.spread for n, s in around.items()},
                        "simulated_at_run_speed_rps": sim_now,
                        "error_at_run_speed": (sim_now - live) / live if live else None})
        rows.append(row)
        if result.interrupted:
            break
    profile.validation = rows
    return rows
