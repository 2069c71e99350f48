"""``hydractl status``: instances and latency of a running daemon, as rich tables or JSON."""

from __future__ import annotations

import click


@click.command()
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, envvar="HYDRAD_URL",
              help="The daemon's base URL. Env: HYDRAD_URL.")
@click.option("--admin-token", envvar="HYDRAD_ADMIN_TOKEN", help="Needed for non-loopback daemons. "
              "Env: HYDRAD_ADMIN_TOKEN.")
@click.option("--watch", is_flag=True, help="Refresh until interrupted.")
@click.option("--interval", type=float, default=2.0, show_default=True, help="Seconds between refreshes.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the daemon's status document (GET /admin/status) as one line of JSON, one per "
                   "refresh with --watch: for scripts.")
def status(url: str, admin_token: str | None, watch: bool, interval: float, as_json: bool) -> None:
    """Show each instance (device, role, state, load, caches, tokens/s) and request latency."""
    from hydrad.console import make_console

    out = make_console()  # into a pipe or a file: the tables at their whole width
    fetch = lambda: fetch_status(url, admin_token)  # noqa: E731
    if as_json:
        import sys

        watch_json(fetch, sys.stdout, interval if watch else None)
    elif not watch:
        out.print(render(fetch()))
    else:
        watch_status(fetch, out, interval)


def watch_json(fetch, file, interval: float | None, sleep=None) -> None:
    """Write each status document as one line of JSON (once when ``interval`` is None, else
    every ``interval`` seconds until interrupted). While watching, a daemon that does not
    answer is one line ``{"error": ..., "time": ...}`` and the watch goes on."""
    import json
    import time

    from hydrad.errors import HydradError

    sleep = sleep or time.sleep
    while True:
        try:
            line = json.dumps(fetch(), separators=(",", ":"))
        except HydradError as e:
            if interval is None:
                raise
            line = json.dumps({"error": str(e), "time": time.time()})
        file.write(line + "\n")
        file.flush()
        if interval is None:
            return
        sleep(interval)


def watch_status(fetch, out, interval: float, sleep=None) -> None:
    """Redraw every ``interval`` seconds until interrupted: in place on a terminal, one
    snapshot after another elsewhere (a pipe or a log file, where a live display would
    print nothing before it ends). A daemon that stops answering (restarting) is shown
    as such until it answers again."""
    import time

    from rich.live import Live

    from hydrad.errors import HydradError

    def snapshot():
        try:
            return render(fetch())
        except HydradError as e:
            return f"[red]{time.strftime('%H:%M:%S')} {e}[/]"

    sleep = sleep or time.sleep
    if not out.is_terminal:
        while True:
            # Rendered whole, then written in one call: an interrupt while it renders
            # prints nothing of it, never half a snapshot.
            with out.capture() as captured:
                out.print(snapshot())
            out.file.write(captured.get())
            out.file.flush()
            sleep(interval)
    with Live(snapshot(), console=out, auto_refresh=False) as live:
        while True:
            sleep(interval)
            live.update(snapshot(), refresh=True)


def fetch_status(url: str, admin_token: str | None) -> dict:
    import json

    from hydrad.cli.daemon_http import daemon_request

    with daemon_request(url, "/admin/status", admin_token) as response:
        return json.load(response)


def render(status: dict):
    from rich.console import Group
    from rich.table import Table

    deployment = status.get("deployment") or {}
    deploy = f", {deployment['deploy']}" if deployment.get("deploy") else ""
    # The dtype the instances' models run in (one, unless CPU and CUDA instances differ).
    shown = "/".join(dict.fromkeys(i["dtype"] for i in status["instances"] if i.get("dtype")))
    dtypes = f", {shown}" if shown else ""
    # A line of its own: as the table's title it would wrap to the table's width.
    head = (f"hydrad: {status['model']}{deploy}{dtypes} (max_model_len {status['max_model_len']}, "
            f"up {_duration(status['uptime_seconds'])})")
    # Borderless columns (as ``kubectl get``): the table fits an 80-column terminal.
    instances = Table(box=None, pad_edge=False, header_style="bold")
    for name in ("#", "device", "role", "state", "running", "waiting", "KV", "image", "cached", "tok/s"):
        instances.add_column(name, justify="left" if name in ("device", "role", "state") else "right", no_wrap=True,
                             min_width=len(name) if name in ("#", "role") else None)
    for i in status["instances"]:
        state = {"ready": "[green]ready[/]", "down": "[red]down[/]"}.get(i["state"], f"[yellow]{i['state']}[/]")
        instances.add_row(str(i["id"]), i["device"], i["role"], state, _n(i["num_running"]), _n(i["num_waiting"]),
                          _pct(i["kv_usage"]), _pct(i["image_usage"]), _hits(i), _rate(i["tokens_per_second"]))
    instance_lines = [f"#{i['id']} {i['role']}{_threads(i)}{_usage(i)}" + (_model_line(i) if i.get("latency_model")
                                                                          else "")
                      for i in status["instances"] if i.get("latency_model") or i.get("threads") or _usage(i)]
    r = status["requests"]
    requests = Table(title=f"requests (last {r['window_seconds']:.0f} s)", box=None, pad_edge=False,
                     header_style="bold")
    for name in ("in flight", "req/s", "TTFT p50", "TTFT p90", "TBT p50", "TBT p90"):
        requests.add_column(name, justify="right", no_wrap=True)
    requests.add_row(str(r["num_inflight"]), f"{r['request_rate']:.2f}", _ms(r["ttft_p50"]), _ms(r["ttft_p90"]),
                     _ms(r["tbt_p50"]), _ms(r["tbt_p90"]))
    parts = [head, instances]
    if deployment.get("reason"):
        parts.append(f"deployment {deployment['deploy']}: {deployment['reason']}")
    if instance_lines:
        parts.append("instances:\n  " + "\n  ".join(instance_lines))
    history = deployment.get("history") or []
    if len(history) > 1:
        parts.append("deployments:\n  " + "\n  ".join(_deployment_line(d) for d in history[-5:]))
    planner = status.get("planner") or {}
    if planner.get("auto") or planner.get("decisions"):
        decisions = planner.get("decisions") or []
        head = (f"re-planning every {planner['interval']:g} s (window {planner['window']:g} s, margin "
                f"{planner['margin']:.0%})") if planner.get("auto") else "planned at start"
        parts.append(head + (":\n  " + "\n  ".join(_decision_line(d) for d in decisions[-5:])
                             if decisions else ": no decision yet"))
    parts.append(requests)
    failures = status.get("failures") or {}
    if failures.get("worker_restarts") or failures.get("requests_run_again") or failures.get("requests_lost"):
        restarted = ", ".join(f"#{i['id']} x{i['restarts']}" for i in status["instances"] if i.get("restarts"))
        parts.append(f"worker restarts: {failures['worker_restarts']}" + (f" ({restarted})" if restarted else "")
                     + f"; their requests run again: {failures['requests_run_again']}, lost: "
                     + f"{failures['requests_lost']}"
                     + (f"; quarantined: {failures['quarantined']} (refused since: "
                        f"{failures.get('requests_refused_quarantined', 0)})" if failures.get("quarantined") else ""))
    kept = status.get("responses")
    if kept and kept.get("kept"):
        running = kept.get("background_running")
        parts.append(f"kept responses (/v1/responses): {kept['kept']}, {kept['bytes'] / (1 << 20):.1f} of "
                     f"{kept['max_bytes'] / (1 << 20):.0f} MiB" + (f"; background running: {running}" if running else ""))
    frontend = status.get("frontend")
    if frontend and frontend.get("cpu_share") is not None:
        per_token = frontend.get("cpu_per_token")
        processes = frontend.get("processes")
        parts.append(f"daemon: {100 * frontend['cpu_share']:.0f}% of a core"
                     + (f" over {len(processes)} front-end processes" if processes else "")
                     + (f", {1e6 * per_token:.0f} us CPU per token" if per_token is not None else "")
                     + f"; event-loop lag p99 {_ms(frontend['loop_lag_p99'])}, max {_ms(frontend['loop_lag_max'])}")
    return Group(*parts)


def _model_line(i: dict) -> str:
    """An instance's step bound, how its steps run against its latency model, and the model."""
    return (f": steps up to {_ms(i['latency_bound'])}"
            + (f" (÷ {c:.2f}: steps with decodes run {c:.2f}x the model now)"
               if (c := i.get("latency_calibration")) and abs(c - 1.0) > 0.005 else "")
            + (f"; its steps run {_speed(i['live_speed'])} their prediction" if i.get("live_speed") else "")
            + f"; {i['latency_model']}"
            + (f"; on borrowed cores: {i['borrow_latency_model']}" if i.get("borrow_latency_model") else
               "; on borrowed cores: the same (theirs is measured between steps once its lenders are idle)"
               if i.get("borrowed_threads")
               else ""))


def _usage(instance: dict) -> str:
    """The worker process's share of a core and its resident memory (of it, shared memory: cache
    pools other processes map too), where the daemon read them."""
    share, rss, shared = instance.get("cpu_share"), instance.get("rss_bytes"), instance.get("shared_bytes")
    memory = [] if rss is None else [f"{rss / (1 << 30):.2f} GiB resident" + (
        f" ({shared / (1 << 30):.2f} shared)" if shared and shared >= (1 << 30) / 200 else "")]
    parts = ([f"{100 * share:.0f}% of a core"] if share is not None else []) + memory
    return ", " + ", ".join(parts) if parts else ""


def _threads(instance: dict) -> str:
    """A CPU instance's torch threads: its own, and those it borrows while its lenders idle."""
    if not instance.get("threads"):
        return ""
    own, borrowed = instance["threads"], instance.get("borrowed_threads") or 0
    return f" on {own}{f'+{borrowed}' if borrowed else ''} thread{'s' if own + borrowed > 1 else ''}"


def _decision_line(d: dict) -> str:
    import time

    return f"{time.strftime('%H:%M:%S', time.localtime(d['time']))} {d['action']} {d['current']}: {d['reason']}"


def _deployment_line(d: dict) -> str:
    import time

    took = f", changed in {d['seconds']:.1f} s" if d.get("seconds") is not None else ""
    return f"{time.strftime('%H:%M:%S', time.localtime(d['since']))} {d['deploy']} ({d['reason']}{took})"


def _hits(instance: dict) -> str:
    """The share of looked-up prompt tokens found cached (``-``: the instance looks nothing up)."""
    queries = instance.get("prefix_cache_queries")
    if not queries:
        return "-"
    return f"{100 * instance['prefix_cache_hits'] / queries:.0f}%"


def _n(value) -> str:
    return "-" if value is None else str(value)


def _rate(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _speed(parts: dict) -> str:
    """Measured / predicted by kind of work: "images 1.31x, decodes 1.18x"."""
    return ", ".join(f"{kind} {factor:.2f}x" for kind, factor in parts.items())


def _ms(value) -> str:
    return "-" if value is None else f"{1000 * value:.1f} ms"


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m" if hours else f"{m}m{s:02d}s"
