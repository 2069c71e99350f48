"""Latency of small requests while large ones are processed, and the daemon's memory.

    python bench/request_isolation.py [--repo DIR] [--model DIR] [--config FILE] [--out results.json]

Starts ``hydrad start --devices cpu:1`` from ``--repo`` (default: this checkout, so an
older checkout can be measured with the same script) on the tiny LLaVA checkpoint
(built offline unless ``--model`` is given). Each scenario sends its large requests
at once and, while they are in flight, one small request after another (a text
"hi", 4 greedy tokens, whole): the small requests' latency is what a user of a
shared daemon sees while someone else sends large inputs. The scenarios:

* ``idle``: small requests only (the baseline);
* ``prompt-20mb``: one chat request with a 20 MB text prompt;
* ``prompts-3mb``: four chat requests with a 3 MB prompt each;
* ``images-8x6000``: four chat requests with eight 6000x6000 PNGs each;
* ``images-2x6000``: four chat requests with two 6000x6000 PNGs each (within the
  default pixel limits, so they are decoded and preprocessed).

The daemon's resident memory (``VmRSS`` of the daemon process, workers not
included) is sampled every 50 ms: its peak during the scenario, and what is left
2 s after the last request.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image
from rich.console import Console
from rich.table import Table

from common import machine, write_json

console = Console(width=150)
HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Daemon:
    def __init__(self, repo: Path, model: str, config: str | None, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "hydrad", "start", "--model", model, "--devices", "cpu:1",
                "--host", "127.0.0.1", "--port", str(self.port)]
        if config:
            args += ["--config", config]
        env = {**os.environ, "PYTHONPATH": str(repo)}
        self.log = log
        self.process = subprocess.Popen(args, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, cwd=repo)

    async def wait_ready(self, session, timeout: float = 180.0) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"hydrad exited:\n{self.log.read_text()}")
            try:
                async with session.get(self.url + "/health") as r:
                    if r.status == 200:
                        return time.monotonic() - start
            except OSError:
                pass
            await asyncio.sleep(0.2)
        raise RuntimeError(f"hydrad not ready after {timeout} s")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def chat_body(content, max_tokens: int = 4) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                       "temperature": 0}).encode()


def big_png(size: int) -> bytes:
    """A size x size PNG of flat colour blocks: few bytes on the wire, all its pixels once decoded."""
    y, x = np.mgrid[0:size, 0:size]
    pixels = np.stack([x // 250 * 10 % 256, y // 250 * 10 % 256, (x + y) // 500 * 10 % 256], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def scenarios() -> dict[str, list[bytes]]:
    words = "the quick brown fox jumps over the lazy dog "
    png = "data:image/png;base64," + base64.b64encode(big_png(6000)).decode()
    images = [{"type": "image_url", "image_url": {"url": png}} for _ in range(8)]
    return {
        "idle": [],
        "prompt-20mb": [chat_body((words * (20_000_000 // len(words) + 1))[:20_000_000])],
        "prompts-3mb": [chat_body((words * (3_000_000 // len(words) + 1))[:3_000_000]) for _ in range(4)],
        "images-8x6000": [chat_body(images + [{"type": "text", "text": "describe"}]) for _ in range(4)],
        # Within the per-request pixel limit (72 Mpx each): these are decoded and preprocessed.
        "images-2x6000": [chat_body(images[:2] + [{"type": "text", "text": "describe"}]) for _ in range(4)],
    }


async def post(session, url: str, body: bytes) -> tuple[int, float, str]:
    start = time.monotonic()
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        text = await r.text()
    return r.status, time.monotonic() - start, text


async def run_scenario(session, daemon: Daemon, large: list[bytes], num_small: int) -> dict:
    url = daemon.url + "/v1/chat/completions"
    small_body = chat_body("hi")
    samples: list[float] = []
    done = asyncio.Event()

    async def sample_rss():
        while not done.is_set():
            samples.append(rss_mb(daemon.process.pid))
            await asyncio.sleep(0.05)

    sampler = asyncio.ensure_future(sample_rss())
    rss_before = rss_mb(daemon.process.pid)
    large_tasks = [asyncio.ensure_future(post(session, url, body)) for body in large]
    await asyncio.sleep(0.2)  # the large bodies are on their way
    small = []
    # Small requests one after another until the large ones are answered (and at least num_small).
    while len(small) < num_small or not all(t.done() for t in large_tasks):
        status, seconds, text = await post(session, url, small_body)
        if status != 200:
            raise RuntimeError(f"a small request failed: {status} {text[:200]}")
        small.append(seconds)
        await asyncio.sleep(0.1)
    large_results = [t.result() for t in large_tasks]
    await asyncio.sleep(2.0)
    done.set()
    await sampler
    return {
        "small": {"n": len(small), "p50": statistics.median(small), "max": max(small),
                  "p95": sorted(small)[max(0, int(0.95 * len(small)) - 1)]},
        "large": [{"status": s, "seconds": t, "body_mb": len(b) / 1e6,
                   "error": json.loads(x)["error"]["message"] if s != 200 else None}
                  for (s, t, x), b in zip(large_results, large)],
        "rss_mb": {"before": rss_before, "peak": max(samples), "after": samples[-1]},
    }


async def main_async(args) -> dict:
    import aiohttp

    model = args.model
    if model is None:
        sys.path.insert(0, str(HERE.parent))
        from hydrad.models.builder import build_model

        model = str(build_model(Path(tempfile.mkdtemp()) / "llava-tiny", "llava", "tiny", 0, progress=False))
    console.print("building the request bodies ...")
    bodies = scenarios()
    log = Path(tempfile.mkdtemp()) / "hydrad.log"
    daemon = Daemon(Path(args.repo).resolve(), model, args.config, log)
    results = {}
    try:
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            ready = await daemon.wait_ready(session)
            console.print(f"daemon healthy after {ready:.1f} s (log: {log})")
            for _ in range(3):  # warm-up
                await post(session, daemon.url + "/v1/chat/completions", chat_body("hi"))
            for name, large in bodies.items():
                if args.only and name not in args.only:
                    continue
                console.print(f"scenario {name} ...")
                results[name] = await run_scenario(session, daemon, large, args.num_small)
    finally:
        daemon.stop()
    return {"machine": machine(), "repo": str(Path(args.repo).resolve()), "config": args.config,
            "scenarios": results}


def show(payload: dict) -> None:
    table = Table(title="small requests while large ones are in flight (cpu:1, tiny LLaVA)")
    for column in ("scenario", "small n", "small p50 s", "small p95 s", "small max s", "large: status, s",
                   "RSS before / peak / after MB"):
        table.add_column(column, justify="left" if column in ("scenario", "large: status, s") else "right")
    for name, r in payload["scenarios"].items():
        large = ", ".join(f"{x['status']} {x['seconds']:.1f}" for x in r["large"]) or "-"
        rss = r["rss_mb"]
        table.add_row(name, str(r["small"]["n"]), f"{r['small']['p50']:.3f}", f"{r['small']['p95']:.3f}",
                      f"{r['small']['max']:.3f}", large,
                      f"{rss['before']:.0f} / {rss['peak']:.0f} / {rss['after']:.0f}")
    console.print(table)
    for name, r in payload["scenarios"].items():
        for x in r["large"]:
            if x["error"]:
                console.print(f"{name}: {x['status']}: {x['error']}")
                break


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", default=str(HERE.parent), help="checkout whose hydrad is started")
    parser.add_argument("--model", help="checkpoint folder (default: the tiny LLaVA, built offline)")
    parser.add_argument("--config", help="hydrad.toml for the daemon")
    parser.add_argument("--num-small", type=int, default=20, help="small requests per scenario, at least")
    parser.add_argument("--only", nargs="*", help="scenarios to run (default: all)")
    parser.add_argument("--out", help="write the results as JSON")
    args = parser.parse_args()
    payload = asyncio.run(main_async(args))
    show(payload)
    write_json(args.out, payload)


if __name__ == "__main__":
    main()
