"""Migration time per request in a live 1E+1P+1D deployment, against a raw cross-process copy.

    python bench/migration.py [--model DIR] [--num 32] [--max-tokens 8] [--concurrency 1,8]

Three worker processes (``cpu:3``) are started by the daemon's own supervisor and
driven through its request table and router, as ``hydrad start`` does, minus HTTP.
Every request carries one image, so it migrates twice: its image features from E
to P, its KV blocks from P to D. Each request's final ``stage_times`` give
``encode_to_prefill_migration`` and ``prefill_to_decode_migration``: from the
stage's end on the source to the target's step that finds the copy finished, so
they include the messaging (offer -> daemon relay -> target), waiting for the
target's current step, its scheduling and its copy thread, not only the copy.
Several requests in flight (``--concurrency``) show how much of that is waiting.

The baseline, in the same run: two spawned processes, the receiver copying exactly
the bytes one request migrates out of the sender's shared-memory pool into its own,
with the same block layout (``index_copy_`` of ``index_select``, as the engine does),
and as one contiguous ``copy_`` of the same size.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import time

import torch
from common import machine, model_dir, photo_like, write_json
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

console = Console()

EDGES = (("image", "encode_to_prefill_migration", "E->P image"),
         ("kv", "prefill_to_decode_migration", "P->D KV"))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def summary(values: list[float]) -> dict:
    return {"n": len(values), "p50": percentile(values, 50), "p95": percentile(values, 95),
            "mean": statistics.fmean(values)}


# -- the live deployment ------------------------------------------------------------------------
def make_config(path: str, kv_mb: int, image_mb: int):
    from hydrad.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig

    return EngineConfig(
        model=ModelConfig(path=path),
        cache=CacheConfig(kv_cache_memory_mb=kv_mb, image_cache_memory_mb=image_mb),
        scheduler=SchedulerConfig(derive_budgets=False),
        parallel=ParallelConfig(deploy="1E+1P+1D", devices="cpu:3"),
    )


def make_requests(processor, num: int, max_tokens: int, image_size: int, prefix: str):
    from hydrad.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    requests = []
    for i in range(num):
        conv = [{"role": "user", "content": [{"type": "image", "image": photo_like(image_size, image_size, i)},
                                             {"type": "text", "text": "What is shown here?"}]}]
        request = processor.make_engine_request(f"{prefix}-{i}", processor.process_chat(conv), params)
        for image in request.images:
            image.pixel_values.share_memory_()
        requests.append(request)
    return requests


async def run_one(router, request) -> dict:
    instance = router.select(has_images=True)
    request.arrival_time = time.monotonic()
    queue = instance.add_request(request)
    while True:
        delta = await queue.get()
        if isinstance(delta, Exception):
            raise delta
        if delta.finish_reason is not None:
            if delta.finish_reason != "length":
                raise RuntimeError(f"request {request.req_id} finished with {delta.finish_reason}")
            return delta.stage_times


async def run_deployment(args, config, processor, progress: Progress) -> dict[int, list[dict]]:
    """Stage times of every measured request, per concurrency level."""
    from hydrad.cluster.deploy import plan_instances
    from hydrad.cluster.router import Router
    from hydrad.cluster.launch import plan_specs
    from hydrad.cluster.supervisor import Supervisor

    specs = plan_specs(plan_instances("1E+1P+1D", "cpu:3", 0))
    supervisor = Supervisor(config, specs)
    await supervisor.start(console)
    try:
        router = Router(supervisor.clients, "round-robin", seed=0)
        supervisor.table.router = router
        warm = make_requests(processor, 2, args.max_tokens, args.image_size, "warmup")
        await asyncio.gather(*(run_one(router, r) for r in warm))
        results = {}
        for concurrency in args.concurrency:
            requests = make_requests(processor, args.num, args.max_tokens, args.image_size, f"c{concurrency}")
            task = progress.add_task(f"1E+1P+1D, concurrency {concurrency}", total=len(requests))
            gate = asyncio.Semaphore(concurrency)

            async def gated(request):
                async with gate:
                    times = await run_one(router, request)
                progress.advance(task)
                return times

            results[concurrency] = await asyncio.gather(*(gated(r) for r in requests))
        return results
    finally:
        await supervisor.stop()


# -- the raw copy baseline ----------------------------------------------------------------------
def copy_receiver(conn, jobs: dict, repeats: int) -> None:
    """Spawned child: time copies out of the parent's shared pools into its own.

    Each repeat copies other blocks (other bytes, for the contiguous copy) of a pool as
    large as the engine's, so the source is not cache-warm from the previous repeat,
    as in a real migration."""
    torch.set_num_threads(1)  # as each of the three CPU workers on this machine
    gen = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {}
    with torch.inference_mode():
        for kind, (src_pool, dim, num_blocks, nbytes) in jobs.items():
            dst_pool = torch.zeros_like(src_pool).share_memory_()
            src_flat = src_pool.view(-1)
            numel = nbytes // src_pool.element_size()
            dst_flat = torch.zeros(numel, dtype=src_pool.dtype).share_memory_()
            num_pool_blocks, num_slices = src_pool.shape[dim], src_flat.numel() // numel
            layouts = []
            for _ in range(repeats + 5):
                order = torch.randperm(num_pool_blocks, generator=gen)
                layouts.append((order[:num_blocks], torch.randperm(num_pool_blocks, generator=gen)[:num_blocks]))

            def blocks(i: int) -> None:
                src, dst = layouts[i]
                dst_pool.index_copy_(dim, dst, src_pool.index_select(dim, src))

            def contiguous(i: int) -> None:
                start = (i * 7919 % num_slices) * numel
                dst_flat.copy_(src_flat[start:start + numel])

            for name, op in ((f"{kind}/blocks", blocks), (f"{kind}/contiguous", contiguous)):
                for i in range(5):
                    op(i)
                samples = []
                for i in range(5, repeats + 5):
                    start = time.perf_counter()
                    op(i)
                    samples.append(time.perf_counter() - start)
                times[name] = samples
    conn.send(times)
    conn.close()


def raw_copy(shapes: dict, repeats: int) -> dict[str, list[float]]:
    import torch.multiprocessing as mp

    gen = torch.Generator().manual_seed(0)
    jobs = {kind: (torch.randn(pool_shape, generator=gen).share_memory_(), dim, num_blocks, nbytes)
            for kind, (pool_shape, dim, num_blocks, nbytes) in shapes.items()}
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=copy_receiver, args=(child, jobs, repeats), name="copy-receiver")
    process.start()
    child.close()
    times = parent.recv()  # the sender keeps its shared pools alive until here
    process.join()
    return times


def edge_shapes(path: str, config, num_prompt_tokens: int, num_image_tokens: int) -> dict:
    """Pool shape, block dim, blocks per request and bytes per request of each edge, as the
    engine lays them out (float32 on CPU)."""
    from hydrad.engine.core import _num_blocks
    from hydrad.models.attention import SDPA_BLOCK_SIZE
    from hydrad.models.llama import head_dim_of
    from hydrad.models.loader import load_config

    text = load_config(path).text_config
    cache = config.cache
    bs = cache.kv_block_size or SDPA_BLOCK_SIZE  # the bench runs on CPU: SDPA
    kv_block = (text.num_hidden_layers, 2, 1, bs, text.num_key_value_heads, head_dim_of(text))
    kv_block_bytes = math.prod(kv_block) * 4
    num_kv = _num_blocks(None, cache.kv_cache_memory_mb, kv_block_bytes)  # P holds both caches
    kv_blocks = math.ceil(num_prompt_tokens / bs)
    image_block_bytes = num_image_tokens * text.hidden_size * 4  # one block = one image's tokens
    num_img = _num_blocks(None, cache.image_cache_memory_mb + cache.kv_cache_memory_mb, image_block_bytes)
    return {
        "image": ((num_img, num_image_tokens, text.hidden_size), 0, 1, image_block_bytes),
        "kv": (kv_block[:2] + (num_kv,) + kv_block[3:], 2, kv_blocks, kv_blocks * kv_block_bytes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the built-in default model)")
    parser.add_argument("--num", type=int, default=32, help="measured requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", default="1,8",
                        help="comma-separated numbers of requests in flight (closed loop)")
    parser.add_argument("--image-size", type=int, default=336, help="edge of the synthetic square images")
    parser.add_argument("--repeats", type=int, default=200, help="raw copies timed per layout")
    parser.add_argument("--kv-cache-mb", type=int, default=64)
    parser.add_argument("--image-cache-mb", type=int, default=32)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    os.environ.setdefault("HYDRAD_LOG_LEVEL", "WARNING")  # workers: keep the progress display readable

    from hydrad.processor import InputProcessor

    path = model_dir(args.model)
    config = make_config(path, args.kv_cache_mb, args.image_cache_mb)
    processor = InputProcessor(path, max_images_per_request=1)
    probe = make_requests(processor, 1, args.max_tokens, args.image_size, "probe")[0]
    num_prompt, num_image_tokens = probe.num_prompt_tokens, probe.images[0].length
    shapes = edge_shapes(path, config, num_prompt, num_image_tokens)

    started = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        stage_times = asyncio.run(run_deployment(args, config, processor, progress))
        task = progress.add_task("raw cross-process copy (2 processes)", total=1)
        raw = raw_copy(shapes, args.repeats)
        progress.advance(task)
    elapsed = time.perf_counter() - started

    results = {"raw": {name: summary(v) for name, v in raw.items()}, "migration": {}}
    table = Table(title=f"1E+1P+1D on cpu:3, {args.num} requests per level, 1 image ({num_image_tokens} image "
                        f"tokens), {num_prompt} prompt tokens, {args.max_tokens} output tokens; model {path}")
    for col in ("edge", "bytes/req", "in flight", "migration p50/p95 ms", "raw blocks p50/p95 ms",
                "raw contig. p50/p95 ms", "ratio p50/p95"):
        table.add_column(col, justify="right" if col != "edge" else "left")
    for kind, key, label in EDGES:
        blocks, contiguous = results["raw"][f"{kind}/blocks"], results["raw"][f"{kind}/contiguous"]
        nbytes = shapes[kind][3]
        for concurrency, times in stage_times.items():
            m = summary([t[key] for t in times])
            results["migration"][f"{kind}/c{concurrency}"] = m | {"bytes": nbytes}
            table.add_row(
                label, f"{nbytes:,}", str(concurrency),
                f"{m['p50'] * 1e3:.2f} / {m['p95'] * 1e3:.2f}",
                f"{blocks['p50'] * 1e3:.3f} / {blocks['p95'] * 1e3:.3f}",
                f"{contiguous['p50'] * 1e3:.3f} / {contiguous['p95'] * 1e3:.3f}",
                f"{m['p50'] / blocks['p50']:.0f}x / {m['p95'] / blocks['p95']:.0f}x",
            )
    console.print(table)
    console.print("Migration = stage end on the source -> the target's step that finds the copy done: messaging, "
                  "relay, waiting for the target's step, its scheduling and copy thread included. Raw = the copy "
                  "alone, ratio = migration / raw blocks; "
                  f"{args.repeats} repeats in a second process. Run took {elapsed:.0f} s.")
    write_json(args.out, {"machine": machine(), "args": vars(args), "num_prompt_tokens": num_prompt,
                          "num_image_tokens": num_image_tokens, "results": results,
                          "stage_times": {str(c): t for c, t in stage_times.items()}})


if __name__ == "__main__":
    main()
