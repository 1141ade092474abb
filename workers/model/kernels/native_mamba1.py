"""Python entry points of the native Mamba1 (Jamba) kernels (csrc/mamba1_decode.c): argument checks, output
allocation, one ctypes call each. The four linears of the mixer stay linears (the caller runs them between these
calls); `kernels/selective_scan.py` and `layers/mamba1.py`'s torch path are the reference.

Glossary: b rows, l tokens per row, I channels (d_inner), R dt rank, N state size, W conv taps. Every tensor is
float32, contiguous, on CPU (`native.pointer` refuses anything else).
"""

from __future__ import annotations

import torch

from workers.model.kernels import native


def _check_counts(num_tokens: torch.Tensor, b: int, length: int) -> None:
    if not (num_tokens.dtype == torch.int64 and num_tokens.is_contiguous() and tuple(num_tokens.shape) == (b,)):
        raise ValueError("num_tokens must be a contiguous int64 tensor with one entry per row")
    if b and (int(num_tokens.max()) > length or int(num_tokens.min()) < 0):
        raise ValueError(f"num_tokens must be within 0 … {length}")


def conv(
    proj: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    advance: bool,
) -> torch.Tensor:
    """The causal conv + SiLU over x of proj [l, b, 2I] (token-major; [b, 2I] is one token) continuing the windows
    conv_state [b, I, W-1] → xc of proj's leading shape with I channels. `advance`: the windows take the tokens in
    (a decode step); else they are left as they are (a verification)."""
    rows = proj.reshape(-1, proj.shape[-1])
    b, channels, taps = conv_state.shape[0], conv_weight.shape[0], conv_weight.shape[1]
    if proj.shape[-1] != 2 * channels or rows.shape[0] % max(b, 1) or conv_state.shape[1:] != (channels, taps - 1):
        raise ValueError(f"shape mismatch: proj {tuple(proj.shape)}, conv_state {tuple(conv_state.shape)}")
    length = rows.shape[0] // max(b, 1)
    xc = torch.empty(*proj.shape[:-1], channels)
    native.load().mamba1_conv(
        native.pointer(proj),
        native.pointer(conv_state),
        native.pointer(conv_weight),
        native.pointer(conv_bias),
        native.pointer(xc),
        b,
        length,
        channels,
        taps,
        int(advance),
        torch.get_num_threads(),
    )
    return xc


def norms(xdbc: torch.Tensor, dt_weight: torch.Tensor, b_weight: torch.Tensor, c_weight: torch.Tensor, eps: float):
    """Jamba's inner RMS norms over x_proj's output [..., R + 2N]: B and C normed in place; returns the normed dt
    slice [..., R] (contiguous: dt_proj's input)."""
    rank, size = dt_weight.shape[0], b_weight.shape[0]
    if xdbc.shape[-1] != rank + 2 * size or c_weight.shape[0] != size:
        raise ValueError(f"shape mismatch: x_proj output {tuple(xdbc.shape)}, dt rank {rank}, state size {size}")
    dt_in = torch.empty(*xdbc.shape[:-1], rank)
    native.load().mamba1_norms(
        native.pointer(xdbc),
        native.pointer(dt_weight),
        native.pointer(b_weight),
        native.pointer(c_weight),
        eps,
        native.pointer(dt_in),
        xdbc.numel() // xdbc.shape[-1],
        rank,
        size,
        torch.get_num_threads(),
    )
    return dt_in


def ssm(
    proj: torch.Tensor,
    xc: torch.Tensor,
    xdbc: torch.Tensor,
    dt_raw: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    ssm_state: torch.Tensor,
    in_place: bool,
) -> torch.Tensor:
    """The gated selective scan of l tokens per row, token-major: proj [l, b, 2I] (z), xc [l, b, I], xdbc [l, b, R + 2N]
    (normed B, C), dt_raw [l, b, I] (dt_proj output) from ssm_state [b, I, N] → y [l, b, I], the out_proj input
    ([b, ·] inputs: one token). `in_place` (one token): the states advance; else they are left as they are and y is
    what l decode steps would give."""
    b, channels, size = ssm_state.shape
    length = xc.numel() // max(b * channels, 1)
    rank = xdbc.shape[-1] - 2 * size
    if (
        xc.shape[-1] != channels
        or proj.numel() != 2 * xc.numel()
        or dt_raw.shape != xc.shape
        or xdbc.numel() != length * b * (rank + 2 * size)
        or tuple(A.shape) != (channels, size)
        or (in_place and length != 1)
    ):
        raise ValueError(
            f"shape mismatch: xc {tuple(xc.shape)}, xdbc {tuple(xdbc.shape)}, state {tuple(ssm_state.shape)}"
        )
    y = torch.empty(xc.shape)
    native.load().mamba1_ssm(
        native.pointer(proj),
        native.pointer(xc),
        native.pointer(xdbc),
        native.pointer(dt_raw),
        native.pointer(A),
        native.pointer(D),
        native.pointer(ssm_state),
        native.pointer(y),
        b,
        length,
        channels,
        rank,
        size,
        int(in_place),
        torch.get_num_threads(),
    )
    return y


def keep(
    kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    A: torch.Tensor,
    ssm_state: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
) -> None:
    """After a verification of l tokens per row: advance conv_state [b, I, W-1] and ssm_state [b, I, N] in place by
    each row's first num_accepted_tokens[r] (1 … l) tokens of the verification's kept (proj [l, b, 2I], normed xdbc
    [l, b, R + 2N], dt_raw [l, b, I]) — bit for bit the states that many decode steps leave."""
    proj, xdbc, dt_raw = kept
    length, b, width = proj.shape
    channels, size = ssm_state.shape[1], ssm_state.shape[2]
    if width != 2 * channels or dt_raw.shape != (length, b, channels) or xdbc.shape[:2] != (length, b):
        raise ValueError(f"shape mismatch: proj {tuple(proj.shape)}, dt {tuple(dt_raw.shape)}")
    _check_counts(num_accepted_tokens, b, length)
    if b and int(num_accepted_tokens.min()) < 1:
        raise ValueError(f"accepted counts must be 1 … {length}")
    xc = torch.empty(length, b, channels)
    native.load().mamba1_keep(
        native.pointer(proj),
        native.pointer(conv_state),
        native.pointer(conv_weight),
        native.pointer(conv_bias),
        native.pointer(xdbc),
        native.pointer(dt_raw),
        native.pointer(A),
        native.pointer(ssm_state),
        native.pointer(xc),
        num_accepted_tokens.data_ptr(),
        b,
        length,
        channels,
        xdbc.shape[-1] - 2 * size,
        size,
        conv_weight.shape[1],
        torch.get_num_threads(),
    )


def prefill_conv(
    proj: torch.Tensor,
    num_tokens: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    initial_conv: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt's conv + SiLU: proj [b, l, 2I] (right-padded, num_tokens [b] int64 valid tokens per row) continuing
    initial_conv [b, I, W-1] (None: zeros) → (xc [b, l, I], 0 at padding; the windows after each row's last valid
    token [b, I, W-1])."""
    b, length, width = proj.shape
    channels, taps = conv_weight.shape
    if width != 2 * channels or (initial_conv is not None and initial_conv.shape != (b, channels, taps - 1)):
        raise ValueError(f"shape mismatch: proj {tuple(proj.shape)}, conv weight {tuple(conv_weight.shape)}")
    _check_counts(num_tokens, b, length)
    xc, conv_state = torch.empty(b, length, channels), torch.empty(b, channels, taps - 1)
    native.load().mamba1_prefill_conv(
        native.pointer(proj),
        num_tokens.data_ptr(),
        native.pointer(conv_weight),
        native.pointer(conv_bias),
        native.pointer(initial_conv),
        native.pointer(conv_state),
        native.pointer(xc),
        b,
        length,
        channels,
        taps,
        torch.get_num_threads(),
    )
    return xc, conv_state


def prefill_scan(
    proj: torch.Tensor,
    num_tokens: torch.Tensor,
    xc: torch.Tensor,
    xdbc: torch.Tensor,
    dt_raw: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    initial_ssm: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prompt's gated selective scan, batch-major: proj [b, l, 2I] (z), xc, dt_raw [b, l, I], xdbc [b, l, R + 2N]
    (normed) from initial_ssm [b, I, N] (None: zeros) → (y [b, l, I] the out_proj input, 0 at padding; the states
    after each row's last valid token [b, I, N]; dt after softplus [b, l, I], 0 at padding)."""
    b, length, channels = xc.shape
    size = A.shape[1]
    rank = xdbc.shape[-1] - 2 * size
    if proj.shape != (b, length, 2 * channels) or dt_raw.shape != xc.shape or xdbc.shape[:2] != (b, length):
        raise ValueError(f"shape mismatch: proj {tuple(proj.shape)}, xc {tuple(xc.shape)}, xdbc {tuple(xdbc.shape)}")
    if initial_ssm is not None and initial_ssm.shape != (b, channels, size):
        raise ValueError(f"shape mismatch: initial state {tuple(initial_ssm.shape)}")
    _check_counts(num_tokens, b, length)
    y, dt = torch.empty(b, length, channels), torch.empty(b, length, channels)
    ssm_state = torch.empty(b, channels, size)
    native.load().mamba1_prefill_scan(
        native.pointer(proj),
        num_tokens.data_ptr(),
        native.pointer(xc),
        native.pointer(xdbc),
        native.pointer(dt_raw),
        native.pointer(A),
        native.pointer(D),
        native.pointer(initial_ssm),
        native.pointer(ssm_state),
        native.pointer(dt),
        native.pointer(y),
        b,
        length,
        channels,
        rank,
        size,
        torch.get_num_threads(),
    )
    return y, ssm_state, dt


def state_after(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    A: torch.Tensor,
    ssm_state: torch.Tensor,
    num_tokens: torch.Tensor,
) -> torch.Tensor:
    """ssm_state [b, I, N] advanced by each row's first num_tokens[r] tokens of a forward's scan inputs (x, dt after
    softplus [b, l, I]; B [b, l, N]) → a new tensor, with the decode step's arithmetic (speculative state shifting)."""
    b, length, channels = x.shape
    size = A.shape[1]
    if dt.shape != x.shape or B.shape != (b, length, size) or ssm_state.shape != (b, channels, size):
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, B {tuple(B.shape)}, state {tuple(ssm_state.shape)}")
    _check_counts(num_tokens, b, length)
    state = ssm_state.clone(memory_format=torch.contiguous_format)
    x, dt, B = x.contiguous(), dt.contiguous(), B.contiguous()  # held here until the call returns
    native.load().mamba1_state_after(
        native.pointer(x),
        native.pointer(dt),
        native.pointer(B),
        native.pointer(A),
        native.pointer(state),
        num_tokens.data_ptr(),
        b,
        length,
        channels,
        size,
        torch.get_num_threads(),
    )
    return state
