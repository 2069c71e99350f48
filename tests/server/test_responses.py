"""The Responses API's requests as chat requests, its errors in its own words, and its
answers' shape, whole and streamed (the route end to end, with the official client:
tests/interop/test_clients.py)."""

import asyncio
import json

import pytest

from hydrad.errors import RequestError
from hydrad.server.engine_client import Output
from hydrad.server.protocol import parse_chat_request
from hydrad.server.responses import ResponsesFormat, parse_responses_request, rename

IMAGE = "data:image/png;base64,AAAA"


def test_input_becomes_the_chat_routes_messages_and_fields():
    req = parse_responses_request({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9,
        "top_k": 4, "seed": 3, "metadata": {"run": "a"}, "store": False,
        "input": [{"role": "developer", "content": "Answer in French."},
                  {"type": "message", "role": "user",
                   "content": [{"type": "input_image", "image_url": IMAGE, "detail": "low"},
                               {"type": "input_text", "text": "What is it?"}]},
                  {"role": "assistant", "content": [{"type": "output_text", "text": "Un chat."}]},
                  {"role": "user", "content": "Sure?"}]})
    assert req.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE, "detail": "low"}},
                                     {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Un chat."}]},
        {"role": "user", "content": "Sure?"}]
    chat = parse_chat_request({"model": "m", "messages": req.messages, "max_tokens": 7, "temperature": 0.5,
                               "top_p": 0.9, "top_k": 4, "seed": 3})
    assert req.options.params == chat.options.params and req.options.max_tokens == 7
    assert req.sources == ["instructions", "input[0]", "input[1]", "input[2]", "input[3]"]
    assert req.settings["instructions"] == "Be brief." and req.settings["metadata"] == {"run": "a"}
    assert parse_responses_request({"input": "hi"}).messages == [{"role": "user", "content": "hi"}]


def test_text_format_is_the_chat_routes_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    req = parse_responses_request({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                                      "schema": schema, "strict": True}}})
    chat = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}})
    assert req.options.params["structured_outputs"].json == chat.options.params["structured_outputs"].json
    assert "structured_outputs" not in parse_responses_request({"input": "hi",
                                                               "text": {"format": {"type": "text"}}}).options.params


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": ""}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input[0].output"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]}, "input[0].content[0]"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": 3}, None),  # range-checked when prepared (SamplingParams)
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "hi", "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": "hi", "instructions": 5}, "instructions"),
    ({"input": "hi", "store": True}, "store"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "conversation": "c"}, "conversation"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "hi", "tools": [{"type": "function", "name": "a b"}]}, "tools[0]"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "allowed_tools"}},
     "tool_choice"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "hi", "reasoning": {"effort": "low"}}, "reasoning"),
    ({"input": "hi", "top_logprobs": 2}, "top_logprobs"),
    ({"input": "hi", "stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"input": "hi", "n": 2}, "n"),
    ({"input": "hi", "messages": []}, "messages"),
])
def test_what_is_not_served_is_refused_by_name(body, param):
    if param is None:
        parse_responses_request(body)
        return
    with pytest.raises(RequestError) as info:
        parse_responses_request(body)
    assert info.value.param == param, info.value


def test_the_chat_routes_errors_name_the_requests_own_fields():
    """Errors the Request Processor raises about ``messages[i]`` name the input item it came
    from (or the instructions), an earlier call's the ``function_call`` item."""
    req = parse_responses_request({"instructions": "x", "input": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"}, {"role": "user", "content": "d"}]})
    sources, calls = req.sources, req.call_sources

    def renamed(message: str, param: str) -> tuple[str, str]:
        error = rename(RequestError(message, param), sources, calls)
        return error.param, str(error)

    assert renamed("messages[1].content[0]: images are accepted in user messages only", "messages[1].content[0]") \
        == ("input[0].content[0]", "input[0].content[0]: images are accepted in user messages only")
    assert renamed("bad", "messages[0].content") == ("instructions", "bad")
    assert renamed("messages[2].tool_calls[1].function.arguments must be a JSON object",
                   "messages[2].tool_calls[1].function.arguments") == ("input[3].arguments",
                                                                       "input[3].arguments must be a JSON object")
    assert renamed("x", "messages[2].tool_calls[0]")[0] == "input[2]"
    assert renamed("x", "messages[3].role")[0] == "input[4].role"
    assert renamed("x", "messages[4]")[0] == "input[5]"
    assert renamed("the template refused the messages", "messages") == ("input", "the template refused the input")
    assert renamed("max_tokens must be at least 1", "max_tokens")[0] == "max_output_tokens"
    assert renamed("x", "temperature")[0] == "temperature"


def test_calls_and_their_outputs_become_the_chat_routes_tool_calls_and_tool_messages():
    tools = [{"type": "function", "name": "weather", "description": "d", "strict": True,
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    req = parse_responses_request({"tools": tools, "tool_choice": {"type": "function", "name": "weather"}, "input": [
        {"role": "user", "content": "Paris?"},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "weather", "arguments": '{"city": "P"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]})
    assert req.messages == [
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "P"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    assert req.tools.mode == "named" and req.tools.name == "weather"
    assert req.tool_specs == [{"type": "function", "function": {k: v for k, v in tools[0].items() if k != "type"}}]
    assert req.settings["tools"] == tools
    auto = parse_responses_request({"tools": tools, "input": "hi", "parallel_tool_calls": False})
    assert auto.tools.mode == "auto" and not auto.tools.parallel


def _events(data: bytes) -> list[dict]:
    out = []
    for block in data.decode().split("\n\n"):
        if block:
            kind, payload = block.split("\n")
            event = json.loads(payload.removeprefix("data: "))
            assert kind == "event: " + event["type"]
            out.append(event)
    return out


def test_a_streamed_answer_is_openais_events_numbered():
    fmt = ResponsesFormat("resp_1", "m", 5, {"instructions": None})
    data = fmt.stream_start() + fmt.chunk_bytes(Output(0, "Hel", [1], None), True, None, False) \
        + fmt.chunk_bytes(Output(0, "lo \u2028", [2], "stop"), False, None, False)
    usage = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6,
             "prompt_tokens_details": {"cached_tokens": 1}}
    events = _events(data + fmt.stream_end(usage, False, failed=False))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(10))
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["output"][0]["content"][0]["text"] == "Hello \u2028"
    assert done["usage"] == {"input_tokens": 4, "input_tokens_details": {"cached_tokens": 1}, "output_tokens": 2,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 6}
    assert fmt.whole([{"text": "Hello", "finish_reason": "length"}], usage)["incomplete_details"] == \
        {"reason": "max_output_tokens"}


def test_a_stream_that_fails_ends_with_the_error_and_a_failed_response():
    fmt = ResponsesFormat("resp_1", "m", 5, {})
    data = fmt.stream_start() + fmt.chunk_bytes(Output(0, "Hi", [1], None), True, None, False)
    data += fmt.stream_error(503, RuntimeError("boom"), [0], [True], None, False)
    data += fmt.stream_end({}, False, failed=True)
    events = _events(data)
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"]["message"] == "internal server error"


def test_calls_streamed_and_whole_are_function_call_items():
    """A required call's answer: one function_call item, its arguments as generated, streamed
    piece by piece and whole, the same item either way."""
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    req = parse_responses_request({"tools": tools, "tool_choice": "required", "input": "hi"})
    pieces = ['[{"name": "f", ', '"parameters": {"a"', ': 1}}]']
    fmt = ResponsesFormat("resp_1", "m", 5, {}, req.tools)
    data = fmt.stream_start() + b"".join(
        fmt.chunk_bytes(Output(0, text, [k], "stop" if k == len(pieces) - 1 else None), k == 0, None, False)
        for k, text in enumerate(pieces))
    usage = {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
             "prompt_tokens_details": {"cached_tokens": 0}}
    events = _events(data + fmt.stream_end(usage, False, failed=False))
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    streamed = events[-1]["response"]["output"]
    assert len(streamed) == 1 and streamed[0]["type"] == "function_call" and streamed[0]["name"] == "f"
    assert streamed[0]["arguments"] == '{"a": 1}' == "".join(
        e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    whole = ResponsesFormat("resp_1", "m", 5, {}, req.tools).whole(
        [{"text": "".join(pieces), "finish_reason": "stop"}], usage)
    assert whole["status"] == "completed"
    assert [(i["type"], i["name"], i["arguments"]) for i in whole["output"]] == [("function_call", "f", '{"a": 1}')]


class _Transport:
    """A connection's transport that keeps what the delivery pass writes to it."""

    def __init__(self):
        self.writes: list[bytes] = []

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0

    def write(self, data: bytes) -> None:
        self.writes.append(data)


class _Response:
    headers = {"Transfer-Encoding": "chunked"}

    def __init__(self):
        self.writes: list[bytes] = []

    async def write(self, data: bytes) -> None:
        assert data, "an empty write"
        self.writes.append(data)


class _DirectOutputs:
    """A stand-in for ``RequestStream``: its first output goes to the handler, the rest
    through ``direct`` as a step's delivery pass writes them."""

    def __init__(self, outs):
        self.outs, self.direct, self.choices = list(outs), None, [None]
        self.num_prompt_tokens, self.num_cached_tokens, self.num_output_tokens = 3, 0, len(outs)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.direct is None and self.outs:
            return [self.outs.pop(0)]
        while self.outs:
            assert self.direct([self.outs.pop(0)])
        raise StopAsyncIteration


def test_a_token_without_events_writes_nothing(monkeypatch):
    """A token that adds nothing to a call's arguments yet (part of a character) has no event:
    nothing is written for it, where an empty HTTP/1.1 chunk would end the response's body."""
    import asyncio
    from types import SimpleNamespace

    from hydrad.server import serving

    response, transport = _Response(), _Transport()

    async def open_event_stream(request):
        return response

    monkeypatch.setattr(serving, "open_event_stream", open_event_stream)
    req = parse_responses_request({"tools": [{"type": "function", "name": "f"}], "input": "hi", "stream": True,
                                   "tool_choice": {"type": "function", "name": "f"}})
    fmt = ResponsesFormat("resp_1", "m", 5, {}, req.tools)
    outs = [Output(0, '{"a":"', [1], None), Output(0, "", [2], None), Output(0, '\u00e9"}', [3], "stop")]
    asyncio.run(serving.respond_stream(SimpleNamespace(transport=transport), fmt, req, _DirectOutputs(outs)))
    assert transport.writes and all(not w.startswith(b"0\r\n") for w in transport.writes), transport.writes
    first, *end = response.writes  # the handler's: before and after the delivery pass's
    events = _events(first + b"".join(w.split(b"\r\n", 1)[1][:-2] for w in transport.writes) + b"".join(end))
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"][0]["arguments"] == '{"a":"\u00e9"}'


def test_an_answer_with_text_and_a_call_is_a_message_then_a_function_call():
    """Under tool_choice "auto" the calls the model writes (Hermes' blocks) are read out of its
    text: the text before them is the message item, closed when the first call starts."""
    from hydrad.server.tools import ToolChoice

    pieces = ["Sure", ". <tool", '_call>\n{"name": "f", "arg', 'uments": {"a": 1}}\n</tool_call>']
    usage = {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8,
             "prompt_tokens_details": {"cached_tokens": 0}}
    fmt = ResponsesFormat("resp_1", "m", 5, {}, ToolChoice("auto", {"f": None}))
    data = fmt.stream_start() + b"".join(
        fmt.chunk_bytes(Output(0, text, [k], "stop" if k == len(pieces) - 1 else None), k == 0, None, False)
        for k, text in enumerate(pieces)) + fmt.stream_end(usage, False, failed=False)
    events = _events(data)
    added = [(e["output_index"], e["item"]["type"]) for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == [(0, "message"), (1, "function_call")] and done == [0, 1]
    # The message is done before the call is added.
    kinds = [e["type"] for e in events]
    assert kinds.index("response.output_item.done") < kinds.index("response.function_call_arguments.delta")
    whole = ResponsesFormat("resp_1", "m", 5, {}, ToolChoice("auto", {"f": None})).whole(
        [{"text": "".join(pieces), "finish_reason": "stop"}], usage)
    strip = [{k: v for k, v in item.items() if k != "call_id"} for item in whole["output"]]
    assert strip == [{k: v for k, v in item.items() if k != "call_id"} for item in events[-1]["response"]["output"]]
    assert whole["output"][0]["content"][0]["text"] == "Sure. " and whole["output"][1]["arguments"] == '{"a": 1}'


# -- kept responses ------------------------------------------------------------------------------

def test_a_kept_conversation_comes_before_the_input():
    """``previous_response_id``'s items (as ``ResponseStore.items`` gives them: inputs, and the
    answer's message and call items) become the chat messages before the request's own input;
    errors in the own input keep their names, the earlier items are named by the id."""
    prior = [{"type": "message", "id": "msg_1_in0", "role": "user",
              "content": [{"type": "input_text", "text": "Weather?"}]},
             {"type": "message", "id": "msg_1_0", "role": "assistant", "status": "completed",
              "content": [{"type": "output_text", "text": "Calling.", "annotations": [], "logprobs": []}]},
             {"type": "function_call", "id": "fc_1_1", "call_id": "c1", "name": "weather", "arguments": "{}",
              "status": "completed"}]
    body = {"instructions": "Be brief.", "previous_response_id": "resp_1",
            "input": [{"type": "function_call_output", "call_id": "c1", "output": "sunny"}]}
    req = parse_responses_request(body, keeping=True, prior=prior)
    assert req.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Calling."}],
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    assert req.sources == ["instructions", "previous_response_id", "previous_response_id", "input[0]"]
    assert req.call_sources == {(2, 0): "previous_response_id"}
    assert req.store and req.previous_id == "resp_1" and req.input_items == body["input"]
    assert req.settings["store"] is True and req.settings["previous_response_id"] == "resp_1"
    with pytest.raises(RequestError) as info:
        parse_responses_request({**body, "input": [{"role": "user", "content": 5}]}, keeping=True, prior=prior)
    assert info.value.param == "input[0].content"


def test_where_responses_are_kept_store_is_on_unless_sent_false():
    req = parse_responses_request({"input": "hi"}, keeping=True)
    assert req.store and req.settings["store"] is True
    assert req.input_items == [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
    req = parse_responses_request({"input": "hi", "store": False}, keeping=True)
    assert not req.store and req.settings["store"] is False and req.input_items == []
    assert not parse_responses_request({"input": "hi"}).store  # a server that keeps none
    for body, param in (({"store": "yes"}, "store"), ({"previous_response_id": 5}, "previous_response_id"),
                        ({"previous_response_id": ""}, "previous_response_id"), ({"conversation": "c"}, "conversation"),
                        ({"background": "yes"}, "background"), ({"background": True, "store": False}, "background"),
                        ({"background": True, "stream": True, "store": False}, "background")):
        with pytest.raises(RequestError) as info:
            parse_responses_request({"input": "hi", **body}, keeping=True)
        assert info.value.param == param, body


def test_a_background_request_is_kept_and_says_so():
    req = parse_responses_request({"input": "hi", "background": True}, keeping=True)
    assert req.background and req.store and req.settings["background"] is True and req.input_items
    req = parse_responses_request({"input": "hi", "background": False}, keeping=True)
    assert not req.background and req.settings["background"] is False
    req = parse_responses_request({"input": "hi", "background": True, "stream": True}, keeping=True)
    assert req.background and req.stream and req.store


def test_a_streamed_background_responses_log_splits_its_events_and_is_followed_by_many():
    """The log of a streamed background response: one entry per event (its sequence
    number), each follower from where it asked, until the log ends."""
    from hydrad.server.background import EventLog, follow_kept
    from hydrad.server.response_store import KeptResponse, LocalStore, ResponseStore

    def event(n: int) -> bytes:
        return b'event: e\ndata: {"n":"a\\n\\nb","sequence_number":%d}\n\n' % n

    async def main():
        log = EventLog()
        log.add(event(0) + event(1))
        assert log.events == [event(0), event(1)]

        async def read(after: int) -> bytes:
            return b"".join([data async for data in log.follow(after)])

        readers = [asyncio.create_task(read(after)) for after in (-1, 0, 1, 5)]
        for n in range(2, 7):
            await asyncio.sleep(0)
            log.add(event(n))
        log.end()
        assert await asyncio.gather(*readers) == [b"".join(map(event, range(first, 7))) for first in (0, 1, 2, 6)]
        assert [data async for data in log.follow(6)] == []  # ended: nothing follows

        # Readers written to by the log itself once their first events are out, while their
        # connections take them; one whose connection is full goes on from where it was.
        log = EventLog()
        log.add(event(0))
        taken = {"fast": [], "full": []}

        def writer(name: str, takes: int):
            def write(data: bytes) -> bool:
                if len(taken[name]) >= takes:
                    return False
                taken[name].append(data)
                return True
            return write

        async def read_direct(name: str, takes: int) -> list[bytes]:
            return [data async for data in log.follow(-1, writer(name, takes))]

        readers = [asyncio.create_task(read_direct("fast", 100)), asyncio.create_task(read_direct("full", 2))]
        await asyncio.sleep(0)
        for n in range(1, 6):
            log.add(event(n))
            await asyncio.sleep(0)
        log.end()
        fast, full = await asyncio.gather(*readers)
        assert fast == [event(0)] and taken["fast"] == [event(n) for n in range(1, 6)]
        assert full[0] == event(0) and taken["full"] == [event(1), event(2)]
        assert b"".join(full[1:]) == b"".join(map(event, range(3, 6)))  # its handler wrote the rest
        assert log._direct == []

        # From the store, as a process that does not run it reads it.
        store = ResponseStore(1 << 20)
        response = {"id": "resp_1", "status": "queued", "background": True, "output": []}
        store.start(KeptResponse.of(response, [], None), ("resp_1",), streamed=True)
        store.add_events("resp_1", [event(0), event(1)])
        kept = LocalStore(store)
        first = await kept.call("events", ("resp_1", 0))

        async def more_later():
            await asyncio.sleep(0.12)
            store.add_events("resp_1", [event(2)])
            store.finish(KeptResponse.of({**response, "status": "completed"}, [], None))

        later = asyncio.create_task(more_later())
        read = [data async for data in follow_kept(kept, "resp_1", 0, first)]
        await later
        assert read == [event(1), event(2)]

    asyncio.run(main())


def test_a_streamed_background_responses_events_reach_the_store_sooner_once_followed_there():
    """The process that runs it hands its events to the store every second while no other
    process follows it there, every 50 ms once one does (the store says so), and all of them
    before its answer."""
    from hydrad.server import background
    from hydrad.server.background import BackgroundResponses, EventLog

    async def main():
        calls = []

        class Kept:
            followed = False

            async def call(self, op, arg):
                calls.append((op, arg))
                return self.followed

        kept = Kept()
        runner, log = BackgroundResponses(kept), EventLog()
        now = asyncio.get_running_loop().time()
        log.add(b"event: a\ndata: {}\n\n")
        log.flushed_at = now - 2 * background.FLUSH_SECONDS
        await runner._flush("resp_1", log)
        assert calls == []  # 0.1 s after the last: not yet, while nobody follows it elsewhere
        log.flushed_at = now - background.UNFOLLOWED_FLUSH_SECONDS
        kept.followed = True
        await runner._flush("resp_1", log)
        assert calls == [("add_events", ("resp_1", [b"event: a\ndata: {}\n\n"]))] and log.followed
        log.add(b"event: b\ndata: {}\n\n")
        log.flushed_at = asyncio.get_running_loop().time() - 2 * background.FLUSH_SECONDS
        await runner._flush("resp_1", log)
        assert calls[-1] == ("add_events", ("resp_1", [b"event: b\ndata: {}\n\n"]))
        log.add(b"event: c\ndata: {}\n\n")
        await runner._flush("resp_1", log)  # just handed on: waits
        assert len(calls) == 2
        await runner._flush("resp_1", log, force=True)  # the answer's: at once
        assert len(calls) == 3 and log.flushed == 3

    asyncio.run(main())


def test_an_answer_is_kept_before_its_last_bytes_once_it_has_ended():
    from hydrad.server.response_store import LocalStore, ResponseStore
    from hydrad.server.responses import keep_response

    usage = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 0}}
    store = ResponseStore(1 << 20)
    req = parse_responses_request({"input": [{"role": "user", "content": "hi"},
                                            {"id": "mine", "role": "user", "content": "again"}]},
                                  keeping=True)

    async def run(fmt, stream: bool, finish: str | None, failed: bool = False):
        fmt.keep = lambda response: keep_response(LocalStore(store), req, response)
        if stream:
            fmt.stream_start()
            fmt.chunk_bytes(Output(0, "Hi", [1], finish), True, None, False)
            fmt.stream_end(usage, False, failed)
        else:
            fmt.whole([{"text": "Hi", "finish_reason": finish}], usage)
        await fmt.ended(failed)

    import asyncio

    asyncio.run(run(ResponsesFormat("resp_1", "m", 5, {}), stream=False, finish="length"))
    asyncio.run(run(ResponsesFormat("resp_2", "m", 5, {}), stream=True, finish="stop"))
    asyncio.run(run(ResponsesFormat("resp_3", "m", 5, {}), stream=True, finish=None, failed=True))
    asyncio.run(run(ResponsesFormat("resp_4", "m", 5, {}), stream=False, finish="abort"))
    assert store.get("resp_1").response["status"] == "incomplete"
    kept = store.get("resp_2")
    assert kept.response["status"] == "completed" and kept.response["output"][0]["content"][0]["text"] == "Hi"
    # Input items get ids where they came without (told apart from the output's by "in").
    assert [item["id"] for item in kept.input_items] == ["msg_2_in0", "mine"]
    assert store.get("resp_3") is None and store.get("resp_4") is None  # failed: not kept
