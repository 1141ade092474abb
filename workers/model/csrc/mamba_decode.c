/* One decode step of a Mamba2 mixer on CPU, float32: everything between in_proj and out_proj in one pass.
 *
 * The pure-PyTorch path in workers/model/mamba2.py (conv_step_, ssm_step_, GatedRMSNorm) is the reference; this
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
#include <stdint.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

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
#pragma omp for schedule(static)
        for (int64_t bc = 0; bc < b * Cd; ++bc) {
            const int64_t bi = bc / Cd, c = bc % Cd;
            float *window = conv_state + bc * (W - 1);
            const float *w = conv_w + c * W;
            const float input = proj[bi * row_len + I + c];
            float acc = conv_b ? conv_b[c] : 0.0f;
            for (int64_t k = 0; k < W - 1; ++k) acc += window[k] * w[k];
            acc += input * w[W - 1];
            for (int64_t k = 0; k + 1 < W - 1; ++k) window[k] = window[k + 1];
            if (W > 1) window[W - 2] = input;
            xbc[bc] = acc;
        }
#pragma omp for schedule(static)
        for (int64_t bi = 0; bi < b; ++bi) silu_inplace(xbc + bi * Cd, Cd);
        /* 2. SSM: h = exp(dt A) h + dt x ⊗ B;  y = h · C + D x. */
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < b * H; ++bh) {
            const int64_t bi = bh / H, h = bh % H, g = h / heads_per_group;
            float dt = softplus(proj[bi * row_len + I + Cd + h] + dt_bias[h]);
            dt = fminf(fmaxf(dt, dt_min), dt_max);
            const float decay = expf(dt * -expf(A_log[h]));
            const float *x = xbc + bi * Cd + h * P;
            const float *B = xbc + bi * Cd + I + g * N;
            const float *C = xbc + bi * Cd + I + G * N + g * N;
            float *state = ssm_state + bh * P * N;
            float *y = out + bi * I + h * P;
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
                y[p] = acc + D[h] * x[p];
            }
        }
        /* 3. Gate with silu(z), then the grouped RMSNorm. */
#pragma omp for schedule(static)
        for (int64_t bg = 0; bg < b * norm_groups; ++bg) {
            float *y = out + bg * group_size;
            const int64_t bi = bg / norm_groups, g = bg % norm_groups;
            silu_mul_row(proj + bi * row_len + g * group_size, y, y, group_size);
            const float *w = norm_w + (bg % norm_groups) * group_size;
            float sq = 0.0f;
            for (int64_t i = 0; i < group_size; ++i) sq += y[i] * y[i];
            const float scale = 1.0f / sqrtf(sq / (float)group_size + eps);
            for (int64_t i = 0; i < group_size; ++i) y[i] = w[i] * (y[i] * scale);
        }
    }
}
