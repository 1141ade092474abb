/* A whole-model decode step as one call: the kernel invocations of one step, recorded once per batch size.
 *
 * Called one by one from Python, the ~70 kernels of a bench-model step spend ~3 ms in the interpreter (argument
 * checks, output allocation, ctypes) against ~14 ms of work at batch 1. decode_plan.py records, per batch size, the
 * same calls with their buffers, weights and state slots as a list of fixed-size records; this walks the list.
 * Every record calls the kernel the module would have called, with the same arguments, so a step's results are
 * bit-for-bit those of the module-by-module path (tests check that). The CPU counterpart of a CUDA graph.
 * A record is 32 words: the op code, 27 integer or pointer arguments, 4 float arguments (as doubles).
 *
 * Speculative verification runs l tokens per row the same way: linears over all of them at once, and each attention,
 * Mamba2, Gated DeltaNet and short-conv layer in one call over the l tokens (the recurrent ones read their states
 * and leave them as they are); decode_plan_shift then advances each row's states by its accepted tokens (the keep
 * kernels), with the arithmetic of the decode steps, so the kept state is bit for bit what plain decode steps would
 * leave.
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"

/* Op codes; decode_plan.py's `Op` has the same values. */
enum {
    OP_EMBED = 1,
    OP_RMS_NORM,
    OP_ADD_RMS_NORM,
    OP_LINEAR,
    OP_SILU_MUL,
    OP_MAMBA2,
    OP_ATTENTION,
    OP_RELU_SQUARE,
    OP_ROPE,
    OP_COPY,
    OP_MAMBA2_SHIFT,
    OP_GDN,
    OP_GDN_SHIFT,
    OP_COPY_ROWS,
    OP_SIGMOID_MUL,
    OP_ARGMAX_FEED = 16, /* the draft chain's (draft_chain.py) */
    OP_ATTENTION_PADDED = 18,
    OP_ARGMAX = 19,
    OP_MAMBA2_VERIFY = 20,
    OP_GDN_VERIFY = 21,
    OP_ATTENTION_VERIFY = 22,
    OP_LINEAR_INT8 = 23,
    OP_LINEAR_BF16 = 24,
    OP_LINEAR_W8A8 = 40,
    OP_MOE_ROUTE = 41,
    OP_MOE_EXPERTS = 42,
    OP_MOE_COMBINE = 43,
    OP_MAMBA1_CONV = 50, /* Mamba1 (Jamba): mamba1_decode.c, recorded by steps/mamba1_records.py */
    OP_MAMBA1_NORMS = 51,
    OP_MAMBA1_SSM = 52,
    OP_MAMBA1_SHIFT = 53,
    OP_ADD = 80, /* Zamba2's shared blocks (shared_block.c) */
    OP_GELU_MUL = 81,
    OP_SHORT_CONV = 70, /* LFM2's gated short conv (short_conv.c) */
    OP_SHORT_CONV_VERIFY = 71,
    OP_SHORT_CONV_SHIFT = 72,
    OP_REPEAT_HEADS = 73, /* LFM3's per-head output gate, repeated over each head's channels */
    OP_KDA = 57, /* Kimi Delta Attention (kda_decode.c) */
    OP_KDA_VERIFY = 58,
    OP_KDA_SHIFT = 59,
    OP_MLA = 64, /* latent attention (mla_attention.c) */
};

typedef struct {
    int64_t code;
    int64_t a[27];
    double f[4];
} plan_op;

_Static_assert(sizeof(plan_op) == 32 * sizeof(int64_t), "a plan record is 32 words");

#define F32(i) ((float *)op->a[i])
#define I64(i) ((int64_t *)op->a[i])

int64_t decode_plan_record_words(void) { return sizeof(plan_op) / sizeof(int64_t); }

/* out[r] = table[ids[r]] · multiplier; fails on an id outside [0, vocab). */
static int embed(const int64_t *ids, const float *table, float *out, int64_t rows, int64_t d, int64_t vocab,
                 float multiplier) {
    for (int64_t r = 0; r < rows; ++r) {
        if (ids[r] < 0 || ids[r] >= vocab) return 1;
        const float *row = table + ids[r] * d;
        if (multiplier == 1.0f) {
            memcpy(out + r * d, row, d * sizeof(float));
        } else {
            for (int64_t i = 0; i < d; ++i) out[r * d + i] = row[i] * multiplier;
        }
    }
    return 0;
}

/* Index of the largest row[i] / divisor in float32, as torch.argmax(logits / divisor): the first one on ties (a
 * division can round distinct logits to equal values), NaN counts as largest (the first NaN wins). */
static int64_t argmax_divided(const float *row, int64_t n, float divisor) {
    int64_t index = 0;
    float best = row[0] / divisor;
    for (int64_t i = 1; i < n && best == best; ++i) {
        const float value = row[i] / divisor;
        if (value != value || value > best) {
            best = value;
            index = i;
        }
    }
    return index;
}

/* A greedy draft step's choice: per row r the argmax of logits row r (/ divisor), written as the next step's token
 * id and into the drafts column; the rows' positions (when given) advance by one. */
static void argmax_feed(const plan_op *op) {
    const float *logits = F32(0);
    const int64_t b = op->a[1], v = op->a[2];
    int64_t *next_ids = I64(3), *drafts = I64(4), *positions = I64(5);
    const float divisor = (float)op->f[0];
    for (int64_t r = 0; r < b; ++r) {
        const float *row = logits + r * v;
        const int64_t token = divisor == 1.0f ? argmax_row(row, v) : argmax_divided(row, v, divisor);
        next_ids[r] = drafts[r] = token;
        if (positions) positions[r] += 1;
    }
}

/* OP_ATTENTION over the rows whose position is not -1 (the padding in front of an MTP head's shorter catch-up
 * feeds): those rows write nothing and leave their output rows alone. Each run of consecutive real rows is one
 * attention_decode call; the kernel computes every row alike, so a row's result is the one the whole batch gives.
 * 1 when a real row's position is outside the cache or has no KV block, else 0. */
static int attention_padded(const plan_op *op, int num_threads) {
    const int64_t *positions = I64(6), *slot_ids = I64(5), *tables = I64(7);
    const int64_t rows = op->a[9], H = op->a[10], KV = op->a[11], d = op->a[12], capacity = op->a[13];
    const int64_t max_blocks = op->a[14], block_size = op->a[15];
    for (int64_t r = 0; r < rows; ++r) {
        if (positions[r] == -1) continue;
        if (positions[r] < 0 || positions[r] >= capacity) return 1;
        if (tables[slot_ids[r] * max_blocks + positions[r] / block_size] == 0) return 1; /* no block */
    }
    for (int64_t r = 0, end; r < rows; r = end) {
        if (positions[r] == -1) {
            end = r + 1;
            continue;
        }
        for (end = r; end < rows && positions[end] != -1; ++end) {
        }
        attention_decode(F32(0) + r * H * d, F32(1) + r * KV * d, F32(2) + r * KV * d, F32(3), F32(4), tables,
                         max_blocks, block_size, op->a[16], slot_ids + r, positions + r, (float)op->f[0],
                         F32(8) + r * H * d, end - r, H, KV, d, num_threads);
    }
    return 0;
}

/* Run records [0, n); 0 on success, else 1 + the index of the record that refused its input (a token id outside
 * the vocabulary, a position outside the KV cache), with the records before it done. */
int64_t decode_plan_run(const plan_op *ops, int64_t n, int num_threads) {
    for (int64_t i = 0; i < n; ++i) {
        const plan_op *op = ops + i;
        switch (op->code) {
        case OP_EMBED:
            if (embed(I64(0), F32(1), F32(2), op->a[3], op->a[4], op->a[5], (float)op->f[0])) return i + 1;
            break;
        case OP_RMS_NORM:
            rms_norm(F32(0), F32(1), (float)op->f[0], F32(2), op->a[3], op->a[4], num_threads);
            break;
        case OP_ADD_RMS_NORM:
            add_rms_norm(F32(0), F32(1), (float)op->f[0], F32(2), (float)op->f[1], F32(3), op->a[4], op->a[5],
                         num_threads);
            break;
        case OP_LINEAR:
            linear_panels(F32(0), F32(1), F32(2), F32(3), op->a[4], op->a[5], op->a[6], num_threads);
            break;
        case OP_LINEAR_INT8: /* a: x, int8 panels, scale, bias, y, M, N, K */
            linear_panels_int8(F32(0), (const int8_t *)op->a[1], F32(2), F32(3), F32(4), op->a[5], op->a[6], op->a[7],
                               num_threads);
            break;
        case OP_LINEAR_BF16: /* a: x, bf16 panels, bias, y, M, N, K, path (linear_bf16.c) */
            linear_panels_bf16(F32(0), (const uint16_t *)op->a[1], F32(2), F32(3), op->a[4], op->a[5], op->a[6],
                               (int)op->a[7], num_threads);
            break;
        case OP_LINEAR_W8A8: /* a: x, int8 panels, scale, correction, bias, y, M, N, K, G, float weight, top_k */
            linear_panels_w8a8(F32(0), (const int8_t *)op->a[1], F32(2), (const int32_t *)op->a[3], F32(4), F32(5),
                               op->a[6], op->a[7], op->a[8], op->a[9], 0, num_threads);
            if (op->a[11] > 0) /* an LM head: a: …, float weight, top_k */
                rescore_top_logits(F32(0), F32(10), F32(4), F32(5), op->a[6], op->a[7], op->a[8], op->a[11],
                                   num_threads);
            break;
        case OP_MOE_ROUTE: /* a: logits, weights, ids, t, E, k, kind, norm, groups, topk groups, bias; f: scaling, eps */
            if (moe_route(F32(0), F32(1), I64(2), op->a[3], op->a[4], op->a[5], op->a[6], op->a[7], op->a[8], op->a[9],
                          F32(10), (float)op->f[0], (float)op->f[1]))
                return i + 1;
            break;
        case OP_MOE_EXPERTS: /* a: moe_experts' arguments (native_moe.experts_arguments) */
            if (moe_experts(F32(0), F32(1), I64(2), F32(3), op->a[4], op->a[5], op->a[6], op->a[7], op->a[8], op->a[9],
                            op->a[10], op->a[11], (const void *)op->a[12], F32(13), op->a[14],
                            (const void *)op->a[15], F32(16), op->a[17], num_threads))
                return i + 1;
            break;
        case OP_MOE_COMBINE: /* a: routed, shared, gate or null, out, rows, d */
            moe_combine(F32(0), F32(1), F32(2), F32(3), op->a[4], op->a[5]);
            break;
        case OP_ADD: /* a: x, y, out, n */
            add_rows(F32(0), F32(1), F32(2), op->a[3], num_threads);
            break;
        case OP_GELU_MUL: /* a: h [rows, 2n] = [gate | up], out [rows, n], rows, n */
            gelu_mul(F32(0), F32(1), op->a[2], op->a[3], num_threads);
            break;
        case OP_SILU_MUL:
            silu_mul(F32(0), F32(1), op->a[2], op->a[3], num_threads);
            break;
        case OP_RELU_SQUARE:
            relu_square(F32(0), F32(1), op->a[2], num_threads);
            break;
        case OP_COPY:
            memcpy(F32(0), F32(1), op->a[2] * sizeof(float));
            break;
        case OP_ROPE:
            rope_rows(F32(0), I64(1), F32(2), op->a[3], op->a[4], op->a[5], op->a[6]);
            break;
        case OP_COPY_ROWS: /* a: dst, src, rows, width, dst stride, src stride (gated attention's [q_h | gate_h]) */
            for (int64_t r = 0; r < op->a[2]; ++r)
                memcpy(F32(0) + r * op->a[4], F32(1) + r * op->a[5], op->a[3] * sizeof(float));
            break;
        case OP_SIGMOID_MUL:
            sigmoid_mul(F32(0), F32(1), F32(2), op->a[3], op->a[4], num_threads);
            break;
        case OP_ARGMAX_FEED: /* a: logits [b, v], b, v, next token ids [b], drafts [b], positions [b] or null;
                              * f: logits divisor */
            argmax_feed(op);
            break;
        case OP_GDN: /* a: in_proj output, conv windows, conv weight, dt_bias, A_log, delta-rule states, norm weight,
                      * conv output scratch, out, b, HK, HV, DK, DV, W; f: eps, beta_scale (gdn_decode.c's) */
            gdn_decode_step(F32(0), F32(1), F32(2), F32(3), F32(4), (float)op->f[1], F32(5), F32(6), (float)op->f[0],
                            F32(7), F32(8),
                            op->a[9], op->a[10], op->a[11], op->a[12], op->a[13], op->a[14], num_threads);
            break;
        case OP_GDN_VERIFY: /* as OP_GDN with proj and out [l, b, ·], qkv scratch [l, b, Cd], a15 l */
            gdn_verify(F32(0), F32(1), F32(2), F32(3), F32(4), (float)op->f[1], F32(5), F32(6), (float)op->f[0], F32(7),
                       F32(8),
                       op->a[9], op->a[15], op->a[10], op->a[11], op->a[12], op->a[13], op->a[14], num_threads);
            break;
        case OP_MAMBA2_VERIFY: /* as OP_MAMBA2 with proj and out [l, b, ·], xbc scratch [l, b, Cd], a18 l */
            mamba2_verify(F32(0), F32(1), F32(2), F32(3), F32(4), F32(5), F32(6), (float)op->f[0], (float)op->f[1],
                          F32(7), F32(8), op->a[9], (float)op->f[2], F32(10), F32(11), op->a[12], op->a[18],
                          op->a[13], op->a[14], op->a[15], op->a[16], op->a[17], num_threads);
            break;
        case OP_MAMBA2:
            mamba2_decode_step(F32(0), F32(1), F32(2), F32(3), F32(4), F32(5), F32(6), (float)op->f[0],
                               (float)op->f[1], F32(7), F32(8), op->a[9], (float)op->f[2], F32(10), F32(11),
                               op->a[12], op->a[13], op->a[14], op->a[15], op->a[16], op->a[17], num_threads);
            break;
        case OP_ATTENTION:
        case OP_ATTENTION_VERIFY: {
            /* a: q, k, v, key cache, value cache, slot ids, positions, block tables, out, b, H, KV, d, capacity,
             * max blocks, block size, cache tokens, and for a verification l (q, k, v, out [l, b, ·]; positions
             * of each row's first token); a18 the sliding window (0: none) */
            const int64_t *positions = I64(6), *slot_ids = I64(5), *tables = I64(7);
            const int64_t rows = op->a[9], capacity = op->a[13], max_blocks = op->a[14], block_size = op->a[15];
            const int64_t length = op->code == OP_ATTENTION ? 1 : op->a[17];
            for (int64_t r = 0; r < rows; ++r)
                for (int64_t t = 0; t < length; ++t) {
                    const int64_t position = positions[r] + t;
                    if (position < 0 || position >= capacity) return i + 1;
                    if (tables[slot_ids[r] * max_blocks + position / block_size] == 0) return i + 1; /* no block */
                }
            attention_verify_window(F32(0), F32(1), F32(2), F32(3), F32(4), tables, max_blocks, block_size,
                                    op->a[16], slot_ids, positions, (float)op->f[0], F32(8), rows, length, op->a[10],
                                    op->a[11], op->a[12], op->a[18], num_threads);
            break;
        }
        case OP_ATTENTION_PADDED: /* a: as OP_ATTENTION; rows at position -1 are padding */
            if (attention_padded(op, num_threads)) return i + 1;
            break;
        case OP_KDA:
        case OP_KDA_VERIFY: /* a, f: kda_plan_step's (kda_decode.c) */
            kda_plan_step(op->a, op->f, op->code == OP_KDA_VERIFY, num_threads);
            break;
        case OP_MLA: /* a, f: mla_plan_step's (mla_attention.c); refuses a position without a block */
            if (mla_plan_step(op->a, op->f, num_threads)) return i + 1;
            break;
        case OP_MAMBA1_CONV: /* a: proj [l, b, 2I], conv windows, conv weight, conv bias, xc out, b, l, I, W, advance */
            mamba1_conv(F32(0), F32(1), F32(2), F32(3), F32(4), op->a[5], op->a[6], op->a[7], op->a[8], op->a[9],
                        num_threads);
            break;
        case OP_MAMBA1_NORMS: /* a: x_proj output, dt / B / C norm weights, dt_in out, rows, R, N; f: eps */
            mamba1_norms(F32(0), F32(1), F32(2), F32(3), (float)op->f[0], F32(4), op->a[5], op->a[6], op->a[7],
                         num_threads);
            break;
        case OP_MAMBA1_SSM: /* a: proj, xc, xdbc, dt_raw, A, D, SSM states, y, b, l, I, R, N, in place */
            mamba1_ssm(F32(0), F32(1), F32(2), F32(3), F32(4), F32(5), F32(6), F32(7), op->a[8], op->a[9], op->a[10],
                       op->a[11], op->a[12], op->a[13], num_threads);
            break;
        case OP_SHORT_CONV: /* a: in_proj output, windows, conv weight, conv bias or null, u scratch, out, b, d, W */
            short_conv_step(F32(0), F32(1), F32(2), F32(3), F32(4), F32(5), op->a[6], op->a[7], op->a[8], num_threads);
            break;
        case OP_SHORT_CONV_VERIFY: /* as OP_SHORT_CONV over [l, b, ·] rows, a9 l */
            short_conv_verify(F32(0), F32(1), F32(2), F32(3), F32(4), F32(5), op->a[6], op->a[9], op->a[7], op->a[8],
                              num_threads);
            break;
        case OP_REPEAT_HEADS: /* a: per-head values [rows, H], out [rows, H, width], rows · H, width */
            for (int64_t r = 0; r < op->a[2]; ++r)
                for (int64_t i = 0; i < op->a[3]; ++i) F32(1)[r * op->a[3] + i] = F32(0)[r];
            break;
        case OP_ARGMAX: /* a: logits [rows, n], token ids out [rows] (int64), rows, n: torch.argmax's first index */
            argmax_rows(F32(0), I64(1), op->a[2], op->a[3], num_threads);
            break;
        default:
            return i + 1;
        }
    }
    return 0;
}

/* Shift records, one per recurrent layer, after a verification: OP_MAMBA2_SHIFT (a: in_proj outputs [l, b, ·],
 * conv windows, conv weight, conv bias, dt_bias, A_log, D, SSM states, xbc scratch [l, b, Cd], b, H, P, G, N, W, l;
 * f: dt_min, dt_max) or OP_GDN_SHIFT (a: in_proj outputs, conv windows, conv weight, dt_bias, A_log, delta-rule
 * states, qkv scratch [l, b, Cd], b, HK, HV, DK, DV, W, l; f: beta_scale). Every row advances its states by its first accepted[r]
 * tokens (1 ≤ accepted[r] ≤ l). 0 on success, else 1 + the refusing record. */
int64_t decode_plan_shift(const plan_op *ops, int64_t n, const int64_t *accepted, int num_threads) {
    for (int64_t i = 0; i < n; ++i) {
        const plan_op *op = ops + i;
        if (op->code == OP_KDA_SHIFT) { /* a: kda_plan_shift's (kda_decode.c) */
            if (kda_plan_shift(op->a, accepted, num_threads)) return i + 1;
            continue;
        }
        if (op->code == OP_MAMBA1_SHIFT) { /* a: proj, conv windows, conv w, conv b, xdbc, dt_raw, A, SSM states, xc
                                            * scratch, b, l, I, R, N, W (mamba1_keep's arguments) */
            for (int64_t r = 0; r < op->a[9]; ++r)
                if (accepted[r] < 1 || accepted[r] > op->a[10]) return i + 1;
            mamba1_keep(F32(0), F32(1), F32(2), F32(3), F32(4), F32(5), F32(6), F32(7), F32(8), accepted, op->a[9],
                        op->a[10], op->a[11], op->a[12], op->a[13], op->a[14], num_threads);
            continue;
        }
        if (op->code == OP_SHORT_CONV_SHIFT) { /* a: as OP_SHORT_CONV_VERIFY without out: proj, windows, weight,
                                                * bias, u scratch, b, d, W, l */
            for (int64_t r = 0; r < op->a[5]; ++r)
                if (accepted[r] < 1 || accepted[r] > op->a[8]) return i + 1;
            short_conv_keep(F32(0), F32(1), F32(2), F32(3), F32(4), accepted, op->a[5], op->a[8], op->a[6], op->a[7],
                            num_threads);
            continue;
        }
        const int mamba = op->code == OP_MAMBA2_SHIFT;
        if (!mamba && op->code != OP_GDN_SHIFT) return i + 1;
        const int64_t b = mamba ? op->a[9] : op->a[7], length = mamba ? op->a[15] : op->a[13];
        for (int64_t r = 0; r < b; ++r)
            if (accepted[r] < 1 || accepted[r] > length) return i + 1;
        if (mamba)
            mamba2_keep(F32(0), F32(1), F32(2), F32(3), F32(4), F32(5), F32(6), (float)op->f[0], (float)op->f[1],
                        F32(7), F32(8), accepted, b, length, op->a[10], op->a[11], op->a[12], op->a[13], op->a[14],
                        num_threads);
        else
            gdn_keep(F32(0), F32(1), F32(2), F32(3), F32(4), (float)op->f[0], F32(5), F32(6), accepted, b, length, op->a[8], op->a[9],
                     op->a[10], op->a[11], op->a[12], num_threads);
    }
    return 0;
}
