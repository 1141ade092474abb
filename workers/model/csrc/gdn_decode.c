/* Gated DeltaNet on CPU, float32: everything between in_proj and out_proj for one decode step.
 *
 * The pure-PyTorch path in workers/model/gdn.py (conv_step_, l2norm, delta_rule_step_, HeadGatedRMSNorm) is the
 * reference; this kernel computes the same thing in one pass per request and value head over the delta-rule state
 * (the state, h_v · d_k · d_v floats per request, is what a decode step is bound by; PyTorch makes ~4 passes).
 * Shapes (all contiguous, row-major), with Cd = 2 · HK · DK + HV · DV:
 *   proj        [b, Cd + HV·DV + 2·HV]  in_proj output: q | k | v | z | b (beta before sigmoid) | a
 *   conv_state  [b, Cd, W-1]            updated in place        conv_w [Cd, W] (no bias)
 *   dt_bias, A_log [HV]                 g = -exp(A_log) · softplus(a + dt_bias), decay = exp(g)
 *   delta_state [b, HV, DK, DV]         updated in place
 *   norm_w      [DV]                    per-head gated RMSNorm: w · rmsnorm(o) · silu(z)
 *   qkv         [b, Cd]                 scratch: conv output (q | k | v after silu; q, k then l2-normalised)
 *   out         [b, HV·DV]              the out_proj input
 * Value head h reads key head h / (HV / HK) (repeat_interleave).
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include "vexp.h"

static inline float softplus(float v) { return v > 20.0f ? v : log1pf(expf(v)); }

/* x ← x / sqrt(Σx² + 1e-6) · scale over n values (the FLA / transformers l2norm). */
static inline void l2norm_scaled(float *x, int64_t n, float scale) {
    float sq = 0.0f;
    for (int64_t i = 0; i < n; ++i) sq += x[i] * x[i];
    const float factor = scale / sqrtf(sq + 1e-6f);
    for (int64_t i = 0; i < n; ++i) x[i] *= factor;
}

/* One token through one value head: S ← decay·S;  S += k ⊗ beta·(v − Sᵀk);  o = Sᵀq.  S is [DK, DV]. */
static inline void delta_head_step(float *S, const float *q, const float *k, const float *v, float decay, float beta,
                                   float *o, float *delta, int64_t DK, int64_t DV) {
    for (int64_t j = 0; j < DV; ++j) delta[j] = 0.0f;
    for (int64_t i = 0; i < DK; ++i) { /* Sᵀk of the undecayed state; scaled by decay below */
        const float ki = k[i];
        const float *row = S + i * DV;
#pragma omp simd
        for (int64_t j = 0; j < DV; ++j) delta[j] += row[j] * ki;
    }
    for (int64_t j = 0; j < DV; ++j) {
        delta[j] = (v[j] - decay * delta[j]) * beta;
        o[j] = 0.0f;
    }
    for (int64_t i = 0; i < DK; ++i) { /* the update and the output in one pass over the (now cached) state */
        const float ki = k[i], qi = q[i];
        float *row = S + i * DV;
#pragma omp simd
        for (int64_t j = 0; j < DV; ++j) {
            const float s = row[j] * decay + ki * delta[j];
            row[j] = s;
            o[j] += s * qi;
        }
    }
}

void gdn_decode_step(const float *proj, float *conv_state, const float *conv_w, const float *dt_bias,
                     const float *A_log, float *delta_state, const float *norm_w, float eps, float *qkv, float *out,
                     int64_t b, int64_t HK, int64_t HV, int64_t DK, int64_t DV, int64_t W, int num_threads) {
    const int64_t Cd = 2 * HK * DK + HV * DV, row_len = Cd + HV * DV + 2 * HV, per_key = HV / HK;
#pragma omp parallel num_threads(num_threads)
    {
        /* 1. Causal conv over the window [state, new input], shift the window, silu. */
#pragma omp for schedule(static)
        for (int64_t bc = 0; bc < b * Cd; ++bc) {
            const int64_t bi = bc / Cd, c = bc % Cd;
            float *window = conv_state + bc * (W - 1);
            const float *w = conv_w + c * W;
            const float input = proj[bi * row_len + c];
            float acc = 0.0f;
            for (int64_t k = 0; k < W - 1; ++k) acc += window[k] * w[k];
            acc += input * w[W - 1];
            for (int64_t k = 0; k + 1 < W - 1; ++k) window[k] = window[k + 1];
            if (W > 1) window[W - 2] = input;
            qkv[bc] = acc;
        }
#pragma omp for schedule(static)
        for (int64_t bi = 0; bi < b; ++bi) silu_inplace(qkv + bi * Cd, Cd);
        /* 2. l2-normalise each key head of q (then scale by DK^-0.5) and of k. */
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < b * 2 * HK; ++bh) {
            const int64_t bi = bh / (2 * HK), h = bh % (2 * HK); /* h < HK: q heads, then k heads */
            l2norm_scaled(qkv + bi * Cd + h * DK, DK, h < HK ? 1.0f / sqrtf((float)DK) : 1.0f);
        }
        /* 3. The delta rule per (row, value head), then the gated norm of its output. */
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < b * HV; ++bh) {
            const int64_t bi = bh / HV, h = bh % HV, kh = h / per_key;
            const float *row = qkv + bi * Cd, *p = proj + bi * row_len;
            const float g = -expf(A_log[h]) * softplus(p[Cd + HV * DV + HV + h] + dt_bias[h]);
            const float beta = 1.0f / (1.0f + expf(-p[Cd + HV * DV + h]));
            float delta[DV];
            float *o = out + bh * DV;
            delta_head_step(delta_state + bh * DK * DV, row + kh * DK, row + HK * DK + kh * DK,
                            row + 2 * HK * DK + h * DV, expf(g), beta, o, delta, DK, DV);
            float sq = 0.0f;
            for (int64_t j = 0; j < DV; ++j) sq += o[j] * o[j];
            const float scale = 1.0f / sqrtf(sq / (float)DV + eps);
            const float *z = p + Cd + h * DV;
            for (int64_t j = 0; j < DV; ++j) o[j] = norm_w[j] * (o[j] * scale) * (z[j] / (1.0f + expf(-z[j])));
        }
    }
}
