"""How fast a borrower runs on lent threads while its lender works in bursts beside it.

    python bench/borrow_speed.py [--model DIR] [--busy-ms 15] [--idle-ms 35] [--rounds 3] [--out FILE.json]

A CPU borrower (EP of ``1EP+1D``, ``engine.cores``) runs on its own thread and on the
lender's while the lender is idle, re-picking its count before every operation of the
model (``worker.StepThreads``). This times a prefill of four 297-token prompts on the
borrower (one torch thread of its own, one to borrow; the worker's hooks) in three
conditions, per round: on one thread, on two, and while a lender process alternates
``--busy-ms`` of work on its core (a 1024x1024 matmul loop, its byte on the board set) and
``--idle-ms`` asleep (its byte clear). From the lender's busy share f and the times T1, T2
and T of the three, the speed of the borrowed stretches against two threads is
``((1/T - f/T1) / (1 - f)) / (1/T2)``: 1 if borrowing were free, T2/T1 if the borrowed
stretches ran no faster than one thread. The planner's simulator takes it as
``SimSetup.borrow_efficiency`` (``planner.profile.DEFAULT_BORROW_EFFICIENCY``). The same
is timed with a lender that only flips its byte (sleeping through its busy time): what the
switches cost without work on the lent core.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

from common import machine, model_dir, write_json
from rich.console import Console
from rich.table import Table

console = Console()


def lender(flags, stop, busy_ms: float, idle_ms: float, work: bool) -> None:
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    while not stop.value:
        flags[1] = 1
        start = time.perf_counter()
        if not work:
            time.sleep(busy_ms / 1e3)
        while work and time.perf_counter() - start < busy_ms / 1e3:
            a @ b
        flags[1] = 0
        time.sleep(idle_ms / 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the built-in small model)")
    parser.add_argument("--busy-ms", type=float, default=15.0)
    parser.add_argument("--idle-ms", type=float, default=35.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="timed prefills per condition (median)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    # As the launcher sets for CPU workers that share the cores.
    os.environ.setdefault("GOMP_SPINCOUNT", "30000")
    import torch

    from hydrad.config import EngineConfig, ModelConfig
    from hydrad.engine.core import EngineCore
    from hydrad.engine.cores import CoreBoard, CoreLending, CpuThreads
    from hydrad.engine.profiler import EngineTimer, Probe
    from hydrad.engine.worker import StepThreads

    torch.set_num_threads(1)
    ctx = mp.get_context("fork")
    board = CoreBoard.new()
    engine = EngineCore(EngineConfig(model=ModelConfig(path=str(model_dir(args.model)))), role="EPD")
    timer = EngineTimer(engine, repeats=1)
    probe = Probe(prefills=((0, 297),) * 4)
    threads = StepThreads(engine, CoreLending(board, 0, CpuThreads(1, 1, (1,))))
    threads._hook_layers()
    busy = args.busy_ms / (args.busy_ms + args.idle_ms)

    def timed(lender_busy: bool | None = None, work: bool = False) -> float:
        stop, proc = ctx.Value("b", 0), None
        if lender_busy is None:
            proc = ctx.Process(target=lender, args=(board.flags, stop, args.busy_ms, args.idle_ms, work))
            proc.start()
            time.sleep(0.5)
        else:
            board.flags[1] = int(lender_busy)
        try:
            threads.before_step()
            timer(probe)
            return statistics.median(timer(probe) for _ in range(args.repeats))
        finally:
            if proc is not None:
                stop.value = 1
                proc.join()

    rows = []
    with console.status("timing") as status:
        for r in range(args.rounds):
            status.update(f"round {r + 1} of {args.rounds}")
            one, two = timed(lender_busy=True), timed(lender_busy=False)
            flips, works = timed(work=False), timed(work=True)

            def efficiency(t: float) -> float:
                return ((1 / t - busy / one) / (1 - busy)) * two

            rows.append({"one_thread": one, "two_threads": two, "lender_flips": flips, "lender_works": works,
                         "efficiency_flips": efficiency(flips), "efficiency_works": efficiency(works),
                         "one_thread_share": two / one})
    table = Table(title=f"4 x 297-token prefill; lender {args.busy_ms:g} ms busy / {args.idle_ms:g} ms idle")
    for name in ("round", "1 thread", "2 threads", "lender flips", "lender works", "borrowed speed: flips",
                 "borrowed speed: works", "1 thread's"):
        table.add_column(name, justify="right")
    for i, row in enumerate(rows):
        table.add_row(str(i + 1), *(f"{1e3 * row[k]:.0f} ms" for k in ("one_thread", "two_threads", "lender_flips",
                                                                         "lender_works")),
                      *(f"{row[k]:.2f}" for k in ("efficiency_flips", "efficiency_works", "one_thread_share")))
    console.print(table)
    median = statistics.median(row["efficiency_works"] for row in rows)
    console.print(f"borrowed stretches beside a working lender: {median:.2f} of the two-thread speed (median)")
    if args.out:
        write_json(args.out, {"args": vars(args), "machine": machine(), "rounds": rows,
                              "borrow_efficiency": median})


if __name__ == "__main__":
    main()
