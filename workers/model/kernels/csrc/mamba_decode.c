/* Mamba2 on CPU, float32: everything between in_proj and out_proj, for one decode step and for a prompt.
 *
 * The pure-PyTorch path in workers/model/layers/mamba2.py (conv_step_, ssm_step_, GatedRMSNorm) is the reference; this
 * kernel computes the same thing, reading and writing each row's conv window and SSM state exactly once.
 * Shapes (all contiguous, row-major):
 *   proj       [b, I + Cd + H]   in_proj output: z | xBC | dt (before softplus)
 *   conv_state [b, Cd, W-1]      updated in place        conv_w [Cd, W]   conv_b [Cd] or NULL
 *   dt_bias, A_log, D [H]        A = -exp(A_log)
 *   ssm_state  [b, H, P, N]      updated in place
 *   norm_w     [I]               grouped gated RMSNorm, norm_groups groups of I / norm_groups channels
 *   xbc        [b, Cd]           scratch: conv output (x | B | C)
 *   out        [b, I]            normed, gated output (the input of out_proj)
 * with I = H * P and Cd = I + 2 * G * N.
 */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "conv_step.h"
#include "kernels.h"
#include "vexp.h"

/* Denormal floats cost x86 cores ~100× per operation; SSM states decay towards them over long sequences.
 * Flush-to-zero / denormals-are-zero for the calling thread (no-op elsewhere). */
static inline void flush_denormals(void) {
#if defined(__SSE__)
    _mm_setcsr(_mm_getcsr() | 0x8040);
#endif
}

/* Set flush-to-zero on every thread of the OpenMP pool (the one PyTorch's CPU ops run on as well). */
void flush_denormals_on_threads(int num_threads) {
#pragma omp parallel num_threads(num_threads)
    flush_denormals();
}

/* torch.nn.functional.softplus with its default threshold of 20. */
static inline float softplus(float v) { return v > 20.0f ? v : log1pf(expf(v)); }

/* dt of head h for one token: softplus(dt_raw + dt_bias) clamped; its decay exp(dt · A), A = -exp(A_log). */
static inline float head_dt(float dt_raw, float bias, float dt_min, float dt_max) {
    return fminf(fmaxf(softplus(dt_raw + bias), dt_min), dt_max);
}

/* One token through one head: state [P, N] ← decay · state + dt x ⊗ B; y[p] = state[p] · C + D x[p].
 * Not inlined: the decode step, the verification and the keep below call this one compiled body, so that the
 * vectorised reduction adds in one order everywhere and their states and outputs agree bit for bit. */
static __attribute__((noinline, noclone)) void ssm_head_step(float *state, const float *x, const float *B,
                                                             const float *C, float dt, float decay, float D, float *y,
                                                             int64_t P, int64_t N) {
    for (int64_t p = 0; p < P; ++p) {
        const float xdt = x[p] * dt;
        float *s = state + p * N;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t n = 0; n < N; ++n) {
            const float v = s[n] * decay + xdt * B[n];
            s[n] = v;
            acc += v * C[n];
        }
        y[p] = acc + D * x[p];
    }
}

/* y ← rmsnorm(y · silu(z)) · w over one group of n channels, in place (one compiled body, as ssm_head_step). */
static __attribute__((noinline, noclone)) void gated_norm_group(const float *z, float *y, const float *w, float eps,
                                                                int64_t n) {
    silu_mul_row(z, y, y, n);
    float sq = 0.0f;
    for (int64_t i = 0; i < n; ++i) sq += y[i] * y[i];
    const float scale = 1.0f / sqrtf(sq / (float)n + eps);
    for (int64_t i = 0; i < n; ++i) y[i] = w[i] * (y[i] * scale);
}

void mamba2_decode_step(const float *proj, float *conv_state, const float *conv_w, const float *conv_b,
                        const float *dt_bias, const float *A_log, const float *D, float dt_min, float dt_max,
                        float *ssm_state, const float *norm_w, int64_t norm_groups, float eps, float *xbc,
                        float *out, int64_t b, int64_t H, int64_t P, int64_t G, int64_t N, int64_t W,
                        int num_threads) {
    const int64_t I = H * P, Cd = I + 2 * G * N, row_len = I + Cd + H, heads_per_group = H / G;
    const int64_t group_size = I / norm_groups;
#pragma omp parallel num_threads(num_threads)
    {
        flush_denormals();
        /* 1. Causal conv over the window [state, new input], shift the window, silu. */
        conv_rows(conv_state, conv_w, conv_b, proj + I, row_len, 0, xbc, 0, 1, NULL, b, Cd, W, 1);
#pragma omp for schedule(static)
        for (int64_t bi = 0; bi < b; ++bi) silu_inplace(xbc + bi * Cd, Cd);
        /* 2. SSM: h = exp(dt A) h + dt x ⊗ B;  y = h · C + D x. */
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < b * H; ++bh) {
            const int64_t bi = bh / H, h = bh % H, g = h / heads_per_group;
            const float dt = head_dt(proj[bi * row_len + I + Cd + h], dt_bias[h], dt_min, dt_max);
            const float *row = xbc + bi * Cd;
            ssm_head_step(ssm_state + bh * P * N, row + h * P, row + I + g * N, row + I + G * N + g * N, dt,
                          expf(dt * -expf(A_log[h])), D[h], out + bi * I + h * P, P, N);
        }
        /* 3. Gate with silu(z), then the grouped RMSNorm. */
#pragma omp for schedule(static)
        for (int64_t bg = 0; bg < b * norm_groups; ++bg) {
            const int64_t bi = bg / norm_groups, g = bg % norm_groups;
            gated_norm_group(proj + bi * row_len + g * group_size, out + bg * group_size, norm_w + g * group_size, eps,
                             group_size);
        }
    }
}

/* Speculative verification: l tokens per row from the states in place, which are read and left as they are (the
 * keep below advances them once the accepted count is known). proj [l, b, I + Cd + H] token-major → out
 * [l, b, I]; xbc [l, b, Cd] scratch. Each (row, head) walks its l tokens on a copy of its state in cache, so the
 * state is read once instead of saved, updated l times and restored; outputs are bit for bit those of l decode
 * steps (the same conv order, the same `ssm_head_step`, the same norm). */
void mamba2_verify(const float *proj, const float *conv_state, const float *conv_w, const float *conv_b,
                   const float *dt_bias, const float *A_log, const float *D, float dt_min, float dt_max,
                   const float *ssm_state, const float *norm_w, int64_t norm_groups, float eps, float *xbc,
                   float *out, int64_t b, int64_t l, int64_t H, int64_t P, int64_t G, int64_t N, int64_t W,
                   int num_threads) {
    const int64_t I = H * P, Cd = I + 2 * G * N, row_len = I + Cd + H, heads_per_group = H / G;
    const int64_t group_size = I / norm_groups;
#pragma omp parallel num_threads(num_threads)
    {
        flush_denormals();
        conv_rows((float *)conv_state, conv_w, conv_b, proj + I, row_len, b * row_len, xbc, b * Cd, l, NULL, b, Cd,
                  W, 0);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < l * b; ++r) silu_inplace(xbc + r * Cd, Cd);
        float *state = malloc(P * N * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < b * H; ++bh) {
            const int64_t bi = bh / H, h = bh % H, g = h / heads_per_group;
            memcpy(state, ssm_state + bh * P * N, P * N * sizeof(float));
            for (int64_t t = 0; t < l; ++t) {
                const int64_t r = t * b + bi;
                const float dt = head_dt(proj[r * row_len + I + Cd + h], dt_bias[h], dt_min, dt_max);
                const float *row = xbc + r * Cd;
                ssm_head_step(state, row + h * P, row + I + g * N, row + I + G * N + g * N, dt,
                              expf(dt * -expf(A_log[h])), D[h], out + r * I + h * P, P, N);
            }
        }
        free(state);
#pragma omp for schedule(static)
        for (int64_t rg = 0; rg < l * b * norm_groups; ++rg) {
            const int64_t r = rg / norm_groups, g = rg % norm_groups;
            gated_norm_group(proj + r * row_len + g * group_size, out + rg * group_size, norm_w + g * group_size, eps,
                             group_size);
        }
    }
}

/* After `mamba2_verify`: row r advances its conv window and SSM state, in place, by its first accepted[r] tokens of
 * proj [l, b, ·] — the states accepted[r] decode steps would leave, bit for bit. xbc [l, b, Cd] is scratch. */
void mamba2_keep(const float *proj, float *conv_state, const float *conv_w, const float *conv_b,
                 const float *dt_bias, const float *A_log, const float *D, float dt_min, float dt_max,
                 float *ssm_state, float *xbc, const int64_t *accepted, int64_t b, int64_t l, int64_t H, int64_t P,
                 int64_t G, int64_t N, int64_t W, int num_threads) {
    const int64_t I = H * P, Cd = I + 2 * G * N, row_len = I + Cd + H, heads_per_group = H / G;
#pragma omp parallel num_threads(num_threads)
    {
        flush_denormals();
        conv_rows(conv_state, conv_w, conv_b, proj + I, row_len, b * row_len, xbc, b * Cd, 0, accepted, b, Cd, W, 1);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < l * b; ++r)
            if (r / b < accepted[r % b]) silu_inplace(xbc + r * Cd, Cd);
        float *y = malloc(P * sizeof(float)); /* the outputs were the verification's; only the states matter */
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < b * H; ++bh) {
            const int64_t bi = bh / H, h = bh % H, g = h / heads_per_group;
            for (int64_t t = 0; t < accepted[bi]; ++t) {
                const int64_t r = t * b + bi;
                const float dt = head_dt(proj[r * row_len + I + Cd + h], dt_bias[h], dt_min, dt_max);
                const float *row = xbc + r * Cd;
                ssm_head_step(ssm_state + bh * P * N, row + h * P, row + I + g * N, row + I + G * N + g * N, dt,
                              expf(dt * -expf(A_log[h])), D[h], y, P, N);
            }
        }
        free(y);
    }
}

/* A prompt through a Mamba2 mixer from the zero state: proj [b, l, I + Cd + H] (rows right-padded, row r has
 * num_tokens[r] valid tokens) → out [b, l, I] (the out_proj input; 0 at padding), and the states after each row's
 * last valid token into conv_state [b, Cd, W-1] and ssm_state [b, H, P, N]. xbc [b, l, Cd] is scratch.
 * The same recurrence as the decode step, token after token, but walked per (row, head) so that the head's state
 * (P · N floats, 32 KiB for the bench model) stays in L1 for the whole prompt: no chunked-scan passes. */
void mamba2_prefill(const float *proj, const int64_t *num_tokens, const float *conv_w, const float *conv_b,
                    const float *dt_bias, const float *A_log, const float *D, float dt_min, float dt_max,
                    const float *norm_w, int64_t norm_groups, float eps, float *xbc, const float *initial_conv,
                    const float *initial_ssm, float *conv_state, float *ssm_state, float *out, int64_t b, int64_t l,
                    int64_t H, int64_t P, int64_t G, int64_t N, int64_t W, int num_threads) {
    const int64_t I = H * P, Cd = I + 2 * G * N, row_len = I + Cd + H, heads_per_group = H / G;
    const int64_t group_size = I / norm_groups;
#pragma omp parallel num_threads(num_threads)
    {
        flush_denormals();
        /* 1. Causal conv continuing the initial window (zeros without one), per channel; the window keeps the
         * last W-1 inputs. Input src < 0 is entry W-1+src of the initial window. */
#pragma omp for schedule(static)
        for (int64_t bc = 0; bc < b * Cd; ++bc) {
            const int64_t bi = bc / Cd, c = bc % Cd, n = num_tokens[bi];
            const float *w = conv_w + c * W, *in = proj + bi * l * row_len + I + c;
            const float *window = initial_conv ? initial_conv + bc * (W - 1) : NULL;
            for (int64_t t = 0; t < l; ++t) {
                float acc = conv_b ? conv_b[c] : 0.0f;
                for (int64_t k = 0; k < W; ++k) {
                    const int64_t src = t - (W - 1) + k;
                    acc += (src >= 0 ? in[src * row_len] : (window ? window[W - 1 + src] : 0.0f)) * w[k];
                }
                xbc[(bi * l + t) * Cd + c] = acc;
            }
            for (int64_t k = 0; k < W - 1; ++k) {
                const int64_t src = n - (W - 1) + k;
                conv_state[bc * (W - 1) + k] = src >= 0 ? in[src * row_len] : (window ? window[W - 1 + src] : 0.0f);
            }
        }
#pragma omp for schedule(static)
        for (int64_t bt = 0; bt < b * l; ++bt) silu_inplace(xbc + bt * Cd, Cd);
        /* 2. SSM per (row, head) over the row's valid tokens, from the initial state (zeros without one). */
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < b * H; ++bh) {
            const int64_t bi = bh / H, h = bh % H, g = h / heads_per_group;
            float *state = ssm_state + bh * P * N;
            for (int64_t i = 0; i < P * N; ++i) state[i] = initial_ssm ? initial_ssm[bh * P * N + i] : 0.0f;
            const float A = -expf(A_log[h]);
            for (int64_t t = 0; t < l; ++t) {
                float *y = out + (bi * l + t) * I + h * P;
                if (t >= num_tokens[bi]) {
                    for (int64_t p = 0; p < P; ++p) y[p] = 0.0f;
                    continue;
                }
                const float dt = head_dt(proj[(bi * l + t) * row_len + I + Cd + h], dt_bias[h], dt_min, dt_max);
                const float *row = xbc + (bi * l + t) * Cd;
                ssm_head_step(state, row + h * P, row + I + g * N, row + I + G * N + g * N, dt, expf(dt * A), D[h],
                              y, P, N);
            }
        }
        /* 3. Gate with silu(z), then the grouped RMSNorm, per token and group. */
#pragma omp for schedule(static)
        for (int64_t btg = 0; btg < b * l * norm_groups; ++btg) {
            const int64_t bt = btg / norm_groups, g = btg % norm_groups;
            gated_norm_group(proj + bt * row_len + g * group_size, out + btg * group_size, norm_w + g * group_size,
                             eps, group_size);
        }
    }
}
