/* The elementwise work of Zamba2's shared transformer blocks (layers/shared_block.py), float32.
 *
 * gelu_mul: the gated-GELU MLP's gelu(gate) · up, the erf form torch's F.gelu computes by default,
 * 0.5 · g · (1 + erf(g / √2)). erf is Abramowitz & Stegun 7.1.26 (|error| ≤ 1.5e-7), the approximation torch's own
 * vectorised erf uses, with vexp.h's exp, on LANES lanes; 1 + erf(x) for x < 0 is computed as erfc(|x|) directly
 * (no cancellation in the negative tail). The module path calls this kernel on the native path and a decode plan
 * records it, so both compute the same bits; every lane and the scalar tail compute the same function.
 * add_rows: out = x + y elementwise (a use's base projection plus its low-rank adapter; the residual stream plus a
 * use's output, whose norm the next block reads): IEEE addition, bit for bit torch's `x + y`.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "vexp.h"

#define ERF_P 0.3275911f
#define ERF_A1 0.254829592f
#define ERF_A2 -0.284496736f
#define ERF_A3 1.421413741f
#define ERF_A4 -1.453152027f
#define ERF_A5 1.061405429f
#define ERFC_UNDERFLOW 87.0f /* exp(-x²) is below float32's normal range past it (vexp.h clamps there): erfc = 0 */

/* 1 + erf(x) for one value (loop tails): erfc(|x|) = poly(t) · t · exp(−x²), t = 1 / (1 + p|x|). */
static inline float one_plus_erf(float x) {
    const float a = fabsf(x), t = 1.0f / (1.0f + ERF_P * a);
    const float poly = (((ERF_A5 * t + ERF_A4) * t + ERF_A3) * t + ERF_A2) * t + ERF_A1;
    const float erfc = a * a < ERFC_UNDERFLOW ? poly * t * vexpf(-(a * a)) : 0.0f;
    return x < 0.0f ? erfc : 2.0f - erfc;
}

/* one_plus_erf on LANES lanes. */
static inline vf one_plus_erf_lanes(vf x) {
    const vf zero = {0};
    const vf a = (vf)((vi)x & 0x7fffffff), t = 1.0f / (1.0f + ERF_P * a); /* |x|: the sign bit cleared */
    const vf poly = (((ERF_A5 * t + ERF_A4) * t + ERF_A3) * t + ERF_A2) * t + ERF_A1;
    const vf erfc = (vf)((vi)(poly * t * vexpf_lanes(-(a * a))) & (a * a < ERFC_UNDERFLOW));
    const vi negative = x < zero;
    return (vf)(((vi)erfc & negative) | ((vi)(2.0f - erfc) & ~negative));
}

/* out [rows, n] = gelu(gate) · up for h [rows, 2n] = [gate | up]. */
void gelu_mul(const float *h, float *out, int64_t rows, int64_t n, int num_threads) {
    const float half_sqrt = (float)M_SQRT1_2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * n > 65536)
    for (int64_t r = 0; r < rows; ++r) {
        const float *gate = h + r * 2 * n, *up = gate + n;
        float *o = out + r * n;
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES) {
            vf g, u;
            memcpy(&g, gate + i, sizeof g);
            memcpy(&u, up + i, sizeof u);
            const vf y = 0.5f * g * one_plus_erf_lanes(g * half_sqrt) * u;
            memcpy(o + i, &y, sizeof y);
        }
        for (; i < n; ++i) o[i] = 0.5f * gate[i] * one_plus_erf(gate[i] * half_sqrt) * up[i];
    }
}

/* out[i] = x[i] + y[i] for i < n (out may be x or y). */
void add_rows(const float *x, const float *y, float *out, int64_t n, int num_threads) {
#pragma omp parallel for simd num_threads(num_threads) schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] + y[i];
}
