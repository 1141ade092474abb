"""MTP head plans (`workers/model/steps/mtp_plan.py`) against the module path's decode form, bit for bit: a catch-up
feed of c_i positions per row (rows padded in front) equals c_i one-position `MtpHead.forward` calls + `model.logits`,
chained steps equal the proposer's module-path steps, and the head's KV caches end equal — for Qwen3.5 / Qwen3-Next
(gated attention + SwiGLU MLP) and Nemotron-H ("*-*-": two attention blocks, relu² MLPs), rows in scattered slots
with different feed lengths, batch 1 / 5 / 16."""

from __future__ import annotations

import pytest
import torch

from workers.model import ForwardBatch, load_checkpoint
from workers.model.kernels import native
from workers.model.kv_blocks import BlockTable
from workers.model.state import KVCache, paged_kv_cache
from workers.model.steps.mtp_plan import MtpPlan, unsupported_reason
from workers.model.steps.plan_records import Op, Recorder
from workers.runner import execution_summary

PLANNED_HEADS = ["qwen3_5_text", "qwen3_5", "qwen3_next_dense", "nemotron_dense", "nemotron_moe", "qwen3_5_moe"]
SLOTS, CAPACITY, TOKENS_PER_ROW, STEPS = 20, 48, 5, 4


def _caches(model, blocks: BlockTable, seed: int) -> list[KVCache]:
    """The head's caches with random entries everywhere (what earlier feeds would have left)."""
    g = torch.Generator().manual_seed(seed)
    caches = [
        paged_kv_cache(blocks, model.config, torch.device("cpu"), torch.float32)
        for _ in range(model.mtp.num_attention_blocks)
    ]
    for cache in caches:
        cache.key.copy_(torch.randn(cache.key.shape, generator=g))
        cache.value.copy_(torch.randn(cache.value.shape, generator=g))
    return caches


def _clone(caches: list[KVCache]) -> list[KVCache]:
    return [KVCache(c.key.clone(), c.value.clone(), c.blocks) for c in caches]


def _module_head(model, caches, slots, positions, token_ids, hidden) -> torch.Tensor:
    """One position per row on the module path (the decode form): out [b, d]."""
    batch = ForwardBatch(
        torch.tensor(slots), torch.tensor(positions), torch.ones(len(slots), dtype=torch.long), one_token_each=True
    )
    with torch.inference_mode():
        return model.mtp(torch.tensor(token_ids)[:, None], hidden[:, None], model.embed_tokens, batch, caches)[:, 0]


def _module_reference(model, caches, rows: list[dict], num_steps: int, chain_ids=None):
    """The feed position by position (each row's positions in order; rows without one sit out), then the chain;
    chain_ids[s] the tokens of step s + 1 (None: the argmax of the previous logits). → (logits per step, their
    argmax or given tokens per step, the feed's output [b, d])."""
    last = [None] * len(rows)
    for j in range(max(len(r["ids"]) for r in rows)):
        live = [i for i, r in enumerate(rows) if j < len(r["ids"])]
        out = _module_head(
            model,
            caches,
            [rows[i]["slot"] for i in live],
            [rows[i]["start"] + j for i in live],
            [rows[i]["ids"][j] for i in live],
            torch.stack([rows[i]["hidden"][j] for i in live]),
        )
        for row, i in enumerate(live):
            last[i] = out[row]
    out = fed = torch.stack(last)
    logits, ids = [model.logits(out)], []
    positions = [r["start"] + len(r["ids"]) for r in rows]
    for step in range(1, num_steps):
        ids.append(logits[-1].argmax(-1).tolist() if chain_ids is None else chain_ids[step - 1])
        out = _module_head(model, caches, [r["slot"] for r in rows], positions, ids[-1], out)
        logits.append(model.logits(out))
        positions = [p + 1 for p in positions]
    ids.append(logits[-1].argmax(-1).tolist())
    return logits, ids, fed


def _rows(model, b: int, seed: int) -> list[dict]:
    """b rows in scattered slots, each feeding 1 … TOKENS_PER_ROW positions from its own start."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(SLOTS, generator=g)[:b].tolist()
    rows = []
    for row, slot in enumerate(slots):
        count = 1 + (row * 3 + seed) % TOKENS_PER_ROW if b > 1 else TOKENS_PER_ROW - 1
        start = int(torch.randint(0, CAPACITY - count - STEPS, (1,), generator=g))
        ids = torch.randint(0, model.config.vocab_size, (count,), generator=g).tolist()
        hidden = torch.randn(count, model.config.hidden_size, generator=g)
        rows.append(dict(slot=slot, start=start, ids=ids, hidden=hidden))
    return rows


def _stage(plan: MtpPlan, rows: list[dict]) -> None:
    pieces = [[r["hidden"][:1], r["hidden"][1:]] if len(r["ids"]) > 1 else [r["hidden"]] for r in rows]
    plan.stage_feed([r["slot"] for r in rows], [r["start"] for r in rows], [r["ids"] for r in rows], pieces)


@pytest.mark.parametrize("b", [1, 5, 16])
@pytest.mark.parametrize("family", PLANNED_HEADS)
def test_feed_and_chain_equal_the_module_path_bit_for_bit(checkpoint_dir, family, b):
    model = load_checkpoint(str(checkpoint_dir(family)), mtp=True).model
    assert unsupported_reason(model) is None
    blocks = BlockTable.fully_assigned(SLOTS, CAPACITY, 16, torch.device("cpu"))
    original = _caches(model, blocks, seed=b)
    rows = _rows(model, b, seed=b)
    # 1. Greedy: the feed and three chained steps in one call, argmax between them.
    reference, planned = _clone(original), _clone(original)
    logits, ids, _ = _module_reference(model, reference, rows, STEPS)
    plan = MtpPlan(model, planned, SLOTS, TOKENS_PER_ROW, STEPS)
    _stage(plan, rows)
    assert plan.greedy(STEPS).tolist() == ids
    for step in range(STEPS):
        assert torch.equal(plan.logits[step, :b], logits[step]), f"logits of step {step}"
    for cache, expected in zip(planned, reference):  # the same entries written; none at padded positions
        assert torch.equal(cache.key, expected.key) and torch.equal(cache.value, expected.value)
    # 2. One call per step with given tokens (what sampled rows do), other tokens than the argmax.
    chain_ids = [[(t + 7 * step + 1) % model.config.vocab_size for t in ids[step]] for step in range(STEPS - 1)]
    reference, planned = _clone(original), _clone(original)
    logits, _, _ = _module_reference(model, reference, rows, STEPS, chain_ids)
    plan = MtpPlan(model, planned, SLOTS, TOKENS_PER_ROW, STEPS)
    _stage(plan, rows)
    assert torch.equal(plan.feed(), logits[0])
    for step in range(1, STEPS):
        assert torch.equal(plan.step(step, chain_ids[step - 1]), logits[step]), f"logits of step {step}"
    for cache, expected in zip(planned, reference):
        assert torch.equal(cache.key, expected.key) and torch.equal(cache.value, expected.value)


@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_dense"])
def test_a_chain_from_a_module_catch_up_equals_the_module_chain(checkpoint_dir, family):
    """Feeds longer than the plan takes (prompts) run module by module; the chain then starts from their output."""
    model = load_checkpoint(str(checkpoint_dir(family)), mtp=True).model
    blocks = BlockTable.fully_assigned(SLOTS, CAPACITY, 16, torch.device("cpu"))
    reference = _caches(model, blocks, seed=1)
    planned = _clone(reference)
    rows = _rows(model, 3, seed=4)
    logits, ids, _ = _module_reference(model, reference, rows, STEPS)
    _, _, fed = _module_reference(model, planned, rows, 1)  # the catch-up alone, module by module
    plan = MtpPlan(model, planned, SLOTS, TOKENS_PER_ROW, STEPS)
    plan.stage_output([r["slot"] for r in rows], fed, [r["start"] + len(r["ids"]) for r in rows])
    assert plan.greedy(STEPS).tolist() == ids
    for step in range(STEPS):
        assert torch.equal(plan.logits[step, :3], logits[step]), f"logits of step {step}"
    for cache, expected in zip(planned, reference):
        assert torch.equal(cache.key, expected.key) and torch.equal(cache.value, expected.value)


def test_argmax_op_takes_the_first_maximal_index_as_torch_does():
    logits = torch.tensor(
        [
            [1.0, 3.0, 3.0, -1.0],
            [2.0, 2.0, 2.0, 2.0],
            [0.0, float("nan"), 5.0, float("nan")],
            [-float("inf"), -1.0, -1.0, -2.0],
        ]
    )
    ids = torch.full((4,), -5, dtype=torch.int64)
    rec = Recorder(4, 1)
    rec.emit(Op.ARGMAX, [logits, ids, 4, 4])
    records = rec.tensor()
    assert native.load().decode_plan_run(records.data_ptr(), records.shape[0], 1) == 0
    assert ids.tolist() == logits.argmax(-1).tolist() == [1, 0, 1, 1]


def test_heads_outside_the_plan_say_why_and_a_feed_refuses_a_position_without_a_block(checkpoint_dir):
    torch_head = load_checkpoint(str(checkpoint_dir("qwen3_5_text")), mtp=True, decode_kernel="torch").model
    assert "native kernels are off" in unsupported_reason(torch_head)
    assert "no MTP head" in unsupported_reason(load_checkpoint(str(checkpoint_dir("qwen3_5_text"))).model)
    model = load_checkpoint(str(checkpoint_dir("qwen3_5_text")), mtp=True).model
    assert execution_summary(model, decode_plan=True, mtp=True).endswith("MTP head plan on")
    moe = load_checkpoint(str(checkpoint_dir("nemotron_moe")), mtp=True).model
    assert execution_summary(moe, decode_plan=True, mtp=True).endswith("MTP head plan on")
    assert execution_summary(torch_head, decode_plan=True, mtp=True).endswith(
        "MTP head plan off (the native kernels are off (not CPU float32, or decode_kernel / linear_backend chose "
        "another path))"
    )
    assert execution_summary(model, decode_plan=False, mtp=True).endswith("MTP head plan off (turned off)")
    blocks = BlockTable(2, 32, 3, 16, torch.device("cpu"))
    blocks.ensure(0, 16)  # slot 0 holds positions 0 … 15, slot 1 nothing
    plan = MtpPlan(model, _caches(model, blocks, seed=0), 2, 4, 2)
    hidden = torch.zeros(2, model.config.hidden_size)
    plan.stage_feed([0, 1], [3, 0], [[5, 6], [7]], [[hidden], [hidden[:1]]])
    with pytest.raises(ValueError, match="without a KV block"):
        plan.feed()
    plan.stage_feed([0], [14], [[5, 6, 7]], [[torch.zeros(3, model.config.hidden_size)]])
    with pytest.raises(ValueError, match="without a KV block"):
        plan.feed()
    with pytest.raises(ValueError, match="at most 4 positions"):
        plan.stage_feed([0], [0], [[1] * 5], [[torch.zeros(5, model.config.hidden_size)]])
