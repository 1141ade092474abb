"""Prefix state caching: rows sharing a prompt prefix restore its states and share its KV blocks, with the same
tokens as without the cache, on every family, with and without n-gram speculation, under chunked prefill and a
tight KV budget; what the cache holds returns to unused when the run ends."""

from __future__ import annotations

import random

import pytest

from tests.tiny_models import FAMILIES
from workers import ModelRunner, SamplingParams, SpeculativeConfig
from workers.prefix_cache import common_prefix_length

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# Shared prefixes: shorter than a KV block, exactly one, and several blocks plus a tail (past a checkpoint, 64).
PREFIXES = {"short": 10, "one block": 16, "blocks and a tail": 149}


def _templated(prefix_len: int, num_rows: int = 8, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(4, 120) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(4, 120) for _ in range(rng.randrange(3, 40))] for _ in range(num_rows)]


def _run(path: str, prompts: list[list[int]], caching: bool, **kwargs) -> tuple[list[list[int]], ModelRunner, list]:
    runner = ModelRunner.from_pretrained(path, max_num_seqs=4, enable_prefix_caching=caching, **kwargs)
    results = runner.generate(prompts, GREEDY)
    return [r.token_ids for r in results], runner, results


def _assert_nothing_held(runner: ModelRunner) -> None:
    """After the run: no cached block in use, no reservation left."""
    scheduler = runner._scheduler
    cache = scheduler.prefix_cache
    assert all(entry.refs == 0 for entry in cache.entries.values())
    assert scheduler.blocks.num_pinned == 0 and scheduler.blocks.num_reserved == 0


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("prefix", list(PREFIXES))
def test_cache_on_gives_the_tokens_of_cache_off(family, prefix, checkpoint_dir):
    """Chunked prefill at a small token budget (64) too: chunks, checkpoint stops and restored rows interleave."""
    path, prompts = str(checkpoint_dir(family)), _templated(PREFIXES[prefix])
    off, _, _ = _run(path, prompts, False, max_num_batched_tokens=64)
    on, runner, results = _run(path, prompts, True, max_num_batched_tokens=64)
    assert on == off
    hits = [r.num_cached_tokens for r in results]
    if PREFIXES[prefix] >= 64 + 9:  # a checkpoint fits in the shared prefix: every row after the first restores it
        assert hits[0] == 0 and all(h == 128 for h in hits[1:])
    else:
        assert hits == [0] * len(prompts)
    assert runner.scheduler_stats()["prefix_cache_hit_tokens"] == sum(hits)
    _assert_nothing_held(runner)


@pytest.mark.parametrize("family", ["granite_moe", "nemotron_dense", "qwen3_5"])
def test_cache_with_ngram_speculation_gives_the_tokens_of_cache_off(family, checkpoint_dir):
    path = str(checkpoint_dir(family))
    prompts = _templated(149, seed=1)
    speculative = SpeculativeConfig("ngram", 3, prompt_lookup_min=1, policy="fixed")
    off, _, _ = _run(path, prompts, False, speculative=speculative)
    on, runner, results = _run(path, prompts, True, speculative=speculative)
    assert on == off and sum(r.num_cached_tokens for r in results) > 0
    assert runner.spec_stats()["num_draft_tokens"] > 0
    _assert_nothing_held(runner)


def test_a_tight_kv_budget_evicts_unused_entries_and_admission_never_waits_on_them(checkpoint_dir):
    """Three templates one after another through a cache too small to keep them all: older templates are evicted
    (leaves first), every row runs, and the tokens stay those of cache off."""
    path = str(checkpoint_dir("bamba"))
    prompts = _templated(149, 4, seed=2) + _templated(149, 4, seed=3) + _templated(149, 4, seed=4)
    probe = ModelRunner.from_pretrained(path, max_num_seqs=4)
    plan = probe.memory_plan
    small = plan.reserved_bytes + 60 * plan.bytes_per_block  # room for about 4 rows of ~12 blocks and a little
    off, _, _ = _run(path, prompts, False, max_memory=small)
    on, runner, results = _run(path, prompts, True, max_memory=small)
    assert on == off and all(r.finish_reason == "length" for r in results)
    cache = runner._scheduler.prefix_cache
    assert len(cache.entries) < sum(len(p) // 16 for p in prompts)  # something was evicted
    _assert_nothing_held(runner)


def test_rows_of_one_template_admitted_together_wait_for_the_first_to_checkpoint_it(checkpoint_dir):
    path = str(checkpoint_dir("qwen3_5"))
    prompts = _templated(200, 4, seed=5)
    _, runner, results = _run(path, prompts, True)
    assert [r.num_cached_tokens for r in results] == [0, 192, 192, 192]


def test_common_prefix_length():
    a = list(range(200))
    assert common_prefix_length(a, a[:150] + [0]) == 150
    assert common_prefix_length(a, a) == 200 and common_prefix_length(a, []) == 0
    assert common_prefix_length(a, a[:64] + [-1] + a[65:]) == 64


@pytest.mark.parametrize("family", list(FAMILIES))
def test_scoring_computes_a_shared_prefix_once_with_the_same_logprobs(family, checkpoint_dir):
    """Sequences sharing a 149-token prefix (and one that shares nothing): the prefix's first 128 tokens are computed
    once for all of them, and every log-prob is what scoring without sharing gives (float32 rounding: the shared
    prefix runs alone, unshared sequences in padded batches)."""
    path = str(checkpoint_dir(family))
    sequences = _templated(149, 6, seed=8) + [list(range(4, 60))]
    scores = {}
    for caching in (False, True):
        runner = ModelRunner.from_pretrained(path, max_num_seqs=4, enable_prefix_caching=caching)
        scores[caching] = [r.token_logprobs for r in runner.score(sequences)]
        shared = runner._scorer.num_shared_tokens
        assert shared == (5 * 128 if caching else 0)
    for off, on, sequence in zip(scores[False], scores[True], sequences):
        assert len(on) == len(off) == len(sequence) - 1
        assert max(abs(a - b) for a, b in zip(on, off)) < 2e-5


@pytest.mark.parametrize(
    "method,family,draft",
    [
        ("draft", "granite_moe", "self"),
        ("draft", "bamba", "draft_attention"),
        ("draft", "nemotron_dense", "draft_hybrid"),
        ("mtp", "qwen3_5", None),
        ("mtp", "nemotron_moe", None),
    ],
)
@pytest.mark.parametrize("prefix", ["one block", "blocks and a tail"])
def test_cache_with_a_draft_model_or_mtp_gives_the_tokens_of_cache_off(method, family, draft, prefix, checkpoint_dir):
    """A draft model catches up on a restored request's whole context (its own states are not cached); an MTP head
    shares the prefix's KV but the last block, which the restored request copies and rewrites from the hidden state
    the checkpoint kept. Greedy tokens equal cache off either way; a model drafting for itself has every draft
    accepted (its caught-up states and KV are right)."""
    path = str(checkpoint_dir(family))
    draft_path = path if draft == "self" else str(checkpoint_dir(draft)) if draft else None
    speculative = SpeculativeConfig(method, 3, draft_model=draft_path, policy="fixed")
    prompts = _templated(PREFIXES[prefix], seed=9)
    off, _, _ = _run(path, prompts, False, speculative=speculative)
    on, runner, results = _run(path, prompts, True, speculative=speculative)
    assert on == off
    assert (sum(r.num_cached_tokens for r in results) > 0) == (PREFIXES[prefix] >= 73)
    stats = runner.spec_stats()
    assert stats["num_draft_tokens"] > 0
    if draft == "self":
        assert stats["acceptance_rate"] == 1.0
    _assert_nothing_held(runner)


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_moe"])
@pytest.mark.parametrize("prefix_len", [128, 149])  # rows diverge right at the checkpoint (128), or after it
def test_an_mtp_head_restored_from_the_cache_drafts_what_it_drafts_without(
    family, prefix_len, checkpoint_dir, monkeypatch
):
    """The head's KV of the shared prefix (but its last position, rewritten with the request's own next token from
    the hidden state the checkpoint kept) gives every request the drafts it gets without the cache."""
    path = str(checkpoint_dir(family))
    prompts = _templated(prefix_len, 8, seed=9)
    drafts = {}
    for caching in (False, True):
        runner = ModelRunner.from_pretrained(
            path, max_num_seqs=4, enable_prefix_caching=caching, speculative=SpeculativeConfig("mtp", 3, policy="fixed")
        )
        proposer = runner._make_proposer()
        propose, seen = proposer.propose, {}

        def recorded(requests, num_drafts, propose=propose, seen=seen):
            proposal = propose(requests, num_drafts)
            for request, row in zip(requests, proposal.token_ids.tolist()):
                row = [t for t in row if t != -1]  # without the batch's padding
                if row:
                    seen[(request.index, request.num_tokens)] = row
            return proposal

        monkeypatch.setattr(proposer, "propose", recorded)
        runner.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        drafts[caching] = seen
    assert drafts[True] == drafts[False] and len(drafts[True]) >= 8 * 3


def test_a_path_through_another_slots_blocks_is_never_evicted_under_it():
    """Two slots prefill the same prompt: the second's blocks stay its own, its path goes through the first's
    entries. When the first finishes and eviction runs, those entries stay (the second holds them) and the
    second's later blocks hang off live entries (it used to extend a path through evicted entries, and a later
    eviction failed on them)."""
    import types

    import torch

    from workers.model.kv_blocks import BlockTable
    from workers.prefix_cache import CheckpointStore, PrefixCache

    blocks = BlockTable(2, 64, 9, 16, torch.device("cpu"))
    pool = types.SimpleNamespace(conv=torch.zeros(1, 2, 1, 1), ssm=torch.zeros(1, 2, 1, 1, 1))
    cache = PrefixCache(blocks, CheckpointStore(pool, 2), multiple=16)
    prompt = list(range(64))
    paths = {0: [], 1: []}
    for slot in (0, 1):
        blocks.ensure(slot, 32)
        cache.insert(prompt, slot, paths[slot], 32)
    assert [e.block for e in paths[1]] == [e.block for e in paths[0]] != blocks.owned[1][:2]
    cache.release(paths[0])
    blocks.free_slot(0)
    cache.evict_blocks(8)
    assert all(entry.key in cache.entries for entry in paths[1])
    blocks.ensure(1, 64)
    cache.insert(prompt, 1, paths[1], 64)
    cache.release(paths[1])
    blocks.free_slot(1)
    cache.evict_blocks(8)  # everything unused goes, parents after their children
    assert not cache.entries and blocks.num_pinned == 0 and len(blocks._is_free) == 8
