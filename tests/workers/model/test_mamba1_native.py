"""The native Mamba1 (Jamba) kernels (`csrc/mamba1_decode.c`) against the PyTorch reference, at odd shapes: state
sizes that are not a multiple of the vector width, odd d_inner (a partial channel block), odd dt_rank, conv and
projection biases on and off. The prefill scan against a float64 token-by-token recurrence at lengths around the
reference's chunk, with padding, from a kept state; verification == decode steps and keep == the states they leave,
bit for bit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from workers.model.checkpoint.config import Mamba1Config
from workers.model.kernels import native_mamba1
from workers.model.layers.mamba1 import Mamba1Mixer
from workers.model.state import RecurrentState

HIDDEN = 24
# (d_inner, state size, dt rank, conv taps, conv bias, proj bias): Jamba's (16 states, wide dt rank), and odd ones.
SHAPES = [
    (64, 16, 4, 4, True, False),
    (37, 5, 3, 3, False, True),
    (70, 13, 7, 2, True, True),
    (33, 17, 1, 4, False, False),
]
CHUNK = 16  # the reference scan's chunk (Mamba1Config.chunk_size): lengths around it and past several of them
LENGTHS = [1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]


def _mixers(shape: tuple, seed: int = 0) -> dict[str, Mamba1Mixer]:
    """kernel → a Mamba1 mixer of `shape` with random weights (the same for both), dt near softplus⁻¹(0.2)."""
    channels, size, rank, taps, conv_bias, proj_bias = shape
    config = SimpleNamespace(
        hidden_size=HIDDEN,
        rms_norm_eps=1e-6,
        mamba1=Mamba1Config(channels, size, taps, rank, conv_bias, proj_bias, chunk_size=CHUNK),
    )
    generator = torch.Generator().manual_seed(seed)
    mixers = {}
    for kernel in ("torch", "native"):
        mixer = Mamba1Mixer(config)
        generator.manual_seed(seed)
        with torch.no_grad():
            for name, param in mixer.named_parameters():
                value = torch.randn(param.shape, generator=generator) * 0.3
                if name.endswith("layernorm.weight"):
                    value = 1 + value
                elif name == "A_log":
                    value = torch.rand(param.shape, generator=generator) * 2
                elif name == "dt_proj.bias":
                    value = value - 1.5
                param.copy_(value)
        mixer.decode_kernel = kernel
        mixers[kernel] = mixer
    return mixers


def _state(mixer: Mamba1Mixer, batch: int, seed: int) -> RecurrentState:
    m, generator = mixer.config, torch.Generator().manual_seed(seed)
    return RecurrentState(
        torch.randn(batch, m.intermediate_size, m.conv_kernel - 1, generator=generator),
        torch.randn(batch, m.intermediate_size, m.state_size, generator=generator) * 0.5,
    )


def _copy(state: RecurrentState) -> RecurrentState:
    return RecurrentState(state.conv.clone(), state.ssm.clone())


def _reference_scan(x, dt, A, B, C, state, num_tokens):
    """The recurrence token by token in float64 over each row's valid tokens → (y [b, l, i], final state)."""
    x, dt, A, B, C, state = (t.double() for t in (x, dt, A, B, C, state))
    ys = torch.zeros(x.shape, dtype=torch.float64)
    for r in range(x.shape[0]):
        for t in range(int(num_tokens[r])):
            state[r] = torch.exp(A * dt[r, t, :, None]) * state[r] + (dt[r, t] * x[r, t])[:, None] * B[r, t]
            ys[r, t] = state[r] @ C[r, t]
    return ys, state


@pytest.mark.parametrize("from_state", [False, True], ids=["zero", "kept"])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("shape", SHAPES[:2], ids=["jamba", "odd"])
def test_prefill_scan_equals_the_token_by_token_recurrence(shape, length, from_state):
    channels, size, rank = shape[:3]
    g = torch.Generator().manual_seed(length)
    b = 4
    num_tokens = torch.tensor([length, (length + 1) // 2, 0, max(length - 3, 1)])  # ragged, one row empty
    proj = torch.randn(b, length, 2 * channels, generator=g)
    xc = torch.randn(b, length, channels, generator=g)
    xdbc = torch.randn(b, length, rank + 2 * size, generator=g)
    dt_raw = torch.randn(b, length, channels, generator=g) - 1.5
    A = -torch.exp(torch.rand(channels, size, generator=g) * 2)
    D = torch.randn(channels, generator=g)
    start = torch.randn(b, channels, size, generator=g) if from_state else None
    y, final, dt = native_mamba1.prefill_scan(proj, num_tokens, xc, xdbc, dt_raw, A, D, start)
    valid = (torch.arange(length)[None, :] < num_tokens[:, None])[..., None]
    torch.testing.assert_close(dt, torch.nn.functional.softplus(dt_raw) * valid)
    B, C = xdbc[..., rank : rank + size], xdbc[..., rank + size :]
    zero = torch.zeros(b, channels, size)
    ys, expected_final = _reference_scan(xc, dt, A, B, C, zero if start is None else start, num_tokens)
    z = proj[..., channels:].double()
    expected = (ys + D.double() * xc.double()) * z * torch.sigmoid(z) * valid
    torch.testing.assert_close(y.double(), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final.double(), expected_final, rtol=1e-4, atol=1e-5)
    assert torch.equal(final[2], zero[2] if start is None else start[2])  # a row without tokens keeps its state


@pytest.mark.parametrize("from_state", [False, True], ids=["zero", "kept"])
@pytest.mark.parametrize("shape", SHAPES)
def test_native_mixer_prefill_equals_the_torch_mixer(shape, from_state):
    mixers = _mixers(shape)
    b, length = 3, 2 * CHUNK + 3
    num_tokens = torch.tensor([length, 9, 1])
    hidden = torch.randn(b, length, HIDDEN, generator=torch.Generator().manual_seed(5))
    start = _state(mixers["torch"], b, seed=6) if from_state else None
    with torch.no_grad():
        results = {k: m(hidden, None if start is None else _copy(start), num_tokens) for k, m in mixers.items()}
    valid = (torch.arange(length)[None, :] < num_tokens[:, None])[..., None]
    (out, state, scan), (ref_out, ref_state, ref_scan) = results["native"], results["torch"]
    torch.testing.assert_close(out * valid, ref_out * valid, rtol=1e-4, atol=1e-5)
    assert torch.equal(state.conv, ref_state.conv)  # the conv window is a copy of inputs
    torch.testing.assert_close(state.ssm, ref_state.ssm, rtol=1e-4, atol=1e-5)
    assert (scan is None) == (start is None)
    if start is not None:  # the state after a prefix of each row, as speculative shifting asks for it
        counts = torch.tensor([5, 3, 1])
        after = mixers["native"].state_after(_copy(start), scan, counts)
        expected = mixers["torch"].state_after(_copy(start), ref_scan, counts)
        assert torch.equal(after.conv, expected.conv)
        torch.testing.assert_close(after.ssm, expected.ssm, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
def test_native_decode_steps_equal_the_torch_steps(shape):
    mixers = _mixers(shape)
    b = 5
    states = {k: _state(mixers["torch"], b, seed=1) for k in mixers}
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for step in range(6):
            hidden = torch.randn(b, 1, HIDDEN, generator=g)
            outs = {k: m(hidden, states[k], torch.ones(b, dtype=torch.int64), in_place=True) for k, m in mixers.items()}
            assert outs["native"][1] is states["native"]  # updated in place
            torch.testing.assert_close(outs["native"][0], outs["torch"][0], rtol=1e-4, atol=1e-5, msg=f"step {step}")
            assert torch.equal(states["native"].conv, states["torch"].conv)
            torch.testing.assert_close(states["native"].ssm, states["torch"].ssm, rtol=1e-4, atol=1e-5)


def _step_inputs(mixer: Mamba1Mixer, b: int, length: int, seed: int) -> torch.Tensor:
    """Random token-major in_proj outputs [l, b, 2i], for kernel-level checks."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(length, b, 2 * mixer.config.intermediate_size, generator=g)


def _inner(mixer: Mamba1Mixer, xc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return mixer._native_inner(xc)


@pytest.mark.parametrize("shape", SHAPES)
def test_verification_equals_decode_steps_and_keep_their_states_bit_for_bit(shape):
    mixer = _mixers(shape)["native"]
    b, length = 4, 5
    weight, bias, A, D = mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, mixer.native_A(), mixer.D.detach()
    proj = _step_inputs(mixer, b, length, seed=3)
    start = _state(mixer, b, seed=4)
    # The reference: l decode steps (conv, x_proj, norms, dt_proj, scan), with every state along the way.
    stepped, outputs, snapshots, kept_xdbc, kept_dt = _copy(start), [], [_copy(start)], [], []
    for t in range(length):
        xc = native_mamba1.conv(proj[t].contiguous(), stepped.conv, weight, bias, advance=True)
        xdbc, dt_raw = _inner(mixer, xc)
        kept_xdbc.append(xdbc)
        kept_dt.append(dt_raw)
        outputs.append(native_mamba1.ssm(proj[t].contiguous(), xc, xdbc, dt_raw, A, D, stepped.ssm, in_place=True))
        snapshots.append(_copy(stepped))
    # The verification: all l tokens at once, the states read and left as they were.
    verified = _copy(start)
    xc = native_mamba1.conv(proj, verified.conv, weight, bias, advance=False)
    xdbc, dt_raw = _inner(mixer, xc)
    y = native_mamba1.ssm(proj, xc, xdbc, dt_raw, A, D, verified.ssm, in_place=False)
    for t in range(length):
        assert torch.equal(y[t], outputs[t]), f"token {t}"
        assert torch.equal(xdbc[t], kept_xdbc[t]) and torch.equal(dt_raw[t], kept_dt[t])
    assert torch.equal(verified.conv, start.conv) and torch.equal(verified.ssm, start.ssm)
    accepted = torch.tensor([1, 5, 3, 2])
    native_mamba1.keep((proj, xdbc, dt_raw), verified.conv, weight, bias, A, verified.ssm, accepted)
    for row, n in enumerate(accepted.tolist()):
        assert torch.equal(verified.conv[row], snapshots[n].conv[row]), f"conv window of row {row}"
        assert torch.equal(verified.ssm[row], snapshots[n].ssm[row]), f"SSM state of row {row}"
    with pytest.raises(ValueError, match="accepted counts must be 1"):
        native_mamba1.keep((proj, xdbc, dt_raw), verified.conv, weight, bias, A, verified.ssm, accepted * 0)


@pytest.mark.parametrize("shape", SHAPES[:2], ids=["jamba", "odd"])
def test_prefill_in_two_chunks_equals_one(shape):
    """A prompt split in two forwards (the second from the first's state) gives the one-forward result."""
    mixer = _mixers(shape)["native"]
    b, length = 2, 3 * CHUNK + 5
    hidden = torch.randn(b, length, HIDDEN, generator=torch.Generator().manual_seed(7))
    full = torch.full((b,), length)
    with torch.no_grad():
        out, state, _ = mixer(hidden, None, full)
        first, middle, _ = mixer(hidden[:, :CHUNK], None, torch.full((b,), CHUNK))
        second, end, _ = mixer(hidden[:, CHUNK:], middle, torch.full((b,), length - CHUNK))
    torch.testing.assert_close(torch.cat([first, second], dim=1), out, rtol=0, atol=0)
    assert torch.equal(end.conv, state.conv) and torch.equal(end.ssm, state.ssm)


@pytest.mark.parametrize("shape", SHAPES[1:2], ids=["odd"])
def test_bad_inputs_are_refused_before_the_call(shape):
    mixer = _mixers(shape)["native"]
    channels = mixer.config.intermediate_size
    proj = torch.randn(2, 3, 2 * channels)
    weight = mixer.conv1d.weight.squeeze(1)
    with pytest.raises(ValueError, match="num_tokens must be within"):
        native_mamba1.prefill_conv(proj, torch.tensor([4, 1]), weight, None, None)
    with pytest.raises(ValueError, match="contiguous int64"):
        native_mamba1.prefill_conv(proj, torch.tensor([3, 1], dtype=torch.int32), weight, None, None)
    with pytest.raises(ValueError, match="shape mismatch"):
        native_mamba1.prefill_conv(proj[..., :-1], torch.tensor([3, 1]), weight, None, None)
    with pytest.raises(ValueError, match="contiguous float32"):
        native_mamba1.prefill_conv(proj.double(), torch.tensor([3, 1]), weight, None, None)
