"""Which chat template /v1/chat/completions renders with: `--chat-template`, else the tokenizer's own.

`--chat-template` (SGLang's flag) takes a path to a Jinja template file, a built-in name (`BUILTIN`),
or an inline Jinja template. Without it the tokenizer's `chat_template` is used; a tokenizer without
one gets no silent fallback: chat completions are refused with a message naming the flag (a base model
answering a prompt the operator never chose is worse than an error). The choice is made and checked
(rendered once) at start-up, and logged.

This module resolves and describes the template; rendering is openai_api.render_chat's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

# Built-in templates, written for this server (HF's Jinja dialect, as apply_chat_template renders it).
BUILTIN: dict[str, str] = {
    # One "role: content" line per message, then "assistant:" (what a base model can continue).
    "plain": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
             "{% if add_generation_prompt %}assistant:{% endif %}",
    # ChatML (Qwen, many instruct models): <|im_start|>role\ncontent<|im_end|>\n per message.
    "chatml": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
}


class NoChatTemplate(ValueError):
    """Chat completions asked of a server whose tokenizer has no template and no --chat-template."""


@dataclass(frozen=True)
class ChatTemplate:
    template: str | None  # None: chat completions are refused
    source: str  # for the start-up log and the refusal: where the template came from

    def require(self) -> str:
        if self.template is None:
            raise NoChatTemplate(
                f"this model's tokenizer has no chat template, so /v1/chat/completions cannot build a prompt; "
                f"start the server with --chat-template (a Jinja file, an inline template, or one of "
                f"{sorted(BUILTIN)}), or use /v1/completions with your own prompt")
        return self.template


def resolve_chat_template(value: str | None, tokenizer) -> ChatTemplate:
    """--chat-template's value (or None) and the engine's HF tokenizer (or None) -> the template to use.

    Raises ValueError naming the flag when the value is none of a file, a built-in name or a template,
    or when the template does not render a one-message conversation."""
    if value is None:
        own = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
        if not own:
            return ChatTemplate(None, "none (the tokenizer has no chat template and --chat-template is not set: "
                                      "chat completions are refused)")
        return ChatTemplate(own, "the tokenizer's own")
    if value in BUILTIN:
        chosen = ChatTemplate(BUILTIN[value], f"built-in {value!r} (--chat-template)")
    elif "{{" in value or "{%" in value:
        chosen = ChatTemplate(value, "inline (--chat-template)")
    elif Path(value).is_file():
        chosen = ChatTemplate(Path(value).read_text(), f"file {value} (--chat-template)")
    else:
        raise ValueError(f"--chat-template {value!r} is not a file, a built-in name ({sorted(BUILTIN)}) or an "
                         f"inline Jinja template")
    if tokenizer is not None:
        try:  # fail at start-up, not on the first chat request
            tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=chosen.template,
                                          tokenize=False, add_generation_prompt=True)
        except Exception as e:
            raise ValueError(f"--chat-template {value!r}: the template does not render: {e}") from e
    return chosen


@functools.lru_cache(maxsize=16)
def takes_content_parts(template: str) -> bool:
    """Whether `template` loops over a message's content (`{% for part in message['content'] %}`: it renders a
    list of content parts itself, as Llama-4's and most multimodal templates do) -- SGLang's "openai" content
    format; otherwise ("string") a message's text parts are joined into one string before rendering. A
    template Jinja cannot parse here (HF's own tags) counts as taking strings."""
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateError:
        return False
    for loop in tree.find_all(nodes.For):
        it = loop.iter
        while isinstance(it, nodes.Filter):  # message['content'] | selectattr(...)
            it = it.node
        if (isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) and it.arg.value == "content") or \
                (isinstance(it, nodes.Getattr) and it.attr == "content"):
            return True
    return False
