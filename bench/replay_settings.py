"""Two settings of the planner's replay against the same live runs, paired.

    python bench/replay_settings.py RUN.json [RUN.json ...] [--model DIR]
        [--a-corun images=0.01,prefills=0.03,decodes=0.09] [--a-client yes|no] [--a-warm N] [--a-noise-correlation R]
        [--b-corun images=0.14,prefills=0.10,decodes=0.10] [--b-client yes|no] [--b-warm N] [--b-noise-correlation R]
        [--a-all-cores KINDS] [--b-all-cores KINDS] [--a-team yes|no] [--b-team yes|no]
        [--at around-run|profile] [--a-speed check|history|sample] [--b-speed check|history|sample] [--chain]
        [--out FILE.json]

Each RUN.json is the output of ``bench/planner_accuracy.py accuracy``, whose recorded traces
are still on disk (the run's working folder, beside each deployment's ``trace_dir``). Every
live round of every deployment in them is replayed twice at the speed measured around it
(``speed_around_run``, per kind and with its spread where the run stored it, else
``--spread``), once with setting A and once with B, and each goodput is compared with that
round's live goodput (``--at profile``: each deployment once per setting at the speed its
profile measured before the live runs, against the mean of its live rounds: the run's
headline comparison). A setting is a ``corun_slowdown`` per kind (and an
``all_cores_slowdown``, which replays of one instance on every core take instead, and whether such an
instance waits for its slowest thread, ``SimSetup.team_waits``), whether the bench
client's CPU per request (measured while the run recorded its trace) is replayed as a load
of its own, and the requests of the warm-up replay that calibrates the instances before
each counted one (``SimSetup.warm_requests``; 0: they start cold), and the correlation of
each step's time noise with its instance's previous step's (``SimSetup.noise_correlation``),
and, with ``--at profile``, the speed the profile is replayed at (``--a-speed``,
``--b-speed``): ``check``, the check the profile took as it started, alone; ``history``,
the median of that check, the run's checks before it (the earlier profiles' checks and the
checks around the earlier live runs, as the JSON holds them: the mean of the two around
each run; the last ``machine_speed.SPEED_HISTORY``) and the fit, as ``profile.planning_speeds``
plans (a run made with the history: the speed it planned at); ``sample``, at each check of
the speed sample a profile averages its goodput over (``machine_speed.speed_sample``: those
earlier checks, the profile's and the fit), the goodput their mean. ``--chain``: a profile's
earlier checks are those of every run given before it, in the order given, for each
setting (the history then rebuilt for runs made with it too). With ``--at profile`` it also
prints how far each setting's speed was from the mean speed measured around the workload's
live runs. The defaults: A is the
replay before the serving slowdown (the probes beside a copy of themselves,
``bench/corun_speed.py``, the client's CPU, cold instances, noise drawn anew each step), B
is the replay's default now (``profile.DEFAULT_CORUN_SLOWDOWN``, a team that waits, no separate client load,
``profile.DEFAULT_WARM_REQUESTS``, ``profile.DEFAULT_NOISE_CORRELATION``, the speed sample). Both replays of
a round share everything else (the machine's latency models and copy bandwidth, measured or
cached here), so the difference between their errors is the settings' alone.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from common import machine, model_dir, write_json
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

console = Console()

OLD_CORUN = "images=0.01,prefills=0.03,decodes=0.09"


def parse_kinds(text: str) -> dict[str, float]:
    """``images=0.14,prefills=0.1`` as a dict; a usage error names the bad part."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, sep, value = part.partition("=")
        try:
            if not sep or kind not in ("images", "prefills", "decodes"):
                raise ValueError
            out[kind] = float(value)
        except ValueError:
            raise SystemExit(f"bad corun setting {part!r}: expected images|prefills|decodes=<fraction>") from None
    return out


def make_setting(corun: str | None, client: str, warm: int, noise_correlation: float, defaults: dict,
                 speed: str = "check", all_cores: str | None = None, team: str = "no") -> dict:
    """One replay setting from its command-line values; ``corun`` (``all_cores``) None:
    ``defaults``' corun_slowdown (all_cores_slowdown). A usage error names the bad value."""
    if warm < 0:
        raise SystemExit(f"warm-up requests must be >= 0, got {warm}")
    if not 0 <= noise_correlation < 1:
        raise SystemExit(f"a noise correlation must be in [0, 1), got {noise_correlation}")
    return {"corun_slowdown": parse_kinds(corun) if corun is not None else dict(defaults["corun_slowdown"]),
            "all_cores_slowdown": (parse_kinds(all_cores) if all_cores is not None
                                   else dict(defaults["all_cores_slowdown"])),
            "client_cpu": client == "yes", "warm_requests": warm, "noise_correlation": noise_correlation,
            "speed": speed, "team_waits": team == "yes"}


def profile_checks(workload: dict, spread: float) -> dict:
    """The speed check (``machine_speed.Speed`` by thread count) a profile took as it started (a run
    that stored it overall only: per kind, the speeds planned at scaled by its factor over the
    one planned at)."""
    from hydrad.engine.machine_speed import Speed

    machine_json = workload["profile"]["machine"]
    planned = machine_json.get("speed_by_kind", {})
    basis = machine_json.get("speed_basis") or {}
    if basis:
        return {int(n): Speed(b["check_now"], spread, b.get("check_now_by_kind") or {
            kind: f * b["check_now"] / b["planned_at"] for kind, f in planned.get(n, {}).items()})
            for n, b in basis.items()}
    return {int(n): Speed(f, spread, planned.get(n, {})) for n, f in machine_json["speed_vs_latency_model"].items()}


def checks_around_runs(workload: dict, spread: float) -> list[dict]:
    """The checks around the workload's live runs (the mean of the two around each), round by round."""
    from hydrad.engine.machine_speed import Speed

    rounds = [dep.get("rounds") or [dep] for dep in workload["deployments"]]
    found = []
    for k in range(max(map(len, rounds), default=0)):
        for r in (each[k] for each in rounds if k < len(each)):
            if r.get("speed_around_run"):
                found.append({int(n): Speed(f, spread, (r.get("speed_around_run_by_kind") or {}).get(n, {}))
                              for n, f in r["speed_around_run"].items()})
    return found


def planned_speeds(run: dict, index: int, how: str, spread: float, chained: list[dict] | None = None):
    """The speeds (by thread count) the profile of ``run``'s workload ``index`` is replayed at:
    ``check``, its own check alone; ``history``, as ``profile.planning_speeds`` plans;
    ``sample``, the checks a profile averages its goodput over (a list of them,
    ``machine_speed.speed_sample``). The earlier checks are ``chained`` when given (the checks
    of every run before this profile, ``--chain``), else the run's own before this workload,
    and for ``history`` a run made with the history plans at the speed it stored."""
    from hydrad.engine.machine_speed import SPEED_HISTORY, Speed, speed_sample, typical_speed

    workload = run["workloads"][index]
    now = profile_checks(workload, spread)
    if how == "check":
        return now
    machine_json = workload["profile"]["machine"]
    if chained is None and how == "history" and any(
            b.get("with_fit") for b in (machine_json.get("speed_basis") or {}).values()):
        return {int(n): Speed(f, spread, machine_json.get("speed_by_kind", {}).get(n, {}))
                for n, f in machine_json["speed_vs_latency_model"].items()}
    earlier = chained
    if earlier is None:
        earlier = []
        for w in run["workloads"][:index]:
            earlier += [profile_checks(w, spread), *checks_around_runs(w, spread)]
    by_count = {n: [c[n] for c in earlier if n in c][-SPEED_HISTORY:] for n in now}
    if how == "sample":
        return speed_sample(now, by_count)
    return {n: typical_speed(speed, by_count[n]) for n, speed in now.items()}


def speed_off(speeds: dict, workload: dict) -> list[float]:
    """|log| of each thread count's speed over the mean speed around the workload's live runs."""
    around = checks_around_runs(workload, 0.0)
    return [abs(math.log(speed.factor / statistics.mean(c[n].factor for c in around if n in c)))
            for n, speed in speeds.items() if any(n in c for c in around)]


def summarize(errors: list[float]) -> dict:
    """Relative errors (simulated - live) / live of many rounds, summed up."""
    return {"rounds": len(errors), "mean": statistics.mean(errors), "median": statistics.median(errors),
            "mean_abs": statistics.mean(abs(e) for e in errors), "within_15pct": sum(abs(e) <= 0.15 for e in errors)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="JSON files of bench/planner_accuracy.py accuracy")
    parser.add_argument("--model", help="Checkpoint folder (default: the built-in small model).")
    parser.add_argument("--a-corun", default=OLD_CORUN)
    parser.add_argument("--a-all-cores", default="",
                        help="all_cores_slowdown of A (one instance on every core), e.g. prefills=0.18; default none")
    parser.add_argument("--b-all-cores", help="default: the replay's DEFAULT_ALL_CORES_SLOWDOWN")
    parser.add_argument("--a-team", choices=("yes", "no"), default="no",
                        help="SimSetup.team_waits in A (one instance on every core waits for its slowest thread)")
    parser.add_argument("--b-team", choices=("yes", "no"), default="yes")
    parser.add_argument("--a-client", choices=("yes", "no"), default="yes",
                        help="replay the bench client's CPU as a load of its own in A")
    parser.add_argument("--a-warm", type=int, default=0, help="warm-up requests of each replay in A")
    parser.add_argument("--a-noise-correlation", type=float, default=0.0)
    parser.add_argument("--b-corun", help="default: the replay's DEFAULT_CORUN_SLOWDOWN")
    parser.add_argument("--b-client", choices=("yes", "no"), default="no")
    parser.add_argument("--b-warm", type=int, help="default: the replay's DEFAULT_WARM_REQUESTS")
    parser.add_argument("--b-noise-correlation", type=float, help="default: the replay's DEFAULT_NOISE_CORRELATION")
    parser.add_argument("--at", choices=("around-run", "profile"), default="around-run",
                        help="around-run: each live round at the speed measured around it; profile: each "
                        "deployment at the speed its profile measured (as the run's headline figure), against "
                        "the mean of its live rounds")
    parser.add_argument("--a-speed", choices=("check", "history", "sample"), default="check",
                        help="--at profile: replay A at the profile's check alone, at the median with the history, "
                        "or at each check of the speed sample, its goodput the mean")
    parser.add_argument("--b-speed", choices=("check", "history", "sample"), default="sample")
    parser.add_argument("--chain", action="store_true",
                        help="--at profile: each profile's earlier checks are those of the runs given before it, "
                        "in the order given (else its own run's before it)")
    parser.add_argument("--spread", type=float, default=0.1,
                        help="the speed check's spread for runs that did not store it")
    parser.add_argument("--out")
    args = parser.parse_args()

    from hydrad.cluster.deploy import parse_deploy
    from hydrad.engine.machine_speed import Speed
    from hydrad.planner.profile import (DEFAULT_ALL_CORES_SLOWDOWN, DEFAULT_CORUN_SLOWDOWN, DEFAULT_NOISE_CORRELATION,
                                        DEFAULT_WARM_REQUESTS, Devices, MachineOptions, MachineProbe, at_speeds,
                                        machine_setup)
    from hydrad.planner.search import ROLE_ORDER, Evaluation, Planner
    from hydrad.planner.workload import Workload
    from hydrad.trace import read_trace

    sys.path.insert(0, str(Path(__file__).parent))
    from planner_accuracy import daemon_config

    defaults = {"corun_slowdown": DEFAULT_CORUN_SLOWDOWN, "all_cores_slowdown": DEFAULT_ALL_CORES_SLOWDOWN,
                "warm_requests": DEFAULT_WARM_REQUESTS,
                "noise_correlation": DEFAULT_NOISE_CORRELATION}
    settings = {
        "A": make_setting(args.a_corun, args.a_client, args.a_warm, args.a_noise_correlation, defaults, args.a_speed,
                          args.a_all_cores, args.a_team),
        "B": make_setting(args.b_corun, args.b_client,
                          defaults["warm_requests"] if args.b_warm is None else args.b_warm,
                          defaults["noise_correlation"] if args.b_noise_correlation is None
                          else args.b_noise_correlation, defaults, args.b_speed, args.b_all_cores, args.b_team)}
    runs = []
    for path in args.runs:
        try:
            runs.append((Path(path).stem, json.loads(Path(path).read_text())))
        except (OSError, ValueError) as e:
            raise SystemExit(f"cannot read {path}: {e}") from None
    first = runs[0][1]["args"]
    devices = Devices.parse(first["devices"])
    config = daemon_config(model_dir(args.model), first["devices"], "auto", first["slo_ttft"], first["slo_tbt"])
    if args.at == "profile":
        work = [(name, run, (k, i, w), dep, dep) for k, (name, run) in enumerate(runs)
                for i, w in enumerate(run["workloads"])
                for dep in w["deployments"] if dep.get("live_goodput_rps")]
        # Each setting's speeds per workload, planned once (keyed by the run's place in the
        # list: two runs' files can share a name): replayed below, and how far they were from
        # the speed around the live runs.
        chains, seen = {}, []
        for k, (_, run) in enumerate(runs):
            for i, w in enumerate(run["workloads"]):
                chains[k, i] = list(seen) if args.chain else None
                seen += [profile_checks(w, args.spread), *checks_around_runs(w, args.spread)]
        planned = {(k, i, label): planned_speeds(run, i, setting["speed"], args.spread, chains[k, i])
                   for k, (_, run) in enumerate(runs) for i in range(len(run["workloads"]))
                   for label, setting in settings.items()}
        off = {label: [x for k, (_, run) in enumerate(runs) for i, w in enumerate(run["workloads"])
                       if isinstance(planned[k, i, label], dict) for x in speed_off(planned[k, i, label], w)]
               for label in settings}
    else:
        work = [(name, run, (k, i, w), dep, r) for k, (name, run) in enumerate(runs)
                for i, w in enumerate(run["workloads"])
                for dep in w["deployments"]
                for r in dep.get("rounds") or [dep] if r.get("speed_around_run") and r.get("live_goodput_rps")]
    rows = []
    with MachineProbe(config.engine, devices) as probe, Progress(console=console) as progress:
        base = machine_setup(config.engine, devices, MachineOptions(check_speed=False), show_progress=False,
                             probe=probe)
        what = "live round" if args.at == "around-run" else "deployment"
        task = progress.add_task(f"replaying each {what} twice", total=len(work))
        workloads = {}
        for name, run, (k, index, w), dep, r in work:
            trace = Path(dep["trace_dir"]).parents[1] / "trace"
            if trace not in workloads:
                if not trace.exists():
                    raise SystemExit(f"{name}: the recorded trace {trace} is gone; run the accuracy benchmark again")
                workloads[trace] = Workload.from_records(read_trace(trace))
            noise = None
            if args.at == "profile":
                # The step noise the profile replayed with (which replaces the one at_speeds
                # derives from the spread).
                noise = w["profile"]["machine"]["step_noise"]
            else:
                spreads = r.get("speed_around_run_spread") or {}
                speeds = {int(n): Speed(f, spreads.get(n, args.spread), r["speed_around_run_by_kind"].get(n, {}))
                          for n, f in r["speed_around_run"].items()}
            roles = tuple(sorted(parse_deploy(dep["deploy"]), key=ROLE_ORDER.index))
            row = {"run": name, "workload": w["workload"], "deploy": dep["deploy"], "live_rps": r["live_goodput_rps"]}
            for label, setting in settings.items():
                if args.at == "profile":
                    speeds = planned[k, index, label]
                setup = replace(base, corun_slowdown=setting["corun_slowdown"],
                                all_cores_slowdown=setting["all_cores_slowdown"],
                                warm_requests=setting["warm_requests"],
                                noise_correlation=setting["noise_correlation"], team_waits=setting["team_waits"],
                                client_seconds=w["client_cpu_seconds_per_request"] if setting["client_cpu"] else 0.0)
                each = []
                for at in speeds if isinstance(speeds, list) else [speeds]:  # a speed sample: the mean
                    at_setup = at_speeds(setup, at)
                    if noise is not None:
                        at_setup = replace(at_setup, step_noise=noise)
                    planner = Planner(at_setup, workloads[trace], slo_ttft=run["args"]["slo_ttft"],
                                      slo_tbt=run["args"]["slo_tbt"], num_requests=run["args"]["num_requests"],
                                      seed=config.engine.seed)
                    each.append(planner.bisect(Evaluation(roles, planner.bound(roles))))
                goodput = statistics.mean(each)
                row[label] = goodput
                row[f"error_{label}"] = (goodput - row["live_rps"]) / row["live_rps"]
            rows.append(row)
            progress.advance(task)
    table = Table(title="the same live rounds replayed with settings A and B (req/s; error against live)")
    for column in ("run", "workload", "deployment", "live", "A", "error", "B", "error"):
        table.add_column(column, justify="left" if column in ("run", "workload", "deployment") else "right")
    for row in rows:
        table.add_row(row["run"], row["workload"], row["deploy"], f"{row['live_rps']:.3g}", f"{row['A']:.3g}",
                      f"{100 * row['error_A']:+.0f}%", f"{row['B']:.3g}", f"{100 * row['error_B']:+.0f}%")
    console.print(table)
    summary = {label: summarize([row[f"error_{label}"] for row in rows]) for label in settings} if rows else {}
    for label, s in summary.items():
        setting = settings[label]
        console.print(f"{label} (corun {setting['corun_slowdown']}, client CPU "
                      f"{'replayed' if setting['client_cpu'] else 'not replayed'}, {setting['warm_requests']} "
                      f"warm-up requests, noise correlation {setting['noise_correlation']:g}, "
                      f"{'a team that waits' if setting['team_waits'] else 'threads sharing the cores'}"
                      f"{', at the ' + setting['speed'] if args.at == 'profile' else ''}): "
                      f"mean error {100 * s['mean']:+.1f}%, median {100 * s['median']:+.1f}%, mean absolute "
                      f"{100 * s['mean_abs']:.1f}%, within 15% {s['within_15pct']} of {s['rounds']}", highlight=False)
    speed_summary = {}
    if args.at == "profile":
        for label, logs in off.items():
            if logs:
                speed_summary[label] = {"profiles_by_threads": len(logs), "mean_abs": math.expm1(statistics.mean(logs)),
                                        "max_abs": math.expm1(max(logs))}
                console.print(f"{label}'s speed against the mean speed around the live runs: off by "
                              f"{100 * speed_summary[label]['mean_abs']:.0f}% on average, at most "
                              f"{100 * speed_summary[label]['max_abs']:.0f}% ({len(logs)} profiles x thread counts)",
                              highlight=False)
    write_json(args.out, {"mode": "replay_settings", "machine": machine(), "runs": [name for name, _ in runs],
                          "at": args.at, "settings": settings,
                          "rounds": rows, "summary": summary, "speed_vs_around_run": speed_summary})


if __name__ == "__main__":
    main()
