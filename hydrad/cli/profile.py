"""``hydractl profile``: the best deployment for a recorded workload and SLOs, and why."""

from __future__ import annotations

from pathlib import Path

import click

from hydrad.cli.common import console


def _fetch(url: str, path: str, admin_token: str | None) -> bytes:
    from hydrad.cli.daemon_http import daemon_request

    with daemon_request(url, path, admin_token, timeout=60) as response:
        return response.read()


def _records_from_daemon(url: str, admin_token: str | None, limit: int, out_dir: Path):
    """(records, trace file, model folder, devices) of a running daemon's recent trace."""
    import json

    from hydrad.trace import parse_lines

    body = _fetch(url, f"/admin/trace?limit={limit}", admin_token)
    trace_file = out_dir / "trace.jsonl"
    trace_file.write_bytes(body)
    records = [r for r in parse_lines(body.decode().splitlines(), f"{url}/admin/trace") if r.completed]
    model_root = json.loads(_fetch(url, "/v1/models", None))["data"][0].get("root")
    status = json.loads(_fetch(url, "/admin/status", admin_token))
    devices = [i["device"] for i in status["instances"]]
    spec = f"cpu:{len(devices)}" if all(d == "cpu" for d in devices) else "cuda:" + ",".join(
        d.partition(":")[2] or "0" for d in devices)
    return records, trace_file, model_root, spec


def _table(profile, top_k: int):
    from rich.table import Table

    result = profile.result
    a2 = result.algorithm2_pick
    costs = profile.planner.costs
    table = Table(title=f"{result.n} instance(s), TTFT <= {profile.slo_ttft:g} s, TBT p90 <= {profile.slo_tbt:g} s; "
                        f"rates in req/s; attainment at the trace's {profile.workload.mean_rate:.3g} req/s")
    shown = result.ranked[:top_k]
    if a2 is not None and a2 not in shown:
        shown = shown + [a2]
    spread = any(e.goodput_by_speed for e in shown)
    columns = ("#", "deployment", "goodput", *(("at recent speeds",) if spread else ()), "attainment", "bottleneck",
               "bound", "Algorithm 2")
    for name in columns:
        table.add_column(name, justify="right" if name in ("#", "goodput", "at recent speeds", "bound", "attainment")
                         else "left", no_wrap=name != "Algorithm 2")

    from hydrad.planner.search import rate_text

    def rate(goodput: float) -> str:
        return rate_text(goodput, profile.planner.max_rate)

    for e in shown:
        rank = result.ranked.index(e) + 1
        att = f"{100 * e.trace_attainment:.1f}%" if e.trace_attainment is not None else "-"
        mark = ", ".join(e.methods) + (" (pick)" if e is a2 else "") if e.methods else ""
        span = (f"{min(e.goodput_by_speed):.3g}-{rate(max(e.goodput_by_speed))}" if e.goodput_by_speed else "-",)
        table.add_row(str(rank), e.spec, rate(e.goodput), *(span if spread else ()), att, e.bottleneck(costs),
                      f"{e.bound.rate:.3g}", mark)
    if spread:
        table.caption = (f"goodput: the mean of the goodputs at the {len(profile.setup.speed_sample)} recent speeds "
                         "of the machine (its speed checks and the fit); at recent speeds: the lowest and highest")
    return table


@click.command("profile")
@click.option("--trace", "trace_path", type=click.Path(exists=True),
              help="A request trace: a trace file, or the daemon's trace folder.")
@click.option("--url", help="Plan from a running daemon's recent trace (GET /admin/trace).")
@click.option("--admin-token", envvar="HYDRAD_ADMIN_TOKEN", help="For a non-loopback --url. Env: HYDRAD_ADMIN_TOKEN.")
@click.option("--limit", type=click.IntRange(min=2), default=1000, show_default=True,
              help="With --url: the newest requests to plan from.")
@click.option("--devices", metavar="SPEC",
              help="cpu:N or cuda:0,1 (default: the daemon's with --url, else every GPU, else one CPU worker per core).")
@click.option("--model", "model_path", metavar="PATH",
              help="Checkpoint folder (default: the daemon's with --url, else the config's or the built-in model).")
@click.option("--config", "config_file", metavar="FILE", envvar="HYDRAD_CONFIG", type=click.Path(dir_okay=False),
              help="The daemon's TOML config (cache, scheduler, alpha, router). Env: HYDRAD_CONFIG.")
@click.option("--slo-ttft", type=float, required=True, help="TTFT SLO in seconds.")
@click.option("--slo-tbt", type=float, required=True, help="SLO on each request's p90 inter-token gap, in seconds.")
@click.option("--top", "top_k", type=click.IntRange(min=1), default=3, show_default=True,
              help="Deployments ranked exactly, shown, plotted and validated.")
@click.option("--num-requests", type=click.IntRange(min=10), default=None,
              help="Requests per replayed rate (as hydractl bench --num-requests). Default: 300, and more (up to "
              "2400) where 300 cannot tell the best deployments apart, as hydrad start --deploy auto.")
@click.option("--arrivals", type=click.Choice(["trace", "poisson"]), default="trace", show_default=True,
              help="The trace's own arrival pattern scaled to each rate, or Poisson.")
@click.option("--message-ms", type=float, default=2.0, show_default=True,
              help="Milliseconds per message between the daemon and a worker.")
@click.option("--step-overhead-ms", type=float, default=1.0, show_default=True,
              help="Milliseconds per step beyond the latency model (scheduling, pipes).")
@click.option("--client-cpu-ms", type=click.FloatRange(min=0, max=999), default=0.0, show_default=True,
              help="CPU milliseconds per request of clients running on the planned machine's cores (a "
              "benchmark client beside the daemon; 0: clients run elsewhere).")
@click.option("--speed-history", type=click.IntRange(min=0), default=None,
              help="Replay at the median of the machine's speed check now, up to this many recent checks "
              "and the fitted model (default 8; 0: the check now alone).")
@click.option("--jobs", type=click.IntRange(min=1), default=None,
              help="Processes that replay the ranked deployments at the recent speeds (default: one per core, "
              "up to 16; 1 beside a busy daemon keeps the planning off its other cores).")
@click.option("--out", type=click.Path(dir_okay=False), help="Write the ranking and its inputs as JSON.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write SLO attainment against rate of the top K as PNG.")
@click.option("--keep", is_flag=True, help="Keep the pick as the plan hydrad start --deploy auto deploys with this "
              "--config, --devices, --trace and SLO (plan.json in the config's trace folder): no planning at the "
              "start while the trace holds fewer new requests than it was made from, for [planner] reuse_hours.")
@click.option("--validate", is_flag=True, help="Start each top deployment live, replay the trace with the bench "
              "client, and compare simulated with live goodput.")
def profile(trace_path, url, admin_token, limit, devices, model_path, config_file, slo_ttft, slo_tbt, top_k,
            num_requests, arrivals, message_ms, step_overhead_ms, client_cpu_ms, speed_history, jobs, out,
            plot, keep, validate) -> None:
    """Rank every deployment of the devices for a recorded workload by simulated goodput."""
    import dataclasses
    import json
    import tempfile

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from hydrad.cluster.deploy import format_deploy
    from hydrad.config import SLOConfig
    from hydrad.config_file import load_config
    from hydrad.errors import ConfigError
    from hydrad.models.default import resolve_model_path
    from hydrad.planner.profile import (DEFAULT_NUM_REQUESTS, Devices, MachineOptions, MachineProbe,
                                        attainment_curves, plot_curves, run_profile)
    from hydrad.planner.search import MAX_PLAN_REQUESTS
    from hydrad.trace import read_trace

    if (trace_path is None) == (url is None):
        raise click.UsageError("give exactly one of --trace and --url")
    if keep and trace_path is None:
        raise click.UsageError("--keep needs --trace: the trace hydrad start --deploy auto plans from")
    try:
        SLOConfig(ttft=slo_ttft, tbt=slo_tbt)
    except ConfigError as e:
        raise click.BadParameter(str(e), param_hint="--slo-ttft/--slo-tbt") from None
    work_dir = Path(tempfile.mkdtemp(prefix="hydrad-profile-"))
    config = load_config(config_file)
    with console.status("reading the trace"):
        if url is not None:
            records, trace_file, root, daemon_devices = _records_from_daemon(url, admin_token, limit, work_dir)
            model_path = model_path or root
            devices = devices or daemon_devices
        else:
            trace_file = Path(trace_path)
            records = read_trace(trace_file)
    model = resolve_model_path(model_path or config.engine.model.path)
    mine = [r for r in records if r.model == model.name]
    if not mine:
        names = sorted({r.model for r in records})
        raise ConfigError(f"the trace holds no finished requests of model {model.name!r} "
                          f"(it has {', '.join(names) or 'none'}); pass --model")
    engine = dataclasses.replace(config.engine, model=dataclasses.replace(config.engine.model, path=str(model)))
    config = dataclasses.replace(config, engine=engine)
    device_set = Devices.parse(devices)
    console.print(f"planning {len(device_set)} instance(s) on {device_set.spec} ({device_set.threads} thread(s) "
                  f"each) from {len(mine)} requests of {model.name}", highlight=False)
    options = MachineOptions(message_ms / 1e3, step_overhead_ms / 1e3, config.server.router_policy,
                             client_seconds=client_cpu_ms / 1e3, speed_history=speed_history)
    # On CPU, --validate checks the machine's speed again around each live run, on this
    # instance (on a GPU it would hold device memory the live daemons need).
    probe = MachineProbe(engine, device_set) if validate and device_set.is_cpu else None
    try:
        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=console, transient=True)
        with progress:
            task = progress.add_task("search", total=None)

            def advance(done: int, total: int, spec: str) -> None:
                progress.update(task, completed=done, total=total, description=f"search: {spec}")

            result = run_profile(mine, engine, device_set, slo_ttft=slo_ttft, slo_tbt=slo_tbt, top_k=top_k,
                                 num_requests=num_requests or DEFAULT_NUM_REQUESTS,
                                 max_requests=None if num_requests else MAX_PLAN_REQUESTS, arrivals=arrivals,
                                 options=options, progress=advance, probe=probe, processes=jobs)
        s = result.result
        if result.setup.speeds:
            parts = result.setup.part_speeds

            def kinds(n: int) -> str:
                return "".join(f", {kind} {f:.2f}x" for kind, f in parts.get(n, {}).items())

            basis = result.setup.speed_basis

            def why(n: int) -> str:
                b = basis.get(n)
                if not b or not b["with_fit"]:
                    return ""
                return f"; now {b['check_now']:.2f}x, with {b['earlier_checks']} earlier check(s) and the fit"

            console.print("steps replayed at " + ", ".join(f"{f:.2f}x the latency model ({n} thread(s){kinds(n)}"
                                                          f"{why(n)})" for n, f in sorted(result.setup.speeds.items()))
                          + ": the speed this machine runs the model's probes at", highlight=False)
        console.print(f"searched {len(s.evaluations)} deployments with {s.num_replays} replays in {s.seconds:.1f} s; "
                      "Algorithm 2's candidates: " + ", ".join(f"{m} {format_deploy(list(r))}"
                                                               for m, r in s.algorithm2.items()), highlight=False)
        if plot:
            with console.status("attainment curves"):
                attainment_curves(result, top_k)
            plot_curves(result, plot, f"{model.name} on {device_set.spec}: TTFT <= {slo_ttft:g} s, "
                                      f"TBT p90 <= {slo_tbt:g} s")
        console.print(_table(result, top_k))
        console.print(f"pick: [bold]{result.pick}[/]", highlight=False)
        if validate:
            _validate(result, config, trace_file, top_k, work_dir, probe)
        if out:
            Path(out).write_text(json.dumps(result.to_json(top_k), indent=2))
            console.print(f"results written to {out}")
        if keep:
            _keep(result, config, devices, device_set, Path(trace_path), mine, config_file)
    finally:
        if probe is not None:
            probe.close()


def _keep(result, config, devices: str | None, device_set, trace: Path, records, config_file: str | None) -> None:
    """``--keep``: the pick kept as the plan of the start with the same inputs, and that
    start's command."""
    import dataclasses

    from hydrad.planner.auto import keep_profile

    spec = devices or (device_set.spec if device_set.is_cpu else "auto")
    slo = config.engine.slo
    kept_slo = dataclasses.replace(slo, ttft=result.slo_ttft, tbt=result.slo_tbt)
    kept = dataclasses.replace(config, engine=dataclasses.replace(config.engine, slo=kept_slo))
    reason = result.pick_reason(len(records), "the pick of hydractl profile")
    path = keep_profile(kept, spec, trace, records, result.pick, reason)
    command = " ".join(["hydrad start --deploy auto", f"--devices {spec}",
                        *([f"--config {config_file}"] if config_file else []),
                        *([] if trace.resolve() == config.trace.directory.resolve() else [f"--trace {trace}"])])
    console.print(f"kept in {path}: `{command}` deploys {result.pick} without planning while the trace holds fewer "
                  f"new requests than the {len(records)} it was planned from, for [planner] reuse_hours = "
                  f"{config.planner.reuse_hours:g}", highlight=False, markup=False)
    if (slo.ttft, slo.tbt) != (result.slo_ttft, result.slo_tbt):
        console.print(f"note: the config's [slo] is TTFT {slo.ttft:g} s, TBT {slo.tbt:g} s, and a start plans for "
                      f"it: set ttft = {result.slo_ttft:g} and tbt = {result.slo_tbt:g} there to deploy this pick",
                      highlight=False, markup=False)


def _validate(result, config, trace_file: Path, top_k: int, work_dir: Path, probe) -> None:
    from rich.table import Table

    from hydrad.cli.bench import _ProgressObserver
    from hydrad.planner.validate import ROUNDS_AROUND_RUN, validate
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    specs = [e.spec for e in result.result.ranked[:top_k]]
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("sent {task.fields[sent]}  met {task.fields[met]}  errors {task.fields[errors]}"),
                        TimeElapsedColumn(), console=console)
    with progress:
        rows = validate(result, config, trace_file, specs, log_dir=work_dir,
                        observer_for=lambda spec: _ProgressObserver(progress),
                        speed_check=(lambda: probe.speeds(ROUNDS_AROUND_RUN)) if probe is not None else None)
    table = Table(title="simulated vs live goodput (req/s)",
                  caption="speed around the run: an idle check before and after it, by thread count; workers' "
                          "speed: their own steps' measured / predicted seconds during the search (images, "
                          "prefills, decodes)")
    for name in ("deployment", "simulated", "live", "error", "speed around the run", "simulated at it", "error",
                 "workers' speed", "simulated at it", "error"):
        table.add_column(name, justify="left" if name == "deployment" else "right")

    def rate(value, lower_bound: bool) -> str:
        # ">=": at the replay's ceiling (past 2400 requests, or --num-requests given: raise it to tell them apart).
        return "-" if value is None else f"{'>=' if lower_bound else ''}{value:.3g}"

    def error(value, lower_bound: bool) -> str:
        return "-" if value is None else f"{'>=' if lower_bound else ''}{100 * value:+.1f}%"

    for row in rows:
        at_least = row.get("simulated_is_lower_bound", False)
        now_at_least = row.get("simulated_at_run_speed_is_lower_bound", False)
        loaded_at_least = row.get("simulated_at_live_speed_is_lower_bound", False)
        speed = ", ".join(f"{f:.2f}x" for f in row.get("speed_around_run", {}).values())
        loaded = ", ".join(f"{k[0]} {f:.2f}x" for k, f in (row.get("live_speed_by_kind") or {}).items())
        table.add_row(row["deploy"], rate(row["simulated_goodput_rps"], at_least), rate(row["live_goodput_rps"], False),
                      error(row["error"], at_least), speed or "-",
                      rate(row.get("simulated_at_run_speed_rps"), now_at_least),
                      error(row.get("error_at_run_speed"), now_at_least), loaded or "-",
                      rate(row.get("simulated_at_live_speed_rps"), loaded_at_least),
                      error(row.get("error_at_live_speed"), loaded_at_least))
    console.print(table)
    console.print(f"the live daemons' logs and request traces are in {work_dir}", highlight=False)
