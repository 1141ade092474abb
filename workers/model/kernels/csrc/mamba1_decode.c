/* Mamba (version 1, Jamba) on CPU, float32: the small ops between the mixer's four linears, for a decode step, a
 * speculative verification, the keep after it, and a prompt.
 *
 * The mixer is in_proj → [x | z]; conv (+ SiLU) over x → xc; x_proj(xc) → [dt_in (R) | B (N) | C (N)], each slice
 * RMS-normed; dt = softplus(dt_proj(dt_in)); h = exp(dt·A) ⊙ h + (dt·xc) ⊗ B; y = h·C + D·xc; y · silu(z); out_proj.
 * The four linears run as native linears (decode_plan.py records them with `rec.linear`); these kernels are the
 * rest, so that the module path and the plan call the same code between the same linears. The pure-PyTorch path
 * (layers/mamba1.py, kernels/selective_scan.py) is the reference.
 * Shapes (contiguous, row-major; "rows" are tokens, token-major [l, b] for a step, batch-major [b, l] for a prompt):
 *   proj     [rows, 2I]      in_proj output: x (the conv's input) | z (the gate)
 *   conv     [b, I, W-1]     conv windows          conv_w [I, W]   conv_b [I] or NULL
 *   xc       [rows, I]       conv output after SiLU (the scan's x)
 *   xdbc     [rows, R + 2N]  x_proj output; B and C normed in place, dt_in normed into dt_in [rows, R]
 *   dt_raw   [rows, I]       dt_proj output (before softplus)
 *   A        [I, N]          -exp(A_log), computed once in Python    D [I]
 *   ssm      [b, I, N]       SSM states
 *   y        [rows, I]       the out_proj input
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "conv_step.h"
#include "kernels.h"
#include "vexp.h"

/* The helpers with vectorised reductions that a decode step, a verification, a keep and a prompt share are not
 * inlined: each is one compiled body, so that its sums add in one order everywhere and all agree bit for bit. */
#define SHARED_STEP __attribute__((noinline, noclone))
#define CHANNEL_BLOCK 32 /* channels a thread walks together: their states (32 · N floats) stay in L1 */

static inline float softplus(float v) { return v > 20.0f ? v : log1pf(expf(v)); }

/* One token through `count` channels: state [count, N] ← exp(dt·A) ⊙ state + (dt·x) ⊗ B;  y = state · C.
 * x, dt (after softplus), y [count]; A [count, N]; B, C [N]. N need not be a multiple of the vector width: the
 * tail runs lane by lane through the same exp. */
static SHARED_STEP void channels_step(float *state, const float *A, const float *x, const float *dt, const float *B,
                                      const float *C, float *y, int64_t count, int64_t N) {
    for (int64_t c = 0; c < count; ++c) {
        float *s = state + c * N;
        const float *a = A + c * N;
        const float step = dt[c], xdt = dt[c] * x[c];
        vf acc = {0};
        int64_t n = 0;
        for (; n + LANES <= N; n += LANES) {
            vf sv, av, bv, cv;
            memcpy(&sv, s + n, sizeof sv);
            memcpy(&av, a + n, sizeof av);
            memcpy(&bv, B + n, sizeof bv);
            memcpy(&cv, C + n, sizeof cv);
            sv = sv * vexpf_lanes(av * step) + bv * xdt;
            memcpy(s + n, &sv, sizeof sv);
            acc += sv * cv;
        }
        float sum = 0.0f;
        for (int k = 0; k < LANES; ++k) sum += acc[k];
        for (; n < N; ++n) {
            const float v = s[n] * vexpf(a[n] * step) + B[n] * xdt;
            s[n] = v;
            sum += v * C[n];
        }
        y[c] = sum;
    }
}

/* out = rmsnorm(x) · w over n values (out may be x). */
static SHARED_STEP void norm_slice(const float *x, const float *w, float eps, float *out, int64_t n) {
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int64_t i = 0; i < n; ++i) sq += x[i] * x[i];
    const float scale = 1.0f / sqrtf(sq / (float)n + eps);
    for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * scale);
}

/* One token's output row of I channels: y ← (y + D · x) · silu(z). */
static SHARED_STEP void gate_row(float *y, const float *x, const float *D, const float *z, int64_t I) {
    for (int64_t c = 0; c < I; ++c) y[c] = y[c] + D[c] * x[c];
    silu_mul_row(z, y, y, I);
}

/* Conv output of l tokens per row (token-major proj [l, b, 2I] → xc [l, b, I], SiLU applied), continuing the windows
 * [b, I, W-1]: advanced by the l tokens if `advance` (a decode step: l = 1), else left as they are (a verification). */
void mamba1_conv(const float *proj, float *conv_state, const float *conv_w, const float *conv_b, float *xc, int64_t b,
                 int64_t l, int64_t I, int64_t W, int64_t advance, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    {
        conv_rows(conv_state, conv_w, conv_b, proj, 2 * I, b * 2 * I, xc, b * I, l, NULL, b, I, W, (int)advance);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < l * b; ++r) silu_inplace(xc + r * I, I);
    }
}

/* Jamba's inner norms over x_proj's output rows [rows, R + 2N]: dt_in [rows, R] = norm(dt slice); B and C slices
 * normed in place. */
void mamba1_norms(float *xdbc, const float *dt_w, const float *b_w, const float *c_w, float eps, float *dt_in,
                  int64_t rows, int64_t R, int64_t N, int num_threads) {
    const int64_t width = R + 2 * N;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * width > 65536)
    for (int64_t r = 0; r < rows; ++r) {
        float *row = xdbc + r * width;
        norm_slice(row, dt_w, eps, dt_in + r * R, R);
        norm_slice(row + R, b_w, eps, row + R, N);
        norm_slice(row + R + N, c_w, eps, row + R + N, N);
    }
}

/* The selective scan of l tokens per row (token-major rows [l, b]) from the states ssm [b, I, N], gated: y [l, b, I].
 * `in_place` (a decode step, l = 1): the states advance; else (a verification) each (row, channel block) walks its l
 * tokens on a copy and the states are left as they are — the outputs are those of l decode steps, bit for bit. */
void mamba1_ssm(const float *proj, const float *xc, const float *xdbc, const float *dt_raw, const float *A,
                const float *D, float *ssm_state, float *y, int64_t b, int64_t l, int64_t I, int64_t R, int64_t N,
                int64_t in_place, int num_threads) {
    const int64_t blocks = (I + CHANNEL_BLOCK - 1) / CHANNEL_BLOCK, width = R + 2 * N;
#pragma omp parallel num_threads(num_threads)
    {
        float *copy = in_place ? NULL : malloc(CHANNEL_BLOCK * N * sizeof(float));
        float dt[CHANNEL_BLOCK];
#pragma omp for schedule(static)
        for (int64_t item = 0; item < b * blocks; ++item) {
            const int64_t bi = item / blocks, c0 = item % blocks * CHANNEL_BLOCK;
            const int64_t count = I - c0 < CHANNEL_BLOCK ? I - c0 : CHANNEL_BLOCK;
            float *state = ssm_state + (bi * I + c0) * N;
            if (!in_place) state = memcpy(copy, state, count * N * sizeof(float));
            for (int64_t t = 0; t < l; ++t) {
                const int64_t r = t * b + bi;
                for (int64_t c = 0; c < count; ++c) dt[c] = softplus(dt_raw[r * I + c0 + c]);
                const float *row = xdbc + r * width;
                channels_step(state, A + c0 * N, xc + r * I + c0, dt, row + R, row + R + N, y + r * I + c0, count, N);
            }
        }
        free(copy);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < l * b; ++r) gate_row(y + r * I, xc + r * I, D, proj + r * 2 * I + I, I);
    }
}

/* After a verification: row r advances its conv window and SSM state, in place, by its first accepted[r] tokens of
 * the verification's kept proj [l, b, 2I], xdbc [l, b, R + 2N] (normed) and dt_raw [l, b, I] — the states accepted[r]
 * decode steps would leave, bit for bit. xc [l, b, I] is scratch. */
void mamba1_keep(const float *proj, float *conv_state, const float *conv_w, const float *conv_b, const float *xdbc,
                 const float *dt_raw, const float *A, float *ssm_state, float *xc, const int64_t *accepted, int64_t b,
                 int64_t l, int64_t I, int64_t R, int64_t N, int64_t W, int num_threads) {
    const int64_t blocks = (I + CHANNEL_BLOCK - 1) / CHANNEL_BLOCK, width = R + 2 * N;
#pragma omp parallel num_threads(num_threads)
    {
        conv_rows(conv_state, conv_w, conv_b, proj, 2 * I, b * 2 * I, xc, b * I, 0, accepted, b, I, W, 1);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < l * b; ++r)
            if (r / b < accepted[r % b]) silu_inplace(xc + r * I, I);
        float dt[CHANNEL_BLOCK], y[CHANNEL_BLOCK]; /* the outputs were the verification's: only the states matter */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < b * blocks; ++item) {
            const int64_t bi = item / blocks, c0 = item % blocks * CHANNEL_BLOCK;
            const int64_t count = I - c0 < CHANNEL_BLOCK ? I - c0 : CHANNEL_BLOCK;
            for (int64_t t = 0; t < accepted[bi]; ++t) {
                const int64_t r = t * b + bi;
                for (int64_t c = 0; c < count; ++c) dt[c] = softplus(dt_raw[r * I + c0 + c]);
                const float *row = xdbc + r * width;
                channels_step(ssm_state + (bi * I + c0) * N, A + c0 * N, xc + r * I + c0, dt, row + R, row + R + N, y,
                              count, N);
            }
        }
    }
}

/* A prompt's conv (batch-major proj [b, l, 2I], num_tokens[r] valid tokens per row) continuing the windows
 * initial_conv [b, I, W-1] (NULL: zeros) → xc [b, l, I] after SiLU (0 at padding), and the windows after each row's
 * last valid token into conv_state [b, I, W-1]. The decode step's conv arithmetic (conv_step.h). */
void mamba1_prefill_conv(const float *proj, const int64_t *num_tokens, const float *conv_w, const float *conv_b,
                         const float *initial_conv, float *conv_state, float *xc, int64_t b, int64_t l, int64_t I,
                         int64_t W, int num_threads) {
    const int64_t blocks = (I + CONV_BLOCK - 1) / CONV_BLOCK;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < b * blocks; ++item) {
            const int64_t bi = item / blocks, c0 = item % blocks * CONV_BLOCK;
            const int64_t count = I - c0 < CONV_BLOCK ? I - c0 : CONV_BLOCK;
            float *window = conv_state + (bi * I + c0) * (W - 1);
            if (initial_conv)
                memcpy(window, initial_conv + (bi * I + c0) * (W - 1), count * (W - 1) * sizeof(float));
            else
                memset(window, 0, count * (W - 1) * sizeof(float));
            conv_block_steps(window, conv_w + c0 * W, conv_b ? conv_b + c0 : NULL, proj + bi * l * 2 * I + c0, 2 * I,
                             xc + bi * l * I + c0, I, num_tokens[bi], count, W, 1);
        }
#pragma omp for schedule(static)
        for (int64_t bt = 0; bt < b * l; ++bt) {
            if (bt % l < num_tokens[bt / l])
                silu_inplace(xc + bt * I, I);
            else
                memset(xc + bt * I, 0, I * sizeof(float));
        }
    }
}

/* A prompt's selective scan (batch-major rows [b, l]) from initial_ssm [b, I, N] (NULL: zeros): each (row, channel
 * block) walks the row's valid tokens with its states in cache, discretising in registers. Writes the states after
 * each row's last valid token into ssm_state, dt (after softplus, 0 at padding) into dt_out [b, l, I], and the gated
 * output into y [b, l, I] (0 at padding). The decode step's arithmetic token by token: no chunked closed form (a
 * per-channel A would need [l, l, I, N] decays). */
void mamba1_prefill_scan(const float *proj, const int64_t *num_tokens, const float *xc, const float *xdbc,
                         const float *dt_raw, const float *A, const float *D, const float *initial_ssm,
                         float *ssm_state, float *dt_out, float *y, int64_t b, int64_t l, int64_t I, int64_t R,
                         int64_t N, int num_threads) {
    const int64_t blocks = (I + CHANNEL_BLOCK - 1) / CHANNEL_BLOCK, width = R + 2 * N;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < b * blocks; ++item) {
            const int64_t bi = item / blocks, c0 = item % blocks * CHANNEL_BLOCK, n = num_tokens[bi];
            const int64_t count = I - c0 < CHANNEL_BLOCK ? I - c0 : CHANNEL_BLOCK;
            float *state = ssm_state + (bi * I + c0) * N;
            if (initial_ssm)
                memcpy(state, initial_ssm + (bi * I + c0) * N, count * N * sizeof(float));
            else
                memset(state, 0, count * N * sizeof(float));
            for (int64_t t = 0; t < l; ++t) {
                const int64_t r = bi * l + t;
                float *dt = dt_out + r * I + c0;
                if (t >= n) {
                    memset(dt, 0, count * sizeof(float));
                    memset(y + r * I + c0, 0, count * sizeof(float));
                    continue;
                }
                for (int64_t c = 0; c < count; ++c) dt[c] = softplus(dt_raw[r * I + c0 + c]);
                const float *row = xdbc + r * width;
                channels_step(state, A + c0 * N, xc + r * I + c0, dt, row + R, row + R + N, y + r * I + c0, count, N);
            }
        }
#pragma omp for schedule(static)
        for (int64_t bt = 0; bt < b * l; ++bt)
            if (bt % l < num_tokens[bt / l]) gate_row(y + bt * I, xc + bt * I, D, proj + bt * 2 * I + I, I);
    }
}

/* The states ssm [b, I, N] advanced in place by each row's first num_tokens[r] tokens of a forward's scan inputs
 * (batch-major x, dt after softplus [b, l, I]; B [b, l, N]): the module path's speculative state shift, with the
 * decode step's arithmetic. */
void mamba1_state_after(const float *x, const float *dt, const float *B, const float *A, float *ssm_state,
                        const int64_t *num_tokens, int64_t b, int64_t l, int64_t I, int64_t N, int num_threads) {
    const int64_t blocks = (I + CHANNEL_BLOCK - 1) / CHANNEL_BLOCK;
#pragma omp parallel num_threads(num_threads)
    {
        float y[CHANNEL_BLOCK];
#pragma omp for schedule(static)
        for (int64_t item = 0; item < b * blocks; ++item) {
            const int64_t bi = item / blocks, c0 = item % blocks * CHANNEL_BLOCK;
            const int64_t count = I - c0 < CHANNEL_BLOCK ? I - c0 : CHANNEL_BLOCK;
            for (int64_t t = 0; t < num_tokens[bi]; ++t) {
                const int64_t r = bi * l + t;
                channels_step(ssm_state + (bi * I + c0) * N, A + c0 * N, x + r * I + c0, dt + r * I + c0, B + r * N,
                              B + r * N, y, count, N);
            }
        }
    }
}
