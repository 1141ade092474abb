"""The Triton decode-step and state-shift kernels, run by Triton's interpreter on CPU in float32, against the mixers'
pure-PyTorch paths (the reference): outputs and states within 1e-5, for several shapes and acceptance counts.

Triton chooses interpreter or compiler when it is imported, so these cases run in a process started with
TRITON_INTERPRET=1: `test_triton_kernels.py` starts one (named `*_cases.py`, the suite itself does not collect them).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from workers.model.checkpoint.config import GdnConfig, KdaConfig, Mamba1Config, MambaConfig, ShortConvConfig
from workers.model.kernels.triton_kernels import interpreter_on, unavailable_reason
from workers.model.layers.gdn import GatedDeltaNetMixer
from workers.model.layers.kda import KimiDeltaAttentionMixer
from workers.model.layers.mamba1 import Mamba1Mixer
from workers.model.layers.mamba2 import Mamba2Mixer
from workers.model.layers.short_conv import ShortConvMixer
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


def _mamba1(channels: int, state_size: int, conv_kernel: int, bias: bool, seed: int = 0) -> Mamba1Mixer:
    """Odd widths: channel blocks of 32 with a masked tail, a state size that is not a power of two."""
    config = Mamba1Config(channels, state_size, conv_kernel, dt_rank=5, conv_bias=bias, proj_bias=bias, chunk_size=4)
    mixer = Mamba1Mixer(SimpleNamespace(mamba1=config, hidden_size=24, rms_norm_eps=1e-5))
    _randomise(mixer, seed)
    return mixer


def _kda(heads: int, head_dim: int, seed: int = 0) -> KimiDeltaAttentionMixer:
    config = KdaConfig(num_heads=heads, head_dim=head_dim, conv_kernel=4)
    mixer = KimiDeltaAttentionMixer(SimpleNamespace(kda=config, hidden_size=24, rms_norm_eps=1e-5))
    _randomise(mixer, seed)
    return mixer


def _short_conv(width: int, conv_kernel: int, bias: bool, seed: int = 0) -> ShortConvMixer:
    config = ShortConvConfig(conv_kernel=conv_kernel, bias=bias)
    mixer = ShortConvMixer(SimpleNamespace(short_conv=config, hidden_size=width))
    _randomise(mixer, seed)
    with torch.no_grad():  # the projections' outputs as large at any width as at 24 (B · x is a product of two)
        for projection in (mixer.in_proj, mixer.out_proj):
            projection.weight.mul_((24 / width) ** 0.5)
    return mixer


def _state(mixer: torch.nn.Module, batch: int, seed: int) -> RecurrentState:
    generator = torch.Generator().manual_seed(seed)
    if isinstance(mixer, ShortConvMixer):  # the window alone; the matrix state is empty
        width, taps = mixer.conv1d.weight.shape[0], mixer.conv1d.weight.shape[-1]
        return RecurrentState(torch.randn(batch, width, taps - 1, generator=generator), torch.zeros(batch, 0, 0, 0))
    c = mixer.config
    conv_dim = mixer.conv1d.weight.shape[0]
    if isinstance(mixer, Mamba2Mixer):
        shape = (batch, c.num_heads, c.head_dim, c.state_size)
    elif isinstance(mixer, Mamba1Mixer):
        shape = (batch, c.intermediate_size, c.state_size)
    elif isinstance(mixer, KimiDeltaAttentionMixer):
        shape = (batch, c.num_heads, c.head_dim, c.head_dim)
    else:
        shape = (batch, c.num_value_heads, c.key_head_dim, c.value_head_dim)
    conv = torch.randn(batch, conv_dim, c.conv_kernel - 1, generator=generator)
    return RecurrentState(conv, torch.randn(shape, generator=generator))


def _copy(state: RecurrentState) -> RecurrentState:
    return RecurrentState(state.conv.clone(), state.ssm.clone())


MIXERS = {
    "mamba2 g1": lambda: _mamba(heads=4, groups=1, norm_groups=1),
    "mamba2 g2, norm groups 2": lambda: _mamba(heads=4, groups=2, norm_groups=2, seed=1),
    "mamba2 g2, n 12 (masked)": lambda: _mamba(heads=6, groups=2, norm_groups=1, state_size=12, seed=2),
    "gdn h_v = h_k": lambda: _gdn(key_heads=2, value_heads=2),
    "gdn h_v = 2 h_k": lambda: _gdn(key_heads=2, value_heads=4, seed=1),
    "gdn beta · 2 (OLMo-Hybrid)": lambda: _gdn(key_heads=2, value_heads=4, seed=2, beta_scale=2.0),
    "mamba1 i 40, n 12, W 4, biases": lambda: _mamba1(40, 12, 4, bias=True),
    "mamba1 i 72, n 16, W 3": lambda: _mamba1(72, 16, 3, bias=False, seed=1),
    "kda h 3, d 12": lambda: _kda(heads=3, head_dim=12),
    "kda h 2, d 40 (two value blocks)": lambda: _kda(heads=2, head_dim=40, seed=1),
    "short conv d 24, W 3": lambda: _short_conv(24, 3, bias=False),
    "short conv d 300, W 4, biases (two blocks)": lambda: _short_conv(300, 4, bias=True, seed=1),
}


def _width(mixer: torch.nn.Module) -> int:
    return mixer.in_proj.in_features


def _moved(new: RecurrentState, old: RecurrentState) -> float:
    """How far a state moved (the window for a short conv, whose matrix state is empty)."""
    return float((new.ssm - old.ssm).abs().max() if old.ssm.numel() else (new.conv - old.conv).abs().max())


@pytest.mark.parametrize("name", list(MIXERS))
def test_decode_steps_equal_the_torch_path(name):
    mixer, batch = MIXERS[name](), 3
    state = _state(mixer, batch, seed=5)
    reference_state, triton_state = _copy(state), _copy(state)
    hidden = torch.randn(batch, 4, 1, _width(mixer), generator=torch.Generator().manual_seed(6))
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
    assert _moved(triton_state, state) > 0.1  # the state really moved


@pytest.mark.parametrize("name", list(MIXERS))
def test_state_shift_after_partial_acceptance_equals_the_torch_path(name):
    mixer, length = MIXERS[name](), 4
    accepted = torch.tensor([1, 3, 4, 2, 1])  # several counts per batch, incl. none and all of the drafts
    state = _state(mixer, len(accepted), seed=7)
    hidden = torch.randn(len(accepted), length, _width(mixer), generator=torch.Generator().manual_seed(8))
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


@pytest.mark.parametrize("gated", [True, False])
def test_triton_grouped_experts_give_zeros_for_another_ranks_experts(gated):
    """Expert parallel's static form: a pair whose id is E (another rank's expert) gets zeros and no GEMM rows; the
    other pairs are what the eager experts give with those slots skipped (id -1)."""
    from workers.model.kernels.triton_kernels import moe as triton_moe
    from workers.model.layers import moe
    from workers.model.layers.feed_forward import activate

    g = torch.Generator().manual_seed(5)
    experts, width, inter, tokens, k = 3, 40, 24, 19, 2
    up = torch.randn(experts, inter * (2 if gated else 1), width, generator=g) * 0.3
    down = torch.randn(experts, width, inter, generator=g) * 0.3
    x = torch.randn(tokens, width, generator=g)
    ids = torch.randint(0, experts + 1, (tokens, k), generator=g)  # experts (the sentinel): another rank's
    assert bool((ids == experts).any()) and bool((ids < experts).any())
    got = triton_moe.expert_rows(x, ids, up, down, gated, activate)
    skipped = torch.where(ids == experts, -1, ids)
    torch.testing.assert_close(got, moe._rows_eager(x, skipped, up, down, gated), **TOL)
    assert not bool(got.view(tokens, k, width)[ids == experts].any())


@pytest.mark.parametrize("family", ["lfm2", "jamba_dense", "kimi_linear_dense", "olmo_hybrid"])
@torch.inference_mode()
def test_graph_steps_through_the_triton_kernels_equal_the_torch_module_path(checkpoint_dir, family):
    """Whole models: the graph plan's decode, verification and keep steps with decode_kernel='triton' (short conv,
    Mamba1, KDA, OLMo's Gated DeltaNet with beta · 2 through Triton; the loader chose it for every recurrent mixer)
    against the torch module path of the same checkpoint."""
    from tests.workers.model.test_cuda_graph import TOLERANCE, compare_graph_steps
    from workers.model import load_checkpoint

    path = str(checkpoint_dir(family))
    triton_model = load_checkpoint(path, decode_kernel="triton", linear_backend="torch").model
    torch_model = load_checkpoint(path, decode_kernel="torch", linear_backend="torch").model
    kernels = {module.decode_kernel for module in triton_model.modules() if hasattr(module, "decode_kernel")}
    assert "triton" in kernels and "torch" not in kernels, kernels
    compare_graph_steps(triton_model, torch_model, TOLERANCE.get(family, 1e-5))


@pytest.mark.parametrize("name", ["mamba1 i 40, n 12, W 4, biases", "kda h 3, d 12", "short conv d 24, W 3"])
def test_bfloat16_decode_steps_stay_within_rounding_of_the_torch_path(name):
    """The dtype GPUs serve: bfloat16 weights, activations and conv windows (A_log, D, dt_bias and the recurrent
    states in float32, as the loader keeps them) — the kernels' loads, stores and conversions; the torch step rounds
    its intermediates to bfloat16 where the kernels keep float32, hence the bfloat16-sized tolerance."""
    from workers.model.loader import FLOAT32_SUFFIXES

    mixer, batch = MIXERS[name]().to(torch.bfloat16), 3
    for parameter_name, parameter in mixer.named_parameters():
        if parameter_name.endswith(tuple(suffix.lstrip(".") for suffix in FLOAT32_SUFFIXES)):
            parameter.data = parameter.data.float()
    state = _state(mixer, batch, seed=5)
    state = RecurrentState(state.conv.to(torch.bfloat16), state.ssm)
    reference_state, triton_state = _copy(state), _copy(state)
    hidden = torch.randn(batch, 3, 1, _width(mixer), generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    ones = torch.ones(batch, dtype=torch.long)
    for step in range(3):
        mixer.decode_kernel = "torch"
        reference, _, _ = mixer(hidden[:, step], reference_state, ones, in_place=True)
        mixer.decode_kernel = "triton"
        out, _, _ = mixer(hidden[:, step], triton_state, ones, in_place=True)
        assert out.dtype == torch.bfloat16 and triton_state.conv.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), reference.float(), atol=5e-2, rtol=5e-2)
        torch.testing.assert_close(triton_state.ssm, reference_state.ssm, atol=5e-2, rtol=5e-2)
        torch.testing.assert_close(triton_state.conv.float(), reference_state.conv.float(), atol=5e-2, rtol=5e-2)
