"""The HTTP application: OpenAI-compatible API, health, metrics, admin.

``make_app`` wires everything; the workers, the Request Processor's thread pool
and (if enabled) the HTTP session for remote images live in one cleanup context,
so they start with the app and stop after the last in-flight request. What is let
in, and the drain, are ``Admission``'s (``server/admission.py``).
"""

from __future__ import annotations

import asyncio
import hmac
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
from hydrad.errors import RequestError
from hydrad.server.admin import check_admin_access, instance_stats, status_body
from hydrad.server.admission import Admission
from hydrad.server.engine_client import EngineClient
from hydrad.server.errors import UNAVAILABLE, APIError, error_response
from hydrad.server.metrics import Metrics
from hydrad.server.notify import sd_notify
from hydrad.server.protocol import GenerateRequest, parse_chat_request, parse_completion_request
from hydrad.server.serving import ResponseFormat, respond_stream, respond_whole
from hydrad.cluster.supervisor import InstanceSpec, Supervisor

logger = logging.getLogger("hydrad.server")

CONFIG = web.AppKey("config", DaemonConfig)
SPECS = web.AppKey("specs", list)
CONSOLE = web.AppKey("console", Console)
SUPERVISOR = web.AppKey("supervisor", Supervisor)
ENGINE = web.AppKey("engine", EngineClient)
METRICS = web.AppKey("metrics", Metrics)
ADMISSION = web.AppKey("admission", Admission)
STARTED = web.AppKey("started", float)


def make_app(config: DaemonConfig, specs: list[InstanceSpec], *, console: Console | None = None) -> web.Application:
    """``config.engine.model.path`` must name a local checkpoint folder."""
    app = web.Application(
        client_max_size=config.server.max_body_mb << 20, middlewares=[error_middleware, api_key_middleware]
    )
    app[CONFIG] = config
    app[SPECS] = specs
    app[CONSOLE] = console or Console(stderr=True)
    app.cleanup_ctx.append(engine_ctx)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/admin/status", admin_status)
    return app


async def engine_ctx(app: web.Application):
    """Workers and the Request Processor (loaded side by side), then the engine client."""
    config = app[CONFIG]
    server = config.server
    model_path = Path(config.engine.model.path)
    loop = asyncio.get_running_loop()
    # One thread more than large requests may take: see Admission.
    num_threads = server.processor_threads + 1
    executor = ThreadPoolExecutor(num_threads, thread_name_prefix="hydrad-processor")
    from hydrad.processor import InputProcessor

    def load_processor() -> InputProcessor:
        processor = InputProcessor(
            model_path, max_images_per_request=server.max_images_per_request,
            max_image_pixels=server.max_image_pixels, max_request_pixels=server.max_request_pixels,
            max_model_len=config.engine.model.max_model_len,
        )
        processor.add_instances(num_threads - 1)  # one per thread, loaded while the workers load
        return processor

    processor_future = loop.run_in_executor(executor, load_processor)
    supervisor = Supervisor(config.engine, app[SPECS], start_timeout=server.worker_start_timeout,
                            router_policy=server.router_policy)
    supervisor.on_degraded = lambda status: sd_notify(f"STATUS={status}")
    try:
        readies = await supervisor.start(app[CONSOLE])
        processor = await processor_future
    except BaseException:
        await supervisor.stop(timeout=5.0)
        executor.shutdown(wait=False, cancel_futures=True)
        raise
    session = aiohttp.ClientSession() if server.remote_images.enabled else None
    app[METRICS] = Metrics(processor.model_name)
    for client in supervisor.clients:
        client.on_step_timing = lambda c, timing: app[METRICS].observe_step(c.instance_id, timing)
    app[SUPERVISOR] = supervisor
    app[STARTED] = time.monotonic()
    app[ADMISSION] = Admission(server, executor)
    app[ENGINE] = EngineClient(
        processor, supervisor.router, supervisor.table, app[METRICS],
        app[ADMISSION], server, min([processor.max_model_len] + [r.max_model_len for r in readies]), session,
    )
    if processor.max_prompt_chars is not None:
        logger.info("prompts of more than %d characters are refused before tokenizing (max_model_len %d)",
                    processor.max_prompt_chars, processor.max_model_len)
    yield
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
        return error_response(e)
    except (RequestError, APIError, *UNAVAILABLE) as e:
        response = error_response(e)
        log = logger.warning if response.status >= 500 else logger.info
        log("%s %s -> %d: %s", request.method, request.path, response.status, e)
        return response
    except ConnectionError:
        raise  # the client went away; its request was aborted on the way out
    except Exception as e:
        logger.exception("%s %s failed", request.method, request.path)
        return error_response(e)


@web.middleware
async def api_key_middleware(request: web.Request, handler):
    key = request.app[CONFIG].server.api_key
    if key and request.path.startswith("/v1/"):
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")
    return await handler(request)


# -- handlers --------------------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    """Read the body within its budget, check and prepare the request within the processing
    budgets, generate. The request is in flight (for the drain) until its response ends."""
    arrival = time.monotonic()
    admission = request.app[ADMISSION]
    with admission.track() as inflight:
        body, reservation = await admission.read_body(request, arrival)
        try:
            req = (parse_chat_request if chat else parse_completion_request)(_json(body))
            del body  # the parsed request holds what is needed until it is processed
            engine = _engine_for(request, req)
            req_id = inflight.req_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            prepare = engine.prepare_chat if chat else engine.prepare_completion
            prepared = await prepare(req_id, req, reservation, arrival)
        finally:
            reservation.release()  # a request refused before processing took the reservation over
        # The input's memory goes with its reservation: only the prepared prompt stays.
        if chat:
            req.messages = []
        else:
            req.prompt = ""
        fmt = ResponseFormat(chat, req_id, engine.model_name, req.return_token_ids, engine.token_text)
        return await _respond(request, engine, req, fmt, prepared, arrival)


async def _respond(request, engine: EngineClient, req: GenerateRequest, fmt: ResponseFormat, prepared,
                   arrival: float) -> web.StreamResponse:
    async with engine.generate(prepared, arrival, req.user) as outputs:
        if req.stream:
            return await respond_stream(request, fmt, req, outputs)
        return await respond_whole(fmt, outputs)


async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    card = {
        "id": engine.model_name, "object": "model", "created": int(time.time()), "owned_by": "hydrad",
        "root": str(request.app[CONFIG].engine.model.path), "parent": None, "max_model_len": engine.max_model_len,
    }
    return web.json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    draining = request.app[ADMISSION].draining
    if draining is not None:
        return web.json_response({"status": "draining", "reason": draining}, status=503)
    supervisor = request.app[SUPERVISOR]
    down = [c.instance_id for c in supervisor.clients if not c.alive]
    if down:
        return web.json_response({"status": "unhealthy", "instances_down": down}, status=503)
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    clients = request.app[SUPERVISOR].clients
    registry = request.app[METRICS]
    for client, stats in zip(clients, await instance_stats(clients, timeout=1.0)):
        registry.set_instance(client.instance_id, client.device, client.role, client.alive, stats)
    return web.Response(body=generate_latest(registry.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def admin_status(request: web.Request) -> web.Response:
    check_admin_access(request, request.app[CONFIG].server.admin_token)
    supervisor = request.app[SUPERVISOR]
    engine = request.app[ENGINE]
    body = status_body(supervisor.clients, await instance_stats(supervisor.clients), model=engine.model_name,
                       max_model_len=engine.max_model_len, started=request.app[STARTED],
                       num_requests=len(supervisor.table), window=request.app[METRICS].window.summary())
    return web.json_response(body)


def _json(body: bytes):
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None


def _engine_for(request: web.Request, req: GenerateRequest) -> EngineClient:
    engine = request.app[ENGINE]
    if req.model is not None and req.model != engine.model_name:
        raise APIError(404, f"The model `{req.model}` does not exist.", "model", "model_not_found")
    return engine
