"""Validation of OpenAI-style request bodies into typed requests and ``SamplingParams``.

Follows the OpenAI API, and vLLM where OpenAI is silent (``top_k``,
``ignore_eos``, ``return_token_ids``, ``stream_options.continuous_usage_stats``).
Message contents (roles, content parts, images) are validated by the Request
Processor; everything else here. Every problem raises ``RequestError`` naming the
offending parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from hydrad.errors import RequestError
from hydrad.sampling_params import SEED_RANGE, SamplingParams

_SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}


@dataclass
class SamplingOptions:
    """Sampling fields as sent; ``max_tokens`` None means "up to the context length"."""

    max_tokens: int | None
    max_tokens_param: str
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    ignore_eos: bool

    def to_params(self, num_prompt_tokens: int, max_model_len: int, prompt_param: str) -> SamplingParams:
        max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = max_model_len - num_prompt_tokens
            if max_tokens < 1:
                raise RequestError(
                    f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
                    f"{num_prompt_tokens} tokens, which leaves no room for a completion.",
                    prompt_param,
                )
        elif num_prompt_tokens + max_tokens > max_model_len:
            raise RequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} "
                f"in the completion). Please reduce the length of the prompt or completion.",
                self.max_tokens_param,
            )
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                seed=self.seed, stop=self.stop, ignore_eos=self.ignore_eos,
            )
        except ValueError as e:
            param = str(e).split(" ", 1)[0]
            if param == "max_tokens":
                param = self.max_tokens_param
            raise RequestError(str(e), param if param in _SAMPLING_FIELDS | {self.max_tokens_param} else None)


@dataclass
class GenerateRequest:
    model: str | None
    options: SamplingOptions
    stream: bool
    include_usage: bool
    continuous_usage: bool  # usage in every chunk (``stream_options.continuous_usage_stats``)
    return_token_ids: bool


@dataclass
class ChatRequest(GenerateRequest):
    messages: list[dict]


@dataclass
class CompletionRequest(GenerateRequest):
    prompt: str


def parse_chat_request(body: Any) -> ChatRequest:
    body = _object(body)
    messages = body.get("messages")
    if messages is None:
        raise RequestError("'messages' is a required property", "messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty array", "messages")
    if not all(isinstance(m, dict) for m in messages):
        raise RequestError("each message must be an object", "messages")
    max_param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    _refuse_unsupported(body)
    return ChatRequest(messages=messages, **_common(body, max_param))


def parse_completion_request(body: Any) -> CompletionRequest:
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise RequestError("'prompt' must be a non-empty string", "prompt")
    _refuse_unsupported(body)
    if body.get("echo"):
        raise RequestError("echo is not supported", "echo")
    if body.get("suffix"):
        raise RequestError("suffix is not supported", "suffix")
    if _get(body, "best_of", int, 1) != 1:
        raise RequestError("only best_of=1 is supported", "best_of")
    return CompletionRequest(prompt=prompt, **_common(body, "max_tokens"))


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def _common(body: dict, max_param: str) -> dict:
    model = _get(body, "model", str, None)
    stream = _get(body, "stream", bool, False)
    stream_options = body.get("stream_options")
    if stream_options is not None and not stream:
        raise RequestError("stream_options can only be set when stream is true", "stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise RequestError("stream_options must be an object", "stream_options")
    include_usage = _get(stream_options or {}, "include_usage", bool, False, "stream_options.include_usage")
    # vLLM's extension: usage so far in every chunk, only together with include_usage (as vLLM).
    continuous_usage = _get(stream_options or {}, "continuous_usage_stats", bool, False,
                            "stream_options.continuous_usage_stats") and include_usage
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise RequestError("stop must be a string or an array of strings", "stop")
    temperature = _get(body, "temperature", float, 1.0)
    seed = _get(body, "seed", int, None)
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise RequestError(f"seed must be a 64-bit signed integer, got {seed}", "seed")
    options = SamplingOptions(
        max_tokens=_get(body, max_param, int, None),
        max_tokens_param=max_param,
        temperature=temperature,
        top_p=_get(body, "top_p", float, 1.0),
        top_k=_get(body, "top_k", int, 0),
        seed=seed,
        stop=stop or [],
        ignore_eos=_get(body, "ignore_eos", bool, False),
    )
    if options.max_tokens is not None and options.max_tokens < 1:
        raise RequestError(f"{max_param} must be at least 1, got {options.max_tokens}", max_param)
    return dict(model=model, options=options, stream=stream, include_usage=include_usage,
                continuous_usage=continuous_usage, return_token_ids=_get(body, "return_token_ids", bool, False))


def _refuse_unsupported(body: dict) -> None:
    if _get(body, "n", int, 1) != 1:
        raise RequestError("only n=1 is supported", "n")
    for name in ("logprobs", "top_logprobs", "tools", "functions", "logit_bias"):
        if body.get(name):
            raise RequestError(f"{name} is not supported", name)
    for name in ("presence_penalty", "frequency_penalty"):
        if _get(body, name, float, 0.0) != 0.0:
            raise RequestError(f"{name} is not supported (only 0)", name)


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "a boolean"}


def _get(body: dict, key: str, kind: type, default: Any, param: str | None = None) -> Any:
    value = body.get(key)
    if value is None:
        return default
    ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    if not ok:
        raise RequestError(f"{param or key} must be {_TYPE_NAMES[kind]}, got {value!r}", param or key)
    return value
