/* The vector width and register tile of this build's instruction set, for the linear kernels' column panels.
 *
 * native.py compiles this library once per instruction-set variant (`-march` picks it; see `native.ISA_FLAGS`),
 * and each variant sizes its register tile to its registers:
 *   avx512    16 lanes, 8 rows × 3 vectors = 24 accumulators of 32 zmm registers;
 *   avx2      8 lanes,  4 rows × 3 vectors = 12 accumulators of 16 ymm registers (8 rows spilled on every k step);
 *   neon      4 lanes,  8 rows × 3 vectors = 24 accumulators of 32 q registers;
 *   portable  4 lanes,  4 rows × 3 vectors = 12 accumulators of 16 xmm registers (SSE), or what the target has.
 * A panel is PANEL = 3 · LANES output columns wide; `linear_panel_width()` tells the packing code. Each output
 * column still sums over k in order, one multiply-add per k, whatever the width: a product's value does not depend on
 * the variant where the variants fuse multiply-adds alike (avx512 and avx2 do; the SSE build has no FMA).
 */
#ifndef HYBRIDGEN_SIMD_H
#define HYBRIDGEN_SIMD_H

#if defined(__AVX512F__)
#define LANES 16
#define TILE_ROWS 8
#define KERNEL_ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
#define TILE_ROWS 4
#define KERNEL_ISA "avx2"
#elif defined(__ARM_NEON) || defined(__aarch64__)
#define LANES 4
#define TILE_ROWS 8
#define KERNEL_ISA "neon"
#else
#define LANES 4
#define TILE_ROWS 4
#define KERNEL_ISA "portable"
#endif

#define PANEL (3 * LANES)

/* Keep three vectors in registers: without it gcc folds the panel row's loads into every multiply-add on AVX2
 * (12 loads per k step where 3 do; the register tile then ran load-bound). */
#if defined(__x86_64__) && defined(__AVX__)
#define IN_REGISTERS(a, b, c) __asm__("" : "+x"(a), "+x"(b), "+x"(c))
#elif defined(__aarch64__)
#define IN_REGISTERS(a, b, c) __asm__("" : "+w"(a), "+w"(b), "+w"(c))
#else
#define IN_REGISTERS(a, b, c)
#endif

#endif
