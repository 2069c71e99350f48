"""The daemon's view of the engine: prepare requests off the loop, stream outputs.

``prepare_*`` checks a request's size on the loop (its text and its images'
headers, nothing decoded), then runs the Request Processor in the pool of
``Admission`` (chat template, tokenizer, image decoding and preprocessing, pixel
tensors moved to shared memory) within its memory budgets, so large inputs
neither stall token streaming nor the small requests that come meanwhile. ``generate``
sends a request's ``n`` completions to the instances the router picks and returns
a ``RequestStream``. Each completion is a ``ChoiceStream``, the request table's sink
for it: it is fed synchronously while a step's output is read (detokenization, stop
strings, metrics happen there, for all of a step's requests in one pass), and queues
``Output``s; the HTTP handler wakes once per step and takes everything queued.
Closing the stream early (client gone) aborts the unfinished completions on their
workers, which free their blocks at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Callable

import aiohttp

from hydrad.chat_options import ChatTemplateOptions
from hydrad.config_file import ServerConfig
from hydrad.detokenizer import IncrementalDetokenizer
from hydrad.engine.inputs import EngineRequest, ImageInput, TokenLogprobs
from hydrad.errors import RequestError
from hydrad.logs import REQUESTS_LOGGER
from hydrad.processor import InputProcessor, ProcessedPrompt, PromptSize, holds_videos
from hydrad.sampling_params import split_choices
from hydrad.cluster.worker_client import WorkerClient
from hydrad.server.admission import Admission, Reservation
from hydrad.server.images_remote import fetch_remote_images
from hydrad.server.metrics import Metrics
from hydrad.server.protocol import ChatRequest, CompletionRequest, SamplingOptions, TokenizeRequest
from hydrad.cluster.requests import RequestCancelled, RequestTable
from hydrad.cluster.router import Router, entry_stage

logger = logging.getLogger(REQUESTS_LOGGER)


@dataclass(slots=True)
class Output:
    """One generated token of one completion, or the end of that completion."""

    index: int  # which of the n completions
    text: str  # the text this token makes visible (may be empty)
    token_ids: list[int]  # the token (empty for an end without a token)
    finish_reason: str | None
    logprobs: TokenLogprobs | None = None
    num_output_tokens: int = 0  # tokens of this completion so far


@dataclass(frozen=True)
class Prepared:
    """A request processed for the engine: one engine request per completion, and the CPU
    seconds the Request Processor's thread spent on it (no wait for a thread, for memory or
    for the interpreter lock counts), which the request trace keeps for the planner."""

    requests: list[EngineRequest]
    processing: float
    # Completions per prompt: ``requests`` holds a request's prompts in turn, ``n`` each.
    n: int = 1
    # Per completion, the text its answer begins with (``echo``); None: none.
    echo: list[str] | None = None
    # Of its prompts' images, those found preprocessed (``ProcessedPrompt.num_images_found``).
    images_found: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return sum(r.num_prompt_tokens for r in self.requests[::self.n])


class EngineClient:
    def __init__(
        self,
        processor: InputProcessor,
        router: Router,
        table: RequestTable,
        metrics: Metrics,
        admission: Admission,
        config: ServerConfig,
        max_model_len: int,
        http_session: aiohttp.ClientSession | None = None,
        image_caches: tuple[tuple[int, int], ...] = (),
    ):
        self.processor = processor
        self.router = router
        self.table = table
        self.metrics = metrics
        self.admission = admission
        self.config = config
        self.max_model_len = max_model_len
        # The instances' image caches, (blocks, slots per block) each: a request whose images
        # one of them could never hold is refused here, before anything streams.
        self.image_caches = image_caches
        self.http_session = http_session
        self.model_name = processor.model_name
        # The request trace (``hydrad.trace.TraceWriter``), None when off.
        self.trace = None
        self._token_text: dict[int, str] = {}
        # Streams with outputs to write once the outputs being delivered are all in.
        self._to_flush: list[RequestStream] = []

    def flush_later(self, stream: RequestStream) -> None:
        if not self._to_flush:
            asyncio.get_running_loop().call_soon(self._flush)
        self._to_flush.append(stream)

    def _flush(self) -> None:
        streams, self._to_flush = self._to_flush, []
        for stream in streams:
            stream.flush()

    def token_text(self, token_id: int) -> str:
        """A token's own text (special tokens included), for log-probabilities."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.processor.tokenizer.decode([token_id])
        return text

    async def prepare_chat(self, req_id: str, chat: ChatRequest, body: Reservation,
                           arrival: float) -> Prepared:
        """``body``: the reservation of the request's body, released once it is processed."""
        if chat.tools is not None:
            chat.tools.prepare(chat.options.params, self.processor.tool_call_format,
                               self.processor.tool_call_tags_special)
        messages, size = await self._inspect_chat(chat.messages, chat.template)
        return await self._prepare(req_id, size, body, arrival,
                                   lambda: [self.processor.process_chat(messages, chat.tool_specs, chat.template)],
                                   chat.options, "messages", price_once=not chat.stream)

    async def _inspect_chat(self, messages: list[dict], template: ChatTemplateOptions
                            ) -> tuple[list[dict], PromptSize]:
        """The messages with their remote images fetched (where the server fetches them), and
        their size, checked."""
        if self.http_session is not None:
            messages = await fetch_remote_images(
                messages, self.http_session, self.config.remote_images, max_pixels=self.config.max_image_pixels,
            )
        if holds_videos(messages):
            # A video's header may sit at the end of its file: the whole base64 is decoded to
            # read it, off the event loop.
            return messages, await asyncio.get_running_loop().run_in_executor(None, self.processor.inspect_chat,
                                                                               messages, template)
        return messages, self.processor.inspect_chat(messages, template)

    async def tokenize(self, req: TokenizeRequest, body: Reservation, arrival: float) -> list[int]:
        """The ids ``req`` asks for (``/tokenize``), processed as a generation request would be
        (within the same budgets)."""
        if req.messages is None:
            size = self.processor.inspect_prompt(req.prompt)
            return await self.admission.process(lambda: self.processor.tokenize(req.prompt, req.add_special_tokens),
                                                size, body, arrival)
        messages, size = await self._inspect_chat(req.messages, req.template)
        prompt = await self.admission.process(lambda: self.processor.process_chat(messages, req.tool_specs,
                                                                                  req.template),
                                              size, body, arrival)
        return prompt.prompt_token_ids

    async def prepare_completion(self, req_id: str, req: CompletionRequest, body: Reservation,
                                 arrival: float) -> Prepared:
        sizes = [self.processor.inspect_prompt(prompt) for prompt in req.prompts]
        size = PromptSize(sum(size.num_chars for size in sizes))
        prepared = await self._prepare(req_id, size, body, arrival,
                                       lambda: [self.processor.process_prompt(p) for p in req.prompts],
                                       req.options, "prompt", price_once=not req.stream)
        if not req.echo:
            return prepared
        echo = [text for prompt in req.prompts for text in [self.processor.prompt_text(prompt)] * prepared.n]
        return replace(prepared, echo=echo)

    async def _prepare(
        self, req_id: str, size: PromptSize, body: Reservation, arrival: float,
        process: Callable[[], list[ProcessedPrompt]], options: SamplingOptions, prompt_param: str,
        price_once: bool = False,
    ) -> Prepared:
        """One engine request per completion of each prompt (``n`` of them, sharing the
        prompt's tensors); ``price_once``: the first of them alone computes the prompt's
        log-probabilities, which the whole answer gives every completion (``ResponseFormat``;
        a streamed completion carries its own)."""

        def build() -> Prepared:
            start = time.thread_time()
            requests, found = [], 0
            for prompt in process():
                found += prompt.num_images_found
                params = options.to_params(len(prompt.prompt_token_ids), self.max_model_len, prompt_param)
                check_image_caches(prompt.images, self.image_caches, prompt_param)
                requests += [(prompt, p) for p in split_choices(params, price_once)]
            one = len(requests) == 1
            # Each prompt's completions are one group, placed together (``Router.select_stage``).
            requests = [self.processor.make_engine_request(req_id if one else f"{req_id}-{i}", prompt, p,
                                                           f"{req_id}-{i - i % options.n}" if options.n > 1 else None)
                        for i, (prompt, p) in enumerate(requests)]
            for request in requests[::options.n]:  # each prompt's, which its completions share
                for image in request.images:
                    image.pixel_values.share_memory_()
                if request.mrope_positions is not None:
                    request.mrope_positions.share_memory_()
            return Prepared(requests, time.thread_time() - start, n=options.n, images_found=found)

        return await self.admission.process(build, size, body, arrival)

    async def wait_for_entry(self, requests: list[EngineRequest], arrival: float) -> None:
        """While the only instances of the request's first stage are being restarted, wait for
        them (until ``queue_timeout`` after its arrival) rather than fail it at once."""
        stage = entry_stage(bool(requests[0].images))
        await self.table.wait_for_stage(stage, arrival + self.config.queue_timeout - time.monotonic())

    def generate(self, prepared: Prepared, arrival: float, user: str | None = None) -> RequestStream:
        """Send a request's completions to instances; their outputs stream from the returned
        object. Use it as ``async with``: leaving early aborts what has not finished."""
        stream = RequestStream(self, prepared.num_prompt_tokens, arrival, user, prepared.processing, prepared.n,
                               prepared.images_found)
        try:
            for index, request in enumerate(prepared.requests):
                instance = self.router.select(has_images=bool(request.images), request=request)
                request.arrival_time = time.monotonic()
                choice = ChoiceStream(stream, index, request, instance)
                stream.choices.append(choice)
                admitted = instance.add_request(request, choice)
                if admitted is not None:  # placed by the daemon (a front-end process): awaited on entry
                    stream.admissions.append((choice, admitted))
        except BaseException:
            stream.close()
            raise
        return stream


def check_image_caches(images: list[ImageInput], caches: tuple[tuple[int, int], ...], param: str) -> None:
    """Refuse (RequestError) images that an image cache of ``caches`` ((blocks, slots per
    block) each) could never hold at once; a request's images stay in the cache of the
    instance that encodes them until its prefill has read them, each in blocks of its own
    (a video's groups of frames each in theirs: ``ImageInput.groups``)."""
    parts = []  # the tokens of each group, as ``ImageInput.groups`` splits them
    for image in images:
        parts += [image.length // image.num_groups] * image.num_groups
    for num_blocks, block_size in caches:
        need = sum(-(-tokens // block_size) for tokens in parts)
        if need > num_blocks:
            raise RequestError(
                f"the request's {len(images)} images take {sum(parts)} image tokens, {need} blocks of "
                f"{block_size}, but the image cache holds {num_blocks}; send fewer or smaller images", param)


class RequestStream:
    """The outputs of one HTTP request's completions, taken by the handler in batches, or
    written straight from the step's delivery pass once the handler set ``direct``."""

    def __init__(self, client: EngineClient, num_prompt_tokens: int, arrival: float, user: str | None,
                 processing: float | None = None, n: int = 1, images_found: int = 0):
        """``num_prompt_tokens``: of all the request's prompts; ``n``: completions per prompt;
        ``images_found``: of its images, those found preprocessed."""
        self.client = client
        self.num_prompt_tokens = num_prompt_tokens
        self.n = n
        self.arrival = arrival
        self.user = user
        self.processing = processing
        self.images_found = images_found
        self.choices: list[ChoiceStream] = []
        self._ready: list[Output] = []
        self._error: Exception | None = None
        self._waiter: asyncio.Future | None = None
        self.first_token_time: float | None = None
        self.num_unfinished = 0  # completions without a finish_reason yet
        # ``direct(outputs) -> bool``: write these outputs to the client now (False: not now,
        # e.g. the connection's buffer is full; the handler then writes them and waits).
        # While it is set, a step's outputs are written once the step has been delivered,
        # without waking the handler, which wakes only to end the stream.
        self.direct: Callable[[list[Output]], bool] | None = None
        self._flush_pending = False
        # (completion, future) for each completion sent to the daemon from a front-end
        # process, until the daemon placed it on an instance.
        self.admissions: list[tuple[ChoiceStream, asyncio.Future]] = []

    @property
    def num_output_tokens(self) -> int:
        return sum(c.num_output_tokens for c in self.choices)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens found in a prefix cache, as far as known (per prompt, the most of its
        completions: a prompt is counted once)."""
        cached = [c.num_cached_tokens for c in self.choices]
        return sum(max(cached[i:i + self.n]) for i in range(0, len(cached), self.n))

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    async def __aenter__(self) -> RequestStream:
        admissions, self.admissions = self.admissions, []
        for choice, admitted in admissions:
            try:
                await admitted
            except BaseException:
                choice.discard()  # refused: it never ran
                for other, pending in admissions:
                    if not pending.done():
                        pending.cancel()
                self.close()
                raise
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.close()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> list[Output]:
        """Everything produced since the last call (at least one output), in order; raises
        the error that ended a completion. Stops once every completion has ended."""
        while not self._ready:
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            if self.finished:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        ready, self._ready = self._ready, []
        return ready

    def _push(self, output: Output) -> None:
        self._ready.append(output)
        self._changed()

    def _changed(self) -> None:
        if self.direct is None:
            self._wake()
        elif not self._flush_pending:
            self._flush_pending = True
            self.client.flush_later(self)

    def flush(self) -> None:
        """Write what the step produced (called once the step's outputs are all delivered, so
        a finish goes in the chunk of its request's last token)."""
        self._flush_pending = False
        if self._ready and self._error is None and self.direct is not None and self.direct(self._ready):
            self._ready = []
        if self._ready or self.finished or self._error is not None:
            self._wake()

    def _fail(self, error: Exception) -> None:
        if self._error is None:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def close(self) -> None:
        """Abort every completion that has not finished (client gone, error); the stream is
        done with. Its completions are dropped from it: each refers back to the stream, and the
        cycle kept them, their requests and their pixels (shared memory, one descriptor each)
        until the next full garbage collection, hundreds of requests later. A completion the
        request table still holds keeps its stream alive."""
        choices, self.choices = self.choices, []
        for choice in choices:
            choice.close()


class ChoiceStream:
    """The request table's sink for one completion: detokenizes and records metrics as
    tokens arrive, and queues the outputs on its request's stream."""

    def __init__(self, parent: RequestStream, index: int, request: EngineRequest, instance: WorkerClient):
        self.parent = parent
        self.index = index
        self.request = request
        self.instance = instance
        self.detokenizer = IncrementalDetokenizer(parent.client.processor.tokenizer, request.sampling_params)
        self.metrics = parent.client.metrics
        self.num_output_tokens = 0
        self.last_token_time: float | None = None
        self.finish_reason: str | None = None
        self.stage_times: dict[str, float] | None = None
        self.num_cached_tokens = 0
        parent.num_unfinished += 1
        # Inter-token gaps, kept for the request trace only.
        self.gaps: list[float] | None = [] if parent.client.trace is not None else None

    # -- RequestSink ---------------------------------------------------------------------------
    def on_token(self, token_id: int, logprobs: TokenLogprobs | None) -> None:
        if self.finish_reason is not None:
            return
        now = time.monotonic()
        parent = self.parent
        if self.last_token_time is None:
            if parent.first_token_time is None:
                parent.first_token_time = now
            self.metrics.observe_first_token(now - parent.arrival, 1, now)
        else:
            self.metrics.observe_next_tokens(now - self.last_token_time, 1, now)
            if self.gaps is not None:
                self.gaps.append(now - self.last_token_time)
        self.last_token_time = now
        self.num_output_tokens += 1
        detok = self.detokenizer
        text = detok.add_token(token_id)
        if detok.stopped:
            parent.client.table.abort(self.request.req_id)
            self._end(Output(self.index, text, [token_id], "stop", logprobs, self.num_output_tokens))
            return
        parent._push(Output(self.index, text, [token_id], None, logprobs, self.num_output_tokens))

    def on_finish(self, finish_reason: str, stage_times: dict[str, float] | None, num_cached_tokens: int = 0) -> None:
        if self.finish_reason is not None:
            return
        self.stage_times = stage_times
        self.num_cached_tokens = num_cached_tokens
        text = self.detokenizer.flush()
        if self.detokenizer.stopped and finish_reason == "length":  # the last character made a stop string
            finish_reason = "stop"
        # A finish comes in the same step as the last token, whose output the handler has not
        # taken yet: the finish (and the text the last token completes) goes with it, so a
        # stream has one chunk per token. Otherwise (an abort) it is an output of its own.
        last = next((o for o in reversed(self.parent._ready) if o.index == self.index), None)
        if last is None or last.finish_reason is not None:
            self._end(Output(self.index, text, [], finish_reason, None, self.num_output_tokens))
            return
        last.text += text
        last.finish_reason = finish_reason
        self._finish(finish_reason)
        self.parent._changed()

    def on_error(self, error: Exception) -> None:
        if self.finish_reason is None:
            self._finish("abort" if isinstance(error, RequestCancelled) else "error")
            self.parent._fail(error)

    # -- ending ----------------------------------------------------------------------------------
    def _end(self, output: Output) -> None:
        self._finish(output.finish_reason)
        self.parent._push(output)

    def discard(self) -> None:
        """The completion was refused before it ran: it ends without counting as finished."""
        if self.finish_reason is None:
            self.finish_reason = "refused"
            self.parent.num_unfinished -= 1

    def close(self) -> None:
        if self.finish_reason is None:
            self.parent.client.table.abort(self.request.req_id)
            self._finish("abort")

    def _finish(self, finish_reason: str) -> None:
        self.finish_reason = finish_reason
        req, parent = self.request, self.parent
        parent.num_unfinished -= 1
        e2e = time.monotonic() - parent.arrival
        self.metrics.observe_finished(finish_reason, e2e, req.num_prompt_tokens, len(req.images), self.stage_times)
        ttft = f"{parent.first_token_time - parent.arrival:.3f}s" if parent.first_token_time is not None else "-"
        stages = "".join(f" {k}={v:.3f}s" for k, v in sorted((self.stage_times or {}).items()))
        user = f" user={parent.user!r}" if parent.user else ""
        # The instances it went through (a front-end process learns them from the daemon).
        route = parent.client.table.routes.get(req.req_id) or \
            ([self.instance.instance_id] if self.instance.instance_id is not None else [])
        logger.info(
            "finished %s instance=%s prompt_tokens=%d output_tokens=%d images=%d ttft=%s e2e=%.3fs finish=%s%s%s",
            req.req_id, route[0] if route else "-", req.num_prompt_tokens, self.num_output_tokens,
            len(req.images), ttft, e2e, finish_reason, user, stages,
        )
        trace = parent.client.trace
        if trace is not None:
            from hydrad.trace import wall_clock

            first = parent.first_token_time
            trace.record(
                timestamp=wall_clock(parent.arrival), prompt_tokens=req.num_prompt_tokens,
                images=[(i.image_size[1] if i.image_size else None, i.image_size[0] if i.image_size else None,
                         i.length, i.offset, i.num_patches, i.attention_span, i.frames) for i in req.images],
                output_tokens=self.num_output_tokens, max_tokens=req.sampling_params.max_tokens,
                finish_reason=finish_reason, preprocess=req.arrival_time - parent.arrival,
                ttft=first - parent.arrival if first is not None else None, e2e=e2e, gaps=self.gaps,
                stages=self.stage_times, instances=list(route), cached_tokens=self.num_cached_tokens,
                processing=parent.processing, images_found=parent.images_found,
                prompt_logprobs=req.sampling_params.prompt_logprobs is not None,
                group=req.group,
            )
