"""The planner against the live system: simulated vs live goodput, and --deploy auto vs vLLM-cpu.

    python bench/planner_accuracy.py accuracy [--model DIR] [--devices cpu:2] [--workloads textcaps,mix,mooncake]
        [--slo-ttft 2] [--slo-tbt 0.1] [--record-rate 1] [--record-requests 200] [--num-requests 200]
        [--top 3] [--live-rounds 1] [--sampling greedy|defaults|filtered] [--out planner_accuracy.json]
    python bench/planner_accuracy.py auto [--model DIR] [--devices cpu:2] [--hand 1EP+1D,2EPD,1E+1PD]
        [--live-rounds 1] [--vllm-python VENV/bin/python | --vllm-url http://127.0.0.1:8001]
        [--sampling greedy|defaults|filtered] [--out planner_auto.json]

``--sampling``: how every request samples, in the recorded trace and in every live run
(``hydrad.bench.SAMPLING_PRESETS``: greedy by default; the API's defaults, temperature 1;
or temperature 0.8 with top-p 0.9 and top-k 50). The simulator replays steps as the
latency model predicts them, which holds no sampling terms: a run with sampled requests
tests that.

``accuracy``: for each workload, a daemon (``1EP+1D``; ``1EPD`` on one device) records a trace of the workload
sent by ``hydractl bench`` at ``--record-rate``; the planner ranks every deployment of
the devices from that trace (``hydractl profile``); then each of the ``--top``
deployments is started live and its goodput measured by ``hydractl bench`` replaying the
same trace (same request count, the trace's arrivals, the same goodput search), as
``hydractl profile --validate`` does. The bench client runs on the same cores as the
daemon. The replay's default ``corun_slowdown`` was measured here, with that client on
the cores (the workers' steps while serving against the idle speed check around the same
run: printed after each run as the serving slowdown, ``serving_slowdown`` in the JSON), so
it holds the client's share; ``--count-client-cpu`` counts the client's CPU once more, as
a steady load at each replayed rate of the seconds per request it took while it recorded
the trace (``BenchResult.client_cpu_per_request``; ``SimSetup.client_seconds``;
``hydractl profile --client-cpu-ms``). Reported: simulated and live goodput per
deployment, their relative difference, and whether the live best is the simulated best
(with ``--live-rounds N``, the live goodput is the mean of N searches, alternately
forward and backward through the deployments, each reported: one deployment's live
goodput moves by more than 15% between runs an hour apart on a shared 2-core machine);
how far the top pick was from the best other deployment live, against the standard error
of that difference over the rounds (``live_margin``: a margin within two standard errors
is one the live rounds do not settle, reported beside the agreement, which is counted as
it is);
and the same again with each deployment simulated at the machine's speed measured right
before and after its live run (``validate``'s ``speed_check``), which separates the
simulator's error from the machine's drift over the hour the live runs take; and again at
the speed each deployment's workers measured on their own steps during its search
(``EngineStats.live_speed``, read from ``/admin/status``), which takes the machine's speed
under that load out of the comparison: what is left is the replay's own error.

Workloads: ``textcaps`` (TextCaps-like, Poisson), ``mix`` (TextCaps and POPE, half
each, Poisson), ``video`` (a 4-second 320x240 MP4 at 2 frames a second, 12 prompt and 16
output tokens, Poisson: for Qwen2-VL and Qwen2.5-VL), ``mooncake`` (POPE-like requests at
the arrival times of Mooncake's ``conversation_trace.jsonl``, bursty). That trace's timestamps come in 3-second ticks
(2 to 28 requests, 10 on average, share each one); taken as exact, every tick is a burst of
simultaneous image requests that no deployment of two CPU cores answers within a 2 s TTFT
at any rate, so every goodput would be 0. The script spreads each tick's requests over the
tick at seeded uniform offsets: the arrival rate still follows the trace's counts per tick.

``auto``: the workload of the planner issue (one 640x480 image, 12 prompt tokens, 16
output tokens per request; TTFT <= 2 s, TBT p90 <= 0.1 s): a trace is recorded,
``hydrad start --deploy auto --trace`` starts from it, and its live goodput is compared
with the best of the ``--hand`` deployments (measured live; with ``--live-rounds N``, each
daemon's goodput is the mean of N searches, the daemons taken alternately forward and
backward) and with vLLM-cpu on the same cores, which takes its turn in every round after
(forward) or before (backward) hydrad's daemons: started by the script alone, on a copy of
the checkpoint in its layout (``--vllm-python``: the Python of a vLLM-cpu install, see
``../shared/peer/``), or a server already running (``--vllm-url``, which then shares the
cores with hydrad's runs). vLLM's goodput is the mean of its rounds, each reported with the
attainment at every rate its search ran. Its search stops at ``--vllm-min-rate``: a round
below it counts as that rate, and the ratio over vLLM is then a lower bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from common import machine, model_dir, vllm_copy, vllm_server, write_json
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

console = Console()
MOONCAKE = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "mooncake" / "conversation_trace.jsonl"
# A workload spec given as file contents is written to the run's folder (``workload_spec``).
VIDEO_WORKLOAD = ('{"prompt_tokens": 12, "output_tokens": 16, '
                  '"videos": [{"frames": 8, "width": 320, "height": 240, "fps": 2}]}\n')
WORKLOADS = {
    "textcaps": ("textcaps", None),
    "mix": ("mix:textcaps=0.5,pope=0.5", None),
    "mooncake": ("pope", MOONCAKE),
    "video": (VIDEO_WORKLOAD, None),
}
ISSUE_WORKLOAD = '{"prompt_tokens": 12, "images": [{"width": 640, "height": 480}], "output_tokens": 16}\n'


def workload_spec(spec: str, work: Path) -> str:
    """``spec`` as ``hydractl bench --workload`` takes it: a workload line (JSON) is written
    to ``work`` as a one-line file workload."""
    if not spec.startswith("{"):
        return spec
    path = work / "workload.jsonl"
    path.write_text(spec)
    return str(path)


def spread_ticks(src: Path, dst: Path, seed: int = 0) -> Path:
    """``src`` (Mooncake format) with each timestamp's requests spread uniformly at random over
    the gap to the next timestamp (ms); the other fields are kept."""
    import random

    rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    ticks = sorted({row["timestamp"] for row in rows})
    width = {t: (ticks[i + 1] - t if i + 1 < len(ticks) else (ticks[-1] - ticks[0]) / max(1, len(ticks) - 1))
             for i, t in enumerate(ticks)}
    rng = random.Random(seed)
    for row in rows:
        row["timestamp"] = row["timestamp"] + rng.uniform(0.0, width[row["timestamp"]])
    rows.sort(key=lambda row: row["timestamp"])
    dst.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return dst


def daemon_config(model: str, devices: str, deploy: str, slo_ttft: float, slo_tbt: float, *,
                  reuse_plans: bool = True):
    """The daemon's configuration; ``reuse_plans`` False: ``--deploy auto`` plans at every start."""
    from hydrad.config_file import load_config

    config = load_config(None)
    if not reuse_plans:
        config = dataclasses.replace(config, planner=dataclasses.replace(config.planner, reuse_hours=0.0))
    engine = config.engine
    return dataclasses.replace(config, engine=dataclasses.replace(
        engine, model=dataclasses.replace(engine.model, path=model),
        parallel=dataclasses.replace(engine.parallel, deploy=deploy, devices=devices),
        slo=dataclasses.replace(engine.slo, ttft=slo_ttft, tbt=slo_tbt)))


def bench(url: str, workload: str, *, slo, rates=(), search=None, num_requests: int, trace=None,
          arrivals: str = "poisson", label: str = "", warmup: int = 0, sampling: str = "greedy"):
    from hydrad.bench import SAMPLING_PRESETS, BenchConfig, run_bench

    from hydrad.cli.bench import _ProgressObserver

    config = BenchConfig(url=url, slo=slo, workload=workload, rates=tuple(rates), search=search,
                         num_requests=num_requests, trace=str(trace) if trace else None,
                         arrivals="trace" if trace or arrivals == "trace" else "poisson", warmup=warmup,
                         sampling=SAMPLING_PRESETS[sampling])
    progress = Progress(TextColumn(f"{label} " + "{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("met {task.fields[met]} errors {task.fields[errors]}"), TimeElapsedColumn(),
                        console=console)
    with progress:
        return run_bench(config, _ProgressObserver(progress))


def record(model: str, devices: str, workload: str, trace, *, rate: float, num: int, slo_ttft: float,
           slo_tbt: float, work: Path, deploy: str | None = None, sampling: str = "greedy") -> tuple[Path, float]:
    """A trace of ``workload`` sent at ``rate`` to a live daemon (``deploy``; default
    ``1EP+1D``, or ``1EPD`` on one device), and the bench client's CPU seconds per request
    while it sent it."""
    from hydrad.bench import SLO
    from hydrad.planner.validate import LiveDaemon

    trace_dir = work / "trace"
    if deploy is None:
        from hydrad.planner.profile import Devices

        deploy = "1EP+1D" if len(Devices.parse(devices)) > 1 else "1EPD"
    daemon = LiveDaemon(daemon_config(model, devices, deploy, slo_ttft, slo_tbt), work / "record.log",
                        trace_dir=trace_dir)
    try:
        result = bench(daemon.url, workload, slo=SLO(slo_ttft, slo_tbt), rates=(rate,), num_requests=num,
                       trace=trace, label="record", sampling=sampling)
        if result.summary is None or result.summary.errors:
            raise SystemExit(f"recording failed: {result.summary}")
    finally:
        daemon.stop()
    return trace_dir, result.client_cpu_per_request or 0.0


# The figures of a validate row that are compared with the live goodput, and their errors.
_COMPARED = (("simulated_at_run_speed_rps", "error_at_run_speed"),
             ("simulated_at_live_speed_rps", "error_at_live_speed"))


def round_order(items: list, k: int) -> list:
    """The order of live round ``k`` (from 0): forward, then backward, and so on, so that a slow
    stretch of the machine does not fall on the same deployment in every round."""
    return list(items) if k % 2 == 0 else list(items)[::-1]


def mean_goodput(rounds: list[float | None]) -> float | None:
    """The mean of one deployment's goodputs over live rounds: a round that found none (no
    rate met the SLO) makes the mean None, a goodput of 0 counts."""
    return sum(rounds) / len(rounds) if rounds and all(g is not None for g in rounds) else None


def floored_mean(rounds: list[float | None], floor: float) -> tuple[float | None, bool]:
    """The mean of vLLM's goodputs over live rounds, where a round that found no goodput down
    to the search's lowest rate ``floor`` (a search in which no rate passed reports 0; None
    when it could not tell) counts as ``floor``: the mean is then an upper bound of vLLM's
    (so hydrad's ratio over it a lower bound), flagged by the second value."""
    if not rounds:
        return None, False
    counted = [floor if not g else g for g in rounds]
    return sum(counted) / len(counted), any(not g for g in rounds)


def combine_rounds(rows: list[dict]) -> dict:
    """One deployment's validate rows of several live rounds as one: the live goodput is
    their mean (each round's in ``live_goodput_rounds``), and every error is taken against
    it. The replays at the speeds around each run and under its load are averaged the same
    way; the first round's other fields (speeds, points) stand for the rest, and each
    round's row is kept whole under ``rounds``."""
    if len(rows) == 1:
        return rows[0]
    row = dict(rows[0])
    lives = [r["live_goodput_rps"] for r in rows]
    sim = row["simulated_goodput_rps"]
    live = mean_goodput(lives)
    row.update({"live_goodput_rps": live, "live_goodput_rounds": lives,
                "error": (sim - live) / live if sim is not None and live else None,
                "interrupted": any(r["interrupted"] for r in rows), "rounds": rows})
    for key, error in _COMPARED:
        values = [r.get(key) for r in rows]
        if live and all(v is not None for v in values):
            row[key] = sum(values) / len(values)
            row[error] = (row[key] - live) / live
    return row


def live_margin(rows: list[dict], pick: str) -> dict | None:
    """How far ``pick`` (the simulation's top deployment) was from the best of the others
    live, against how much the live rounds themselves scatter: the difference of the means
    over the other's mean (> 0: ``pick`` ahead), and the standard error of that difference
    from the rounds' sample variances (sqrt(s_a^2/n_a + s_b^2/n_b), same scale). A margin
    within two standard errors is one the live rounds do not settle. None without another
    deployment whose every round found a goodput, or when one of ``pick``'s found none; the
    standard error is None with a single round of either."""
    rounds = {r["deploy"]: r.get("live_goodput_rounds") or [r["live_goodput_rps"]] for r in rows}
    known = {d: rs for d, rs in rounds.items() if all(g is not None for g in rs)}
    others = [d for d in known if d != pick]
    if pick not in known or not others:
        return None
    other = max(others, key=lambda d: statistics.mean(rounds[d]))
    a, b = rounds[pick], rounds[other]
    base = statistics.mean(b)
    if base <= 0:
        return None
    margin = (statistics.mean(a) - base) / base
    se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b)) / base \
        if len(a) > 1 and len(b) > 1 else None
    return {"pick": pick, "other": other, "margin": margin, "standard_error": se,
            "settled": se is not None and abs(margin) > 2 * se}


def serving_slowdown(rows: list[dict], threads: int) -> dict[str, dict]:
    """How much longer each kind of work took while serving than in the idle speed check:
    per kind, over every live run of ``rows`` (validate rows, one per deployment, their
    rounds under ``rounds``), the median of the workers' speed on their own steps
    (``live_speed_by_kind``) over the speed check around the same run at the workers'
    ``threads`` (``speed_around_run_by_kind``), less 1; with the number of runs. The
    replay's ``SimSetup.corun_slowdown`` stands for it (``DEFAULT_CORUN_SLOWDOWN``); for one
    worker on every core (``--devices cpu:1`` on a machine of more cores), its
    ``all_cores_slowdown`` (``DEFAULT_ALL_CORES_SLOWDOWN``)."""
    ratios: dict[str, list[float]] = {}
    for row in rows:
        for run in row.get("rounds") or [row]:
            loaded = run.get("live_speed_by_kind") or {}
            idle = (run.get("speed_around_run_by_kind") or {}).get(str(threads)) or {}
            for kind in loaded.keys() & idle.keys():
                if idle[kind] > 0:
                    ratios.setdefault(kind, []).append(loaded[kind] / idle[kind])
    return {kind: {"slowdown": statistics.median(r) - 1.0, "runs": len(r)} for kind, r in sorted(ratios.items())}


def accuracy(args) -> dict:
    from hydrad.bench import SAMPLING_PRESETS
    from hydrad.planner.profile import (DEFAULT_ALL_CORES_SLOWDOWN, DEFAULT_CORUN_SLOWDOWN, Devices, MachineOptions,
                                        MachineProbe, run_profile)
    from hydrad.trace import read_trace
    from hydrad.planner.validate import ROUNDS_AROUND_RUN, validate

    model = model_dir(args.model)
    rows = []
    for name in args.workloads.split(","):
        spec, arrivals = WORKLOADS[name]
        work = Path(tempfile.mkdtemp(prefix=f"planner-{name}-"))
        spec = workload_spec(spec, work)
        if arrivals is not None:
            arrivals = spread_ticks(arrivals, work / "arrivals.jsonl")
        console.rule(f"{name}: recording {args.record_requests} requests at {args.record_rate} req/s")
        trace_dir, client_cpu = record(model, args.devices, spec, arrivals, rate=args.record_rate,
                                       num=args.record_requests, slo_ttft=args.slo_ttft, slo_tbt=args.slo_tbt,
                                       work=work, sampling=args.sampling)
        # The live runs' client shares the cores with the daemon; the default corun_slowdown,
        # measured beside it, holds its share unless asked to count it on its own as well.
        options = MachineOptions(client_seconds=client_cpu if args.count_client_cpu else 0.0,
                                 speed_history=args.speed_history)
        records = read_trace(trace_dir)
        config = daemon_config(model, args.devices, "auto", args.slo_ttft, args.slo_tbt)
        devices = Devices.parse(args.devices)
        # One instance of the model in this process measures the machine's speed for the
        # profile and again around each live run (validate's speed_check).
        with MachineProbe(config.engine, devices) as probe:
            started = time.perf_counter()
            profile = run_profile(records, config.engine, devices, slo_ttft=args.slo_ttft, slo_tbt=args.slo_tbt,
                                  top_k=args.top, num_requests=args.num_requests, probe=probe, options=options)
            plan_seconds = time.perf_counter() - started
            specs = [e.spec for e in profile.result.ranked[: args.top]]
            console.print(f"{name}: simulated top {args.top}: " + ", ".join(
                f"{e.spec} {e.goodput:.3g}" for e in profile.result.ranked[: args.top]), highlight=False)
            rounds = []
            for k in range(args.live_rounds):
                order = round_order(specs, k)
                if args.live_rounds > 1:
                    console.rule(f"{name}: live round {k + 1} of {args.live_rounds}")
                log_dir = work / f"round{k + 1}"
                log_dir.mkdir(exist_ok=True)
                rows_k = validate(profile, config, trace_dir, order, log_dir=log_dir,
                                  speed_check=lambda: probe.speeds(ROUNDS_AROUND_RUN), warmup=args.warmup,
                                  sampling=SAMPLING_PRESETS[args.sampling])
                rounds.append({r["deploy"]: r for r in rows_k})
            live = [combine_rounds([rnd[spec] for rnd in rounds if spec in rnd]) for spec in specs
                    if any(spec in rnd for rnd in rounds)]
        sim_best = max(live, key=lambda r: r["simulated_goodput_rps"])["deploy"]
        live_best = max(live, key=lambda r: r["live_goodput_rps"] or 0.0)["deploy"]
        now_best = max(live, key=lambda r: r.get("simulated_at_run_speed_rps") or 0.0)["deploy"]
        loaded_best = max(live, key=lambda r: r.get("simulated_at_live_speed_rps") or 0.0)["deploy"]
        rows.append({"workload": name, "spec": spec, "arrivals": "mooncake" if arrivals else "poisson",
                     "trace_requests": len(records), "trace_rate": profile.workload.mean_rate,
                     "client_cpu_seconds_per_request": client_cpu,
                     "simulated_client_seconds": options.client_seconds,
                     "plan_seconds": plan_seconds, "deployments": live, "simulated_best": sim_best,
                     "live_best": live_best, "ranking_agrees": sim_best == live_best,
                     "simulated_best_at_run_speed": now_best, "ranking_agrees_at_run_speed": now_best == live_best,
                     "simulated_best_at_live_speed": loaded_best,
                     "ranking_agrees_at_live_speed": loaded_best == live_best,
                     "live_margin": live_margin(live, sim_best),
                     "max_abs_error": max((abs(r["error"]) for r in live if r["error"] is not None), default=None),
                     "profile": profile.to_json(args.top)})
    table = Table(title="simulated vs live goodput (req/s): at the profile's speed, at the speed around each run, "
                        "and at the speed the workers measured on their own steps during it")
    for column in ("workload", "deployment", "simulated", "live", "error", "top pick agrees", "speed around run",
                   "simulated at it", "error at it", "top pick agrees at it", "workers' speed", "simulated at it",
                   "error at it", "top pick agrees at it"):
        table.add_column(column, justify="left" if column in ("workload", "deployment") else "right")

    def pct(x):
        return "-" if x is None else f"{100 * x:+.1f}%"

    for row in rows:
        for i, d in enumerate(row["deployments"]):
            live_g, now, loaded = d["live_goodput_rps"], d.get("simulated_at_run_speed_rps"), \
                d.get("simulated_at_live_speed_rps")
            table.add_row(row["workload"] if i == 0 else "", d["deploy"], f"{d['simulated_goodput_rps']:.3g}",
                          "-" if live_g is None else f"{live_g:.3g}" + (
                              " (" + ", ".join("-" if g is None else f"{g:.3g}" for g in d["live_goodput_rounds"]) + ")"
                              if "live_goodput_rounds" in d else ""), pct(d["error"]),
                          ("yes" if row["ranking_agrees"] else "no") if i == 0 else "",
                          ", ".join(f"{f:.2f}x" for f in d.get("speed_around_run", {}).values()) or "-",
                          "-" if now is None else f"{now:.3g}", pct(d.get("error_at_run_speed")),
                          ("yes" if row["ranking_agrees_at_run_speed"] else "no") if i == 0 else "",
                          ", ".join(f"{k[0]} {f:.2f}x" for k, f in (d.get("live_speed_by_kind") or {}).items()) or "-",
                          "-" if loaded is None else f"{loaded:.3g}", pct(d.get("error_at_live_speed")),
                          ("yes" if row["ranking_agrees_at_live_speed"] else "no") if i == 0 else "")
    console.print(table)
    for row in rows:
        m = row["live_margin"]
        if m is not None:
            se = "-" if m["standard_error"] is None else f"{100 * m['standard_error']:.0f}%"
            console.print(f"{row['workload']}: live, the top pick {m['pick']} against {m['other']}: "
                          f"{100 * m['margin']:+.1f}%, standard error {se} over the rounds"
                          + ("" if m["settled"] else " (not settled by the live rounds)"), highlight=False)
    devices = Devices.parse(args.devices)
    serving = serving_slowdown([d for row in rows for d in row["deployments"]], devices.threads)
    # One worker on every core meets the all-cores slowdown, never the co-running one.
    name, stood_for = (("all_cores_slowdown", DEFAULT_ALL_CORES_SLOWDOWN)
                       if len(devices) == 1 and devices.is_cpu and devices.threads > 1
                       else ("corun_slowdown", DEFAULT_CORUN_SLOWDOWN))
    if serving:
        console.print("serving slowdown, the workers' steps against the idle speed check around the same run "
                      "(median over the live runs): " + ", ".join(
                          f"{kind} {100 * v['slowdown']:+.0f}% ({v['runs']} runs)" for kind, v in serving.items())
                      + f"; the replay's {name}: " + ", ".join(
                          f"{kind} {100 * v:+.0f}%" for kind, v in stood_for.items()), highlight=False)
    return {"mode": "accuracy", "args": vars(args), "machine": machine(), "workloads": rows,
            "serving_slowdown": serving}


def auto(args) -> dict:
    from hydrad.bench import SLO, GoodputSearch
    from hydrad.planner.validate import LiveDaemon

    model = model_dir(args.model)
    work = Path(tempfile.mkdtemp(prefix="planner-auto-"))
    workload = work / "issue.jsonl"
    workload.write_text(ISSUE_WORKLOAD)
    slo = SLO(args.slo_ttft, args.slo_tbt)
    console.rule("recording the workload's trace")
    trace_dir, _ = record(model, args.devices, str(workload), None, rate=args.record_rate,
                          num=args.record_requests, slo_ttft=args.slo_ttft, slo_tbt=args.slo_tbt, work=work,
                          sampling=args.sampling)
    search = GoodputSearch(start_rate=args.search_start, rel_tol=0.05)

    def live_goodput(deploy: str, extra: dict | None = None) -> tuple[float | None, dict]:
        # Every round of auto plans: the rounds measure the planner, not the plan it kept.
        config = daemon_config(model, args.devices, deploy, args.slo_ttft, args.slo_tbt,
                               reuse_plans=deploy != "auto")
        daemon = LiveDaemon(config, work / f"daemon-{deploy}.log", **(extra or {}))
        try:
            with urllib.request.urlopen(daemon.url + "/admin/status") as response:
                status = json.loads(response.read())
            result = bench(daemon.url, str(workload), slo=slo, search=search, num_requests=args.num_requests,
                           label=deploy, warmup=args.warmup, sampling=args.sampling)
        finally:
            daemon.stop()
        return result.goodput_total, status.get("deployment", {})

    vllm_search = dataclasses.replace(search, min_rate=args.vllm_min_rate)
    vllm_runs: list[dict] = []
    vllm_model = vllm_copy(Path(model), work / "vllm-model") if args.vllm_python else None

    def vllm_goodput() -> float | None:
        server, url = None, args.vllm_url
        run: dict = {}
        if args.vllm_python:
            console.print("starting vLLM-cpu (alone)")
            server = vllm_server(args.vllm_python, vllm_model, work / f"vllm-{len(vllm_runs)}.log")
            run["start_seconds"] = server.start()
            url = server.url
        try:
            result = bench(url, str(workload), slo=slo, search=vllm_search, num_requests=args.num_requests,
                           label="vllm", warmup=args.warmup, sampling=args.sampling)
        finally:
            if server is not None:
                server.stop()
        run["goodput_rps"] = result.goodput_total
        run["sweep"] = {f"{r.rate:g}": r.summary.attainment for r in result.runs if r.summary is not None}
        vllm_runs.append(run)
        return result.goodput_total

    with_vllm = bool(args.vllm_url or args.vllm_python)
    names = ["auto", *args.hand.split(",")] + (["vllm"] if with_vllm else [])
    rounds: dict[str, list] = {name: [] for name in names}
    deployments = []
    for k in range(args.live_rounds):
        for name in round_order(names, k):
            title = {"auto": "hydrad start --deploy auto --trace", "vllm": "vLLM-cpu"}.get(name, f"by hand: {name}")
            console.rule(title + (f" (round {k + 1} of {args.live_rounds})" if args.live_rounds > 1 else ""))
            if name == "vllm":
                rounds[name].append(vllm_goodput())
                continue
            extra = {"args": ("--trace", str(trace_dir))} if name == "auto" else None
            goodput, deployment = live_goodput(name, extra)
            rounds[name].append(goodput)
            if name == "auto":
                deployments.append(deployment)
    hydrad_names = [n for n in names if n != "vllm"]
    results = {name: {"goodput_rps": mean_goodput(rounds[name]), "goodput_rounds": rounds[name]}
               for name in hydrad_names}
    # "deployment": the first round's, as before rounds existed; "deployments": every round's.
    results["auto"]["deployment"] = deployments[0]
    results["auto"]["deployments"] = deployments
    goodput = results["auto"]["goodput_rps"]
    best_hand = max(hydrad_names[1:], key=lambda k: results[k]["goodput_rps"] or 0.0)
    out = {"mode": "auto", "args": vars(args), "machine": machine(), "results": results, "best_hand": best_hand,
           "auto_over_best_hand": (goodput or 0.0) / (results[best_hand]["goodput_rps"] or float("nan"))}
    if with_vllm:
        # vLLM takes its turn in every round, like hydrad's daemons, so that a fast or slow
        # stretch of the machine falls on both; a round under the lowest rate searched counts
        # as that rate, and the ratio is then a lower bound.
        floor_mean, below = floored_mean(rounds["vllm"], args.vllm_min_rate)
        # The figure the ratio divides by: with a round under the lowest rate counted as it,
        # an upper bound of vLLM's goodput (flagged by auto_over_vllm_is_lower_bound).
        out["vllm_goodput_rps"] = floor_mean
        out["vllm_goodput_rounds"] = rounds["vllm"]
        out["vllm_runs"] = vllm_runs
        # The first round's, under the keys single-round runs have always written.
        out["vllm_sweep"] = vllm_runs[0]["sweep"]
        if "start_seconds" in vllm_runs[0]:
            out["vllm_start_seconds"] = vllm_runs[0]["start_seconds"]
        out["auto_over_vllm"] = (goodput or 0.0) / floor_mean
        out["auto_over_vllm_is_lower_bound"] = below
        console.print("vLLM-cpu, goodput by round: " + ", ".join(
            "< " + f"{args.vllm_min_rate:g}" if not g else f"{g:.3g}" for g in rounds["vllm"])
            + f"; --deploy auto over vLLM-cpu: {'>= ' if below else ''}{out['auto_over_vllm']:.2f}x", highlight=False)
    console.print_json(json.dumps({k: v for k, v in out.items() if k not in ("args", "machine")}))
    return out


def main() -> None:
    from hydrad.bench import SAMPLING_PRESETS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("accuracy", "auto"))
    parser.add_argument("--model", help="Checkpoint folder (default: the built-in small model).")
    parser.add_argument("--devices", default="cpu:2")
    parser.add_argument("--workloads", default="textcaps,mix,mooncake")
    parser.add_argument("--slo-ttft", type=float, default=2.0)
    parser.add_argument("--slo-tbt", type=float, default=0.1)
    parser.add_argument("--record-rate", type=float, default=1.0)
    parser.add_argument("--record-requests", type=int, default=200)
    parser.add_argument("--num-requests", type=int, default=200, help="Requests per rate, simulated and live.")
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--sampling", choices=tuple(SAMPLING_PRESETS), default="greedy",
                        help="How every request samples, recorded and live: greedy, the API's defaults "
                        "(temperature 1), or temperature 0.8 with top-p 0.9 and top-k 50.")
    parser.add_argument("--live-rounds", type=int, default=1,
                        help="Search each deployment's live goodput this many times (forward, then backward) "
                        "and take their mean (accuracy: compared with the replay; auto: --deploy auto against "
                        "each --hand deployment); each round's figure is reported.")
    parser.add_argument("--count-client-cpu", action="store_true",
                        help="accuracy: replay the bench client's CPU per request (measured while recording) "
                        "as a load of its own, beside the default corun_slowdown that was measured with it.")
    parser.add_argument("--speed-history", type=int, default=None,
                        help="accuracy: plan at the median of the speed check, this many recent ones and the fit "
                        "(hydractl profile --speed-history; default 8, 0: the check alone).")
    parser.add_argument("--warmup", type=int, default=None,
                        help="Requests sent to each live daemon (vLLM's too) at its search's first rate before "
                        "it, not counted (default: hydrad.planner.validate.LIVE_WARMUP; 0: none). The replay "
                        "starts warm (profile.DEFAULT_WARM_REQUESTS).")
    parser.add_argument("--hand", default="1EP+1D,2EPD,1E+1PD,1ED+1P", help="auto: deployments measured by hand.")
    parser.add_argument("--search-start", type=float, default=1.0, help="auto: first rate of each goodput search.")
    parser.add_argument("--vllm-python", help="auto: the Python of a vLLM-cpu install; vLLM is started alone "
                        "after hydrad's runs, on a copy of the checkpoint in its layout.")
    parser.add_argument("--vllm-url", help="auto: a vLLM-cpu server already running on the same cores instead.")
    parser.add_argument("--vllm-min-rate", type=float, default=0.25,
                        help="auto: the lowest rate of vLLM's goodput search.")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.live_rounds < 1:
        parser.error("--live-rounds must be at least 1")
    if args.warmup is None:
        from hydrad.planner.validate import LIVE_WARMUP

        args.warmup = LIVE_WARMUP
    elif args.warmup < 0:
        parser.error("--warmup must be at least 0")
    payload = accuracy(args) if args.mode == "accuracy" else auto(args)
    write_json(args.out, payload)


if __name__ == "__main__":
    main()
