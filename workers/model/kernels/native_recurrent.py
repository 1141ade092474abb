"""Python entry points of the native recurrent decode and prefill kernels (csrc/mamba_decode.c, csrc/gdn_decode.c):
argument checks, output allocation, one ctypes call each. The PyTorch paths in layers/mamba2.py and
layers/gdn.py are the reference."""

from __future__ import annotations

import torch

from workers.model.kernels import native


def mamba2_decode_step(
    proj: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor,
    dt_limits: tuple[float, float],
    ssm_state: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_groups: int,
    eps: float,
    num_groups: int,
    conv_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row through a Mamba2 mixer's conv, SSM and gated norm; states are updated in place.

    proj [b, I + conv_dim + H] (in_proj output); conv_state [b, conv_dim, W-1]; conv_weight [conv_dim, W];
    ssm_state [b, H, P, N]. Returns the out_proj input [b, I]. `conv_out` [b, conv_dim], if given, receives the
    conv output (x | B | C after silu). All float32, contiguous, on CPU.
    """
    lib = native.load()
    b, H, P, N = ssm_state.shape
    width = conv_weight.shape[1]
    if conv_state.shape != (b, conv_weight.shape[0], width - 1) or proj.shape != (b, H * P + conv_weight.shape[0] + H):
        raise ValueError(
            f"shape mismatch: proj {tuple(proj.shape)}, conv_state {tuple(conv_state.shape)}, "
            f"ssm_state {tuple(ssm_state.shape)}"
        )
    xbc = torch.empty(b, conv_weight.shape[0]) if conv_out is None else conv_out
    out = torch.empty(b, H * P)
    lib.mamba2_decode_step(
        native.pointer(proj),
        native.pointer(conv_state),
        native.pointer(conv_weight),
        native.pointer(conv_bias),
        native.pointer(dt_bias),
        native.pointer(A_log),
        native.pointer(D),
        dt_limits[0],
        dt_limits[1],
        native.pointer(ssm_state),
        native.pointer(norm_weight),
        norm_groups,
        eps,
        native.pointer(xbc),
        native.pointer(out),
        b,
        H,
        P,
        num_groups,
        N,
        width,
        torch.get_num_threads(),
    )
    return out


def gdn_decode_step(
    proj: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    dt_bias: torch.Tensor,
    A_log: torch.Tensor,
    delta_state: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    num_key_heads: int,
    beta_scale: float = 1.0,
) -> torch.Tensor:
    """One token per row through a Gated DeltaNet mixer's conv, delta rule and gated norm; states in place.
    beta = beta_scale · sigmoid(b) (OLMo-Hybrid: 2).

    proj [b, conv_dim + h_v·d_v + 2·h_v] (in_proj output, rows q | k | v | z | b | a); conv_state [b, conv_dim, W-1];
    conv_weight [conv_dim, W]; delta_state [b, h_v, d_k, d_v]. Returns the out_proj input [b, h_v·d_v]. All float32,
    contiguous, on CPU.
    """
    lib = native.load()
    b, num_value_heads, key_head_dim, value_head_dim = delta_state.shape
    conv_dim, width = conv_weight.shape
    value_dim = num_value_heads * value_head_dim
    expected = (b, conv_dim + value_dim + 2 * num_value_heads)
    if (
        conv_dim != 2 * num_key_heads * key_head_dim + value_dim
        or tuple(proj.shape) != expected
        or tuple(conv_state.shape) != (b, conv_dim, width - 1)
    ):
        raise ValueError(
            f"shape mismatch: proj {tuple(proj.shape)}, conv_state {tuple(conv_state.shape)}, "
            f"delta_state {tuple(delta_state.shape)}"
        )
    qkv, out = torch.empty(b, conv_dim), torch.empty(b, value_dim)
    lib.gdn_decode_step(
        native.pointer(proj),
        native.pointer(conv_state),
        native.pointer(conv_weight),
        native.pointer(dt_bias),
        native.pointer(A_log),
        beta_scale,
        native.pointer(delta_state),
        native.pointer(norm_weight),
        eps,
        native.pointer(qkv),
        native.pointer(out),
        b,
        num_key_heads,
        num_value_heads,
        key_head_dim,
        value_head_dim,
        width,
        torch.get_num_threads(),
    )
    return out


def mamba2_prefill(
    proj: torch.Tensor,
    num_tokens: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor,
    dt_limits: tuple[float, float],
    norm_weight: torch.Tensor,
    norm_groups: int,
    eps: float,
    num_heads: int,
    num_groups: int,
    initial: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts (or the next chunk of them) through a Mamba2 mixer's conv, SSM and gated norm, from the zero state
    or from `initial` (conv window [b, conv_dim, W-1], float32 SSM state [b, H, P, N]: a chunked prefill).

    proj [b, l, I + conv_dim + H] (right-padded; num_tokens [b] int64 valid tokens per row). Returns (out [b, l, I],
    conv_state [b, conv_dim, W-1], ssm_state [b, H, P, N], xbc [b, l, conv_dim]): the out_proj input, the states
    after each row's last valid token, and the conv's output after SiLU (x, B, C: the scan's inputs).
    """
    b, length, row_len = proj.shape
    conv_dim, width = conv_weight.shape
    intermediate = row_len - conv_dim - num_heads
    head_dim, state_size = intermediate // num_heads, (conv_dim - intermediate) // (2 * num_groups)
    if not (num_tokens.dtype == torch.int64 and num_tokens.is_contiguous() and num_tokens.shape == (b,)):
        raise ValueError("num_tokens must be a contiguous int64 tensor with one entry per row")
    if int(num_tokens.max()) > length or int(num_tokens.min()) < 0:
        raise ValueError(f"num_tokens must be within 0 … {length}")
    xbc = torch.empty(b, length, conv_dim)
    conv_state, out = torch.empty(b, conv_dim, width - 1), torch.empty(b, length, intermediate)
    ssm_state = torch.empty(b, num_heads, head_dim, state_size)
    initial_conv, initial_ssm = (None, None) if initial is None else (t.contiguous() for t in initial)
    native.load().mamba2_prefill(
        native.pointer(proj),
        num_tokens.data_ptr(),
        native.pointer(conv_weight),
        native.pointer(conv_bias),
        native.pointer(dt_bias),
        native.pointer(A_log),
        native.pointer(D),
        dt_limits[0],
        dt_limits[1],
        native.pointer(norm_weight),
        norm_groups,
        eps,
        native.pointer(xbc),
        native.pointer(initial_conv),
        native.pointer(initial_ssm),
        native.pointer(conv_state),
        native.pointer(ssm_state),
        native.pointer(out),
        b,
        length,
        num_heads,
        head_dim,
        num_groups,
        state_size,
        width,
        torch.get_num_threads(),
    )
    return out, conv_state, ssm_state, xbc


def gdn_prefill(
    proj: torch.Tensor,
    num_tokens: torch.Tensor,
    conv_weight: torch.Tensor,
    dt_bias: torch.Tensor,
    A_log: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    num_key_heads: int,
    num_value_heads: int,
    initial: tuple[torch.Tensor, torch.Tensor] | None = None,
    beta_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts (or the next chunk of them) through a Gated DeltaNet mixer's conv, delta rule and gated norm, from
    the zero state or from `initial` (conv window [b, conv_dim, W-1], delta-rule state [b, h_v, d_k, d_v]);
    beta = beta_scale · sigmoid(b) (OLMo-Hybrid: 2).

    proj [b, l, conv_dim + h_v·d_v + 2·h_v] (in_proj output, rows q | k | v | z | b | a; right-padded, num_tokens
    [b] int64 valid tokens per row). Returns (out [b, l, h_v·d_v], conv_state [b, conv_dim, W-1], delta_state
    [b, h_v, d_k, d_v], qkv [b, l, conv_dim]): the out_proj input (0 at padding), the states after each row's last
    valid token, and the conv output after SiLU with q and k l2-normalised (q scaled by d_k^-0.5).
    """
    b, length, row_len = proj.shape
    conv_dim, width = conv_weight.shape
    value_dim = row_len - conv_dim - 2 * num_value_heads
    value_head_dim = value_dim // num_value_heads
    key_head_dim = (conv_dim - value_dim) // (2 * num_key_heads)
    if conv_dim != 2 * num_key_heads * key_head_dim + value_dim or value_dim != num_value_heads * value_head_dim:
        raise ValueError(f"shape mismatch: proj {tuple(proj.shape)}, conv_weight {tuple(conv_weight.shape)}")
    if not (num_tokens.dtype == torch.int64 and num_tokens.is_contiguous() and num_tokens.shape == (b,)):
        raise ValueError("num_tokens must be a contiguous int64 tensor with one entry per row")
    if b and (int(num_tokens.max()) > length or int(num_tokens.min()) < 0):
        raise ValueError(f"num_tokens must be within 0 … {length}")
    state_shape = (b, num_value_heads, key_head_dim, value_head_dim)
    if initial is not None and (initial[0].shape != (b, conv_dim, width - 1) or initial[1].shape != state_shape):
        raise ValueError(f"shape mismatch: initial conv {tuple(initial[0].shape)}, state {tuple(initial[1].shape)}")
    qkv, out = torch.empty(b, length, conv_dim), torch.empty(b, length, value_dim)
    conv_state, delta_state = torch.empty(b, conv_dim, width - 1), torch.empty(state_shape)
    initial_conv, initial_delta = (None, None) if initial is None else (t.contiguous() for t in initial)
    conv_by_tap = conv_weight.t().contiguous()  # [W, conv_dim]: each tap's weights side by side
    native.load().gdn_prefill(
        native.pointer(proj),
        num_tokens.data_ptr(),
        native.pointer(conv_by_tap),
        native.pointer(dt_bias),
        native.pointer(A_log),
        beta_scale,
        native.pointer(norm_weight),
        eps,
        native.pointer(initial_conv),
        native.pointer(initial_delta),
        native.pointer(qkv),
        native.pointer(conv_state),
        native.pointer(delta_state),
        native.pointer(out),
        b,
        length,
        num_key_heads,
        num_value_heads,
        key_head_dim,
        value_head_dim,
        width,
        torch.get_num_threads(),
    )
    return out, conv_state, delta_state, qkv
