"""Row scoring against transformers: whole texts, completion-only masking, chat turns, bad rows, truncation."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import ALL_FAMILIES
from workers import ModelRunner
from workers.scoring import ScoreSpec, score_shard

TEXTS = ["the cat sat on the mat and the dog ran to the big red mat .", "hello world", "a dog . a cat . a mat ."]


def _hf_token_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([ids]), position_ids=torch.arange(len(ids))[None]).logits.float()
    return logits.log_softmax(-1)[0, :-1].gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_sum_logprob_matches_transformers(family, checkpoint_dir, hf_model):
    path = checkpoint_dir(family)
    runner = ModelRunner.from_pretrained(str(path))
    columns = score_shard(runner, [{"text": t} for t in TEXTS], ScoreSpec(text_column="text", token_logprobs=True))
    for i, text in enumerate(TEXTS):
        ids = runner.tokenizer.encode(text)
        reference = _hf_token_logprobs(hf_model(path), ids)
        assert columns["num_scored_tokens"][i] == len(ids) - 1
        assert abs(columns["sum_logprob"][i] - reference.sum().item()) < 1e-3
        assert columns["perplexity"][i] == pytest.approx(math.exp(-reference.mean().item()), rel=1e-3)
        torch.testing.assert_close(torch.tensor(columns["token_logprobs"][i]), reference, atol=1e-4, rtol=0)


def test_prompt_completion_scores_exactly_the_completion_tokens(checkpoint_dir, hf_model):
    path = checkpoint_dir("nemotron_moe")
    runner = ModelRunner.from_pretrained(str(path))
    row = {"q": "the cat sat on", "a": "the big red mat"}
    columns = score_shard(runner, [row], ScoreSpec(prompt_column="q", completion_column="a", token_logprobs=True))
    prompt = runner.tokenizer.encode(row["q"])
    completion = runner.tokenizer.encode(row["a"], add_special_tokens=False)
    reference = _hf_token_logprobs(hf_model(path), prompt + completion)[len(prompt) - 1 :]
    assert columns["num_scored_tokens"] == [len(completion)] == [4]
    assert abs(columns["sum_logprob"][0] - reference.sum().item()) < 1e-3
    torch.testing.assert_close(torch.tensor(columns["token_logprobs"][0]), reference, atol=1e-4, rtol=0)


def test_chat_scores_the_last_assistant_turn(checkpoint_dir):
    runner = ModelRunner.from_pretrained(str(checkpoint_dir("bamba")))
    conversation = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "the cat sat"}]
    columns = score_shard(runner, [{"m": conversation}, {"m": conversation[:1]}], ScoreSpec(messages_column="m"))
    full = runner.tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False)
    prompt = runner.tokenizer.apply_chat_template(
        conversation[:1], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert columns["num_scored_tokens"][0] == len(full) - len(prompt) > 0
    assert "assistant" in columns["error"][1]


def test_bad_rows_and_truncation(checkpoint_dir):
    runner = ModelRunner.from_pretrained(str(checkpoint_dir("granite_dense")), max_model_len=12)
    long = " ".join(["cat"] * 20)
    rows = [{"text": ""}, {"text": 7}, {"text": long}, {"text": "the cat sat"}]
    strict = score_shard(runner, rows, ScoreSpec(text_column="text"))
    assert strict["error"][0] == "'text' is empty"
    assert "must be a string" in strict["error"][1]
    assert "more than max_model_len=12 (use --truncate)" in strict["error"][2]
    assert strict["error"][3] is None and strict["num_scored_tokens"][3] == 2
    cut = score_shard(runner, rows, ScoreSpec(text_column="text", truncate=True))
    assert cut["num_truncated_tokens"][2] == 8 and cut["num_scored_tokens"][2] == 11 and cut["error"][2] is None
    full = score_shard(
        ModelRunner.from_pretrained(str(checkpoint_dir("granite_dense"))),
        [{"text": " ".join(["cat"] * 12)}],
        ScoreSpec(text_column="text"),
    )
    assert cut["sum_logprob"][2] == pytest.approx(full["sum_logprob"][0], abs=1e-4)  # the first 12 tokens, scored alike
