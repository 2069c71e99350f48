"""Tool calls a model writes in its own format, read back from its answer: what
``tool_choice: "auto"`` serves (the model decides whether to call; its chat template tells
it how).

One format is read, Hermes': each call a block ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` in the answer's text (NousResearch's Hermes, the Qwen2 and Qwen2.5
templates with tools, and the template of the Qwen2-VL checkpoints ``hydrad make-model``
writes). A chat template that writes ``<tool_call>`` asks for it (``format_of``).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TAGS = (OPEN, CLOSE)
FORMATS = ("hermes",)


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


def _held_back(text: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``OPEN``."""
    for n in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


@dataclass
class HermesCalls:
    """One answer's content and calls as its text arrives. ``feed`` returns the content to
    send now and the ``tool_calls`` deltas (a call goes out whole, in one delta, when its
    block closes: OpenAI's streamed shape allows a call's arguments in one piece); text that
    may begin a block is held until it does or cannot. ``finish`` returns what is held: a
    last block without its closing tag is a call where its text is one, else (cut inside
    the call by ``max_tokens``) content, as is a block that holds no call."""

    calls: list[dict] = field(default_factory=list)
    content: str = ""  # every piece of content so far
    _held: str = ""
    _in_call: bool = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        held = self._held + text
        out, deltas = [], []
        while True:
            if not self._in_call:
                at = held.find(OPEN)
                if at < 0:
                    keep = _held_back(held)
                    out.append(held[:len(held) - keep])
                    held = held[len(held) - keep:]
                    break
                out.append(held[:at])
                held, self._in_call = held[at + len(OPEN):], True
            else:
                at = held.find(CLOSE)
                if at < 0:
                    break
                block, held, self._in_call = held[:at], held[at + len(CLOSE):], False
                call = _call(block)
                if call is None:
                    out.append(OPEN + block + CLOSE)
                else:
                    self.calls.append(call)
                    deltas.append({"index": len(self.calls) - 1, **call})
        self._held = held
        content = "".join(out)
        self.content += content
        return content, deltas

    def take(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """The content to send now and the ``tool_calls`` deltas of a piece of the answer
        (``final``: its last)."""
        content, deltas = self.feed(text)
        if final:
            rest, last = self.finish()
            content, deltas = content + rest, deltas + last
        return content, deltas

    def finish(self) -> tuple[str, list[dict]]:
        """What is held at the answer's end: content, or the call of a block the answer ended
        in without its closing tag (a model may stop right after the call's JSON)."""
        text, in_call = self._held, self._in_call
        self._held, self._in_call = "", False
        if in_call and (call := _call(text)) is not None:
            self.calls.append(call)
            return "", [{"index": len(self.calls) - 1, **call}]
        text = (OPEN if in_call else "") + text
        self.content += text
        return text, []

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.calls and reason == "stop" else reason


def read_answer(text: str) -> tuple[str | None, list[dict]]:
    """A whole answer's content (None where it is only whitespace beside calls) and calls."""
    calls = HermesCalls()
    calls.take(text, final=True)
    content = calls.content
    return (None if calls.calls and not content.strip() else content), calls.calls
