"""Tool calls read back from an answer in Hermes' format (``tool_choice: "auto"``): whole, and
streamed however the text is cut, the same calls and the same content."""

from __future__ import annotations

import json
import random

import pytest

from hydrad.tool_calls import HermesCalls, format_of, read_answer

CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "days": [1, 2]}}\n</tool_call>'
ANSWERS = [
    "No call here, just words <tool and a < sign.",
    CALL,
    "Let me look.\n" + CALL + "\n" + CALL.replace("Oslo", "Bergen \\u00e6 <tool_call>"),
    '<tool_call>{"name": "now", "parameters": {}}</tool_call> then text',
    '<tool_call>{"name": "now", "arguments": "{\\"raw\\": 1}"}</tool_call>',
    "Broken: <tool_call>{not json}</tool_call> and " + CALL,
    "Cut: " + CALL + ' <tool_call>{"name": "wea',
    "ends with a partial tag <tool_ca",
    'Stopped after the JSON: <tool_call>\n{"name": "now", "arguments": {}}\n',
    '<tool_call>{"arguments": {"x": "}"}, "name": "late"}</tool_call><tool_call>{"name": "f", "arguments": 3}',
    'Cut in the arguments: <tool_call>{"name": "f", "arguments": {"a": [1, "x\\"}',
]


def test_a_whole_answer_splits_into_content_and_calls():
    content, calls = read_answer(ANSWERS[2])
    assert content == "Let me look.\n\n"
    assert [c["function"]["name"] for c in calls] == ["weather", "weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "days": [1, 2]}
    assert json.loads(calls[1]["function"]["arguments"])["city"] == "Bergen \u00e6 <tool_call>"
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    # Only whitespace beside the calls: no content.
    content, calls = read_answer(CALL)
    assert content is None and len(calls) == 1
    assert read_answer(ANSWERS[0]) == (ANSWERS[0], [])
    # "parameters" is read as "arguments"; arguments given as a string stay that string.
    assert read_answer(ANSWERS[3])[1][0]["function"] == {"name": "now", "arguments": "{}"}
    assert read_answer(ANSWERS[4])[1][0]["function"]["arguments"] == '{"raw": 1}'


def test_what_is_not_a_call_stays_content():
    content, calls = read_answer(ANSWERS[5])
    assert content == "Broken: <tool_call>{not json}</tool_call> and " and len(calls) == 1
    content, calls = read_answer(ANSWERS[6])  # cut inside the second block
    assert content == 'Cut:  <tool_call>{"name": "wea' and len(calls) == 1
    assert read_answer('<tool_call>["weather"]</tool_call>') == ('<tool_call>["weather"]</tool_call>', [])
    assert read_answer(ANSWERS[7]) == (ANSWERS[7], [])
    # A last block whose closing tag never came is a call where its text is one.
    content, calls = read_answer(ANSWERS[8])
    assert content == "Stopped after the JSON: " and calls[0]["function"] == {"name": "now", "arguments": "{}"}


@pytest.mark.parametrize("answer", ANSWERS)
def test_streamed_content_and_calls_are_the_whole_answers_however_the_text_is_cut(answer):
    whole = HermesCalls()
    whole.take(answer, final=True)
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(len(answer) + 1), rng.randint(0, 12)))
        pieces = [answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)])]
        stream, content, calls = HermesCalls(), "", []
        for i, piece in enumerate(pieces):
            sent, deltas = stream.take(piece, final=i == len(pieces) - 1)
            content += sent
            add_deltas(calls, deltas)
        assert content == whole.content
        assert calls == [c["function"] for c in whole.calls]


def add_deltas(calls: list[dict], deltas: list[dict]) -> None:
    """A client's reading of one chunk's ``tool_calls`` deltas into ``calls``: a call's first
    delta has its id, type and name; the next ones only pieces of its arguments."""
    assert len({d["index"] for d in deltas}) == len(deltas)  # one delta per call in a chunk
    for delta in deltas:
        if delta["index"] == len(calls):
            assert delta["type"] == "function" and delta["id"].startswith("call_")
            calls.append(dict(delta["function"]))
        else:
            assert delta["index"] == len(calls) - 1 and set(delta) == {"index", "function"}
            assert set(delta["function"]) == {"arguments"}
            calls[-1]["arguments"] += delta["function"]["arguments"]


def test_a_calls_arguments_stream_as_they_are_generated():
    stream = HermesCalls()
    assert stream.feed('Sure. <tool_call>\n{"name": "weather", "argu') == ("Sure. ", [])
    _, deltas = stream.feed('ments": {"city": "Os')
    assert deltas == [{"index": 0, "id": stream.calls[0]["id"], "type": "function",
                       "function": {"name": "weather", "arguments": '{"city": "Os'}}]
    assert stream.feed('lo"}}\n</tool') == ("", [{"index": 0, "function": {"arguments": 'lo"}'}}])
    assert stream.feed('_call>') == ("", [])
    # A second call, and its arguments cut by max_tokens: a call with what was generated.
    _, deltas = stream.take('<tool_call>{"name": "now", "arguments": {"tz": "U', final=True)
    assert deltas[0]["index"] == 1 and deltas[0]["function"] == {"name": "now", "arguments": '{"tz": "U'}
    assert [c["function"]["arguments"] for c in stream.calls] == ['{"city": "Oslo"}', '{"tz": "U']
    assert stream.content == "Sure. " and stream.finish_reason("length") == "length"


def test_a_block_not_in_the_streamed_shape_is_read_whole_when_it_closes():
    # The arguments before the name, or not an object: nothing goes out until the block closes.
    for block, arguments in (('{"arguments": {"a": "}"}, "name": "f"}', '{"a": "}"}'),
                             ('{"name": "f", "arguments": "{\\"a\\": 1}"}', '{"a": 1}'),
                             ('{"name": "f", "arguments": 7}', "7")):
        stream = HermesCalls()
        assert stream.feed("<tool_call>" + block) == ("", [])
        content, deltas = stream.feed("</tool_call>")
        assert content == "" and deltas[0]["function"] == {"name": "f", "arguments": arguments}, block


def test_text_that_may_start_a_block_is_held_until_it_does_or_cannot():
    stream = HermesCalls()
    assert stream.feed("abc <tool") == ("abc ", [])
    assert stream.feed("_x") == ("<tool_x", [])
    assert stream.feed("<tool_call>{\"name\": \"f\"") == ("", [])
    content, deltas = stream.feed(", \"arguments\": {}}</tool_call>!")
    assert content == "!" and deltas[0]["function"] == {"name": "f", "arguments": "{}"}
    assert stream.finish_reason("stop") == "tool_calls" and stream.finish_reason("length") == "length"
    assert HermesCalls().finish_reason("stop") == "stop"


def test_the_format_a_chat_template_asks_for():
    assert format_of("... <tool_call>\\n{...}\\n</tool_call> ...") == "hermes"
    assert format_of("{{ messages }}") is None and format_of(None) is None


def test_offline_chat_puts_tools_in_the_template_and_the_calls_come_back_in_the_text(tiny_checkpoint, tmp_path):
    from hydrad import LLM, SamplingParams
    from hydrad.models.chat_templates import QWEN2_VL_CHAT_TEMPLATE

    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    regex = "".join("\\" + c if c in ".^$|?*+()[]{}\\" else "\\n" if c == "\n" else c for c in call)
    with LLM(str(tiny_checkpoint("qwen2-vl"))) as llm:
        plain, with_tools = (llm.chat(messages, SamplingParams(max_tokens=2), tools=t, use_tqdm=False)[0]
                             for t in (None, tools))
        assert len(with_tools.prompt_token_ids) > len(plain.prompt_token_ids) + 50  # the tools' system turn
        out = llm.chat(messages, SamplingParams(max_tokens=200, temperature=0.0, structured_outputs={"regex": regex}),
                       tools=tools, use_tqdm=False)[0]
    content, calls = read_answer(out.text)
    assert content is None and calls[0]["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    # A template of one's own, for a checkpoint without tools (the default LLaVA's).
    path = tmp_path / "tools.jinja"
    path.write_text(QWEN2_VL_CHAT_TEMPLATE)
    from hydrad.processor import InputProcessor

    assert InputProcessor(tiny_checkpoint("llava")).tool_call_format is None
    with LLM(str(tiny_checkpoint("llava")), chat_template=str(path)) as llm:
        assert llm.processor.tool_call_format == "hermes"
        assert llm.chat(messages, SamplingParams(max_tokens=2), tools=tools, use_tqdm=False)[0].finish_reason
