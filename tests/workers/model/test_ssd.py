"""The scan kernels against token-by-token references: chunked SSD, causal conv, padding, initial states."""

from __future__ import annotations

import pytest
import torch

from workers.model.kernels.ssd import causal_conv, ssd_chunked, ssm_step

B_, H, P, N, G = 3, 4, 8, 6, 2


def _inputs(length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B_, length, H, P, generator=g)
    dt = torch.rand(B_, length, H, generator=g) * 0.5 + 0.01
    A = -torch.rand(H, generator=g) * 2 - 0.1
    Bm = torch.randn(B_, length, G, N, generator=g)
    Cm = torch.randn(B_, length, G, N, generator=g)
    state = torch.randn(B_, H, P, N, generator=g)
    return x, dt, A, Bm, Cm, state


def _reference(x, dt, A, Bm, Cm, state):
    """The recurrence written out per token, per head, with the group of each head spelled out."""
    ys = []
    h = state.clone()
    for t in range(x.shape[1]):
        y_t = torch.zeros(x.shape[0], H, P)
        for head in range(H):
            group = head // (H // G)
            decay = torch.exp(dt[:, t, head] * A[head])[:, None, None]
            h[:, head] = (
                h[:, head] * decay + dt[:, t, head, None, None] * x[:, t, head, :, None] * Bm[:, t, group, None, :]
            )
            y_t[:, head] = (h[:, head] * Cm[:, t, group, None, :]).sum(-1)
        ys.append(y_t)
    return (torch.stack(ys, dim=1) if ys else x.new_zeros(x.shape[0], 0, H, P)), h


@pytest.mark.parametrize("length", [1, 5, 8, 9, 23])
def test_chunked_ssd_equals_token_by_token_from_a_given_state(length):
    x, dt, A, Bm, Cm, state = _inputs(length)
    y, final = ssd_chunked(x, dt, A, Bm, Cm, state, chunk_size=8)
    y_ref, final_ref = _reference(x, dt, A, Bm, Cm, state)
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, final_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("length", [1, 8, 23])
def test_chunked_ssd_from_no_state_equals_token_by_token_from_zeros(length):
    x, dt, A, Bm, Cm, state = _inputs(length, seed=5)
    y, final = ssd_chunked(x, dt, A, Bm, Cm, None, chunk_size=8)
    y_ref, final_ref = _reference(x, dt, A, Bm, Cm, torch.zeros_like(state))
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, final_ref, atol=1e-4, rtol=1e-4)


def test_step_equals_reference():
    x, dt, A, Bm, Cm, state = _inputs(1, seed=3)
    y, new = ssm_step(x[:, 0], dt[:, 0], A, Bm[:, 0], Cm[:, 0], state)
    y_ref, new_ref = _reference(x, dt, A, Bm, Cm, state)
    torch.testing.assert_close(y, y_ref[:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new, new_ref, atol=1e-5, rtol=1e-5)


def test_padding_leaks_into_no_state():
    x, dt, A, Bm, Cm, state = _inputs(20, seed=1)
    num_tokens = torch.tensor([20, 7, 0])
    valid = torch.arange(20)[None, :] < num_tokens[:, None]
    # Garbage at the padded positions must not matter.
    x_noisy = torch.where(valid[..., None, None], x, torch.full_like(x, 1e3))
    _, final = ssd_chunked(x_noisy, dt * valid[..., None], A, Bm, Cm, state, chunk_size=8)
    for row, n in enumerate(num_tokens.tolist()):
        _, expected = _reference(
            x[row : row + 1, :n],
            dt[row : row + 1, :n],
            A,
            Bm[row : row + 1, :n],
            Cm[row : row + 1, :n],
            state[row : row + 1],
        )
        torch.testing.assert_close(final[row : row + 1], expected, atol=1e-4, rtol=1e-4)


def test_causal_conv_windows_and_outputs():
    g = torch.Generator().manual_seed(0)
    channels, width, length = 5, 4, 6
    xbc = torch.randn(3, length, channels, generator=g)
    window = torch.randn(3, channels, width - 1, generator=g)
    weight, bias = torch.randn(channels, width, generator=g), torch.randn(channels, generator=g)
    num_tokens = torch.tensor([6, 2, 0])
    out, new_window = causal_conv(xbc, window, weight, bias, num_tokens)
    for row in range(3):
        history = torch.cat([window[row], xbc[row].T], dim=1)  # [c, W-1+l]
        for t in range(length):
            expected = torch.nn.functional.silu((history[:, t : t + width] * weight).sum(-1) + bias)
            torch.testing.assert_close(out[row, t], expected, atol=1e-5, rtol=1e-5)
        n = int(num_tokens[row])
        torch.testing.assert_close(new_window[row], history[:, n : n + width - 1])


def test_in_place_decode_steps_equal_the_functional_ones():
    from workers.model.kernels.ssd import conv_step_, ssm_step_

    x, dt, A, Bm, Cm, state = _inputs(1, seed=5)
    y_ref, state_ref = ssm_step(x[:, 0], dt[:, 0], A, Bm[:, 0], Cm[:, 0], state)
    updated = state.clone()
    y = ssm_step_(x[:, 0], dt[:, 0], A, Bm[:, 0], Cm[:, 0], updated)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(updated, state_ref, atol=1e-5, rtol=1e-5)
    g = torch.Generator().manual_seed(2)
    xbc, window = torch.randn(3, 1, 5, generator=g), torch.randn(3, 5, 3, generator=g)
    weight, bias = torch.randn(5, 4, generator=g), torch.randn(5, generator=g)
    out_ref, window_ref = causal_conv(xbc, window, weight, bias, torch.ones(3, dtype=torch.long))
    shifted = window.clone()
    torch.testing.assert_close(conv_step_(xbc, shifted, weight, bias), out_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shifted, window_ref)


@pytest.mark.slow
def test_compiled_decode_step_equals_the_eager_one():
    from workers.model.kernels.ssd import compiled_ssm_step_

    x, dt, A, Bm, Cm, state = _inputs(1, seed=7)
    y_ref, state_ref = ssm_step(x[:, 0], dt[:, 0], A, Bm[:, 0], Cm[:, 0], state)
    for batch in (3, 2):  # a second batch size reuses the dynamic-shape kernel
        updated = state[:batch].clone()
        y = compiled_ssm_step_()(x[:batch, 0], dt[:batch, 0], A, Bm[:batch, 0], Cm[:batch, 0], updated)
        torch.testing.assert_close(y, y_ref[:batch], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(updated, state_ref[:batch], atol=1e-5, rtol=1e-5)
