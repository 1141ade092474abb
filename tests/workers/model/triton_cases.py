"""The Triton decode-step and state-shift kernels, run by Triton's interpreter on CPU in float32, against the mixers'
pure-PyTorch paths (the reference): outputs and states within 1e-5, for several shapes and acceptance counts.

Triton chooses interpreter or compiler when it is imported, so these cases run in a process started with
TRITON_INTERPRET=1: `test_triton_kernels.py` starts one (named `*_cases.py`, the suite itself does not collect them).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from workers.model.checkpoint.config import GdnConfig, MambaConfig
from workers.model.kernels.triton_kernels import interpreter_on, unavailable_reason
from workers.model.layers.gdn import GatedDeltaNetMixer
from workers.model.layers.mamba2 import Mamba2Mixer
from workers.model.state import RecurrentState

if not interpreter_on() or unavailable_reason(torch.device("cpu")) is not None:
    pytest.skip("needs triton and TRITON_INTERPRET=1 (test_triton_kernels.py runs these)", allow_module_level=True)

TOL = dict(atol=1e-5, rtol=1e-5)


def _randomise(module: torch.nn.Module, seed: int) -> None:
    """Large random weights (0.02-scale ones would hide a wrong state); A_log kept so decays stay in (0, 1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * (0.5 if name.endswith("A_log") else 0.3))


def _mamba(heads: int, groups: int, norm_groups: int, state_size: int = 8, seed: int = 0) -> Mamba2Mixer:
    config = MambaConfig(
        num_heads=heads,
        head_dim=8,
        state_size=state_size,
        num_groups=groups,
        conv_kernel=4,
        chunk_size=8,
        conv_bias=True,
        proj_bias=False,
        dt_min=0.001,
        dt_max=0.5,
    )
    mixer = Mamba2Mixer(SimpleNamespace(mamba=config, hidden_size=24, rms_norm_eps=1e-5))
    mixer.norm.num_groups = norm_groups
    _randomise(mixer, seed)
    return mixer


def _gdn(key_heads: int, value_heads: int, seed: int = 0, beta_scale: float = 1.0) -> GatedDeltaNetMixer:
    config = GdnConfig(
        num_key_heads=key_heads,
        num_value_heads=value_heads,
        key_head_dim=8,
        value_head_dim=12,
        conv_kernel=4,
        beta_scale=beta_scale,
    )
    mixer = GatedDeltaNetMixer(SimpleNamespace(gdn=config, hidden_size=24, rms_norm_eps=1e-3))
    _randomise(mixer, seed)
    return mixer


def _state(mixer: torch.nn.Module, batch: int, seed: int) -> RecurrentState:
    generator = torch.Generator().manual_seed(seed)
    c = mixer.config
    if isinstance(mixer, Mamba2Mixer):
        shape = (batch, c.num_heads, c.head_dim, c.state_size)
    else:
        shape = (batch, c.num_value_heads, c.key_head_dim, c.value_head_dim)
    conv = torch.randn(batch, c.conv_dim, c.conv_kernel - 1, generator=generator)
    return RecurrentState(conv, torch.randn(shape, generator=generator))


def _copy(state: RecurrentState) -> RecurrentState:
    return RecurrentState(state.conv.clone(), state.ssm.clone())


MIXERS = {
    "mamba2 g1": lambda: _mamba(heads=4, groups=1, norm_groups=1),
    "mamba2 g2, norm groups 2": lambda: _mamba(heads=4, groups=2, norm_groups=2, seed=1),
    "mamba2 g2, n 12 (masked)": lambda: _mamba(heads=6, groups=2, norm_groups=1, state_size=12, seed=2),
    "gdn h_v = h_k": lambda: _gdn(key_heads=2, value_heads=2),
    "gdn h_v = 2 h_k": lambda: _gdn(key_heads=2, value_heads=4, seed=1),
    "gdn beta 2·sigmoid (OLMo-Hybrid)": lambda: _gdn(key_heads=2, value_heads=4, seed=3, beta_scale=2.0),
}


@pytest.mark.parametrize("name", list(MIXERS))
def test_decode_steps_equal_the_torch_path(name):
    mixer, batch = MIXERS[name](), 3
    state = _state(mixer, batch, seed=5)
    reference_state, triton_state = _copy(state), _copy(state)
    hidden = torch.randn(batch, 4, 1, 24, generator=torch.Generator().manual_seed(6))
    ones = torch.ones(batch, dtype=torch.long)
    for step in range(4):  # consecutive steps: the in-place state and window carry over
        mixer.decode_kernel = "torch"
        reference, _, _ = mixer(hidden[:, step], reference_state, ones, in_place=True)
        mixer.decode_kernel = "triton"
        out, returned, scan = mixer(hidden[:, step], triton_state, ones, in_place=True)
        assert returned is triton_state and scan is None  # updated in place
        torch.testing.assert_close(out, reference, **TOL)
        torch.testing.assert_close(triton_state.ssm, reference_state.ssm, **TOL)
        torch.testing.assert_close(triton_state.conv, reference_state.conv, **TOL)
    assert (triton_state.ssm - state.ssm).abs().max() > 0.1  # the state really moved


@pytest.mark.parametrize("name", list(MIXERS))
def test_state_shift_after_partial_acceptance_equals_the_torch_path(name):
    mixer, length = MIXERS[name](), 4
    accepted = torch.tensor([1, 3, 4, 2, 1])  # several counts per batch, incl. none and all of the drafts
    state = _state(mixer, len(accepted), seed=7)
    hidden = torch.randn(len(accepted), length, 24, generator=torch.Generator().manual_seed(8))
    mixer.decode_kernel = "torch"
    _, _, scan = mixer(hidden, state, torch.full_like(accepted, length))
    reference = mixer.state_after(state, scan, accepted)
    mixer.decode_kernel = "triton"
    shifted = mixer.state_after(state, scan, accepted)
    torch.testing.assert_close(shifted.ssm, reference.ssm, **TOL)
    assert torch.equal(shifted.conv, reference.conv)  # a gather: exact
    for row, n in enumerate(accepted.tolist()):  # against plain steps over the accepted prefix, one row at a time
        _, stepped, _ = mixer(hidden[row : row + 1, :n], _copy_row(state, row), torch.tensor([n]))
        torch.testing.assert_close(shifted.ssm[row : row + 1], stepped.ssm, **TOL)
        torch.testing.assert_close(shifted.conv[row : row + 1], stepped.conv, **TOL)


def _copy_row(state: RecurrentState, row: int) -> RecurrentState:
    return RecurrentState(state.conv[row : row + 1].clone(), state.ssm[row : row + 1].clone())


def test_decode_step_reads_strided_state_views():
    """The pool hands out per-layer views ([slots, …] slices of [layers, slots, …]): strides must be honoured."""
    mixer = _mamba(heads=4, groups=2, norm_groups=1)
    pool_conv = torch.randn(2, 3, mixer.config.conv_dim, 3)
    pool_ssm = torch.randn(2, 3, 4, 8, 8)
    reference = RecurrentState(pool_conv[1, :2].clone(), pool_ssm[1, :2].clone())
    view = RecurrentState(pool_conv[1, :2], pool_ssm[1, :2])
    hidden = torch.randn(2, 1, 24)
    mixer.decode_kernel = "torch"
    expected, _, _ = mixer(hidden, reference, torch.ones(2, dtype=torch.long), in_place=True)
    untouched = pool_ssm[0].clone(), pool_ssm[1, 2].clone()
    mixer.decode_kernel = "triton"
    out, _, _ = mixer(hidden, view, torch.ones(2, dtype=torch.long), in_place=True)
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(pool_ssm[1, :2], reference.ssm, **TOL)
    torch.testing.assert_close(pool_conv[1, :2], reference.conv, **TOL)
    assert torch.equal(pool_ssm[0], untouched[0]) and torch.equal(pool_ssm[1, 2], untouched[1])


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("tokens, k, experts", [(1, 2, 4), (7, 2, 5), (19, 3, 6)])
def test_triton_grouped_experts_match_the_eager_experts(tokens, k, experts, gated):
    """The Triton grouped GEMM over block-padded expert rows (the graph form where torch._grouped_mm cannot run):
    experts with no rows, more rows than a block, widths that are not block multiples."""
    from workers.model.kernels.triton_kernels import moe as triton_moe
    from workers.model.layers import moe
    from workers.model.layers.feed_forward import activate

    g = torch.Generator().manual_seed(tokens)
    width, inter = 40, 24
    up = torch.randn(experts, inter * (2 if gated else 1), width, generator=g) * 0.3
    down = torch.randn(experts, width, inter, generator=g) * 0.3
    x = torch.randn(tokens, width, generator=g)
    ids = torch.stack([torch.randperm(experts - 1, generator=g)[:k] for _ in range(tokens)])  # the last expert: none
    if tokens > 16:
        ids[:, 0] = 0  # expert 0 takes more rows than a block
    got = triton_moe.expert_rows(x, ids, up, down, gated, activate)
    torch.testing.assert_close(got, moe._rows_eager(x, ids, up, down, gated), **TOL)
    from workers.model.steps.capture_safety import find_capture_hazards

    assert find_capture_hazards(lambda: triton_moe.expert_rows(x, ids, up, down, gated, activate)) == []
