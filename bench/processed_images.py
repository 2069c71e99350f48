"""The Request Processor's CPU for a chat turn that resends its image, with and without the
cache of preprocessed images (``server.processed_image_cache_mb``).

    python bench/processed_images.py [--model DIR] [--turns 50] [--out results.json]

A three-turn conversation about one 640x480 JPEG (a photograph-like picture, as the
``vs_vllm.py`` chat scenario sends), sent as a data URL: every turn resends the image. Each
setting processes the same turn ``--turns`` times in this thread (after a few unmeasured
ones) and reports the median CPU time of one turn (``thread_time``: the daemon's processing
thread's own, as the request trace records it). With the cache, every turn after the first
finds the image; without it, each decodes and processes it again. Then the share of the
turn each part takes without the cache (the image's decode and processing against the
rest: headers, chat template, tokenizer).
"""

from __future__ import annotations

import argparse
import base64
import io
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, median_seconds, model_dir, photo_like, write_json  # noqa: E402

console = Console(width=120)


def turn(url: str) -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": "What is shown in this picture?"}]},
        {"role": "assistant", "content": "A garden with a path and a bench."},
        {"role": "user", "content": "What colour is the bench?"},
        {"role": "assistant", "content": "It is green."},
        {"role": "user", "content": "Is anyone sitting on it?"},
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint folder (default: the built-in default model)")
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--out")
    args = parser.parse_args()

    from hydrad.processor import InputProcessor

    path = model_dir(args.model)
    buffer = io.BytesIO()
    photo_like(640, 480, seed=7).save(buffer, "JPEG", quality=90)
    url = "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages = turn(url)
    results = {}
    with console.status("loading the processors"):
        processors = {"without the cache": InputProcessor(path),
                      "with the cache": InputProcessor(path, processed_image_cache_bytes=512 << 20)}
    for name, processor in processors.items():
        with console.status(f"{name}: {args.turns} turns"):
            results[name] = median_seconds(lambda: processor.process_chat(messages), args.turns, warmup=3,
                                           clock=time.thread_time)
    text_only = [{**m, "content": [p for p in m["content"] if p["type"] == "text"]} if isinstance(m["content"], list)
                 else m for m in messages]
    with console.status("the turn without its image"):
        results["the same turn without its image"] = median_seconds(
            lambda: processors["without the cache"].process_chat(text_only), args.turns, warmup=3,
            clock=time.thread_time)

    table = Table(title=f"one chat turn's processing, {Path(path).name}, {len(buffer.getvalue()) // 1024} KiB JPEG")
    table.add_column("setting")
    table.add_column("CPU ms per turn", justify="right")
    table.add_column("÷ without the cache", justify="right")
    base = results["without the cache"]
    for name, seconds in results.items():
        table.add_row(name, f"{seconds * 1e3:.2f}", f"{seconds / base:.2f}")
    console.print(table)
    found = processors["with the cache"].processed_images
    console.print(f"with the cache: {found.num_found} lookups found, {found.num_missed} not")
    write_json(args.out, {"machine": machine(), "model": path, "turns": args.turns, "jpeg_bytes": len(buffer.getvalue()),
                          "cpu_seconds_per_turn": results})


if __name__ == "__main__":
    main()
