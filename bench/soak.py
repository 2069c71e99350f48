r"""A soak: a daemon under mixed traffic for a long time, watched for lost requests and for
memory, descriptors and threads that grow.

``--streams`` clients each send one request after another (after ``--think`` seconds on
average, exponentially spread; 0: at once) for ``--minutes``, each request of a kind in turn:

  image-greedy   streamed chat, one image, greedy
  image-sampled  streamed chat, one image, temperature 0.8, top-p 0.95 (every other one seeded)
  text-sampled   chat without streaming, the API's default sampling
  cut            streamed chat with one image that the client drops after two token chunks
  bad            a body the API must refuse: an image that is not one, top_p 2, a negative
                 max_tokens, an unknown field (one of them in turn)

Every answer asks for exactly its number of tokens (``max_tokens`` with ``ignore_eos``: 8 to
``--max-tokens``). A request is lost when a valid one does not end with HTTP 200 and exactly
that many tokens, when a bad one gets anything but a 4xx with an OpenAI error body, or when
the daemon stops answering. A cut request counts as served when its first chunks came.

Every ``--sample-every`` seconds each process of the daemon (the daemon, its workers, the
fork server, its HTTP processes) is read from ``/proc``: PSS and private memory
(``smaps_rollup``), open descriptors and threads; ``/admin/status`` gives the workers' pids
and restarts. At the end the script waits for every instance to drain (nothing in flight,
no KV block held by a request), then reports the requests by kind, the lost ones' errors,
and per process the growth of each figure as a least-squares slope per hour over the
samples after the first ``--settle-minutes``.

While the traffic runs, ``--kill-every M`` kills a worker (SIGKILL, the instances in turn)
every M minutes: the daemon restarts it with its role and runs its requests again, so none
may be lost; ``--redeploy-every M --redeploy A B ...`` changes the deployment to A, B, ...
in turn every M minutes (``/admin/redeploy``, as ``hydractl redeploy``), live.

    python bench/soak.py --minutes 60 --streams 256 --devices cpu:2 --out soak.json
    python bench/soak.py --url http://127.0.0.1:8000 --pid <daemon pid> --minutes 180 ...
    python bench/soak.py --devices cpu:2 --deploy 1EP+1D --minutes 15 --kill-every 3 \
        --redeploy-every 5 --redeploy 2EPD 1EP+1D

Ctrl-C or SIGTERM stops the traffic early; the drain check and the report follow as at the end.

Exit status 1 when a request was lost, a worker restarted but by the kills, a redeploy
failed or an instance did not drain.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from common import Server, free_port, machine, model_dir, write_json
from hydrad.bench.client import Payload, auth_headers, stream_chat

KINDS = ("image-greedy", "image-sampled", "text-sampled", "cut", "bad")
# Memory figures read from smaps_rollup (kB there, MiB here).
_SMAPS = {"Rss": "rss_mib", "Pss": "pss_mib", "Pss_Anon": "pss_anon_mib", "Private_Clean": "_private_clean",
          "Private_Dirty": "_private_dirty"}
FIGURES = ("rss_mib", "pss_mib", "pss_anon_mib", "private_mib", "fds", "threads")
_BAD_BODIES = (
    ("an image that is not one", lambda body: body["messages"][0]["content"].__setitem__(
        0, {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8gd29ybGQ="}})),
    ("top_p 2", lambda body: body.update(top_p=2)),
    ("a negative max_tokens", lambda body: body.update(max_tokens=-3)),
    ("an unknown field", lambda body: body.update(frobnicate=1)),
)


# -- the processes --------------------------------------------------------------------------

def parse_smaps_rollup(text: str) -> dict[str, float]:
    """The memory figures of one ``/proc/PID/smaps_rollup`` (MiB)."""
    values = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in _SMAPS and rest.strip().endswith("kB"):
            values[_SMAPS[key]] = int(rest.split()[0]) / 1024
    values["private_mib"] = values.pop("_private_clean", 0.0) + values.pop("_private_dirty", 0.0)
    return values


def descendants(root: int, parents: dict[int, int]) -> list[int]:
    """``root`` and every process below it (``parents``: pid -> parent pid), root first."""
    children = defaultdict(list)
    for pid, parent in parents.items():
        children[parent].append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(sorted(children[pid]))
    return out


def _parents() -> dict[int, int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat[stat.rindex(")") + 2:].split()[1])
    return parents


def read_process(pid: int) -> dict[str, float] | None:
    """One process's figures, or None where it is gone."""
    try:
        figures = parse_smaps_rollup(Path(f"/proc/{pid}/smaps_rollup").read_text())
        figures["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    figures["threads"] = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("Threads:"))
    return figures


def label_processes(root: int | None, workers: dict[int, str]) -> dict[str, int]:
    """label -> pid: the daemon (``root``), its workers (``workers``: pid -> label, from
    /admin/status) and its other processes (by what they run)."""
    labels = {label: pid for pid, label in workers.items()}
    if root is None:
        return labels
    labels["daemon"] = root
    for pid in descendants(root, _parents())[1:]:
        if pid in workers:
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        kind = ("fork server" if "forkserver" in cmdline else "resource tracker" if "resource_tracker" in cmdline
                else "process")
        name, n = kind, 2
        while name in labels:
            name, n = f"{kind} {n}", n + 1
        labels[name] = pid
    return labels


def growth_per_hour(samples: list[tuple[float, float]]) -> float | None:
    """The least-squares slope of (seconds, value) samples, per hour; None under 3 samples."""
    if len(samples) < 3:
        return None
    ts, vs = [t for t, _ in samples], [v for _, v in samples]
    mean_t, mean_v = statistics.fmean(ts), statistics.fmean(vs)
    spread = sum((t - mean_t) ** 2 for t in ts)
    if spread == 0:
        return None
    return 3600.0 * sum((t - mean_t) * (v - mean_v) for t, v in zip(ts, vs)) / spread


# -- the requests ---------------------------------------------------------------------------

@dataclass
class Tally:
    served: Counter = field(default_factory=Counter)
    lost: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)  # (kind, error) -> count

    def add(self, kind: str, error: str | None) -> None:
        if error is None:
            self.served[kind] += 1
        else:
            self.lost[kind] += 1
            self.errors[(kind, error[:200])] += 1


class Traffic:
    """The soak's clients: ``streams`` loops of requests of every kind in turn."""

    def __init__(self, url: str, model: str, images: list[str], max_tokens: int, think: float, seed: int,
                 api_key: str | None = None, timeout: float = 600.0):
        self.url, self.model, self.images = url.rstrip("/"), model, images
        self.max_tokens, self.think = max_tokens, think
        self.rng = random.Random(seed)
        self.headers = {"Content-Type": "application/json", **auth_headers(api_key)}
        self.timeout = timeout  # the longest silence on an answer
        self.tally = Tally()
        self.sent = 0

    def body(self, kind: str, index: int) -> tuple[dict, int]:
        rng = self.rng
        tokens = rng.randint(8, self.max_tokens)
        words = " ".join(rng.choice(("what", "is", "shown", "here", "describe", "the", "picture", "colors",
                                     "please", "briefly", "shapes", "light")) for _ in range(rng.randint(4, 24)))
        content: str | list = words
        if kind != "text-sampled":
            content = [{"type": "image_url", "image_url": {"url": rng.choice(self.images)}},
                       {"type": "text", "text": words}]
        body = {"model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": tokens,
                "ignore_eos": True, "stream": kind != "text-sampled"}
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        if kind in ("image-greedy", "cut"):
            body["temperature"] = 0.0
        elif kind == "image-sampled":
            body.update(temperature=0.8, top_p=0.95)
            if index % 2:
                body["seed"] = index
        elif kind == "bad":
            _BAD_BODIES[index // len(KINDS) % len(_BAD_BODIES)][1](body)
        return body, tokens

    async def one(self, session: aiohttp.ClientSession, kind: str, index: int) -> str | None:
        """Send one request; its error, or None where it was served as it must be. A streamed
        answer is read as ``hydractl bench`` reads it (``stream_chat``: HTTP 200, [DONE] and
        exactly the tokens asked for)."""
        body, tokens = self.body(kind, index)
        url = f"{self.url}/v1/chat/completions"
        if kind in ("image-greedy", "image-sampled"):
            return (await stream_chat(session, url, Payload(json.dumps(body).encode(), tokens), self.headers,
                                      self.timeout)).error
        try:
            async with session.post(url, json=body, headers=self.headers) as resp:
                if kind == "bad":
                    text = await resp.text()
                    if not 400 <= resp.status < 500:
                        return f"a bad body got HTTP {resp.status}"
                    if not isinstance(json.loads(text).get("error", {}).get("message"), str):
                        return f"a bad body's error is not OpenAI's shape: {text[:100]}"
                    return None
                if resp.status != 200:
                    return f"HTTP {resp.status}: {(await resp.text())[:150]}"
                if not body["stream"]:
                    got = (await resp.json())["usage"]["completion_tokens"]
                    return None if got == tokens else f"{got} tokens for max_tokens {tokens} with ignore_eos"
                return await self._cut(resp)
        except asyncio.TimeoutError:
            return "no answer within the timeout"
        except (aiohttp.ClientError, ValueError, KeyError, TypeError) as e:
            return f"{type(e).__name__}: {e}"

    @staticmethod
    async def _cut(resp: aiohttp.ClientResponse, after: int = 2) -> str | None:
        """Read ``after`` chunks of an answer, then go away mid-answer."""
        chunks = 0
        async for raw in resp.content:
            if raw.startswith(b"data:") and b'"choices"' in raw:
                chunks += 1
                if chunks >= after:
                    resp.close()
                    return None
        return f"the stream ended after {chunks} chunk(s), before the client went away"

    async def run(self, streams: int, seconds: float, timeout: float) -> None:
        deadline = time.monotonic() + seconds
        client_timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=timeout)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=client_timeout) as session:
            async def client(c: int) -> None:
                index = c
                while time.monotonic() < deadline:
                    if self.think:
                        await asyncio.sleep(min(self.rng.expovariate(1 / self.think), deadline - time.monotonic()))
                        if time.monotonic() >= deadline:
                            return
                    kind = KINDS[index % len(KINDS)]
                    self.sent += 1
                    self.tally.add(kind, await self.one(session, kind, index))
                    index += streams

            await asyncio.gather(*(client(c) for c in range(streams)))


# -- the daemon -----------------------------------------------------------------------------

def get_json(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.load(resp)


def worker_labels(status: dict) -> dict[int, str]:
    """pid -> label of each worker (by instance id: a redeploy changes its role, not its id)."""
    return {inst["pid"]: f"worker {inst['id']}" for inst in status.get("instances", []) if inst.get("pid")}


class Chaos:
    """Kills a worker every ``kill_every`` seconds and redeploys every ``redeploy_every``
    seconds (to each of ``deploys`` in turn) while the traffic runs; ``events`` says what
    happened when (seconds from ``began``)."""

    def __init__(self, url: str, began: float, kill_every: float | None, redeploy_every: float | None,
                 deploys: list[str]):
        self.url, self.began = url, began
        self.kill_every, self.redeploy_every, self.deploys = kill_every, redeploy_every, deploys
        self.events: list[dict] = []
        self.kills = self.redeploys = self.failed_redeploys = 0

    async def run(self, session: aiohttp.ClientSession, until: float) -> None:
        due = {"kill": self.kill_every, "redeploy": self.redeploy_every}
        due = {kind: self.began + every for kind, every in due.items() if every}
        while due:
            kind, at = min(due.items(), key=lambda item: item[1])
            if at >= until:
                return
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            await (self._kill(session) if kind == "kill" else self._redeploy(session))
            due[kind] = max(time.monotonic(), at + (self.kill_every if kind == "kill" else self.redeploy_every))

    def _event(self, **what) -> None:
        event = {"t": time.monotonic() - self.began, **what}
        self.events.append(event)
        print(f"[{event['t'] / 60:6.1f} min] " + ", ".join(f"{k} {v}" for k, v in what.items()), flush=True)

    async def _kill(self, session: aiohttp.ClientSession) -> None:
        async with session.get(f"{self.url}/admin/status") as resp:
            instances = [i for i in (await resp.json())["instances"] if i.get("pid")]
        if not instances:
            return
        victim = instances[self.kills % len(instances)]
        try:
            os.kill(victim["pid"], signal.SIGKILL)
        except ProcessLookupError:
            return
        self.kills += 1
        self._event(killed=f"worker {victim['id']} ({victim['role']}, pid {victim['pid']})")

    async def _redeploy(self, session: aiohttp.ClientSession) -> None:
        deploy = self.deploys[self.redeploys % len(self.deploys)]
        self.redeploys += 1
        result, started = None, time.monotonic()
        try:
            async with session.post(f"{self.url}/admin/redeploy", json={"deploy": deploy}) as resp:
                async for raw in resp.content:
                    if raw.strip():
                        line = json.loads(raw)
                        result = line if "progress" not in line else result
        except (aiohttp.ClientError, ValueError) as e:
            result = {"error": {"message": str(e)}}
        if result is None or "error" in result:
            self.failed_redeploys += 1
            error = "no answer" if result is None else result["error"].get("message")
            self._event(redeploy=deploy, error=error)
        else:
            self._event(redeploy=deploy, seconds=round(time.monotonic() - started, 1))


def drained(status: dict) -> bool:
    return all(inst.get("num_inflight", 0) == 0 and inst.get("num_running", 0) == 0
               and inst.get("num_waiting", 0) == 0 and inst.get("num_kv_blocks_used", 0) == 0
               for inst in status.get("instances", []))


def summarize(samples: list[dict], settle: float) -> dict[str, dict]:
    """Per process label: first and last value and hourly slope of each figure, over the
    samples at or after ``settle`` seconds (of its last process, where it was restarted)."""
    out = {}
    labels = sorted({label for s in samples for label in s["processes"]})
    for label in labels:
        series = [(s["t"], s["processes"][label]) for s in samples if label in s["processes"] and s["t"] >= settle]
        if not series:
            continue
        # A worker restarted meanwhile: its process now, not the one before.
        series = [(t, p) for t, p in series if p["pid"] == series[-1][1]["pid"]]
        row = {"pid": series[-1][1]["pid"], "samples": len(series)}
        for figure in FIGURES:
            points = [(t, p[figure]) for t, p in series if figure in p]
            if points:
                row[figure] = {"first": points[0][1], "last": points[-1][1], "max": max(v for _, v in points),
                               "per_hour": growth_per_hour(points)}
        out[label] = row
    return out


def table(growth: dict[str, dict]) -> str:
    lines = ["| process | pid | PSS MiB (first → last, /h) | private MiB (/h) | fds (first → last) | threads |",
             "|---|---|---|---|---|---|"]
    for label, row in growth.items():
        def fig(name: str, digits: int = 0) -> str:
            f = row.get(name)
            if not f:
                return "-"
            slope = "" if f["per_hour"] is None else f", {f['per_hour']:+.{digits}f}/h"
            return f"{f['first']:.{digits}f} → {f['last']:.{digits}f}{slope}"
        lines.append(f"| {label} | {row['pid']} | {fig('pss_mib', 1)} | {fig('private_mib', 1)} | {fig('fds')} | "
                     f"{fig('threads')} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running daemon (default: start one)")
    parser.add_argument("--pid", type=int, help="with --url: the daemon's pid, to watch its own processes too")
    parser.add_argument("--model", help="model folder for the daemon started here (default: the built-in one)")
    parser.add_argument("--devices", help="for the daemon started here (default: the daemon's own)")
    parser.add_argument("--deploy", help="for the daemon started here (default: the daemon's own)")
    parser.add_argument("--config", help="TOML config for the daemon started here")
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--think", type=float, default=0.0, help="mean seconds a client waits between requests")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--images", type=int, default=32, help="distinct images the requests carry")
    parser.add_argument("--sample-every", type=float, default=30.0)
    parser.add_argument("--settle-minutes", type=float, default=5.0,
                        help="samples before this are left out of the growth (warming caches, pools)")
    parser.add_argument("--timeout", type=float, default=600.0, help="longest silence on a request")
    parser.add_argument("--kill-every", type=float, metavar="MINUTES", help="kill a worker this often (SIGKILL)")
    parser.add_argument("--redeploy-every", type=float, metavar="MINUTES",
                        help="redeploy this often, to each of --redeploy in turn")
    parser.add_argument("--redeploy", nargs="+", default=[], metavar="SPEC", help="deployments to redeploy to")
    parser.add_argument("--api-key")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="JSON results")
    args = parser.parse_args()
    if args.streams < 1 or args.minutes <= 0:
        parser.error("--streams must be >= 1 and --minutes > 0")
    if bool(args.redeploy_every) != bool(args.redeploy):
        parser.error("--redeploy-every and --redeploy go together")

    from hydrad.bench.images import image_data_url, synth_image

    rng = random.Random(args.seed)
    images = [image_data_url(synth_image(rng.randint(200, 800), rng.randint(200, 600), i), "jpeg")
              for i in range(args.images)]
    server, log_dir = None, None
    if args.url is None:
        log_dir = tempfile.mkdtemp(prefix="hydrad-soak-")
        port = free_port()
        command = [sys.executable, "-m", "hydrad", "start", "--model", model_dir(args.model), "--port", str(port)]
        command += ["--devices", args.devices] if args.devices else []
        command += ["--deploy", args.deploy] if args.deploy else []
        command += ["--config", args.config] if args.config else []
        server = Server("hydrad", command, {}, port, Path(log_dir) / "hydrad.log", ())
        print(f"starting the daemon ({' '.join(command[3:])}); log {server.log_path}", flush=True)
        print(f"  healthy after {server.start():.1f} s", flush=True)
        url, root = server.url, server.process.pid
    else:
        url, root = args.url.rstrip("/"), args.pid
    try:
        return soak(args, url, root, images)
    finally:
        if server is not None:
            server.stop()


def soak(args, url: str, root: int | None, images: list[str]) -> int:
    model = get_json(f"{url}/v1/models")["data"][0]["id"]
    traffic = Traffic(url, model, images, args.max_tokens, args.think, args.seed, args.api_key, args.timeout)
    seconds = 60.0 * args.minutes
    samples: list[dict] = []
    restarts_at_start = {i["id"]: i.get("restarts", 0) for i in get_json(f"{url}/admin/status")["instances"]}
    began = time.monotonic()

    def sample() -> None:
        status = get_json(f"{url}/admin/status")
        labels = label_processes(root, worker_labels(status))
        processes = {}
        for label, pid in labels.items():
            figures = read_process(pid)
            if figures is not None:
                processes[label] = {"pid": pid, **figures}
        t = time.monotonic() - began
        samples.append({"t": t, "processes": processes, "sent": traffic.sent,
                        "served": sum(traffic.tally.served.values()), "lost": sum(traffic.tally.lost.values()),
                        "restarts": {i["id"]: i.get("restarts", 0) for i in status["instances"]}})
        memory = ", ".join(f"{label} {p['pss_mib']:.0f}" for label, p in processes.items() if "pss_mib" in p)
        print(f"[{t / 60:6.1f}/{args.minutes:g} min] {samples[-1]['served']} served, {samples[-1]['lost']} lost | "
              f"PSS MiB: {memory}", flush=True)

    async def watch(task: asyncio.Task) -> None:
        while not task.done():
            await asyncio.get_running_loop().run_in_executor(None, sample)
            await asyncio.wait({task}, timeout=args.sample_every)  # the next sample, or the traffic's end

    chaos = Chaos(url, began, 60.0 * args.kill_every if args.kill_every else None,
                  60.0 * args.redeploy_every if args.redeploy_every else None, args.redeploy)

    async def run() -> None:
        task = asyncio.create_task(traffic.run(args.streams, seconds, args.timeout))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            chaotic = asyncio.create_task(chaos.run(session, began + seconds))
            await watch(task)
            await task
            await chaotic

    print(f"soaking {args.minutes:g} min: {args.streams} streams, kinds {', '.join(KINDS)} (Ctrl-C or SIGTERM: stop "
          "and report)", flush=True)
    interrupted = False
    # Ctrl-C or SIGTERM (what stops a soak run in the background, whose SIGINT the shell
    # ignores, or by a service manager) stops the traffic; the report follows.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        asyncio.run(run())
    except KeyboardInterrupt:  # what was measured so far is still reported
        interrupted = True
    # Every request has ended at the client; the daemon must hold nothing for any of them.
    deadline, status = time.monotonic() + 60.0, {}
    while time.monotonic() < deadline:
        status = get_json(f"{url}/admin/status")
        if drained(status):
            break
        time.sleep(0.5)
    sample()
    is_drained = drained(status)
    restarts = {i["id"]: i.get("restarts", 0) - restarts_at_start.get(i["id"], 0) for i in status["instances"]}
    growth = summarize(samples, min(60.0 * args.settle_minutes, samples[-1]["t"] / 2))
    tally = traffic.tally
    print(f"\nrequests: {sum(tally.served.values())} served, {sum(tally.lost.values())} lost; by kind: "
          + ", ".join(f"{k} {tally.served[k]}/{tally.served[k] + tally.lost[k]}" for k in KINDS))
    for (kind, error), count in tally.errors.most_common(20):
        print(f"  lost {count} {kind}: {error}")
    unexpected = sum(restarts.values()) - chaos.kills  # restarts beyond the workers killed here
    print(f"workers restarted: {sum(restarts.values())} ({chaos.kills} killed here); redeploys: "
          f"{chaos.redeploys} ({chaos.failed_redeploys} failed); drained after "
          f"the traffic: {is_drained}")
    print(table(growth))
    write_json(args.out, {
        "machine": machine(), "url": url, "minutes": args.minutes, "streams": args.streams, "think": args.think,
        "max_tokens": args.max_tokens, "devices": args.devices, "deploy": args.deploy, "interrupted": interrupted,
        "seconds": samples[-1]["t"],
        "requests": {k: {"served": tally.served[k], "lost": tally.lost[k]} for k in KINDS},
        "errors": [{"kind": k, "error": e, "count": n} for (k, e), n in tally.errors.most_common()],
        "restarts": restarts, "kills": chaos.kills, "events": chaos.events, "drained": is_drained,
        "growth": growth, "samples": samples,
    })
    return 1 if tally.lost or unexpected or chaos.failed_redeploys or not is_drained else 0


if __name__ == "__main__":
    sys.exit(main())
