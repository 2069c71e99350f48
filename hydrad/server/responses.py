"""OpenAI's Responses API (``POST /v1/responses``) on the chat path.

A Responses request is a chat request said another way: its ``input`` (a text, or a list
of items: messages whose parts are ``input_text``, ``input_image`` and, in earlier
assistant turns, ``output_text``; the ``function_call`` items of an earlier answer and
the ``function_call_output`` items that answer them) and its ``instructions`` (a system
message before them) become the chat route's messages, ``max_output_tokens`` its
``max_tokens``, ``text.format`` its ``response_format``, its function ``tools`` and
``tool_choice`` the chat route's; it is then checked, processed and generated as a chat
request is. The answer is a ``response`` object whose output items are the answer's
``message`` (its text) and its ``function_call`` items, whole or streamed as OpenAI
streams them: ``response.created``, ``response.in_progress``, each item added, its text
(``response.output_text.delta``, one per token) or its arguments
(``response.function_call_arguments.delta``) as generated, each item done, then
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut the
answer) with the usage; each event is named on an ``event:`` line and numbered
(``sequence_number``), and no ``[DONE]`` follows, as in OpenAI's streams.

Where the daemon keeps responses (``[server] responses_store_mb``, ``response_store``), a
response is kept unless its request sends ``store`` false, and ``previous_response_id``
continues a kept one: the conversation's earlier items come before the request's
``input``; ``background`` responses are answered at once and polled, or streamed and
followed again by id (``hydrad.server.background``). ``conversation`` objects are refused, as are tools other
than functions, reasoning and log-probabilities (the chat route serves those).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

from hydrad.errors import RequestError
from hydrad.server.engine_client import Output
from hydrad.server.errors import error_body
from hydrad.server.protocol import ChatRequest, parse_chat_request, refuse_unknown
from hydrad.server.response_store import KeptResponse, ResponseGone, ResponseRunning
from hydrad.server.serving import dumps, json_text
from hydrad.server.tools import ToolCallStream, ToolChoice
from hydrad.tool_calls import HermesCalls

# Responses fields and the chat fields they become (where the names differ).
_CHAT_NAMES = {"max_output_tokens": "max_tokens"}
_RESPONSES_NAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format"}
# The chat route's sampling fields and extensions (vLLM's and OpenAI's), and vLLM's
# structured outputs, taken here as there.
_SAMPLING = {"top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "logit_bias", "include_stop_str_in_output",
             "skip_special_tokens", "structured_outputs"}
_FIELDS = _SAMPLING | {
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "stream_options", "text",
    "metadata", "store", "user", "safety_identifier", "prompt_cache_key", "service_tier", "parallel_tool_calls",
    "tool_choice", "tools", "truncation", "background", "previous_response_id", "include", "reasoning",
    "top_logprobs", "conversation"}
_ROLES = ("user", "assistant", "system", "developer")
_MESSAGE_PARAM = re.compile(r"^messages\[(\d+)\]")
_CALL_PARAM = re.compile(r"\.tool_calls\[(\d+)\]")

logger = logging.getLogger("hydrad.server")


@dataclass
class ResponsesRequest(ChatRequest):
    # The request's fields the response object says back (OpenAI's echo of its settings).
    settings: dict[str, Any] = field(default_factory=dict)
    # What each chat message came from ("instructions", "input[i]"), and each earlier tool
    # call ((message, call) -> "input[i]"): for naming the request's own fields in errors.
    sources: list[str] = field(default_factory=list)
    call_sources: dict[tuple[int, int], str] = field(default_factory=dict)
    # Kept once answered (``store``), with its own input items, after ``previous_id``.
    store: bool = False
    input_items: list = field(default_factory=list)
    previous_id: str | None = None
    # Answered at once as ``queued`` (or its stream's first event), generated on, polled or
    # followed (``hydrad.server.background``).
    background: bool = False

    def in_own_words(self, e: RequestError) -> RequestError:
        return rename(e, self.sources, self.call_sources)


def parse_responses_request(body: Any, *, keeping: bool = False, prior: list | None = None) -> ResponsesRequest:
    """``keeping``: the daemon keeps responses (``store`` and ``previous_response_id`` are
    served); ``prior``: the items of the conversation ``previous_response_id`` names."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    refuse_unknown(body, _FIELDS)
    _refuse_state(body, keeping)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError("instructions must be a string", "instructions")
    first = 1 if instructions else 0
    messages, sources, call_sources = [], [], {}
    if prior:
        # Taken before, so valid then: any error in them is the previous response's.
        messages, _, earlier = _messages(prior, first)
        sources = ["previous_response_id"] * len(messages)
        call_sources = dict.fromkeys(earlier, "previous_response_id")
    own, own_sources, own_calls = _messages(body.get("input"), first + len(messages))
    messages += own
    sources += own_sources
    call_sources.update(own_calls)
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
        sources.insert(0, "instructions")
    chat = {"messages": messages}
    for name in ("model", "max_output_tokens", "temperature", "top_p", "stream", "metadata", "user",
                 "safety_identifier", "prompt_cache_key", "service_tier", "parallel_tool_calls", *_SAMPLING):
        if name in body:
            chat[_CHAT_NAMES.get(name, name)] = body[name]
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
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
        raise rename(e, sources, call_sources) from None
    # OpenAI's default: kept unless sent false (where the daemon keeps responses).
    store = keeping and body.get("store") is not False
    background = bool(body.get("background"))
    previous_id = body.get("previous_response_id")
    settings = {
        "instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
        "temperature": 1.0 if body.get("temperature") is None else float(body["temperature"]),
        "top_p": 1.0 if body.get("top_p") is None else float(body["top_p"]),
        "text": text if text is not None else {"format": {"type": "text"}},
        "metadata": body.get("metadata") or {}, "user": body.get("user"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True), "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [], "truncation": "disabled", "store": store, "background": background,
        "previous_response_id": previous_id, "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
    }
    fields = {name: getattr(req, name) for name in ChatRequest.__dataclass_fields__}
    return ResponsesRequest(**fields, settings=settings, sources=sources, call_sources=call_sources, store=store,
                            input_items=_input_items(body["input"]) if store else [], previous_id=previous_id,
                            background=background)


async def prior_items(kept, body: Any) -> list[dict] | None:
    """The items of the conversation a request's ``previous_response_id`` continues (None:
    it names none, or the daemon keeps no responses: the parser then says why)."""
    previous_id = body.get("previous_response_id") if isinstance(body, dict) else None
    if kept is None or not isinstance(previous_id, str) or not previous_id:
        return None
    try:
        return await kept.call("items", previous_id)
    except ResponseRunning:
        raise RequestError(f"Previous response with id '{previous_id}' has not ended: it is a background response "
                           "still running; continue it once it has completed", "previous_response_id",
                           "previous_response_in_progress") from None
    except ResponseGone as e:
        if e.response_id == previous_id:
            message = f"Previous response with id '{previous_id}' not found: it is not kept (never was, was deleted, " \
                      "or went to make room)"
        else:
            message = f"previous_response_id '{previous_id}': an earlier response of its conversation, " \
                      f"'{e.response_id}', is no longer kept"
        raise RequestError(message, "previous_response_id", "previous_response_not_found") from None


# The ids of kept input items, by item type (a message's differs from its output's ``msg_``
# by the ``in`` before its index).
_ITEM_IDS = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


async def keep_response(kept, req: ResponsesRequest, response: dict) -> None:
    """Keep ``response``, the answer to ``req``, with ``req``'s input items."""
    await kept.call("keep", kept_response_of(req, response))


def kept_response_of(req: ResponsesRequest, response: dict) -> KeptResponse:
    """``response`` with ``req``'s input items (ids given to those sent without), as kept."""
    suffix = response["id"].removeprefix("resp_")
    items = [item if "id" in item else {"id": f"{_ITEM_IDS.get(item.get('type', 'message'), 'item')}_{suffix}_in{k}",
                                        **item}
             for k, item in enumerate(req.input_items)]
    return KeptResponse.of(response, items, req.previous_id)


def _input_items(given: str | list) -> list[dict]:
    """A request's ``input`` as the items a kept response lists, as OpenAI lists them: every
    message typed, its text as a part (a text alone: one user message)."""
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    items = []
    for item in given:
        item = dict(item)
        if item.setdefault("type", "message") == "message" and isinstance(item.get("content"), str):
            kind = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": kind, "text": item["content"]}]
        items.append(item)
    return items


def _refuse_state(body: dict, keeping: bool) -> None:
    """Refuse what this route does not serve, each by name and why."""
    store, previous_id = body.get("store"), body.get("previous_response_id")
    if not keeping:
        if store:
            raise RequestError("store: this server keeps no responses to fetch later (server.responses_store_mb "
                               "is 0); send store false", "store")
        if previous_id is not None:
            raise RequestError("previous_response_id: this server keeps no responses (server.responses_store_mb "
                               "is 0); send the conversation's messages as input", "previous_response_id")
    if store is not None and not isinstance(store, bool):
        raise RequestError("store must be a boolean", "store")
    if previous_id is not None and not (isinstance(previous_id, str) and previous_id):
        raise RequestError("previous_response_id must be a response's id", "previous_response_id")
    if body.get("conversation") is not None:
        raise RequestError("conversation: conversation objects are not kept; continue a kept response with "
                           "previous_response_id, or send the conversation's messages as input", "conversation")
    background = body.get("background")
    if background is not None and not isinstance(background, bool):
        raise RequestError("background must be a boolean", "background")
    if background:
        if not keeping:
            raise RequestError("background: this server keeps no responses to poll (server.responses_store_mb is "
                               "0); send background false", "background")
        if store is False:
            raise RequestError("background responses must be kept (they are polled by id): send store true or "
                               "leave it out", "background")
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


def _messages(items: Any, first: int) -> tuple[list[dict], list[str], dict[tuple[int, int], str]]:
    """``input`` as chat messages, what each came from, and where each earlier call came from
    (``first``: the index the first message will have). An earlier answer's
    ``function_call`` items join its assistant message as its ``tool_calls``, and each
    ``function_call_output`` is a ``tool`` message."""
    if isinstance(items, str):
        if not items:
            raise RequestError("input must not be empty", "input")
        return [{"role": "user", "content": items}], ["input"], {}
    if not isinstance(items, list) or not items:
        raise RequestError("input must be a string or a non-empty array of items", "input")
    messages: list[dict] = []
    sources: list[str] = []
    call_sources: dict[tuple[int, int], str] = {}
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "function_call":
            call = _call_of(item, where)
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":  # else the calls of that answer
                last = {"role": "assistant", "content": None, "tool_calls": []}
                messages.append(last)
                sources.append(where)
            last.setdefault("tool_calls", []).append(call)
            call_sources[(first + len(messages) - 1, len(last["tool_calls"]) - 1)] = where
            continue
        if kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise RequestError(f"{where}.call_id must be a string", f"{where}.call_id")
            if isinstance(output, list):
                output = [_part(part, f"{where}.output[{j}]", "tool") for j, part in enumerate(output)]
            elif not isinstance(output, str):
                raise RequestError(f"{where}.output must be a string or an array of input_text parts",
                                   f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
            sources.append(where)
            continue
        if kind != "message":
            raise RequestError(f"{where}: input items of type {kind!r} are not served (messages, function_call "
                               "and function_call_output)", where)
        role = item.get("role")
        if role not in _ROLES:
            raise RequestError(f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}", f"{where}.role")
        content = item.get("content")
        if isinstance(content, list):
            content = [_part(part, f"{where}.content[{j}]", role) for j, part in enumerate(content)]
        elif not isinstance(content, str):
            raise RequestError(f"{where}.content must be a string or an array of parts", f"{where}.content")
        messages.append({"role": role, "content": content})
        sources.append(where)
    return messages, sources, call_sources


def _call_of(item: dict, where: str) -> dict:
    """An earlier ``function_call`` item as a chat message's tool call."""
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str):
            raise RequestError(f"{where}.{name} must be a string", f"{where}.{name}")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def _tools(tools: Any) -> Any:
    """Function tools (``{"type": "function", "name", "description", "parameters", "strict"}``)
    as the chat route's; other kinds of tool are refused."""
    if not isinstance(tools, list):
        return tools  # the chat route names the problem
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise RequestError(f"tools[{i}]: tools of type {kind!r} are not served (functions only)", f"tools[{i}]")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def _tool_choice(choice: Any) -> Any:
    """``{"type": "function", "name": ...}`` as the chat route's; the rest as it is."""
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise RequestError(f"tool_choice of type {choice.get('type')!r} is not served (\"none\", \"auto\", "
                               '"required" or {"type": "function", "name": ...})', "tool_choice")
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _part(part: Any, where: str, role: str) -> dict:
    """A content part as the chat route's: text, or an image by URL."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text"):
        if kind == "output_text" and role != "assistant":
            raise RequestError(f"{where}: output_text parts belong to assistant messages", where)
        return {"type": "text", "text": part.get("text")}
    if kind == "input_image" and role != "tool":
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


def rename(e: RequestError, sources: list[str], call_sources: dict[tuple[int, int], str]) -> RequestError:
    """A chat route's error in the Responses request's own words: ``messages[i]`` is what
    message ``i`` came from (``sources``: ``input[j]``, or ``instructions``), its
    ``tool_calls[k]`` the ``function_call`` item it came from, ``max_tokens`` is
    ``max_output_tokens``, ``response_format`` is ``text.format``."""
    param, message = e.param, str(e)
    if param is None:
        return e
    match = _MESSAGE_PARAM.match(param)
    if match:
        index = int(match.group(1))
        call = _CALL_PARAM.match(param, match.end())
        if call and (index, int(call.group(1))) in call_sources:
            # A call's ``function.name`` / ``function.arguments`` are the item's ``name`` / ``arguments``.
            old = param
            new = renamed = call_sources[(index, int(call.group(1)))] + param[call.end():].replace(".function.", ".")
        else:
            old = match.group(0)
            new = sources[index] if index < len(sources) else "input"
            renamed = new + param[match.end():] if new.startswith("input[") else new
        return RequestError(message.replace(old, new), renamed, e.code)
    if param == "messages":
        return RequestError(message.replace("messages", "input"), "input", e.code)
    head = re.split(r"[.\[]", param, maxsplit=1)[0]
    if head in _RESPONSES_NAMES:
        renamed = _RESPONSES_NAMES[head] + param[len(head):]
        return RequestError(message.replace(param, renamed), renamed, e.code)
    return e


class ResponsesFormat:
    """The shape of one Responses request's answer: the ``response`` object, whole or as its
    stream of events (the interface of ``serving.ResponseFormat``). With tools, the answer's
    text goes through the chat route's reading of tool calls (``tools.ToolChoice``): its
    content is the ``message`` item, each call a ``function_call`` item."""

    def __init__(self, req_id: str, model: str, created: int, settings: dict, tools: ToolChoice | None = None):
        self.req_id = req_id
        self.model = model
        self.created = created
        self.settings = settings
        self.tools = tools
        self._suffix = req_id.removeprefix("resp_")
        self._sequence = 0
        # The streamed answer's output items so far (the last one open while ``_open``), its
        # message's text pieces, and how it finished.
        self._items: list[dict] = []
        self._open = False
        self._text: list[str] = []
        self._calls: ToolCallStream | HermesCalls | None = None
        self._finish: str | None = None
        self._delta_tail = b',"logprobs":[],"sequence_number":'
        # The response as it ended (set by ``whole`` and ``stream_end``), and where it is kept
        # (an async callable taking it; None: not kept).
        self.final: dict | None = None
        self.keep = None

    # -- whole ------------------------------------------------------------------------------
    def whole(self, choices: list[dict], usage: dict) -> dict:
        choice = choices[0]
        status = _status(choice["finish_reason"])
        text, calls = (choice["text"], []) if self.tools is None else self.tools.answer(choice["text"])
        items = []
        if text or not calls:
            items.append(self._message(len(items), text or "", status))
        for call in calls:
            items.append(self._call(len(items), call, status))
        self.final = self.response(status, items, usage)
        return self.final

    async def ended(self, failed: bool) -> None:
        """Keep the answered response, before its last bytes go out: the client's next
        request may name it as soon as it has them."""
        if self.keep is None or failed or self.final is None or self.final["status"] == "failed":
            return
        try:
            await self.keep(self.final)
        except Exception as e:  # the answer goes out all the same
            logger.warning("response %s was not kept: %s", self.req_id, e)

    def response(self, status: str, output: list[dict], usage: dict | None) -> dict:
        return {
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

    def failed(self, status: int, e: BaseException, output: list[dict]) -> dict:
        """The response as failed by ``e`` (its HTTP status ``status``), with ``output``."""
        error = error_body(status, e)["error"]
        failed = self.response("failed", output, None)
        failed["error"] = {"code": error["code"] or error["type"], "message": error["message"]}
        return failed

    def _message(self, index: int, text: str | None, status: str) -> dict:
        content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {"type": "message", "id": f"msg_{self._suffix}_{index}", "status": status, "role": "assistant",
                "content": content}

    def _call(self, index: int, call: dict, status: str) -> dict:
        return {"type": "function_call", "id": f"fc_{self._suffix}_{index}", "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}

    # -- streamed ---------------------------------------------------------------------------
    def _event(self, kind: str, payload: dict) -> bytes:
        payload = {"type": kind, **payload, "sequence_number": self._sequence}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + dumps(payload).encode() + b"\n\n"

    def stream_start(self) -> bytes:
        started = self.response("in_progress", [], None)
        return self._event("response.created", {"response": started}) + \
            self._event("response.in_progress", {"response": started})

    def stream_queued(self) -> bytes:
        """A background response's first events: created, and queued (``stream_running``
        follows once it runs)."""
        queued = self.response("queued", [], None)
        return self._event("response.created", {"response": queued}) + \
            self._event("response.queued", {"response": queued})

    def stream_running(self) -> bytes:
        return self._event("response.in_progress", {"response": self.response("in_progress", [], None)})

    def chunk_bytes(self, out: Output, first: bool, usage: dict | None, include_usage: bool) -> bytes:
        final = out.finish_reason is not None
        if self.tools is None:
            content, deltas = out.text, []  # one text delta per token, empty or not, as the chat route's chunks
        else:
            if self._calls is None:
                self._calls = self.tools.stream()
            content, deltas = self._calls.take(out.text, final)
        events = []
        if content is not None and (content or self.tools is None):
            events += self._text_delta(content)
        for delta in deltas:
            events += self._arguments_delta(delta)
        if final:
            self._finish = out.finish_reason
            if not self._items:  # an answer without text: its message, empty
                events += self._text_delta("")
            events += self._close(_status(out.finish_reason))
        return b"".join(events)

    def _text_delta(self, text: str) -> list[bytes]:
        events = []
        if not (self._open and self._items[-1]["type"] == "message"):
            events += self._close("completed")
            item = self._message(len(self._items), None, "in_progress")
            self._items.append(item)
            self._open = True
            self._text = []
            events.append(self._event("response.output_item.added", {"output_index": len(self._items) - 1,
                                                                     "item": item}))
            events.append(self._event("response.content_part.added", {
                "item_id": item["id"], "output_index": len(self._items) - 1, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}))
            self._delta_head = (b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
                                b'"item_id":' + dumps(item["id"]).encode() + b',"output_index":'
                                + str(len(self._items) - 1).encode() + b',"content_index":0,"delta":')
        self._text.append(text)
        events.append(self._delta_head + json_text(text) + self._delta_tail + str(self._sequence).encode() + b"}\n\n")
        self._sequence += 1
        return events

    def _arguments_delta(self, delta: dict) -> list[bytes]:
        events = []
        function = delta.get("function") or {}
        if "id" in delta:  # a new call
            events += self._close("completed")
            item = self._call(len(self._items), {"id": delta["id"], "function": {"name": function.get("name"),
                                                                                  "arguments": ""}}, "in_progress")
            self._items.append(item)
            self._open = True
            events.append(self._event("response.output_item.added", {"output_index": len(self._items) - 1,
                                                                     "item": dict(item)}))
        text = function.get("arguments")
        if text:
            item = self._items[-1]
            item["arguments"] += text
            events.append(self._event("response.function_call_arguments.delta", {
                "item_id": item["id"], "output_index": len(self._items) - 1, "delta": text}))
        return events

    def _close(self, status: str) -> list[bytes]:
        """The open item's done events (none open: none)."""
        if not self._open:
            return []
        self._open = False
        index, item = len(self._items) - 1, self._items[-1]
        item["status"] = status
        if item["type"] == "function_call":
            return [self._event("response.function_call_arguments.done", {
                        "item_id": item["id"], "output_index": index, "arguments": item["arguments"]}),
                    self._event("response.output_item.done", {"output_index": index, "item": item})]
        text = "".join(self._text)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        item["content"] = [part]
        return [self._event("response.output_text.done", {"item_id": item["id"], "output_index": index,
                                                          "content_index": 0, "text": text, "logprobs": []}),
                self._event("response.content_part.done", {"item_id": item["id"], "output_index": index,
                                                           "content_index": 0, "part": part}),
                self._event("response.output_item.done", {"output_index": index, "item": item})]

    def stream_error(self, status: int, e: BaseException, unended: list[int], started: list[bool],
                     usage: dict | None, include_usage: bool) -> bytes:
        error = error_body(status, e)["error"]
        events = self._close("incomplete")
        failed = self.failed(status, e, self._items)
        events.append(self._event("error", {"code": error["code"], "message": error["message"],
                                            "param": error["param"]}))
        events.append(self._event("response.failed", {"response": failed}))
        return b"".join(events)

    def stream_end(self, usage: dict, include_usage: bool, failed: bool) -> bytes:
        if failed:
            return b""
        status = _status(self._finish)
        kind = "response.completed" if status == "completed" else f"response.{status}"
        self.final = self.response(status, self._items, usage)
        return self._event(kind, {"response": self.final})


def _status(finish_reason: str | None) -> str:
    """A response's status for its answer's finish reason."""
    if finish_reason == "length":
        return "incomplete"
    return "completed" if finish_reason in ("stop", "tool_calls") else "failed"
