"""Kimi-Linear's native kernels (csrc/kda_decode.c, csrc/mla_attention.c) against the PyTorch reference: the KDA
decode step and prompt walk (chunk boundaries, ragged rows, continued from a kept state) vs token-by-token PyTorch
steps, the absorbed latent attention vs the einsum path, on the tiny checkpoints of `tests/kimi_models.py` (the odd
layout: KDA head_dim 12 over 3 heads, MLA without a rope part) and against transformers for the odd layout."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import KimiLinearForCausalLM

from workers import ModelRunner
from workers.model import ForwardBatch, StatePool, load_checkpoint
from workers.model.checkpoint.config import KDA
from workers.model.kernels import native_kimi
from workers.model.layers.kda import KimiDeltaAttentionMixer
from workers.model.layers.mla import MultiHeadLatentAttention
from workers.model.layers.native_linear import NativeLinear
from workers.model.state import RecurrentState

TOL = dict(atol=2e-5, rtol=1e-4)  # float32 rounding; a wrong state or output is off by O(1)
FAMILIES = ["kimi_linear", "kimi_linear_odd"]


@pytest.fixture(scope="module")
def kimi_model(checkpoint_dir):
    """layout → (checkpoint path, our model on the native path), loaded on first use."""
    built = {}

    def get(family: str):
        if family not in built:
            path = checkpoint_dir(family)
            built[family] = path, load_checkpoint(str(path), decode_kernel="native").model
        return built[family]

    return get


def _wide_kda(config) -> KimiDeltaAttentionMixer:
    """A random KDA mixer with head_dim 80 (one full 64-column block of the prompt walk plus a 16-column tail)."""
    torch.manual_seed(0)
    mixer = KimiDeltaAttentionMixer(replace(config, kda=replace(config.kda, head_dim=80, num_heads=2)))
    with torch.no_grad():
        for name, parameter in mixer.named_parameters():
            parameter.copy_(torch.randn(parameter.shape) * (0.5 if "bias" in name or "A_log" in name else 0.2))
        mixer.o_norm.weight.add_(1.0)
    for name in ("in_proj", "f_b_proj", "g_b_proj", "o_proj"):  # as the loader packs them on the native path
        setattr(mixer, name, NativeLinear(getattr(mixer, name)))
    mixer.decode_kernel = "native"
    return mixer.eval()


def _kda(kimi_model, family: str) -> KimiDeltaAttentionMixer:
    if family == "wide":
        return _wide_kda(kimi_model("kimi_linear")[1].config)
    return next(block.mixer for block in kimi_model(family)[1].blocks if block.kind == KDA)


def _state(mixer, b: int, seed: int) -> RecurrentState:
    k, g = mixer.config, torch.Generator().manual_seed(seed)
    conv = torch.randn(b, k.conv_dim, k.conv_kernel - 1, generator=g)
    return RecurrentState(conv, 0.3 * torch.randn(b, k.num_heads, k.head_dim, k.head_dim, generator=g))


def _torch_tokens(mixer, hidden: torch.Tensor, state: RecurrentState | None) -> tuple[torch.Tensor, RecurrentState]:
    """The reference: the PyTorch mixer one token at a time (kda_scan over one position) → (out, state after)."""
    mixer.decode_kernel = "torch"
    try:
        if state is None:
            b, k = hidden.shape[0], mixer.config
            state = RecurrentState(
                torch.zeros(b, k.conv_dim, k.conv_kernel - 1), torch.zeros(b, k.num_heads, k.head_dim, k.head_dim)
            )
        outs = []
        for t in range(hidden.shape[1]):
            out, state, _ = mixer(hidden[:, t : t + 1], state, torch.ones(hidden.shape[0], dtype=torch.int64))
            outs.append(out)
        return torch.cat(outs, dim=1), state
    finally:
        mixer.decode_kernel = "native"


@pytest.mark.parametrize("family", [*FAMILIES, "wide"])
def test_kda_decode_step_matches_the_pytorch_step(kimi_model, family):
    mixer = _kda(kimi_model, family)
    hidden = torch.randn(3, 1, mixer.in_proj.in_features, generator=torch.Generator().manual_seed(0))
    state = _state(mixer, 3, 1)
    expected, expected_state = _torch_tokens(mixer, hidden, RecurrentState(state.conv.clone(), state.ssm.clone()))
    with torch.inference_mode():
        out, new_state, scan = mixer(hidden, state, torch.ones(3, dtype=torch.int64), in_place=True)
    assert new_state.ssm is state.ssm and scan is None  # updated in place
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(state.conv, expected_state.conv, **TOL)
    torch.testing.assert_close(state.ssm, expected_state.ssm, **TOL)
    assert (state.ssm - _state(mixer, 3, 1).ssm).abs().max() > 1e-3  # the step did change the state


@pytest.mark.parametrize("family", [*FAMILIES, "wide"])
def test_kda_native_verification_and_keep_equal_decode_steps_bit_for_bit(kimi_model, family):
    """A few tokens per row from a kept state through the native module path (ragged rows): every output is the
    native decode step's, the start state is left as it was, the new state and `state_after` for any accepted
    counts are the states those decode steps leave."""
    mixer = _kda(kimi_model, family)
    hidden = torch.randn(3, 4, mixer.in_proj.in_features, generator=torch.Generator().manual_seed(7))
    start = _state(mixer, 3, 8)
    stepped = RecurrentState(start.conv.clone(), start.ssm.clone())
    outputs, snapshots = [], [RecurrentState(start.conv.clone(), start.ssm.clone())]
    with torch.inference_mode():
        for t in range(4):
            outputs.append(mixer(hidden[:, t : t + 1], stepped, torch.ones(3, dtype=torch.int64), in_place=True)[0])
            snapshots.append(RecurrentState(stepped.conv.clone(), stepped.ssm.clone()))
        state = RecurrentState(start.conv.clone(), start.ssm.clone())
        out, new_state, kept = mixer(hidden, state, torch.tensor([4, 2, 3]))
        shifted = mixer.state_after(state, kept, torch.tensor([1, 4, 0]))
    assert torch.equal(out, torch.cat(outputs, dim=1))
    assert torch.equal(state.conv, start.conv) and torch.equal(state.ssm, start.ssm)
    for row, (n, shift) in enumerate(zip([4, 2, 3], [1, 4, 0])):
        for got, steps in ((new_state, n), (shifted, shift)):
            assert torch.equal(got.conv[row], snapshots[steps].conv[row]), f"conv window of row {row}"
            assert torch.equal(got.ssm[row], snapshots[steps].ssm[row]), f"delta-rule state of row {row}"
    with pytest.raises(ValueError, match="accepted counts"):
        mixer.state_after(state, kept, torch.tensor([1, 5, 0]))


PREFILL_CASES = [(f, n) for f in FAMILIES for n in (1, 63, 64, 65, 133)] + [("wide", n) for n in (1, 63, 65)]


@pytest.mark.parametrize(("family", "length"), PREFILL_CASES)
def test_kda_native_prefill_matches_token_by_token_steps(kimi_model, family, length):
    """Prompt lengths around the delta rule's chunk (64): 1, chunk − 1, chunk, chunk + 1, two chunks + a tail; rows
    right-padded (ragged); from the zero state and continued from each row's kept state. "wide": head_dim 80, a
    full 64-column block of the prompt walk and a partial one."""
    mixer = _kda(kimi_model, family)
    assert mixer.config.chunk_size == 64
    g = torch.Generator().manual_seed(length)
    hidden = torch.randn(3, length, mixer.in_proj.in_features, generator=g)
    num_tokens = torch.tensor([length, max(1, length // 2), max(1, length - 7)])
    for start in (None, _state(mixer, 3, 2)):
        with torch.inference_mode():
            initial = None if start is None else RecurrentState(start.conv.clone(), start.ssm.clone())
            out, state, scan = mixer._native_prefill(hidden, num_tokens, initial)
        assert (scan is None) == (start is None)
        for row, n in enumerate(num_tokens.tolist()):
            first = None if start is None else RecurrentState(start.conv[row : row + 1], start.ssm[row : row + 1])
            with torch.inference_mode():
                expected, expected_state = _torch_tokens(mixer, hidden[row : row + 1, :n], first)
            torch.testing.assert_close(out[row, :n], expected[0], **TOL)
            torch.testing.assert_close(state.conv[row], expected_state.conv[0], **TOL)
            torch.testing.assert_close(state.ssm[row], expected_state.ssm[0], **TOL)


@pytest.mark.parametrize("family", [*FAMILIES, "wide"])
def test_kda_native_prefill_continues_through_forward_and_shifts(kimi_model, family):
    """A prompt in two pieces through `forward` (the second from the kept state, longer than the recurrent
    threshold: the native prefill with scan inputs) equals it in one piece; the scan inputs shift the state exactly
    as the PyTorch path's `state_after` does."""
    mixer = _kda(kimi_model, family)
    hidden = torch.randn(2, 40, mixer.in_proj.in_features, generator=torch.Generator().manual_seed(5))
    full = torch.tensor([40, 40])
    with torch.inference_mode():
        whole, whole_state, _ = mixer(hidden, None, full)
        first, kept, _ = mixer(hidden[:, :17], None, torch.tensor([17, 17]))
        second, state, scan = mixer(hidden[:, 17:], kept, torch.tensor([23, 23]))
        shifted = mixer.state_after(kept, scan, torch.tensor([23, 5]))
        _, reference, _ = mixer(hidden[:, :22], None, torch.tensor([22, 22]))
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole, **TOL)
    torch.testing.assert_close(state.ssm, whole_state.ssm, **TOL)
    assert torch.equal(state.conv, whole_state.conv)
    torch.testing.assert_close(shifted.ssm[0], whole_state.ssm[0], **TOL)
    torch.testing.assert_close(shifted.ssm[1], reference.ssm[1], **TOL)
    assert torch.equal(shifted.conv[1], reference.conv[1])


def test_kda_kernels_refuse_mismatched_shapes(kimi_model):
    mixer = _kda(kimi_model, "kimi_linear")
    k, state = mixer.config, _state(mixer, 2, 0)
    proj = torch.zeros(2, mixer.in_proj.out_features + 1)
    with pytest.raises(ValueError, match="shape mismatch"):
        native_kimi.kda_decode_step(
            proj,
            torch.zeros(2, k.qkv_dim),
            torch.zeros(2, k.qkv_dim),
            state.conv,
            mixer.conv1d.weight.squeeze(1),
            mixer.dt_bias,
            mixer.A_log,
            state.ssm,
            mixer.o_norm.weight,
            1e-5,
        )
    with pytest.raises(ValueError, match="num_tokens"):
        proj = torch.zeros(2, 3, mixer.in_proj.out_features)
        gates = torch.zeros(2, 3, k.qkv_dim)
        native_kimi.kda_prefill(
            proj,
            gates,
            gates,
            torch.tensor([4, 1]),
            mixer.conv1d.weight.squeeze(1),
            mixer.dt_bias,
            mixer.A_log,
            mixer.o_norm.weight,
            1e-5,
            k.num_heads,
        )


def _mla(model) -> tuple[int, MultiHeadLatentAttention]:
    layer = next(i for i, b in enumerate(model.blocks) if isinstance(b.mixer, MultiHeadLatentAttention))
    return sum(isinstance(b.mixer, MultiHeadLatentAttention) for b in model.blocks[:layer]), model.blocks[layer].mixer


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("length", [1, 4])
def test_mla_native_step_matches_the_einsum_path(kimi_model, family, length):
    """Decode steps (1 query token) and verifications (4, causal) at ragged positions over a random cache (blocks
    of 16: queries cross block boundaries): the same outputs and cache entries as the einsum path."""
    model = kimi_model(family)[1]
    index, mla = _mla(model)
    pool = StatePool(model.config, 3, 64, torch.device("cpu"), torch.float32)
    pool.key.copy_(torch.randn(pool.key.shape, generator=torch.Generator().manual_seed(1)))
    reference_key = pool.key.clone()
    positions = torch.tensor([0, 15, 37])
    hidden = torch.randn(3, length, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    batch = ForwardBatch(torch.tensor([2, 0, 1]), positions, torch.full((3,), length))
    with torch.inference_mode():
        out = mla(hidden, batch, pool.kv_caches()[index])
        mla.native = False
        try:
            cache = pool.kv_caches()[index]
            expected = mla(hidden, batch, type(cache)(reference_key[index], cache.value, cache.blocks))
        finally:
            mla.native = True
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(pool.key, reference_key, **TOL)
    assert not torch.equal(pool.key, torch.randn(pool.key.shape, generator=torch.Generator().manual_seed(1)))


def test_mla_native_refuses_a_position_without_a_block(kimi_model):
    model = kimi_model("kimi_linear")[1]
    index, mla = _mla(model)
    pool = StatePool(model.config, 2, 32, torch.device("cpu"), torch.float32)
    pool.key.zero_()
    pool.blocks.tables[1].zero_()  # slot 1 holds no block
    batch = ForwardBatch(torch.tensor([0, 1]), torch.tensor([3, 3]), torch.tensor([1, 1]))
    hidden = torch.randn(2, 1, model.config.hidden_size)
    with pytest.raises(ValueError, match="no KV block"), torch.inference_mode():
        mla(hidden, batch, pool.kv_caches()[index])
    assert not pool.key.any()  # nothing was written, not even row 0's entry
    with pytest.raises(ValueError, match="outside the cache"), torch.inference_mode():
        mla(
            hidden,
            ForwardBatch(torch.tensor([0, 0]), torch.tensor([3, 32]), torch.tensor([1, 1])),
            pool.kv_caches()[index],
        )


@pytest.mark.parametrize("family", ["kimi_linear_odd", "kimi_linear_wide"])
def test_odd_layouts_score_like_transformers(kimi_model, family):
    """The odd layout (KDA head_dim 12 over 3 heads, a 5-wide conv, MLA without a rope part, low-rank query) and the
    wide one (KDA head_dim 80: full and partial column blocks) on the native path against transformers' modeling
    code, over a prompt longer than one delta-rule chunk."""
    path, _ = kimi_model(family)
    hf = KimiLinearForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    sequences = [torch.randint(4, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 90)]
    for sequence, score in zip(sequences, ModelRunner.from_pretrained(str(path), max_num_seqs=2).score(sequences)):
        ids = torch.tensor([sequence])
        with torch.no_grad():
            logprobs = hf(ids).logits.float().log_softmax(-1)[0, :-1]
        reference = logprobs.gather(-1, ids[0, 1:, None]).squeeze(-1)
        assert (torch.tensor(score.token_logprobs) - reference).abs().max() < 1e-4
