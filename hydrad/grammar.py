"""Structured outputs' languages as llguidance grammars (checked where a request comes in).

A request's ``StructuredOutputsParams`` (a JSON schema, any JSON object, a regex, a choice
of strings or a Lark grammar) becomes one llguidance grammar, checked at once, so that a
language llguidance cannot compile is refused as the request's error before any of its
work runs; the grammar text then travels with the request to every instance that samples
it (``hydrad.engine.grammar_mask`` builds its matcher there). No tokenizer is needed here.
"""

from __future__ import annotations

import functools
import json

from llguidance import LLMatcher

# JSON output as the OpenAI API and vLLM give it: whitespace between tokens only where the
# model puts it (llguidance's default lets the schema's own "x-guidance" options override).
_JSON_OPTIONS = {"whitespace_flexible": True}

# Languages up to this many characters have their grammar kept (``CACHED_GRAMMARS`` of them,
# least recently used first out): an application sends the same schema with every request,
# and compiling and checking even a small one costs the daemon about half a millisecond.
CACHED_SOURCE_CHARS = 64 << 10
CACHED_GRAMMARS = 128


def compile_grammar(kind: str, source: str) -> str:
    """llguidance's grammar of a language of ``kind`` given as ``source``
    (``StructuredOutputsParams.source``); ValueError (one line) where it does not compile."""
    if len(source) <= CACHED_SOURCE_CHARS:
        return _compile_cached(kind, source)
    return _compile(kind, source)


def _compile(kind: str, source: str) -> str:
    try:
        if kind == "json":
            schema = json.loads(source)
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema is an object")
            grammar = LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        elif kind == "json_object":
            grammar = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        elif kind == "regex":
            grammar = LLMatcher.grammar_from_regex(source)
        elif kind == "choice":
            # Lark string literals, one alternative each (JSON's escapes are Lark's).
            grammar = LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(source)))
        else:
            grammar = LLMatcher.grammar_from_lark(source)
    except (ValueError, TypeError) as e:  # JSON text that does not parse, a schema of the wrong type
        raise ValueError(f"structured outputs: the {kind} is not valid: {one_line(str(e))}") from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"structured outputs: the {kind} is not valid: {one_line(error)}")
    return grammar


_compile_cached = functools.lru_cache(maxsize=CACHED_GRAMMARS)(_compile)


def one_line(message: str) -> str:
    """llguidance's message on one line: its first line and its "error: ..." line, without
    the source excerpt between them."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "rejected by llguidance"
    detail = next((line for line in lines[1:] if line.startswith("error:")), None)
    return f"{lines[0]} {detail}" if detail else lines[0]
