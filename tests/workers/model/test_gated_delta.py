"""The gated delta rule: chunked == token by token (from a non-zero state, across chunks, with padding), against
transformers' own torch reference kernels, and the Gated DeltaNet mixer's prefill(a) + prefill(b) == prefill(a+b)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from workers.model import load_checkpoint
from workers.model.checkpoint.config import GDN
from workers.model.kernels.gated_delta import chunked_delta_rule, delta_rule_scan, delta_state_after, l2norm
from workers.model.state import RecurrentState

TOL = dict(atol=2e-5, rtol=1e-4)  # float32 rounding of two summation orders; a wrong rule is off by O(0.1)


def _inputs(b: int, length: int, h: int = 4, dk: int = 8, dv: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(b, length, h, dk, generator=g)) * dk**-0.5
    k = l2norm(torch.randn(b, length, h, dk, generator=g))
    v = torch.randn(b, length, h, dv, generator=g)
    decay = -torch.rand(b, length, h, generator=g) * 3
    beta = torch.rand(b, length, h, generator=g)
    state = torch.randn(b, h, dk, dv, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("length", [1, 7, 16, 17, 50])
def test_chunked_equals_token_by_token_from_a_state(length):
    q, k, v, decay, beta, state = _inputs(2, length)
    reference, reference_state = delta_rule_scan(q, k, v, decay, beta, state)
    out, final = chunked_delta_rule(q, k, v, decay, beta, state, chunk_size=16)
    torch.testing.assert_close(out, reference, **TOL)
    torch.testing.assert_close(final, reference_state, **TOL)
    assert (final - state).abs().max() > 0.1  # the state really moved


def test_scans_match_transformers_reference_kernels():
    q, k, v, decay, beta, state = _inputs(2, 40, seed=1)
    # transformers scales q itself (by d_k^-0.5) and takes the key heads un-repeated when they are shared.
    hf_q = q * q.shape[-1] ** 0.5
    hf_chunk, hf_chunk_state = torch_chunk_gated_delta_rule(
        hf_q, k, v, g=decay, beta=beta, chunk_size=16, initial_state=state, output_final_state=True
    )
    hf_step, hf_step_state = torch_recurrent_gated_delta_rule(
        hf_q, k, v, g=decay, beta=beta, initial_state=state, output_final_state=True
    )
    ours, ours_state = chunked_delta_rule(q, k, v, decay, beta, state, chunk_size=16)
    scanned, scanned_state = delta_rule_scan(q, k, v, decay, beta, state)
    torch.testing.assert_close(ours, hf_chunk, **TOL)
    torch.testing.assert_close(ours_state, hf_chunk_state, **TOL)
    torch.testing.assert_close(scanned, hf_step, **TOL)
    torch.testing.assert_close(scanned_state, hf_step_state, **TOL)


def test_padding_positions_leave_the_state_alone():
    q, k, v, decay, beta, state = _inputs(3, 37, seed=2)
    num_tokens = torch.tensor([37, 20, 0])
    valid = (torch.arange(37)[None, :] < num_tokens[:, None])[..., None]
    _, final = chunked_delta_rule(q, k, v, decay * valid, beta * valid, state, chunk_size=16)
    for row, n in enumerate(num_tokens.tolist()):
        _, alone = delta_rule_scan(
            q[row : row + 1, :n],
            k[row : row + 1, :n],
            v[row : row + 1, :n],
            decay[row : row + 1, :n],
            beta[row : row + 1, :n],
            state[row : row + 1],
        )
        torch.testing.assert_close(final[row : row + 1], alone, **TOL)
    # delta_state_after: the same prefixes, from the unmasked inputs.
    torch.testing.assert_close(delta_state_after(k, v, decay, beta, state, num_tokens), final, **TOL)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("split", [5, 30])  # the second part runs token by token (≤ 8) or chunked
def test_mixer_prefill_in_two_parts_equals_one_prefill(family, split, checkpoint_dir):
    model = load_checkpoint(str(checkpoint_dir(family)), linear_backend="torch").model
    mixer = next(block.mixer for block in model.blocks if block.kind == GDN)
    hidden = torch.randn(2, 36, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    everything = torch.tensor([36, 36])
    with torch.no_grad():
        full, full_state, _ = mixer(hidden, None, everything)
        first, state, _ = mixer(hidden[:, :split], None, torch.tensor([split, split]))
        second, state, _ = mixer(hidden[:, split:], state, everything - split)
    torch.testing.assert_close(torch.cat([first, second], dim=1), full, **TOL)
    torch.testing.assert_close(state.conv, full_state.conv, **TOL)
    torch.testing.assert_close(state.ssm, full_state.ssm, **TOL)
    # in_place (the decode loop's path) writes the same new state into the given tensors.
    kept = RecurrentState(state.conv.clone(), state.ssm.clone())
    with torch.no_grad():
        out, new, _ = mixer(hidden[:, :1], RecurrentState(state.conv.clone(), state.ssm.clone()), torch.tensor([1, 1]))
        out_in_place, updated, _ = mixer(hidden[:, :1], kept, torch.tensor([1, 1]), in_place=True)
    assert updated.ssm is kept.ssm
    torch.testing.assert_close(out_in_place, out)
    torch.testing.assert_close(kept.ssm, new.ssm)
