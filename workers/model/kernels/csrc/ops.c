/* Small per-token operations of a decode step, float32: each is one pass instead of several PyTorch ops.
 *
 * A decode step runs them on a few KiB per layer, where PyTorch's per-op cost (dispatch, temporaries, a pass per
 * elementwise op) outweighs the arithmetic. References: RMSNorm (F.rms_norm), the residual add, silu(gate) · up,
 * relu(h)² (torch.relu(h).square()), x · sigmoid(gate), argmax; tests compare each with it. All tensors
 * contiguous, row-major.
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include "vexp.h"

static void rms_norm_row(const float *x, const float *weight, float eps, float *out, int64_t d) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < d; ++i) sum += x[i] * x[i];
    const float scale = 1.0f / sqrtf(sum / (float)d + eps);
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) out[i] = weight[i] * (x[i] * scale);
}

/* out = rmsnorm(x) · weight over rows of d. */
void rms_norm(const float *x, const float *weight, float eps, float *out, int64_t rows, int64_t d, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * d > 65536)
    for (int64_t r = 0; r < rows; ++r) rms_norm_row(x + r * d, weight, eps, out + r * d, d);
}

/* hidden += alpha · delta (in place), then out = rmsnorm(hidden) · weight: a block's residual and the next norm. */
void add_rms_norm(float *hidden, const float *delta, float alpha, const float *weight, float eps, float *out,
                  int64_t rows, int64_t d, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * d > 65536)
    for (int64_t r = 0; r < rows; ++r) {
        float *h = hidden + r * d;
        const float *e = delta + r * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) h[i] = alpha == 1.0f ? h[i] + e[i] : h[i] + alpha * e[i];
        rms_norm_row(h, weight, eps, out + r * d, d);
    }
}

/* out [rows, n] = silu(gate) · up for h [rows, 2n] = [gate | up]. */
void silu_mul(const float *h, float *out, int64_t rows, int64_t n, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * n > 65536)
    for (int64_t r = 0; r < rows; ++r) silu_mul_row(h + r * 2 * n, h + r * 2 * n + n, out + r * n, n);
}

/* out = relu(h)² elementwise (n values; NaN stays NaN, as torch.relu): the non-gated MLPs' activation. */
void relu_square(const float *h, float *out, int64_t n, int num_threads) {
#pragma omp parallel for simd num_threads(num_threads) schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; ++i) {
        const float v = h[i] > 0.0f || h[i] != h[i] ? h[i] : 0.0f;
        out[i] = v * v;
    }
}

/* out = x · sigmoid(gate) over rows of n (out may be x): gated attention's output gate (Qwen3.5 / Qwen3-Next).
 * As torch computes it, the sigmoid 1 / (1 + exp(-gate)) first, then the product; exp is vexp.h's (~2 ulp). */
void sigmoid_mul(const float *x, const float *gate, float *out, int64_t rows, int64_t n, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * n > 65536)
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * n, *gr = gate + r * n;
        float *o = out + r * n;
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES) {
            vf g, v;
            memcpy(&g, gr + i, sizeof g);
            memcpy(&v, xr + i, sizeof v);
            const vf y = v * (1.0f / (1.0f + vexpf_lanes(-g)));
            memcpy(o + i, &y, sizeof y);
        }
        for (; i < n; ++i) o[i] = xr[i] * (1.0f / (1.0f + vexpf(-gr[i])));
    }
}

/* Index of the largest value of row[0 … n) (the first one on ties, as torch.argmax); NaN counts as largest.
 * One vectorised pass: each of LANES lanes keeps its largest value and the first index holding it (a later index
 * replaces it only when strictly larger), then the lanes' maximum with the smallest index among the lanes holding
 * it. A NaN anywhere (rare) takes a second scan for the first one. */
int64_t argmax_row(const float *row, int64_t n) {
    float best = -INFINITY;
    int64_t index = 0, i = 0;
    int nan = 0;
    if (n >= LANES && n <= INT32_MAX) {
        vf lane_best;
        vi lane_index = {0}, current = {0}, seen_nan = {0};
        for (int lane = 0; lane < LANES; ++lane) current[lane] = lane;
        memcpy(&lane_best, row, sizeof lane_best);
        seen_nan |= lane_best != lane_best;
        lane_index = current;
        for (i = LANES; i + LANES <= n; i += LANES) {
            vf v;
            memcpy(&v, row + i, sizeof v);
            current += LANES;
            const vi larger = v > lane_best;
            seen_nan |= v != v;
            vi v_bits, best_bits;
            memcpy(&v_bits, &v, sizeof v);
            memcpy(&best_bits, &lane_best, sizeof lane_best);
            best_bits = (larger & v_bits) | (~larger & best_bits);
            memcpy(&lane_best, &best_bits, sizeof lane_best);
            lane_index = (larger & current) | (~larger & lane_index);
        }
        for (int lane = 0; lane < LANES; ++lane) {
            nan |= seen_nan[lane] != 0;
            if (lane_best[lane] > best || (lane_best[lane] == best && lane_index[lane] < index)) {
                best = lane_best[lane];
                index = lane_index[lane];
            }
        }
        if (best == -INFINITY) index = 0; /* every value so far -inf (or NaN): the first one */
    }
    for (; i < n; ++i) { /* the tail (or a short row) */
        nan |= row[i] != row[i];
        if (row[i] > best) {
            best = row[i];
            index = i;
        }
    }
    if (nan)
        for (int64_t j = 0; j < n; ++j)
            if (row[j] != row[j]) return j;
    return index;
}

/* argmax_row of each of `rows` rows of n. */
void argmax_rows(const float *x, int64_t *out, int64_t rows, int64_t n, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * n, n);
}
