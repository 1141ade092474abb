"""The MTP proposer through its plan against the module path run one position at a time, in the same scheduler:
identical drafts, draft distributions and KV caches after every proposal — greedy rows under forced acceptance
patterns (0 drafts, none, all, partial; rows with different budgets and catch-up lengths, rows moving slots), and
sampled rows chained one call per step — at batch 1, 5 and 16; greedy MTP through the plan equals plain greedy."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import engine_config
from tests.workers.spec_decode.test_state_shifting import PARAMS, ScriptedProposer
from workers import ModelRunner, SamplingParams, SpeculativeConfig
from workers.model import ForwardBatch
from workers.model.steps.mtp_plan import MtpPlan
from workers.requests import Request
from workers.scheduler import Scheduler
from workers.spec_decode.mtp import MtpProposer
from workers.spec_decode.proposal import Proposal

K = 4
SAMPLED = SamplingParams(temperature=0.9, top_k=20, max_tokens=24, ignore_eos=True)


class DecodeFormMtp(MtpProposer):
    """The module path with every catch-up the plan would take fed one position per forward (the decode form the
    plan equals); longer ones (prompts) as the planned proposer feeds them."""

    def __init__(self, model, num_speculative_tokens: int):
        super().__init__(model, num_speculative_tokens, decode_plan=False)

    def _feed(self, requests: list[Request], starts: list[int], hiddens: list[torch.Tensor]) -> torch.Tensor:
        counts = [h.shape[0] for h in hiddens]
        if max(counts) > 2 * (self.num_speculative_tokens + 1):
            return super()._feed(requests, starts, hiddens)
        last: list[torch.Tensor | None] = [None] * len(requests)
        for j in range(max(counts)):
            live = [i for i, c in enumerate(counts) if j < c]
            ids = torch.tensor([[requests[i].token_at(starts[i] + 1 + j)] for i in live])
            positions = torch.tensor([starts[i] + j for i in live])
            batch = ForwardBatch(
                torch.tensor([requests[i].slot for i in live]),
                positions,
                torch.ones_like(positions),
                one_token_each=True,
            )
            hidden = torch.stack([hiddens[i][j] for i in live])[:, None]
            out = self.head(ids, hidden, self.model.embed_tokens, batch, self.caches)[:, 0]
            for row, i in enumerate(live):
                last[i] = out[row]
        return torch.stack(last)


class TwinMtp(ScriptedProposer):
    """Runs the planned and the decode-form proposer side by side on the same target hidden states and checks they
    agree; hands the verifier the scripted drafts (`forced`) or the planned proposer's own."""

    drafts_from_hidden = True

    def __init__(self, model, reference: dict[int, list[int]] | None):
        super().__init__(reference or {}, model.config.vocab_size)
        self.planned, self.module = MtpProposer(model, K), DecodeFormMtp(model, K)
        self.forced = reference is not None
        self.feed_lengths: list[list[int]] = []  # per proposal, each drafting row's catch-up length

    def start(self, pool, max_chunk_tokens: int) -> None:
        for proposer in (self.planned, self.module):
            proposer.start(pool, max_chunk_tokens)
        assert isinstance(self.planned.plan, MtpPlan) and self.module.plan is None

    def admit(self, requests) -> None:
        self.planned.admit(requests), self.module.admit(requests)

    def move(self, source: int, target: int) -> None:
        self.planned.move(source, target), self.module.move(source, target)

    def observe_target(self, requests, hidden, cache_lens, num_tokens) -> None:
        for proposer in (self.planned, self.module):
            proposer.observe_target(requests, hidden, cache_lens, num_tokens)

    def propose(self, requests, num_drafts) -> Proposal:
        scripted = super().propose(requests, num_drafts) if self.forced else None
        counts = scripted.num_draft_tokens if self.forced else num_drafts
        self.feed_lengths.append([self.planned.pending[r.slot].count for r, k in zip(requests, counts) if k])
        states = [r.generator.get_state() for r in requests]
        planned = self.planned.propose(requests, counts)
        for request, state in zip(requests, states):  # the same random draws for both
            request.generator.set_state(state)
        module = self.module.propose(requests, counts)
        assert torch.equal(planned.token_ids, module.token_ids)
        assert (planned.probs is None) == (module.probs is None)
        assert planned.probs is None or torch.equal(planned.probs, module.probs)
        blocks = self.planned.caches[0].blocks  # blocks no slot was handed yet hold whatever memory held
        held = blocks.tables[blocks.tables > 0].unique()[:, None] * blocks.block_size + torch.arange(blocks.block_size)
        for ours, theirs in zip(self.planned.caches, self.module.caches):
            assert torch.equal(ours.key[:, held], theirs.key[:, held])
            assert torch.equal(ours.value[:, held], theirs.value[:, held])
        return scripted if self.forced else planned


def _requests(prompts, params) -> list[Request]:
    return [Request(i, p, params[i], frozenset(), torch.Generator().manual_seed(i), 512) for i, p in enumerate(prompts)]


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [
        torch.randint(4, 128, (int(torch.randint(1, 24, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


@pytest.mark.parametrize("batch", [1, 5, 16])
@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_dense"])
def test_planned_drafts_and_kv_equal_the_module_path_under_forced_acceptance(checkpoint_dir, family, batch):
    runner = ModelRunner.from_pretrained(
        str(checkpoint_dir(family)), max_num_seqs=batch, speculative=SpeculativeConfig("mtp", K)
    )
    prompts = _prompts(batch + 2)  # more requests than slots: slots free up and requests move
    reference = {
        i: r.token_ids
        for i, r in enumerate(
            ModelRunner.from_pretrained(str(checkpoint_dir(family)), max_num_seqs=batch, decode_plan=False).generate(
                prompts, PARAMS
            )
        )
    }
    twin = TwinMtp(runner.model, reference)
    scheduler = Scheduler(
        runner.model, engine_config(batch, K, decode_plan=True), _requests(prompts, [PARAMS] * len(prompts)), twin
    )
    while scheduler.has_work():
        scheduler.step()
    assert all(accepted == expected for accepted, expected in twin.seen)
    assert {n for accepted, _ in twin.seen for n in accepted} >= {1, 2, 5}
    assert {r.index: r.output for r in scheduler.finished} == reference
    lengths = [n for feed in twin.feed_lengths for n in feed]
    assert len(twin.feed_lengths) > 10 and {1, 2, 3} <= set(lengths)  # short catch-ups through the plan
    assert max(lengths) > 2 * (K + 1)  # and prompts module by module
    if batch > 1:
        assert any(len(set(feed)) > 1 for feed in twin.feed_lengths)  # padded feeds


@pytest.mark.parametrize("batch", [1, 5])
def test_sampled_rows_chain_one_call_per_step_and_draw_what_the_module_path_draws(checkpoint_dir, batch):
    runner = ModelRunner.from_pretrained(
        str(checkpoint_dir("qwen3_5_text")), max_num_seqs=batch, speculative=SpeculativeConfig("mtp", K)
    )
    prompts = _prompts(batch + 1)
    params = [SAMPLED if i % 2 == 0 else PARAMS for i in range(len(prompts))]  # sampled and greedy rows mixed
    twin = TwinMtp(runner.model, None)
    scheduler = Scheduler(runner.model, engine_config(batch, K, decode_plan=True), _requests(prompts, params), twin)
    while scheduler.has_work():
        scheduler.step()
    assert len(twin.feed_lengths) > 5 and all(len(r.output) == 24 for r in scheduler.finished)


@pytest.mark.parametrize("batch", [1, 5, 16])
def test_greedy_mtp_through_the_plan_equals_plain_greedy(checkpoint_dir, monkeypatch, batch):
    path = str(checkpoint_dir("qwen3_5_text"))
    prompts = _prompts(batch)
    plain = [r.token_ids for r in ModelRunner.from_pretrained(path, max_num_seqs=8).generate(prompts, PARAMS)]
    plans: list[MtpPlan] = []
    init = MtpPlan.__init__
    monkeypatch.setattr(MtpPlan, "__init__", lambda plan, *args: (init(plan, *args), plans.append(plan))[0])
    runner = ModelRunner.from_pretrained(path, max_num_seqs=8, speculative=SpeculativeConfig("mtp", 3, policy="fixed"))
    assert [r.token_ids for r in runner.generate(prompts, PARAMS)] == plain
    assert runner.spec_stats()["num_drafts"] > 0
    assert len(plans) == 1 and any(key[0] == "greedy" for key in plans[0]._records)  # drafted through the plan
    storages = len(runner._scheduler.workspace.pool.blocks.on_allocate)
    assert [r.token_ids for r in runner.generate(prompts, PARAMS)] == plain  # the same slots: caches and plan kept
    assert len(plans) == 1 and len(runner._scheduler.workspace.pool.blocks.on_allocate) == storages
