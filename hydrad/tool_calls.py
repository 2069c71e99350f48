"""Tool calls a model writes in its own format, read back from its answer: what
``tool_choice: "auto"`` serves (the model decides whether to call; its chat template tells
it how).

One format is read, Hermes': each call a block ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` in the answer's text (NousResearch's Hermes, the Qwen2 and Qwen2.5
templates with tools, and the template of the Qwen2-VL checkpoints ``hydrad make-model``
writes). A chat template that writes ``<tool_call>`` asks for it (``format_of``); the text
that ends a call in it is ``END_OF_CALL`` (a stop string there holds an answer to one call).

``CallScanner`` follows a call's JSON as it is generated, so that its arguments stream as
they come: the Hermes reader uses it inside each block, and the constrained ``"required"``
answers (``hydrad.server.tools``) over their array of calls.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TAGS = (OPEN, CLOSE)
END_OF_CALL = {"hermes": CLOSE}


def format_of(chat_template: str | None) -> str | None:
    """The tool-call format a chat template asks the model for; None: none it can be read in."""
    return "hermes" if chat_template and OPEN in chat_template else None


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _call(block: str) -> dict | None:
    """The call a block's text holds (``{"name": ..., "arguments": {...}}``; "parameters" is
    read as "arguments"), or None where it holds none."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id(), "type": "function", "function": {"name": obj["name"], "arguments": arguments}}


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _merged(deltas: list[dict]) -> list[dict]:
    """``tool_calls`` deltas with one per call: a call's pieces of arguments joined."""
    out: dict[int, dict] = {}
    for delta in deltas:
        into = out.get(delta["index"])
        if into is None:
            out[delta["index"]] = {**delta, "function": dict(delta["function"])}
        else:
            into["function"]["arguments"] += delta["function"]["arguments"]
    return [out[i] for i in sorted(out)]


@dataclass
class CallScanner:
    """Calls read out of JSON text as it is generated, one character at a time, into ``calls``.

    Each object at ``depth`` (1: the text is a call's object; 2: an array of them) whose
    ``"name"`` string comes before its arguments (the value of one of ``keys``) starts a call
    where that value starts; the call's ``arguments`` are the value's text as generated. One
    call per object. ``objects_only``: an arguments value that is not an object starts no
    call (``started`` stays as it was: its reader decides on the whole text). ``feed`` returns
    the ``tool_calls`` deltas of a piece of text in OpenAI's streamed shape: a call's first
    delta has its ``id``, ``type`` and ``name``, the next ones pieces of its ``arguments``."""

    calls: list[dict]
    depth: int
    keys: tuple[str, ...]
    objects_only: bool = False
    started: int = 0  # calls started by this scanner
    _depth: int = 0  # open arrays and objects
    _in_string: bool = False
    _escape: bool = False
    _token: list[str] = field(default_factory=list)  # a string being read in a call's object
    _expect_key: bool = False  # the next string in a call's object is a key
    _key: str | None = None  # the key whose value comes next there
    _name: str | None = None  # the call's name, once read (None again once its call started)
    _capturing: bool = False  # inside a call's arguments
    _value_depth: int | None = None  # the depth their value starts at (None: not begun)
    _scalar: bool = False  # arguments that are a number or literal, read to the next ',' or '}'

    def feed(self, text: str) -> list[dict]:
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
            if self._depth == self.depth:  # a call's object
                self._expect_key, self._key, self._name = True, None, None
        elif char in "]}":
            self._depth -= 1
        elif char == "," and self._depth == self.depth:
            self._expect_key, self._key = True, None
        elif (char == ":" and self._depth == self.depth and self._key in self.keys
              and self._name is not None):
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
        if self._depth != self.depth:
            return
        if self._expect_key:
            self._key, self._expect_key = value, False
        elif self._key == "name":
            self._name = value

    def _step_arguments(self, char: str) -> bool:
        """Inside a call's arguments (from the ':' before them): True where ``char`` is part of
        them; False where it is not (whitespace before them, what follows a number or literal
        that ended, a value ``objects_only`` leaves alone), then read as structure."""
        if self._value_depth is None:  # before the value
            if char.isspace():
                return False  # whitespace: nothing to read
            if self.objects_only and char != "{":
                self._capturing = False
                return False
            self._value_depth = self._depth
            self.calls.append({"id": call_id(), "type": "function", "function": {"name": self._name, "arguments": ""}})
            self.started += 1
            self._name = None
            if char in "[{":
                self._depth += 1
            elif char == '"':
                self._in_string = True
            else:
                self._scalar = True
            return True
        if self._in_string:
            if self._string_ends(char) and self._depth == self._value_depth:  # the arguments were a string
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


@dataclass
class HermesCalls:
    """One answer's content and calls as its text arrives. ``take`` returns the content to
    send now and the ``tool_calls`` deltas. Outside a block, text is content (text that may
    begin a block is held until it does or cannot). Inside one, a call starts once its name
    is read and its arguments object begins, and its arguments go out as they are generated
    (``CallScanner``); a block whose JSON is not of that shape (arguments before the name, or
    given as a string) is read whole when it closes: a call where it holds one, else content.
    At the answer's end a block without its closing tag is a call where one started in it or
    its text holds one (a model may stop right after the call's JSON, and a stop string may
    take the tag), else content; a call cut by ``max_tokens`` keeps the arguments generated."""

    calls: list[dict] = field(default_factory=list)
    content: str = ""  # every piece of content so far
    _held: str = ""
    _in_call: bool = False
    _block: str = ""  # the open block's text so far
    _scanner: CallScanner | None = None  # the open block's

    def take(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """The content to send now and the ``tool_calls`` deltas of a piece of the answer
        (``final``: its last)."""
        content, deltas = self.feed(text)
        if final:  # the last call's arguments may go on in what was held back: one delta a call
            rest, last = self.finish()
            content, deltas = content + rest, _merged(deltas + last)
        return content, deltas

    def feed(self, text: str) -> tuple[str, list[dict]]:
        held = self._held + text
        out: list[str] = []
        deltas: list[dict] = []
        while True:
            if not self._in_call:
                at = held.find(OPEN)
                if at < 0:
                    keep = _held_back(held, OPEN)
                    out.append(held[:len(held) - keep])
                    held = held[len(held) - keep:]
                    break
                out.append(held[:at])
                held, self._in_call = held[at + len(OPEN):], True
                self._block = ""
                self._scanner = CallScanner(self.calls, 1, ("arguments", "parameters"), objects_only=True)
            else:
                at = held.find(CLOSE)
                if at < 0:
                    keep = _held_back(held, CLOSE)
                    deltas += self._scan(held[:len(held) - keep])
                    held = held[len(held) - keep:]
                    break
                deltas += self._scan(held[:at])
                held, self._in_call = held[at + len(CLOSE):], False
                left, whole = self._close()
                out.append(left and left + CLOSE)
                deltas += whole
        self._held = held
        content = "".join(out)
        self.content += content
        return content, deltas

    def finish(self) -> tuple[str, list[dict]]:
        """What is held at the answer's end (its content and its last call's deltas)."""
        held, in_call = self._held, self._in_call
        self._held, self._in_call = "", False
        if not in_call:
            self.content += held
            return held, []
        deltas = self._scan(held)
        text, whole = self._close()  # a call read whole where none started: one or the other
        self.content += text
        return text, deltas + whole

    def _scan(self, text: str) -> list[dict]:
        self._block += text
        return self._scanner.feed(text)

    def _close(self) -> tuple[str, list[dict]]:
        """The open block ends: the content it leaves (its text, from its opening tag, where it
        holds no call) and the delta of a call read whole."""
        if self._scanner.started:
            return "", []
        call = _call(self._block)
        if call is None:
            return OPEN + self._block, []
        self.calls.append(call)
        return "", [{"index": len(self.calls) - 1, **call}]

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.calls and reason == "stop" else reason


def read_answer(text: str) -> tuple[str | None, list[dict]]:
    """A whole answer's content (None where it is only whitespace beside calls) and calls."""
    calls = HermesCalls()
    calls.take(text, final=True)
    content = calls.content
    return (None if calls.calls and not content.strip() else content), calls.calls
