"""The HTTP application: OpenAI-compatible API, health, metrics, admin.

``make_app`` wires everything; the workers, the Request Processor's thread pool
and (if enabled) the HTTP session for remote images live in one cleanup context,
so they start with the app and stop after the last in-flight request. What is let
in, and the drain, are ``Admission``'s (``server/admission.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import itertools
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from rich.console import Console

from hydrad.config_file import DaemonConfig
from hydrad.console import console as default_console
from hydrad.errors import ConfigError, RequestError
from hydrad.engine.probe_lock import StartupHold
from hydrad.logs import RepeatedLines
from hydrad.server.admin import check_admin_access, instance_stats, status_body, worker_pids, worker_usage
from hydrad.server.admission import Admission
from hydrad.server.background import BackgroundResponses, follow_kept
from hydrad.server.engine_client import EngineClient, Prepared
from hydrad.server.frontends import Frontends
from hydrad.server.errors import UNAVAILABLE, APIError, error_body, error_response
from hydrad.server.metrics import MergedRegistry, Metrics
from hydrad.server.monitor import FrontendMonitor, combined_cpu_per_token, frontend_status
from hydrad.server.notify import sd_notify
from hydrad.server.protocol import (DetokenizeRequest, GenerateRequest, TokenizeRequest, parse_chat_request,
                                    parse_completion_request, parse_detokenize_request, parse_tokenize_request)
from hydrad.server.response_store import CannotCancel, LocalStore, NotStreamed, ResponseGone, ResponseStore
from hydrad.server.responses import ResponsesFormat, keep_response, parse_responses_request, prior_items
from hydrad.server.serving import DirectWriter, ResponseFormat, dumps, respond_stream, respond_whole
from hydrad.server.sse import open_event_stream
from hydrad.cluster.deploy import format_deploy, parse_deploy
from hydrad.cluster.launch import InstanceSpec, Launched
from hydrad.cluster.requests import RequestCancelled
from hydrad.cluster.supervisor import RedeployError, RestartPolicy, Supervisor

logger = logging.getLogger("hydrad.server")

# Request ids: random per daemon run, then counted (unique without a system call per request).
_ID_PREFIX = uuid.uuid4().hex[:16]
_ID_COUNTER = itertools.count()
# Fields whose language (structured outputs, tool calls) is compiled while the request is parsed.
_STRUCTURED = frozenset({"response_format", "structured_outputs", "tools", "text"})

CONFIG = web.AppKey("config", DaemonConfig)
SPECS = web.AppKey("specs", list)
LAUNCHED = web.AppKey("launched", dict)
CONSOLE = web.AppKey("console", Console)
SUPERVISOR = web.AppKey("supervisor", Supervisor)
ENGINE = web.AppKey("engine", EngineClient)
METRICS = web.AppKey("metrics", Metrics)
MONITOR = web.AppKey("monitor", FrontendMonitor)
ADMISSION = web.AppKey("admission", Admission)
STARTED = web.AppKey("started", float)
REJECTIONS_LOGGED = web.AppKey("rejections_logged", RepeatedLines)
# The re-planning loop (planner.auto), or None.
REPLANNER = web.AppKey("replanner", object)
# The deployment started with and why: {"spec": "1EP+1D", "reason": "...", "auto": True
# when --deploy auto chose it, "planned_devices": the --devices it was planned for} (the
# supervisor's history has it, and every change since).
DEPLOYMENT = web.AppKey("deployment", dict)
# The other front-end processes ([server] frontend_processes), started by ``serve``.
FRONTENDS = web.AppKey("frontends", Frontends)
# The kept responses of /v1/responses (``response_store``: the daemon's ``LocalStore``, a
# front end's ``RemoteStore``), or None where server.responses_store_mb is 0.
KEPT = web.AppKey("kept", object)
# The background responses this process runs (``background.BackgroundResponses``), or None
# where no responses are kept.
BACKGROUND = web.AppKey("background", object)

# Routes outside /v1 that the API key guards too (``add_api_routes``).
TOKENIZER_ROUTES = frozenset({"/tokenize", "/detokenize", "/tokenizer_info"})


def make_app(config: DaemonConfig, specs: list[InstanceSpec], *, console: Console | None = None,
             deployment: dict | None = None, launched: dict[int, Launched] | None = None) -> web.Application:
    """``config.engine.model.path`` must name a local checkpoint folder; ``deployment`` says
    which deployment runs and why (shown by ``/admin/status``); ``launched``: the workers
    of ``specs`` started already (``cluster.launch.launch_all``), which the supervisor adopts."""
    app = web.Application(
        client_max_size=config.server.max_body_mb << 20, middlewares=[error_middleware, api_key_middleware]
    )
    app[CONFIG] = config
    app[REJECTIONS_LOGGED] = RepeatedLines()
    app[SPECS] = specs
    app[LAUNCHED] = launched if launched is not None else {}
    app[DEPLOYMENT] = deployment or {"spec": format_deploy([s.role for s in specs]), "reason": "start"}
    app[CONSOLE] = console or default_console
    store = ResponseStore(config.server.responses_store_mb << 20) if config.server.responses_store_mb else None
    app[KEPT] = LocalStore(store) if store is not None else None
    app[BACKGROUND] = BackgroundResponses(app[KEPT]) if store is not None else None
    app[FRONTENDS] = Frontends(config, store)
    app.cleanup_ctx.append(engine_ctx)
    add_api_routes(app)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/admin/status", admin_status)
    app.router.add_post("/admin/redeploy", admin_redeploy)
    app.router.add_get("/admin/trace", admin_trace)
    return app


def add_api_routes(app: web.Application) -> None:
    """The OpenAI-compatible API (served by every front-end process)."""
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/responses/{id}", kept_response)
    app.router.add_delete("/v1/responses/{id}", delete_response)
    app.router.add_post("/v1/responses/{id}/cancel", cancel_response)
    app.router.add_get("/v1/responses/{id}/input_items", response_input_items)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    # vLLM's tokenizer routes (remote tokenizers: lm-evaluation-harness finds them by itself).
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/tokenizer_info", tokenizer_info)


def load_processor(config: DaemonConfig, num_threads: int):
    """The Request Processor, with one tokenizer per processing thread and one for the
    event loop (short text prompts)."""
    from hydrad.processor import InputProcessor

    server = config.server
    processor = InputProcessor(
        Path(config.engine.model.path), max_images_per_request=server.max_images_per_request,
        max_image_pixels=server.max_image_pixels, max_request_pixels=server.max_request_pixels,
        max_model_len=config.engine.model.max_model_len, max_video_frames=server.max_video_frames,
        chat_template=config.engine.model.chat_template,
        processed_image_cache_bytes=server.processed_image_cache_mb << 20,
    )
    processor.add_instances(num_threads)
    return processor


async def engine_ctx(app: web.Application):
    """Workers and the Request Processor (loaded side by side), then the engine client."""
    config = app[CONFIG]
    server = config.server
    loop = asyncio.get_running_loop()
    # One thread more than large requests may take: see Admission.
    num_threads = server.processor_threads + 1
    executor = ThreadPoolExecutor(num_threads, thread_name_prefix="hydrad-processor")
    # Loaded while the workers load; CPU workers' latency-model probes wait for it (a first
    # start's probes beside it measured again).
    hold = StartupHold() if any(spec.device == "cpu" for spec in app[SPECS]) else None
    processor_future = loop.run_in_executor(executor, load_processor, config, num_threads)
    if hold is not None:
        processor_future.add_done_callback(lambda _: hold.release())
    supervisor = Supervisor(config.engine, app[SPECS], start_timeout=server.worker_start_timeout,
                            router_policy=server.router_policy,
                            restart=RestartPolicy(server.worker_restart_limit, server.worker_restart_window),
                            launched=app[LAUNCHED], rerun_image_bytes=server.rerun_image_mb << 20,
                            stall_timeout=server.worker_stall_timeout, quarantine_seconds=server.quarantine_seconds)
    supervisor.on_status = lambda status: sd_notify(f"STATUS={status}")
    # Every worker client, the restarted ones too, reports its steps' times to the metrics.
    supervisor.on_client = lambda client: setattr(
        client, "on_step", lambda c, timing, delay: app[METRICS].observe_step(c.instance_id, timing, delay))
    try:
        # More front-end processes load their Request Processor meanwhile; they listen once
        # the daemon does (``serve``).
        await app[FRONTENDS].spawn(supervisor.table, supervisor.router)
        readies = await supervisor.start(app[CONSOLE], reason=app[DEPLOYMENT]["reason"])
        processor = await processor_future
    except BaseException:
        await app[FRONTENDS].stop()
        await supervisor.stop(timeout=5.0)
        executor.shutdown(wait=False, cancel_futures=True)
        raise
    session = aiohttp.ClientSession() if server.remote_images.enabled else None
    app[METRICS] = Metrics(processor.model_name, processor.processed_images,
                           app[KEPT].store if app[KEPT] is not None else None)
    app[MONITOR] = FrontendMonitor(app[METRICS], worker_pids=lambda: worker_pids(supervisor.clients))
    app[MONITOR].start()
    app[SUPERVISOR] = supervisor
    app[STARTED] = time.monotonic()
    app[ADMISSION] = Admission(server, executor)
    app[METRICS].watch_admission(app[ADMISSION])
    app[ENGINE] = EngineClient(
        processor, supervisor.router, supervisor.table, app[METRICS],
        app[ADMISSION], server, min([processor.max_model_len] + [r.max_model_len for r in readies]), session,
        image_caches=tuple(sorted({r.image_cache for r in readies if r.image_cache is not None})),
    )
    if processor.max_prompt_chars is not None:
        logger.info("prompts of more than %d characters are refused before tokenizing (max_model_len %d)",
                    processor.max_prompt_chars, processor.max_model_len)
    if config.trace.enabled:
        from hydrad.trace import TraceWriter, count_template_tokens

        app[ENGINE].trace = TraceWriter(
            config.trace.directory, max_bytes=config.trace.max_file_mb << 20, max_files=config.trace.max_files,
            model=processor.model_name, deploy=lambda: supervisor.deployment,
            template_tokens=count_template_tokens(processor))
        logger.info("recording finished requests in %s", app[ENGINE].trace.path)
    replanner = None
    # --deploy auto started on a kept plan the trace has outgrown: the new plan is made now.
    refresh_since = app[DEPLOYMENT].get("refresh_since")
    if config.planner.auto or refresh_since is not None:
        from hydrad.planner.replan import Replanner

        replanner = Replanner(config, supervisor, processor.model_name,
                              keep_plans=bool(app[DEPLOYMENT].get("auto")),
                              planned_devices=app[DEPLOYMENT].get("planned_devices"))
        if config.planner.auto:
            replanner.start()
            logger.info("re-planning every %g s on the last %g s of the trace (planner.auto)",
                        config.planner.interval, config.planner.window)
        if refresh_since is not None:
            replanner.start_refresh(refresh_since)
    app[REPLANNER] = replanner
    if app[KEPT] is not None:  # a background response's cancel ends its requests, wherever they run
        app[KEPT].store.abort = functools.partial(cancel_requests, supervisor.table)
    yield
    if app[BACKGROUND] is not None:
        await app[BACKGROUND].stop()  # drained by now, unless the daemon stops at once
    await app[FRONTENDS].stop()  # they have drained by now, unless the daemon stops at once
    await app[MONITOR].stop()
    if replanner is not None:
        await replanner.stop()
    if app[ENGINE].trace is not None:
        app[ENGINE].trace.close()
    # In-flight requests have completed or been cancelled (aborted) by now.
    await supervisor.stop()
    if session is not None:
        await session.close()
    executor.shutdown(wait=False, cancel_futures=True)


# -- middlewares -----------------------------------------------------------------------------


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        _count_rejected(request, e.status, None)
        return error_response(e)
    except (RequestError, APIError, *UNAVAILABLE) as e:
        response = error_response(e)
        code = getattr(e, "code", None)
        _count_rejected(request, response.status, code)
        # Under overload or a drain every request may be refused: a few lines of each kind
        # per REJECTIONS_LOGGED.window seconds, the rest counted (the metric has them all).
        log_it, left_out = request.app[REJECTIONS_LOGGED].admit((response.status, code))
        if log_it:
            log = logger.warning if response.status >= 500 else logger.info
            log("%s %s -> %d: %s%s", request.method, request.path, response.status, e,
                f" ({left_out} more like it left out of the log before this one)" if left_out else "")
        return response
    except ConnectionError:
        raise  # the client went away; its request was aborted on the way out
    except Exception as e:
        logger.exception("%s %s failed", request.method, request.path)
        _count_rejected(request, 500, None)
        return error_response(e)


def _count_rejected(request: web.Request, status: int, code: str | None) -> None:
    metrics = request.app.get(METRICS)
    if metrics is not None:
        metrics.observe_rejected(status, code)


@web.middleware
async def api_key_middleware(request: web.Request, handler):
    key = request.app[CONFIG].server.api_key
    if key and (request.path.startswith("/v1/") or request.path in TOKENIZER_ROUTES):
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")
    return await handler(request)


# -- handlers --------------------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def responses(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "responses")


def _kept(request: web.Request):
    kept = request.app[KEPT]
    if kept is None:
        raise APIError(404, f"no response {request.match_info['id']!r} is kept: this server keeps no responses "
                       "(server.responses_store_mb is 0)", "id", "response_not_found")
    return kept


def _not_kept(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found: it is not kept (never was, was deleted, or "
                    "went to make room)", "id", "response_not_found")


async def kept_response(request: web.Request) -> web.StreamResponse:
    """``GET /v1/responses/{id}``: a kept response, as it was answered; with ``stream=true``
    the events of a background response created with ``stream`` (after ``starting_after``),
    followed until it ends."""
    response_id = request.match_info["id"]
    query = request.query
    stream = query.get("stream", "false")
    if stream not in ("true", "false"):
        raise APIError(400, f"stream must be true or false, got {stream!r}", "stream")
    if stream == "true":
        try:
            after = int(query.get("starting_after", "-1"))
        except ValueError:
            raise APIError(400, f"starting_after must be an event's sequence number, got "
                           f"{query.get('starting_after')!r}", "starting_after") from None
        return await _follow(request, response_id, after)
    if "starting_after" in query:
        raise APIError(400, "starting_after is for stream=true", "starting_after")
    response = await _kept(request).call("get", response_id)
    if response is None:
        raise _not_kept(response_id)
    return web.json_response(response, dumps=dumps)


async def _follow(request: web.Request, response_id: str, after: int) -> web.StreamResponse:
    kept = _kept(request)
    log = request.app[BACKGROUND].logs.get(response_id)  # running in this process: its own log
    if log is not None:
        return await _write_log(request, log, after)
    try:
        first = await kept.call("events", (response_id, after))
    except NotStreamed:
        raise APIError(400, f"Response '{response_id}' was not created with background and stream true: it has "
                       "no events to stream; get it without stream", "stream") from None
    if first is None:
        raise _not_kept(response_id)
    return await _write_events(await open_event_stream(request), follow_kept(kept, response_id, after, first))


async def _write_events(response: web.StreamResponse, events) -> web.StreamResponse:
    """A background response's events as they come, on its opened event stream; a client
    that leaves ends only its own stream (the response goes on)."""
    try:
        async for data in events:
            await response.write(data)
    except ConnectionError:
        logger.debug("a follower of a background response disconnected")
    return response


async def _write_log(request: web.Request, log, after: int) -> web.StreamResponse:
    """The events of a background response this process runs, from its log: written from
    the step's delivery pass once the first are out, as a streamed route's."""
    response = await open_event_stream(request)
    writer = DirectWriter(request, response)
    return await _write_events(response, log.follow(after, writer.offer if writer.possible else None))


async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["id"]
    if not await _kept(request).call("delete", response_id):
        raise _not_kept(response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


async def cancel_response(request: web.Request) -> web.Response:
    """``POST /v1/responses/{id}/cancel``: end a background response still running; it is
    answered ``cancelled``."""
    response_id = request.match_info["id"]
    try:
        response = await _kept(request).call("cancel", response_id)
    except CannotCancel as e:
        raise APIError(400, str(e), "response_id") from None
    if response is None:
        raise _not_kept(response_id)
    return web.json_response(response, dumps=dumps)


def cancel_requests(table, req_ids: tuple[str, ...]) -> None:
    """End a cancelled background response's engine requests (an abort, for their sinks)."""
    for req_id in req_ids:
        table.fail(req_id, RequestCancelled("the response was cancelled"))


async def response_input_items(request: web.Request) -> web.Response:
    """``GET /v1/responses/{id}/input_items``: the items a kept response was generated from
    (its conversation's earlier items, then its own input), OpenAI's page of them (``limit``,
    ``order``, ``after``)."""
    response_id = request.match_info["id"]
    query = request.query
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise APIError(400, f"limit must be an integer from 1 to 100, got {query.get('limit')!r}", "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be 'asc' or 'desc', got {order!r}", "order")
    try:
        items = await _kept(request).call("inputs", response_id)
    except ResponseGone as e:
        if e.response_id == response_id:
            raise _not_kept(response_id) from None
        raise APIError(404, f"the conversation of response '{response_id}' is no longer whole: its earlier "
                       f"response '{e.response_id}' is not kept", "id", "response_not_found") from None
    if order == "desc":
        items = items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise APIError(400, f"after: no input item {after!r} in response '{response_id}'", "after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return web.json_response({"object": "list", "data": page, "first_id": page[0].get("id") if page else None,
                              "last_id": page[-1].get("id") if page else None, "has_more": len(items) > limit},
                             dumps=dumps)


# Per route: how its body is parsed, the prefix of its ids, and whether it is a chat.
_ROUTES = {"chat": (parse_chat_request, "chatcmpl-", True), "completion": (parse_completion_request, "cmpl-", False),
           "responses": (parse_responses_request, "resp_", True)}


async def _generate(request: web.Request, route: str) -> web.StreamResponse:
    """Read the body within its budget, check and prepare the request within the processing
    budgets, generate. The request is in flight (for the drain) until its response ends."""
    arrival = time.monotonic()
    admission = request.app[ADMISSION]
    parse, id_prefix, chat = _ROUTES[route]
    # ``held``: what the request holds until its response ends (a kept response's input); a
    # background response's task takes it over (a drain does not wait for that task: what it
    # answers is kept in memory, which the stop loses).
    with admission.track() as inflight, contextlib.ExitStack() as held:
        body, reservation = await admission.read_body(request, arrival)
        try:
            parsed = _json(body)
            if route == "responses":  # the conversation it continues first, where one is kept
                kept = request.app[KEPT]
                parse = functools.partial(parse, keeping=kept is not None, prior=await prior_items(kept, parsed))
            if isinstance(parsed, dict) and not _STRUCTURED.isdisjoint(parsed):
                # Compiling a language takes up to a few hundred milliseconds for the largest
                # (llguidance releases the GIL meanwhile): never on the event loop.
                req = await asyncio.get_running_loop().run_in_executor(None, parse, parsed)
            else:
                req = parse(parsed)
            del body  # the parsed request holds what is needed until it is processed
            if route == "responses" and req.store:
                # Its input items are kept with its answer: its body's units stay reserved until then.
                held.callback(reservation.keep().release)
            engine = _engine_for(request, req)
            req_id = inflight.req_id = f"{id_prefix}{_ID_PREFIX}{next(_ID_COUNTER):08x}"
            prepare = engine.prepare_chat if chat else engine.prepare_completion
            try:
                prepared = await prepare(req_id, req, reservation, arrival)
            except RequestError as e:
                renamed = req.in_own_words(e)  # the fields as the request named them
                if renamed is e:
                    raise
                raise renamed from None
        finally:
            reservation.release()  # a request refused before processing took the reservation over
        # The input's memory goes with its reservation: only the prepared prompt stays (and a
        # kept response's input items, under ``held``).
        if chat:
            req.messages, req.tool_specs = [], None
        else:
            req.prompts = []
        if route == "responses":
            fmt = ResponsesFormat(req_id, engine.model_name, int(time.time()), req.settings, req.tools)
            if req.background:
                created, log = await request.app[BACKGROUND].start(engine, req, fmt, prepared, arrival, held)
                if log is None:
                    return web.json_response(created, dumps=dumps)
                return await _write_log(request, log, -1)
            if req.store:
                fmt.keep = functools.partial(keep_response, request.app[KEPT], req)
        else:
            fmt = ResponseFormat(chat, req_id, engine.model_name, req.return_token_ids, engine.token_text,
                                 tools=req.tools if chat else None, echo=prepared.echo,
                                 token_logprobs="logprobs" in req.options.params,
                                 prompt_logprobs=req.prompt_logprobs, n=req.options.n)
        return await _respond(request, engine, req, fmt, prepared, arrival)


async def _respond(request, engine: EngineClient, req: GenerateRequest, fmt: ResponseFormat, prepared: Prepared,
                   arrival: float) -> web.StreamResponse:
    await engine.wait_for_entry(prepared.requests, arrival)
    async with engine.generate(prepared, arrival, req.user) as outputs:
        if req.stream:
            return await respond_stream(request, fmt, req, outputs)
        return await respond_whole(fmt, outputs)


async def tokenize(request: web.Request) -> web.Response:
    """A prompt's or messages' token ids, as the generation routes would give them to the model."""
    arrival = time.monotonic()
    admission = request.app[ADMISSION]
    body, reservation = await admission.read_body(request, arrival)
    try:
        req = parse_tokenize_request(_json(body))
        engine = _engine_for(request, req)
        token_ids = await engine.tokenize(req, reservation, arrival)
    finally:
        reservation.release()
    token_strs = engine.processor.tokenizer.convert_ids_to_tokens(token_ids) if req.return_token_strs else None
    return web.json_response({"count": len(token_ids), "max_model_len": engine.max_model_len, "tokens": token_ids,
                              "token_strs": token_strs})


async def detokenize(request: web.Request) -> web.Response:
    arrival = time.monotonic()
    body, reservation = await request.app[ADMISSION].read_body(request, arrival)
    try:
        req = parse_detokenize_request(_json(body))
    finally:
        reservation.release()
    engine = _engine_for(request, req)
    engine.processor.check_token_ids(req.tokens, "tokens")
    return web.json_response({"prompt": engine.processor.tokenizer.decode(req.tokens)})


async def tokenizer_info(request: web.Request) -> web.Response:
    return web.json_response(request.app[ENGINE].processor.tokenizer_info())


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request)]})


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}`` (OpenAI's retrieve): the served model's card, else a 404."""
    card = _model_card(request)
    if request.match_info["model"] != card["id"]:
        raise APIError(404, f"The model `{request.match_info['model']}` does not exist.", "model", "model_not_found")
    return web.json_response(card)


def _model_card(request: web.Request) -> dict:
    engine = request.app[ENGINE]
    hf_config = engine.processor.hf_config
    return {
        "id": engine.model_name, "object": "model", "created": int(time.time()), "owned_by": "hydrad",
        "root": str(request.app[CONFIG].engine.model.path), "parent": None, "max_model_len": engine.max_model_len,
        # The family served (config.json's architecture and model type), e.g. Qwen2VLForConditionalGeneration.
        "architecture": (getattr(hf_config, "architectures", None) or [None])[0], "model_type": hf_config.model_type,
    }


async def health(request: web.Request) -> web.Response:
    draining = request.app[ADMISSION].draining
    if draining is not None:
        return web.json_response({"status": "draining", "reason": draining}, status=503)
    if not request.app[FRONTENDS].listening:  # the daemon listens; its front-end processes not yet
        return web.json_response({"status": "starting", "reason": "front-end processes starting"}, status=503)
    supervisor = request.app[SUPERVISOR]
    down = [c.instance_id for c in supervisor.clients if not c.accepting]
    if down:
        body = {"status": "unhealthy", "instances_down": down,
                "restarting": sorted(supervisor.restarting),
                "crash_loop": {str(i): reason for i, reason in sorted(supervisor.crash_loops.items())}}
        return web.json_response(body, status=503)
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    supervisor = request.app[SUPERVISOR]
    clients = supervisor.clients
    registry = request.app[METRICS]
    for client, stats in zip(clients, await instance_stats(clients, timeout=1.0)):
        registry.set_instance(client.instance_id, client.device, client.role, client.alive, stats,
                              client.num_bytes_unread)
    request.app[MONITOR].refresh()
    registry.set_worker_usage(worker_usage(clients, request.app[MONITOR].workers))
    table = supervisor.table
    registry.set_failures(supervisor.num_restarts, table.num_lost, table.num_run_again, table.kept_image_bytes,
                          len(table.quarantine), table.quarantine.num_refused)
    replanner = request.app[REPLANNER]
    registry.set_deployment(supervisor.deployment, supervisor.history, supervisor.num_failed_redeploys,
                            replanner.num_decisions if replanner is not None else None)
    snapshots = await request.app[FRONTENDS].snapshots()
    if not snapshots:
        return web.Response(body=generate_latest(registry.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
    # The same numbers from every front-end process: theirs merged into the daemon's own.
    cpu_per_token = combined_cpu_per_token([request.app[MONITOR].status()] + [s.monitor for s in snapshots])
    merged = MergedRegistry([list(registry.registry.collect())] + [s.families for s in snapshots],
                            {"hydrad_daemon_cpu_seconds_per_token": cpu_per_token})
    return web.Response(body=generate_latest(merged), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def admin_status(request: web.Request) -> web.Response:
    check_admin_access(request, request.app[CONFIG].server.admin_token)
    supervisor = request.app[SUPERVISOR]
    engine = request.app[ENGINE]
    request.app[MONITOR].refresh()
    stats, snapshots = await asyncio.gather(instance_stats(supervisor.clients), request.app[FRONTENDS].snapshots())
    body = status_body(supervisor, stats, model=engine.model_name,
                       max_model_len=engine.max_model_len, started=request.app[STARTED],
                       num_requests=len(supervisor.table),
                       window=request.app[METRICS].window.summary([s.window for s in snapshots]),
                       usage=request.app[MONITOR].workers)
    current = supervisor.history[-1]
    body["deployment"] = {"deploy": supervisor.deployment, "reason": current.reason, "history": history(supervisor)}
    replanner = request.app[REPLANNER]
    body["planner"] = replanner.status() if replanner is not None else {"auto": False, "decisions": []}
    body["frontend"] = frontend_status(request.app[MONITOR].status(), [s.monitor for s in snapshots])
    kept = request.app[KEPT]
    body["responses"] = None if kept is None else {
        "kept": len(kept.store), "bytes": kept.store.nbytes, "max_bytes": kept.store.max_bytes,
        "background_running": kept.store.num_running}
    return web.json_response(body)


async def admin_redeploy(request: web.Request) -> web.StreamResponse:
    """Change the deployment while serving: ``{"deploy": "1EP+1D"}``. The answer streams one
    JSON object per line: ``{"progress": ...}`` as the change goes, then the result
    (``{"deploy", "seconds", "changed", "history"}``) or ``{"error": {...}}``."""
    check_admin_access(request, request.app[CONFIG].server.admin_token)
    body = await read_json(request)
    spec = body.get("deploy") if isinstance(body, dict) else None
    if not isinstance(spec, str) or not spec:
        raise RequestError("'deploy' must be a deployment spec such as 1EP+1D", "deploy")
    supervisor = request.app[SUPERVISOR]
    try:
        roles = parse_deploy(spec, len(supervisor.clients))
    except ConfigError as e:
        raise RequestError(str(e), "deploy") from None
    if len(roles) != len(supervisor.clients):
        raise RequestError(f"deploy {spec!r} has {len(roles)} instance(s); this daemon runs {len(supervisor.clients)}"
                           " (a redeploy keeps the devices)", "deploy")
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)

    async def send(obj: dict) -> None:
        await response.write(json.dumps(obj).encode() + b"\n")

    lines: asyncio.Queue = asyncio.Queue()
    before = supervisor.history[-1]
    change = asyncio.ensure_future(supervisor.redeploy(roles, reason=body.get("reason") or "redeploy",
                                                        progress=lines.put_nowait))
    while not change.done() or not lines.empty():
        getter = asyncio.ensure_future(lines.get())
        await asyncio.wait([getter, change], return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            await send({"progress": getter.result()})
        else:
            getter.cancel()
    try:
        deployment = change.result()
    except RedeployError as e:
        await send(error_body(409, e))
    else:
        # Asked for the deployment it serves, the supervisor changes nothing and returns it.
        changed = deployment is not before
        await send({"deploy": deployment.deploy, "seconds": deployment.seconds if changed else 0.0,
                    "changed": changed, "history": history(supervisor)})
    return response


def history(supervisor: Supervisor) -> list[dict]:
    return [dataclasses.asdict(d) for d in supervisor.history]


async def admin_trace(request: web.Request) -> web.Response:
    """The newest ``limit`` (default 1000) lines of the request trace, as JSONL."""
    check_admin_access(request, request.app[CONFIG].server.admin_token)
    trace = request.app[ENGINE].trace
    if trace is None:
        raise APIError(404, "the request trace is off on this daemon ([trace] enabled = false)")
    try:
        limit = int(request.query.get("limit", "1000"))
    except ValueError:
        limit = -1
    if limit < 1:
        raise APIError(400, "limit must be a positive integer", "limit")
    lines = await asyncio.get_running_loop().run_in_executor(None, trace.recent, limit)
    return web.Response(text="".join(line + "\n" for line in lines), content_type="application/x-ndjson")


async def read_json(request: web.Request):
    return _json(await request.read())


def _json(body: bytes):
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None


def _engine_for(request: web.Request, req: GenerateRequest | TokenizeRequest | DetokenizeRequest) -> EngineClient:
    engine = request.app[ENGINE]
    if req.model is not None and req.model != engine.model_name:
        raise APIError(404, f"The model `{req.model}` does not exist.", "model", "model_not_found")
    return engine
