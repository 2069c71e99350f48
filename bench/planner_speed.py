"""How fast the planner is: one 1,000-request replay, and the full search over N instances.

    python bench/planner_speed.py [--model DIR] [--requests 1000] [--instances 2,4,8] [--num-requests 300]

After each search it times what a profile adds: every ranked deployment bisected again at
each of 10 speeds (``Profile.average_over_speeds``), in one process and in one per core
(``--processes``). The workload is TextCaps-like (one image of 256 tokens, 11 prompt words, 10-30 output
tokens, Poisson arrivals at 2 req/s). The latency model is the one ``hydractl profile``
would use for ``--model`` (fitted on this machine with one torch thread, or loaded from
the cache); without ``--model``, fixed coefficients of the same order as the built-in
``small`` model's on this machine (see the output). SLO: TTFT <= 2 s, TBT p90 <= 0.1 s.
Replays run on the real scheduler, so their time depends on how many steps the
deployment takes; the replay is timed on 1EP+1D and 2EPD at three rates.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from common import machine, write_json
from rich.console import Console
from rich.table import Table

console = Console()

# A speed sample as large as the default history gives (8 earlier checks, the check, the
# fit), spread as the checks here spread: 0.95-1.2x.
SAMPLE_SPEEDS = (1.0, 0.95, 1.03, 1.08, 1.2, 0.98, 1.05, 1.12, 1.0, 1.0)


def synthetic_setup():
    from hydrad.config import SchedulerConfig, SLOConfig
    from hydrad.engine.latency_model import LatencyModel
    from hydrad.planner.profile import DEFAULT_WARM_REQUESTS
    from hydrad.planner.search import ROLE_ORDER
    from hydrad.planner.simulator import InstanceLayout, SimSetup

    model = LatencyModel(v_fixed=0.002, v_image=0.035, l_fixed=0.006, l_prefill=6e-4, l_attn=2e-5, l_decode=1.2e-3,
                         l_ctx=5e-4, overlap=0.95)
    return SimSetup(model, {r: InstanceLayout(4096, 256) for r in ROLE_ORDER}, 16, 256, 32768, 524288, 2048,
                    SchedulerConfig(), SLOConfig(ttft=2.0, tbt=0.1), message_seconds=0.002, step_overhead=0.001,
                    cores=2, threads=1, warm_requests=DEFAULT_WARM_REQUESTS)


def records(n: int, rate: float, seed: int = 0):
    from hydrad.trace import make_record

    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(make_record(timestamp=t, model="m", prompt_tokens=256 + 26, template_tokens=15,
                               images=[(1024, 768, 256, 5)], output_tokens=rng.randint(10, 30), max_tokens=30,
                               finish_reason="length", preprocess=0.015, ttft=None, e2e=0.0, gaps=[], stages={},
                               instances=[0], deploy="1EP+1D"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="Checkpoint folder whose latency model to use (fitted here if not cached).")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--instances", default="2,4,8")
    parser.add_argument("--num-requests", type=int, default=300, help="Requests per replay in the search.")
    parser.add_argument("--processes", type=int, default=None,
                        help="Processes the averaging runs in, beside one (default: one per core).")
    parser.add_argument("--out")
    args = parser.parse_args()

    import copy as copy_module
    import dataclasses

    from hydrad.engine.machine_speed import Speed
    from hydrad.planner.profile import Devices, Profile
    from hydrad.planner.search import Planner, deployments
    from hydrad.planner.simulator import simulate
    from hydrad.planner.workload import Workload

    from hydrad.engine.cores import usable_cpus

    args.processes = args.processes or usable_cpus()
    if args.model:
        from hydrad.config import EngineConfig, ModelConfig, SLOConfig
        from hydrad.planner.profile import machine_setup

        config = EngineConfig(model=ModelConfig(path=args.model), slo=SLOConfig(ttft=2.0, tbt=0.1))
        setup = machine_setup(config, Devices(("cpu", "cpu")))
    else:
        setup = synthetic_setup()
    console.print(f"latency model: {setup.model.summary() or setup.model}", highlight=False)
    workload = Workload.from_records(records(args.requests, 2.0))

    replays = []
    for roles in (["EP", "D"], ["EPD", "EPD"]):
        for rate in (1.0, 2.0, 3.0):
            reqs = workload.requests(rate, args.requests)
            times, result = [], None
            for _ in range(3):
                start = time.perf_counter()
                result = simulate(setup, roles, reqs, slo_ttft=2.0, slo_tbt=0.1)
                times.append(time.perf_counter() - start)
            replays.append({"deploy": "+".join(roles), "rate": rate, "requests": args.requests,
                            "seconds": statistics.median(times), "steps": result.num_steps,
                            "attainment": result.attainment})
    table = Table(title=f"one replay of {args.requests} requests (median of 3)")
    for column in ("deployment", "rate", "steps", "attainment", "seconds"):
        table.add_column(column, justify="right")
    for r in replays:
        table.add_row(r["deploy"], f"{r['rate']:g}", str(r["steps"]), f"{100 * r['attainment']:.1f}%",
                      f"{r['seconds']:.3f}")
    console.print(table)

    searches = []
    for n in (int(x) for x in args.instances.split(",")):
        setup_n = dataclasses.replace(setup, cores=None) if n > 2 else setup  # GPUs: one device each
        planner = Planner(setup_n, workload, slo_ttft=2.0, slo_tbt=0.1, num_requests=args.num_requests)
        result = planner.search(n, top_k=3)
        search = {"instances": n, "deployments": len(deployments(n)), "seconds": result.seconds,
                  "replays": result.num_replays, "ranked": len(result.ranked),
                  "top": [(e.spec, e.goodput) for e in result.ranked[:3]],
                  "algorithm2": {m: "+".join(r) for m, r in result.algorithm2.items()}}
        # What a profile adds after the search: every ranked deployment again at each check of
        # a speed sample as large as the default history gives (Profile.average_over_speeds).
        sample = tuple({n_: Speed(f, 0.0) for n_ in (setup_n.speeds or {setup_n.threads: 1.0})}
                       for f in SAMPLE_SPEEDS)
        # In one process, then in one per core (the same goodputs).
        tops = []
        for key, processes in (("over_speeds_seconds", 1), ("over_speeds_seconds_in_processes", args.processes)):
            copy = copy_module.deepcopy(result)
            profile = Profile(workload, Devices(("cpu",) * n), dataclasses.replace(setup_n, speed_sample=sample),
                              2.0, 0.1, planner, copy)
            start = time.perf_counter()
            profile.average_over_speeds(processes=processes)
            search[key] = time.perf_counter() - start
            tops.append([(e.spec, e.goodput) for e in copy.ranked[:3]])
        if tops[0] != tops[1]:
            raise SystemExit(f"the averaging in {args.processes} processes differs from one: {tops}")
        search["processes"], search["top_over_speeds"] = args.processes, tops[0]
        searches.append(search)
    table = Table(title=f"full search, {args.num_requests} requests per replay; then the ranked deployments at "
                        f"{len(SAMPLE_SPEEDS)} speeds ({min(SAMPLE_SPEEDS):g}-{max(SAMPLE_SPEEDS):g}x)")
    for column in ("instances", "deployments", "replays", "bisected", "seconds", "top 3 (goodput req/s)",
                   "at the speeds: seconds", f"in {args.processes} processes"):
        table.add_column(column, justify="right")
    for s in searches:
        table.add_row(str(s["instances"]), str(s["deployments"]), str(s["replays"]), str(s["ranked"]),
                      f"{s['seconds']:.2f}", ", ".join(f"{d} {g:.3g}" for d, g in s["top"]),
                      f"{s['over_speeds_seconds']:.2f}", f"{s['over_speeds_seconds_in_processes']:.2f}")
    console.print(table)
    write_json(args.out, {"machine": machine(), "replays": replays, "searches": searches})


if __name__ == "__main__":
    main()
