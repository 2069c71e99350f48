"""Dual streams on one EPD instance: throughput with vision and language work overlapped, or not.

    python bench/dual_streams.py [--model DIR] [--num 32] [--concurrency 16] [--threads default,1]

One in-process EPD engine per setting, fixed budgets (no SLO derivation). A closed
loop keeps ``--concurrency`` requests in flight, each with one image and between
``--min-tokens`` and ``--max-tokens`` output tokens (ignore_eos), so new images
are encoded while earlier requests decode. With dual streams the vision batch of
a step runs on a second executor thread next to the language batch; without,
one after the other. Runs alternate (on, off, on, off, ...) per torch thread
count to cancel drift. Reported per setting: requests/s, output tokens/s,
images/s (medians over repeats) and the on/off ratio; also the share of steps
that had both vision and language work (the only steps dual streams can help)
and the fraction of wall time the vision and language batches ran.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import machine, model_dir, photo_like, write_json
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

console = Console()


def make_engine(path: str, dual: bool, args):
    from hydrad.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
    from hydrad.engine.core import EngineCore

    config = EngineConfig(
        model=ModelConfig(path=path),
        cache=CacheConfig(kv_cache_memory_mb=args.kv_cache_mb, image_cache_memory_mb=args.image_cache_mb),
        scheduler=SchedulerConfig(token_budget=args.token_budget, image_budget=args.image_budget,
                                  derive_budgets=False),
        parallel=ParallelConfig(dual_streams=dual),
    )
    engine = EngineCore(config, role="EPD", device="cpu")
    engine.steps = {"both": 0, "total": 0, "vision_secs": 0.0, "language_secs": 0.0}
    run = engine.streams.run

    def counting_run(vision, language):
        (v, vision_secs), (lang, language_secs) = run(vision, language)
        engine.steps["total"] += 1
        engine.steps["both"] += vision is not None and language is not None
        engine.steps["vision_secs"] += vision_secs
        engine.steps["language_secs"] += language_secs
        return (v, vision_secs), (lang, language_secs)

    engine.streams.run = counting_run
    return engine


def make_requests(processor, args, prefix: str):
    from hydrad.sampling_params import SamplingParams

    requests = []
    span = args.max_tokens - args.min_tokens
    for i in range(args.num):
        # Output lengths spread evenly over the range, so finishes (and new images) are spread too.
        max_tokens = args.min_tokens + (i * 37 % (span + 1) if span else 0)
        conv = [{"role": "user", "content": [
            {"type": "image", "image": photo_like(224 + 16 * (i % 8), 224 + 16 * (i % 5), i)},
            {"type": "text", "text": "Describe this picture in detail, please."},
        ]}]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        requests.append(processor.make_engine_request(f"{prefix}-{i}", processor.process_chat(conv), params))
    return requests


def run_workload(engine, requests, concurrency: int, progress: Progress, description: str) -> dict:
    """Closed loop: keep ``concurrency`` requests in the engine until all have finished."""
    pending = list(reversed(requests))
    in_flight = 0
    num_tokens = 0
    task = progress.add_task(description, total=len(requests))
    engine.steps.update(both=0, total=0, vision_secs=0.0, language_secs=0.0)
    start = time.perf_counter()
    while pending or in_flight:
        while pending and in_flight < concurrency:
            request = pending.pop()
            request.arrival_time = time.monotonic()
            engine.add_request(request)
            in_flight += 1
        for delta in engine.step():
            num_tokens += len(delta.new_token_ids)
            if delta.finish_reason is not None:
                in_flight -= 1
                progress.advance(task)
    secs = time.perf_counter() - start
    progress.remove_task(task)
    num = len(requests)
    return {"seconds": secs, "requests_per_s": num / secs, "output_tokens_per_s": num_tokens / secs,
            "images_per_s": num / secs, "output_tokens": num_tokens,
            "overlap_steps": engine.steps["both"] / max(1, engine.steps["total"]), "steps": engine.steps["total"],
            "vision_share": engine.steps["vision_secs"] / secs, "language_share": engine.steps["language_secs"] / secs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the built-in default model)")
    parser.add_argument("--num", type=int, default=32, help="requests per run")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight (closed loop)")
    parser.add_argument("--min-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--token-budget", type=int, default=512, help="τ_t, tokens per step")
    parser.add_argument("--image-budget", type=int, default=4, help="τ_e, images per step")
    parser.add_argument("--repeats", type=int, default=2, help="runs per setting (alternating on/off)")
    parser.add_argument("--threads", default="default,1",
                        help="torch intra-op thread counts to try, comma-separated ('default' = torch's own)")
    parser.add_argument("--kv-cache-mb", type=int, default=256)
    parser.add_argument("--image-cache-mb", type=int, default=64)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if not 1 <= args.min_tokens <= args.max_tokens:
        parser.error("need 1 <= --min-tokens <= --max-tokens")

    from hydrad.processor import InputProcessor

    default_threads = torch.get_num_threads()
    thread_counts = [default_threads if t == "default" else int(t) for t in args.threads.split(",")]
    path = model_dir(args.model)
    processor = InputProcessor(path, max_images_per_request=1)
    engines = {dual: make_engine(path, dual, args) for dual in (True, False)}
    warm_args = argparse.Namespace(**{**vars(args), "num": 2, "min_tokens": 4, "max_tokens": 4})

    runs: dict[tuple[int, bool], list[dict]] = {}
    started = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        overall = progress.add_task("all runs", total=len(thread_counts) * args.repeats * 2)
        for threads in thread_counts:
            torch.set_num_threads(threads)
            for dual, engine in engines.items():
                run_workload(engine, make_requests(processor, warm_args, f"warm-{threads}-{dual}"), 2, progress,
                             "warm-up")
            for rep in range(args.repeats):
                order = (True, False) if rep % 2 == 0 else (False, True)
                for dual in order:
                    label = f"{threads} thread(s), dual streams {'on' if dual else 'off'}, run {rep + 1}"
                    requests = make_requests(processor, args, f"t{threads}-{dual}-{rep}")
                    runs.setdefault((threads, dual), []).append(
                        run_workload(engines[dual], requests, args.concurrency, progress, label))
                    progress.advance(overall)
    elapsed = time.perf_counter() - started
    for engine in engines.values():
        engine.shutdown()

    def median(threads: int, dual: bool, key: str) -> float:
        return statistics.median(r[key] for r in runs[(threads, dual)])

    table = Table(title=f"1 EPD instance, {args.num} requests x 1 image, {args.min_tokens}-{args.max_tokens} output "
                        f"tokens, {args.concurrency} in flight, τ_t={args.token_budget} τ_e={args.image_budget}; "
                        f"medians of {args.repeats} runs; model {path}")
    for col in ("torch threads", "dual streams", "requests/s", "output tok/s", "images/s", "steps with both",
                "vision / language busy",
                "runs (output tok/s)", "on / off", "on / off per pair"):
        table.add_column(col, justify="right")
    results = {}
    for threads in thread_counts:
        for dual in (True, False):
            tok = median(threads, dual, "output_tokens_per_s")
            ratio = tok / median(threads, False, "output_tokens_per_s")
            # Runs i of on and off ran back to back: their ratio cancels slow drift in the machine's load.
            pairs = [a["output_tokens_per_s"] / b["output_tokens_per_s"]
                     for a, b in zip(runs[(threads, True)], runs[(threads, False)])]
            results[f"threads={threads},dual={dual}"] = {
                "runs": runs[(threads, dual)],
                **{k: median(threads, dual, k) for k in ("requests_per_s", "output_tokens_per_s", "images_per_s",
                                                         "overlap_steps", "vision_share", "language_share")},
                "on_off_ratio": ratio if dual else None,
                "on_off_pair_ratios": pairs if dual else None,
            }
            table.add_row(
                str(threads), "on" if dual else "off",
                f"{median(threads, dual, 'requests_per_s'):.3f}", f"{tok:.1f}",
                f"{median(threads, dual, 'images_per_s'):.3f}",
                f"{median(threads, dual, 'overlap_steps'):.1%}",
                f"{median(threads, dual, 'vision_share'):.0%} / {median(threads, dual, 'language_share'):.0%}",
                " ".join(f"{r['output_tokens_per_s']:.0f}" for r in runs[(threads, dual)]),
                f"{ratio:.3f}x" if dual else "",
                " ".join(f"{p:.3f}x" for p in pairs) if dual else "",
            )
    console.print(table)
    console.print(f"Every request has one image, so requests/s = images/s. Run took {elapsed:.0f} s.")
    write_json(args.out, {"machine": machine() | {"default_threads": default_threads}, "args": vars(args),
                          "results": results})


if __name__ == "__main__":
    main()
