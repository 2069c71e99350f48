"""OpenAI's Responses API (``POST /v1/responses``) on the chat path.

A Responses request is a chat request said another way: its ``input`` (a text, or a list
of messages whose parts are ``input_text``, ``input_image`` and, in earlier assistant
turns, ``output_text``) and its ``instructions`` (a system message before them) become the
chat route's messages, ``max_output_tokens`` its ``max_tokens``, ``text.format`` its
``response_format``; it is then checked, processed and generated as a chat request is. The
answer is a ``response`` object with one ``message`` output item, whole or streamed as
OpenAI streams it: ``response.created``, ``response.in_progress``, the output item and its
text part added, one ``response.output_text.delta`` per token, the text, part and item
done, then ``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut
the answer) with the usage; each event is named on an ``event:`` line and numbered
(``sequence_number``), and no ``[DONE]`` follows, as in OpenAI's streams.

What needs state kept between requests (``store``, ``previous_response_id``,
``conversation``, ``background``) is refused: hydrad keeps no responses; so are tools,
reasoning and log-probabilities, which this route does not serve (the chat route serves
tools and log-probabilities).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from hydrad.errors import RequestError
from hydrad.server.engine_client import Output
from hydrad.server.errors import error_body
from hydrad.server.protocol import ChatRequest, parse_chat_request
from hydrad.server.serving import dumps, json_text

# Responses fields and the chat fields they become (where the names differ).
_CHAT_NAMES = {"max_output_tokens": "max_tokens"}
_RESPONSES_NAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format",
                    "stream_options": "stream_options"}
# The chat route's sampling extensions (vLLM's and OpenAI's), taken here as there.
_SAMPLING = {"top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "logit_bias", "include_stop_str_in_output",
             "skip_special_tokens"}
_FIELDS = _SAMPLING | {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "stream_options",
           "text", "metadata", "store", "user", "safety_identifier", "prompt_cache_key", "service_tier",
           "parallel_tool_calls", "tool_choice", "tools", "truncation", "background", "previous_response_id",
           "include", "reasoning", "top_logprobs", "conversation"}
_ROLES = ("user", "assistant", "system", "developer")
_MESSAGE_PARAM = re.compile(r"^messages\[(\d+)\]")


@dataclass
class ResponsesRequest(ChatRequest):
    # The request's fields the response object says back (OpenAI's echo of its settings).
    settings: dict[str, Any] = field(default_factory=dict)
    # Messages before ``input``'s first (its ``instructions``): for naming ``input`` in errors.
    num_leading: int = 0


def parse_responses_request(body: Any) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise RequestError(f"unknown or unsupported parameter {unknown[0]!r}", unknown[0])
    _refuse_state(body)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError("instructions must be a string", "instructions")
    messages = _messages(body.get("input"))
    leading = [{"role": "system", "content": instructions}] if instructions else []
    chat = {"messages": leading + messages}
    for name in ("model", "max_output_tokens", "temperature", "top_p", "stream", "metadata", "user",
                 "safety_identifier", "prompt_cache_key", "service_tier", *_SAMPLING):
        if name in body:
            chat[_CHAT_NAMES.get(name, name)] = body[name]
    stream_options = body.get("stream_options")
    if stream_options is not None:
        # OpenAI's only option here pads events against size side channels: none are padded.
        if not isinstance(stream_options, dict) or set(stream_options) - {"include_obfuscation"}:
            raise RequestError('stream_options takes "include_obfuscation" alone', "stream_options")
        if not body.get("stream"):
            raise RequestError("stream_options can only be set when stream is true", "stream_options")
    text = body.get("text")
    if text is not None:
        chat["response_format"] = _text_format(text)
    try:
        req = parse_chat_request(chat)
    except RequestError as e:
        raise rename(e, len(leading)) from None
    settings = {
        "instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
        "temperature": 1.0 if body.get("temperature") is None else float(body["temperature"]),
        "top_p": 1.0 if body.get("top_p") is None else float(body["top_p"]),
        "text": text if text is not None else {"format": {"type": "text"}},
        "metadata": body.get("metadata") or {}, "user": body.get("user"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True), "tool_choice": body.get("tool_choice", "auto"),
        "tools": [], "truncation": "disabled", "store": False, "background": False, "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None}, "service_tier": "default",
    }
    fields = {name: getattr(req, name) for name in ChatRequest.__dataclass_fields__}
    return ResponsesRequest(**fields, settings=settings, num_leading=len(leading))


def _refuse_state(body: dict) -> None:
    """Refuse what this route does not serve, each by name and why."""
    if body.get("store"):
        raise RequestError("store: hydrad keeps no responses to fetch later; send store false", "store")
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            raise RequestError(f"{name}: hydrad keeps no responses; send the conversation's messages as input",
                               name)
    if body.get("background"):
        raise RequestError("background responses are not served: hydrad keeps no responses to poll", "background")
    if body.get("tools"):
        raise RequestError("tools are not served on /v1/responses; /v1/chat/completions serves them", "tools")
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise RequestError("tool_choice needs tools, which /v1/responses does not serve", "tool_choice")
    if body.get("parallel_tool_calls") is not None and not isinstance(body["parallel_tool_calls"], bool):
        raise RequestError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if body.get("truncation") not in (None, "disabled"):
        raise RequestError("truncation: only 'disabled' is served (an input too long for the context is refused)",
                           "truncation")
    if body.get("include"):
        raise RequestError("include: no additional output data is served on /v1/responses", "include")
    reasoning = body.get("reasoning")
    if reasoning is not None and (not isinstance(reasoning, dict) or any(v is not None for v in reasoning.values())):
        raise RequestError("reasoning options are not served: this model does not reason separately", "reasoning")
    if body.get("top_logprobs"):
        raise RequestError("top_logprobs is not served on /v1/responses; /v1/chat/completions serves "
                           "log-probabilities", "top_logprobs")


def _messages(items: Any) -> list[dict]:
    """``input`` as chat messages."""
    if isinstance(items, str):
        if not items:
            raise RequestError("input must not be empty", "input")
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError("input must be a string or a non-empty array of messages", "input")
    messages = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be a message object", where)
        kind = item.get("type", "message")
        if kind != "message":
            raise RequestError(f"{where}: input items of type {kind!r} are not served (messages only)", where)
        role = item.get("role")
        if role not in _ROLES:
            raise RequestError(f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}", f"{where}.role")
        content = item.get("content")
        if isinstance(content, list):
            content = [_part(part, f"{where}.content[{j}]", role) for j, part in enumerate(content)]
        elif not isinstance(content, str):
            raise RequestError(f"{where}.content must be a string or an array of parts", f"{where}.content")
        messages.append({"role": role, "content": content})
    return messages


def _part(part: Any, where: str, role: str) -> dict:
    """A content part as the chat route's: text, or an image by URL."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text"):
        if kind == "output_text" and role != "assistant":
            raise RequestError(f"{where}: output_text parts belong to assistant messages", where)
        return {"type": "text", "text": part.get("text")}
    if kind == "input_image":
        if part.get("file_id") is not None:
            raise RequestError(f"{where}.file_id: hydrad keeps no files; send the image as image_url", where)
        url = part.get("image_url")
        if not isinstance(url, str):
            raise RequestError(f"{where}.image_url must be a URL string (data: URLs)", where)
        detail = part.get("detail")
        return {"type": "image_url", "image_url": {"url": url} if detail is None else {"url": url, "detail": detail}}
    raise RequestError(f"{where}.type must be input_text or input_image (output_text in assistant messages), "
                       f"got {kind!r}", where)


def _text_format(text: Any) -> dict:
    """``text.format`` as the chat route's ``response_format``."""
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise RequestError('text must be an object with "format"', "text")
    if text.get("verbosity") not in (None, "medium"):
        raise RequestError("text.verbosity is not served: the model's answers have one verbosity", "text.verbosity")
    fmt = text.get("format") or {"type": "text"}
    if not isinstance(fmt, dict):
        raise RequestError("text.format must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return fmt


def rename(e: RequestError, num_leading: int) -> RequestError:
    """A chat route's error in the Responses request's own words: ``messages[i]`` is
    ``input[i - num_leading]`` (or ``instructions``), ``max_tokens`` is ``max_output_tokens``."""
    param, message = e.param, str(e)
    if param is not None:
        match = _MESSAGE_PARAM.match(param)
        if match:
            index = int(match.group(1)) - num_leading
            name = "instructions" if index < 0 else f"input[{index}]"
            new = name + param[match.end():] if index >= 0 else name
            message = message.replace(match.group(0), name)
            param = new
        elif param == "messages":
            param = "input"
            message = message.replace("messages", "input")
        else:
            head = param.split(".", 1)[0]
            if head in _RESPONSES_NAMES:
                renamed = _RESPONSES_NAMES[head] + param[len(head):]
                message = message.replace(param, renamed)
                param = renamed
    out = RequestError(message, param, e.code)
    return out


class ResponsesFormat:
    """The shape of one Responses request's answer: the ``response`` object, whole or as its
    stream of events (the interface of ``serving.ResponseFormat``)."""

    def __init__(self, req_id: str, model: str, created: int, settings: dict):
        self.req_id = req_id
        self.model = model
        self.created = created
        self.settings = settings
        self.item_id = "msg_" + req_id.removeprefix("resp_")
        self._sequence = 0
        self._text: list[str] = []
        self._finish: str | None = None
        item = dumps(self.item_id)
        self._delta_head = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",' \
                           b'"item_id":' + item.encode() + b',"output_index":0,"content_index":0,"delta":'
        self._delta_tail = b',"logprobs":[],"sequence_number":'

    # -- whole ------------------------------------------------------------------------------
    def whole(self, choices: list[dict], usage: dict) -> dict:
        choice = choices[0]
        return self.response(_status(choice["finish_reason"]), choice["text"], usage)

    def response(self, status: str, text: str | None, usage: dict | None) -> dict:
        output = [] if text is None else [self._item(text, status)]
        body = {
            "id": self.req_id, "object": "response", "created_at": self.created, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.model, "output": output, **self.settings,
            "usage": None if usage is None else {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"]},
        }
        return body

    def _item(self, text: str | None, status: str) -> dict:
        content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {"type": "message", "id": self.item_id, "status": "completed" if status == "completed" else
                status, "role": "assistant", "content": content}

    # -- streamed ---------------------------------------------------------------------------
    def _event(self, kind: str, payload: dict) -> bytes:
        payload = {"type": kind, **payload, "sequence_number": self._sequence}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + dumps(payload).encode() + b"\n\n"

    def stream_start(self) -> bytes:
        started = self.response("in_progress", None, None)
        return self._event("response.created", {"response": started}) + \
            self._event("response.in_progress", {"response": started})

    def chunk_bytes(self, out: Output, first: bool, usage: dict | None, include_usage: bool) -> bytes:
        events = []
        if first:
            events.append(self._event("response.output_item.added",
                                      {"output_index": 0, "item": self._item(None, "in_progress")}))
            events.append(self._event("response.content_part.added", {
                "item_id": self.item_id, "output_index": 0, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}))
        self._text.append(out.text)
        events.append(self._delta_head + json_text(out.text) + self._delta_tail
                      + str(self._sequence).encode() + b"}\n\n")
        self._sequence += 1
        if out.finish_reason is not None:
            self._finish = out.finish_reason
            text = "".join(self._text)
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            events.append(self._event("response.output_text.done", {
                "item_id": self.item_id, "output_index": 0, "content_index": 0, "text": text, "logprobs": []}))
            events.append(self._event("response.content_part.done", {
                "item_id": self.item_id, "output_index": 0, "content_index": 0, "part": part}))
            events.append(self._event("response.output_item.done",
                                      {"output_index": 0, "item": self._item(text, _status(out.finish_reason))}))
        return b"".join(events)

    def stream_error(self, status: int, e: BaseException, unended: list[int], started: list[bool],
                     usage: dict | None, include_usage: bool) -> bytes:
        error = error_body(status, e)["error"]
        failed = self.response("failed", "".join(self._text) if any(started) else None, None)
        failed["error"] = {"code": error["code"] or error["type"], "message": error["message"]}
        return self._event("error", {"code": error["code"], "message": error["message"], "param": error["param"]}) \
            + self._event("response.failed", {"response": failed})

    def stream_end(self, usage: dict, include_usage: bool, failed: bool) -> bytes:
        if failed:
            return b""
        status = _status(self._finish)
        kind = "response.completed" if status == "completed" else f"response.{status}"
        return self._event(kind, {"response": self.response(status, "".join(self._text), usage)})


def _status(finish_reason: str | None) -> str:
    """A response's status for its answer's finish reason."""
    if finish_reason == "length":
        return "incomplete"
    return "completed" if finish_reason == "stop" else "failed"
