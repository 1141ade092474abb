"""The draft model's greedy chain (its one-token steps as one native call) against the step-by-step paths.

The reference is the same proposer stepping its decode plan one step at a time (`native_chain=False`), and the
module-by-module path (`decode_plan=False`). Both proposers see the same forced verification outcomes — 0 … k
drafts accepted, per-row budgets that differ (rows running steps past their own budget) — and must draft the same
tokens and keep the same draft states, bit for bit against the plan path. Runners reuse the draft's slots and plans
across `generate` calls only when they fit, with the results of fresh runners.
"""

from __future__ import annotations

import pytest
import torch

from workers import ModelRunner, SamplingParams, SpeculativeConfig
from workers.model import StatePool, load_checkpoint
from workers.model.kernels import native
from workers.model.steps.plan_records import Op, Recorder
from workers.requests import Request
from workers.spec_decode.draft_model import DraftModelProposer

K = 3
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# Draft models the plan covers: Mamba2 + attention (bamba), attention only, Gated DeltaNet + attention, and
# granite_dense's logits divisor (logits_scaling 2).
DRAFTS = ["draft_hybrid", "draft_attention", "qwen3_5_text", "granite_dense"]


def _argmax_feed(logits: torch.Tensor, divisor: float) -> tuple[list[int], list[int], list[int], list[int]]:
    """Run one OP_ARGMAX_FEED record over logits [b, v]: (next ids, drafts, positions before, positions after)."""
    b, v = logits.shape
    next_ids, drafts = torch.full((b,), -5, dtype=torch.int64), torch.full((b,), -5, dtype=torch.int64)
    positions = torch.arange(b, dtype=torch.int64) * 10
    before = positions.tolist()
    rec = Recorder(b, 1)
    rec.emit(Op.ARGMAX_FEED, [logits, b, v, next_ids, drafts, positions], (divisor,))
    records = rec.tensor()
    assert native.load().decode_plan_run(records.data_ptr(), records.shape[0], 1) == 0
    return next_ids.tolist(), drafts.tolist(), before, positions.tolist()


def test_argmax_feed_is_torch_argmax_on_ties_nan_infinities_and_a_divisor():
    nan, inf = float("nan"), float("inf")
    rows = [
        [1.0, 3.0, 3.0, 2.0, 3.0],  # ties: the first
        [-inf, -inf, -inf, -inf, -inf],  # all -inf: index 0
        [0.5, nan, 7.0, nan, 1.0],  # NaN is the largest, the first one
        [-0.0, 0.0, -1.0, 0.0, -2.0],  # ±0 are equal
        [-3.0, -1.0, -2.0, inf, inf],
        [nan, 1.0, 2.0, 3.0, 4.0],
    ]
    logits = torch.tensor(rows, dtype=torch.float32)
    expected = logits.argmax(-1).tolist()
    next_ids, drafts, before, after = _argmax_feed(logits, 1.0)
    assert next_ids == drafts == expected == [1, 0, 1, 0, 3, 0]
    assert after == [p + 1 for p in before]
    # Division can round two different logits to one value: the argmax of logits / divisor is then the first
    # of them, not the larger one. Find such a pair so that this case is exercised, not assumed.
    g = torch.Generator().manual_seed(0)
    values = torch.rand(200_000, generator=g) * 8 + 1
    larger = torch.nextafter(values, torch.tensor(inf))
    tied = ((values / 3.0) == (larger / 3.0)).nonzero()[:4, 0]
    assert len(tied) == 4
    pairs = torch.stack([values[tied], larger[tied]], 1)  # [4, 2]: the larger logit second
    logits = torch.cat([pairs, torch.rand(4, 30, generator=g)], 1)  # the pair is the maximum (rand < 1)
    assert logits.argmax(-1).tolist() == [1] * 4 and (logits / 3.0).argmax(-1).tolist() == [0] * 4
    logits = torch.cat([logits, torch.randn(60, 32, generator=g)])  # and plain rows
    assert _argmax_feed(logits, 3.0)[0] == (logits / 3.0).argmax(-1).tolist()


class Lockstep:
    """A draft proposer over its own copy of the requests, fed the same verification outcomes as the others."""

    def __init__(self, model, prompts: list[list[int]], decode_plan: bool, native_chain: bool):
        self.proposer = DraftModelProposer(model, K, decode_plan=decode_plan, native_chain=native_chain)
        capacity = max(len(p) for p in prompts) + 80  # 14 steps of up to 1 + K tokens
        self.target_pool = StatePool(model.config, len(prompts), capacity, torch.device("cpu"), torch.float32)
        self.proposer.start(self.target_pool, 4096)
        self.requests = [
            Request(i, list(p), GREEDY, frozenset(), torch.Generator(), 2048) for i, p in enumerate(prompts)
        ]
        for slot, request in enumerate(self.requests):
            request.slot = slot
        self.proposer.admit(self.requests)

    def propose(self, budgets: list[int]) -> list[list[int]]:
        proposal = self.proposer.propose(self.requests, budgets)
        return [row[:k] for row, k in zip(proposal.token_ids.tolist(), proposal.num_draft_tokens)]

    def verify(self, appended: list[list[int]], num_accepted: list[int]) -> None:
        for request, tokens in zip(self.requests, appended):
            request.output += tokens
        self.proposer.accepted(self.requests, num_accepted)

    def kept(self, row: int) -> tuple[int, list[torch.Tensor]]:
        """What the draft keeps for a row: tokens covered, recurrent states, KV of the covered positions."""
        pool, covered = self.proposer.pool, self.proposer.covered[row]
        return covered, [pool.conv[:, row], pool.ssm[:, row], *pool.slot_kv(row, covered)]


def _outcome(drafts: list[int], budget: int, step: int, row: int, vocab: int) -> tuple[list[int], int]:
    """A forced verification outcome: (tokens appended, num_accepted_tokens) cycling 0 … k accepted drafts."""
    if budget == 0:
        return [(7 * step + row) % vocab], 1
    accepted = (step + 2 * row) % (budget + 1)
    correction = (drafts[accepted] + 1) % vocab if accepted < budget else (step * 13 + row) % vocab
    return drafts[:accepted] + [correction], accepted + 1


def _budgets(batch: int, step: int) -> list[int]:
    """Per-row draft budgets: mostly K, some rows fewer (they run steps past their budget), now and then none."""
    budgets = [K if (row + step) % 3 else 1 + (row + step) % K for row in range(batch)]
    if step % 5 == 4:
        budgets[-1] = 0  # a trailing row without drafts: the rest still run planned
    if step % 7 == 6 and batch > 2:
        budgets[1] = 0  # a gap: the rows are no slot prefix, the module path runs
    return budgets


def _assert_same(runs: dict[str, Lockstep], batch: int, exact: set[str]) -> None:
    reference = runs["chain"]
    for name, run in runs.items():
        for row in range(batch):
            covered, tensors = run.kept(row)
            ref_covered, ref_tensors = reference.kept(row)
            assert covered == ref_covered, f"{name}: covered of row {row}"
            for got, want in zip(tensors, ref_tensors, strict=True):
                if name in exact:
                    assert torch.equal(got, want), f"{name}: kept state of row {row}"
                else:
                    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("batch", [1, 5, 16])
@pytest.mark.parametrize("draft", DRAFTS)
def test_chain_drafts_and_kept_states_equal_the_step_by_step_paths(checkpoint_dir, draft, batch):
    model = load_checkpoint(str(checkpoint_dir(draft))).model
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(batch)
    prompts = [
        torch.randint(4, vocab, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
        for _ in range(batch)
    ]
    runs = {
        "chain": Lockstep(model, prompts, decode_plan=True, native_chain=True),
        "plan steps": Lockstep(model, prompts, decode_plan=True, native_chain=False),
        "module": Lockstep(model, prompts, decode_plan=False, native_chain=False),
    }
    assert runs["chain"].proposer.chain is not None and runs["module"].proposer.plan is None
    accepted_counts = set()
    for step in range(14):
        budgets = _budgets(batch, step)
        drafts = {name: run.propose(budgets) for name, run in runs.items()}
        assert drafts["chain"] == drafts["plan steps"] == drafts["module"], f"step {step}"
        assert [len(d) for d in drafts["chain"]] == budgets
        outcomes = [_outcome(d, k, step, row, vocab) for row, (d, k) in enumerate(zip(drafts["chain"], budgets))]
        accepted_counts.update(n - 1 for (_, n), k in zip(outcomes, budgets) if k)
        for run in runs.values():
            run.verify([tokens for tokens, _ in outcomes], [n for _, n in outcomes])
        _assert_same(runs, batch, exact={"chain", "plan steps"})
    assert accepted_counts == set(range(K + 1))


def _copy_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase, so the draft's greedy continuation often matches the target's."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(4, 128, (5,), generator=g).tolist() * 8)[:n] for n in lengths]


def _summary(results) -> list[tuple]:
    return [(r.token_ids, r.num_drafts, r.num_draft_tokens, r.num_accepted_draft_tokens) for r in results]


def test_runner_reuses_the_draft_slots_and_plans_only_when_they_fit(checkpoint_dir):
    target, draft = str(checkpoint_dir("bamba")), str(checkpoint_dir("bamba"))  # self-drafting: all accepted
    spec = SpeculativeConfig("draft", K, draft_model=draft, policy="fixed")

    def fresh(prompts):
        return _summary(ModelRunner.from_pretrained(target, max_num_seqs=8, speculative=spec).generate(prompts, GREEDY))

    runner = ModelRunner.from_pretrained(target, max_num_seqs=8, speculative=spec)
    plain = ModelRunner.from_pretrained(target, max_num_seqs=8)
    runs = [_copy_prompts([9, 17, 4, 30, 12], 0), _copy_prompts([3, 25], 1), _copy_prompts([8] * 7, 2),
            _copy_prompts([40], 3)]  # fmt: skip
    proposers, plans = [], []
    for prompts in runs:
        results = runner.generate(prompts, GREEDY)
        assert _summary(results) == fresh(prompts)
        assert [r.token_ids for r in results] == [r.token_ids for r in plain.generate(prompts, GREEDY)]
        proposers.append(runner._proposer)
        plans.append((runner._proposer.pool, runner._proposer.plan))
    assert len({id(p) for p in proposers}) == 1
    assert plans[1][0] is plans[0][0] and plans[1][1] is plans[0][1]  # fewer, shorter: the same slots and plan
    assert plans[2][0] is not plans[1][0]  # more requests than slots: the target's workspace and the draft's are new
    assert runner._proposer.pool.blocks is runner._scheduler.workspace.pool.blocks
    assert runner.spec_stats()["num_accepted_draft_tokens"] > 0
