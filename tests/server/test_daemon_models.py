"""``hydrad start --model`` on LLaVA-NeXT, Qwen2-VL and Qwen2.5-VL: chat completions with images
(and, on the Qwen families, a video file) over HTTP give transformers' greedy tokens, and
``/v1/models`` names the architecture.

One daemon per family, each in a deployment that migrates (so image layouts and M-RoPE
positions cross worker processes), each worker fitting its latency model at start on the
family's own probe images.
"""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from factories import (hf_inputs, hf_model, http_get_stub, image, mp4, photo_frames, text, video_hf_inputs,
                       video_url)

from daemon_process import Daemon, http

pytestmark = pytest.mark.slow

MAX_TOKENS = 10
# family -> (architecture, model_type, deployment, devices)
FAMILIES = {
    "llava-next": ("LlavaNextForConditionalGeneration", "llava_next", "1EP+1D", "cpu:2"),
    "qwen2-vl": ("Qwen2VLForConditionalGeneration", "qwen2_vl", "1E+1PD", "cpu:2"),
    "qwen2.5-vl": ("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", "1E+1PD", "cpu:2"),
}


def _conversations() -> list[list[dict]]:
    """Two images of different sizes in one turn, text only, an image in a multi-turn chat."""
    return [
        [{"role": "user", "content": [image(120, 80, 1), text("Compare these:"), image(60, 150, 2)]}],
        [{"role": "user", "content": "Write a short poem about the sea."}],
        [
            {"role": "user", "content": [image(200, 90, 3), text("What is this?")]},
            {"role": "assistant", "content": "A bus."},
            {"role": "user", "content": "What colour is it?"},
        ],
    ]


def _openai_messages(conversation: list[dict]) -> list[dict]:
    """The conversation as an API client sends it: images as PNG data URLs (lossless, so the
    daemon decodes the pixels the reference sees)."""
    messages = []
    for message in conversation:
        content = message["content"]
        if isinstance(content, list):
            parts = []
            for part in content:
                if part["type"] == "image":
                    buf = io.BytesIO()
                    part["image"].save(buf, format="PNG")
                    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
                    part = {"type": "image_url", "image_url": {"url": url}}
                parts.append(part)
            content = parts
        messages.append({"role": message["role"], "content": content})
    return messages


def _reference(path, conversations) -> list[list[int]]:
    from hydrad.models.hf_processor import load_hf_processor
    from hydrad.models.loader import load_config

    hf = hf_model(path)
    processor = load_hf_processor(path, load_config(path).model_type)
    tokens = []
    for conv in conversations:
        inputs = hf_inputs(processor, conv)
        with torch.no_grad():
            out = hf.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS, pad_token_id=0)
        tokens.append(out[0, inputs["input_ids"].shape[1]:].tolist())
    return tokens


def _check_videos(client, model: str, path, family: str) -> None:
    """A video file in a chat, as a data URL or fetched from a URL, gives the tokens transformers
    gives for its frames as the daemon decodes them; a damaged one, or a video to a model that
    takes none, gets a 400 and the daemon goes on serving."""
    from hydrad.processor import InputProcessor

    data = mp4(photo_frames(30, 48, 64, 4), fps=10)
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": video_url(data)}},
                                             text("What happens?")]}]
    if family.startswith("qwen"):
        processor = InputProcessor(path)
        prompt = processor.process_chat(messages)
        with torch.no_grad():
            out = hf_model(path).generate(**video_hf_inputs(processor, prompt), do_sample=False,
                                          max_new_tokens=MAX_TOKENS, pad_token_id=0)
        expected = out[0, len(prompt.prompt_token_ids):].tolist()
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                               extra_body={"return_token_ids": True})
        assert reply.choices[0].token_ids == expected
        # The same file from a URL ([server.remote_images] enabled): fetched, then the same video.
        with http_get_stub(lambda path: data if path == "/clip.mp4" else None, "video/mp4") as root:
            remote = [{**messages[0], "content": [{"type": "video_url", "video_url": {"url": root + "/clip.mp4"}},
                                                  messages[0]["content"][1]]}]
            reply = client.chat.completions.create(model=model, messages=remote, max_tokens=MAX_TOKENS,
                                                   temperature=0, extra_body={"return_token_ids": True})
        assert reply.choices[0].token_ids == expected
        messages[0]["content"][0]["video_url"]["url"] = video_url(data[: len(data) // 3])
        refusal = "not a video file that can be read|damaged or truncated"
    else:
        refusal = "does not take videos"
    with pytest.raises(openai.BadRequestError, match=refusal):
        client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS)
    assert client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=2).choices[0].finish_reason


def _regex_of(text: str) -> str:
    return "".join("\\" + c if c in ".^$|?*+()[]{}\\" else "\\n" if c == "\n" else c for c in text)


def _check_tools(client, model: str, family: str) -> None:
    """tool_choice "auto": the Qwen families' templates ask for Hermes' <tool_call> blocks, read
    back from the answer (here forced by a regex) as calls, whole and streamed; the call and
    its result go in the next turn's prompt. LLaVA-NeXT's template has no tool calls: refused."""
    import json

    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    if not family.startswith("qwen"):
        with pytest.raises(openai.BadRequestError, match='tool_choice "auto"'):
            client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=4)
        return
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    forced = dict(model=model, messages=messages, tools=tools, max_tokens=200, temperature=0,
                  extra_body={"structured_outputs": {"regex": _regex_of("Sure." + call)}})
    reply = client.chat.completions.create(**forced)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    (tool_call,) = choice.message.tool_calls
    assert tool_call.function.name == "weather" and json.loads(tool_call.function.arguments) == {"city": "Oslo"}
    content, calls, reasons = "", {}, []
    for chunk in client.chat.completions.create(**forced, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:  # the arguments in pieces, as generated
            name, arguments = calls.get(part.index, (part.function.name, ""))
            calls[part.index] = (name, arguments + (part.function.arguments or ""))
        reasons.append(chunk.choices[0].finish_reason)
    assert content == "Sure." and reasons[-1] == "tool_calls"
    assert list(calls.values()) == [("weather", tool_call.function.arguments)]
    # Without parallel calls the answer ends with its first call (the model would write two).
    twice = {**forced, "extra_body": {"structured_outputs": {"regex": _regex_of(call + call + "Done.")}}}
    single = client.chat.completions.create(**twice, parallel_tool_calls=False).choices[0]
    assert single.finish_reason == "tool_calls" and len(single.message.tool_calls) == 1
    assert len(client.chat.completions.create(**twice).choices[0].message.tool_calls) == 2
    with pytest.raises(openai.BadRequestError, match="at most 15 stop strings"):  # that stop string's room
        client.chat.completions.create(**twice, parallel_tool_calls=False, stop=[str(i) for i in range(16)])
    follow = messages + [{"role": "assistant", "content": None, "tool_calls": [tool_call.model_dump()]},
                         {"role": "tool", "tool_call_id": tool_call.id, "content": "sunny"}]
    again = client.chat.completions.create(model=model, messages=follow, tools=tools, max_tokens=3, temperature=0)
    assert again.usage.prompt_tokens > reply.usage.prompt_tokens and again.choices[0].finish_reason
    # /tokenize renders the tools as the chat route does: the ids it prefills.
    root = str(client.base_url).rstrip("/").removesuffix("/v1")
    tokenized = http("POST", root + "/tokenize", json.dumps({"messages": follow, "tools": tools}).encode(),
                     {"Content-Type": "application/json", "Authorization": f"Bearer {client.api_key}"}).json()
    assert tokenized["count"] == again.usage.prompt_tokens
    bare = http("POST", root + "/tokenize", json.dumps({"messages": follow}).encode(),
                {"Content-Type": "application/json", "Authorization": f"Bearer {client.api_key}"}).json()
    assert bare["count"] < tokenized["count"]  # the template's tool list is in the first
    # The Responses API: the same answer as items (its text a message, its call a function_call,
    # whole and streamed), and the call and its output as input items, the chat route's prompt.
    responses_tools = [{"type": "function", **tools[0]["function"]}]
    asked = dict(model=model, input="Weather in Oslo?", tools=responses_tools, max_output_tokens=200, temperature=0,
                 extra_body=forced["extra_body"])
    whole = client.responses.create(**asked)
    assert [item.type for item in whole.output] == ["message", "function_call"] and whole.status == "completed"
    assert whole.output[0].content[0].text == "Sure." and whole.output[1].name == "weather"
    assert whole.output[1].arguments == tool_call.function.arguments
    events = list(client.responses.create(**asked, stream=True))
    assert [(i.type, getattr(i, "arguments", None)) for i in events[-1].response.output] == \
        [("message", None), ("function_call", tool_call.function.arguments)]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Sure."
    next_turn = client.responses.create(model=model, tools=responses_tools, max_output_tokens=3, temperature=0, input=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": tool_call.id, "name": "weather",
         "arguments": tool_call.function.arguments},
        {"type": "function_call_output", "call_id": tool_call.id, "output": "sunny"}])
    assert next_turn.usage.input_tokens == again.usage.prompt_tokens


@pytest.mark.parametrize("family", list(FAMILIES))
def test_daemon_serves_the_family(tiny_checkpoint, tmp_path, family):
    architecture, model_type, deploy, devices = FAMILIES[family]
    path = tiny_checkpoint(family)
    conversations = _conversations()
    reference = _reference(path, conversations)
    config = tmp_path / "hydrad.toml"
    # Pools of a few MB (the tiny models need no more): allocating and sharing the default ones
    # between workers takes seconds on a small machine.
    config.write_text("[cache]\nkv_cache_memory_mb = 32\nimage_cache_memory_mb = 16\n"
                      "[server.remote_images]\nenabled = true\n")
    daemon = Daemon(["--model", str(path), "--config", str(config), "--devices", devices, "--deploy", deploy],
                    tmp_path / "hydrad.log")
    try:
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)
        card = client.models.list().data[0]
        assert (card.id, card.architecture, card.model_type) == (path.name, architecture, model_type)

        def ask(conv):
            return client.chat.completions.create(
                model=card.id, messages=_openai_messages(conv), max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"return_token_ids": True})

        with ThreadPoolExecutor(len(conversations)) as pool:  # in flight together, batched by the workers
            replies = list(pool.map(ask, conversations))
        for i, (reply, expected) in enumerate(zip(replies, reference)):
            assert reply.choices[0].token_ids == expected, f"{family}: conversation {i}"
        _check_videos(client, card.id, path, family)
        _check_tools(client, card.id, family)
        # Each worker fitted its latency model at start; the encoding one on the family's images.
        instances = http("GET", daemon.url + "/admin/status").json()["instances"]
        assert all(i["latency_model"] for i in instances)
        assert any("/image" in i["latency_model"] for i in instances)
    finally:
        assert daemon.stop() == 0, daemon.log()
