/* y = Σ_g (x_q · q_g ᵀ) · sx[m, g] · sw[n, g] (+ bias): int8 weights × int8 activations, quantization="int8".
 *
 * Weights are quantized once at load, symmetric per group of G inputs (G a multiple of 4; G ≥ K: one group, per
 * output channel), and packed as [ceil(N / 48), Kp / 4, 48, 4] int8 (Kp = groups · G, zero-padded): one k-quad row
 * of a 16-column slice is 64 bytes, what `vpdpbusd` multiplies (and an AMX B-tile row). Activations are quantized
 * at each call per row and group the same way (q = round-half-even(x · 127 / max|x|)), stored with +128 as uint8
 * because `vpdpbusd` multiplies u8 × s8; the +128 comes back out through `correction` = 128 · Σ_k q[n, k] per group,
 * precomputed at load. AVX2 has no u8 × s8 dot product that cannot saturate: its path takes the activations back to
 * signed (q = stored ^ 0x80) and multiplies |w| by q with w's sign (vpsignb, vpmaddubsw: pairs ≤ 2 · 127² fit
 * int16, then vpmaddwd), which is Σ q · w, the same integer as VNNI's sum less its correction. Within a group the sum
 * is integer and exact, so every path (VNNI, AVX2, portable) and every number of rows gives the same integer; the groups are then folded in order with one fma each,
 * total = fma(float(acc_g), sw[n, g] · sx[m, g], total), identically on every path. A row's result therefore does
 * not depend on the batch it is in, nor on the path (greedy speculative output equals plain).
 * Shapes: x [M, K], panels [ceil(N / 48), Kp / 4, 48, 4] int8, scale and correction [ceil(N / 48), groups, 48]
 * (float32, int32), bias [N] or NULL, y [M, N]. The reference is `linear_w8a8.py`'s W8A8Reference.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define LANES 16
#define PANEL (3 * LANES)
#define ROW_BLOCK 64 /* rows of x per work item */
#define ROW_TILE 4   /* rows multiplied together: 12 int32 + 12 float accumulators in registers */

enum { PATH_AUTO = 0, PATH_PORTABLE = 1, PATH_VNNI = 2, PATH_AVX2 = 3 };

typedef struct {
    const uint8_t *xq; /* [M, Kp] activations + 128 */
    const float *sx;   /* [M, groups] */
    const int8_t *panels;
    const float *scale;
    const int32_t *correction;
    int64_t Kp, G, groups;
} w8a8_args;

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define HAVE_VNNI 1

static void quantize_group(const float *x, int64_t n, uint8_t *q, float *scale) {
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    __m512 vmax = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + LANES <= n; k += LANES) vmax = _mm512_max_ps(vmax, _mm512_and_ps(_mm512_loadu_ps(x + k), magnitude));
    float amax = _mm512_reduce_max_ps(vmax);
    for (; k < n; ++k) amax = fabsf(x[k]) > amax ? fabsf(x[k]) : amax;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    *scale = amax / 127.0f;
    const __m512 vinv = _mm512_set1_ps(inv), low = _mm512_set1_ps(-127.0f), high = _mm512_set1_ps(127.0f);
    for (k = 0; k + LANES <= n; k += LANES) { /* cvtps rounds half to even (the default MXCSR mode), as rintf */
        const __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(x + k), vinv), low), high);
        const __m512i shifted = _mm512_add_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(128));
        _mm_storeu_si128((__m128i *)(q + k), _mm512_cvtepi32_epi8(shifted));
    }
    for (; k < n; ++k) q[k] = (uint8_t)((int)rintf(fminf(fmaxf(x[k] * inv, -127.0f), 127.0f)) + 128);
}

/* R rows (R ≤ ROW_TILE, a constant after inlining) × one 48-column panel over every group. */
static inline __attribute__((always_inline)) void tile_vnni(const w8a8_args *a, int64_t p, int64_t m, const int R,
                                                            float *out) {
    __m512 total[ROW_TILE][3];
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < 3; ++j) total[r][j] = _mm512_setzero_ps();
    const int64_t quads = a->G / 4;
    for (int64_t g = 0; g < a->groups; ++g) {
        __m512i acc[ROW_TILE][3];
        for (int r = 0; r < R; ++r)
            for (int j = 0; j < 3; ++j) acc[r][j] = _mm512_setzero_si512();
        const int8_t *w = a->panels + (p * a->Kp + g * a->G) * PANEL;
        const uint8_t *xg = a->xq + m * a->Kp + g * a->G;
        for (int64_t q = 0; q < quads; ++q, w += 4 * PANEL) {
            const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64),
                          w2 = _mm512_loadu_si512(w + 128);
            for (int r = 0; r < R; ++r) {
                int32_t quad;
                memcpy(&quad, xg + r * a->Kp + 4 * q, sizeof quad);
                const __m512i xr = _mm512_set1_epi32(quad);
                acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], xr, w0);
                acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], xr, w1);
                acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], xr, w2);
            }
        }
        const int64_t at = (p * a->groups + g) * PANEL;
        for (int j = 0; j < 3; ++j) {
            const __m512 sw = _mm512_loadu_ps(a->scale + at + j * LANES);
            const __m512i c = _mm512_loadu_si512(a->correction + at + j * LANES);
            for (int r = 0; r < R; ++r) {
                const __m512 s = _mm512_mul_ps(sw, _mm512_set1_ps(a->sx[(m + r) * a->groups + g]));
                const __m512 exact = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][j], c));
                total[r][j] = _mm512_fmadd_ps(exact, s, total[r][j]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < 3; ++j) _mm512_storeu_ps(out + r * PANEL + j * LANES, total[r][j]);
}

static void tiles_vnni(const w8a8_args *a, int64_t p, int64_t begin, int64_t end, float *acc) {
    int64_t m = begin;
    for (; m + ROW_TILE <= end; m += ROW_TILE) tile_vnni(a, p, m, ROW_TILE, acc + (m - begin) * PANEL);
    switch (end - m) {
    case 3: tile_vnni(a, p, m, 3, acc + (m - begin) * PANEL); break;
    case 2: tile_vnni(a, p, m, 2, acc + (m - begin) * PANEL); break;
    case 1: tile_vnni(a, p, m, 1, acc + (m - begin) * PANEL); break;
    }
}
#else
#define HAVE_VNNI 0
#endif

#if defined(__AVX2__)
#include <immintrin.h>
#define HAVE_AVX2 1
#define AVX2_ROW_TILE 2 /* 2 rows × 6 vectors of 8 columns: 12 int32 accumulators of 16 ymm registers */

/* R rows (R ≤ AVX2_ROW_TILE) × one 48-column panel over every group; totals accumulate in out [R, PANEL]. */
static inline __attribute__((always_inline)) void tile_avx2(const w8a8_args *a, int64_t p, int64_t m, const int R,
                                                            float *out) {
    enum { VECTORS = PANEL / 8 }; /* a quad row of the panel: 48 columns × 4 k = 6 vectors of 32 bytes */
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    for (int i = 0; i < R * PANEL; ++i) out[i] = 0.0f;
    for (int64_t g = 0; g < a->groups; ++g) {
        __m256i acc[AVX2_ROW_TILE][VECTORS];
        for (int r = 0; r < R; ++r)
            for (int j = 0; j < VECTORS; ++j) acc[r][j] = _mm256_setzero_si256();
        const int8_t *w = a->panels + (p * a->Kp + g * a->G) * PANEL;
        const uint8_t *xg = a->xq + m * a->Kp + g * a->G;
        for (int64_t q = 0; q < a->G / 4; ++q, w += 4 * PANEL) {
            __m256i xs[AVX2_ROW_TILE];
            for (int r = 0; r < R; ++r) {
                int32_t quad;
                memcpy(&quad, xg + r * a->Kp + 4 * q, sizeof quad);
                xs[r] = _mm256_xor_si256(_mm256_set1_epi32(quad), flip); /* back to signed */
            }
            for (int j = 0; j < VECTORS; ++j) {
                const __m256i wj = _mm256_loadu_si256((const __m256i *)(w + 32 * j)), magnitude = _mm256_abs_epi8(wj);
                for (int r = 0; r < R; ++r) {
                    const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xs[r], wj));
                    acc[r][j] = _mm256_add_epi32(acc[r][j], _mm256_madd_epi16(pairs, ones));
                }
            }
        }
        const int64_t at = (p * a->groups + g) * PANEL;
        for (int j = 0; j < VECTORS; ++j) {
            const __m256 sw = _mm256_loadu_ps(a->scale + at + 8 * j);
            for (int r = 0; r < R; ++r) {
                const __m256 s = _mm256_mul_ps(sw, _mm256_set1_ps(a->sx[(m + r) * a->groups + g]));
                float *total = out + r * PANEL + 8 * j;
                _mm256_storeu_ps(total, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][j]), s, _mm256_loadu_ps(total)));
            }
        }
    }
}

static void tiles_avx2(const w8a8_args *a, int64_t p, int64_t begin, int64_t end, float *acc) {
    int64_t m = begin;
    for (; m + AVX2_ROW_TILE <= end; m += AVX2_ROW_TILE) tile_avx2(a, p, m, AVX2_ROW_TILE, acc + (m - begin) * PANEL);
    if (m < end) tile_avx2(a, p, m, 1, acc + (m - begin) * PANEL);
}
#else
#define HAVE_AVX2 0
#endif

/* Portable: the same integers and the same float steps, one row at a time. */
static void quantize_group_portable(const float *x, int64_t n, uint8_t *q, float *scale) {
    float amax = 0.0f;
    for (int64_t k = 0; k < n; ++k) amax = fabsf(x[k]) > amax ? fabsf(x[k]) : amax;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    *scale = amax / 127.0f;
    for (int64_t k = 0; k < n; ++k) q[k] = (uint8_t)((int)rintf(fminf(fmaxf(x[k] * inv, -127.0f), 127.0f)) + 128);
}

static void tiles_portable(const w8a8_args *a, int64_t p, int64_t begin, int64_t end, float *acc) {
    for (int64_t m = begin; m < end; ++m) {
        float *total = acc + (m - begin) * PANEL;
        for (int j = 0; j < PANEL; ++j) total[j] = 0.0f;
        for (int64_t g = 0; g < a->groups; ++g) {
            int32_t sums[PANEL] = {0};
            const int8_t *w = a->panels + (p * a->Kp + g * a->G) * PANEL;
            const uint8_t *xg = a->xq + m * a->Kp + g * a->G;
            for (int64_t q = 0; q < a->G / 4; ++q, w += 4 * PANEL)
                for (int j = 0; j < PANEL; ++j)
                    for (int t = 0; t < 4; ++t) sums[j] += (int32_t)xg[4 * q + t] * (int32_t)w[4 * j + t];
            const int64_t at = (p * a->groups + g) * PANEL;
            const float sx = a->sx[m * a->groups + g];
            for (int j = 0; j < PANEL; ++j)
                total[j] = fmaf((float)(sums[j] - a->correction[at + j]), a->scale[at + j] * sx, total[j]);
        }
    }
}

static int vnni_usable(void) {
#if HAVE_VNNI
    __builtin_cpu_init(); /* a shared library may run before libgcc's own initialisation */
    return __builtin_cpu_supports("avx512vnni") != 0;
#else
    return 0;
#endif
}

int64_t linear_w8a8_paths(void) {
    return (1 << PATH_PORTABLE) | (vnni_usable() << PATH_VNNI) | (HAVE_AVX2 << PATH_AVX2);
}

/* The path a call runs: the one asked for, or for PATH_AUTO the fastest here (VNNI, then AVX2, then portable). */
static int resolve_path(int path) {
    if (path == PATH_AUTO) return vnni_usable() ? PATH_VNNI : HAVE_AVX2 ? PATH_AVX2 : PATH_PORTABLE;
    if (path == PATH_VNNI && !vnni_usable()) return PATH_PORTABLE;
    if (path == PATH_AVX2 && !HAVE_AVX2) return PATH_PORTABLE;
    return path;
}

/* Row m of x [M, K] → xq[m] (+128, zero-padded to Kp) and sx[m, ·], per group; both paths round alike. */
static void quantize_row(const float *x, int64_t K, int use_vnni, const w8a8_args *a, uint8_t *xq, float *sx,
                         int64_t m) {
    for (int64_t g = 0; g < a->groups; ++g) {
        const int64_t k0 = g * a->G, n = K - k0 < a->G ? K - k0 : a->G;
        uint8_t *q = xq + m * a->Kp + k0;
        float *scale = sx + m * a->groups + g;
#if HAVE_VNNI
        if (use_vnni) quantize_group(x + m * K + k0, n, q, scale);
        else quantize_group_portable(x + m * K + k0, n, q, scale);
#else
        (void)use_vnni;
        quantize_group_portable(x + m * K + k0, n, q, scale);
#endif
        memset(q + n, 128, (size_t)(a->G - n)); /* padding: q = 0 */
    }
}

void linear_panels_w8a8(const float *x, const int8_t *panels, const float *scale, const int32_t *correction,
                        const float *bias, float *y, int64_t M, int64_t N, int64_t K, int64_t G, int path,
                        int num_threads) {
    const int64_t groups = (K + G - 1) / G, Kp = groups * G;
    const int chosen = resolve_path(path), use_vnni = chosen == PATH_VNNI;
    uint8_t *xq = malloc((size_t)(M * Kp) + 64);
    float *sx = malloc((size_t)(M * groups) * sizeof(float) + 64);
    w8a8_args a = {xq, sx, panels, scale, correction, Kp, G, groups};
    const int64_t num_panels = (N + PANEL - 1) / PANEL, num_row_blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) quantize_row(x, K, use_vnni, &a, xq, sx, m);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_panels * num_row_blocks; ++item) {
            float acc[ROW_BLOCK * PANEL];
            const int64_t p = item % num_panels, begin = (item / num_panels) * ROW_BLOCK;
            const int64_t end = begin + ROW_BLOCK < M ? begin + ROW_BLOCK : M;
            const int64_t n0 = p * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL;
#if HAVE_VNNI
            if (chosen == PATH_VNNI) tiles_vnni(&a, p, begin, end, acc);
            else
#endif
#if HAVE_AVX2
            if (chosen == PATH_AVX2) tiles_avx2(&a, p, begin, end, acc);
            else
#endif
                tiles_portable(&a, p, begin, end, acc);
            for (int64_t m = begin; m < end; ++m) {
                const float *row = acc + (m - begin) * PANEL;
                float *out = y + m * N + n0;
                for (int64_t j = 0; j < width; ++j) out[j] = bias ? row[j] + bias[n0 + j] : row[j];
            }
        }
    }
    free(xq);
    free(sx);
}

/* The top_k largest logits of each row (ties: the lower index), recomputed in float32 from the float weight
 * [N, K]: an int8 LM head whose greedy choice is float32's whenever float32's best token is among the int8 head's
 * top_k. Each dot product runs 16 lanes in k order then a fixed tree, so a row's result does not depend on M. */
static float dot(const float *a, const float *b, int64_t K) {
    float lanes[LANES] = {0};
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES)
        for (int i = 0; i < LANES; ++i) lanes[i] = fmaf(a[k + i], b[k + i], lanes[i]);
    for (int i = 0; k < K; ++k, ++i) lanes[i] = fmaf(a[k], b[k], lanes[i]);
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int i = 0; i < width; ++i) lanes[i] += lanes[i + width];
    return lanes[0];
}

void rescore_top_logits(const float *x, const float *weight, const float *bias, float *logits, int64_t M,
                        int64_t N, int64_t K, int64_t top_k, int num_threads) {
    enum { MAX_TOP = 64 };
    top_k = top_k < MAX_TOP ? (top_k < N ? top_k : N) : MAX_TOP;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t m = 0; m < M; ++m) {
        float *row = logits + m * N;
        int64_t best[MAX_TOP];
        int64_t count = 0;
        float floor = -INFINITY; /* the smallest kept value once top_k are kept */
        for (int64_t n = 0; n < N; ++n) { /* insertion into a sorted list: best[0] the largest */
            if (count == top_k && !(row[n] > floor)) continue;
            int64_t i = count < top_k ? count++ : count - 1;
            for (; i > 0 && row[n] > row[best[i - 1]]; --i) best[i] = best[i - 1];
            best[i] = n;
            if (count == top_k) floor = row[best[top_k - 1]];
        }
        for (int64_t i = 0; i < count; ++i) {
            const float value = dot(x + m * K, weight + best[i] * K, K);
            row[best[i]] = bias ? value + bias[best[i]] : value;
        }
    }
}
