"""The native kernels behind the LFM and OLMo-Hybrid decode plans against their PyTorch references: the short conv
step (`csrc/short_conv.c`), sliding-window attention (`csrc/attention.c`), and the Gated DeltaNet kernels with
OLMo's beta = 2·sigmoid(b) (`csrc/gdn_decode.c`: decode step, prefill at chunk boundaries, from a kept state)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.workers.model.plan_checks import clone, module_step, random_pool
from tests.workers.model.test_gdn_prefill_native import _native_prefill
from workers.model import load_checkpoint
from workers.model.kernels.gated_delta import delta_rule_scan
from workers.model.kernels.short_conv import (
    native_short_conv_prefill,
    native_short_conv_step_,
    short_conv,
    short_conv_step_,
)
from workers.model.kernels.ssd import causal_conv
from workers.model.layers.gdn import GatedDeltaNetMixer
from workers.model.layers.short_conv import ShortConvMixer
from workers.model.state import RecurrentState

ATOL = RTOL = 1e-5


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("d", "taps"), [(64, 3), (72, 4), (200, 2), (13, 5)])
def test_native_short_conv_step_equals_the_torch_step(d, taps, bias):
    """Widths that are and are not multiples of the kernel's 64-channel blocks, several steps in a row."""
    g = torch.Generator().manual_seed(d + taps)
    b = 3
    weight, conv_bias = torch.randn(d, taps, generator=g), torch.randn(d, generator=g) if bias else None
    window = torch.randn(b, d, taps - 1, generator=g)
    reference = window.clone()
    for _ in range(5):
        proj = torch.randn(b, 3 * d, generator=g)
        gate_b, gate_c, x = proj.chunk(3, dim=-1)
        expected = gate_c * short_conv_step_((gate_b * x)[:, None], reference, weight, conv_bias)[:, 0]
        out = native_short_conv_step_(proj, window, weight, conv_bias)
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
        assert torch.equal(window, reference)  # the window holds the products B · x themselves


@pytest.mark.parametrize("from_window", [False, True], ids=["zero", "kept"])
@pytest.mark.parametrize(("d", "taps", "length"), [(64, 3, 1), (72, 4, 2), (13, 5, 37), (200, 2, 130)])
def test_native_short_conv_prefill_equals_the_torch_conv(d, taps, length, from_window):
    """Ragged rows (one without tokens, one shorter than the window), continuing a kept window or from zeros."""
    g = torch.Generator().manual_seed(d * length + taps)
    num_tokens = torch.tensor([length, (length + 1) // 2, 0, 1])
    b = num_tokens.shape[0]
    weight, bias = torch.randn(d, taps, generator=g), torch.randn(d, generator=g)
    window = torch.randn(b, d, taps - 1, generator=g) if from_window else None
    proj = torch.randn(b, length, 3 * d, generator=g)
    gate_b, gate_c, x = proj.chunk(3, dim=-1)
    u = gate_b * x
    start = torch.zeros(b, d, taps - 1) if window is None else window
    conv, expected_window = short_conv(u, start, weight, bias, num_tokens)
    out, new_window, got_u = native_short_conv_prefill(proj, num_tokens, weight, bias, window)
    torch.testing.assert_close(out, gate_c * conv, atol=ATOL, rtol=RTOL)  # padding too: what torch computes
    assert torch.equal(got_u, u) and torch.equal(new_window, expected_window)
    with pytest.raises(ValueError, match="num_tokens"):
        native_short_conv_prefill(proj, num_tokens + length, weight, bias, window)


@pytest.mark.parametrize("family", ["lfm2", "lfm2_untied"])
def test_native_short_conv_mixer_forwards_equal_the_torch_mixer(checkpoint_dir, family):
    """Prompts from zero, chunks continuing a state, and the scan inputs a state shift re-reads."""
    path = str(checkpoint_dir(family))
    mixers = {
        kernel: next(
            m for m in load_checkpoint(path, decode_kernel=kernel).model.modules() if isinstance(m, ShortConvMixer)
        )
        for kernel in ("torch", "native")
    }
    g = torch.Generator().manual_seed(3)
    d, taps = mixers["torch"].conv1d.weight.shape[0], mixers["torch"].conv1d.weight.shape[2]
    hidden, num_tokens = torch.randn(3, 9, d, generator=g), torch.tensor([9, 4, 0])
    state = RecurrentState(torch.randn(3, d, taps - 1, generator=g), torch.zeros(3, 0, 0, 0))
    for start in (None, state):
        with torch.inference_mode():
            (out, new, scan), (expected, expected_new, expected_scan) = (
                mixers[k](hidden, start, num_tokens) for k in ("native", "torch")
            )
        valid = (torch.arange(9)[None, :] < num_tokens[:, None])[..., None]
        torch.testing.assert_close(out * valid, expected * valid, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(new.conv, expected_new.conv, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(scan.conv_in, expected_scan.conv_in, atol=ATOL, rtol=RTOL)
        if start is not None:
            shifted = mixers["native"].state_after(start, scan, torch.tensor([2, 4, 0]))
            reference = mixers["torch"].state_after(start, expected_scan, torch.tensor([2, 4, 0]))
            torch.testing.assert_close(shifted.conv, reference.conv, atol=ATOL, rtol=RTOL)


def test_native_short_conv_step_checks_shapes():
    weight, window = torch.randn(8, 3), torch.randn(2, 8, 2)
    with pytest.raises(ValueError, match="shape mismatch"):
        native_short_conv_step_(torch.randn(2, 25), window, weight, None)
    with pytest.raises(ValueError, match="shape mismatch"):
        native_short_conv_step_(torch.randn(2, 24), torch.randn(2, 8, 3), weight, None)


@pytest.mark.parametrize("family", ["lfm2_untied", "lfm3", "olmo_hybrid"])
def test_native_decode_steps_equal_the_torch_module_path(checkpoint_dir, family):
    """Whole decode steps with every native kernel (short conv, sliding-window attention at positions past LFM3's
    window of 8, head gates, sandwich and post norms, OLMo's GDN with beta 2) against the torch kernels."""
    path = str(checkpoint_dir(family))
    models = {kernel: load_checkpoint(path, decode_kernel=kernel).model for kernel in ("torch", "native")}
    kinds = {m.decode_kernel for m in models["native"].modules() if isinstance(m, ShortConvMixer | GatedDeltaNetMixer)}
    assert kinds == {"native"}
    pools = {"torch": random_pool(models["torch"], slots=3, capacity=40, seed=0)}
    pools["torch"].ssm.mul_(0.3)
    pools["native"] = clone(pools["torch"])
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        token_ids = torch.randint(0, models["torch"].config.vocab_size, (3,), generator=g).tolist()
        positions = [step, 9 + step, 30 + step]  # inside, at and past the sliding window
        logits = {k: module_step(models[k], pools[k], token_ids, positions)[0] for k in models}
        torch.testing.assert_close(logits["native"], logits["torch"], atol=1e-4, rtol=1e-4)
    for name in ("conv", "ssm", "key", "value"):
        torch.testing.assert_close(getattr(pools["native"], name), getattr(pools["torch"], name), atol=1e-4, rtol=1e-4)


def _olmo_mixer(path: Path) -> GatedDeltaNetMixer:
    model = load_checkpoint(str(path), decode_kernel="native").model
    mixer = next(m for m in model.modules() if isinstance(m, GatedDeltaNetMixer))
    assert mixer.config.beta_scale == 2.0 and mixer.decode_kernel == "native"
    return mixer


def _token_by_token(
    mixer: GatedDeltaNetMixer, proj: torch.Tensor, num_tokens: torch.Tensor, state: RecurrentState
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference: conv, heads and gates (beta_scale · sigmoid) as `gdn.py`, the delta rule token by token."""
    g = mixer.config
    b, length, _ = proj.shape
    conv_in, z, b_raw, a_raw = proj.split([g.conv_dim, g.value_dim, g.num_value_heads, g.num_value_heads], dim=-1)
    with torch.no_grad():
        qkv, conv = causal_conv(conv_in, state.conv, mixer.conv1d.weight.squeeze(1), None, num_tokens)
        q, k, v = mixer._heads(qkv)
        decay, beta = mixer._gates(b_raw, a_raw, num_tokens)  # 0 at padding: the state stays
        o, delta_state = delta_rule_scan(q, k, v, decay, beta, state.ssm)
        out = mixer.norm(o, z.reshape(b, length, g.num_value_heads, g.value_head_dim), torch.float32)
    return out.reshape(b, length, g.value_dim), conv, delta_state


@pytest.mark.parametrize("from_state", [False, True], ids=["zero", "kept"])
@pytest.mark.parametrize("length", [1, 63, 64, 65, 2 * 64 + 9])
def test_olmo_native_prefill_equals_the_token_by_token_reference(checkpoint_dir, length, from_state):
    """Prompt lengths at the chunk size's boundaries (1, chunk − 1, chunk, chunk + 1, two chunks and a tail), ragged
    rows, one without tokens; from the zero state or continuing a kept one."""
    mixer = _olmo_mixer(checkpoint_dir("olmo_hybrid"))
    g, generator = mixer.config, torch.Generator().manual_seed(length)
    assert g.chunk_size == 64
    num_tokens = torch.tensor([length, (length + 1) // 2, 0])
    state = RecurrentState(
        torch.randn(3, g.conv_dim, g.conv_kernel - 1, generator=generator),
        torch.randn(3, g.num_value_heads, g.key_head_dim, g.value_head_dim, generator=generator) * 0.3,
    )
    if not from_state:
        state.conv.zero_(), state.ssm.zero_()
    hidden = torch.randn(3, length, mixer.in_proj.in_features, generator=generator)
    with torch.no_grad():
        proj = mixer.in_proj(hidden)
    expected_out, expected_conv, expected_state = _token_by_token(mixer, proj, num_tokens, state)
    out, conv, delta_state, _ = _native_prefill(mixer, proj, num_tokens, state if from_state else None)
    valid = (torch.arange(length)[None, :] < num_tokens[:, None])[..., None]
    torch.testing.assert_close(out * valid, expected_out * valid, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(conv, expected_conv, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(delta_state, expected_state, atol=ATOL, rtol=RTOL)
    if from_state:  # the row without tokens keeps its state exactly
        assert torch.equal(delta_state[2], state.ssm[2]) and torch.equal(conv[2], state.conv[2])
    with torch.inference_mode():  # the mixer's prompt path (from the zero state: the native kernel) agrees
        mixer_out, _, _ = mixer(hidden, None, num_tokens)
    if not from_state:
        torch.testing.assert_close(mixer_out * valid, mixer.out_proj(out) * valid, atol=ATOL, rtol=RTOL)


def test_olmo_native_decode_steps_equal_the_token_by_token_reference(checkpoint_dir):
    """beta = 2·sigmoid(b) in the decode kernel: steps from a random state against the torch reference."""
    mixer = _olmo_mixer(checkpoint_dir("olmo_hybrid"))
    g, generator = mixer.config, torch.Generator().manual_seed(5)
    start = RecurrentState(
        torch.randn(2, g.conv_dim, g.conv_kernel - 1, generator=generator),
        torch.randn(2, g.num_value_heads, g.key_head_dim, g.value_head_dim, generator=generator) * 0.3,
    )
    hidden = torch.randn(2, 5, mixer.in_proj.in_features, generator=generator)
    state = RecurrentState(start.conv.clone(), start.ssm.clone())
    outs = []
    with torch.inference_mode():
        for t in range(5):
            outs.append(mixer(hidden[:, t : t + 1], state, torch.ones(2, dtype=torch.long), in_place=True)[0])
        proj = mixer.in_proj(hidden)
        expected_out, expected_conv, expected_state = _token_by_token(mixer, proj, torch.full((2,), 5), start)
        expected = mixer.out_proj(expected_out)
    torch.testing.assert_close(torch.cat(outs, dim=1), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state.conv, expected_conv, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(state.ssm, expected_state, atol=1e-4, rtol=1e-4)
