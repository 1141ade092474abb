/* y = x · wᵀ (+ bias), float32, with the weight packed into column panels: the CPU linear layer.
 *
 * Decode steps multiply a few rows by every weight of the model, so a linear layer is bound by streaming its
 * weight from memory; oneDNN and BLAS stream it at well under the bandwidth there and spend ~25 µs per call.
 * Here the weight is packed once at load into panels of PANEL output columns, [ceil(N / PANEL), K, PANEL]
 * (zero-padded; see `pack_panels` in native.py), so each thread reads its panels as one contiguous stream.
 * A panel is walked in chunks of K_CHUNK rows that stay in L1 while every block of TILE_ROWS rows of x (then the
 * rest, as one tile, so that a verification's few rows read the chunk once) is multiplied by them, and the next
 * chunk in memory is prefetched meanwhile, spread evenly over the row blocks' k steps so that memory streaming and
 * arithmetic overlap (issuing it all in the first block left the others waiting: 32 rows ran 11–16% slower).
 * Micro-kernels hold a rows × PANEL tile of y in vector registers (simd.h sizes it to the instruction set) and
 * broadcast x; partial sums live in a small per-thread buffer between chunks.
 * Shapes: x [M, K], panels [ceil(N / PANEL), K, PANEL], bias [N] or NULL, y [M, N].
 * The reference is torch.nn.functional.linear; tests compare the two.
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

#define K_CHUNK (1024 / LANES) /* panel rows per chunk: 12 KiB, kept in L1 across the row blocks */
#define ROW_BLOCK 64           /* rows of x per work item (decode steps: one item per panel) */
#define LINE_FLOATS 16         /* floats per 64-byte cache line */

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void save(float *p, vec v) { memcpy(p, &v, sizeof v); }

/* Accumulators of tile row i: zero on the first chunk, else the partial sums in acc. */
#define DECLARE(i)                                                                                               \
    vec c##i##0 = {0}, c##i##1 = {0}, c##i##2 = {0};                                                             \
    if (!first) {                                                                                                \
        c##i##0 = load(acc + (i) * PANEL);                                                                       \
        c##i##1 = load(acc + (i) * PANEL + LANES);                                                               \
        c##i##2 = load(acc + (i) * PANEL + 2 * LANES);                                                           \
    }
#define LOAD_PANEL_ROW                                                                                           \
    const float *wk = panel + k * PANEL;                                                                         \
    for (int64_t j = 0; j < prefetch_per_k; ++j) __builtin_prefetch(prefetch + (k * prefetch_per_k + j) * LINE_FLOATS); \
    vec w0 = load(wk), w1 = load(wk + LANES), w2 = load(wk + 2 * LANES);                                      \
    IN_REGISTERS(w0, w1, w2)
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

/* acc [rows, PANEL] (+)= x[rows, chunk] · panel[chunk, PANEL]; x and panel start at the chunk. Each k step also
 * prefetches `prefetch_per_k` cache lines (of 16 floats) from `prefetch` on. */
#define TILE_ARGS                                                                                                \
    const float *x, int64_t K, const float *panel, int64_t chunk, float *acc, int first, const float *prefetch,      \
        int64_t prefetch_per_k

static void tile8(TILE_ARGS) {
    DECLARE(0) DECLARE(1) DECLARE(2) DECLARE(3) DECLARE(4) DECLARE(5) DECLARE(6) DECLARE(7)
    for (int64_t k = 0; k < chunk; ++k) {
        LOAD_PANEL_ROW;
        FMA(0); FMA(1); FMA(2); FMA(3); FMA(4); FMA(5); FMA(6); FMA(7);
    }
    SAVE(0); SAVE(1); SAVE(2); SAVE(3); SAVE(4); SAVE(5); SAVE(6); SAVE(7);
}

static void tile7(TILE_ARGS) {
    DECLARE(0) DECLARE(1) DECLARE(2) DECLARE(3) DECLARE(4) DECLARE(5) DECLARE(6)
    for (int64_t k = 0; k < chunk; ++k) {
        LOAD_PANEL_ROW;
        FMA(0); FMA(1); FMA(2); FMA(3); FMA(4); FMA(5); FMA(6);
    }
    SAVE(0); SAVE(1); SAVE(2); SAVE(3); SAVE(4); SAVE(5); SAVE(6);
}

static void tile6(TILE_ARGS) {
    DECLARE(0) DECLARE(1) DECLARE(2) DECLARE(3) DECLARE(4) DECLARE(5)
    for (int64_t k = 0; k < chunk; ++k) {
        LOAD_PANEL_ROW;
        FMA(0); FMA(1); FMA(2); FMA(3); FMA(4); FMA(5);
    }
    SAVE(0); SAVE(1); SAVE(2); SAVE(3); SAVE(4); SAVE(5);
}

static void tile5(TILE_ARGS) {
    DECLARE(0) DECLARE(1) DECLARE(2) DECLARE(3) DECLARE(4)
    for (int64_t k = 0; k < chunk; ++k) {
        LOAD_PANEL_ROW;
        FMA(0); FMA(1); FMA(2); FMA(3); FMA(4);
    }
    SAVE(0); SAVE(1); SAVE(2); SAVE(3); SAVE(4);
}

static void tile4(TILE_ARGS) {
    DECLARE(0) DECLARE(1) DECLARE(2) DECLARE(3)
    for (int64_t k = 0; k < chunk; ++k) {
        LOAD_PANEL_ROW;
        FMA(0); FMA(1); FMA(2); FMA(3);
    }
    SAVE(0); SAVE(1); SAVE(2); SAVE(3);
}

static void tile3(TILE_ARGS) {
    DECLARE(0) DECLARE(1) DECLARE(2)
    for (int64_t k = 0; k < chunk; ++k) {
        LOAD_PANEL_ROW;
        FMA(0); FMA(1); FMA(2);
    }
    SAVE(0); SAVE(1); SAVE(2);
}

static void tile2(TILE_ARGS) {
    DECLARE(0) DECLARE(1)
    for (int64_t k = 0; k < chunk; ++k) {
        LOAD_PANEL_ROW;
        FMA(0); FMA(1);
    }
    SAVE(0); SAVE(1);
}

static void tile1(TILE_ARGS) {
    DECLARE(0)
    for (int64_t k = 0; k < chunk; ++k) {
        LOAD_PANEL_ROW;
        FMA(0);
    }
    SAVE(0);
}

int64_t linear_panel_width(void) { return PANEL; }

const char *kernel_isa(void) { return KERNEL_ISA; }

void linear_panels(const float *x, const float *panels, const float *bias, float *y, int64_t M, int64_t N,
                   int64_t K, int num_threads) {
    const int64_t num_panels = (N + PANEL - 1) / PANEL;
    const int64_t num_row_blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK; /* work items: panel × block of rows */
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t item = 0; item < num_panels * num_row_blocks; ++item) {
        float acc[ROW_BLOCK * PANEL];
        const int64_t p = item % num_panels, begin = (item / num_panels) * ROW_BLOCK;
        const int64_t end = begin + ROW_BLOCK < M ? begin + ROW_BLOCK : M;
        const int64_t n0 = p * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL;
        /* The next chunk in memory (the next panel's first after the last) is fetched a share per row block. */
        const int64_t rows = end - begin, chunk_lines = K_CHUNK * PANEL / LINE_FLOATS;
        const int64_t num_tiles = rows / TILE_ROWS + (rows % TILE_ROWS != 0);
        const int64_t share = (chunk_lines + num_tiles - 1) / num_tiles;
        for (int64_t k0 = 0; k0 < K; k0 += K_CHUNK) {
            const int64_t chunk = K - k0 < K_CHUNK ? K - k0 : K_CHUNK;
            const float *panel = panels + (p * K + k0) * PANEL;
            const float *next = panel + chunk * PANEL;
            const int64_t per_k = (share + chunk - 1) / chunk;
            const int first = k0 == 0;
#define TILE(n) tile##n(x + m * K + k0, K, panel, chunk, acc + (m - begin) * PANEL, first, next, per_k)
#define TILE_FULL_(n) TILE(n) /* TILE_ROWS expanded first */
#define TILE_FULL TILE_FULL_(TILE_ROWS)
            int64_t m = begin;
            for (; m + TILE_ROWS <= end; m += TILE_ROWS, next += share * LINE_FLOATS) TILE_FULL;
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
            for (int64_t j = 0; j < width; ++j) out[j] = bias ? row[j] + bias[n0 + j] : row[j];
        }
    }
}
