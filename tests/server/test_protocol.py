import pytest

from hydrad.errors import RequestError
from hydrad.server.protocol import MAX_PROMPTS, parse_chat_request, parse_completion_request

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return parse_chat_request({"messages": MESSAGES, **fields})


def test_chat_fields_become_sampling_params():
    req = chat(model="m", max_completion_tokens=5, max_tokens=99, temperature=0, top_p=0.5, top_k=3, seed=1,
               stop="x", ignore_eos=True, stream=True, stream_options={"include_usage": True},
               return_token_ids=True)
    assert (req.model, req.stream, req.include_usage, req.return_token_ids) == ("m", True, True, True)
    params = req.options.to_params(num_prompt_tokens=10, max_model_len=100, prompt_param="messages")
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed) == (5, 0.0, 0.5, 3, 1)
    assert params.stop == ["x"] and params.ignore_eos


@pytest.mark.parametrize("stream_options, include, continuous", [
    (None, False, False),
    ({"include_usage": True}, True, False),
    ({"include_usage": True, "continuous_usage_stats": True}, True, True),
    # As vLLM: usage in every chunk only together with the final usage.
    ({"continuous_usage_stats": True}, False, False),
])
def test_stream_options(stream_options, include, continuous):
    req = chat(stream=True, stream_options=stream_options)
    assert (req.include_usage, req.continuous_usage) == (include, continuous)


def test_default_max_tokens_fills_the_context():
    params = chat().options.to_params(num_prompt_tokens=10, max_model_len=100, prompt_param="messages")
    assert params.max_tokens == 90


@pytest.mark.parametrize("body, param", [
    ([], None),
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages"),
    ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ({"messages": MESSAGES, "max_completion_tokens": -1}, "max_completion_tokens"),
    ({"messages": MESSAGES, "max_tokens": "5"}, "max_tokens"),
    ({"messages": MESSAGES, "temperature": "hot"}, "temperature"),
    ({"messages": MESSAGES, "stop": [1]}, "stop"),
    ({"messages": MESSAGES, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": MESSAGES, "stream": True, "stream_options": {"continuous_usage_stats": "yes"}},
     "stream_options.continuous_usage_stats"),
    ({"messages": MESSAGES, "n": "2"}, "n"),
    ({"messages": MESSAGES, "logprobs": 3}, "logprobs"),
    ({"messages": MESSAGES, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": MESSAGES, "logit_bias": [1, 2]}, "logit_bias"),
    ({"messages": MESSAGES, "stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools[0]"),
    ({"messages": MESSAGES, "tool_choice": "auto"}, "tool_choice"),
    ({"messages": MESSAGES, "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ({"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}},
     "response_format"),
    ({"messages": MESSAGES, "structured_outputs": {"regex": "a("}}, "structured_outputs"),
    ({"messages": MESSAGES, "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"messages": MESSAGES, "structured_outputs": ["a"]}, "structured_outputs"),
    ({"messages": MESSAGES, "structured_outputs": {"choice": ["a"]}, "response_format": {"type": "text"}},
     "structured_outputs"),
    ({"messages": MESSAGES, "best_of": 2}, "best_of"),
    ({"messages": MESSAGES, "frobnicate": True}, "frobnicate"),
    ({"messages": MESSAGES, "seed": 2**64}, "seed"),
    ({"messages": MESSAGES, "seed": -(2**63) - 1}, "seed"),
    ({"messages": MESSAGES, "store": True}, "store"),
    ({"messages": MESSAGES, "store": "no"}, "store"),
    ({"messages": MESSAGES, "metadata": ["a"]}, "metadata"),
    ({"messages": MESSAGES, "metadata": {"a": 1}}, "metadata"),
    ({"messages": MESSAGES, "metadata": {"a": "x" * 513}}, "metadata"),
    ({"messages": MESSAGES, "metadata": {"k" * 65: "x"}}, "metadata"),
    ({"messages": MESSAGES, "metadata": {str(i): "x" for i in range(17)}}, "metadata"),
    ({"messages": MESSAGES, "service_tier": "priority"}, "service_tier"),
    ({"messages": MESSAGES, "modalities": ["text", "audio"]}, "modalities"),
    ({"messages": MESSAGES, "modalities": []}, "modalities"),
    ({"messages": MESSAGES, "prompt_cache_key": 7}, "prompt_cache_key"),
    ({"messages": MESSAGES, "safety_identifier": 7}, "safety_identifier"),
    ({"messages": MESSAGES, "reasoning_effort": "low"}, "reasoning_effort"),
])
def test_chat_request_errors(body, param):
    with pytest.raises(RequestError) as info:
        parse_chat_request(body)
    assert info.value.param == param


def test_openai_bookkeeping_fields_are_taken_for_what_they_ask():
    """Fields OpenAI clients send whatever the server: a server that stores nothing and serves
    one tier takes them as they come, and the answer is the same as without them."""
    plain = parse_chat_request({"messages": MESSAGES, "temperature": 0.5})
    sent = parse_chat_request({
        "messages": MESSAGES, "temperature": 0.5, "store": False, "metadata": {"task": "caption", "k" * 64: "x" * 512},
        "service_tier": "auto", "modalities": ["text"], "prompt_cache_key": "user-42", "safety_identifier": "hash-1"})
    assert sent.options.params == plain.options.params
    assert sent.options.max_tokens == plain.options.max_tokens
    assert sent.user == "hash-1"  # OpenAI's successor to ``user`` names the caller in the log line
    assert parse_chat_request({"messages": MESSAGES, "user": "u", "safety_identifier": "s"}).user == "u"
    assert parse_chat_request({"messages": MESSAGES, "service_tier": "default"}).user is None
    with pytest.raises(RequestError) as info:  # the completions route takes none of them, as OpenAI's
        parse_completion_request({"prompt": "a", "store": False})
    assert info.value.param == "store"


@pytest.mark.parametrize("fields, param", [
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 95}, "max_tokens"),
    ({"max_completion_tokens": 95}, "max_completion_tokens"),
])
def test_sampling_range_errors(fields, param):
    options = chat(**fields).options
    with pytest.raises(RequestError) as info:
        options.to_params(num_prompt_tokens=10, max_model_len=100, prompt_param="messages")
    assert info.value.param == param


def test_values_that_would_fail_inside_the_worker_step():
    """A worker's step raising kills the worker and every request on it: such values
    must be refused (or made safe) at the door."""
    import torch

    from hydrad.engine.sampler import Sampler, SamplingMetadata

    sampler, logits = Sampler(), torch.randn(1, 50) * 20
    for fields in ({"temperature": 1e-300, "seed": 2**63 - 1}, {"temperature": 5e-324, "seed": -(2**63)}):
        params = chat(**fields).options.to_params(num_prompt_tokens=10, max_model_len=100, prompt_param="messages")
        assert params.greedy
        sampler.generator_for(params.seed)
        meta = SamplingMetadata.greedy(1)
        meta.temperature[:] = params.temperature
        assert sampler.sample(logits, meta).token_ids == [int(logits.argmax())]
    assert chat(temperature=0.5).options.temperature == 0.5


@pytest.mark.parametrize("fields, param", [
    ({"n": 0}, "n"), ({"n": 17}, "n"),
    ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": 11}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"top_p": 0}, "top_p"), ({"top_k": -5}, "top_k"), ({"temperature": 3}, "temperature"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_every_sampling_field_is_range_checked_and_named(fields, param):
    with pytest.raises(RequestError) as info:
        chat(**fields).options.to_params(num_prompt_tokens=10, max_model_len=100, prompt_param="messages")
    assert info.value.param == param and str(info.value).startswith(param.split(".")[0]), str(info.value)


@pytest.mark.parametrize("field, value, kind", [
    ("response_format", {"type": "json_object"}, "json_object"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "n", "strict": True,
                                                                 "schema": {"type": "object"}}}, "json"),
    ("structured_outputs", {"regex": "[0-9]+"}, "regex"),
    ("structured_outputs", {"choice": ["yes", "no"]}, "choice"),
    ("structured_outputs", {"grammar": 'start: "a"+'}, "grammar"),
])
def test_structured_outputs_reach_the_params_compiled(field, value, kind):
    for req in (chat(**{field: value}), parse_completion_request({"prompt": "x", field: value})):
        params = req.options.to_params(num_prompt_tokens=10, max_model_len=100, prompt_param="messages")
        assert params.structured_outputs.kind == kind and params.structured_outputs.compiled


def test_new_sampling_fields_reach_the_params():
    req = chat(n=3, min_p=0.1, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=-0.5,
               logit_bias={"7": -100, "9": 2.5}, min_tokens=4, logprobs=True, top_logprobs=5, stop_token_ids=[3],
               skip_special_tokens=False, user="alice", tool_choice="none", response_format={"type": "text"})
    params = req.options.to_params(num_prompt_tokens=10, max_model_len=100, prompt_param="messages")
    assert (params.n, params.min_p, params.repetition_penalty, params.presence_penalty,
            params.frequency_penalty) == (3, 0.1, 1.2, 0.5, -0.5)
    assert params.logit_bias == {7: -100.0, 9: 2.5} and params.min_tokens == 4 and params.logprobs == 5
    assert params.stop_token_ids == [3] and not params.skip_special_tokens and req.user == "alice"
    assert chat(logprobs=True).options.to_params(10, 100, "messages").logprobs == 0
    assert parse_completion_request({"prompt": "x", "logprobs": 2}).options.to_params(10, 100, "prompt").logprobs == 2


def test_prompt_filling_the_context_is_refused():
    with pytest.raises(RequestError, match="no room") as info:
        chat().options.to_params(num_prompt_tokens=100, max_model_len=100, prompt_param="messages")
    assert info.value.param == "messages"


def test_completion_request():
    req = parse_completion_request({"prompt": ["once upon"], "max_tokens": 3})
    assert req.prompts == ["once upon"] and req.options.max_tokens == 3 and not req.echo
    for body, param in [({"prompt": ""}, "prompt"), ({"prompt": "x", "best_of": 2}, "best_of")]:
        with pytest.raises(RequestError) as info:
            parse_completion_request(body)
        assert info.value.param == param


def test_completion_prompts_in_every_form():
    """OpenAI's four forms of ``prompt``: a text, texts, token ids, lists of token ids."""
    for prompt, want in [("a", ["a"]), (["a", "b c"], ["a", "b c"]), ([5, 6, 7], [[5, 6, 7]]),
                         ([[5], [6, 7]], [[5], [6, 7]]), (["a", [5]], ["a", [5]])]:
        assert parse_completion_request({"prompt": prompt}).prompts == want, prompt
    assert parse_completion_request({"prompt": "a", "echo": True}).echo
    too_many = ["x"] * (MAX_PROMPTS + 1)
    for prompt in ["", [], [[]], ["a", ""], [1.5], [True, 2], [[1], "x", [2, None]], {"a": 1}, None, too_many]:
        with pytest.raises(RequestError) as info:
            parse_completion_request({"prompt": prompt})
        assert info.value.param == "prompt", prompt
    # echo with logprobs: the prompt's log-probabilities as well, as many of the most likely.
    params = parse_completion_request({"prompt": "a", "echo": True, "logprobs": 2}).options.to_params(1, 10, "prompt")
    assert params.logprobs == params.prompt_logprobs == 2
    params = parse_completion_request({"prompt": "a", "logprobs": 2}).options.to_params(1, 10, "prompt")
    assert params.logprobs == 2 and params.prompt_logprobs is None
