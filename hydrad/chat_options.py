"""How a conversation is rendered by the checkpoint's chat template: the options vLLM's chat
API and ``LLM.chat`` take beside the messages.

- ``add_generation_prompt`` (default true): end the prompt with the template's header of a new
  assistant turn, so the model answers;
- ``continue_final_message``: the conversation ends with an assistant message the model
  continues (no end of turn after it, no new header): an answer begun for the model;
- ``chat_template_kwargs``: the template's own variables (``enable_thinking`` and the like).
  Those the template does not read are left out, as vLLM leaves them out, so a client may
  send one set to any model; the names of the renderer's own arguments are refused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from hydrad.errors import RequestError

# Arguments of the template renderer and the variables it sets itself: a kwarg of one of
# these names would clash with them, not reach the template.
RESERVED = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "return_dict", "return_tensors", "return_assistant_tokens_mask",
    "processor_kwargs", "tokenizer_kwargs", "padding", "truncation", "max_length",
})
# The JSON text of one request's template variables at most: they reach the prompt's text.
MAX_KWARGS_CHARS = 65536


@dataclass(frozen=True)
class ChatTemplateOptions:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    # Characters of the kwargs' JSON text: counted with the messages' against the prompt's bound.
    num_chars: int = 0

    @classmethod
    def of(cls, add_generation_prompt: bool | None = None, continue_final_message: bool = False,
           kwargs: Mapping[str, Any] | None = None) -> ChatTemplateOptions:
        """Checked options; ``add_generation_prompt`` None: true unless the final message is
        continued. A request's errors name its fields."""
        if add_generation_prompt is None:
            add_generation_prompt = not continue_final_message
        if add_generation_prompt and continue_final_message:
            raise RequestError("continue_final_message and add_generation_prompt cannot both be true: one continues "
                               "the final message, the other starts a new one", param="continue_final_message")
        kwargs = dict(kwargs or {})
        num_chars = len(json.dumps(kwargs, default=str)) if kwargs else 0
        clash = sorted(RESERVED & set(kwargs))
        if clash:
            raise RequestError(f"chat_template_kwargs may not set {', '.join(clash)}: the request's own fields say "
                               "that", param="chat_template_kwargs")
        if num_chars > MAX_KWARGS_CHARS:
            raise RequestError(f"chat_template_kwargs holds {num_chars} characters; the limit is {MAX_KWARGS_CHARS}",
                               param="chat_template_kwargs")
        return cls(add_generation_prompt, continue_final_message, kwargs, num_chars)

    def check_messages(self, messages: list[dict]) -> None:
        """A continued final message must be the assistant's."""
        if self.continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
            raise RequestError("continue_final_message needs the last message to be the assistant's", param="messages")

    def template_kwargs(self, template: str) -> dict[str, Any]:
        """The kwargs ``template`` reads (the others are left out)."""
        if not self.kwargs:
            return {}
        used = template_variables(template)
        return {k: v for k, v in self.kwargs.items() if used is None or k in used}


@lru_cache(maxsize=16)
def template_variables(template: str) -> frozenset[str] | None:
    """The variables a Jinja template reads from its caller; None where this parser cannot
    read it (a tag of the renderer's own: every kwarg is then passed on)."""
    from jinja2 import TemplateSyntaxError, meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return frozenset(meta.find_undeclared_variables(env.parse(template)))
    except TemplateSyntaxError:
        return None


DEFAULT = ChatTemplateOptions()
