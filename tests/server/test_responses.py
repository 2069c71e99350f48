"""The Responses API's requests as chat requests, its errors in its own words, and its
answers' shape, whole and streamed (the route end to end, with the official client:
tests/interop/test_clients.py)."""

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
    assert req.num_leading == 1
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
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
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
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
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
    """Errors the Request Processor raises about ``messages[i]`` name ``input[i]`` (or the
    instructions, messages[0] when they are sent)."""
    error = rename(RequestError("messages[2].content[0]: images are accepted in user messages only",
                                "messages[2].content[0]"), 1)
    assert (error.param, str(error)) == ("input[1].content[0]",
                                         "input[1].content[0]: images are accepted in user messages only")
    assert rename(RequestError("bad", "messages[0].content"), 1).param == "instructions"
    assert rename(RequestError("messages[0].content bad", "messages[0].content"), 0).param == "input[0].content"
    assert rename(RequestError("the template refused the messages", "messages"), 0).param == "input"
    assert rename(RequestError("x", "temperature"), 0).param == "temperature"


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
    usage = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 1}}
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
