"""A generation job's chat flags → the workers' `ChatOptions`, checked on the driver.

`--chat-template` names a file: it is read here, once, and the config then carries the template's text, so the
manifest records it and a rerun with another template (or an edited file) refuses to resume like any other
difference. The template is compiled here (transformers' sandboxed Jinja environment): a syntax error fails the job
before any worker starts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pipeline.config import ChatConfig
from workers.chat import ChatOptions


def resolve_chat_template(chat: ChatConfig) -> ChatConfig:
    """The chat section with `--chat-template`'s file replaced by its text; `ValueError` naming the flag for a
    missing file or a template that does not compile."""
    if chat.chat_template is None:
        return chat
    path = Path(chat.chat_template).expanduser()
    if not path.is_file():
        raise ValueError(f"--chat-template {chat.chat_template!r}: no such file (give a Jinja chat template file)")
    text = path.read_text()
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(text)
    except TemplateError as error:
        raise ValueError(f"--chat-template {chat.chat_template!r}: not a valid Jinja template ({error})") from None
    return dataclasses.replace(chat, chat_template=text)


def chat_options(chat: ChatConfig) -> ChatOptions:
    """The workers' `ChatOptions` of a resolved chat section (its `chat_template` holds the template's text)."""
    return ChatOptions(
        chat_template=chat.chat_template,
        chat_template_kwargs=dict(chat.chat_template_kwargs or {}),
        add_generation_prompt=chat.add_generation_prompt,
        continue_final_message=chat.continue_final_message,
        reasoning_parser=chat.reasoning_parser,
    )
