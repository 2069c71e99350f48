"""Threads or processes for the Request Processor: how much of its work holds the GIL.

    python bench/processor_pool.py [--model DIR] [--out results.json]

Three measurements on the tiny LLaVA checkpoint (built offline unless ``--model``):

* each step of processing a request run in a thread while the main thread, standing in
  for the daemon's event loop, wakes every millisecond: the step's time and the longest
  the main thread waited for the GIL (``gap``);
* a batch of requests processed one after another, then by 2 threads (one HF processor
  each, no lock) and by 2 spawned processes (``ProcessPoolExecutor``, one processor
  each; prompts come back pickled): the speedup over one thread;
* the process pool's own costs: starting its processes, and the round trip of a small
  request (a thread's is a few microseconds more than the work).
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from PIL import Image
from rich.console import Console
from rich.table import Table

from common import machine, write_json

console = Console(width=120)
HERE = Path(__file__).resolve().parent
_processor = None


def png_url(size: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size]
    pixels = np.stack([x * 255 // size, y * 255 // size, (x + y) * 127 // size], -1).astype(np.uint8)
    pixels[rng.integers(0, size, 2000), rng.integers(0, size, 2000)] = 255  # not all smooth
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def with_gap(fn) -> tuple[float, float]:
    """(seconds fn took in a thread, the main thread's longest wait between 1 ms wakeups)."""
    done = threading.Event()
    took = []

    def run():
        start = time.perf_counter()
        fn()
        took.append(time.perf_counter() - start)
        done.set()

    thread = threading.Thread(target=run)
    last = time.perf_counter()
    thread.start()
    gap = 0.0
    while not done.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        gap, last = max(gap, now - last), now
    thread.join()
    return took[0], gap


def init_worker(model: str) -> None:
    global _processor
    sys.path.insert(0, str(HERE.parent))
    from hydrad.processor import InputProcessor

    _processor = InputProcessor(model, max_images_per_request=8, max_image_pixels=40_000_000)


def process_in_worker(messages):
    return _processor.process_chat(messages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder (default: the tiny LLaVA, built offline)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE.parent))
    from hydrad.images import decode_data_url
    from hydrad.models.builder import build_model
    from hydrad.processor import InputProcessor

    model = args.model or str(build_model(Path(tempfile.mkdtemp()) / "llava-tiny", "llava", "tiny", 0,
                                          progress=False))
    processor = InputProcessor(model, max_images_per_request=8, max_image_pixels=40_000_000)
    processor.add_instances(1)
    big = png_url(6000, 0)
    image = decode_data_url(big, max_pixels=40_000_000)
    text = ("the quick brown fox jumps over the lazy dog " * 25_000)[:1_000_000]
    steps = {
        "tokenizer (transformers call), 1 MB of text": lambda: processor.tokenizer(text),
        "PNG decode, 6000x6000": lambda: decode_data_url(big, max_pixels=40_000_000),
        "image processor, one 6000x6000 image": lambda: processor.processor.image_processor(images=[image]),
        "whole request: 1 MB prompt": lambda: processor.process_prompt(text),
    }
    gil = {}
    for name, fn in steps.items():
        runs = [with_gap(fn) for _ in range(args.repeats)]
        gil[name] = {"seconds": statistics.median(r[0] for r in runs), "gap_ms": 1000 * max(r[1] for r in runs)}

    requests = [[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url(2000, i)}}] * 2
                  + [{"type": "text", "text": f"picture {i}"}]}] for i in range(4)]
    requests += [[{"role": "user", "content": f"text {i} " + "lorem ipsum dolor " * 700}] for i in range(4)]
    for r in requests:  # warm
        processor.process_chat(r)
    scaling = {}
    start = time.perf_counter()
    for r in requests:
        processor.process_chat(r)
    scaling["1 thread"] = time.perf_counter() - start
    with ThreadPoolExecutor(2) as pool:
        start = time.perf_counter()
        list(pool.map(processor.process_chat, requests))
        scaling["2 threads"] = time.perf_counter() - start
    start = time.perf_counter()
    with ProcessPoolExecutor(2, mp_context=get_context("spawn"), initializer=init_worker,
                             initargs=(model,)) as pool:
        list(pool.map(process_in_worker, [[{"role": "user", "content": "warm"}]] * 2))
        startup = time.perf_counter() - start
        start = time.perf_counter()
        list(pool.map(process_in_worker, requests))
        scaling["2 processes"] = time.perf_counter() - start
        small = [{"role": "user", "content": "hi"}]
        trips = []
        for _ in range(50):
            t = time.perf_counter()
            pool.submit(process_in_worker, small).result()
            trips.append(time.perf_counter() - t)
    with ThreadPoolExecutor(1) as pool:
        thread_trips = []
        for _ in range(50):
            t = time.perf_counter()
            pool.submit(processor.process_chat, small).result()
            thread_trips.append(time.perf_counter() - t)
    costs = {"process pool start (2 processes, until each has a processor) s": startup,
             "small request round trip, process pool ms": 1000 * statistics.median(trips),
             "small request round trip, thread pool ms": 1000 * statistics.median(thread_trips)}

    table = Table(title="a step in a thread: its time, and the longest the main thread waited")
    table.add_column("step")
    table.add_column("s", justify="right")
    table.add_column("main thread's longest wait, ms", justify="right")
    for name, r in gil.items():
        table.add_row(name, f"{r['seconds']:.2f}", f"{r['gap_ms']:.0f}")
    console.print(table)
    table = Table(title=f"{len(requests)} requests (4 with two 2000x2000 PNGs, 4 with 12 kB of text)")
    table.add_column("pool")
    table.add_column("s", justify="right")
    table.add_column("speedup", justify="right")
    for name, seconds in scaling.items():
        table.add_row(name, f"{seconds:.2f}", f"{scaling['1 thread'] / seconds:.2f}x")
    console.print(table)
    for name, value in costs.items():
        console.print(f"{name}: {value:.2f}")
    write_json(args.out, {"machine": machine(), "gil": gil, "scaling_seconds": scaling, "costs": costs})


if __name__ == "__main__":
    main()
