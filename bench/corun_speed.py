"""How much slower each kind of work runs while another worker computes on the other core.

    python bench/corun_speed.py [--model DIR] [--rounds 4] [--timings 5] [--out FILE.json]

CPU workers of a deployment each run on their own share of the cores, and the planner's
simulator slows a step only while more threads are busy than there are cores. Two steps
on separate cores still share the caches and the memory bandwidth. This times the
latency model's speed probes (``machine_speed.speed_probes``: one with images, one prefill,
one of decodes; the probes the planner's speed check times) on one torch thread, per
round: alone, then while a second process runs the same probes in a loop on its own
thread. Both conditions in every round, one right after the other, so the machine's
drift between rounds moves both; reported per kind: the median of each condition's
``--timings`` timings against the probe's fitted time, and their ratio (co-running /
alone), then the median ratio over the rounds.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

from common import machine, model_dir, write_json
from rich.console import Console
from rich.table import Table

console = Console()


def _probes(model: str):
    """An engine's timer and the latency model's speed probes, on one torch thread."""
    import torch

    torch.set_num_threads(1)
    from hydrad.config import EngineConfig, ModelConfig
    from hydrad.engine.core import EngineCore
    from hydrad.engine.profiler import EngineTimer, fit_latency_model, probe_images
    from hydrad.engine.machine_speed import speed_probes

    engine = EngineCore(EngineConfig(model=ModelConfig(path=model)), role="EPD")
    fitted = fit_latency_model(engine, show_progress=False)
    timer = EngineTimer(engine, images=probe_images(engine))
    return timer, speed_probes(fitted, set(timer.images))


def neighbour(model: str, ready, stop) -> None:
    """The other worker: the same probes, one after another, until stopped."""
    timer, probes = _probes(model)
    ready.set()
    while not stop.is_set():
        for probe, _ in probes:
            timer(probe)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the built-in small model)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--timings", type=int, default=5, help="timings of each probe per condition (median)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from hydrad.engine.machine_speed import probe_kind

    model = str(model_dir(args.model))
    with console.status("fitting or loading the latency model"):
        timer, probes = _probes(model)
    ctx = mp.get_context("spawn")

    def timed() -> dict[str, float]:
        ratios: dict[str, list[float]] = {}
        for _ in range(args.timings):
            for probe, seconds in probes:
                ratios.setdefault(probe_kind(probe), []).append(timer(probe) / seconds)
        return {kind: statistics.median(r) for kind, r in ratios.items()}

    rows = []
    with console.status("timing") as status:
        for r in range(args.rounds):
            status.update(f"round {r + 1} of {args.rounds}: alone")
            alone = timed()
            status.update(f"round {r + 1} of {args.rounds}: starting the neighbour")
            ready, stop = ctx.Event(), ctx.Event()
            proc = ctx.Process(target=neighbour, args=(model, ready, stop))
            proc.start()
            try:
                if not ready.wait(300):
                    raise SystemExit("the neighbour process did not start")
                time.sleep(1.0)  # into its loop
                status.update(f"round {r + 1} of {args.rounds}: beside the neighbour")
                beside = timed()
            finally:
                stop.set()
                proc.join()
            rows.append({"alone": alone, "beside": beside, "slowdown": {k: beside[k] / alone[k] for k in alone}})
    kinds = list(rows[0]["alone"])
    table = Table(title="speed probes on one thread against their fitted time: alone, and beside a neighbour")
    for name in ("round", "kind", "alone", "beside", "slowdown"):
        table.add_column(name, justify="left" if name == "kind" else "right")
    for i, row in enumerate(rows):
        for kind in kinds:
            table.add_row(str(i + 1) if kind == kinds[0] else "", kind,
                          *(f"{row[name][kind]:.3f}" for name in ("alone", "beside", "slowdown")))
    console.print(table)
    median = {kind: statistics.median(row["slowdown"][kind] for row in rows) for kind in kinds}
    console.print("median slowdown beside a neighbour: " + ", ".join(f"{k} {v:.3f}x" for k, v in median.items()))
    if args.out:
        write_json(args.out, {"args": vars(args), "machine": machine(), "rounds": rows, "median_slowdown": median})


if __name__ == "__main__":
    main()
