/* A whole-model decode step as one call: the kernel invocations of one step, recorded once per batch size.
 *
 * Called one by one from Python, the ~70 kernels of a bench-model step spend ~3 ms in the interpreter (argument
 * checks, output allocation, ctypes) against ~14 ms of work at batch 1. decode_plan.py records, per batch size, the
 * same calls with their buffers, weights and state slots as a list of fixed-size records; this walks the list.
 * Every record calls the kernel the module would have called, with the same arguments, so a step's results are
 * bit-for-bit those of the module-by-module path (tests check that). The CPU counterpart of a CUDA graph.
 * A record is 32 words: the op code, 27 integer or pointer arguments, 4 float arguments (as doubles).
 *
 * Speculative verification runs l tokens per row the same way (linears over all of them at once, the Mamba2,
 * Gated DeltaNet and attention steps token by token, states updated in place after saving them); decode_plan_shift
 * then gives each row the state after its accepted tokens: rows that accepted fewer than l get the saved state back
 * and re-run their accepted tokens through the same kernel, so the kept state is bit for bit what plain decode
 * steps would leave.
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
    OP_ATTENTION_PADDED = 18, /* 16 and 17: another change's ops */
    OP_ARGMAX = 19,
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
        case OP_GDN: /* a: in_proj output, conv windows, conv weight, dt_bias, A_log, delta-rule states, norm weight,
                      * conv output scratch, out, b, HK, HV, DK, DV, W; f: eps (gdn_decode.c's arguments) */
            gdn_decode_step(F32(0), F32(1), F32(2), F32(3), F32(4), F32(5), F32(6), (float)op->f[0], F32(7), F32(8),
                            op->a[9], op->a[10], op->a[11], op->a[12], op->a[13], op->a[14], num_threads);
            break;
        case OP_MAMBA2:
            mamba2_decode_step(F32(0), F32(1), F32(2), F32(3), F32(4), F32(5), F32(6), (float)op->f[0],
                               (float)op->f[1], F32(7), F32(8), op->a[9], (float)op->f[2], F32(10), F32(11),
                               op->a[12], op->a[13], op->a[14], op->a[15], op->a[16], op->a[17], num_threads);
            break;
        case OP_ATTENTION: {
            /* a: q, k, v, key cache, value cache, slot ids, positions, block tables, out, b, H, KV, d, capacity,
             * max blocks, block size, cache tokens */
            const int64_t *positions = I64(6), *slot_ids = I64(5), *tables = I64(7);
            const int64_t rows = op->a[9], capacity = op->a[13], max_blocks = op->a[14], block_size = op->a[15];
            for (int64_t r = 0; r < rows; ++r) {
                if (positions[r] < 0 || positions[r] >= capacity) return i + 1;
                if (tables[slot_ids[r] * max_blocks + positions[r] / block_size] == 0) return i + 1; /* no block */
            }
            attention_decode(F32(0), F32(1), F32(2), F32(3), F32(4), tables, max_blocks, block_size, op->a[16],
                             slot_ids, positions, (float)op->f[0], F32(8), rows, op->a[10], op->a[11], op->a[12],
                             num_threads);
            break;
        }
        case OP_ATTENTION_PADDED: /* a: as OP_ATTENTION; rows at position -1 are padding */
            if (attention_padded(op, num_threads)) return i + 1;
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

/* Rows that accepted fewer than all l tokens restart from the saved state and re-run their accepted tokens, one
 * row at a time (the kernels compute every row alike, so one row alone gives the bits the batch gave). */
static void mamba2_shift(const plan_op *op, const int64_t *accepted, int num_threads) {
    const int64_t b = op->a[12], H = op->a[13], P = op->a[14], G = op->a[15], N = op->a[16], W = op->a[17];
    const int64_t length = op->a[20], Cd = H * P + 2 * G * N, row_len = H * P + Cd + H;
    const int64_t conv_row = Cd * (W - 1), ssm_row = H * P * N;
    for (int64_t r = 0; r < b; ++r) {
        if (accepted[r] == length) continue; /* the state after all l tokens is already in place */
        float *conv = F32(1) + r * conv_row, *ssm = F32(7) + r * ssm_row;
        memcpy(conv, F32(18) + r * conv_row, conv_row * sizeof(float));
        memcpy(ssm, F32(19) + r * ssm_row, ssm_row * sizeof(float));
        for (int64_t t = 0; t < accepted[r]; ++t)
            mamba2_decode_step(F32(0) + (t * b + r) * row_len, conv, F32(2), F32(3), F32(4), F32(5), F32(6),
                               (float)op->f[0], (float)op->f[1], ssm, F32(8), op->a[9], (float)op->f[2], F32(10),
                               F32(11), 1, H, P, G, N, W, num_threads);
    }
}

static void gdn_shift(const plan_op *op, const int64_t *accepted, int num_threads) {
    const int64_t b = op->a[9], HK = op->a[10], HV = op->a[11], DK = op->a[12], DV = op->a[13], W = op->a[14];
    const int64_t length = op->a[17], Cd = 2 * HK * DK + HV * DV, row_len = Cd + HV * DV + 2 * HV;
    const int64_t conv_row = Cd * (W - 1), state_row = HV * DK * DV;
    for (int64_t r = 0; r < b; ++r) {
        if (accepted[r] == length) continue;
        float *conv = F32(1) + r * conv_row, *state = F32(5) + r * state_row;
        memcpy(conv, F32(15) + r * conv_row, conv_row * sizeof(float));
        memcpy(state, F32(16) + r * state_row, state_row * sizeof(float));
        for (int64_t t = 0; t < accepted[r]; ++t)
            gdn_decode_step(F32(0) + (t * b + r) * row_len, conv, F32(2), F32(3), F32(4), state, F32(6),
                            (float)op->f[0], F32(7), F32(8), 1, HK, HV, DK, DV, W, num_threads);
    }
}

/* Shift records, one per recurrent layer: OP_MAMBA2_SHIFT (arguments as OP_MAMBA2, plus a18 saved conv windows,
 * a19 saved SSM states, a20 tokens per row l) or OP_GDN_SHIFT (as OP_GDN, plus a15 saved conv windows, a16 saved
 * delta-rule states, a17 l); a0 holds the layer's in_proj outputs token-major [l, b, ·]. Every row keeps the state
 * after its first accepted[r] tokens (1 ≤ accepted[r] ≤ l). 0 on success, else 1 + the refusing record. */
int64_t decode_plan_shift(const plan_op *ops, int64_t n, const int64_t *accepted, int num_threads) {
    for (int64_t i = 0; i < n; ++i) {
        const plan_op *op = ops + i;
        const int mamba = op->code == OP_MAMBA2_SHIFT;
        if (!mamba && op->code != OP_GDN_SHIFT) return i + 1;
        const int64_t b = mamba ? op->a[12] : op->a[9], length = mamba ? op->a[20] : op->a[17];
        for (int64_t r = 0; r < b; ++r)
            if (accepted[r] < 1 || accepted[r] > length) return i + 1;
        if (mamba)
            mamba2_shift(op, accepted, num_threads);
        else
            gdn_shift(op, accepted, num_threads);
    }
    return 0;
}
