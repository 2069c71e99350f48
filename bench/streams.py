"""Many concurrent streams through a live daemon: output tokens/s, the daemon's own CPU per
streamed token, and inter-token gaps, at several concurrency levels.

A daemon is started on the given model with a loose SLO (so that no step bound binds)
and driven closed-loop: each of C clients sends a streamed chat request with a ~20-token
text prompt and ``--max-tokens`` output tokens (ignore_eos), then the next, for
``--duration`` seconds after a warm-up at full concurrency. Half the requests are greedy,
half sampled at the API's defaults. The daemon's CPU time is read from /proc for the
daemon process alone (its workers are other processes) and divided by the tokens
streamed while measuring; so is the load generator's, to show the client was not the
bottleneck.

    python bench/streams.py --concurrency 64 256 1024 --frontend-processes 1 2 --out streams.json

``--api chat responses`` measures the chat route and OpenAI's Responses API
(``/v1/responses``: the same requests as ``input``, a token per
``response.output_text.delta`` event; each response kept, as OpenAI's default ``store``)
in turn on each daemon; ``responses-unkept`` sends ``store`` false, and
``responses-chained`` continues each client's previous response
(``previous_response_id``) for ``CHAIN_TURNS`` turns, then starts a new conversation;
``responses-background`` creates each response in the background (``background`` true, not
streamed) and polls it every ``POLL_SECONDS`` until it ends, its tokens counted from its
usage once it has (no inter-token gaps: what it costs the daemon is the polls);
``responses-background-stream`` creates each one in the background with ``stream`` true
and reads its events as ``responses`` does (what it costs the daemon: the events kept in
the process that runs it and handed to the store);
``--repo DIR`` measures another checkout's daemon (the same client and model);
``--profile FILE`` samples the daemon with py-spy while measuring.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from common import machine, write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "server"))
from daemon_process import Daemon  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_times(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of one process (not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def cpu_seconds(pid: int) -> float:
    return sum(cpu_times(pid))


# Per API: its route, its request body, and the start of a line that carries one token.
_RESPONSE_TOKEN = b'data: {"type":"response.output_text.delta"'
APIS = {
    "chat": ("/v1/chat/completions", lambda text, max_tokens: {
        "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}, b"data: {"),
    "responses": ("/v1/responses", lambda text, max_tokens: {"input": text, "max_output_tokens": max_tokens},
                  _RESPONSE_TOKEN),
    "responses-unkept": ("/v1/responses", lambda text, max_tokens: {
        "input": text, "max_output_tokens": max_tokens, "store": False}, _RESPONSE_TOKEN),
    "responses-chained": ("/v1/responses", lambda text, max_tokens: {
        "input": text, "max_output_tokens": max_tokens}, _RESPONSE_TOKEN),
    "responses-background": ("/v1/responses", lambda text, max_tokens: {
        "input": text, "max_output_tokens": max_tokens, "background": True}, None),
    "responses-background-stream": ("/v1/responses", lambda text, max_tokens: {
        "input": text, "max_output_tokens": max_tokens, "background": True}, _RESPONSE_TOKEN),
}
# ``responses-background``: how often each client asks whether its response has ended.
POLL_SECONDS = 0.1
# ``responses-chained``: turns of one conversation before a client starts another.
CHAIN_TURNS = 4
_CREATED = b'data: {"type":"response.created"'


async def run_level(url: str, concurrency: int, max_tokens: int, warmup: float, duration: float,
                    api: str = "chat") -> dict:
    import aiohttp

    tokens_measured, gaps, requests_done, errors = 0, [], 0, 0
    route, make_body, token_line = APIS[api]
    measuring = asyncio.Event()
    stop = asyncio.Event()

    async def background(session, body: dict) -> dict | None:
        """Create a background response and poll it until it ends (or the run does); None: refused."""
        async with session.post(url + route, json=body) as response:
            if response.status != 200:
                return None
            polled = await response.json()
        while polled["status"] in ("queued", "in_progress") and not stop.is_set():
            await asyncio.sleep(POLL_SECONDS)
            async with session.get(f"{url}{route}/{polled['id']}") as response:
                polled = await response.json()
        return polled

    async def client(k: int) -> None:
        nonlocal tokens_measured, requests_done, errors
        i, previous, turns = k, None, 0
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            while not stop.is_set():
                body = {**make_body(f"Request {i}: tell me about the number {i}.", max_tokens), "ignore_eos": True,
                        "stream": token_line is not None, **({"temperature": 0} if i % 2 else {})}
                if previous is not None:
                    body["previous_response_id"] = previous
                last = None
                try:
                    if token_line is None:  # a background response, polled until it ends
                        polled = await background(session, body)
                        if polled is None or polled["status"] not in ("incomplete", "completed", "queued",
                                                                        "in_progress"):
                            errors += 1
                        elif measuring.is_set() and not stop.is_set() and polled.get("usage"):
                            tokens_measured += polled["usage"]["output_tokens"]
                            requests_done += 1
                        i += concurrency
                        continue
                    async with session.post(url + route, json=body) as response:
                        if response.status != 200:
                            errors += 1
                            previous = None
                            i += concurrency
                            continue
                        async for line in response.content:
                            if not line.startswith(token_line):
                                if api == "responses-chained" and line.startswith(_CREATED):
                                    turns += 1
                                    previous = json.loads(line[6:])["response"]["id"] if turns < CHAIN_TURNS else None
                                    turns %= CHAIN_TURNS
                                continue
                            now = time.perf_counter()
                            if measuring.is_set() and not stop.is_set():
                                tokens_measured += 1
                                if last is not None:
                                    gaps.append(now - last)
                            last = now
                    requests_done += measuring.is_set()
                except aiohttp.ClientError:
                    errors += 1
                i += concurrency

    tasks = [asyncio.ensure_future(client(k)) for k in range(concurrency)]
    await asyncio.sleep(warmup)
    measuring.set()
    start = time.perf_counter()
    await asyncio.sleep(duration)
    elapsed = time.perf_counter() - start
    stop.set()
    await asyncio.gather(*tasks)
    gaps.sort()
    return {"tokens": tokens_measured, "seconds": elapsed, "requests": requests_done, "errors": errors,
            "output_tokens_per_s": tokens_measured / elapsed,
            "itl_p50_ms": 1e3 * gaps[len(gaps) // 2] if gaps else None,
            "itl_p99_ms": 1e3 * gaps[int(len(gaps) * 0.99)] if gaps else None}


def frontend_pids(daemon: Daemon, count: int) -> list[int]:
    """The daemon process and its ``count - 1`` front-end processes (not the workers), as
    ``/admin/status`` lists them (a daemon without front-end processes lists none)."""
    import urllib.request

    deadline = time.monotonic() + 30
    while True:
        with urllib.request.urlopen(daemon.url + "/admin/status", timeout=10) as response:
            status = json.loads(response.read())
        pids = [p["pid"] for p in (status.get("frontend") or {}).get("processes") or [] if p.get("pid")]
        if len(pids or [daemon.process.pid]) == count or time.monotonic() > deadline:
            return pids or [daemon.process.pid]
        time.sleep(0.5)


def profile_summary(path: Path, top: int = 25) -> list[tuple[str, float]]:
    """py-spy's collapsed stacks -> (function, share of samples it was on the stack), for the
    functions of hydrad, aiohttp, asyncio, json and the tokenizer that cost the most."""
    total, inclusive = 0, {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        seen = set()
        for frame in stack.split(";"):
            name = frame.split(" (")[0] + " (" + frame.split(" (")[-1].split(":")[0].rsplit("/", 1)[-1] + ")" \
                if " (" in frame else frame
            if name not in seen:
                seen.add(name)
                inclusive[name] = inclusive.get(name, 0) + n
    ranked = sorted(inclusive.items(), key=lambda kv: -kv[1])
    return [(name, n / total) for name, n in ranked[:top]] if total else []


def measure(daemon: Daemon, concurrency: int, frontends: int, args, api: str = "chat") -> dict:
    pids = frontend_pids(daemon, frontends)
    me = os.getpid()

    async def main():
        # CPU is read at the start and end of the measured window only.
        task = asyncio.ensure_future(run_level(daemon.url, concurrency, args.max_tokens, args.warmup, args.duration,
                                               api))
        await asyncio.sleep(args.warmup)
        spy = None
        if args.profile:
            # Sampling the daemon alone (py-spy runs outside it) at 100 Hz for the window.
            out = Path(args.profile).with_suffix(f".{concurrency}.txt")
            spy = await asyncio.create_subprocess_exec(
                "py-spy", "record", "--pid", str(pids[0]), "--duration", str(int(args.duration)), "--rate", "100",
                "--format", "raw", "--nonblocking", "--output", str(out),
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        times0, own0 = [cpu_times(p) for p in pids], cpu_seconds(me)
        await asyncio.sleep(args.duration)
        times1, own1 = [cpu_times(p) for p in pids], cpu_seconds(me)
        each0, each1 = [sum(t) for t in times0], [sum(t) for t in times1]
        cpu0, cpu1 = sum(each0), sum(each1)
        result = await task
        if spy is not None:
            await spy.wait()
            result["profile"] = [[name, round(share, 4)] for name, share in profile_summary(out)]
        result["daemon_cpu_us_per_token"] = 1e6 * (cpu1 - cpu0) / max(1, result["tokens"])
        # The kernel's share (system time: the sockets' send and receive paths, which on
        # loopback include the receiving side's TCP processing) against the process's own code.
        result["daemon_sys_us_per_token"] = 1e6 * sum(b[1] - a[1] for a, b in zip(times0, times1)) \
            / max(1, result["tokens"])
        # Per process (the daemon first, then its front-end processes), over all the tokens.
        result["process_cpu_us_per_token"] = [round(1e6 * (b - a) / max(1, result["tokens"]), 1)
                                              for a, b in zip(each0, each1)]
        result["client_cpu_us_per_token"] = 1e6 * (own1 - own0) / max(1, result["tokens"])
        return result

    return asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: a tiny checkpoint built here)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--api", nargs="+", choices=list(APIS), default=["chat"],
                        help="the routes to drive, each in turn on every daemon")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]),
                        help="checkout whose hydrad is started (to measure an older one)")
    parser.add_argument("--frontend-processes", type=int, nargs="+", default=[1],
                        help="[server] frontend_processes values to measure (each a daemon of its own)")
    parser.add_argument("--profile", help="sample the daemon with py-spy; collapsed stacks go to "
                        "PROFILE.<concurrency>.txt and the top functions into the results")
    parser.add_argument("--out")
    args = parser.parse_args()
    from hydrad.models.builder import build_model

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(build_model(Path(tmp) / "tiny", "llava", "tiny", 0, progress=False))
        for frontends in args.frontend_processes:
            config = Path(tmp) / "hydrad.toml"
            config.write_text("[slo]\nttft = 60\ntbt = 5\n[scheduler]\nmax_num_seqs = 1024\n"
                              + (f"[server]\nfrontend_processes = {frontends}\n" if frontends > 1 else ""))
            daemon = Daemon(["--model", model, "--config", str(config), "--devices", "cpu:1"],
                            Path(tmp) / "hydrad.log", repo=Path(args.repo))
            try:
                for concurrency, api in ((c, a) for c in args.concurrency for a in args.api):
                    row = {"frontend_processes": frontends, "concurrency": concurrency, "api": api,
                           **measure(daemon, concurrency, frontends, args, api)}
                    results.append(row)
                    print(f"front ends {frontends} {api:9s} streams {concurrency:5d}: "
                          f"{row['output_tokens_per_s']:8.0f} tok/s  "
                          f"daemon {row['daemon_cpu_us_per_token']:6.1f} us/token "
                          f"(system {row['daemon_sys_us_per_token']:.1f})  "
                          f"({' + '.join(map(str, row['process_cpu_us_per_token']))})  "
                          + (f"ITL p50 {row['itl_p50_ms']:.1f} ms p99 {row['itl_p99_ms']:.1f} ms  "
                             if row["itl_p50_ms"] is not None else "")
                          + f"errors {row['errors']}", flush=True)
                    for name, share in row.get("profile", [])[:12]:
                        print(f"    {100 * share:5.1f}%  {name}")
            finally:
                daemon.stop()
    write_json(args.out, {"machine": machine(), "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
