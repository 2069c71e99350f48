"""Live redeploy under load: time from the command to serving in the new deployment, and
what the requests in flight across the switch saw.

A daemon is started on ``--devices`` with the first deployment of ``--chain``, and
``--streams`` clients keep requests in flight (closed loop): half carry one 640x480 JPEG,
half are text only; half are greedy, half sampled at the API's defaults; ``--max-tokens``
output tokens each. ``--videos K`` (models that take videos: Qwen2-VL, Qwen2.5-VL) puts one
MP4 video (``--video-frames`` frames of ``--video-size``, 2 frames a second) instead in K of
every 8 requests: with a tight ``[slo]`` (``--slo-ttft 2 --slo-tbt 0.1``) their prompts are
long, and the steps that carry them beside decodes take the streams' slack or run over. After ``--settle`` seconds the script redeploys through the rest of the
chain with ``POST /admin/redeploy`` (what ``hydractl redeploy`` sends), ``--settle``
seconds apart, and records per switch:

- ``seconds``: the daemon's time from the command to serving in the new deployment, and
  the client's (the whole admin call);
- the requests in flight when the command was sent: how many, their worst inter-token
  gap and their end-to-end latency, against requests that ran entirely before the first
  switch (the steady state);
- failed requests (there should be none);
- at the end, each instance's preemptions, steps built past their bound (over it for
  images too long for any step with decodes, on the streams' TBT slack) and steps that
  held new prompts while a first token handed over waited, as the daemon's ``/metrics``
  count them since each worker started.

A step ``kill:N`` of the chain kills instance N's worker (SIGKILL) instead: its requests run
again elsewhere or on the restarted worker; ``seconds`` is then the time until that worker
is ready again.

    python bench/redeploy.py --chain 2EPD 1EP+1D 1E+1PD 2EPD --streams 64 --out redeploy.json
    python bench/redeploy.py --chain 2EPD kill:0 1EP+1D kill:1 --streams 256 --out deaths.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from common import machine, write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "server"))
from daemon_process import Daemon  # noqa: E402

from hydrad.bench.client import Payload, chat_payload, stream_chat  # noqa: E402
from hydrad.bench.images import image_data_url, synth_image  # noqa: E402
from hydrad.bench.workloads import RequestSpec, make_prompt  # noqa: E402


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def describe(records, since: float | None = None) -> dict:
    """Latencies of finished requests: TTFT, end to end, worst gap per request; with ``since``
    (a switch's command), also each request's worst gap among those that began after it
    (what the switch did to streams, apart from the gaps they had before it)."""
    ok = [r for r in records if r.error is None and r.chunk_times]
    worst_gaps = [max((b - a for a, b in zip(r.chunk_times, r.chunk_times[1:])), default=0.0) for r in ok]
    after = {}
    if since is not None:
        gaps_after = [max((b - a for a, b in zip(r.chunk_times, r.chunk_times[1:]) if a >= since), default=0.0)
                      for r in ok]
        after = {"gap_after_p50": percentile(gaps_after, 50), "gap_after_max": max(gaps_after, default=None)}
    return after | {
        "requests": len(records),
        "failed": sum(r.error is not None for r in records),
        "ttft_p50": percentile([r.chunk_times[0] - r.start for r in ok], 50),
        "ttft_p99": percentile([r.chunk_times[0] - r.start for r in ok], 99),
        "e2e_p50": percentile([r.end - r.start for r in ok], 50),
        "e2e_max": max((r.end - r.start for r in ok), default=None),
        "worst_gap_p50": percentile(worst_gaps, 50),
        "worst_gap_max": max(worst_gaps, default=None),
    }


async def drive(url: str, args, switches: list[dict]) -> tuple[list, list[dict]]:
    import aiohttp

    rng_prompt = __import__("random").Random(0)
    image = image_data_url(synth_image(640, 480, 7), "jpeg")
    video = None
    if args.videos:
        from hydrad.bench.videos import video_data_url
        from hydrad.bench.workloads import SynthVideo

        width, height = args.video_size
        video = video_data_url(SynthVideo(args.video_frames, width, height, 2.0, 7))
    bodies = []
    for i in range(64):
        spec = RequestSpec(make_prompt(12 + i % 20, rng_prompt), args.max_tokens)
        if i % 8 < args.videos:
            body = json.loads(chat_payload("", spec, [], video_urls=[video]))
        else:
            body = json.loads(chat_payload("", spec, [image] if i % 2 else []))
        body.pop("model")
        if i % 4 >= 2:
            body["temperature"] = 1.0
        bodies.append(Payload(json.dumps(body).encode(), args.max_tokens))  # answers are checked for it
    records = []
    stop = asyncio.Event()
    headers = {"Content-Type": "application/json"}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def client(k: int) -> None:
            i = k
            while not stop.is_set():
                records.append(await stream_chat(session, url + "/v1/chat/completions", bodies[i % len(bodies)],
                                                 headers, 300))
                i += args.streams

        clients = [asyncio.ensure_future(client(k)) for k in range(args.streams)]
        await asyncio.sleep(args.settle)
        for spec in args.chain[1:]:
            if spec.startswith("kill:"):
                switches.append(await kill(session, url, int(spec[5:])))
                await asyncio.sleep(args.settle)
                continue
            sent = time.perf_counter()
            lines = []
            async with session.post(url + "/admin/redeploy", json={"deploy": spec, "reason": "bench"}) as resp:
                async for line in resp.content:
                    if line.strip():
                        lines.append(json.loads(line))
            done = time.perf_counter()
            result = lines[-1] if lines else {}
            if "error" in result:
                raise RuntimeError(f"redeploy to {spec} failed: {result['error']['message']}")
            switches.append({"deploy": spec, "sent": sent, "done": done, "seconds": result.get("seconds"),
                             "client_seconds": done - sent, "progress": [x["progress"] for x in lines[:-1]]})
            print(f"  -> {spec}: {result.get('seconds', 0):.2f} s (client {done - sent:.2f} s)", flush=True)
            await asyncio.sleep(args.settle)
        stop.set()
        await asyncio.gather(*clients)
        async with session.get(url + "/metrics") as resp:
            counters = engine_counters(await resp.text())
    return records, switches, counters


COUNTERS = {"hydrad_preemptions_total": "preemptions", "hydrad_steps_over_bound_total": "steps_over_bound",
            "hydrad_steps_on_tbt_slack_total": "steps_on_tbt_slack",
            "hydrad_steps_holding_prompts_total": "steps_holding_prompts"}


def engine_counters(text: str) -> dict[str, dict[str, float]]:
    """Each instance's counters of ``COUNTERS`` in a Prometheus exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in COUNTERS:
                out.setdefault(sample.labels.get("instance", "?"), {})[COUNTERS[sample.name]] = sample.value
    return out


async def kill(session, url: str, instance_id: int) -> dict:
    """SIGKILL instance ``instance_id``'s worker; back once the daemon has it ready again."""
    import os
    import signal

    async def instance() -> dict:
        async with session.get(url + "/admin/status") as resp:
            status = await resp.json()
        return next(i for i in status["instances"] if i["id"] == instance_id)

    pid = (await instance())["pid"]
    sent = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    while True:
        now = await instance()
        if now["state"] == "ready" and now["pid"] != pid:
            break
        if time.perf_counter() - sent > 300:
            raise RuntimeError(f"instance {instance_id} was not ready again 300 s after its worker was killed")
        await asyncio.sleep(0.05)
    done = time.perf_counter()
    print(f"  -> kill:{instance_id}: ready again after {done - sent:.2f} s", flush=True)
    return {"deploy": f"kill:{instance_id}", "sent": sent, "done": done, "seconds": done - sent,
            "client_seconds": done - sent, "progress": []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: the 'small' LLaVA, built here)")
    parser.add_argument("--devices", default="cpu:2")
    parser.add_argument("--chain", nargs="+", default=["2EPD", "1EP+1D", "1E+1PD", "1ED+1P", "2EPD"],
                        help="deployments in turn; kill:N kills instance N's worker instead")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--settle", type=float, default=20.0, help="seconds of steady load before and between switches")
    parser.add_argument("--slo-ttft", type=float, default=60.0)
    parser.add_argument("--slo-tbt", type=float, default=5.0)
    parser.add_argument("--videos", type=int, choices=range(9), default=0, metavar="K",
                        help="K of every 8 requests carry a video instead (models that take videos)")
    parser.add_argument("--video-frames", type=int, default=16)
    parser.add_argument("--video-size", type=lambda v: tuple(int(x) for x in v.lower().split("x")), default=(640, 480),
                        metavar="WxH")
    parser.add_argument("--out")
    parser.add_argument("--log", help="keep the daemon's log here (default: a temporary folder's, removed)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if args.model:
            model = args.model
        else:
            from hydrad.models.builder import build_model

            model = str(build_model(tmp / "small", "llava", "small", 0, progress=True))
        config = tmp / "hydrad.toml"
        config.write_text(f"[slo]\nttft = {args.slo_ttft}\ntbt = {args.slo_tbt}\n[scheduler]\nmax_num_seqs = 1024\n")
        print(f"starting hydrad {args.devices} {args.chain[0]}", flush=True)
        daemon = Daemon(["--model", model, "--config", str(config), "--devices", args.devices,
                         "--deploy", args.chain[0]], Path(args.log) if args.log else tmp / "hydrad.log",
                        timeout=600)
        try:
            records, switches, counters = asyncio.run(drive(daemon.url, args, []))
        finally:
            daemon.stop()
    first = switches[0]["sent"] if switches else float("inf")
    report = {"steady": describe([r for r in records if r.end and r.end < first]), "switches": []}
    for switch in switches:
        in_flight = [r for r in records if r.start < switch["sent"] < (r.end or float("inf"))]
        report["switches"].append({k: v for k, v in switch.items() if k not in ("sent", "done")}
                                  | {"in_flight": describe(in_flight, switch["sent"])})
    report["counters"] = counters
    report["failed"] = sum(r.error is not None for r in records)
    report["requests"] = len(records)
    for row in report["switches"]:
        f = row["in_flight"]
        print(f"{row['deploy']:>10}: {row['seconds']:.2f} s to serving; {f['requests']} in flight: "
              f"e2e p50 {f['e2e_p50']:.2f} s max {f['e2e_max']:.2f} s, worst gap max {f['worst_gap_max']:.2f} s "
              f"(begun after the command: p50 {f['gap_after_p50']:.2f} s, max {f['gap_after_max']:.2f} s)")
    s = report["steady"]
    for instance, values in sorted(counters.items()):
        print(f"  instance {instance}: " + ", ".join(f"{name.replace('_', ' ')} {value:g}"
                                                     for name, value in values.items()))
    print(f"    steady: e2e p50 {s['e2e_p50']:.2f} s, worst gap p50 {s['worst_gap_p50']:.3f} s; "
          f"{report['failed']} of {report['requests']} requests failed")
    write_json(args.out, {"machine": machine(), "args": vars(args), **report})


if __name__ == "__main__":
    main()
