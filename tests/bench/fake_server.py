"""A fake OpenAI-compatible chat server with exactly timed streams.

Run as ``python fake_server.py``: it binds 127.0.0.1 on a free port and prints
``PORT <n>``. It runs in its own process so the client under test cannot delay its
timers. Each request's behaviour is read from ``key=value`` words in its prompt:

  ttft=S        first token S seconds after the request arrives (default 0.05)
  tbt=S         one token every S seconds after the first (default 0.01)
  gapK=S        the gap between tokens K-1 and K (numbered from 0) is S instead of tbt
  chunk=N       tokens after the first are sent N per chunk
  pair=K,...    token K (K >= 1) is sent in one chunk with the token after it
  empty=K,...   the chunks of tokens K (numbered from 0, K >= 1) carry no text: ``delta: {}``
                (with style=hydrad: ``"content": ""``, and K may be 0)
  silent=1      every token lacks text and only the role and closing chunks are sent
  usage=chunk   every chunk carries cumulative usage (vLLM's continuous_usage_stats)
  token_ids=1   honour ``return_token_ids``: every token chunk lists its tokens' ids
  style=hydrad  hydrad's stream shape: the role goes out with the first token, every
                token chunk carries "content", the last one the finish_reason
  fail=CODE     answer with HTTP CODE instead of a stream
  extra=K       send K tokens more than max_tokens asked for (K < 0: fewer), usage counting them
  cut=K         end the answer after K tokens, without a finish, usage or [DONE]
  knee=R        when the arrival rate over the last 4 requests exceeds R req/s,
                the first token takes slow_ttft seconds instead (default 0.3)

By default (vLLM's and SGLang's shape) a role chunk with empty content is sent as
soon as the request arrives, before any token, and an empty delta with the finish
reason closes the stream.

``POST /v1/responses`` (OpenAI's Responses API) reads the same words from its input's
``input_text`` parts (ttft, tbt, gapK, chunk, fail, extra, cut, and ``failmid=K``: an
``error`` and a ``response.failed`` event after K tokens) and streams that API's events:
``response.created`` at once, a ``response.output_text.delta`` per chunk, then
``response.incomplete`` with the usage.
``GET /fake/requests`` returns what the requests since the last call asked for
(each image as its data-URL header and length) and when they arrived (``arrived``,
``time.perf_counter()`` of the server process).
"""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

_WINDOW = 4
REQUESTS = web.AppKey("requests", list)
ARRIVALS = web.AppKey("arrivals", list)


def _directives(body: dict) -> dict[str, str]:
    content = body["messages"][-1]["content"] if "messages" in body else body["input"][-1]["content"]
    if isinstance(content, list):
        content = " ".join(part.get("text", "") for part in content)
    return dict(word.split("=", 1) for word in content.split() if "=" in word)


def _chunk(delta: dict, usage: dict | None = None, finish_reason: str | None = None,
           token_ids: list[int] | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    obj = {"id": "cmpl-fake", "object": "chat.completion.chunk", "model": "fake-model", "choices": [choice]}
    if usage is not None:
        obj["usage"] = usage
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _observed_rate(arrivals: list[float]) -> float:
    recent = arrivals[-(_WINDOW + 1):]
    if len(recent) < 2 or recent[-1] == recent[0]:
        return float("inf") if len(recent) >= 2 else 0.0
    return (len(recent) - 1) / (recent[-1] - recent[0])


def _describe(body: dict, authorization: str | None, arrived: float) -> dict:
    content = body["messages"][-1]["content"]
    parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
    images = [p["image_url"]["url"] for p in parts if p.get("type") == "image_url"]
    return {
        **{k: v for k, v in body.items() if k != "messages"},
        "authorization": authorization,
        "arrived": arrived,
        "text": " ".join(p["text"] for p in parts if p.get("type") == "text"),
        "image_headers": [url.split(",", 1)[0] for url in images],
        "image_bytes": [len(url) for url in images],
        "videos": [p["video_url"]["url"] for p in parts if p.get("type") == "video_url"],
        "kinds": [p.get("type") for p in parts],
    }


async def requests(request: web.Request) -> web.Response:
    seen = request.app[REQUESTS][:]
    request.app[REQUESTS].clear()
    return web.json_response(seen)


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})


async def chat(request: web.Request) -> web.StreamResponse:
    arrived = time.perf_counter()
    request.app[ARRIVALS].append(arrived)
    body = await request.json()
    request.app[REQUESTS].append(_describe(body, request.headers.get("Authorization"), arrived))
    d = _directives(body)
    if "fail" in d:
        return web.json_response({"error": {"message": "injected failure"}}, status=int(d["fail"]))
    ttft = float(d.get("ttft", 0.05))
    if "knee" in d and _observed_rate(request.app[ARRIVALS]) > float(d["knee"]):
        ttft = float(d.get("slow_ttft", 0.3))
    tbt = float(d.get("tbt", 0.01))
    per_chunk = int(d.get("chunk", 1))
    chunk_usage = d.get("usage") == "chunk"
    num_tokens = body["max_tokens"] + int(d.get("extra", 0))

    hydrad_style = d.get("style") == "hydrad"
    send_ids = d.get("token_ids") == "1" and body.get("return_token_ids")

    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    if not hydrad_style:
        await resp.write(_chunk({"role": "assistant", "content": ""}, {"prompt_tokens": 1, "completion_tokens": 0}
                                if chunk_usage else None))

    # Absolute deadlines, so sleep overshoot never accumulates into later gaps.
    due = [arrived + ttft]
    for k in range(1, num_tokens):
        due.append(due[-1] + float(d.get(f"gap{k}", tbt)))
    empty = {int(k) for k in d["empty"].split(",")} if "empty" in d else set()
    groups = [[0]] + [list(range(i, min(i + per_chunk, num_tokens))) for i in range(1, num_tokens, per_chunk)]
    for k in sorted((int(k) for k in d["pair"].split(",")), reverse=True) if "pair" in d else ():
        i = next(i for i, g in enumerate(groups) if k in g)
        groups[i : i + 2] = [groups[i] + groups[i + 1]]
    if "silent" in d:
        groups = []
        await asyncio.sleep(max(0.0, due[-1] - time.perf_counter()))
    for group in groups:
        if "cut" in d and group[-1] >= int(d["cut"]):
            return resp  # the answer ends here, as a server's that went away mid-stream
        await asyncio.sleep(max(0.0, due[group[-1]] - time.perf_counter()))
        usage = {"prompt_tokens": 1, "completion_tokens": group[-1] + 1} if chunk_usage else None
        text = "" if group[0] in empty else " tok" * len(group)
        ids = [7] * len(group) if send_ids else None
        if not hydrad_style:
            await resp.write(_chunk({"content": text} if text else {}, usage, token_ids=ids))
            continue
        delta = {"role": "assistant", "content": text} if group[0] == 0 else {"content": text}
        await resp.write(_chunk(delta, usage, "length" if group[-1] == num_tokens - 1 else None, ids))
    if not hydrad_style:
        # Like SGLang, close with an empty delta carrying the finish reason.
        await resp.write(_chunk({}, finish_reason="length"))
    if body.get("stream_options", {}).get("include_usage"):
        final = {"id": "cmpl-fake", "object": "chat.completion.chunk", "choices": [],
                 "usage": {"prompt_tokens": 1, "completion_tokens": num_tokens, "total_tokens": num_tokens + 1}}
        await resp.write(b"data: " + json.dumps(final).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


def _event(kind: str, **payload) -> bytes:
    return f"event: {kind}\ndata: ".encode() + json.dumps({"type": kind, **payload}).encode() + b"\n\n"


async def responses(request: web.Request) -> web.StreamResponse:
    arrived = time.perf_counter()
    body = await request.json()
    parts = body["input"][-1]["content"]
    request.app[REQUESTS].append({**{k: v for k, v in body.items() if k != "input"}, "arrived": arrived,
                                  "kinds": [p.get("type") for p in parts],
                                  "image_headers": [p["image_url"].split(",", 1)[0] for p in parts
                                                    if p.get("type") == "input_image"]})
    d = _directives(body)
    if "fail" in d:
        return web.json_response({"error": {"message": "injected failure"}}, status=int(d["fail"]))
    num_tokens = body["max_output_tokens"] + int(d.get("extra", 0))
    tbt, per_chunk = float(d.get("tbt", 0.01)), int(d.get("chunk", 1))
    due = [arrived + float(d.get("ttft", 0.05))]
    for k in range(1, num_tokens):
        due.append(due[-1] + float(d.get(f"gap{k}", tbt)))
    groups = [[0]] + [list(range(i, min(i + per_chunk, num_tokens))) for i in range(1, num_tokens, per_chunk)]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(_event("response.created", response={"id": "resp_fake", "status": "in_progress"}))
    for group in groups:
        if "cut" in d and group[-1] >= int(d["cut"]):
            return resp
        if "failmid" in d and group[-1] >= int(d["failmid"]):
            await resp.write(_event("error", code="injected", message="injected failure mid-stream", param=None))
            await resp.write(_event("response.failed", response={"status": "failed", "error": {
                "code": "injected", "message": "injected failure mid-stream"}}))
            return resp
        await asyncio.sleep(max(0.0, due[group[-1]] - time.perf_counter()))
        await resp.write(_event("response.output_text.delta", delta=" tok" * len(group)))
    usage = {"input_tokens": 1, "output_tokens": num_tokens, "total_tokens": num_tokens + 1}
    await resp.write(_event("response.incomplete", response={"status": "incomplete", "usage": usage}))
    return resp


def make_app() -> web.Application:
    app = web.Application()
    app[REQUESTS] = []
    app[ARRIVALS] = []
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/fake/requests", requests)
    return app


async def serve() -> None:
    runner = web.AppRunner(make_app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(f"PORT {runner.addresses[0][1]}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(serve())
