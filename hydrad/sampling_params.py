"""Per-request sampling options (the shape users know from vLLM and the OpenAI API)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

# Below this temperature, logits / temperature overflow float32: sample greedily, as vLLM does.
GREEDY_BELOW = 1e-5
# torch.Generator seeds are 64-bit.
SEED_RANGE = (-(2**63), 2**63 - 1)
MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_CHOICES = 1024
# A grammar, schema or regex longer than this is refused (compiling one runs in the request path).
MAX_GRAMMAR_CHARS = 256 * 1024


def _number(name: str, value, lo: float, hi: float, *, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value > hi or value < lo or (lo_open and value == lo):
        raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {value!r}")
    return float(value)


def _integer(name: str, value, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


@dataclass
class StructuredOutputsParams:
    """Output constrained to a language (vLLM's ``StructuredOutputsParams``): exactly one of

    * ``json``: a JSON schema (an object, or its JSON text);
    * ``json_object``: any JSON object (the API's ``response_format: {"type": "json_object"}``);
    * ``regex``: a regular expression (Rust ``regex`` syntax) the whole output matches;
    * ``choice``: the output is one of these strings;
    * ``grammar``: a context-free grammar in llguidance's Lark dialect.

    Each step masks the tokens that cannot continue the output within the language
    (llguidance computes the mask; ``hydrad.engine.grammar``); once the language allows
    nothing more, only EOS remains. Greedy and sampled requests alike; the constraint
    applies after logit bias, penalties and ``min_tokens`` (where ``min_tokens`` forbids
    every token the language allows, the language wins).
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # The language as llguidance's grammar (``hydrad.grammar.compile_grammar``), made and
    # checked once here and carried with the request to every instance that samples it.
    compiled: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        kinds = self._kinds()
        if len(kinds) != 1:
            raise ValueError("structured outputs take exactly one of json, json_object, regex, choice and grammar"
                             + (f", got {' and '.join(kinds)}" if kinds else ""))
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured outputs: json must be a JSON schema (an object or its text)")
        if not isinstance(self.json_object, bool):
            raise ValueError("structured outputs: json_object must be a boolean")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured outputs: {name} must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not 0 < len(self.choice) <= MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(f"structured outputs: choice must be 1 to {MAX_CHOICES} non-empty strings")
            self.choice = list(self.choice)
        source = self.source()
        if len(source) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"structured outputs: the {self.kind} has more than {MAX_GRAMMAR_CHARS} characters")
        from hydrad.grammar import compile_grammar

        self.compiled = compile_grammar(self.kind, source)

    def _kinds(self) -> list[str]:
        return [name for name, value in (("json", self.json), ("json_object", self.json_object or None),
                                         ("regex", self.regex), ("choice", self.choice), ("grammar", self.grammar))
                if value is not None]

    @property
    def kind(self) -> str:
        return self._kinds()[0]

    def source(self) -> str:
        """What the language is given as, in text: the JSON schema (its keys in their order, the
        order its properties are generated in), the JSON array of the choices, the regex or
        the grammar."""
        if self.json is not None:
            return self.json if isinstance(self.json, str) else json.dumps(self.json)
        if self.json_object:
            return '{"type": "object"}'
        if self.choice is not None:
            return json.dumps(self.choice)
        return self.regex or self.grammar or ""

    @classmethod
    def of(cls, value) -> StructuredOutputsParams:
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"json", "json_object", "regex", "choice", "grammar"})
            if unknown:
                raise ValueError(f"structured outputs: unknown field {unknown[0]!r}")
            return cls(**value)
        raise ValueError("structured_outputs must be a StructuredOutputsParams or an object of its fields")


@dataclass
class SamplingParams:
    """How to sample one request's output.

    ``temperature == 0`` means greedy. ``top_k <= 0``, ``top_p == 1`` and ``min_p == 0``
    disable those filters. ``seed`` makes sampling reproducible per request, independent
    of batching. The filters apply in the order transformers applies its warpers:
    logit bias and penalties, temperature, top-k, top-p, min-p.

    * ``repetition_penalty`` (transformers' and vLLM's): logits of tokens seen in the
      prompt or the output are divided by it when positive, multiplied when negative.
    * ``presence_penalty``, ``frequency_penalty`` (OpenAI's): ``logit -= frequency *
      count + presence * (count > 0)`` over the tokens generated so far.
    * ``logit_bias``: token id -> value in [-100, 100] added to its logit.
    * ``min_tokens``: EOS and the stop token ids cannot be sampled before this many tokens.
    * ``logprobs``: None, or how many most likely tokens to report with each sampled
      token (0: the sampled token's only). They are log-probabilities of the model's raw
      distribution (before penalties, temperature and filters), as vLLM reports by default.
    * ``prompt_logprobs`` (vLLM's): None, or how many most likely tokens to report with
      each prompt token after the first: the log-probability of each prompt token given
      the ones before it (a request that asks for them computes its whole prompt, without
      the prefix cache).
    * ``n``: independent completions of the same prompt.
    * ``structured_outputs``: the output constrained to a JSON schema, a regex, a choice
      of strings or a grammar (``StructuredOutputsParams``; a dict of its fields is taken).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # Leave special tokens out of the text (the token ids always hold them).
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        self.temperature = _number("temperature", self.temperature, 0.0, 2.0)
        self.top_p = _number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}")
        self.min_p = _number("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]
        ):
            raise ValueError(f"seed must be a 64-bit signed integer, got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        for token_id in self.stop_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {token_id!r}")
        self.repetition_penalty = _number("repetition_penalty", self.repetition_penalty, 0.0, 10.0, lo_open=True)
        self.presence_penalty = _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.logit_bias:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                raise ValueError(f"logit_bias must map at most {MAX_LOGIT_BIAS_ENTRIES} token ids to values")
            bias = {}
            for token, value in self.logit_bias.items():
                token_id = int(token) if isinstance(token, str) and token.lstrip("-").isdigit() else token
                if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                    raise ValueError(f"logit_bias keys must be token ids, got {token!r}")
                bias[token_id] = _number(f"logit_bias[{token_id}]", value, *LOGIT_BIAS_RANGE)
            self.logit_bias = bias
        else:
            self.logit_bias = None
        self.min_tokens = _integer("min_tokens", self.min_tokens, 0, self.max_tokens)
        if self.logprobs is not None:
            self.logprobs = _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _integer("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        self.n = _integer("n", self.n, 1, MAX_N)
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def split_choices(params: SamplingParams, price_once: bool = False) -> list[SamplingParams]:
    """``n`` independent requests for ``n`` completions; a seeded request's i-th uses seed + i.
    ``price_once``: only the first computes the prompt's log-probabilities (``prompt_logprobs``);
    the caller gives the others the first's (one prompt, the same values)."""
    if params.n == 1:
        return [params]
    choices = []
    for i in range(params.n):
        seed = params.seed
        if seed is not None:
            seed = SEED_RANGE[0] + (seed + i - SEED_RANGE[0]) % (SEED_RANGE[1] - SEED_RANGE[0] + 1)
        unpriced = {"prompt_logprobs": None} if price_once and i else {}
        choices.append(replace(params, n=1, seed=seed, **unpriced))
    return choices
