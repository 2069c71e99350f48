"""Tool calls as structured outputs: the request's tools and tool_choice, the language they
constrain the answer to, and the answer's text as tool calls, whole and streamed."""

from __future__ import annotations

import json
import random

import pytest

from hydrad.errors import RequestError
from hydrad.server.protocol import parse_chat_request
from hydrad.server.serving import ResponseFormat
from hydrad.server.engine_client import Output
from hydrad.server.tools import ToolCallStream, ToolChoice, parse_tools

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The weather.", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return parse_chat_request({"messages": MESSAGES, **fields})


def test_a_named_function_constrains_the_answer_to_its_parameters():
    req = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "weather"}})
    assert req.tools.mode == "named" and req.tools.name == "weather"
    language = req.options.params["structured_outputs"]
    assert language.json == WEATHER
    no_params = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}})
    assert no_params.options.params["structured_outputs"].json == {"type": "object"}


def test_required_constrains_the_answer_to_an_array_of_calls_of_the_tools():
    schema = chat(tools=TOOLS, tool_choice="required").options.params["structured_outputs"].json
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    calls = schema["items"]["anyOf"]
    assert [c["properties"]["name"] for c in calls] == [{"enum": ["weather"]}, {"enum": ["now"]}]
    assert calls[0]["properties"]["parameters"] == WEATHER and calls[0]["required"] == ["name", "parameters"]
    single = chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert single.options.params["structured_outputs"].json["maxItems"] == 1


def test_references_in_a_tools_parameters_are_hoisted_to_the_root():
    params = {"type": "object", "properties": {"at": {"$ref": "#/$defs/place"}},
              "$defs": {"place": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "go", "parameters": params}}]
    schema = chat(tools=tools, tool_choice="required").options.params["structured_outputs"].json
    assert schema["$defs"] == {"place": {"type": "string"}}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert "$defs" in params  # the request's own schema is not changed
    clash = [*tools, {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "$defs": {"place": {"type": "integer"}}}}}]
    with pytest.raises(RequestError, match=r"define \$place differently"):
        chat(tools=clash, tool_choice="required")


def test_auto_is_the_default_with_tools_and_leaves_the_answer_free():
    for fields in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        req = chat(**fields)
        assert req.tools.mode == "auto" and set(req.tools.tools) == {"weather", "now"}
        assert "structured_outputs" not in req.options.params and req.tool_specs == TOOLS
    # The answer may still be constrained: a structured output beside "auto" (its calls read from it).
    constrained = chat(tools=TOOLS, structured_outputs={"regex": "<tool_call>.*</tool_call>"})
    assert constrained.tools.mode == "auto" and constrained.options.params["structured_outputs"].regex


def test_none_and_no_tools_leave_the_answer_free():
    for fields in ({}, {"tools": TOOLS, "tool_choice": "none"}, {"tool_choice": "none"}):
        req = chat(**fields)
        assert req.tools is None and "structured_outputs" not in req.options.params


@pytest.mark.parametrize("fields, param, message", [
    ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"tools": [], "tool_choice": "required"}, "tools", "tools must be an array of 1 to 128 tools"),
    ({"tools": {"type": "function"}, "tool_choice": "required"}, "tools", "tools must be an array"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools[0]", 'must be {"type": "function"'),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "required"}, "tools[0]",
     "letters, digits"),
    ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools[1]", "two tools are named 'weather'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}], "tool_choice": "required"},
     "tools[0]", "parameters must be a JSON schema object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
      "tool_choice": "required"}, "tools", "the tools' parameters are not valid"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice",
     "'missing', which is not one of the tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", 'tool_choice must be "none", "required"'),
    ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "yes"}, "parallel_tool_calls",
     "must be a boolean"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "not both"),
    ({"functions": [{"name": "f"}]}, "functions", "deprecated form of tools"),
])
def test_bad_tools_are_refused_by_name(fields, param, message):
    with pytest.raises(RequestError, match=None) as e:
        chat(**fields)
    assert e.value.param == param and message in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


REQUIRED = ToolChoice("required", {"weather": WEATHER, "now": None})
ANSWERS = [
    '[{"name": "weather", "parameters": {"city": "Oslo, \\"NO\\" {]", "unit": "c"}}, {"name":"now","parameters":{}}]',
    '[ { "name" : "now" , "parameters" : { } } ]',
    '[{"name": "weather", "parameters": {"city": "a\\\\"}}, {"name": "weather", "parameters": {"city": "[x]"}}',
]


@pytest.mark.parametrize("answer", ANSWERS)
def test_streamed_calls_are_the_whole_answers_calls_however_the_text_is_cut(answer):
    whole = REQUIRED.calls(answer)
    assert [c["function"]["name"] for c in whole] == [c["name"] for c in _loads_calls(answer)]
    for call, expected in zip(whole, _loads_calls(answer)):
        assert json.loads(call["function"]["arguments"]) == expected["parameters"]
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(len(answer) + 1), rng.randint(0, 12)))
        stream, calls = ToolCallStream(REQUIRED), {}
        for piece in (answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)])):
            for delta in stream.feed(piece):
                if "id" in delta:  # a call's first delta names it
                    assert delta["index"] == len(calls) and delta["type"] == "function"
                    calls[delta["index"]] = {"id": delta["id"], "name": delta["function"]["name"], "arguments": ""}
                calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
        assert [(c["name"], c["arguments"]) for c in calls.values()] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in whole]
        assert len({c["id"] for c in calls.values()}) == len(calls)


def _loads_calls(answer: str) -> list[dict]:
    try:
        return json.loads(answer)
    except json.JSONDecodeError:  # cut short: the calls complete in it
        return json.loads(answer[: answer.rindex("}") + 1] + "]")


def test_the_response_carries_tool_calls_whole_and_streamed():
    named = ToolChoice("named", {"weather": WEATHER}, name="weather")
    fmt = ResponseFormat(True, "chatcmpl-1", "m", False, tools=named)
    body = fmt.whole([{"text": '{"city": "Oslo"}', "token_ids": [1], "finish_reason": "stop", "logprobs": None}],
                     {"prompt_tokens": 1})
    message = body["choices"][0]["message"]
    assert message["content"] is None and body["choices"][0]["finish_reason"] == "stop"
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    first = json.loads(fmt.chunk_bytes(Output(0, '{"city"', [1], None), True, None, False)[6:])
    delta = first["choices"][0]["delta"]
    assert delta["role"] == "assistant" and delta["tool_calls"][0]["function"] == {"name": "weather",
                                                                                 "arguments": '{"city"'}
    last = json.loads(fmt.chunk_bytes(Output(0, ': "Oslo"}', [2], "stop"), False, None, False)[6:])
    assert last["choices"][0]["delta"] == {"tool_calls": [{"index": 0, "function": {"arguments": ': "Oslo"}'}}]}

    required = ResponseFormat(True, "chatcmpl-2", "m", False, tools=REQUIRED)
    body = required.whole([{"text": ANSWERS[1], "token_ids": [1], "finish_reason": "stop", "logprobs": None}], {})
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in body["choices"][0]["message"]["tool_calls"]] == ["now"]
    cut = required.whole([{"text": '[{"name": "wea', "token_ids": [1], "finish_reason": "length", "logprobs": None}],
                         {})
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["choices"][0]["message"] == {"role": "assistant", "content": '[{"name": "wea', "tool_calls": []}
    # Cut inside the second call's arguments: both calls, the second's arguments as far as they go.
    text = '[{"name": "now", "parameters": {}}, {"name": "weather", "parameters": {"city": "Os'
    cut = required.whole([{"text": text, "token_ids": [1], "finish_reason": "length", "logprobs": None}], {})
    calls = cut["choices"][0]["message"]["tool_calls"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [("now", "{}"), ("weather", '{"city": "Os')]
    assert cut["choices"][0]["message"]["content"] is None and cut["choices"][0]["finish_reason"] == "length"


def test_auto_answers_carry_content_and_the_calls_read_from_them():
    auto = chat(tools=TOOLS).tools
    fmt = ResponseFormat(True, "chatcmpl-3", "m", False, tools=auto)
    text = 'Checking.<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    body = fmt.whole([{"text": text, "token_ids": [1], "finish_reason": "stop", "logprobs": None},
                      {"text": "No call.", "token_ids": [1], "finish_reason": "stop", "logprobs": None}], {})
    first, second = body["choices"]
    assert first["finish_reason"] == "tool_calls" and first["message"]["content"] == "Checking."
    assert first["message"]["tool_calls"][0]["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    assert second["finish_reason"] == "stop" and second["message"] == {"role": "assistant", "content": "No call.",
                                                                       "tool_calls": []}
    # Streamed: every chunk has content (empty inside a call), the call whole when its block closes.
    pieces = ["Checking.<tool", '_call>{"name": "weather", ', '"arguments": {"city": "Oslo"}}</tool_call>']
    chunks = [json.loads(fmt.chunk_bytes(Output(1, piece, [i], "stop" if i == 2 else None), i == 0, None, False)[6:])
              for i, piece in enumerate(pieces)]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": "Checking."} and deltas[1] == {"content": ""}
    assert deltas[2]["content"] == "" and deltas[2]["tool_calls"][0]["function"]["name"] == "weather"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "tool_calls"]
    # An answer cut inside a call: the block's text goes out as content at the end, no call.
    cut = ResponseFormat(True, "chatcmpl-4", "m", False, tools=auto)
    out = [json.loads(cut.chunk_bytes(Output(0, piece, [0], reason), first, None, False)[6:])["choices"][0]
           for piece, reason, first in (("<tool_call>{", None, True), ('"na', "length", False))]
    assert "".join(o["delta"]["content"] for o in out) == '<tool_call>{"na' and out[1]["finish_reason"] == "length"
    assert "tool_calls" not in out[1]["delta"]


def test_auto_prepares_the_request_for_the_models_format():
    """Under "auto": a template without a format is refused; special-token tags stay in the
    text; without parallel calls the end of a call is a stop string, where there is room."""
    auto = chat(tools=TOOLS)
    assert auto.tools.mode == "auto"
    with pytest.raises(RequestError, match="asks for none") as info:
        auto.tools.prepare(auto.options.params, None, False)
    assert info.value.param == "tool_choice"
    params = {"stop": ["x"]}
    auto.tools.prepare(params, "hermes", True)
    assert params == {"stop": ["x"], "skip_special_tokens": False}
    single = chat(tools=TOOLS, parallel_tool_calls=False, stop=["x"], skip_special_tokens=True)
    params = single.options.params
    single.tools.prepare(params, "hermes", True)
    assert params["stop"] == ["x", "</tool_call>"] and params["skip_special_tokens"] is True  # the request's own
    full = chat(tools=TOOLS, parallel_tool_calls=False, stop=[str(i) for i in range(16)])
    with pytest.raises(RequestError, match="at most 15 stop strings"):
        full.tools.prepare(full.options.params, "hermes", False)
    # A constraining tool choice asks nothing of the format.
    required = chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    before = dict(required.options.params)
    required.tools.prepare(required.options.params, None, True)
    assert required.options.params == before
