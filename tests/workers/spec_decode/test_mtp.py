"""MTP drafting on the Qwen Gated DeltaNet families and Nemotron-H: lossless, its KV caches follow the accepted
positions exactly (forced acceptance patterns), the sampled distribution stays the target's, and clear errors
without an MTP head. `test_mtp_nemotron.py` checks Nemotron-H's drafts against an independent reference."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.tiny_models import NEMOTRON_MTP_FAMILIES, engine_config
from tests.workers.spec_decode.test_greedy_exactness import PARAMS as GREEDY
from tests.workers.spec_decode.test_greedy_exactness import _prompts as greedy_prompts
from tests.workers.spec_decode.test_runner_speculative import assert_second_tokens_follow_the_target
from tests.workers.spec_decode.test_state_shifting import PARAMS, ScriptedProposer, _prompts, _requests
from workers import ModelRunner, SamplingParams, SpeculativeConfig
from workers.model import ForwardBatch, KVCache, StatePool, load_checkpoint
from workers.model.state import paged_kv_cache
from workers.scheduler import Scheduler
from workers.spec_decode.mtp import MtpProposer
from workers.spec_decode.proposal import Proposal

GDN_FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
MTP_FAMILIES = [*GDN_FAMILIES, *NEMOTRON_MTP_FAMILIES]
TOL = dict(atol=5e-5, rtol=1e-4)


class ForcedMtp(ScriptedProposer):
    """Runs the real MTP proposer every step (its catch-up and chain write its KV), but hands the verifier the
    scripted drafts, so that acceptance follows the scripted patterns (0 drafts, all, none, partial)."""

    drafts_from_hidden = True

    def __init__(self, mtp: MtpProposer, reference: dict[int, list[int]], vocab_size: int):
        super().__init__(reference, vocab_size)
        self.mtp = mtp
        self.first_drafts: list[tuple[int, int, int]] = []  # (request index, its token count, MTP's d_1)

    def start(self, pool, max_chunk_tokens: int) -> None:
        self.mtp.start(pool, max_chunk_tokens)

    def admit(self, requests) -> None:
        self.mtp.admit(requests)

    def move(self, source: int, target: int) -> None:
        self.mtp.move(source, target)

    def observe_target(self, requests, hidden, cache_lens, num_tokens) -> None:
        self.mtp.observe_target(requests, hidden, cache_lens, num_tokens)

    def propose(self, requests, num_drafts) -> Proposal:
        scripted = super().propose(requests, num_drafts)
        # The same counts, so that rows without drafts leave their pending hidden states to accumulate.
        own = self.mtp.propose(requests, scripted.num_draft_tokens)
        for request, row in zip(requests, own.token_ids.tolist()):
            if row and row[0] != -1:
                self.first_drafts.append((request.index, request.num_tokens, row[0]))
        return scripted


def _fresh_mtp(model, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """MTP keys (every attention block's) over positions 0 … len-2 from scratch, and its logits at the last one:
    (h_t, token t+1) pairs from one plain target prefill of `tokens`."""
    n = len(tokens)
    pool = StatePool(model.config, 1, n + 1, torch.device("cpu"), torch.float32)
    batch = ForwardBatch(torch.tensor([0]), torch.tensor([0]), torch.tensor([n - 1]))
    with torch.no_grad():
        hidden = model(torch.tensor([tokens[:-1]]), batch, None, pool.kv_caches()).hidden
        caches = [
            paged_kv_cache(pool.blocks, model.config, torch.device("cpu"), torch.float32)
            for _ in range(model.mtp.num_attention_blocks)
        ]
        out = model.mtp(torch.tensor([tokens[1:]]), hidden, model.embed_tokens, batch, caches)
    return _slot_keys(caches, 0, n - 1), model.logits(out[0, -1])


def run_checking_mtp_kv(scheduler: Scheduler, mtp: MtpProposer) -> int:
    """Run `scheduler` to the end; after every step, each running request's MTP keys must equal a fresh
    recompute over the positions the head has consumed. Returns how many such checks ran."""
    checked = 0
    while scheduler.has_work():
        scheduler.step()
        for request in scheduler.running:
            tokens = request.prompt + request.output
            start, count = mtp.pending[request.slot].start, mtp.pending[request.slot].count
            assert start + count == len(tokens) - 1  # the target positions not yet consumed
            assert count == sum(piece.shape[0] for piece in mtp.pending[request.slot].pieces)
            if start >= 1:
                fresh_keys, _ = _fresh_mtp(scheduler.model, tokens[: start + 1])
                torch.testing.assert_close(_slot_keys(mtp.caches, request.slot, start), fresh_keys, **TOL)
                checked += 1
    return checked


def _slot_keys(caches: list[KVCache], slot: int, num_tokens: int) -> torch.Tensor:
    """The keys [caches, kv_heads, num_tokens, head_dim] of positions 0 … num_tokens-1 of `slot` in paged caches."""
    return torch.stack([cache.read(torch.tensor([slot]), num_tokens)[0][0] for cache in caches])


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_mtp_kv_holds_exactly_the_accepted_positions(family, checkpoint_dir):
    runner = ModelRunner.from_pretrained(
        str(checkpoint_dir(family)),
        max_num_seqs=4,
        linear_backend="torch",
        speculative=SpeculativeConfig("mtp", num_speculative_tokens=4),
    )
    prompts = _prompts()
    reference = {
        i: r.token_ids
        for i, r in enumerate(
            ModelRunner.from_pretrained(str(checkpoint_dir(family)), max_num_seqs=4).generate(prompts, PARAMS)
        )
    }
    mtp = MtpProposer(runner.model, 4)
    proposer = ForcedMtp(mtp, reference, runner.config.vocab_size)
    scheduler = Scheduler(runner.model, engine_config(4, 4), _requests(prompts), proposer)
    assert run_checking_mtp_kv(scheduler, mtp) > 20
    for accepted, expected in proposer.seen:
        assert accepted == expected
    assert {n for accepted, _ in proposer.seen for n in accepted} >= {1, 2, 3, 5}
    assert {r.index: r.output for r in scheduler.finished} == reference
    # Each proposal's first draft is the argmax of the MTP head run from scratch over the request's tokens.
    finished = {r.index: r.prompt + r.output for r in scheduler.finished}
    assert len(proposer.first_drafts) > 20
    for index, num_tokens, first in proposer.first_drafts:
        _, logits = _fresh_mtp(runner.model, finished[index][:num_tokens])
        top2 = logits.topk(2).values
        assert first == int(logits.argmax()) or top2[0] - top2[1] < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
@pytest.mark.parametrize("batch", [1, 5, 16])
@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_greedy_mtp_equals_greedy_plain(family, batch, policy, checkpoint_dir):
    """Fixed k verifies drafts every step (count-based acceptance, the target's recurrent states shifted to the
    accepted position); the adaptive policy (the default) chooses k per step."""
    path = str(checkpoint_dir(family))
    prompts = greedy_prompts(batch, batch)
    plain = [r.token_ids for r in ModelRunner.from_pretrained(path, max_num_seqs=8).generate(prompts, GREEDY)]
    speculative = SpeculativeConfig("mtp", 3, policy=policy)
    runner = ModelRunner.from_pretrained(path, max_num_seqs=8, speculative=speculative)
    results = runner.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == plain
    assert runner.spec_stats()["num_drafts"] > 0


@pytest.mark.parametrize(
    "family, expected",
    [
        ("qwen3_5", r"mtp\.fc\.weight, mtp\.pre_fc_norm_embedding\.weight"),
        (
            "nemotron_moe",
            r"mtp\.layers\.0\.enorm\.weight, mtp\.layers\.0\.hnorm\.weight, mtp\.layers\.0\.eh_proj\.weight",
        ),
    ],
)
def test_mtp_without_mtp_weights_is_a_clear_error(family, expected, tmp_path, checkpoint_dir):
    path = tmp_path / "model"
    shutil.copytree(checkpoint_dir(family), path)
    tensors = {k: v for k, v in load_file(path / "model.safetensors").items() if not k.startswith("mtp.")}
    save_file(tensors, path / "model.safetensors")
    ModelRunner.from_pretrained(str(path))  # fine without speculation
    with pytest.raises(ValueError, match=rf"has no mtp\.\* weights \(expected {expected}"):
        ModelRunner.from_pretrained(str(path), speculative=SpeculativeConfig("mtp"))


def test_mtp_on_a_mamba2_family_is_refused(checkpoint_dir):
    with pytest.raises(ValueError, match="speculative method 'mtp' is supported for nemotron_h, qwen3_next"):
        load_checkpoint(str(checkpoint_dir("bamba")), mtp=True)
    with pytest.raises(ValueError, match="draft_model is only used with method='draft'"):
        SpeculativeConfig("mtp", draft_model="x")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_moe"])
def test_sampled_mtp_tokens_follow_the_target_distribution(family, checkpoint_dir):
    runner = ModelRunner.from_pretrained(
        str(checkpoint_dir(family)),
        max_num_seqs=64,
        speculative=SpeculativeConfig("mtp", num_speculative_tokens=2, policy="fixed"),
    )
    prompt = torch.randperm(128, generator=torch.Generator().manual_seed(0)).tolist()[:40]
    n = 1500
    params = [SamplingParams(temperature=1.0, top_k=16, max_tokens=3, seed=i, ignore_eos=True) for i in range(n)]
    results = runner.generate([prompt] * n, params)
    assert runner.spec_stats()["num_drafts"] >= n
    assert 0 < runner.spec_stats()["acceptance_rate"] < 1
    assert_second_tokens_follow_the_target(runner, prompt, params[0], [r.token_ids[1] for r in results])
