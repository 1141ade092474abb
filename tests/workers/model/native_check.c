/* The native kernels against scalar double-precision references, as a program: for a build the test process cannot
 * load (another architecture's, run under qemu-user by test_isa_variants.py). Prints one line per check and
 * "N passed, M failed" last; exits 1 on a failure.
 *
 * Bounds: a float32 sum of K products is within K · 2^-24 · Σ|x_k w_k| of the exact sum (Higham's γ_K, plus one
 * rounding of the bias), whatever the order or fusing; elementwise functions within a few ulp. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

static int passed = 0, failed = 0;
static uint64_t seed = 12345;

static float uniform(void) { /* in [-1, 1) */
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((seed >> 40) / (double)(1 << 24)) * 2.0f - 1.0f;
}

static void check(const char *name, int ok, double worst) {
    printf("%s %s (worst %.3g of its bound)\n", ok ? "ok  " : "FAIL", name, worst);
    ok ? ++passed : ++failed;
}

/* y [M, N] against x · wᵀ + bias in double; returns the worst |error| / bound. */
static double linear_error(const float *x, const float *w, const float *bias, const float *y, int64_t M, int64_t N,
                           int64_t K) {
    double worst = 0.0;
    for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
            double exact = bias ? bias[n] : 0.0, magnitude = bias ? fabs(bias[n]) : 0.0;
            for (int64_t k = 0; k < K; ++k) {
                exact += (double)x[m * K + k] * w[n * K + k];
                magnitude += fabs((double)x[m * K + k] * w[n * K + k]);
            }
            const double bound = (K + 2) * ldexp(1.0, -24) * magnitude + 1e-30;
            const double ratio = fabs(y[m * N + n] - exact) / bound;
            worst = ratio > worst ? ratio : worst;
        }
    return worst;
}

/* w [N, K] as [ceil(N / P), K, P] column panels, zero-padded (native.pack_panels). */
static float *pack(const float *w, int64_t N, int64_t K, int64_t P) {
    const int64_t panels = (N + P - 1) / P;
    float *out = calloc(panels * K * P, sizeof(float));
    for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k) out[((n / P) * K + k) * P + n % P] = w[n * K + k];
    return out;
}

static void check_linear(int64_t M, int64_t N, int64_t K) {
    const int64_t P = linear_panel_width();
    float *x = malloc(M * K * sizeof(float)), *w = malloc(N * K * sizeof(float)), *bias = malloc(N * sizeof(float));
    float *y = malloc(M * N * sizeof(float)), *alone = malloc(N * sizeof(float));
    for (int64_t i = 0; i < M * K; ++i) x[i] = uniform();
    for (int64_t i = 0; i < N * K; ++i) w[i] = uniform();
    for (int64_t i = 0; i < N; ++i) bias[i] = uniform();
    float *panels = pack(w, N, K, P);
    linear_panels(x, panels, bias, y, M, N, K, 2);
    const double worst = linear_error(x, w, bias, y, M, N, K);
    int same = 1; /* each row as if alone in its call: bit for bit */
    for (int64_t m = 0; m < M; ++m) {
        linear_panels(x + m * K, panels, bias, alone, 1, N, K, 1);
        same &= memcmp(alone, y + m * N, N * sizeof(float)) == 0;
    }
    char name[128];
    snprintf(name, sizeof name, "linear_panels M=%lld N=%lld K=%lld (rows batch-invariant: %s)", (long long)M,
             (long long)N, (long long)K, same ? "yes" : "NO");
    check(name, worst <= 1.0 && same, worst);
    /* int8: q · scale with q in [-127, 127], the same panels as int8 */
    int8_t *q = malloc(N * K), *qpanels = calloc(((N + P - 1) / P) * K * P, 1);
    float *scale = malloc(N * sizeof(float)), *dequantized = malloc(N * K * sizeof(float));
    for (int64_t n = 0; n < N; ++n) {
        scale[n] = 0.01f + 0.001f * (float)(n % 7);
        for (int64_t k = 0; k < K; ++k) {
            q[n * K + k] = (int8_t)lrintf(uniform() * 127.0f);
            dequantized[n * K + k] = q[n * K + k] * scale[n];
            qpanels[((n / P) * K + k) * P + n % P] = q[n * K + k];
        }
    }
    linear_panels_int8(x, qpanels, scale, NULL, y, M, N, K, 2);
    /* two more roundings than the float32 bound counts: the scale's product, and the reference's q · scale */
    const double worst8 = linear_error(x, dequantized, NULL, y, M, N, K) * (K + 2.0) / (K + 4.0);
    snprintf(name, sizeof name, "linear_panels_int8 M=%lld N=%lld K=%lld", (long long)M, (long long)N, (long long)K);
    check(name, worst8 <= 1.0, worst8);
    free(x), free(w), free(bias), free(y), free(alone), free(panels), free(q), free(qpanels), free(scale);
    free(dequantized);
}

static void check_bf16(int64_t M, int64_t N, int64_t K) {
    const int64_t P = linear_panel_width(), align = linear_bf16_k_align(), Kp = (K + align - 1) / align * align;
    float *x = malloc(M * K * sizeof(float)), *w = malloc(N * K * sizeof(float)), *y = malloc(M * N * sizeof(float));
    uint16_t *panels = calloc(((N + P - 1) / P) * Kp * P, sizeof(uint16_t));
    for (int64_t i = 0; i < M * K; ++i) x[i] = uniform();
    for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k) { /* a weight bfloat16 holds exactly: the top 16 bits of a float */
            uint32_t bits;
            float value = uniform();
            memcpy(&bits, &value, sizeof bits);
            bits &= 0xffff0000u;
            memcpy(&w[n * K + k], &bits, sizeof bits);
            panels[(((n / P) * (Kp / 2) + k / 2) * P + n % P) * 2 + k % 2] = (uint16_t)(bits >> 16);
        }
    linear_panels_bf16(x, panels, NULL, y, M, N, K, 0 /* portable: float32 activations */, 2);
    const double worst = linear_error(x, w, NULL, y, M, N, K);
    char name[128];
    snprintf(name, sizeof name, "linear_panels_bf16 (portable) M=%lld N=%lld K=%lld", (long long)M, (long long)N,
             (long long)K);
    check(name, worst <= 1.0, worst);
    free(x), free(w), free(y), free(panels);
}

static void check_elementwise(void) {
    enum { ROWS = 3, D = 77 };
    float h[ROWS * 2 * D], out[ROWS * D], weight[D], normed[ROWS * D];
    for (int i = 0; i < ROWS * 2 * D; ++i) h[i] = uniform() * 30.0f; /* far into both tails of silu */
    for (int i = 0; i < D; ++i) weight[i] = uniform();
    silu_mul(h, out, ROWS, D, 2);
    double worst = 0.0;
    for (int r = 0; r < ROWS; ++r)
        for (int i = 0; i < D; ++i) {
            const double g = h[r * 2 * D + i], u = h[r * 2 * D + D + i], exact = g / (1.0 + exp(-g)) * u;
            const double ratio = fabs(out[r * D + i] - exact) / (1e-5 * fabs(exact) + 1e-30);
            worst = ratio > worst ? ratio : worst;
        }
    check("silu_mul (relative 1e-5)", worst <= 1.0, worst);
    rms_norm(h, weight, 1e-5f, normed, ROWS, D, 2); /* rows of h as [ROWS · 2, D]: the first ROWS */
    worst = 0.0;
    for (int r = 0; r < ROWS; ++r) {
        double squares = 0.0;
        for (int i = 0; i < D; ++i) squares += (double)h[r * D + i] * h[r * D + i];
        const double inverse = 1.0 / sqrt(squares / D + 1e-5);
        for (int i = 0; i < D; ++i) {
            const double exact = h[r * D + i] * inverse * weight[i];
            const double ratio = fabs(normed[r * D + i] - exact) / (1e-5 * fabs(exact) + 1e-6);
            worst = ratio > worst ? ratio : worst;
        }
    }
    check("rms_norm (relative 1e-5)", worst <= 1.0, worst);
}

static void check_argmax(void) {
    int ok = 1;
    for (int64_t n = 1; n <= 70; n += 3) {
        float row[70];
        for (int64_t i = 0; i < n; ++i) row[i] = uniform();
        int64_t expected = 0;
        for (int64_t i = 1; i < n; ++i) expected = row[i] > row[expected] ? i : expected;
        ok &= argmax_row(row, n) == expected;
        if (n > 5) { /* a tie: the first index wins; then a NaN, which counts as the largest */
            row[n - 1] = row[2] = 5.0f;
            ok &= argmax_row(row, n) == 2;
            row[n - 2] = NAN;
            ok &= argmax_row(row, n) == n - 2;
        }
    }
    check("argmax_row (ties, NaN, tails)", ok, 0.0);
}

int main(void) {
    printf("kernels built for %s, panels of %lld columns\n", kernel_isa(), (long long)linear_panel_width());
    const int64_t rows[] = {1, 2, 3, 5, 8, 9, 64, 67}, shapes[][2] = {{1, 1}, {13, 37}, {50, 130}, {100, 64}};
    for (size_t r = 0; r < sizeof rows / sizeof rows[0]; ++r)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; ++s) check_linear(rows[r], shapes[s][0], shapes[s][1]);
    check_bf16(1, 50, 37);
    check_bf16(9, 100, 130);
    check_elementwise();
    check_argmax();
    printf("native_check: %d checks ok, %d failed\n", passed, failed);
    return failed != 0;
}
