/* y = (x · qᵀ) · scale (+ bias): int8 weights × float32 activations, the linear layer of quantization="int8".
 *
 * The weight is quantized once at load, symmetric per output channel (w ≈ q · scale[n], q in [-127, 127]), and
 * packed into the same column panels as linear.c's float32 weights, [ceil(N / PANEL), K, PANEL] int8 (see
 * `pack_panels_int8` in native.py). A decode step streams every weight once, so reading a quarter of the bytes is
 * what makes it faster; each LANES weights are widened to float32 in registers (sign-extend, convert) and multiplied
 * exactly as linear.c does, the scale applied once per output at the end. Every row of x walks k in the same order
 * whatever the number of rows, so a row's result does not depend on the batch it is in: a speculative
 * verification's rows equal the decode steps' (greedy speculative output equals plain, as in float32).
 * Shapes: x [M, K], panels [ceil(N / PANEL), K, PANEL] int8, scale [N], bias [N] or NULL, y [M, N].
 * The reference is F.linear(x, q · scale); tests compare the two.
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

#define K_CHUNK (4096 / LANES) /* panel rows per chunk: 12 KiB of int8, kept in L1 across the row blocks */
#define ROW_BLOCK 64           /* rows of x per work item */
#define LINE 64                /* bytes per cache line */

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
/* LANES int8 weights widened to float32 (sign-extend, convert; gcc scalarises __builtin_convertvector here). */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline vec widen(const int8_t *p) {
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    vec out;
    memcpy(&out, &v, sizeof out);
    return out;
}
#elif defined(__AVX2__)
#include <immintrin.h>
static inline vec widen(const int8_t *p) {
    int64_t bytes;
    memcpy(&bytes, p, sizeof bytes);
    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(bytes)));
    vec out;
    memcpy(&out, &v, sizeof out);
    return out;
}
#elif defined(__SSE4_1__)
#include <immintrin.h>
static inline vec widen(const int8_t *p) {
    int32_t bytes;
    memcpy(&bytes, p, sizeof bytes);
    const __m128 v = _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(bytes)));
    vec out;
    memcpy(&out, &v, sizeof out);
    return out;
}
#else
static inline vec widen(const int8_t *p) {
    vec out;
    for (int i = 0; i < LANES; ++i) out[i] = (float)p[i];
    return out;
}
#endif

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void save(float *p, vec v) { memcpy(p, &v, sizeof v); }

#define DECLARE(i)                                                                                               \
    vec c##i##0 = {0}, c##i##1 = {0}, c##i##2 = {0};                                                             \
    if (!first) {                                                                                                \
        c##i##0 = load(acc + (i) * PANEL);                                                                       \
        c##i##1 = load(acc + (i) * PANEL + LANES);                                                               \
        c##i##2 = load(acc + (i) * PANEL + 2 * LANES);                                                           \
    }
#define FMA(i)                                                                                                   \
    do {                                                                                                         \
        const float xi = x[(i) * K + k];                                                                         \
        c##i##0 += w0 * xi;                                                                                      \
        c##i##1 += w1 * xi;                                                                                      \
        c##i##2 += w2 * xi;                                                                                      \
    } while (0)
#define SAVE(i)                                                                                                  \
    do {                                                                                                         \
        save(acc + (i) * PANEL, c##i##0);                                                                        \
        save(acc + (i) * PANEL + LANES, c##i##1);                                                                \
        save(acc + (i) * PANEL + 2 * LANES, c##i##2);                                                            \
    } while (0)
/* Each k step widens one panel row and prefetches `per_k` cache lines of the next chunk from `prefetch` on. */
#define PANEL_ROW                                                                                                \
    const int8_t *wk = panel + k * PANEL;                                                                        \
    for (int64_t j = 0; j < per_k; ++j) __builtin_prefetch(prefetch + (k * per_k + j) * LINE);                   \
    const vec w0 = widen(wk), w1 = widen(wk + LANES), w2 = widen(wk + 2 * LANES)
#define TILE_ARGS                                                                                                \
    const float *x, int64_t K, const int8_t *panel, int64_t chunk, float *acc, int first, const int8_t *prefetch, \
        int64_t per_k
#define ROWS1(M) M(0)
#define ROWS2(M) ROWS1(M) M(1)
#define ROWS3(M) ROWS2(M) M(2)
#define ROWS4(M) ROWS3(M) M(3)
#define ROWS5(M) ROWS4(M) M(4)
#define ROWS6(M) ROWS5(M) M(5)
#define ROWS7(M) ROWS6(M) M(6)
#define ROWS8(M) ROWS7(M) M(7)
#define FMA_(i) FMA(i);
#define SAVE_(i) SAVE(i);
#define DEFINE_TILE(n)                                                                                           \
    static void tile##n(TILE_ARGS) {                                                                             \
        ROWS##n(DECLARE) for (int64_t k = 0; k < chunk; ++k) {                                                   \
            PANEL_ROW;                                                                                           \
            ROWS##n(FMA_)                                                                                        \
        }                                                                                                        \
        ROWS##n(SAVE_)                                                                                           \
    }
DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
DEFINE_TILE(4)
DEFINE_TILE(5)
DEFINE_TILE(6)
DEFINE_TILE(7)
DEFINE_TILE(8)

void linear_panels_int8(const float *x, const int8_t *panels, const float *scale, const float *bias, float *y,
                        int64_t M, int64_t N, int64_t K, int num_threads) {
    const int64_t num_panels = (N + PANEL - 1) / PANEL;
    const int64_t num_row_blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK; /* work items: panel × block of rows */
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t item = 0; item < num_panels * num_row_blocks; ++item) {
        float acc[ROW_BLOCK * PANEL];
        const int64_t p = item % num_panels, begin = (item / num_panels) * ROW_BLOCK;
        const int64_t end = begin + ROW_BLOCK < M ? begin + ROW_BLOCK : M;
        const int64_t n0 = p * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL;
        const int64_t rows = end - begin, chunk_lines = K_CHUNK * PANEL / LINE;
        const int64_t num_tiles = rows / TILE_ROWS + (rows % TILE_ROWS != 0);
        const int64_t share = (chunk_lines + num_tiles - 1) / num_tiles; /* next chunk's lines per row tile */
        for (int64_t k0 = 0; k0 < K; k0 += K_CHUNK) {
            const int64_t chunk = K - k0 < K_CHUNK ? K - k0 : K_CHUNK;
            const int8_t *panel = panels + (p * K + k0) * PANEL;
            const int8_t *next = panel + chunk * PANEL;
            const int64_t per_k = (share + chunk - 1) / chunk;
            const int first = k0 == 0;
#define TILE(n) tile##n(x + m * K + k0, K, panel, chunk, acc + (m - begin) * PANEL, first, next, per_k)
#define TILE_FULL_(n) TILE(n) /* TILE_ROWS expanded first */
#define TILE_FULL TILE_FULL_(TILE_ROWS)
            int64_t m = begin;
            for (; m + TILE_ROWS <= end; m += TILE_ROWS, next += share * LINE) TILE_FULL;
            switch (end - m) { /* the last 1 … TILE_ROWS - 1 rows as one tile: the panel chunk is read once for them */
            case 7: TILE(7); break;
            case 6: TILE(6); break;
            case 5: TILE(5); break;
            case 4: TILE(4); break;
            case 3: TILE(3); break;
            case 2: TILE(2); break;
            case 1: TILE(1); break;
            }
#undef TILE
#undef TILE_FULL
        }
        for (int64_t m = begin; m < end; ++m) {
            const float *row = acc + (m - begin) * PANEL;
            float *out = y + m * N + n0;
            for (int64_t j = 0; j < width; ++j) {
                const float value = row[j] * scale[n0 + j];
                out[j] = bias ? value + bias[n0 + j] : value;
            }
        }
    }
}
