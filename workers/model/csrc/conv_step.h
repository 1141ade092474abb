/* The causal depthwise conv of Mamba2 and Gated DeltaNet mixers, one channel at a time: shared by their decode
 * steps, speculative verification and keep, so that all of them add in one order and agree bit for bit. */
#ifndef HYBRIDGEN_CONV_STEP_H
#define HYBRIDGEN_CONV_STEP_H

#include <stdint.h>

/* Causal conv outputs of `count` tokens for one channel, continuing its window [W-1]: token t's input is
 * in[t · stride], its output goes to out[t · out_stride]; the window then holds the last W-1 inputs if `advance`,
 * else it is left as it was. The decode step calls this with one token, so every caller adds in the same order. */
static __attribute__((noinline, noclone)) void conv_channel_steps(float *window, const float *w, const float *bias, const float *in,
                                      int64_t stride, float *out, int64_t out_stride, int64_t count, int64_t W,
                                      int advance) {
    float local[W > 1 ? W - 1 : 1];
    for (int64_t k = 0; k < W - 1; ++k) local[k] = window[k];
    for (int64_t t = 0; t < count; ++t) {
        const float input = in[t * stride];
        float acc = bias ? bias[0] : 0.0f;
        for (int64_t k = 0; k < W - 1; ++k) acc += local[k] * w[k];
        acc += input * w[W - 1];
        for (int64_t k = 0; k + 1 < W - 1; ++k) local[k] = local[k + 1];
        if (W > 1) local[W - 2] = input;
        out[t * out_stride] = acc;
    }
    if (advance)
        for (int64_t k = 0; k < W - 1; ++k) window[k] = local[k];
}

#endif
