"""OpenAI response bodies for chat and text completions, whole or streamed.

Streaming follows OpenAI and vLLM: one chunk per generated token (empty
content while its text is incomplete), the assistant ``role`` with the first
token, ``finish_reason`` with the last, then (with
``stream_options.include_usage``) a usage chunk with no choices, then
``data: [DONE]``. With ``continuous_usage_stats`` as well, every chunk carries
the usage so far (vLLM's extension). ``return_token_ids`` adds each choice's output token ids
(vLLM's extension), which lets clients check tokens exactly.
"""

from __future__ import annotations

import logging
import time

from aiohttp import web

from hydrad.server.engine_client import Output, OutputStream
from hydrad.server.errors import error_body, exception_status
from hydrad.server.protocol import GenerateRequest
from hydrad.server.requests_table import ServiceStopping
from hydrad.server.sse import open_event_stream, send_done, send_event

logger = logging.getLogger("hydrad.server")


class ResponseFormat:
    """The shape of one request's response: chat or text completion."""

    def __init__(self, chat: bool, req_id: str, model: str, return_token_ids: bool):
        self.chat = chat
        self.req_id = req_id
        self.model = model
        self.return_token_ids = return_token_ids
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.req_id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def chunk(self, out: Output, first: bool) -> dict:
        if self.chat:
            # Every token chunk carries "content", empty or not, so clients can time each token.
            delta = {"role": "assistant", "content": out.text} if first else {"content": out.text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": out.finish_reason}
        else:
            choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = out.token_ids
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, usage: dict) -> dict:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage
        return body

    def whole(self, text: str, token_ids: list[int], finish_reason: str | None, usage: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        body["usage"] = usage
        return body


def usage_of(out: Output | None) -> dict:
    prompt = out.num_prompt_tokens if out else 0
    completion = out.num_output_tokens if out else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def respond_whole(fmt: ResponseFormat, outputs: OutputStream) -> web.Response:
    text, token_ids, last = [], [], None
    async for out in outputs:
        text.append(out.text)
        token_ids += out.token_ids
        last = out
    return web.json_response(fmt.whole("".join(text), token_ids, last.finish_reason if last else None,
                                       usage_of(last)))


async def respond_stream(
    request: web.Request, fmt: ResponseFormat, req: GenerateRequest, outputs: OutputStream
) -> web.StreamResponse:
    response = await open_event_stream(request)
    last = None
    try:
        try:
            async for out in outputs:
                # One chunk per token, even one without text yet (a special token, part of a
                # character): clients that time chunks (vllm bench serve) count on it.
                chunk = fmt.chunk(out, first=last is None)
                if req.include_usage:
                    chunk["usage"] = usage_of(out) if req.continuous_usage else None
                last = out
                await send_event(response, chunk)
        except ConnectionError:
            raise
        except Exception as e:  # the status line has gone out: report in the stream
            status = exception_status(e)
            if status >= 500 and not isinstance(e, ServiceStopping):  # the daemon logged why it stops
                logger.error("request %s failed mid-stream: %s", fmt.req_id, e)
            await send_event(response, error_body(status, e))
        if req.include_usage:
            await send_event(response, fmt.usage_chunk(usage_of(last)))
        await send_done(response)
    except ConnectionError:
        # The client went away between two chunks. Raising would make aiohttp log a
        # traceback and try to send a 500 on a dead connection; the caller's
        # ``generate`` context aborts the request either way.
        logger.debug("request %s: client disconnected mid-stream", fmt.req_id)
    return response
