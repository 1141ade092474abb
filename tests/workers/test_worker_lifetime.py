"""A worker lives for a whole job: what it holds must not grow with the runs, requests or positions it has seen."""

from __future__ import annotations

import weakref

import pytest
import torch

import workers.model.state
import workers.spec_decode.mtp
from workers import ModelRunner, SamplingParams, SpeculativeConfig

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class StorageTracker:
    """Records every state-pool and MTP-cache tensor allocated, and the most bytes they held at once."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.tensors: list[weakref.ref] = []
        self.peak = 0
        init, paged = workers.model.state.StatePool.__init__, workers.spec_decode.mtp.paged_kv_cache

        def tracked_init(pool, *args, **kwargs):
            init(pool, *args, **kwargs)
            self._add(pool.conv, pool.ssm, pool.key, pool.value)

        def tracked_paged(*args, **kwargs):
            cache = paged(*args, **kwargs)
            self._add(cache.key, cache.value)
            return cache

        monkeypatch.setattr(workers.model.state.StatePool, "__init__", tracked_init)
        monkeypatch.setattr(workers.spec_decode.mtp, "paged_kv_cache", tracked_paged)

    def _add(self, *tensors: torch.Tensor) -> None:
        self.tensors += [weakref.ref(t) for t in tensors]
        self.peak = max(self.peak, self.live_bytes())

    def live_bytes(self) -> int:
        """Bytes the recorded tensors still hold (freed storages and collected tensors count nothing)."""
        return sum(t.untyped_storage().nbytes() for ref in self.tensors if (t := ref()) is not None)


@pytest.mark.parametrize("method,family", [(None, "granite_moe"), ("draft", "bamba"), ("mtp", "qwen3_5")])
def test_a_larger_run_frees_the_old_workspace_before_allocating(method, family, checkpoint_dir, monkeypatch):
    """A later run that needs more slots and positions replaces the workspace (target slots, a draft model's slots,
    an MTP head's KV): the old storage is freed first, so the most ever held is what the final runs hold."""
    tracker = StorageTracker(monkeypatch)
    path = str(checkpoint_dir(family))
    speculative = (
        None
        if method is None
        else SpeculativeConfig(method, 2, draft_model=path if method == "draft" else None, policy="fixed")
    )
    runner = ModelRunner.from_pretrained(path, max_num_seqs=8, speculative=speculative)
    small = runner.generate([[5, 6, 7]], GREEDY)
    large = runner.generate(
        [list(range(4, 4 + 40 + i)) for i in range(6)], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    )
    again = runner.generate([[5, 6, 7]], GREEDY)
    assert [r.finish_reason for r in large] == ["length"] * 6 and small[0].token_ids == again[0].token_ids
    assert tracker.live_bytes() > 0
    assert tracker.peak == tracker.live_bytes()


class PlainThen:
    """A policy that keeps every request plain for its first `plain_steps` steps, then drafts fully."""

    def __init__(self, policy, plain_steps: int):
        self.policy, self.plain_steps, self.steps = policy, plain_steps, 0

    def num_drafts(self, request_ids: list[int], budgets: list[int]) -> list[int]:
        self.steps += 1
        return [0] * len(budgets) if self.steps <= self.plain_steps else budgets

    def __getattr__(self, name: str):
        return getattr(self.policy, name)


def _mtp_run(path: str, monkeypatch: pytest.MonkeyPatch, bounded: bool) -> tuple[list, list[list[int]], int]:
    """Greedy MTP generation plain for 120 steps, then drafting: (results, every proposal's drafts, the most
    pending positions one row held). Unbounded: the proposer as it was, consuming pending states only to draft."""
    monkeypatch.setattr(workers.spec_decode.mtp, "MAX_PENDING_POSITIONS", 16)
    if not bounded:
        monkeypatch.setattr(workers.spec_decode.mtp.MtpProposer, "consume_known", lambda self, requests: None)
    runner = ModelRunner.from_pretrained(path, max_num_seqs=4, speculative=SpeculativeConfig("mtp", 2, policy="fixed"))
    runner._policy = PlainThen(runner._policy, 120)
    proposer = runner._make_proposer()
    drafts, most = [], 0
    propose, observe = proposer.propose, proposer.observe_target

    def recorded_propose(requests, num_drafts):
        proposal = propose(requests, num_drafts)
        drafts.append(proposal.token_ids.tolist())
        return proposal

    def recorded_observe(*args):
        nonlocal most
        observe(*args)
        most = max([most] + [p.count for p in proposer.pending.values()])

    monkeypatch.setattr(proposer, "propose", recorded_propose)
    monkeypatch.setattr(proposer, "observe_target", recorded_observe)
    prompts = [list(range(4, 4 + 90)), [5, 6, 7]]
    results = runner.generate(prompts, SamplingParams(temperature=0, max_tokens=150, ignore_eos=True))
    return results, drafts, most


def test_mtp_pending_hidden_states_stay_bounded_through_a_plain_stretch(checkpoint_dir, monkeypatch):
    """While the policy keeps requests plain (and for a long prompt), the MTP proposer consumes the target hidden
    states it would otherwise keep for every position: at most MAX_PENDING_POSITIONS + k + 1 stay pending per row,
    and when drafting resumes its drafts are the ones the unbounded proposer made."""
    path = str(checkpoint_dir("qwen3_5"))
    bounded, bounded_drafts, bounded_most = _mtp_run(path, monkeypatch, bounded=True)
    unbounded, unbounded_drafts, unbounded_most = _mtp_run(path, monkeypatch, bounded=False)
    assert unbounded_most > 200 and bounded_most <= 16 + 3
    assert bounded_drafts == unbounded_drafts and len(bounded_drafts) > 5
    assert [r.token_ids for r in bounded] == [r.token_ids for r in unbounded]
