"""The C signature of every kernel the native library exports, as ctypes types: (return type, argument types).

`native.load` binds each of them once (a library lacking one is refused as stale or foreign). Pointers are
`void *` (tensors' data pointers), integers int64, thread counts C ints.
"""

from __future__ import annotations

import ctypes

P, I64, F32, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int

SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "flush_denormals_on_threads": (None, [INT]),
    "rms_norm": (None, [P, P, F32, P, I64, I64, INT]),
    "add_rms_norm": (None, [P, P, F32, P, F32, P, I64, I64, INT]),
    "silu_mul": (None, [P, P, I64, I64, INT]),
    "sigmoid_mul": (None, [P, P, P, I64, I64, INT]),
    "gelu_mul": (None, [P, P, I64, I64, INT]),
    "add_rows": (None, [P, P, P, I64, INT]),
    "argmax_rows": (None, [P, P, I64, I64, INT]),
    "logprobs_rows": (None, [P, P, I64, I64, I64, P, P, P, INT]),
    "mamba2_prefill": (None, [P] * 7 + [F32, F32, P, I64, F32] + [P] * 6 + [I64] * 7 + [INT]),
    "rope_rows": (None, [P, P, P] + [I64] * 4),
    "attention_decode": (None, [P] * 6 + [I64] * 3 + [P, P, F32, P] + [I64] * 4 + [INT]),
    "linear_panel_width": (I64, []),
    "kernel_isa": (ctypes.c_char_p, []),
    "linear_panels": (None, [P, P, P, P, I64, I64, I64, INT]),
    "linear_panels_int8": (None, [P, P, P, P, P, I64, I64, I64, INT]),
    "linear_panels_bf16": (None, [P, P, P, P, I64, I64, I64, INT, INT]),
    "linear_bf16_path_available": (INT, [INT]),
    "linear_bf16_k_align": (I64, []),
    "linear_panels_w8a8": (None, [P] * 6 + [I64] * 4 + [INT, INT]),
    "linear_w8a8_paths": (I64, []),
    "rescore_top_logits": (None, [P] * 4 + [I64] * 4 + [INT]),
    "decode_plan_record_words": (I64, []),
    "decode_plan_run": (I64, [P, I64, INT]),
    "decode_plan_shift": (I64, [P, I64, P, INT]),
    "gdn_decode_step": (None, [P] * 5 + [F32, P, P, F32, P, P] + [I64] * 6 + [INT]),
    "gdn_prefill": (None, [P, P, P, P, P, F32, P, F32] + [P] * 6 + [I64] * 7 + [INT]),
    "kda_decode_step": (None, [P] * 9 + [F32, P, P] + [I64] * 4 + [INT]),
    "kda_prefill": (None, [P] * 8 + [F32] + [P] * 6 + [I64] * 5 + [INT]),
    "kda_verify": (None, [P] * 9 + [F32, P, P] + [I64] * 5 + [INT]),
    "kda_keep": (None, [P] * 9 + [I64] * 5 + [INT]),
    "mla_attention": (None, [P, P, P, F32, P, P, I64, I64, P, P, P, F32, P] + [I64] * 7 + [INT]),
    "mamba2_decode_step": (None, [P] * 7 + [F32, F32, P, P, I64, F32, P, P] + [I64] * 6 + [INT]),
    "mamba1_conv": (None, [P] * 5 + [I64] * 5 + [INT]),
    "mamba1_norms": (None, [P] * 4 + [F32, P] + [I64] * 3 + [INT]),
    "mamba1_ssm": (None, [P] * 8 + [I64] * 6 + [INT]),
    "mamba1_keep": (None, [P] * 10 + [I64] * 6 + [INT]),
    "mamba1_prefill_conv": (None, [P] * 7 + [I64] * 4 + [INT]),
    "mamba1_prefill_scan": (None, [P] * 11 + [I64] * 5 + [INT]),
    "mamba1_state_after": (None, [P] * 6 + [I64] * 4 + [INT]),
    "moe_route": (I64, [P, P, P] + [I64] * 7 + [P, F32, F32]),
    "moe_experts": (I64, [P, P, P, P] + [I64] * 8 + [P, P, I64, P, P, I64, INT]),
    "moe_combine": (None, [P, P, P, P, I64, I64]),
    "short_conv_step": (None, [P] * 6 + [I64] * 3 + [INT]),
    "short_conv_prefill": (None, [P] * 8 + [I64] * 4 + [INT]),
    "attention_verify_window": (None, [P] * 6 + [I64] * 3 + [P, P, F32, P] + [I64] * 6 + [INT]),
}
