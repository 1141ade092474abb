"""Kimi-Linear against transformers' own modeling code: log-probs, greedy generation, the latent KV cache, state
continuation, ragged batches and CUDA graph steps, on tiny random checkpoints (`tests/kimi_models.py`)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, KimiLinearForCausalLM

from tests.kimi_models import build_kimi_checkpoint
from tests.workers.model.test_cuda_graph import test_every_captured_step_is_capture_safe as assert_capture_safe
from tests.workers.model.test_cuda_graph import test_graph_steps_equal_the_module_path as assert_graph_steps_exact
from tests.workers.test_oracle import assert_same_greedy
from workers import ModelRunner, SamplingParams
from workers.memory import kv_bytes_per_token
from workers.model import ForwardBatch, StatePool, load_checkpoint
from workers.model.layers.mla import MultiHeadLatentAttention

TOL = dict(atol=5e-5, rtol=1e-4)  # float32 rounding across layers; a wrong state is off by O(1)
LAYOUTS = ["kimi_linear", "kimi_linear_qlora"]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """layout → (checkpoint path, transformers' model loaded from it), built on first use."""
    built = {}

    def get(family: str):
        if family not in built:
            path = build_kimi_checkpoint(family, tmp_path_factory.mktemp(family))
            built[family] = path, KimiLinearForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return built[family]

    return get


def _tokens(seed: int, lengths: list[int]) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 128, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("family", LAYOUTS)
def test_score_matches_transformers(family, kimi):
    """Up to 150 tokens: several delta-rule chunks (64) and both latent attention paths (absorbed ≤ 64 queries)."""
    path, hf = kimi(family)
    sequences = _tokens(1, [2, 9, 48, 150] if family == "kimi_linear" else [9, 70])
    worst = 0.0
    for sequence, score in zip(sequences, ModelRunner.from_pretrained(str(path), max_num_seqs=4).score(sequences)):
        assert score.error is None
        ids = torch.tensor([sequence])
        with torch.no_grad():
            logprobs = hf(ids).logits.float().log_softmax(-1)[0, :-1]
        reference = logprobs.gather(-1, ids[0, 1:, None]).squeeze(-1)
        worst = max(worst, (torch.tensor(score.token_logprobs) - reference).abs().max().item())
        assert len(sequence) < 10 or torch.tensor(score.token_logprobs).std() > 0.3  # far from uniform
    print(f"{family}: max |Δ logprob| = {worst:.2e}")
    assert worst < 1e-4


def test_greedy_generate_matches_transformers(kimi):
    path, hf = kimi("kimi_linear")
    runner = ModelRunner.from_pretrained(str(path), max_num_seqs=2)  # 3 prompts through 2 slots: a slot gets reused
    prompts = _tokens(2, [1, 17, 40])
    results = runner.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=10,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
        margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
        assert_same_greedy(result.token_ids, out.sequences[0, len(prompt) :].tolist(), margins)


def _run(model, pool, tokens, slots, cache_lens, num_tokens, states):
    batch = ForwardBatch(torch.tensor(slots), torch.tensor(cache_lens), torch.tensor(num_tokens))
    with torch.no_grad():
        out = model(tokens, batch, states, pool.kv_caches())
    return out.hidden, out.mamba_states


def _assert_states_close(a, b):
    for sa, sb in zip(a, b, strict=True):
        torch.testing.assert_close(sa.conv, sb.conv, **TOL)
        torch.testing.assert_close(sa.ssm, sb.ssm, **TOL)


def test_latent_cache_holds_what_transformers_caches(kimi):
    """Per token and latent-attention layer the pool keeps one head [rmsnorm(latent) | k_rope] — transformers'
    cached (kv_nope, k_rot) side by side — and no value; the memory plan counts exactly that."""
    path, hf = kimi("kimi_linear")
    loaded = load_checkpoint(str(path))
    config, mla = loaded.config, loaded.config.mla
    tokens = torch.tensor(_tokens(3, [21]))
    pool = StatePool(config, 2, 64, torch.device("cpu"), torch.float32)
    _run(loaded.model, pool, tokens, [1], [0], [21], pool.zeros(1))
    cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        hf(tokens, cache=cache, use_cache=True)
    keys, values = pool.slot_kv(1, 21)  # [layers, 1, 21, L + R], [layers, 1, 21, 0]
    assert keys.shape == (1, 1, 21, mla.kv_lora_rank + mla.qk_rope_head_dim) and values.shape == (1, 1, 21, 0)
    layer = hf.config.layer_types.index("full_attention")
    expected = torch.cat([cache.layers[layer].keys, cache.layers[layer].values], dim=-1)[0]  # [1, 21, L + R]
    torch.testing.assert_close(keys[0], expected, **TOL)
    assert pool.kv_bytes_per_token() == kv_bytes_per_token(config, torch.float32) == 4 * (24 + 8)


def test_absorbed_and_expanded_latent_attention_agree(kimi):
    loaded = load_checkpoint(str(kimi("kimi_linear")[0]), linear_backend="torch")
    attention = next(m for m in loaded.model.modules() if isinstance(m, MultiHeadLatentAttention))
    tokens = torch.tensor(_tokens(4, [30, 30]))
    results = []
    for absorb_max_tokens in (0, 1000):
        attention.absorb_max_tokens = absorb_max_tokens
        pool = StatePool(loaded.config, 2, 64, torch.device("cpu"), torch.float32)
        hidden, _ = _run(loaded.model, pool, tokens, [0, 1], [0, 0], [30, 17], pool.zeros(2))
        results.append(hidden)
    torch.testing.assert_close(results[0], results[1], **TOL)


@pytest.fixture(scope="module")
def loaded(kimi):
    return load_checkpoint(str(kimi("kimi_linear")[0]))


def test_prefill_from_a_state_equals_one_full_prefill(loaded):
    model, config = loaded.model, loaded.config
    tokens = torch.tensor(_tokens(5, [77]))  # the first part ends mid-chunk of the 64-token delta-rule grid
    full_pool = StatePool(config, 1, 96, torch.device("cpu"), torch.float32)
    full_hidden, full_states = _run(model, full_pool, tokens, [0], [0], [77], full_pool.zeros(1))
    pool = StatePool(config, 1, 96, torch.device("cpu"), torch.float32)
    _, states = _run(model, pool, tokens[:, :20], [0], [0], [20], pool.zeros(1))
    hidden, states = _run(model, pool, tokens[:, 20:], [0], [20], [57], states)
    torch.testing.assert_close(hidden, full_hidden[:, 20:], **TOL)
    _assert_states_close(states, full_states)


def test_extend_equals_single_steps(loaded):
    model, config = loaded.model, loaded.config
    tokens = torch.tensor(_tokens(6, [26]))
    pool_a = StatePool(config, 1, 64, torch.device("cpu"), torch.float32)
    pool_b = StatePool(config, 1, 64, torch.device("cpu"), torch.float32)
    _, start_a = _run(model, pool_a, tokens[:, :18], [0], [0], [18], pool_a.zeros(1))
    _, states = _run(model, pool_b, tokens[:, :18], [0], [0], [18], pool_b.zeros(1))
    extended, extended_states = _run(model, pool_a, tokens[:, 18:], [0], [18], [8], start_a)
    outputs = []
    for t in range(18, 26):
        out, states = _run(model, pool_b, tokens[:, t : t + 1], [0], [t], [1], states)
        outputs.append(out)
    torch.testing.assert_close(extended, torch.cat(outputs, dim=1), **TOL)
    _assert_states_close(extended_states, states)
    torch.testing.assert_close(pool_a.slot_kv(0, 26)[0], pool_b.slot_kv(0, 26)[0], **TOL)


def test_ragged_batch_rows_equal_rows_run_alone(loaded):
    model, config = loaded.model, loaded.config
    lengths = [5, 70, 1, 17]
    rows = [torch.tensor(t) for t in _tokens(7, lengths)]
    padded = torch.full((4, max(lengths)), 7)  # padding with real token ids: they must not leak anywhere
    for i, row in enumerate(rows):
        padded[i, : len(row)] = row
    pool = StatePool(config, 6, 96, torch.device("cpu"), torch.float32)
    slots = [5, 0, 3, 1]
    hidden, states = _run(model, pool, padded, slots, [0] * 4, lengths, pool.zeros(4))
    for i, row in enumerate(rows):
        alone_pool = StatePool(config, 1, 96, torch.device("cpu"), torch.float32)
        alone, alone_states = _run(model, alone_pool, row[None], [0], [0], [len(row)], alone_pool.zeros(1))
        torch.testing.assert_close(hidden[i : i + 1, : len(row)], alone, **TOL)
        _assert_states_close([type(s)(s.conv[i : i + 1], s.ssm[i : i + 1]) for s in states], alone_states)
        torch.testing.assert_close(pool.slot_kv(slots[i], len(row))[0], alone_pool.slot_kv(0, len(row))[0], **TOL)


def test_graph_steps_of_a_dense_kimi_model_equal_the_module_path_and_are_capture_safe(kimi):
    """Without experts a Kimi-Linear model's decode and verification steps run as CUDA graphs: the latent
    attention's static form and the KDA steps give the module path's logits and states, and capture safely."""
    path = kimi("kimi_linear_dense")[0]
    assert_graph_steps_exact(lambda family: path, "kimi_linear_dense")
    assert_capture_safe(lambda family: path, "kimi_linear_dense")
