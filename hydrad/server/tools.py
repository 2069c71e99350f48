"""Tool calls (the chat API's ``tools`` and ``tool_choice``).

* a named function (``tool_choice: {"type": "function", "function": {"name": ...}}``): the
  answer is constrained to that function's ``parameters`` (a JSON schema; none: any JSON
  object) and is the call's ``arguments``; ``finish_reason`` stays the answer's own;
* ``"required"``: the answer is constrained to a JSON array of one or more calls, each
  ``{"name": ..., "parameters": {...}}`` of one of the tools (one at most with
  ``parallel_tool_calls: false``), and ends with ``finish_reason`` ``tool_calls``;
* ``"auto"`` (the default with tools): the model decides, and writes its calls in its own
  format, which its chat template asks for (``hydrad.tool_calls``); the answer's
  calls are read back from its text, the rest is its content, and an answer that calls
  ends with ``finish_reason`` ``tool_calls``. A model whose chat template asks for no
  format it can be read in is refused "auto" (at preparation, where the template is
  known); ``parallel_tool_calls`` is not enforced there: the calls are the model's;
* ``"none"``: the answer is free text, as without tools.

A call's ``arguments`` are the text the model generated for them (whole or streamed, the
same text), each call with an id of its own.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from hydrad.errors import RequestError
from hydrad.sampling_params import StructuredOutputsParams
from hydrad.tool_calls import HermesCalls, call_id, read_answer

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolChoice:
    """A request's tool choice: ``named`` (``name``) or ``required``, which constrain its answer,
    or ``auto``, read from it."""

    mode: str
    tools: dict[str, dict | None]  # name -> its parameters' schema (None: any object)
    name: str | None = None
    parallel: bool = True

    def language(self) -> StructuredOutputsParams:
        try:
            return StructuredOutputsParams(json=self._schema())
        except ValueError as e:
            raise RequestError(str(e).replace("the json is", "the tools' parameters are"), "tools") from None

    def _schema(self) -> dict:
        if self.mode == "named":
            return self.tools[self.name] or _ANY_OBJECT
        defs: dict[str, Any] = {}
        calls = []
        for name, params in self.tools.items():
            if params and "$defs" in params:
                # References inside a tool's parameters ("#/$defs/...") name the schema's root.
                params = dict(params)
                own = params.pop("$defs")
                if not isinstance(own, dict):
                    raise RequestError(f"the $defs of tool {name!r}'s parameters must be an object", "tools")
                for key, value in own.items():
                    if defs.setdefault(key, value) != value:
                        raise RequestError(f"the tools' parameters define ${key} differently", "tools")
            calls.append({"type": "object", "properties": {"name": {"enum": [name]},
                                                           "parameters": params or _ANY_OBJECT},
                          "required": ["name", "parameters"], "additionalProperties": False})
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return schema

    @property
    def constrains(self) -> bool:
        """Whether the answer is constrained to the calls (a structured output)."""
        return self.mode != "auto"

    def finish_reason(self, reason: str | None, calls: list[dict]) -> str | None:
        called = self.mode == "required" or (self.mode == "auto" and calls)
        return "tool_calls" if called and reason == "stop" else reason

    def stream(self) -> ToolCallStream | HermesCalls:
        return HermesCalls() if self.mode == "auto" else ToolCallStream(self)

    def answer(self, text: str) -> tuple[str | None, list[dict]]:
        """A whole answer's content and calls. Constrained, an answer cut before its first
        call keeps its text as content, where it can be seen."""
        if self.mode == "auto":
            return read_answer(text)
        calls = self.calls(text)
        return (None if calls or not text else text), calls

    def calls(self, text: str) -> list[dict]:
        """The tool calls of a whole answer (where ``max_tokens`` cut it, the last one's
        arguments as far as they were generated, as a streamed answer's)."""
        stream = self.stream()
        stream.feed(text)
        return stream.calls


def parse_tools(body: dict) -> ToolChoice | None:
    """The request's tool choice where it constrains the answer; None: no tools, or "none"."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if body.get("functions") is not None or body.get("function_call") is not None:
        name = "functions" if body.get("functions") is not None else "function_call"
        raise RequestError(f"{name} is the deprecated form of tools; send tools and tool_choice", name)
    if tools is None:
        if choice not in (None, "none"):
            raise RequestError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or not 0 < len(tools) <= MAX_TOOLS:
        raise RequestError(f"tools must be an array of 1 to {MAX_TOOLS} tools", "tools")
    by_name: dict[str, dict | None] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise RequestError(f'{where} must be {{"type": "function", "function": {{...}}}}', where)
        function = tool["function"]
        name, params = function.get("name"), function.get("parameters")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise RequestError(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}",
                               where)
        if name in by_name:
            raise RequestError(f"{where}: two tools are named {name!r}", where)
        if params is not None and not isinstance(params, dict):
            raise RequestError(f"{where}.function.parameters must be a JSON schema object", where)
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise RequestError(f"{where}.function.description must be a string", where)
        by_name[name] = params
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if choice is None or choice == "auto":
        return ToolChoice("auto", by_name, parallel=parallel is not False)
    if choice == "none":
        return None
    if choice == "required":
        return ToolChoice("required", by_name, parallel=parallel is not False)
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise RequestError('tool_choice must be "none", "required", "auto" or {"type": "function", "function": '
                           '{"name": ...}}', "tool_choice")
    if name not in by_name:
        raise RequestError(f"tool_choice names {name!r}, which is not one of the tools", "tool_choice")
    return ToolChoice("named", by_name, name=name)


@dataclass
class ToolCallStream:
    """One answer's tool calls as its text arrives: ``feed`` returns the ``tool_calls`` deltas
    of a piece of text (OpenAI's streamed shape: a call's first delta has its ``id``, ``type``
    and ``name``; then pieces of its ``arguments``); ``calls`` are the calls so far.

    For ``required`` it follows the JSON the grammar allows (an array of objects of ``name``
    then ``parameters``): a call starts where its parameters do, and its arguments are their
    text as generated."""

    choice: ToolChoice
    calls: list[dict] = field(default_factory=list)
    # The scanner of a "required" answer's JSON.
    _depth: int = 0  # open arrays and objects
    _in_string: bool = False
    _escape: bool = False
    _token: list[str] = field(default_factory=list)  # a string being read in a call's object
    _expect_key: bool = False  # the next string in a call's object is a key
    _key: str | None = None  # the key whose value comes next there
    _name: str | None = None  # the call's name, once read
    _capturing: bool = False  # inside a call's parameters
    _value_depth: int | None = None  # the depth their value starts at (None: not begun)
    _scalar: bool = False  # parameters that are a number or literal, read to the next ',' or '}'

    def take(self, text: str, final: bool) -> tuple[str | None, list[dict]]:
        """No content (the answer is the calls) and the ``tool_calls`` deltas of a piece of it."""
        return None, self.feed(text)

    def finish_reason(self, reason: str | None) -> str | None:
        return self.choice.finish_reason(reason, self.calls)

    def feed(self, text: str) -> list[dict]:
        if self.choice.mode == "named":
            if not self.calls:
                if not text:
                    return []
                self.calls.append({"id": call_id(), "type": "function",
                                   "function": {"name": self.choice.name, "arguments": ""}})
                delta = {"index": 0, **self.calls[0], "function": {"name": self.choice.name, "arguments": text}}
                self.calls[0]["function"]["arguments"] = text
                return [delta]
            self.calls[0]["function"]["arguments"] += text
            return [{"index": 0, "function": {"arguments": text}}] if text else []
        deltas: dict[int, dict] = {}
        for char in text:
            started = len(self.calls)
            part = self._step(char)
            if len(self.calls) > started:  # a call starts with this character
                call = self.calls[-1]
                deltas[started] = {"index": started, "id": call["id"], "type": "function",
                                   "function": {"name": call["function"]["name"], "arguments": ""}}
            if part:
                index = len(self.calls) - 1
                self.calls[index]["function"]["arguments"] += char
                delta = deltas.setdefault(index, {"index": index, "function": {"arguments": ""}})
                delta["function"]["arguments"] += char
        return [deltas[i] for i in sorted(deltas)]

    def _step(self, char: str) -> bool:
        """Advance over ``char``; True where it is part of a call's arguments."""
        if self._capturing and self._step_arguments(char):
            return True
        if self._in_string:
            if self._string_ends(char):
                self._end_string(json.loads('"' + "".join(self._token) + '"'))
            else:
                self._token.append(char)
        elif char == '"':
            self._in_string, self._token = True, []
        elif char in "[{":
            self._depth += 1
            if self._depth == 2:  # a call's object
                self._expect_key, self._key, self._name = True, None, None
        elif char in "]}":
            self._depth -= 1
        elif char == "," and self._depth == 2:
            self._expect_key, self._key = True, None
        elif char == ":" and self._depth == 2 and self._key == "parameters":
            self._capturing, self._value_depth, self._scalar = True, None, False
        return False

    def _string_ends(self, char: str) -> bool:
        """Inside a string: whether ``char`` closes it."""
        if self._escape:
            self._escape = False
        elif char == "\\":
            self._escape = True
        elif char == '"':
            self._in_string = False
            return True
        return False

    def _end_string(self, value: str) -> None:
        if self._depth != 2:
            return
        if self._expect_key:
            self._key, self._expect_key = value, False
        elif self._key == "name":
            self._name = value

    def _step_arguments(self, char: str) -> bool:
        """Inside a call's parameters (from the ':' before them): True where ``char`` is part of
        them; False where a number or literal ended before it (then read as structure)."""
        if self._value_depth is None:  # before the value
            if char.isspace():
                return False  # whitespace: nothing to read
            self._value_depth = self._depth
            self.calls.append({"id": call_id(), "type": "function", "function": {"name": self._name, "arguments": ""}})
            if char in "[{":
                self._depth += 1
            elif char == '"':
                self._in_string = True
            else:
                self._scalar = True
            return True
        if self._in_string:
            if self._string_ends(char) and self._depth == self._value_depth:  # the parameters were a string
                self._capturing = False
            return True
        if self._scalar:
            if char in ",}" or char.isspace():
                self._capturing = self._scalar = False
                return False
            return True
        if char == '"':
            self._in_string = True
        elif char in "[{":
            self._depth += 1
        elif char in "]}":
            self._depth -= 1
            if self._depth == self._value_depth:
                self._capturing = False
        return True
