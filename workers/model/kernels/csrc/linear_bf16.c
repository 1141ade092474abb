/* y = x · wᵀ (+ bias) with bfloat16 weights and float32 activations and outputs: the linear layer of
 * dtype="bfloat16" on CPU.
 *
 * The weight is packed once at load (see `pack_panels_bf16` in native.py) into panels of PANEL output columns whose
 * rows hold pairs of consecutive k: [ceil(N / PANEL), Kp / 2, PANEL, 2] bf16, Kp = K rounded up to K_ALIGN (zeros
 * past K and past N). A 16-column slice of a panel row is 64 bytes: one 16-lane vdpbf16ps operand, and one row of an
 * AMX B tile (16 rows of k pairs = 32 k, loaded with the panel's 192-byte row stride). Three paths:
 *   BF16_AMX      tdpbf16ps on 16-row × 32-k tiles (x rounded to bf16, rows padded to 16 with zeros);
 *   BF16_AVX512   vdpbf16ps, rows × 48 columns in 8-row register tiles (x rounded to bf16);
 *   BF16_PORTABLE bf16 widened to float32 in registers (a 16-bit shift), float32 FMA, x as it is.
 * The path is an argument: native_bf16.py picks one per process (`bf16_path`, by measurement), so a row's result
 * never depends on how many rows a call has — every path walks k in the same order for every row whatever M is, and
 * rounds x the same way — and a speculative verification's rows equal the decode steps' (greedy speculative output
 * equals plain). x is rounded to bf16 (nearest even) once per call into a scratch buffer for the bf16 paths.
 * Shapes: x [M, K], panels [ceil(N / PANEL), Kp / 2, PANEL, 2], bias [N] or NULL, y [M, N].
 * The reference is F.linear(x.bfloat16().float(), w.bfloat16().float()) (portable: F.linear(x, w.bfloat16().float()));
 * tests compare them.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

#define K_ALIGN 32             /* one AMX tile's k depth */
#define K_CHUNK (2048 / LANES) /* k pairs per chunk: 24 KiB of panel, kept in L1 across the row blocks */
#define ROW_BLOCK 64  /* rows of x per work item */
#define AMX_ROWS 16   /* rows of an AMX tile */

enum { BF16_PORTABLE = 0, BF16_AVX512 = 1, BF16_AMX = 2 };

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef uint32_t uvec __attribute__((vector_size(LANES * sizeof(uint32_t))));

int64_t linear_bf16_k_align(void) { return K_ALIGN; }

/* float32 → bfloat16, round to nearest even (NaN stays NaN), as torch's .to(torch.bfloat16). */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void save(float *p, vec v) { memcpy(p, &v, sizeof v); }

/* ---- portable: pairs widened to two float32 vectors (k even: low half, k odd: high half) ---- */
static inline void widen_pairs(const uint16_t *p, vec *even, vec *odd) {
    uvec u;
    memcpy(&u, p, sizeof u);
    const uvec lo = u << 16, hi = u & 0xffff0000u;
    memcpy(even, &lo, sizeof *even);
    memcpy(odd, &hi, sizeof *odd);
}

#define P_DECLARE(i)                                                                                             \
    vec c##i##0 = {0}, c##i##1 = {0}, c##i##2 = {0};                                                             \
    if (!first) {                                                                                                \
        c##i##0 = load(acc + (i) * PANEL);                                                                       \
        c##i##1 = load(acc + (i) * PANEL + LANES);                                                               \
        c##i##2 = load(acc + (i) * PANEL + 2 * LANES);                                                           \
    }
#define P_FMA(i)                                                                                                 \
    do {                                                                                                         \
        const float x0 = x[(i) * Kp + 2 * j], x1 = x[(i) * Kp + 2 * j + 1];                                      \
        c##i##0 += e0 * x0;                                                                                      \
        c##i##0 += o0 * x1;                                                                                      \
        c##i##1 += e1 * x0;                                                                                      \
        c##i##1 += o1 * x1;                                                                                      \
        c##i##2 += e2 * x0;                                                                                      \
        c##i##2 += o2 * x1;                                                                                      \
    } while (0);
#define P_SAVE(i)                                                                                                \
    save(acc + (i) * PANEL, c##i##0);                                                                            \
    save(acc + (i) * PANEL + LANES, c##i##1);                                                                    \
    save(acc + (i) * PANEL + 2 * LANES, c##i##2);
#define ROWS1(M) M(0)
#define ROWS2(M) ROWS1(M) M(1)
#define ROWS3(M) ROWS2(M) M(2)
#define ROWS4(M) ROWS3(M) M(3)
#define ROWS5(M) ROWS4(M) M(4)
#define ROWS6(M) ROWS5(M) M(5)
#define ROWS7(M) ROWS6(M) M(6)
#define ROWS8(M) ROWS7(M) M(7)
/* acc [rows, PANEL] (+)= x[rows, chunk pairs] · panel[chunk pairs, PANEL]; x (float, row stride Kp) and panel
 * start at the chunk. */
#define P_DEFINE(n)                                                                                              \
    static void ptile##n(const float *x, int64_t Kp, const uint16_t *panel, int64_t chunk, float *acc, int first) { \
        ROWS##n(P_DECLARE) for (int64_t j = 0; j < chunk; ++j) {                                                 \
            const uint16_t *wj = panel + j * 2 * PANEL;                                                          \
            vec e0, o0, e1, o1, e2, o2;                                                                          \
            widen_pairs(wj, &e0, &o0);                                                                           \
            widen_pairs(wj + 2 * LANES, &e1, &o1);                                                               \
            widen_pairs(wj + 4 * LANES, &e2, &o2);                                                               \
            ROWS##n(P_FMA)                                                                                       \
        }                                                                                                        \
        ROWS##n(P_SAVE)                                                                                          \
    }
P_DEFINE(1)
P_DEFINE(2)
P_DEFINE(3)
P_DEFINE(4)
P_DEFINE(5)
P_DEFINE(6)
P_DEFINE(7)
P_DEFINE(8)

/* ---- AVX512-BF16: vdpbf16ps of a broadcast x pair with 16 columns' weight pairs ---- */
#if defined(__AVX512BF16__)
#include <immintrin.h>
#define B_DECLARE(i)                                                                                             \
    __m512 c##i##0 = _mm512_setzero_ps(), c##i##1 = _mm512_setzero_ps(), c##i##2 = _mm512_setzero_ps();         \
    if (!first) {                                                                                                \
        c##i##0 = _mm512_loadu_ps(acc + (i) * PANEL);                                                            \
        c##i##1 = _mm512_loadu_ps(acc + (i) * PANEL + LANES);                                                    \
        c##i##2 = _mm512_loadu_ps(acc + (i) * PANEL + 2 * LANES);                                                \
    }
#define B_FMA(i)                                                                                                 \
    do {                                                                                                         \
        const __m512bh xi = (__m512bh)_mm512_set1_epi32((int)xpairs[(i) * (Kp / 2) + j]);                        \
        c##i##0 = _mm512_dpbf16_ps(c##i##0, xi, w0);                                                             \
        c##i##1 = _mm512_dpbf16_ps(c##i##1, xi, w1);                                                             \
        c##i##2 = _mm512_dpbf16_ps(c##i##2, xi, w2);                                                             \
    } while (0);
#define B_SAVE(i)                                                                                                \
    _mm512_storeu_ps(acc + (i) * PANEL, c##i##0);                                                                \
    _mm512_storeu_ps(acc + (i) * PANEL + LANES, c##i##1);                                                        \
    _mm512_storeu_ps(acc + (i) * PANEL + 2 * LANES, c##i##2);
#define B_DEFINE(n)                                                                                              \
    static void btile##n(const uint32_t *xpairs, int64_t Kp, const uint16_t *panel, int64_t chunk, float *acc,   \
                         int first) {                                                                            \
        ROWS##n(B_DECLARE) for (int64_t j = 0; j < chunk; ++j) {                                                 \
            const uint16_t *wj = panel + j * 2 * PANEL;                                                          \
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wj);                                                \
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wj + 2 * LANES);                                   \
            const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wj + 4 * LANES);                                    \
            ROWS##n(B_FMA)                                                                                       \
        }                                                                                                        \
        ROWS##n(B_SAVE)                                                                                          \
    }
B_DEFINE(1)
B_DEFINE(2)
B_DEFINE(3)
B_DEFINE(4)
B_DEFINE(5)
B_DEFINE(6)
B_DEFINE(7)
B_DEFINE(8)
#endif

/* One work item of the register-tile paths: acc [rows, PANEL] = x rows [begin, end) · panel p over all k pairs. */
static void register_item(int path, const void *xs, int64_t Kp, const uint16_t *panel, int64_t begin, int64_t end,
                          float *acc) {
    for (int64_t j0 = 0; j0 < Kp / 2; j0 += K_CHUNK) {
        const int64_t chunk = Kp / 2 - j0 < K_CHUNK ? Kp / 2 - j0 : K_CHUNK;
        const uint16_t *part = panel + j0 * 2 * PANEL;
        const int first = j0 == 0;
        for (int64_t m = begin; m < end; m += TILE_ROWS) {
            const int64_t n = end - m < TILE_ROWS ? end - m : TILE_ROWS; /* the last 1 … TILE_ROWS - 1 as one */
            float *a = acc + (m - begin) * PANEL;
            if (path == BF16_PORTABLE) {
                const float *x = (const float *)xs + m * Kp + 2 * j0;
                switch (n) {
                case 8: ptile8(x, Kp, part, chunk, a, first); break;
                case 7: ptile7(x, Kp, part, chunk, a, first); break;
                case 6: ptile6(x, Kp, part, chunk, a, first); break;
                case 5: ptile5(x, Kp, part, chunk, a, first); break;
                case 4: ptile4(x, Kp, part, chunk, a, first); break;
                case 3: ptile3(x, Kp, part, chunk, a, first); break;
                case 2: ptile2(x, Kp, part, chunk, a, first); break;
                default: ptile1(x, Kp, part, chunk, a, first); break;
                }
            }
#if defined(__AVX512BF16__)
            else {
                const uint32_t *x = (const uint32_t *)xs + m * (Kp / 2) + j0;
                switch (n) {
                case 8: btile8(x, Kp, part, chunk, a, first); break;
                case 7: btile7(x, Kp, part, chunk, a, first); break;
                case 6: btile6(x, Kp, part, chunk, a, first); break;
                case 5: btile5(x, Kp, part, chunk, a, first); break;
                case 4: btile4(x, Kp, part, chunk, a, first); break;
                case 3: btile3(x, Kp, part, chunk, a, first); break;
                case 2: btile2(x, Kp, part, chunk, a, first); break;
                default: btile1(x, Kp, part, chunk, a, first); break;
                }
            }
#endif
        }
    }
}

/* ---- AMX: C tiles 0-2 (16 rows × 16 columns each), A tile 3 (16 rows × 32 k), B tiles 4-6 (32 k × 16 columns) ---- */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void amx_configure(void) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    for (int t = 0; t < 7; ++t) {
        config.rows[t] = AMX_ROWS;
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
}

/* acc [16, PANEL] = 16 rows of x (bf16, row stride Kp) · panel over all Kp. */
static void amx_block(const uint16_t *x, int64_t Kp, const uint16_t *panel, float *acc) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int64_t k = 0; k < Kp; k += K_ALIGN) {
        const uint16_t *b = panel + k * PANEL; /* k / 2 pair rows of 2 · PANEL values */
        _tile_loadd(3, x + k, Kp * 2);
        _tile_loadd(4, b, PANEL * 4);
        _tile_loadd(5, b + 2 * LANES, PANEL * 4);
        _tile_loadd(6, b + 4 * LANES, PANEL * 4);
        _tile_dpbf16ps(0, 3, 4);
        _tile_dpbf16ps(1, 3, 5);
        _tile_dpbf16ps(2, 3, 6);
    }
    _tile_stored(0, acc, PANEL * 4);
    _tile_stored(1, acc + LANES, PANEL * 4);
    _tile_stored(2, acc + 2 * LANES, PANEL * 4);
}

/* Linux: ask once for the AMX tile data state (ARCH_REQ_XCOMP_PERM, XTILEDATA); 1 when granted. */
static int amx_granted(void) {
    static int state = 0; /* 0 not asked yet, 1 granted, -1 refused (a benign race: every asker gets the same) */
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    return state == 1;
}
#endif

/* Whether `path` can run here: built into this library, and the CPU (and for AMX the OS) allow it. */
int linear_bf16_path_available(int path) {
    if (path == BF16_PORTABLE) return 1;
#if defined(__AVX512BF16__)
    if (path == BF16_AVX512) return __builtin_cpu_supports("avx512bf16");
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (path == BF16_AMX) return amx_granted();
#endif
    return 0;
}

/* x [M, K] float → scratch rows of Kp (zero padded; rows past M up to `rows` zeros): float or bf16 for `path`. */
static void stage_rows(int path, const float *x, void *xs, int64_t M, int64_t rows, int64_t K, int64_t Kp) {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < rows; ++m) {
        if (path == BF16_PORTABLE) {
            float *out = (float *)xs + m * Kp;
            if (m < M) memcpy(out, x + m * K, K * sizeof(float));
            memset(out + (m < M ? K : 0), 0, (m < M ? Kp - K : Kp) * sizeof(float));
        } else {
            uint16_t *out = (uint16_t *)xs + m * Kp;
            const int64_t valid = m < M ? K : 0;
            for (int64_t k = 0; k < valid; ++k) out[k] = to_bf16(x[m * K + k]);
            memset(out + valid, 0, (Kp - valid) * sizeof(uint16_t));
        }
    }
}

static void write_rows(const float *acc, const float *bias, float *y, int64_t begin, int64_t end, int64_t N,
                       int64_t n0) {
    const int64_t width = N - n0 < PANEL ? N - n0 : PANEL;
    for (int64_t m = begin; m < end; ++m) {
        const float *row = acc + (m - begin) * PANEL;
        float *out = y + m * N + n0;
        for (int64_t j = 0; j < width; ++j) out[j] = bias ? row[j] + bias[n0 + j] : row[j];
    }
}

void linear_panels_bf16(const float *x, const uint16_t *panels, const float *bias, float *y, int64_t M, int64_t N,
                        int64_t K, int path, int num_threads) {
    if (!linear_bf16_path_available(path)) path = BF16_PORTABLE; /* native.py never asks for one it lacks */
    const int64_t Kp = (K + K_ALIGN - 1) / K_ALIGN * K_ALIGN;
    const int64_t rows = (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS; /* AMX reads whole 16-row tiles */
    const size_t bytes = (size_t)(rows * Kp) * (path == BF16_PORTABLE ? sizeof(float) : sizeof(uint16_t));
    void *xs = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!xs) return;
    const int64_t num_panels = (N + PANEL - 1) / PANEL;
    const int64_t num_row_blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK; /* work items: panel × block of rows */
#pragma omp parallel num_threads(num_threads)
    {
        stage_rows(path, x, xs, M, rows, K, Kp); /* ends with the loop's barrier */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
        if (path == BF16_AMX) amx_configure();
#endif
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_panels * num_row_blocks; ++item) {
            float acc[ROW_BLOCK * PANEL];
            const int64_t p = item % num_panels, begin = (item / num_panels) * ROW_BLOCK;
            const int64_t end = begin + ROW_BLOCK < M ? begin + ROW_BLOCK : M;
            const uint16_t *panel = panels + p * Kp * PANEL;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
            if (path == BF16_AMX) {
                for (int64_t m = begin; m < end; m += AMX_ROWS)
                    amx_block((const uint16_t *)xs + m * Kp, Kp, panel, acc + (m - begin) * PANEL);
            } else
#endif
                register_item(path, xs, Kp, panel, begin, end, acc);
            write_rows(acc, bias, y, begin, end, N, p * PANEL);
        }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
        if (path == BF16_AMX) _tile_release();
#endif
    }
    free(xs);
}
