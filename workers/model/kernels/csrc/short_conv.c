/* LFM2's gated short convolution on CPU, float32: everything between in_proj and out_proj, for a decode step, a
 * speculative verification and the keep after it.
 *
 * layers/short_conv.py's PyTorch path is the reference. Shapes (contiguous, row-major), d the model width:
 *   proj    [rows, 3·d]    in_proj output: B | C | x
 *   window  [b, d, W-1]    the last W-1 conv inputs u = B · x of each row (its only state)
 *   conv_w  [d, W]         depthwise taps; conv_b [d] or NULL
 *   u       [rows, d]      scratch: the conv inputs
 *   out     [rows, d]      the out_proj input: C · conv(u)
 * Rows are token-major for l tokens: token t of row r is row t · b + r. The conv is conv_step.h's (shared with
 * Mamba2 and Gated DeltaNet, no activation here); u and the output gate are single products, so the decode step,
 * the verification and the keep compute every value alike, bit for bit.
 */
#include <stddef.h>
#include <stdint.h>

#include "conv_step.h"
#include "kernels.h"

/* u[r] = B[r] · x[r] for `rows` in_proj rows (or only the first accepted[r % b] tokens' rows when accepted is
 * given), as an orphaned `omp for` (call it inside a parallel region). */
static void gated_inputs(const float *proj, float *u, int64_t rows, int64_t b, const int64_t *accepted, int64_t d) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        if (accepted && r / b >= accepted[r % b]) continue;
        const float *p = proj + r * 3 * d;
        for (int64_t c = 0; c < d; ++c) u[r * d + c] = p[c] * p[2 * d + c];
    }
}

/* out[r] ← C[r] · out[r] over `rows` rows (an orphaned `omp for`). */
static void output_gate(const float *proj, float *out, int64_t rows, int64_t d) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float *gate = proj + r * 3 * d + d;
        for (int64_t c = 0; c < d; ++c) out[r * d + c] *= gate[c];
    }
}

/* l tokens per row through the gates and the conv, continuing the windows: advanced in place when `advance`, else
 * read and left as they are. proj [l, b, 3d] → out [l, b, d]; u [l, b, d] scratch. */
static void gated_conv(const float *proj, float *window, const float *conv_w, const float *conv_b, float *u,
                       float *out, int64_t b, int64_t l, int64_t d, int64_t W, int advance, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (l * b * d > 16384)
    {
        gated_inputs(proj, u, l * b, b, NULL, d);
        conv_rows(window, conv_w, conv_b, u, d, b * d, out, b * d, l, NULL, b, d, W, advance);
        output_gate(proj, out, l * b, d);
    }
}

void short_conv_step(const float *proj, float *window, const float *conv_w, const float *conv_b, float *u,
                     float *out, int64_t b, int64_t d, int64_t W, int num_threads) {
    gated_conv(proj, window, conv_w, conv_b, u, out, b, 1, d, W, 1, num_threads);
}

/* Speculative verification: l tokens per row from the windows, which are left as they are (short_conv_keep
 * advances them once the accepted counts are known). Token t's output is what t + 1 decode steps give it. */
void short_conv_verify(const float *proj, const float *window, const float *conv_w, const float *conv_b, float *u,
                       float *out, int64_t b, int64_t l, int64_t d, int64_t W, int num_threads) {
    gated_conv(proj, (float *)window, conv_w, conv_b, u, out, b, l, d, W, 0, num_threads);
}

/* After short_conv_verify: row r's window advances, in place, by its first accepted[r] tokens of proj [l, b, 3d]
 * (1 ≤ accepted[r] ≤ l): the window after input accepted[r] − 1. u [l, b, d] is scratch (the conv's outputs,
 * which nothing reads, overwrite it). */
void short_conv_keep(const float *proj, float *window, const float *conv_w, const float *conv_b, float *u,
                     const int64_t *accepted, int64_t b, int64_t l, int64_t d, int64_t W, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (l * b * d > 16384)
    {
        gated_inputs(proj, u, l * b, b, accepted, d);
        conv_rows(window, conv_w, conv_b, u, d, b * d, u, b * d, 0, accepted, b, d, W, 1);
    }
}

/* Prompts (or the next chunk of them): proj [b, l, 3d] batch-major, right-padded (row r has num_tokens[r] valid
 * tokens), continuing initial [b, d, W-1] (zeros where NULL), conv_wt [W, d] the taps transposed (a tap's weights
 * side by side over the channels) → out [b, l, d] = C · conv(u) for every position (padding too: the module path
 * ignores it there), u [b, l, d] the conv inputs B · x, and window [b, d, W-1] after each row's last valid token.
 * Each output runs over the channels in vector lanes, one tap at a time: no per-token loop in Python, and no
 * [b, d, W-1+l] copy as F.conv1d's causal form needs. */
void short_conv_prefill(const float *proj, const int64_t *num_tokens, const float *conv_wt, const float *conv_b,
                        const float *initial, float *u, float *out, float *window, int64_t b, int64_t l, int64_t d,
                        int64_t W, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    {
        gated_inputs(proj, u, b * l, b * l, NULL, d); /* rows are batch-major here: [b · l, 3d] */
#pragma omp for schedule(static)
        for (int64_t bt = 0; bt < b * l; ++bt) {
            const int64_t bi = bt / l, t = bt % l;
            const float *start = initial ? initial + bi * d * (W - 1) : NULL, *gate = proj + bt * 3 * d + d;
            float *o = out + bt * d;
            for (int64_t c = 0; c < d; ++c) o[c] = conv_b ? conv_b[c] : 0.0f;
            for (int64_t k = 0; k < W; ++k) {
                const int64_t src = t - (W - 1) + k; /* < 0: entry W-1+src of the initial window */
                const float *w = conv_wt + k * d;
                if (src >= 0) {
                    const float *in = u + (bi * l + src) * d;
#pragma omp simd
                    for (int64_t c = 0; c < d; ++c) o[c] += in[c] * w[c];
                } else if (start) {
                    for (int64_t c = 0; c < d; ++c) o[c] += start[c * (W - 1) + W - 1 + src] * w[c];
                }
            }
#pragma omp simd
            for (int64_t c = 0; c < d; ++c) o[c] *= gate[c];
        }
#pragma omp for schedule(static)
        for (int64_t bc = 0; bc < b * d; ++bc) {
            const int64_t bi = bc / d, c = bc % d, n = num_tokens[bi];
            const float *start = initial ? initial + bc * (W - 1) : NULL;
            for (int64_t k = 0; k < W - 1; ++k) {
                const int64_t src = n - (W - 1) + k;
                window[bc * (W - 1) + k] = src >= 0 ? u[(bi * l + src) * d + c] : (start ? start[W - 1 + src] : 0.0f);
            }
        }
    }
}
