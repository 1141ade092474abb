"""A speculative method added through the registry alone: one proposer class, one `register` call."""

from __future__ import annotations

import pytest

from workers import ModelRunner, SamplingParams, SpeculativeConfig
from workers.spec_decode import registry
from workers.spec_decode.proposal import Proposal, Proposer

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


class RepeatLastProposer(Proposer):
    """Drafts the request's last token k times: no state, no model, declared traits left at their defaults."""

    def __init__(self, num_speculative_tokens: int):
        self.num_speculative_tokens = num_speculative_tokens
        self.num_proposals = 0

    def propose(self, requests, num_drafts) -> Proposal:
        self.num_proposals += 1
        return Proposal.from_lists([[r.last_token] * k for r, k in zip(requests, num_drafts)], None)


@pytest.fixture
def repeat_last():
    built: list[RepeatLastProposer] = []

    def build(context: registry.ProposerContext) -> RepeatLastProposer:
        built.append(RepeatLastProposer(context.num_speculative_tokens))
        return built[-1]

    registry.register("repeat_last", RepeatLastProposer, build)
    yield built
    registry.unregister("repeat_last")


def test_a_registered_method_speculates_and_keeps_greedy_output(checkpoint_dir, repeat_last):
    path = str(checkpoint_dir("bamba"))
    prompts = [[7] * 9, [5, 6] * 6, [11, 12, 13, 11, 12, 13, 11]]
    spec = SpeculativeConfig("repeat_last", 3, policy="fixed")
    runner = ModelRunner.from_pretrained(path, max_num_seqs=4, speculative=spec)
    speculated = [r.token_ids for r in runner.generate(prompts, GREEDY)]
    plain = [r.token_ids for r in ModelRunner.from_pretrained(path, max_num_seqs=4).generate(prompts, GREEDY)]
    assert speculated == plain
    assert len(repeat_last) == 1 and repeat_last[0].num_proposals > 0
    assert runner.spec_stats()["num_draft_tokens"] > 0


def test_unknown_and_taken_method_names_are_refused(repeat_last):
    with pytest.raises(ValueError, match="repeat_last"):
        SpeculativeConfig("no_such_method")
    with pytest.raises(ValueError, match="already taken"):
        registry.register("ngram", RepeatLastProposer, lambda context: RepeatLastProposer(1))
