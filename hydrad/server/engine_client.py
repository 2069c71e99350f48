"""The daemon's view of the engine: prepare requests off the loop, stream outputs.

``prepare_*`` runs the Request Processor in a thread pool (chat template,
tokenizer, image decoding and preprocessing, pixel tensors moved to shared
memory), so a burst of large images never stalls token streaming. ``generate``
sends the request to the instance the router picks and turns its deltas into
text (stop strings included), records metrics, and writes one log line per
finished request. Leaving the iteration early (client gone) aborts the request
on its worker, which frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Callable

import aiohttp

from hydrad.config_file import ServerConfig
from hydrad.detokenizer import IncrementalDetokenizer
from hydrad.engine.inputs import EngineRequest
from hydrad.processor import InputProcessor, ProcessedPrompt
from hydrad.server.client import WorkerClient
from hydrad.server.images_remote import fetch_remote_images
from hydrad.server.metrics import Metrics
from hydrad.server.protocol import ChatRequest, CompletionRequest, SamplingOptions
from hydrad.server.router import Router

logger = logging.getLogger("hydrad.requests")


@dataclass
class Output:
    """What one step added to a request's output."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int


class EngineClient:
    def __init__(
        self,
        processor: InputProcessor,
        router: Router,
        metrics: Metrics,
        executor: Executor,
        config: ServerConfig,
        max_model_len: int,
        http_session: aiohttp.ClientSession | None = None,
    ):
        self.processor = processor
        self.router = router
        self.metrics = metrics
        self.executor = executor
        self.config = config
        self.max_model_len = max_model_len
        self.http_session = http_session
        self.model_name = processor.model_name

    async def prepare_chat(self, req_id: str, chat: ChatRequest) -> EngineRequest:
        messages = chat.messages
        if self.http_session is not None:
            messages = await fetch_remote_images(
                messages, self.http_session, self.config.remote_images,
                max_pixels=self.config.max_image_pixels, executor=self.executor,
            )
        return await self._prepare(req_id, lambda: self.processor.process_chat(messages), chat.options, "messages")

    async def prepare_completion(self, req_id: str, req: CompletionRequest) -> EngineRequest:
        return await self._prepare(req_id, lambda: self.processor.process_prompt(req.prompt), req.options, "prompt")

    async def _prepare(
        self, req_id: str, process: Callable[[], ProcessedPrompt], options: SamplingOptions, prompt_param: str
    ) -> EngineRequest:
        def build() -> EngineRequest:
            prompt = process()
            params = options.to_params(len(prompt.prompt_token_ids), self.max_model_len, prompt_param)
            request = self.processor.make_engine_request(req_id, prompt, params)
            for image in request.images:
                image.pixel_values.share_memory_()
            if request.mrope_positions is not None:
                request.mrope_positions.share_memory_()
            return request

        return await asyncio.get_running_loop().run_in_executor(self.executor, build)

    def generate(self, request: EngineRequest, arrival: float) -> OutputStream:
        """Send ``request`` to an instance; its outputs stream from the returned object.
        Use it as ``async with``: leaving early aborts the request on its worker."""
        instance = self.router.select(has_images=bool(request.images))
        request.arrival_time = time.monotonic()
        queue = instance.add_request(request)
        return OutputStream(self, request, instance, queue, arrival)


class OutputStream:
    """The outputs of one request, until one carries a finish_reason."""

    def __init__(self, client: EngineClient, request: EngineRequest, instance: WorkerClient,
                 queue: asyncio.Queue, arrival: float):
        self.client = client
        self.request = request
        self.instance = instance
        self.queue = queue
        self.arrival = arrival
        self.detokenizer = IncrementalDetokenizer(client.processor.tokenizer, request.sampling_params)
        self.num_output_tokens = 0
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_reason: str | None = None
        self.stage_times: dict[str, float] | None = None

    async def __aenter__(self) -> OutputStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.close()

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> Output:
        if self.finish_reason is not None:
            raise StopAsyncIteration
        delta = await self.queue.get()
        if isinstance(delta, Exception):
            self._finish("error")
            raise delta
        metrics, now = self.client.metrics, time.monotonic()
        if delta.new_token_ids:
            if self.first_token_time is None:
                self.first_token_time = now
                metrics.observe_first_token(now - self.arrival, len(delta.new_token_ids))
            else:
                metrics.observe_next_tokens(now - self.last_token_time, len(delta.new_token_ids))
            self.last_token_time = now
        self.num_output_tokens += len(delta.new_token_ids)
        text = self.detokenizer.add_tokens(delta.new_token_ids)
        finish_reason, self.stage_times = delta.finish_reason, delta.stage_times
        if self.detokenizer.stopped and finish_reason is None:
            self.instance.abort(self.request.req_id)
            finish_reason = "stop"
        elif finish_reason is not None and not self.detokenizer.stopped:
            text += self.detokenizer.flush()
        out = Output(text, delta.new_token_ids, finish_reason, self.request.num_prompt_tokens,
                     self.num_output_tokens)
        if finish_reason is not None:
            self._finish(finish_reason)
        return out

    def close(self) -> None:
        """Abort the request on its worker unless it has finished (client gone, error)."""
        if self.finish_reason is None:
            self.instance.abort(self.request.req_id)
            self._finish("abort")

    def _finish(self, finish_reason: str) -> None:
        self.finish_reason = finish_reason
        req, e2e = self.request, time.monotonic() - self.arrival
        self.client.metrics.observe_finished(finish_reason, e2e, req.num_prompt_tokens, len(req.images),
                                             self.stage_times)
        ttft = f"{self.first_token_time - self.arrival:.3f}s" if self.first_token_time is not None else "-"
        stages = "".join(f" {k}={v:.3f}s" for k, v in sorted((self.stage_times or {}).items()))
        logger.info(
            "finished %s instance=%d prompt_tokens=%d output_tokens=%d images=%d ttft=%s e2e=%.3fs finish=%s%s",
            req.req_id, self.instance.instance_id, req.num_prompt_tokens, self.num_output_tokens,
            len(req.images), ttft, e2e, finish_reason, stages,
        )
