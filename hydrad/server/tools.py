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
  known); with ``parallel_tool_calls: false`` the answer ends with its first call (the
  format's end of a call is a stop string);
* ``"none"``: the answer is free text, as without tools.

A call's ``arguments`` are the text the model generated for them (whole or streamed, the
same text), each call with an id of its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from hydrad.errors import RequestError
from hydrad.sampling_params import MAX_STOP_STRINGS, StructuredOutputsParams
from hydrad.tool_calls import END_OF_CALL, CallScanner, HermesCalls, call_id, read_answer

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

    def prepare(self, params: dict[str, Any], call_format: str | None, tags_special: bool) -> None:
        """Under ``"auto"``, what the model's tool-call format (its chat template's:
        ``tool_calls.format_of``) asks of the request's sampling ``params``: its tags kept in
        the text where they are special tokens, and without parallel calls the end of a call
        as a stop string. A template that asks for no format it can be read in is refused."""
        if self.mode != "auto":
            return
        if call_format is None:
            raise RequestError('tool_choice "auto" (the default with tools) reads the calls the model writes in '
                               "the format its chat template asks for, and this model's template asks for none; "
                               'set tool_choice to "required", "none" or {"type": "function", "function": '
                               '{"name": ...}}, or [model] chat_template to a template with tool calls',
                               "tool_choice")
        if tags_special:
            params.setdefault("skip_special_tokens", False)
        if not self.parallel:
            if len(params["stop"]) >= MAX_STOP_STRINGS:
                raise RequestError('parallel_tool_calls false under tool_choice "auto" ends the answer after its '
                                   f"first call with a stop string of its own: send at most {MAX_STOP_STRINGS - 1} "
                                   "stop strings", "stop")
            params["stop"] = [*params["stop"], END_OF_CALL[call_format]]

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
    """One constrained answer's tool calls as its text arrives: ``feed`` returns the
    ``tool_calls`` deltas of a piece of text (OpenAI's streamed shape: a call's first delta has
    its ``id``, ``type`` and ``name``; then pieces of its ``arguments``); ``calls`` are the calls
    so far.

    For ``named`` the whole answer is the call's arguments. For ``required`` it follows the JSON
    the grammar allows (an array of objects of ``name`` then ``parameters``): a call starts
    where its parameters do, and its arguments are their text as generated."""

    choice: ToolChoice
    calls: list[dict] = field(default_factory=list)
    _scanner: CallScanner | None = None

    def __post_init__(self) -> None:
        if self.choice.mode == "required":
            self._scanner = CallScanner(self.calls, 2, ("parameters",))

    def take(self, text: str, final: bool) -> tuple[str | None, list[dict]]:
        """No content (the answer is the calls) and the ``tool_calls`` deltas of a piece of it."""
        return None, self.feed(text)

    def finish_reason(self, reason: str | None) -> str | None:
        return self.choice.finish_reason(reason, self.calls)

    def feed(self, text: str) -> list[dict]:
        if self._scanner is not None:
            return self._scanner.feed(text)
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
