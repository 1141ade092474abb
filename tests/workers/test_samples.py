"""n samples per prompt (`workers/samples.py`): forks equal a fresh prefill on every family, sample j equals its row
run alone with sample j's seed, greedy samples equal the n = 1 output under every speculative method, executor,
prefix caching and chunked prefill, and a group is admitted whole (or fails whole)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.conftest import ALL_FAMILIES
from tests.tiny_models import draft_for
from workers import ModelRunner, SamplingParams, SpeculativeConfig, sample_seed

PROMPT = [(7 * i) % 120 + 4 for i in range(37)]  # 37 tokens: 2 full KV blocks of 16 and a partial one
OTHER = [(11 * i) % 97 + 5 for i in range(21)]


def _splitmix64(state: int) -> list[int]:
    """The first outputs of Vigna's splitmix64 from `state` (the reference C code, transcribed)."""
    mask, out = 2**64 - 1, []
    for _ in range(3):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        out.append(z ^ (z >> 31))
    return out


def test_sample_seed():
    assert sample_seed(1234, 0) == 1234 and sample_seed(-5, 0) == -5  # n = 1 is unchanged
    # Sample j of seed 0 is splitmix64's j-th output from state 0 (published first value 0xE220A8397B1DCDAF).
    assert [sample_seed(0, j) for j in (1, 2, 3)] == _splitmix64(0)
    assert sample_seed(0, 1) == 0xE220A8397B1DCDAF
    # Rows seed with seed + i: no sample of 1,000 rows × 8 samples collides with another or with a row's own seed.
    seeds = {sample_seed(42 + i, j) % 2**64 for i in range(1000) for j in range(8)}
    assert len(seeds) == 8000


@pytest.mark.parametrize("n", [0, -1, 1.5, True, "2"])
def test_n_is_validated(n):
    with pytest.raises(ValueError, match=r"SamplingParams\.n=.* must be an integer ≥ 1"):
        SamplingParams(n=n)


def _step_until_forked(runner: ModelRunner, sampling: SamplingParams) -> list:
    """Add PROMPT, step until its prefill completed; the live requests in sample order."""
    runner.add_request("p", PROMPT, sampling)
    scheduler = runner._engine()
    while not scheduler.running:
        runner.step()
    return sorted(scheduler.running, key=lambda r: r.sample_index)


def _slot_state(runner: ModelRunner, slot: int) -> list[torch.Tensor]:
    pool = runner._scheduler.pool
    return [pool.conv[:, slot].clone(), pool.ssm[:, slot].clone(), *pool.slot_kv(slot, len(PROMPT))]


# Every family: tiny_models' and one of each family kept in a fixture module of its own (conftest builds them all).
EVERY_FAMILY = [
    *ALL_FAMILIES,
    "falcon_h1",
    "kimi_linear",
    "lfm2",
    "lfm2_moe",
    "jamba_moe",
    "olmo_hybrid",
    "zamba2_abab",
]


@pytest.mark.parametrize("family", EVERY_FAMILY)
def test_forks_equal_a_fresh_prefill_and_sample_j_equals_its_seed_alone(family, checkpoint_dir):
    runner = ModelRunner.from_pretrained(str(checkpoint_dir(family)), max_num_seqs=4, enable_prefix_caching=False)
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    (alone,) = _step_until_forked(runner, greedy)
    fresh = _slot_state(runner, alone.slot)
    while runner.has_unfinished_requests():
        runner.step()
    samples = _step_until_forked(runner, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, n=3))
    owned = runner._scheduler.blocks.owned
    for sample in samples:
        for got, want in zip(_slot_state(runner, sample.slot), fresh):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    leader, forks = samples[0], samples[1:]
    for fork in forks:  # the full prompt blocks shared, the partial one copied
        assert owned[fork.slot][:2] == owned[leader.slot][:2] and owned[fork.slot][2] != owned[leader.slot][2]
    while runner.has_unfinished_requests():
        runner.step()
    # Sampled: sample j of a seeded prompt is the prompt run alone with sample j's seed.
    params = dict(temperature=1.0, top_k=40, max_tokens=8, ignore_eos=True)
    results = runner.generate([PROMPT, OTHER], SamplingParams(**params, seed=7, n=3))
    assert [r.sample_index for r in results] == [0, 1, 2] * 2
    for i, prompt in enumerate([PROMPT, OTHER]):
        for j in range(3):
            (single,) = runner.generate([prompt], SamplingParams(**params, seed=sample_seed(7, j)))
            assert results[3 * i + j].token_ids == single.token_ids
    assert len({tuple(r.token_ids) for r in results[:3]}) > 1  # the samples differ


CONFIGS = {  # name → (family, from_pretrained options)
    "module": ("granite_moe", dict(decode_plan=False)),
    "native": ("granite_moe", dict(decode_plan=True)),
    "graph-eager": ("bamba", dict(cuda_graphs=True)),
    "prefix-cache": ("qwen3_next", dict(enable_prefix_caching=True)),
    "chunked": ("granite_dense", dict(max_num_batched_tokens=16, enable_prefix_caching=False)),
    "chunked-cached": ("qwen3_5", dict(max_num_batched_tokens=16, enable_prefix_caching=True)),
    "ngram": ("granite_moe", dict(speculative=("ngram", None))),
    "draft-hybrid": ("bamba", dict(speculative=("draft", "draft_hybrid"))),
    "draft-module": ("qwen3_next", dict(speculative=("draft", "draft_attention"), decode_plan=False)),
    "draft-chunked": ("granite_dense", dict(speculative=("draft", "draft_hybrid"), max_num_batched_tokens=16)),
    "mtp-nemotron": ("nemotron_dense", dict(speculative=("mtp", None))),
    "mtp-gdn-cached": ("qwen3_next", dict(speculative=("mtp", None), enable_prefix_caching=True)),
    "mtp-chunked": ("nemotron_moe", dict(speculative=("mtp", None), max_num_batched_tokens=16, decode_plan=False)),
}


def _runner(name: str, checkpoint_dir) -> ModelRunner:
    family, options = CONFIGS[name]
    options = dict(options)
    if "speculative" in options:
        method, draft = options.pop("speculative")
        draft_model = str(checkpoint_dir(draft_for(family, draft))) if draft else None
        options["speculative"] = SpeculativeConfig(
            method, 3, draft_model=draft_model, prompt_lookup_min=1, prompt_lookup_max=3, policy="fixed"
        )
    return ModelRunner.from_pretrained(str(checkpoint_dir(family)), max_num_seqs=8, **options)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_n_samples_under_every_executor_cache_chunking_and_speculation(name, checkpoint_dir):
    """Greedy samples all equal the n = 1 output; seeded sampled ones equal their row run alone with their seed."""
    runner = _runner(name, checkpoint_dir)
    prompts = [PROMPT, PROMPT[:32], OTHER * 2]  # a partial last block, exactly 2 blocks, a repeating prompt
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = runner.generate(prompts, greedy)
    results = runner.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=3))
    assert [r.token_ids for r in results] == [p.token_ids for p in plain for _ in range(3)]
    if runner.speculative is not None:
        assert runner.spec_stats()["num_drafts"] > 0
    if runner.speculative is not None and "max_num_batched_tokens" not in CONFIGS[name][1]:
        # The proposer's forked state drafts as the prompt's own: the same acceptance (a small token budget would
        # cap the drafts of a wider batch).
        counts = [(r.num_drafts, r.num_draft_tokens, r.num_accepted_draft_tokens) for r in results]
        assert counts == [(p.num_drafts, p.num_draft_tokens, p.num_accepted_draft_tokens) for p in plain for _ in "abc"]
    params = dict(temperature=0.9, max_tokens=10, ignore_eos=True)
    sampled = runner.generate(prompts[:2], SamplingParams(**params, seed=3, n=2))
    for i, prompt in enumerate(prompts[:2]):
        for j in range(2):
            (single,) = runner.generate([prompt], SamplingParams(**params, seed=sample_seed(3, j)))
            assert sampled[2 * i + j].token_ids == single.token_ids, (i, j)
    scheduler = runner._scheduler
    assert scheduler.blocks.num_reserved == 0 and not scheduler.blocks.fork_refs  # every sample gave its room back


def test_groups_are_admitted_whole_and_fail_whole(checkpoint_dir):
    runner = ModelRunner.from_pretrained(str(checkpoint_dir("granite_moe")), max_num_seqs=6)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [PROMPT, OTHER, PROMPT[:20]]
    plain = runner.generate(prompts, greedy)
    # 6 slots hold one group of 4 at a time (never 4 + 2 of the next): each still equals its prompt alone.
    runner_groups = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=4)] * 3
    for prompt in prompts:
        runner.add_request(tuple(prompt), prompt, runner_groups[0])
    results, scheduler = [], runner._engine()
    while runner.has_unfinished_requests():
        results += runner.step()
        live = scheduler.running + scheduler.prefilling
        for request in live:  # whenever a leader runs, its forks' slots are live or promised
            if request.group is not None and not request.group.forked:
                assert scheduler.num_promised_slots >= len(request.group.forks)
        assert len(live) + scheduler.num_promised_slots <= 6
    assert sorted((key, r.sample_index) for key, r in results) == sorted(
        (tuple(p), j) for p in prompts for j in range(4)
    )
    by_prompt = {tuple(p): r.token_ids for p, r in zip(prompts, plain)}
    assert all(r.token_ids == by_prompt[key] for key, r in results)
    # More samples than slots: an error result for each sample, naming n and the limit; the next prompt runs.
    failed = runner.generate([PROMPT, OTHER], [SamplingParams(max_tokens=2, n=7), greedy])
    assert [(r.finish_reason, r.sample_index) for r in failed[:7]] == [("error", j) for j in range(7)]
    assert "n=7" in failed[0].error and "max_num_seqs=6" in failed[0].error
    assert failed[7].token_ids == plain[1].token_ids
    # A bad prompt: one error per sample.
    bad = runner.generate([[]], SamplingParams(n=2))
    assert [(r.finish_reason, r.sample_index) for r in bad] == [("error", 0), ("error", 1)]


@pytest.mark.parametrize("family", ["nemotron_dense", "qwen3_next"])
def test_mtp_forks_pair_the_last_prompt_position_with_their_own_token(family, checkpoint_dir):
    """The MTP head's entry at the prompt's last position holds (h, the sample's own first token): with a prompt of
    whole blocks, that block is each sample's private copy. After one speculative step, sample j's head KV of the
    prompt equals that of the prompt run alone with sample j's seed."""
    speculative = SpeculativeConfig("mtp", 3, policy="fixed")
    runner = ModelRunner.from_pretrained(
        str(checkpoint_dir(family)), max_num_seqs=4, speculative=speculative, enable_prefix_caching=False
    )
    prompt, params = PROMPT[:32], dict(temperature=1.0, max_tokens=8, ignore_eos=True)

    def head_keys(sampling: SamplingParams) -> list[torch.Tensor]:
        runner.add_request("p", prompt, sampling)
        scheduler = runner._engine()
        while not scheduler.running:
            runner.step()
        runner.step()  # the first proposal: the head catches up to the last prompt position
        caches, slots = (
            runner._proposer.caches,
            [r.slot for r in sorted(scheduler.running, key=lambda r: r.sample_index)],
        )
        keys = [torch.stack([c.read(torch.tensor([s]), len(prompt))[0][0] for c in caches]) for s in slots]
        while runner.has_unfinished_requests():
            runner.step()
        return keys

    forked = head_keys(SamplingParams(**params, seed=5, n=3))
    for j, keys in enumerate(forked):
        (alone,) = head_keys(SamplingParams(**params, seed=sample_seed(5, j)))
        torch.testing.assert_close(keys, alone)


def test_a_streaming_worker_writes_each_rows_samples_in_order(checkpoint_dir):
    """Shards streamed through a worker (two in flight, 5 slots, rows of 2 samples): n results per row, row-major,
    each sample its row's prompt alone with its seed; a row that cannot run gets an error per sample."""
    import pyarrow as pa

    from workers.actor import ShardTask, ShardWorker, WorkerSpec
    from workers.config import EngineConfig
    from workers.rows import PromptSource

    sampling = SamplingParams(temperature=0.8, max_tokens=5, ignore_eos=True, seed=9, n=2)
    spec = WorkerSpec(
        "generate",
        str(checkpoint_dir("granite_moe")),
        EngineConfig().replace(max_num_seqs=5),
        prompt=PromptSource(prompt_column="text"),
        sampling=sampling,
    )
    worker = ShardWorker(spec)
    texts = [["the cat sat", "a dog ran on the mat", ""], ["the mat", "cat dog cat dog", "a a a"]]
    shards = [ShardTask(i, 3 * i, pa.table({"text": t})) for i, t in enumerate(texts)]
    with ThreadPoolExecutor(2) as pool:
        outputs = list(pool.map(worker.process, shards))
    runner = ShardWorker(spec).runner  # the worker's own runner belongs to its stream's thread
    for shard, output in zip(shards, outputs):
        columns = output.columns
        assert columns["sample_index"] == [0, 1] * 3
        for row, text in enumerate(shard.rows.column("text").to_pylist()):
            got = columns["generated_token_ids"][2 * row : 2 * row + 2]
            if not text:
                assert columns["error"][2 * row : 2 * row + 2] == ["prompt text is empty"] * 2
                continue
            seed = 9 + shard.first_row + row
            for j in range(2):
                alone = SamplingParams(temperature=0.8, max_tokens=5, ignore_eos=True, seed=sample_seed(seed, j))
                assert got[j] == runner.generate([runner.tokenizer.encode(text)], alone)[0].token_ids


def test_a_group_whose_kv_can_never_fit_fails_each_sample(checkpoint_dir):
    path = str(checkpoint_dir("granite_moe"))
    options = dict(max_num_seqs=8, enable_prefix_caching=False)
    plan = ModelRunner.from_pretrained(path, **options).memory_plan
    runner = ModelRunner.from_pretrained(path, **options, max_memory=plan.reserved_bytes + 6 * plan.bytes_per_block)
    # 37 + 10 positions: 3 blocks for sample 0, 1 more for each fork (2 shared): 8 blocks for 6 samples, 4 for 2.
    assert 4 <= runner.num_kv_blocks - 1 < 8
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    (alone,) = runner.generate([PROMPT], params)
    assert alone.finish_reason == "length"  # one sample fits
    results = runner.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=6))
    assert [(r.finish_reason, r.sample_index) for r in results] == [("error", j) for j in range(6)]
    assert "for its 6 samples" in results[0].error
    fits = runner.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=2))
    assert [r.token_ids for r in fits] == [alone.token_ids] * 2  # 3 + 1 blocks: shared prompt blocks counted once


def test_each_sample_has_its_own_logprobs(checkpoint_dir):
    """Samples and logprobs together: sample j's logprobs (its first position's from the prompt's shared last logits)
    are those of the prompt run alone with sample j's seed."""
    runner = ModelRunner.from_pretrained(str(checkpoint_dir("qwen3_next")), max_num_seqs=4)
    params = dict(temperature=1.0, max_tokens=6, ignore_eos=True, logprobs=2)
    results = runner.generate([PROMPT], SamplingParams(**params, seed=4, n=3))
    for j, result in enumerate(results):
        (alone,) = runner.generate([PROMPT], SamplingParams(**params, seed=sample_seed(4, j)))
        assert result.token_ids == alone.token_ids and len(result.logprobs) == 6
        for got, want in zip(result.logprobs, alone.logprobs):
            assert list(got) == list(want)
            assert [got[t] for t in got] == pytest.approx([want[t] for t in want], abs=1e-5)
