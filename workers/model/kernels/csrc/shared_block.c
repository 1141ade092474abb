/* The elementwise work of Zamba2's shared transformer blocks (layers/shared_block.py), float32.
 *
 * gelu_mul: the gated-GELU MLP's gelu(gate) · up in the erf form torch's F.gelu computes by default,
 * 0.5 · g · (1 + erf(g / √2)), with the C library's erff. The module path calls this kernel on the native path and a
 * decode plan records it, so both compute the same bits (torch's own vectorised erf rounds differently).
 * add_rows: out = x + y elementwise (a use's base projection plus its low-rank adapter; the residual stream plus a
 * use's output, whose norm the next block reads): IEEE addition, bit for bit torch's `x + y`.
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

/* out [rows, n] = gelu(gate) · up for h [rows, 2n] = [gate | up]. A scalar loop: each value is a pure function of
 * its inputs, whatever the row count or the threads (a decode plan's verification runs more rows than a step). */
void gelu_mul(const float *h, float *out, int64_t rows, int64_t n, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * n > 65536)
    for (int64_t r = 0; r < rows; ++r) {
        const float *gate = h + r * 2 * n, *up = gate + n;
        float *o = out + r * n;
        for (int64_t i = 0; i < n; ++i) {
            const float g = gate[i];
            o[i] = 0.5f * g * (1.0f + erff(g * (float)M_SQRT1_2)) * up[i];
        }
    }
}

/* out[i] = x[i] + y[i] for i < n (out may be x or y). */
void add_rows(const float *x, const float *y, float *out, int64_t n, int num_threads) {
#pragma omp parallel for simd num_threads(num_threads) schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] + y[i];
}
