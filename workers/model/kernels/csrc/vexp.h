/* exp and silu for float32 vectors: the activations of the native kernels.
 *
 * libm's expf is a function call per element, which no compiler vectorises; this is Cephes' expf (range reduction
 * by ln 2, a degree-6 polynomial), within ~2 ulp of expf, on LANES lanes (simd.h: the instruction set's vector width)
 * with GCC vector types (casts between vf and vi reinterpret bits). Every lane computes the same function, so a
 * result does not depend on the width. x is clamped to [-87.3, 88.7].
 */
#ifndef HYBRIDGEN_VEXP_H
#define HYBRIDGEN_VEXP_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

/* One lane (loop tails). */
static inline float vexpf(float x) {
    x = fminf(fmaxf(x, -87.3f), 88.7f);
    const float shift = 12582912.0f; /* 1.5 · 2^23: adding and subtracting it rounds to the nearest integer */
    const float n = (x * 1.44269504088896341f + shift) - shift;
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } scale = {.i = ((int32_t)n + 127) << 23}; /* 2^n */
    return p * scale.f;
}

typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));

/* vexpf on LANES lanes with GCC vector types (casts between vf and vi reinterpret the bits). */
static inline vf vexpf_lanes(vf x) {
    const vf zero = {0};
    const vf lo = zero - 87.3f, hi = zero + 88.7f;
    vi below = x < lo, above = x > hi;
    x = (vf)(((vi)x & ~below) | ((vi)lo & below));
    x = (vf)(((vi)x & ~above) | ((vi)hi & above));
    const float shift = 12582912.0f;
    const vf n = (x * 1.44269504088896341f + shift) - shift;
    const vf r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (vf)((__builtin_convertvector(n, vi) + 127) << 23);
}

/* v[i] = silu(v[i]) = v / (1 + exp(-v)), in place. */
static inline void silu_inplace(float *v, int64_t n) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        vf x;
        memcpy(&x, v + i, sizeof x);
        x = x / (1.0f + vexpf_lanes(-x));
        memcpy(v + i, &x, sizeof x);
    }
    for (; i < n; ++i) v[i] = v[i] / (1.0f + vexpf(-v[i]));
}

/* out[i] = silu(gate[i]) · up[i]. */
static inline void silu_mul_row(const float *gate, const float *up, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        vf g, u;
        memcpy(&g, gate + i, sizeof g);
        memcpy(&u, up + i, sizeof u);
        const vf y = g / (1.0f + vexpf_lanes(-g)) * u;
        memcpy(out + i, &y, sizeof y);
    }
    for (; i < n; ++i) out[i] = gate[i] / (1.0f + vexpf(-gate[i])) * up[i];
}

#endif
