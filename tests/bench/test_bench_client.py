"""How the client tells token chunks from role announcements and closing chunks."""

import pytest

from hydrad.bench.client import Chunk, carries_token, text_of, token_chunks


def choice(delta, finish_reason=None):
    return {"index": 0, "delta": delta, "finish_reason": finish_reason}


@pytest.mark.parametrize(
    "delta, finish_reason, expected",
    [
        ({"content": " a"}, None, True),
        ({"reasoning_content": "hm"}, None, True),
        ({"content": ""}, None, True),  # a token without text of its own, mid-stream
        ({}, None, True),
        ({"content": ""}, "length", True),  # the last token, without text (vLLM, hydrad)
        ({"role": "assistant", "content": ""}, None, False),  # a bare role announcement
        ({"role": "assistant", "content": "Hi"}, None, True),  # hydrad: the role with the first token
        ({"role": "assistant", "content": ""}, "length", True),  # a one-token answer
        ({}, "length", False),  # SGLang's closing chunk
        ({"role": None, "content": None}, "length", False),  # the same, serialized with nulls
        ({"role": None, "content": " a"}, None, True),
    ],
)
def test_carries_token_judges_the_delta(delta, finish_reason, expected):
    assert carries_token(choice(delta, finish_reason)) is expected


def test_token_ids_decide_whether_a_role_chunk_carries_a_token():
    hydrad = [Chunk(0.5, False, num_token_ids=1), Chunk(0.6, True, num_token_ids=2, num_chars=5)]
    assert token_chunks(hydrad, 3) == ([0.5, 0.6], [1, 2], [0, 5])
    vllm = [Chunk(0.1, False), Chunk(0.5, True, num_token_ids=1), Chunk(0.6, True, num_token_ids=2)]
    assert token_chunks(vllm, 3) == ([0.5, 0.6], [1, 2], [0, 0])


def test_per_chunk_usage_gives_the_tokens_each_chunk_adds():
    chunks = [Chunk(0.1, False, cumulative_tokens=0), Chunk(0.5, True, cumulative_tokens=1),
              Chunk(0.6, True, cumulative_tokens=1), Chunk(0.8, True, cumulative_tokens=4)]
    assert token_chunks(chunks, 4) == ([0.5, 0.8], [1, 3], [0, 0])


def test_without_exact_counts_the_deltas_decide():
    chunks = [Chunk(0.1, False), Chunk(0.5, True, num_chars=3), Chunk(0.6, True, num_chars=7), Chunk(0.7, False)]
    assert token_chunks(chunks, 5) == ([0.5, 0.6], [None, None], [3, 7])


def test_textless_stream_is_timed_by_its_role_and_closing_chunks():
    chunks = [Chunk(0.1, False), Chunk(0.7, False)]
    assert token_chunks(chunks, 5) == ([0.1, 0.7], [None, None], [0, 0])
    assert token_chunks(chunks, None) == ([], [], [])


def test_text_of_a_choice_includes_reasoning():
    delta = {"role": "assistant", "reasoning_content": "hm ", "content": "yes"}
    assert text_of(choice(delta)) == "hm yes" and text_of(choice({"content": None})) == ""


@pytest.mark.parametrize("style", ["vllm", "hydrad"])
def test_an_answer_of_another_length_than_asked_or_cut_short_is_an_error(server_url, style):
    """The bench asks for exactly ``max_tokens`` tokens (``ignore_eos``): an answer with more or
    fewer, or one that ends without ``[DONE]``, is a failed request, not a measured one."""
    import asyncio

    import aiohttp

    from hydrad.bench.client import chat_payload, stream_chat
    from hydrad.bench.workloads import RequestSpec

    directives = "token_ids=1 style=hydrad" if style == "hydrad" else "usage=chunk"

    async def ask(words: str):
        body = chat_payload("fake-model", RequestSpec(f"{directives} {words} tbt=0.001", 5), [])
        async with aiohttp.ClientSession() as session:
            return await stream_chat(session, server_url + "/v1/chat/completions", body, {}, 10.0)

    async def main():
        return [await ask(w) for w in ("", "extra=1", "extra=-2", "cut=3")]

    exact, more, fewer, cut = asyncio.run(main())
    assert exact.error is None and exact.completion_tokens == 5
    assert more.error == "the answer had 6 token(s) for max_tokens 5 with ignore_eos"
    assert fewer.error == "the answer had 3 token(s) for max_tokens 5 with ignore_eos"
    assert cut.error == "the stream ended without [DONE] after 3 token(s)"


def test_a_responses_payload_is_the_chat_payloads_request_as_input_items():
    import json

    from hydrad.bench.client import responses_payload
    from hydrad.bench.workloads import RequestSpec

    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    payload = responses_payload("m", RequestSpec("Describe it.", 7), ["data:image/png;base64,AA"],
                                {"temperature": 0.7, "top_k": 5, "response_format": schema})
    body = json.loads(payload)
    assert payload.responses and payload.output_tokens == 7
    assert body["input"] == [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"},
                                                           {"type": "input_text", "text": "Describe it."}]}]
    assert (body["max_output_tokens"], body["temperature"], body["top_k"]) == (7, 0.7, 5)
    assert body["ignore_eos"] and body["stream"] and body["store"] is False and "response_format" not in body
    assert body["text"] == {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}
    body = json.loads(responses_payload("m", RequestSpec("hi", 2), [], {"response_format": {"type": "json_object"}}))
    assert body["text"] == {"format": {"type": "json_object"}}
