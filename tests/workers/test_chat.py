"""Chat rows rendered with vLLM's chat options: template kwargs change the prompt as the template says, a template
overrides the tokenizer's, the generation prompt / continued final message forms, and the sandbox."""

from __future__ import annotations

import pytest

from tests.tiny_models import make_tokenizer
from workers.chat import ChatOptions
from workers.rows import PromptSource

# Words of the test tokenizer's vocabulary only, so the rendered text round-trips through its word-level ids:
# a user turn is "red …", an assistant turn "big …", each closed by "mat"; the generation prompt is "hello", then
# "world" opens a thought, or "world world" is an empty thought when the template is told enable_thinking=false.
THINKING_TEMPLATE = (
    "{% for m in messages %}{{ 'red' if m.role == 'user' else 'big' }} {{ m.content }} mat {% endfor %}"
    "{% if add_generation_prompt %}hello {% if enable_thinking is defined and not enable_thinking %}world world"
    "{% else %}world{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "a dog"}]


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = make_tokenizer()
    tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer


def _rendered(tokenizer, options: ChatOptions, messages=MESSAGES) -> str:
    ids = PromptSource(messages_column="m", chat=options).token_ids({"m": messages}, tokenizer)
    return tokenizer.decode(ids)


def test_template_kwargs_change_the_prompt_as_the_template_says(tokenizer):
    assert _rendered(tokenizer, ChatOptions()) == "red the cat mat big a dog mat hello world"
    off = ChatOptions(chat_template_kwargs={"enable_thinking": False})
    assert _rendered(tokenizer, off) == "red the cat mat big a dog mat hello world world"
    on = ChatOptions(chat_template_kwargs={"enable_thinking": True})
    assert _rendered(tokenizer, on) == "red the cat mat big a dog mat hello world"


def test_a_template_overrides_the_tokenizers(tokenizer):
    other = "{% for m in messages %}{{ m.content }} and {% endfor %}{% if add_generation_prompt %}to{% endif %}"
    assert _rendered(tokenizer, ChatOptions(chat_template=other)) == "the cat and a dog and to"
    assert tokenizer.chat_template == THINKING_TEMPLATE  # the tokenizer itself is unchanged


def test_generation_prompt_and_continued_final_message(tokenizer):
    no_prompt = ChatOptions(add_generation_prompt=False)
    assert _rendered(tokenizer, no_prompt) == "red the cat mat big a dog mat"
    # The final assistant message stays open: no closing "mat", no generation prompt.
    continued = ChatOptions(add_generation_prompt=False, continue_final_message=True)
    assert _rendered(tokenizer, continued) == "red the cat mat big a dog"
    with pytest.raises(ValueError, match="ending in an assistant message"):
        _rendered(tokenizer, continued, MESSAGES[:1])


def test_bad_options_are_refused_naming_them():
    with pytest.raises(ValueError, match="add_generation_prompt and continue_final_message cannot both be on"):
        ChatOptions(continue_final_message=True)
    with pytest.raises(ValueError, match="chat_template_kwargs cannot set add_generation_prompt, tokenize"):
        ChatOptions(chat_template_kwargs={"tokenize": False, "add_generation_prompt": False})
    with pytest.raises(ValueError, match="chat_template_kwargs=.* must be a JSON object"):
        ChatOptions(chat_template_kwargs=[("enable_thinking", False)])


def test_a_template_cannot_reach_python_internals(tokenizer):
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ValueError, match="chat template failed: SecurityError"):
        _rendered(tokenizer, ChatOptions(chat_template=escape))
