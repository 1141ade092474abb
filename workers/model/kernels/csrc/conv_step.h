/* The causal depthwise conv of Mamba2 and Gated DeltaNet mixers, a block of channels at a time: shared by their
 * decode steps, speculative verification and keep, so that all of them compute alike and agree bit for bit. */
#ifndef HYBRIDGEN_CONV_STEP_H
#define HYBRIDGEN_CONV_STEP_H

#include <stdint.h>

#define CONV_BLOCK 64 /* channels per call: every caller splits a row's channels into the same blocks */

/* Causal conv outputs of `count` tokens for `channels` consecutive channels, each continuing its window [W-1]:
 * token t's input of channel c is in[t · stride + c], its output goes to out[t · out_stride + c]; the windows then
 * hold the last W-1 inputs if `advance`, else they are left as they were. The decode step calls this with one
 * token: every caller adds in the same order, in scalar code without reductions a compiler may reorder, so it can
 * be inlined (and specialised) wherever it is called. */
static inline void conv_block_steps(float *window, const float *w, const float *bias, const float *in, int64_t stride,
                                    float *out, int64_t out_stride, int64_t count, int64_t channels, int64_t W,
                                    int advance) {
    float local[W > 1 ? W - 1 : 1];
    for (int64_t c = 0; c < channels; ++c) {
        float *win = window + c * (W - 1);
        const float *wc = w + c * W;
        if (!advance) {
            for (int64_t k = 0; k < W - 1; ++k) local[k] = win[k];
            win = local;
        }
        for (int64_t t = 0; t < count; ++t) {
            const float input = in[t * stride + c];
            float acc = bias ? bias[c] : 0.0f;
            for (int64_t k = 0; k < W - 1; ++k) acc += win[k] * wc[k];
            acc += input * wc[W - 1];
            for (int64_t k = 0; k + 1 < W - 1; ++k) win[k] = win[k + 1];
            if (W > 1) win[W - 2] = input;
            out[t * out_stride + c] = acc;
        }
    }
}

/* The conv of b rows, as an orphaned `omp for` over rows × channel blocks (call it inside a parallel region): row
 * r's channel inputs start at in + r · in_row and its outputs at out + r · Cd (tokens stride / out_stride apart),
 * its windows at window + r · Cd · (W-1); counts[r] tokens per row, or `count` for every row when counts is NULL. */
static inline void conv_rows(float *window, const float *w, const float *bias, const float *in, int64_t in_row,
                             int64_t stride, float *out, int64_t out_stride, int64_t count, const int64_t *counts,
                             int64_t b, int64_t Cd, int64_t W, int advance) {
    const int64_t blocks = (Cd + CONV_BLOCK - 1) / CONV_BLOCK;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < b * blocks; ++item) {
        const int64_t r = item / blocks, c = item % blocks * CONV_BLOCK;
        conv_block_steps(window + (r * Cd + c) * (W - 1), w + c * W, bias ? bias + c : NULL, in + r * in_row + c,
                         stride, out + r * Cd + c, out_stride, counts ? counts[r] : count,
                         Cd - c < CONV_BLOCK ? Cd - c : CONV_BLOCK, W, advance);
    }
}

#endif
