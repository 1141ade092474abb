"""Forced acceptance patterns: after every speculative step the states equal those of plain decoding.

A scripted proposer drafts the plain greedy continuation with a chosen number of correct tokens followed by wrong
ones, so greedy verification accepts exactly that many. Patterns mix, per request and per step: 0 drafts, all
rejected, all accepted, partial, and whole steps where no request drafts (vLLM #39273 / #52942 read a stale state
slot on such steps).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import ALL_FAMILIES
from tests.tiny_models import engine_config
from workers import ModelRunner, SamplingParams
from workers.model import ForwardBatch, StatePool
from workers.requests import Request
from workers.scheduler import Scheduler
from workers.spec_decode.draft_model import DraftModelProposer
from workers.spec_decode.proposal import Proposal, Proposer

TOL = dict(atol=5e-5, rtol=1e-4)  # float32 rounding of native vs chunked paths; a wrong shift is off by O(0.1)
K = 4
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# (num drafts, num correct) patterns, cycled per request and step.
PATTERNS = [(0, 0), (4, 4), (4, 0), (2, 1), (3, 3), (1, 0), (4, 2), (2, 2)]


class ScriptedProposer(Proposer):
    """Drafts the reference continuation: `correct` right tokens, then wrong ones; records what it expects."""

    def __init__(self, reference: dict[int, list[int]], vocab_size: int):
        self.reference, self.vocab_size = reference, vocab_size
        self.step, self.expected, self.seen = 0, [], []

    def start(self, pool, max_chunk_tokens: int) -> None:
        pass

    def admit(self, requests: list[Request]) -> None:
        pass

    def move(self, source: int, target: int) -> None:
        pass

    def propose(self, requests: list[Request], num_drafts: list[int]) -> Proposal:
        self.step += 1
        drafts, self.expected = [], []
        for request, budget in zip(requests, num_drafts):
            k, correct = PATTERNS[(request.index * 3 + self.step) % len(PATTERNS)]
            if self.step % 5 == 0:
                k = 0  # a whole step without drafts
            k = min(k, budget)
            correct = min(correct, k)
            ref = self.reference[request.index][len(request.output) :]
            wrong = [(t + 1) % self.vocab_size for t in ref[correct:k]]
            drafts.append(ref[:correct] + wrong)
            self.expected.append(correct + 1)
        return Proposal.from_lists(drafts, None)

    def accepted(self, requests: list[Request], num_accepted: list[int]) -> None:
        self.seen.append((list(num_accepted), list(self.expected)))


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 128, (n,), generator=g).tolist() for n in [1, 9, 17, 4, 30, 12]]


def _requests(prompts, max_model_len=512) -> list[Request]:
    return [
        Request(i, p, PARAMS, frozenset(), torch.Generator().manual_seed(i), max_model_len)
        for i, p in enumerate(prompts)
    ]


def _reference_states(model, tokens: list[int]):
    """States and KV after a plain prefill of `tokens` from zero."""
    pool = StatePool(model.config, 1, len(tokens) + 1, torch.device("cpu"), torch.float32)
    batch = ForwardBatch(torch.tensor([0]), torch.tensor([0]), torch.tensor([len(tokens)]))
    with torch.no_grad():
        out = model(torch.tensor([tokens]), batch, pool.zeros(1), pool.kv_caches())
    return out.mamba_states, pool


def _assert_slot_matches(pool, slot: int, model, tokens: list[int], tol: dict = TOL) -> None:
    states, ref_pool = _reference_states(model, tokens)
    for ours, ref in zip(pool.read(torch.tensor([slot])), states, strict=True):
        torch.testing.assert_close(ours.conv, ref.conv, **tol)
        torch.testing.assert_close(ours.ssm, ref.ssm, **tol)
    n = len(tokens)
    for got, want in zip(pool.slot_kv(slot, n), ref_pool.slot_kv(0, n)):
        torch.testing.assert_close(got, want, **tol)


def assert_forced_acceptance_exact(runner: ModelRunner, tol: dict = TOL) -> None:
    """Scripted acceptance patterns (0 drafts, none / some / all accepted, plain steps) through 4 slots: after every
    step each running request's slot holds the states and KV of a fresh prefill of its kept tokens (within `tol`),
    and the output is plain greedy decoding's (exactly)."""
    prompts = _prompts()
    reference = {i: r.token_ids for i, r in enumerate(runner.generate(prompts, PARAMS))}
    proposer = ScriptedProposer(reference, runner.config.vocab_size)
    scheduler = Scheduler(runner.model, engine_config(4, K), _requests(prompts), proposer)
    while scheduler.has_work():
        scheduler.step()
        for request in scheduler.running:  # the slot covers every token but the newest
            kept = (request.prompt + request.output)[:-1]
            _assert_slot_matches(scheduler.pool, request.slot, runner.model, kept, tol)
    for accepted, expected in proposer.seen:
        assert accepted == expected
    assert {n for accepted, _ in proposer.seen for n in accepted} >= {1, 2, 3, 5}
    assert {r.index: r.output for r in scheduler.finished} == reference


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_forced_acceptance_patterns_keep_states_exact(family, checkpoint_dir):
    assert_forced_acceptance_exact(ModelRunner.from_pretrained(str(checkpoint_dir(family)), max_num_seqs=4))


@pytest.mark.parametrize("draft", ["draft_hybrid", "granite_moe", "qwen3_5"])
def test_hybrid_draft_state_is_shifted_to_what_it_has_seen(draft, checkpoint_dir):
    # The reference linear path: this test is about the shifting logic, compared at float32 rounding level.
    target = ModelRunner.from_pretrained(str(checkpoint_dir("nemotron_moe")), max_num_seqs=3, linear_backend="torch")
    draft_runner = ModelRunner.from_pretrained(str(checkpoint_dir(draft)), linear_backend="torch")
    prompts = _prompts(seed=3)
    reference = {i: r.token_ids for i, r in enumerate(target.generate(prompts, PARAMS))}
    proposer = DraftModelProposer(draft_runner.model)
    scheduler = Scheduler(target.model, engine_config(3, 3), _requests(prompts), proposer)
    steps_checked = 0
    while scheduler.has_work():
        scheduler.step()
        for request in scheduler.running:
            covered = proposer.covered[request.slot]
            if covered:
                tokens = (request.prompt + request.output)[:covered]
                # The draft reached this state through a long prefill and up to 24 single steps, the reference
                # through one chunked prefill: float32 rounding accumulates, so compare relatively (1e-4). The
                # The target's TOL: float32 rounding of native steps against a chunked prefill, whose size depends
                # on the CPU's vector width (1.5e-5 seen on an AVX2 build); a wrong shift is off by O(0.1).
                _assert_slot_matches(proposer.pool, request.slot, draft_runner.model, tokens)
                steps_checked += 1
            _assert_slot_matches(scheduler.pool, request.slot, target.model, (request.prompt + request.output)[:-1])
    assert steps_checked > 10
    assert {r.index: r.output for r in scheduler.finished} == reference
