"""The native Gated DeltaNet prefill (`csrc/gdn_decode.c`) against the PyTorch chunked path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from workers.model import load_checkpoint
from workers.model.kernels import native_recurrent
from workers.model.kernels.gated_delta import chunked_delta_rule
from workers.model.kernels.ssd import causal_conv
from workers.model.layers.gdn import GatedDeltaNetMixer
from workers.model.state import RecurrentState

ATOL = RTOL = 1e-5


@pytest.fixture(scope="module")
def mixers(checkpoint_dir) -> dict[str, GatedDeltaNetMixer]:
    """kernel → the first GDN mixer of the tiny qwen3_5 checkpoint (value heads = 2 × key heads), with random
    dt_bias, A_log and norm weight so that they matter."""
    found = {}
    for kernel in ("torch", "native"):
        model = load_checkpoint(str(checkpoint_dir("qwen3_5")), decode_kernel=kernel).model
        mixer = next(m for m in model.modules() if isinstance(m, GatedDeltaNetMixer))
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for param in (mixer.dt_bias, mixer.A_log, mixer.norm.weight):
                param.copy_(torch.randn(param.shape, generator=generator))
        found[kernel] = mixer
    assert found["native"].decode_kernel == "native"
    assert found["native"].config.num_value_heads == 2 * found["native"].config.num_key_heads
    return found


def _random_state(mixer: GatedDeltaNetMixer, batch: int, seed: int) -> RecurrentState:
    g, generator = mixer.config, torch.Generator().manual_seed(seed)
    return RecurrentState(
        torch.randn(batch, g.conv_dim, g.conv_kernel - 1, generator=generator),
        torch.randn(batch, g.num_value_heads, g.key_head_dim, g.value_head_dim, generator=generator) * 0.3,
    )


def _proj(mixer: GatedDeltaNetMixer, batch: int, length: int, seed: int) -> torch.Tensor:
    """in_proj of random hidden states: [b, l, conv_dim + value_dim + 2 h_v]."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        return mixer.in_proj(torch.randn(batch, length, mixer.in_proj.in_features, generator=generator))


def _torch_prefill(
    mixer: GatedDeltaNetMixer, proj: torch.Tensor, num_tokens: torch.Tensor, state: RecurrentState | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference: causal conv, l2 norms and gates as in `gdn.py`, the chunked delta rule, the gated norm →
    (out [b, l, value_dim], conv window, delta state)."""
    g = mixer.config
    b, length, _ = proj.shape
    conv_in, z, b_raw, a_raw = proj.split([g.conv_dim, g.value_dim, g.num_value_heads, g.num_value_heads], dim=-1)
    zero = _random_state(mixer, b, seed=0)
    zero.conv.zero_(), zero.ssm.zero_()
    start = zero if state is None else state
    with torch.no_grad():
        qkv, conv = causal_conv(conv_in, start.conv, mixer.conv1d.weight.squeeze(1), None, num_tokens)
        q, k, v = mixer._heads(qkv)
        decay, beta = mixer._gates(b_raw, a_raw, num_tokens)
        o, delta_state = chunked_delta_rule(q, k, v, decay, beta, start.ssm, g.chunk_size)
        out = mixer.norm(o, z.reshape(b, length, g.num_value_heads, g.value_head_dim), torch.float32)
    return out.reshape(b, length, g.value_dim), conv, delta_state


def _native_prefill(
    mixer: GatedDeltaNetMixer, proj: torch.Tensor, num_tokens: torch.Tensor, state: RecurrentState | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = mixer.config
    return native_recurrent.gdn_prefill(
        proj.contiguous(),
        num_tokens,
        mixer.conv1d.weight.squeeze(1),
        mixer.dt_bias,
        mixer.A_log,
        mixer.norm.weight,
        mixer.norm.eps,
        g.num_key_heads,
        g.num_value_heads,
        None if state is None else (state.conv, state.ssm),
        g.beta_scale,
    )


@pytest.mark.parametrize("from_state", [False, True], ids=["zero", "kept"])
@pytest.mark.parametrize("length", [1, 7, 64, 130])
def test_native_prefill_equals_the_chunked_torch_path(mixers, length, from_state):
    mixer = mixers["native"]
    num_tokens = torch.tensor([length, (length + 1) // 2, 0, max(length - 3, 1)])  # ragged, one row without tokens
    batch = num_tokens.shape[0]
    proj = _proj(mixer, batch, length, seed=length)
    state = _random_state(mixer, batch, seed=2) if from_state else None
    expected_out, expected_conv, expected_state = _torch_prefill(mixer, proj, num_tokens, state)
    out, conv, delta_state, _ = _native_prefill(mixer, proj, num_tokens, state)
    valid = (torch.arange(length)[None, :] < num_tokens[:, None])[..., None]  # [b, l, 1]
    torch.testing.assert_close(out * valid, expected_out * valid, atol=ATOL, rtol=RTOL)
    assert bool((out[~valid.expand_as(out)] == 0).all())  # padding outputs 0
    torch.testing.assert_close(conv, expected_conv, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(delta_state, expected_state, atol=ATOL, rtol=RTOL)
    if from_state:  # the row without tokens keeps its state exactly
        assert torch.equal(conv[2], state.conv[2]) and torch.equal(delta_state[2], state.ssm[2])


def test_native_prefill_with_wide_heads_equals_the_chunked_torch_path(checkpoint_dir):
    # d_v = 72: the kernel walks a head's state in blocks of 32 columns, the last one partial here.
    config = load_checkpoint(str(checkpoint_dir("qwen3_5"))).config
    config = dataclasses.replace(config, gdn=dataclasses.replace(config.gdn, key_head_dim=40, value_head_dim=72))
    torch.manual_seed(0)
    mixer = GatedDeltaNetMixer(config)
    with torch.no_grad():
        for param in (mixer.dt_bias, mixer.A_log, mixer.norm.weight):
            param.copy_(torch.randn(param.shape))
    num_tokens = torch.tensor([130, 70])
    proj, state = _proj(mixer, 2, 130, seed=3), _random_state(mixer, 2, seed=4)
    expected_out, expected_conv, expected_state = _torch_prefill(mixer, proj, num_tokens, state)
    out, conv, delta_state, _ = _native_prefill(mixer, proj, num_tokens, state)
    valid = (torch.arange(130)[None, :] < num_tokens[:, None])[..., None]
    torch.testing.assert_close(out * valid, expected_out * valid, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(conv, expected_conv, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(delta_state, expected_state, atol=ATOL, rtol=RTOL)


def test_native_prefill_in_two_chunks_equals_one(mixers):
    mixer = mixers["native"]
    batch, first, second = 3, 37, 70
    proj = _proj(mixer, batch, first + second, seed=5)
    full = torch.full((batch,), first + second)
    state = _random_state(mixer, batch, seed=6)
    out, conv, delta_state, _ = _native_prefill(mixer, proj, full, state)
    out_a, conv_a, state_a, _ = _native_prefill(mixer, proj[:, :first], torch.full((batch,), first), state)
    out_b, conv_b, state_b, _ = _native_prefill(
        mixer, proj[:, first:], torch.full((batch,), second), RecurrentState(conv_a, state_a)
    )
    torch.testing.assert_close(torch.cat([out_a, out_b], dim=1), out, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(conv_b, conv, atol=0, rtol=0)
    torch.testing.assert_close(state_b, delta_state, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("from_state", [False, True], ids=["zero", "kept"])
def test_native_mixer_prefill_equals_the_torch_mixer(mixers, from_state):
    length, num_tokens = 130, torch.tensor([130, 64, 9])
    hidden = torch.randn(3, length, mixers["torch"].in_proj.in_features, generator=torch.Generator().manual_seed(7))
    state = _random_state(mixers["torch"], 3, seed=8) if from_state else None
    with torch.inference_mode():
        results = {kernel: mixer(hidden, state, num_tokens) for kernel, mixer in mixers.items()}
    (out, new_state, scan), (expected_out, expected_state, expected_scan) = results["native"], results["torch"]
    valid = (torch.arange(length)[None, :] < num_tokens[:, None])[..., None]
    torch.testing.assert_close(out * valid, expected_out * valid, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(new_state.conv, expected_state.conv, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(new_state.ssm, expected_state.ssm, atol=ATOL, rtol=RTOL)
    if not from_state:
        assert scan is None  # nothing shifts a state the forward did not start from
        return
    for name in ("conv_in", "k", "v", "g", "beta"):  # what a later state shift re-runs
        torch.testing.assert_close(getattr(scan, name), getattr(expected_scan, name), atol=ATOL, rtol=RTOL)
    shifted = {kernel: m.state_after(state, results[kernel][2], num_tokens - 2) for kernel, m in mixers.items()}
    torch.testing.assert_close(shifted["native"].ssm, shifted["torch"].ssm, atol=ATOL, rtol=RTOL)


def test_native_prefill_checks_its_inputs(mixers):
    mixer = mixers["native"]
    proj = _proj(mixer, 2, 5, seed=0)
    with pytest.raises(ValueError, match="num_tokens"):
        _native_prefill(mixer, proj, torch.tensor([5, 6]), None)
    with pytest.raises(ValueError, match="num_tokens"):
        _native_prefill(mixer, proj, torch.tensor([5, 5], dtype=torch.int32), None)
    with pytest.raises(ValueError, match="shape mismatch"):
        _native_prefill(mixer, proj, torch.tensor([5, 5]), _random_state(mixer, 3, seed=0))
