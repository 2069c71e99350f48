"""Validation of OpenAI-style request bodies into typed requests and ``SamplingParams``.

Follows the OpenAI API, and vLLM where OpenAI is silent (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``return_token_ids``, ``stream_options.continuous_usage_stats``, ``structured_outputs``,
``prompt_logprobs``); tool calls
are structured outputs, or read from the answer (``hydrad.server.tools``). Message contents
(roles, content parts, images) are validated by the Request Processor; everything
else here. Every problem raises ``RequestError`` naming the offending parameter, and
a field that is not served is refused by name rather than ignored. OpenAI's fields for
its own bookkeeping, which clients send whatever the server, are taken for what they ask
of a server that stores nothing and serves one tier (``_bookkeeping``).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from hydrad.chat_options import DEFAULT as DEFAULT_TEMPLATE
from hydrad.chat_options import ChatTemplateOptions
from hydrad.errors import RequestError
from hydrad.sampling_params import SEED_RANGE, SamplingParams, StructuredOutputsParams
from hydrad.server.tools import ToolChoice, parse_tools


@dataclass
class SamplingOptions:
    """Sampling fields as sent; ``max_tokens`` None means "up to the context length".
    ``params`` are the other ``SamplingParams`` keyword arguments, validated by it."""

    max_tokens: int | None
    max_tokens_param: str
    params: dict[str, Any]
    # SamplingParams field -> the request field it came from, where the names differ.
    param_names: dict[str, str] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return self.params.get("n", 1)

    def __getattr__(self, name: str) -> Any:
        params = self.__dict__.get("params", {})
        if name in params:
            return params[name]
        if name in _SAMPLING_DEFAULTS:
            return _SAMPLING_DEFAULTS[name]
        raise AttributeError(name)

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
            return SamplingParams(max_tokens=max_tokens, **self.params)
        except ValueError as e:
            message, param = str(e), self._param_of(str(e))
            first = message.split(" ", 1)[0]
            if param and first in self.param_names:  # say it in the request's own words
                message = param + message[len(first):]
            raise RequestError(message, param) from None

    def _param_of(self, message: str) -> str | None:
        """The request field a SamplingParams error is about (its first word)."""
        name = message.split(" ", 1)[0].split("[", 1)[0]
        if name == "max_tokens":
            return self.max_tokens_param
        if name == "at" and "stop strings" in message:
            return "stop"
        return self.param_names.get(name, name if name in _SAMPLING_DEFAULTS else None)


_SAMPLING_DEFAULTS = {f.name: f.default if f.default is not MISSING else f.default_factory()
                      for f in fields(SamplingParams)}


@dataclass
class GenerateRequest:
    model: str | None
    options: SamplingOptions
    stream: bool
    include_usage: bool
    continuous_usage: bool  # usage in every chunk (``stream_options.continuous_usage_stats``)
    return_token_ids: bool
    # The end user the client names (OpenAI's ``user``): written to the request's log line.
    user: str | None
    # vLLM's ``prompt_logprobs`` asked for: the answer carries them in vLLM's shape.
    prompt_logprobs: bool

    def in_own_words(self, e: RequestError) -> RequestError:
        """An error raised while the request is prepared, naming the request's fields as it
        named them (a route that takes its fields under other names renames them)."""
        return e


@dataclass
class ChatRequest(GenerateRequest):
    messages: list[dict]
    # The answer's tool choice (``tools.ToolChoice``): constrained to calls, or read for them
    # ("auto"); None: no tools, or "none".
    tools: ToolChoice | None = None
    # The request's tools as sent (checked), for the chat template; None: none sent.
    tool_specs: list[dict] | None = None
    template: ChatTemplateOptions = DEFAULT_TEMPLATE


@dataclass
class CompletionRequest(GenerateRequest):
    # One text or one list of token ids per prompt (OpenAI's ``prompt``: a string, an array of
    # strings, an array of token ids, or an array of such arrays); each has ``n`` completions.
    prompts: list[str | list[int]]
    # Each completion's text begins with its prompt's (OpenAI's ``echo``).
    echo: bool = False


# Prompts in one completions request at most (each with its ``n`` completions).
MAX_PROMPTS = 256


# Fields every generation endpoint takes (the OpenAI API, and vLLM's extensions).
_COMMON_FIELDS = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stream", "stream_options", "stop",
    "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs",
    "min_tokens", "ignore_eos", "return_token_ids", "stop_token_ids", "include_stop_str_in_output",
    "skip_special_tokens", "user", "response_format", "structured_outputs", "prompt_logprobs",
}
# How the chat template renders the messages (``hydrad.chat_options``), on both routes that take them.
_TEMPLATE_FIELDS = {"add_generation_prompt", "continue_final_message", "chat_template_kwargs"}
# OpenAI's bookkeeping on a chat request (``_bookkeeping``).
_BOOKKEEPING_FIELDS = {"store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key", "modalities"}
_CHAT_FIELDS = _COMMON_FIELDS | _TEMPLATE_FIELDS | _BOOKKEEPING_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions", "function_call",
    "parallel_tool_calls"}
# OpenAI's limits on ``metadata``: pairs, and characters of a key and of a value.
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}


def parse_chat_request(body: Any) -> ChatRequest:
    body = _object(body)
    refuse_unknown(body, _CHAT_FIELDS)
    messages = body.get("messages")
    if messages is None:
        raise RequestError("'messages' is a required property", "messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty array", "messages")
    if not all(isinstance(m, dict) for m in messages):
        raise RequestError("each message must be an object", "messages")
    max_param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    tools = parse_tools(body)
    common = _common(body, max_param)
    safety_identifier = _bookkeeping(body)
    if common["user"] is None:
        common["user"] = safety_identifier
    if tools is not None and tools.constrains:
        params = common["options"].params
        if "structured_outputs" in params:
            raise RequestError("a tool_choice that calls a tool constrains the answer itself: set it or "
                               "response_format / structured_outputs, not both", "tool_choice")
        params["structured_outputs"] = tools.language()
    logprobs = _get(body, "logprobs", bool, False)
    top_logprobs = _get(body, "top_logprobs", int, None)
    if top_logprobs is not None and not logprobs:
        raise RequestError("top_logprobs needs logprobs to be true", "top_logprobs")
    if logprobs:
        common["options"].params["logprobs"] = 0 if top_logprobs is None else top_logprobs
        if top_logprobs is not None:
            common["options"].param_names["logprobs"] = "top_logprobs"
    return ChatRequest(messages=messages, tools=tools, tool_specs=body.get("tools"),
                       template=_template_options(body), **common)


def _bookkeeping(body: dict) -> str | None:
    """Check OpenAI's bookkeeping fields of a chat request; returns its ``safety_identifier``.

    Clients send these whatever the server (some on every request), and vLLM takes them; each
    is taken here for what it asks of a server that keeps no completions and serves one
    tier: ``store`` false (true, keeping the completion to fetch later, is refused),
    ``metadata`` (OpenAI's tags of a stored completion: checked against OpenAI's limits, and
    kept nowhere, as nothing is stored), ``service_tier`` ``auto`` or ``default``,
    ``modalities`` text alone, ``prompt_cache_key`` (a hint for cache hits: the cache-aware
    router finds the instance that holds a prompt's beginning from the prompt itself), and
    ``safety_identifier`` (OpenAI's successor to ``user``: written to the log line as
    ``user`` where that is not set)."""
    if _get(body, "store", bool, False):
        raise RequestError("store: hydrad keeps no completions to fetch later; send store false or leave it out",
                           "store")
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise RequestError("metadata must be an object of string keys and values", "metadata")
        if len(metadata) > METADATA_PAIRS:
            raise RequestError(f"metadata holds {len(metadata)} pairs; the limit is {METADATA_PAIRS}", "metadata")
        for key, value in metadata.items():
            if len(key) > METADATA_KEY_CHARS:
                raise RequestError(f"metadata key {key[:16]!r}... is longer than {METADATA_KEY_CHARS} characters",
                                   "metadata")
            if not isinstance(value, str) or len(value) > METADATA_VALUE_CHARS:
                raise RequestError(f"metadata[{key!r}] must be a string of at most {METADATA_VALUE_CHARS} "
                                   "characters", "metadata")
    tier = _get(body, "service_tier", str, "auto")
    if tier not in ("auto", "default"):
        raise RequestError(f"service_tier {tier!r} is not served: hydrad has one tier ('auto' or 'default')",
                           "service_tier")
    modalities = body.get("modalities")
    if modalities is not None and not (isinstance(modalities, list) and modalities
                                       and all(m == "text" for m in modalities)):
        raise RequestError(f"modalities {modalities!r}: hydrad answers in text alone ([\"text\"])", "modalities")
    _get(body, "prompt_cache_key", str, None)
    return _get(body, "safety_identifier", str, None)


def _template_options(body: dict) -> ChatTemplateOptions:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise RequestError("chat_template_kwargs must be an object", "chat_template_kwargs")
    return ChatTemplateOptions.of(_get(body, "add_generation_prompt", bool, None),
                                  _get(body, "continue_final_message", bool, False), kwargs)


def parse_completion_request(body: Any) -> CompletionRequest:
    body = _object(body)
    refuse_unknown(body, _COMPLETION_FIELDS)
    prompts = parse_prompts(body.get("prompt"))
    echo = _get(body, "echo", bool, False)
    if body.get("suffix"):
        raise RequestError("suffix is not supported", "suffix")
    if _get(body, "best_of", int, 1) != 1:
        raise RequestError("only best_of=1 is supported", "best_of")
    common = _common(body, "max_tokens")
    logprobs = _get(body, "logprobs", int, None)
    if logprobs is not None:
        common["options"].params["logprobs"] = logprobs
        if echo and "prompt_logprobs" not in common["options"].params:  # the prompt's tokens too
            common["options"].params["prompt_logprobs"] = logprobs
            common["options"].param_names["prompt_logprobs"] = "logprobs"
    return CompletionRequest(prompts=prompts, echo=echo, **common)


def parse_prompts(prompt: Any) -> list[str | list[int]]:
    """OpenAI's ``prompt`` as a list of prompts, each a non-empty text or list of token ids
    (their range is the Request Processor's to check)."""
    if isinstance(prompt, str) or (_is_token_ids(prompt) and prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or (_is_token_ids(p) and p) for p in prompt):
        prompts = prompt
    else:
        raise RequestError("'prompt' must be a non-empty string, an array of token ids, or a non-empty array of "
                           "strings or of arrays of token ids", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise RequestError(f"{len(prompts)} prompts in one request; the limit is {MAX_PROMPTS}", "prompt")
    if any(p == "" for p in prompts):
        raise RequestError("'prompt' must not hold an empty string", "prompt")
    return prompts


@dataclass
class TokenizeRequest:
    """``POST /tokenize`` (vLLM's): a ``prompt`` tokenized as ``/v1/completions`` does (with
    ``add_special_tokens``), or ``messages`` as ``/v1/chat/completions`` does."""

    model: str | None
    prompt: str | None
    messages: list[dict] | None
    add_special_tokens: bool = True
    return_token_strs: bool = False
    template: ChatTemplateOptions = DEFAULT_TEMPLATE  # for messages
    tool_specs: list[dict] | None = None  # the tools the chat template renders with messages (checked)


@dataclass
class DetokenizeRequest:
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model: str | None
    tokens: list[int]


_TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "return_token_strs", "tools",
                    *_TEMPLATE_FIELDS}


def parse_tokenize_request(body: Any) -> TokenizeRequest:
    body = _object(body)
    refuse_unknown(body, _TOKENIZE_FIELDS)
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise RequestError("give one of 'prompt' (a text) and 'messages'", "prompt")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise RequestError("'prompt' must be a non-empty string", "prompt")
    if messages is not None:
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestError("'messages' must be a non-empty array of messages", "messages")
        if "add_special_tokens" in body:
            raise RequestError("add_special_tokens is for a prompt; messages are tokenized as the chat route "
                               "tokenizes them", "add_special_tokens")
        parse_tools({"tools": body.get("tools")})  # checked as the chat route checks them
    elif misplaced := sorted((_TEMPLATE_FIELDS | {"tools"}) & set(body)):
        raise RequestError(f"{misplaced[0]} is for messages: a prompt has no chat template applied", misplaced[0])
    return TokenizeRequest(_get(body, "model", str, None), prompt, messages,
                           _get(body, "add_special_tokens", bool, True), _get(body, "return_token_strs", bool, False),
                           _template_options(body), body.get("tools"))


def parse_detokenize_request(body: Any) -> DetokenizeRequest:
    body = _object(body)
    refuse_unknown(body, {"model", "tokens"})
    tokens = body.get("tokens")
    if not _is_token_ids(tokens):
        raise RequestError("'tokens' must be an array of token ids", "tokens")
    return DetokenizeRequest(_get(body, "model", str, None), tokens)


def _is_token_ids(value: Any) -> bool:
    """A JSON array of integers (booleans are not)."""
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def refuse_unknown(body: dict, known: set[str]) -> None:
    """Every field either works or is refused by name: none is silently ignored."""
    unknown = sorted(set(body) - known)
    if unknown:
        raise RequestError(f"unknown or unsupported parameter {unknown[0]!r}", unknown[0])


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
    seed = _get(body, "seed", int, None)
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise RequestError(f"seed must be a 64-bit signed integer, got {seed}", "seed")
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None and not _is_token_ids(stop_token_ids):
        raise RequestError("stop_token_ids must be an array of integers", "stop_token_ids")
    logit_bias = body.get("logit_bias")
    if logit_bias is not None and not isinstance(logit_bias, dict):
        raise RequestError("logit_bias must be an object mapping token ids to numbers", "logit_bias")
    params: dict[str, Any] = {"stop": stop or [], "stop_token_ids": stop_token_ids or [], "seed": seed}
    for name, kind in (("temperature", float), ("top_p", float), ("top_k", int), ("min_p", float),
                       ("repetition_penalty", float), ("presence_penalty", float), ("frequency_penalty", float),
                       ("min_tokens", int), ("n", int), ("ignore_eos", bool), ("include_stop_str_in_output", bool),
                       ("skip_special_tokens", bool), ("prompt_logprobs", int)):
        value = _get(body, name, kind, None)
        if value is not None:
            params[name] = value
    if "prompt_logprobs" in params and stream:  # as vLLM: they come whole, with the answer
        raise RequestError("prompt_logprobs is not available when stream is true", "prompt_logprobs")
    if logit_bias:
        params["logit_bias"] = logit_bias
    structured = _structured_outputs(body)
    if structured is not None:
        params["structured_outputs"] = structured
    options = SamplingOptions(max_tokens=_get(body, max_param, int, None), max_tokens_param=max_param, params=params)
    if options.max_tokens is not None and options.max_tokens < 1:
        raise RequestError(f"{max_param} must be at least 1, got {options.max_tokens}", max_param)
    return dict(model=model, options=options, stream=stream, include_usage=include_usage,
                continuous_usage=continuous_usage, return_token_ids=_get(body, "return_token_ids", bool, False),
                user=_get(body, "user", str, None), prompt_logprobs="prompt_logprobs" in params)


def _structured_outputs(body: dict) -> StructuredOutputsParams | None:
    """The output's language from OpenAI's ``response_format`` (``json_object``, ``json_schema``;
    ``text``: none) or vLLM's ``structured_outputs`` (``json``, ``json_object``, ``regex``, ``choice``,
    ``grammar``), compiled now: a language that does not compile is refused before the
    request's prompt or images are processed."""
    response_format, extension = body.get("response_format"), body.get("structured_outputs")
    if response_format is not None and extension is not None:
        raise RequestError("set response_format or structured_outputs, not both", "structured_outputs")
    if extension is not None:
        if not isinstance(extension, dict):
            raise RequestError("structured_outputs must be an object", "structured_outputs")
        try:
            return StructuredOutputsParams.of(extension)
        except (ValueError, TypeError) as e:
            raise RequestError(str(e), "structured_outputs") from None
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    try:
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise RequestError("response_format.json_schema.schema must be a JSON schema object",
                                   "response_format")
            return StructuredOutputsParams(json=spec["schema"])
    except ValueError as e:
        raise RequestError(str(e), "response_format") from None
    raise RequestError(f"response_format type {kind or response_format!r} is not supported; the types are 'text', "
                       "'json_object' and 'json_schema'", "response_format")


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
