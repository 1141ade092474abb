"""How a chat (messages) row becomes a prompt, with vLLM's chat options, and how its output text is split.

The template is the tokenizer's, or `chat_template` (a template's text, the job's `--chat-template` file read on
the driver) instead; either is rendered by transformers' `apply_chat_template`, whose Jinja environment is
sandboxed: no code from the model repository or the template runs outside it. `chat_template_kwargs` are passed to
the template as variables (`enable_thinking`, …). `add_generation_prompt` (on by default, as vLLM) opens the
assistant's turn; `continue_final_message` instead leaves the conversation's last message open for the model to
continue (vLLM's meaning; not both).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workers.reasoning import check_reasoning_parser, split_reasoning

# Arguments of `apply_chat_template` that the options set themselves, so a template variable cannot.
RESERVED_KWARGS = frozenset(
    "conversation messages chat_template add_generation_prompt continue_final_message tokenize return_dict "
    "return_tensors padding truncation max_length tokenizer_kwargs return_assistant_tokens_mask".split()
)


@dataclass(frozen=True)
class ChatOptions:
    """How chat rows are rendered, and which reasoning parser splits every row's output (None: none)."""

    chat_template: str | None = None  # a template's text overriding the tokenizer's (None: the tokenizer's)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        check_chat_options(self.chat_template_kwargs, self.add_generation_prompt, self.continue_final_message)
        check_reasoning_parser(self.reasoning_parser)

    def render(self, tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
        """The token ids of `messages` rendered; `ValueError` when the template rejects them."""
        if self.continue_final_message and messages[-1].get("role") != "assistant":
            raise ValueError("continue_final_message needs a conversation ending in an assistant message")
        try:
            ids = tokenizer.apply_chat_template(
                messages,
                chat_template=self.chat_template,
                add_generation_prompt=self.add_generation_prompt,
                continue_final_message=self.continue_final_message,
                tokenize=True,
                return_dict=False,
                **self.chat_template_kwargs,
            )
        except Exception as error:  # the template itself rejected the messages
            raise ValueError(f"chat template failed: {type(error).__name__}: {error}") from error
        return list(ids)

    def split(self, text: str | None) -> tuple[str | None, str | None]:
        """(reasoning, answer) of an output text by the reasoning parser (which reads `enable_thinking`)."""
        assert self.reasoning_parser is not None
        return split_reasoning(self.reasoning_parser, text, self.chat_template_kwargs)


def check_chat_options(kwargs: Any, add_generation_prompt: bool, continue_final_message: bool) -> None:
    """`ValueError` naming the option: kwargs not a mapping of names, a reserved name, or both prompt endings."""
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"chat_template_kwargs={kwargs!r} is invalid: must be a JSON object of template variables")
    reserved = sorted(RESERVED_KWARGS & set(kwargs))
    if reserved:
        raise ValueError(
            f"chat_template_kwargs cannot set {', '.join(reserved)}: these are apply_chat_template's own arguments "
            "(use --chat-template, --add-generation-prompt, --continue-final-message)"
        )
    if add_generation_prompt and continue_final_message:
        raise ValueError(
            "add_generation_prompt and continue_final_message cannot both be on: give --no-add-generation-prompt "
            "with --continue-final-message"
        )
